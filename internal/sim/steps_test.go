package sim

import (
	"context"
	"encoding/json"
	"flag"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// manual is a step model driven by the test, step by step, in model time (no goroutine, no
// sleeping: nothing here reads a wall clock).
func manual(p Perf) *stepper {
	return &stepper{p: p, work: make(chan struct{}, 1), wake: make(chan struct{}), stop: make(chan struct{})}
}

// add queues a request computing compute prompt tokens (cached more already held) that
// produces want tokens, traced.
func (s *stepper) add(compute, cached, want int) *seq {
	q := &seq{pending: compute, held: cached, want: want, trace: []time.Duration{}}
	s.wait = append(s.wait, q)
	return q
}

// run steps until every request produced what it wants, at most limit steps.
func (s *stepper) runAll(t *testing.T, limit int) {
	t.Helper()
	for range limit {
		batch, d := s.next()
		if len(batch) == 0 {
			return
		}
		s.apply(batch, d)
		for _, q := range append(append([]*seq{}, s.run...), s.wait...) {
			if q.want >= 0 && q.produced >= q.want {
				s.end(q)
			}
		}
		if s.used > s.p.KVBlocks || s.used < 0 {
			t.Fatalf("KV blocks in use %d, capacity %d", s.used, s.p.KVBlocks)
		}
	}
	t.Fatalf("not done after %d steps: %d running, %d waiting", limit, len(s.run), len(s.wait))
}

// gaps are the intervals between a request's tokens.
func gaps(q *seq) []time.Duration {
	var out []time.Duration
	for i := 1; i < len(q.trace); i++ {
		out = append(out, q.trace[i]-q.trace[i-1])
	}
	return out
}

// A prefill-heavy step slows every decode beside it: a decoding request's tokens come one
// weight-read apart alone, and a chunk of a long prompt's compute apart while that prompt is
// prefilled in chunks beside it; the prompt takes ceil(prompt / budget) steps.
func TestStepModelPrefillSlowsTheDecodesBesideIt(t *testing.T) {
	p := DefaultPerf()
	alone := manual(p)
	d := alone.add(100, 0, 40)
	alone.runAll(t, 1000)
	quiet := gaps(d)
	want := p.stepTime(1, 101)
	if quiet[5] < want-time.Microsecond || quiet[5] > want+time.Microsecond {
		t.Errorf("a lone decode's token gap %v, the model says %v", quiet[5], want)
	}

	busy := manual(p)
	d = busy.add(100, 0, 40)
	for range 3 { // let it decode a little first
		busy.apply(busy.next())
	}
	long := busy.add(3*p.MaxBatchedTokens, 0, 1)
	busy.runAll(t, 1000)
	loud := gaps(d)
	slowest := time.Duration(0)
	for _, g := range loud {
		slowest = max(slowest, g)
	}
	chunk := p.stepTime(p.MaxBatchedTokens, 0)
	if slowest < chunk/2 || slowest < 20*quiet[5] {
		t.Errorf("a decode beside a long prefill: slowest gap %v, alone %v; a full chunk's step is %v", slowest, quiet[5], chunk)
	}
	if len(long.trace) != 1 || long.trace[0] < 3*p.stepTime(p.MaxBatchedTokens-1, 0) {
		t.Errorf("the long prompt's token came at %v; its 3 chunks take at least %v", long.trace, 3*p.stepTime(p.MaxBatchedTokens-1, 0))
	}
	if d.produced != 40 {
		t.Errorf("the decode produced %d of 40 tokens", d.produced)
	}
}

// Throughput grows with the batch until the step turns compute-bound, then flattens; offered
// load past it makes the queue grow step after step, load below it does not.
func TestStepModelSaturatesAndQueuesGrowPastIt(t *testing.T) {
	p := DefaultPerf()
	rate := func(n int) float64 { // decode tokens per model second with n requests decoding
		s := manual(p)
		for range n {
			s.add(1, 500, 200)
		}
		s.runAll(t, 10_000)
		return float64(n*200) / s.clock.Seconds()
	}
	r1, r8, r256, r1024 := rate(1), rate(8), rate(256), rate(1024)
	if r8 < 6*r1 {
		t.Errorf("8 decodes give %.0f tokens/s, one %.0f: a memory-bound step should share its weight read", r8, r1)
	}
	if r1024 > 1.5*r256 {
		t.Errorf("1024 decodes give %.0f tokens/s, 256 %.0f: a compute-bound step cannot keep growing", r1024, r256)
	}
	if r1024 > 1/p.ComputePerToken.Seconds() {
		t.Errorf("%.0f tokens/s is past the compute bound %.0f", r1024, 1/p.ComputePerToken.Seconds())
	}

	// Requests of 1,000 prompt and 100 output tokens: capacity is about one per
	// (1000+100) × 29.5 µs ≈ 32 ms of compute. Offer one per 20 ms and one per 100 ms of model
	// time, for 60 model seconds.
	inEngine := func(every time.Duration) (first, last int) {
		s := manual(p)
		next := time.Duration(0)
		for s.clock < 60*time.Second {
			for next <= s.clock {
				s.add(1000, 0, 100)
				next += every
			}
			batch, d := s.next()
			if len(batch) == 0 {
				s.clock = next // idle until the next arrival
				continue
			}
			s.apply(batch, d)
			for _, q := range append([]*seq{}, s.run...) {
				if q.produced >= q.want {
					s.end(q)
				}
			}
			if first == 0 && s.clock >= 20*time.Second {
				first = len(s.wait) + len(s.run)
			}
		}
		return first, len(s.wait) + len(s.run)
	}
	if f, l := inEngine(20 * time.Millisecond); l < f+500 {
		t.Errorf("offered past capacity, the requests in the engine went %d → %d over 40 s: the queue must grow", f, l)
	}
	if f, l := inEngine(100 * time.Millisecond); l > f+20 || l > 50 {
		t.Errorf("offered below capacity, the requests in the engine went %d → %d", f, l)
	}
}

// A full KV cache preempts the latest-admitted request, which computes its context again and
// still finishes; the blocks in use never pass the capacity (runAll checks every step).
func TestStepModelPreemptsWhenTheKVCacheIsFull(t *testing.T) {
	p := DefaultPerf()
	p.KVBlocks = 200 // 3,200 tokens
	s := manual(p)
	var qs []*seq
	for range 8 {
		qs = append(qs, s.add(200, 0, 300)) // 8 × 500 tokens at the end > 3,200
	}
	s.runAll(t, 100_000)
	if s.preempted == 0 {
		t.Error("no request was preempted though their contexts outgrew the KV cache")
	}
	for i, q := range qs {
		if q.produced != 300 {
			t.Errorf("request %d produced %d of 300 tokens", i, q.produced)
		}
	}
	if s.used != 0 {
		t.Errorf("%d blocks held after every request ended", s.used)
	}
	// A prompt larger than the whole cache is refused, not queued forever.
	live := newStepper(p)
	defer live.close()
	if _, err := live.prefill(context.Background(), nil, 4000, 0); err == nil || !strings.Contains(err.Error(), "400") {
		t.Errorf("a prompt past the KV capacity: %v", err)
	}
}

// An engine with the step model serves requests through it: its answers are the simple mode's,
// its metrics count the scheduler's running requests and KV blocks, and a long prompt's
// prefill shows in the engine's answer time against a short one's.
func TestStepModelEngine(t *testing.T) {
	p := DefaultPerf()
	p.ComputePerToken = 2 * time.Microsecond // fast enough for a test
	p.WeightRead = 100 * time.Microsecond
	p.StepOverhead = 0
	steps := start(t, Config{Engine: EngineVLLM, Steps: &p})
	plain := start(t, Config{Engine: EngineVLLM})
	body := `{"model":"sim-model","prompt":"hello there","max_tokens":12,"ignore_eos":true}`
	a, b := completionText(t, steps.URL(), body), completionText(t, plain.URL(), body)
	if a != b || a == "" {
		t.Errorf("the step model answered %q, the simple mode %q", a, b)
	}
	// A stream's tokens come through the model too.
	resp, err := http.Post(steps.URL()+"/v1/completions", "application/json", strings.NewReader(strings.Replace(body, `"ignore_eos":true`, `"ignore_eos":true,"stream":true`, 1)))
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if n := strings.Count(string(raw), `"finish_reason":null`); n != 12 || !strings.Contains(string(raw), "[DONE]") {
		t.Errorf("a stream through the step model: %d tokens\n%s", n, raw)
	}
	if got := steps.Stats().TokensGenerated; got != 24 {
		t.Errorf("%d tokens counted, 24 generated", got)
	}
	if s := steps.steps; s.steps == 0 {
		t.Error("the step model ran no step")
	}
	r, w, u := steps.steps.counts()
	if r != 0 || w != 0 || u != 0 {
		t.Errorf("after the requests: %d running, %d waiting, %.2f of the KV cache in use", r, w, u)
	}
}

func completionText(t *testing.T, base, body string) string {
	t.Helper()
	resp, err := http.Post(base+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v struct {
		Choices []struct{ Text string }
	}
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil || resp.StatusCode != 200 || len(v.Choices) != 1 {
		t.Fatalf("status %d: %v %+v", resp.StatusCode, err, v)
	}
	return v.Choices[0].Text
}

// The step model's flags build the model; without --step-model the engine keeps per-token costs.
func TestStepModelFlags(t *testing.T) {
	c, err := ParseFlags(flag.NewFlagSet("sim", flag.ContinueOnError), []string{"--step-model", "--max-num-batched-tokens", "2048", "--kv-blocks", "100"})
	if err != nil || c.Steps == nil || c.Steps.MaxBatchedTokens != 2048 || c.Steps.KVBlocks != 100 || c.Steps.MaxSeqs != 1024 {
		t.Fatalf("%v %+v", err, c.Steps)
	}
	if c, err := ParseFlags(flag.NewFlagSet("sim", flag.ContinueOnError), nil); err != nil || c.Steps != nil {
		t.Fatalf("%v %+v", err, c.Steps)
	}
	if _, err := ParseFlags(flag.NewFlagSet("sim", flag.ContinueOnError), []string{"--step-model", "--kv-blocks", "0"}); err == nil {
		t.Error("a step model without KV blocks was taken")
	}
}

// Replay runs the step model in model time over offered arrivals: a long prompt's step holds
// the short ones that arrive during it, which then share one step; one arriving to an idle
// engine is served at once.
func TestReplay(t *testing.T) {
	p := DefaultPerf()
	ms := time.Millisecond
	off := []Offered{{At: 0, Compute: 4000, Want: 1}, {At: 10 * ms, Compute: 100, Cached: 4000, Want: 1},
		{At: 11 * ms, Compute: 100, Cached: 4000, Want: 3}, {At: 300 * ms, Compute: 100, Cached: 4000, Want: 1}}
	first, last, err := Replay(p, off)
	if err != nil {
		t.Fatal(err)
	}
	long, pair := p.stepTime(4000, 0), p.stepTime(200, 0)
	decode := p.stepTime(1, 4100) + p.stepTime(1, 4101) // the third request's two tokens after the pair's step, alone
	want := [][2]time.Duration{{long, long}, {long + pair - 10*ms, long + pair - 10*ms}, {long + pair - 11*ms, long + pair + decode - 11*ms}, {p.stepTime(100, 0), p.stepTime(100, 0)}}
	for i, w := range want {
		if first[i] != w[0] || last[i] != w[1] {
			t.Errorf("request %d: first %v last %v, want %v %v", i, first[i], last[i], w[0], w[1])
		}
	}
	if _, _, err := Replay(p, []Offered{{Compute: p.KVBlocks*p.BlockSize + 1}}); err == nil {
		t.Error("a request larger than the KV cache was replayed")
	}
}
