package app

import (
	"bytes"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// Issue 24, item 3: Baton's readers disagreed on a repeated top-level key (the request parser
// kept the last, the field reader the first) and the engines' JSON keeps the last: a short
// "prompt" first and a batch second passed --max-batch-size and reached the engine as the batch.
// A repeated top-level key is refused, however it is spelled.
func TestDuplicateTopLevelKeysAreRefused(t *testing.T) {
	t.Parallel()
	e := simEngine(t, sim.Config{Engine: sim.EngineSGLang})
	cfg := testConfig(e.URL())
	cfg.MaxBatchSize = 4
	_, gw := startGateway(t, cfg)
	for _, tc := range []struct{ route, body, key string }{
		{"/v1/completions", `{"model":"m","prompt":"x","prompt":["a","b","c","d","e"],"max_tokens":1}`, "prompt"},
		{"/generate", `{"text":"a","text":["a","b","c","d","e"],"sampling_params":{"max_new_tokens":1}}`, "text"},
		{"/v1/chat/completions", `{"model":"m","messages":[],"mod\u0065l":"other"}`, "model"},
		{"/v1/completions", `{"model":"m","prompt":"x","n":1,"n":9}`, "n"},
	} {
		env := wantEnvelope(t, post(t, gw.URL+tc.route, tc.body), 400, "duplicate_key")
		if env.Error.Param == nil || *env.Error.Param != tc.key || !strings.Contains(env.Error.Message, tc.key) {
			t.Errorf("%s: the answer does not name %q: %+v", tc.body, tc.key, env)
		}
	}
	if resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", `{"model":"m","prompt":["a","b"],"max_tokens":1,"x":{"prompt":1,"prompt":2}}`); resp.StatusCode != 200 {
		t.Errorf("a repeated key inside a nested object is the engine's business: %d %s", resp.StatusCode, body)
	}
}

// Issue 24, item 1: the mode a PD request is labelled with and the executor that serves it
// came from two rules: a pair whose prefill Baton cannot identify (generic) ran the parallel
// bootstrap executor while its metrics said pd_vllm. One rule (pd.Mode) decides both.
func TestGenericPairIsLabelledByItsExecutor(t *testing.T) {
	t.Parallel()
	var sawRoom atomic.Bool
	engine := func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet { // neither vLLM's /version nor SGLang's /server_info: generic
			http.NotFound(w, r)
			return
		}
		body, _ := io.ReadAll(r.Body)
		if strings.Contains(string(body), `"bootstrap_room"`) {
			sawRoom.Store(true) // the parallel executor's rendezvous
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"x"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
	}
	prefill, decode := fakeEngine(t, "acme", []string{"m"}, engine), fakeEngine(t, "acme", []string{"m"}, engine)
	cfg := testConfig()
	cfg.PDDisaggregation = true
	cfg.Workers = []config.Worker{{URL: prefill.URL, Role: config.RolePrefill}, {URL: decode.URL, Role: config.RoleDecode}}
	g, gw := startGateway(t, cfg)
	if resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":1}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if !sawRoom.Load() {
		t.Fatal("the generic pair was not served by the bootstrap executor")
	}
	modes := map[string]bool{}
	mfs, err := g.Metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "baton_ttft_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "mode" {
					modes[l.GetValue()] = true
				}
			}
		}
	}
	if !modes[string(pd.ModeParallel)] || modes[string(pd.ModeSequential)] {
		t.Errorf("TTFT modes %v: the bootstrap executor's request must be labelled %s", modes, pd.ModeParallel)
	}
}

// Issue 24, item 1: the pair's handoff reached the access log and the per-pair counter only
// through the response header map, read back after the request: a Mooncake stream whose decode
// recomputed (its head long gone) stayed "mooncake" there. The record carries the verdict.
func TestStreamedRecomputeReachesThePairCounter(t *testing.T) {
	t.Parallel()
	p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorMooncake, EngineID: "p-mooncake"})
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl}) // reads no Mooncake params
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Retry.Disable = true
	pw := config.Worker{URL: p.URL(), Role: config.RolePrefill, KVConnector: "MooncakeConnector", KVEngineID: "p-mooncake"}
	if bp := p.BootstrapPort(); bp != 0 {
		pw.BootstrapPort = &bp
	}
	cfg.Workers = []config.Worker{pw, {URL: d.URL(), Role: config.RoleDecode, KVConnector: "MooncakeConnector"}}
	g, gw := startGateway(t, cfg)
	resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"again"}],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}`)
	if resp.StatusCode != 200 || !strings.Contains(body, "[DONE]") {
		t.Fatalf("stream: %d %s", resp.StatusCode, body)
	}
	poll.Until(t, "the condition", func() bool {
		return testutil.ToFloat64(g.Metrics.PairHandoffs.WithLabelValues(p.URL(), d.URL(), "recomputed")) == 1
	})
	if v := testutil.ToFloat64(g.Metrics.PairHandoffs.WithLabelValues(p.URL(), d.URL(), "mooncake")); v != 0 {
		t.Errorf("a recompute counted as a Mooncake handoff for the pair (%v)", v)
	}
}

// An SGLang prefill without a bootstrap port is a registration warning naming where to give it.
func TestSGLangPrefillWithoutBootstrapPortWarns(t *testing.T) {
	var out bytes.Buffer
	log := slog.New(slog.NewTextHandler(&out, nil))
	w := worker.New(config.Worker{URL: "http://p:1", Role: config.RolePrefill})
	w.SetInfo(&worker.Info{Runtime: config.RuntimeSGLang})
	logConnector(log, config.Default(), w)
	if !strings.Contains(out.String(), "without a bootstrap port") {
		t.Errorf("logged %q", out.String())
	}
	port := 8998
	w = worker.New(config.Worker{URL: "http://p:1", Role: config.RolePrefill, BootstrapPort: &port})
	w.SetInfo(&worker.Info{Runtime: config.RuntimeSGLang})
	out.Reset()
	logConnector(log, config.Default(), w)
	if strings.Contains(out.String(), "bootstrap port") {
		t.Errorf("warned with a port given: %q", out.String())
	}
}
