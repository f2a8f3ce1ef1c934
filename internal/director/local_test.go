package director

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/advisor"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/worker"
)

// The mirror case picks an idle vLLM prefill only, only for a decode past the TPOT SLO at the
// batch it holds, and only once fitted.
func TestServeWholeOnlyAnIdleVLLMPrefill(t *testing.T) {
	r := NewLocalRule(0, false, nil)
	r.Whole, r.TPOTSLO = true, 50*time.Millisecond
	dec := worker.New(config.Worker{URL: "http://d:1", Role: config.RoleDecode, Runtime: config.RuntimeVLLM})
	sgl := worker.New(config.Worker{URL: "http://s:1", Role: config.RolePrefill, Runtime: config.RuntimeSGLang})
	busy := worker.New(config.Worker{URL: "http://b:1", Role: config.RolePrefill, Runtime: config.RuntimeVLLM})
	idle := worker.New(config.Worker{URL: "http://i:1", Role: config.RolePrefill, Runtime: config.RuntimeVLLM})
	busy.Enter()
	req := &policy.Request{Model: "m"}
	all := []*worker.Worker{sgl, busy, idle}
	if w := r.ServeWhole(context.Background(), dec, req, all); w != nil {
		t.Errorf("unfitted: served whole on %s", w.URL)
	}
	r.fit.Store(&localFit{step: 0.060, perRequest: 0.005}) // 60 ms a token alone: past the SLO idle
	if w := r.ServeWhole(context.Background(), dec, req, all); w != nil {
		t.Errorf("an idle decode slower than the SLO alone: served whole on %s (as slow there)", w.URL)
	}
	probe := dec.Enter()
	if w := r.ServeWhole(context.Background(), dec, req, all); w != nil {
		t.Errorf("a decode with one request, whose pace alone is past the SLO: served whole on %s (as slow there)", w.URL)
	}
	dec.Leave(probe)
	r.fit.Store(&localFit{step: 0.030, perRequest: 0.005}) // 30 ms + 5 ms per request decoding
	for range 3 {
		dec.Enter() // 30 + 5 × 4 = 50 ms: at the SLO, not past it
	}
	if w := r.ServeWhole(context.Background(), dec, req, all); w != nil {
		t.Errorf("a decode at its SLO: served whole on %s", w.URL)
	}
	dec.Enter() // 55 ms
	if w := r.ServeWhole(context.Background(), dec, req, all); w != idle {
		t.Errorf("a saturated decode: %v, want the idle vLLM prefill", w)
	}
	if w := r.ServeWhole(context.Background(), dec, req, []*worker.Worker{sgl, busy}); w != nil {
		t.Errorf("no idle vLLM prefill: served whole on %s", w.URL)
	}
	r.Whole = false
	if w := r.ServeWhole(context.Background(), dec, req, all); w != nil {
		t.Errorf("off: served whole on %s", w.URL)
	}
}

// The busy-prefill rule moves a prompt to its decode only when every prefill is queued deeper
// than the decode would take, and only one whose compute keeps the decode's other requests
// within the TPOT SLO, on a decode within it at its batch: a long document off a queued prefill
// stays split.
func TestBusyPrefillRuleKeepsTheDecodeWithinTPOT(t *testing.T) {
	tokens := map[string]int{"short": 100, "long": 2000}
	r := NewLocalRule(1, false, func(_, _ string, body []byte) (int, bool) { return tokens[string(body)], true })
	r.TPOTSLO = 50 * time.Millisecond
	dec := worker.New(config.Worker{URL: "http://d:1", Role: config.RoleDecode, Runtime: config.RuntimeVLLM})
	pf := worker.New(config.Worker{URL: "http://p:1", Role: config.RolePrefill, Runtime: config.RuntimeVLLM})
	decide := func(prompt string) bool {
		return r.Decide(context.Background(), dec, -1, &policy.Request{Model: "m", Body: []byte(prompt)}, []*worker.Worker{pf})
	}
	// 10,000 tokens/s of prefill, 100 ms of work per request in flight, a 10 ms decode step
	// + 1 ms per request decoding.
	r.fit.Store(&localFit{perToken: 1e-4, splitWork: 0.1, step: 0.010, perRequest: 0.001})
	if decide("short") {
		t.Error("an idle prefill: the short prompt went to the decode")
	}
	for range 5 {
		pf.Enter() // 500 ms of work ahead
	}
	if !decide("short") {
		t.Error("a queued prefill: the short prompt (10 ms on the decode) stayed split")
	}
	if decide("long") {
		t.Error("a queued prefill: the long prompt (200 ms on the decode, past the 50 ms TPOT SLO) went to the decode")
	}
	for range 45 {
		dec.Enter() // 10 + 46 ms a token: past the SLO already
	}
	if decide("short") {
		t.Error("a decode past its TPOT SLO took the short prompt")
	}
}

// A prompt of token ids is measured by its ids, not its bytes: 80 five-digit ids are 80 tokens
// (under a threshold of 100), though their 480 bytes would be taken for 120.
func TestLocalRuleCountsTokenIDs(t *testing.T) {
	r := NewLocalRule(100, false, nil)
	dec := worker.New(config.Worker{URL: "http://d:1", Role: config.RoleDecode, Runtime: config.RuntimeVLLM})
	decide := func(prompt string) bool {
		t.Helper()
		body := `{"model":"m","prompt":` + prompt + `}`
		return r.Decide(context.Background(), dec, -1, &policy.Request{Model: "m", Path: "/v1/completions", Body: []byte(body), Parsed: parsed(t, body)}, nil)
	}
	// A chat request's "prompt" is not its prompt (an engine ignores it): a stray short one
	// beside long messages does not make the request short.
	chat := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("words ", 100) + `"}],"prompt":[1]}`
	if r.Decide(context.Background(), dec, -1, &policy.Request{Model: "m", Path: "/v1/chat/completions", Body: []byte(chat), Parsed: parsed(t, chat)}, nil) {
		t.Error(`a chat request of ~150 tokens with a stray "prompt":[1]: served alone`)
	}
	ids := "[" + strings.TrimSuffix(strings.Repeat("12345,", 80), ",") + "]"
	if !decide(ids) {
		t.Error("80 token ids, under the threshold of 100: split")
	}
	if decide("[" + ids + ",[" + strings.TrimSuffix(strings.Repeat("7,", 40), ",") + "]]") {
		t.Error("a batch of 80 + 40 token ids, over the threshold of 100: served alone")
	}
	if decide(`"` + strings.Repeat("words ", 80) + `"`) {
		t.Error("a text prompt of 480 bytes (~120 tokens), over the threshold: served alone")
	}
	for raw, want := range map[string]int{"[]": 0, "[1]": 1, "[[1, 2],\n[3]]": 3} {
		if n, ok := tokenIDs([]byte(raw)); !ok || n != want {
			t.Errorf("tokenIDs(%q) = %d %v, want %d", raw, n, ok, want)
		}
	}
	for _, raw := range []string{`"text"`, `["a", "b"]`, `[1.5]`, `[-1]`, ``} {
		if _, ok := tokenIDs([]byte(raw)); ok {
			t.Errorf("tokenIDs(%q) counted ids", raw)
		}
	}
}

// The fleet's advice (what every /metrics scrape and status refresh shows) is made once per
// AdviceTTL, however often it is asked for; a what-if is answered fresh.
func TestFleetAdviceReusedWithinItsTTL(t *testing.T) {
	adv := &advisor.Advisor{}
	f := newFleet(t, []*worker.Worker{worker.New(config.Worker{URL: "http://d:1", Role: config.RoleDecode})}, func(o *Options) {
		o.PD, o.Advisor, o.AdviceSLO = true, adv, advisor.SLO{TTFT: time.Second, TPOT: 100 * time.Millisecond}
	})
	observe := func() {
		adv.Observe(advisor.Sample{At: time.Now(), Split: true, Prompt: 100, Uncached: 100, Output: 10, PrefillTime: 10 * time.Millisecond})
	}
	observe()
	first := f.d.Advice(0, 0, 0)
	observe()
	if again := f.d.Advice(0, 0, 0); again.Fit.Requests != first.Fit.Requests {
		t.Errorf("the fleet's advice made again within its TTL: %d requests, then %d", first.Fit.Requests, again.Fit.Requests)
	}
	if what := f.d.Advice(4, 0, 0); what.Fit.Requests != first.Fit.Requests+1 {
		t.Errorf("a what-if answered from %d requests, want %d", what.Fit.Requests, first.Fit.Requests+1)
	}
}

// A prompt no cached count sizes is not taken for its bytes / 4: 980 tokens of short words on
// /v1/responses (1,960 bytes, 490 by the old guess) stay split under a 512 threshold, counted by
// the chosen decode; a prompt whose bytes are under the threshold goes to its decode without an
// ask; with no engine to count, its bytes decide.
func TestLocalRuleSizesUncountedPromptsConservatively(t *testing.T) {
	dec := worker.New(config.Worker{URL: "http://d:1", Role: config.RoleDecode, Runtime: config.RuntimeVLLM})
	pf := worker.New(config.Worker{URL: "http://p:1", Role: config.RolePrefill, Runtime: config.RuntimeVLLM})
	long := `{"model":"m","input":"` + strings.TrimSpace(strings.Repeat("w ", 980)) + `"}`
	short := `{"model":"m","input":"` + strings.TrimSpace(strings.Repeat("w ", 100)) + `"}`
	asked := 0
	r := NewLocalRule(512, false, func(string, string, []byte) (int, bool) { return 0, false })
	r.CountPrompt = func(_ context.Context, url, _, path string, body []byte) (int, bool) {
		asked++
		if url != dec.URL || path != "/v1/responses" {
			t.Errorf("asked %s for %s, want the chosen decode for /v1/responses", url, path)
		}
		return strings.Count(string(body), "w"), true
	}
	decide := func(body string) bool {
		return r.Decide(context.Background(), dec, 0, &policy.Request{Model: "m", Path: "/v1/responses", Body: []byte(body)}, []*worker.Worker{pf})
	}
	if decide(long) {
		t.Errorf("980 tokens under a 512 threshold were served by the decode alone")
	}
	if asked != 1 {
		t.Errorf("the decode was asked %d times for the long prompt's count, want 1", asked)
	}
	if !decide(short) || asked != 1 {
		t.Errorf("a 100-token prompt of 199 bytes: not served alone, or counted (%d asks)", asked)
	}
	r.CountPrompt = nil
	if decide(long) {
		t.Errorf("no engine to count: 1,960 bytes were taken for fewer than 512 tokens")
	}
}
