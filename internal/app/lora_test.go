package app

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// loraEngine is a simulated vLLM engine serving model with run-time adapter loading.
func loraEngine(t *testing.T, c sim.Config) *sim.Engine {
	t.Helper()
	c.RuntimeLoRA = true
	if c.Engine == "" {
		c.Engine = sim.EngineVLLM
	}
	return startSim(t, c)
}

func loads(es ...*sim.Engine) (n int64) {
	for _, e := range es {
		l, _ := e.LoRAStats()
		n += l
	}
	return n
}

func adapterReq(t *testing.T, gw, model string) (*http.Response, string) {
	t.Helper()
	return gwtest.PostTimeout(t, gw+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"an adapter's request","max_tokens":2}`, model))
}

// Adapter affinity: an adapter's requests go where it is loaded, never to a worker of another
// base model even though that one lists an adapter of the name; a declared adapter loaded
// nowhere is loaded once on a worker of its base model — once for 50 concurrent requests — and
// its requests stay there.
func TestAdapterAffinityAndSingleFlightLoad(t *testing.T) {
	t.Parallel()
	a := loraEngine(t, sim.Config{Model: "base", LoRALoadTime: 200 * time.Millisecond, MaxLoRAs: 4})
	b := loraEngine(t, sim.Config{Model: "base", LoRALoadTime: 200 * time.Millisecond, MaxLoRAs: 4, LoRAAdapters: []string{"warm"}})
	other := loraEngine(t, sim.Config{Model: "other-base", LoRAAdapters: []string{"cold"}})
	cfg := testConfig(a.URL(), b.URL(), other.URL())
	cfg.Policy = config.PolicyRoundRobin
	cfg.Adapters = []config.Adapter{{Name: "cold", Path: "/adapters/cold", Base: "base"}, {Name: "extra", Path: "/adapters/extra", Base: "base"}}
	_, gw := startGateway(t, cfg)
	req, _ := http.NewRequest(http.MethodGet, gw.URL+"/v1/models", nil)
	_, list := do(t, req)
	if !strings.Contains(list, `{"created":0,"id":"extra","object":"model","owned_by":"baton","parent":"base"}`) || !strings.Contains(list, `"id":"warm"`) {
		t.Errorf("/v1/models lists the declared adapter and the loaded one: %s", list)
	}

	for i := 0; i < 6; i++ {
		if resp, body := adapterReq(t, gw.URL, "warm"); resp.StatusCode != 200 || resp.Header.Get("X-Baton-Worker") != b.URL() {
			t.Fatalf("warm adapter: %d sent to %s, not %s where it is loaded: %s", resp.StatusCode, resp.Header.Get("X-Baton-Worker"), b.URL(), body)
		}
	}
	var wg sync.WaitGroup
	workers := make(chan string, 50)
	for i := 0; i < 50; i++ {
		wg.Go(func() {
			resp, body := adapterReq(t, gw.URL, "cold")
			if resp.StatusCode != 200 {
				t.Errorf("cold adapter: %d %s", resp.StatusCode, body)
			}
			workers <- resp.Header.Get("X-Baton-Worker")
		})
	}
	wg.Wait()
	close(workers)
	seen := map[string]int{}
	for w := range workers {
		seen[w]++
	}
	if n := loads(a, b, other); n != 1 || len(seen) != 1 || seen[other.URL()] > 0 {
		t.Fatalf("50 concurrent requests for a cold adapter: %d loads, served by %v (want one load, one worker of its base)", n, seen)
	}
	var home string
	for w := range seen {
		home = w
	}
	for i := 0; i < 6; i++ {
		if resp, _ := adapterReq(t, gw.URL, "cold"); resp.Header.Get("X-Baton-Worker") != home {
			t.Fatalf("after the load: sent to %s, not %s", resp.Header.Get("X-Baton-Worker"), home)
		}
	}
	if n := loads(a, b, other); n != 1 {
		t.Fatalf("%d loads", n)
	}
}

// All of a worker's adapter slots taken: with unload_lru the least recently used adapter with
// nothing in flight is unloaded first; without it the engine's refusal is a 503 naming the
// adapter. A load that fails is answered at once afterwards, not tried again in a loop.
func TestAdapterLRUUnloadAndFailingLoad(t *testing.T) {
	t.Parallel()
	// SGLang: it refuses a load past --max-loaded-loras (vLLM never refuses one for room).
	e := loraEngine(t, sim.Config{Engine: sim.EngineSGLang, Model: "base", MaxLoRAs: 2, LoRAMissingPaths: []string{"/adapters/gone"}})
	cfg := testConfig(e.URL())
	cfg.LoadPollInterval = 20 * time.Millisecond
	cfg.Adapters = []config.Adapter{{Name: "a1", Path: "/adapters/a1", Base: "base"}, {Name: "a2", Path: "/adapters/a2", Base: "base"},
		{Name: "a3", Path: "/adapters/a3", Base: "base"}, {Name: "gone", Path: "/adapters/gone", Base: "base"}}
	g, gw := startGateway(t, cfg)
	for _, m := range []string{"a1", "a2", "a1"} { // a2 is now the least recently used
		if resp, body := adapterReq(t, gw.URL, m); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", m, resp.StatusCode, body)
		}
	}
	if in := g.Registry.Snapshot().Workers[0].Info(); in == nil || in.MaxLoadedLoRAs != 2 {
		t.Fatalf("max_loaded_loras from /server_info: %+v", in)
	}

	resp, body := adapterReq(t, gw.URL, "a3")
	env := wantAdapterFailure(t, resp, body)
	if !strings.Contains(env.Error.Message, `"a3"`) || !strings.Contains(env.Error.Message, "Maximum number of loaded LoRA adapters") {
		t.Fatalf("full without unload_lru: %s", body)
	}

	cfg.UnloadLRU = true
	g.Adapters.Set(adapterSettings(cfg))
	time.Sleep(10 * time.Millisecond)
	// The refusal above is held for a while: a3 is answered at once, not loaded again.
	before := loads(e)
	if resp, _ := adapterReq(t, gw.URL, "a3"); resp.StatusCode != http.StatusServiceUnavailable || loads(e) != before {
		t.Fatalf("a failed load was tried again at once: %d", resp.StatusCode)
	}
	g.Adapters.ForgetFailures()
	if resp, body := adapterReq(t, gw.URL, "a3"); resp.StatusCode != 200 {
		t.Fatalf("with unload_lru: %d %s", resp.StatusCode, body)
	}
	if got := strings.Join(e.LoadedAdapters(), ","); got != "a1,a3" {
		t.Fatalf("loaded now %s, want a1,a3 (a2 the least recently used unloaded)", got)
	}

	for i := 0; i < 3; i++ {
		resp, body := adapterReq(t, gw.URL, "gone")
		env := wantAdapterFailure(t, resp, body)
		if !strings.Contains(env.Error.Message, `"gone"`) || !strings.Contains(env.Error.Message, "No adapter found") {
			t.Fatalf("a missing adapter: %s", body)
		}
	}
	metrics := scrape(t, g)
	if !strings.Contains(metrics, `baton_adapter_operations_total{op="load",result="failed"} 2`) ||
		!strings.Contains(metrics, `baton_adapter_operations_total{op="load",result="ok"} 3`) ||
		!strings.Contains(metrics, `baton_adapter_operations_total{op="unload",result="ok"} 2`) { // a2, then one to make room for "gone"
		t.Fatalf("adapter metrics:\n%s", grepLines(metrics, "baton_adapter_operations_total"))
	}
	// A declared adapter no worker lists (its load failed) is its own label, not "unknown".
	if !strings.Contains(metrics, `baton_requests_total{model="gone",route="POST /v1/completions",status="503"} 3`) {
		t.Errorf("the failed adapter's requests are not labelled by it:\n%s", grepLines(metrics, "baton_requests_total"))
	}
}

// PD: both legs must have the adapter: Baton loads it on the prefill and the decode, and the
// handoff goes on as without one — vLLM's name as is, SGLang's as base:adapter.
func TestAdapterThroughPD(t *testing.T) {
	t.Parallel()
	for _, engine := range []string{sim.EngineVLLM, sim.EngineSGLang} {
		t.Run(engine, func(t *testing.T) {
			t.Parallel()
			// SGLang as its older releases: an adapter named by the model alone runs the base.
			legacy := engine == sim.EngineSGLang
			p := simEngine(t, sim.Config{Engine: engine, Role: sim.RolePrefill, KVConnector: kvConnectorFor(engine), EngineID: "p", RuntimeLoRA: true, SGLangModelAdapterIgnored: legacy})
			d := simEngine(t, sim.Config{Engine: engine, Role: sim.RoleDecode, KVConnector: kvConnectorFor(engine), RuntimeLoRA: true, SGLangModelAdapterIgnored: legacy})
			cfg := config.Default()
			cfg.PDDisaggregation = true
			pw := config.Worker{URL: p.URL(), Role: config.RolePrefill}
			if engine == sim.EngineSGLang {
				port := p.BootstrapPort()
				pw.BootstrapPort = &port
			} else {
				pw.KVConnector = "NixlConnector"
			}
			cfg.Workers = []config.Worker{pw, {URL: d.URL(), Role: config.RoleDecode}}
			cfg.Adapters = []config.Adapter{{Name: "sql", Path: "/adapters/sql", Base: pdModel}}
			_, gw := startGateway(t, cfg)
			for _, stream := range []string{"", `,"stream":true`} {
				resp, b := gwtest.PostTimeout(t, gw.URL+"/v1/chat/completions", `{"model":"sql","messages":[{"role":"user","content":"adapter through pd"}],"max_tokens":4`+stream+`}`)
				if resp.StatusCode != 200 {
					t.Fatalf("%s: %d %s", stream, resp.StatusCode, b)
				}
				if h := resp.Header.Get("X-Baton-Kv-Handoff"); h == "" || strings.HasPrefix(h, "none") {
					t.Errorf("%s: handoff %q", stream, h)
				}
			}
			// Both legs ran the adapter, whole and streamed (SGLang's by lora_path too: never the
			// base answering a request for the adapter).
			if np, nd := p.AdapterRequests("sql"), d.AdapterRequests("sql"); np != 2 || nd != 2 {
				t.Errorf("requests run by the adapter: prefill %d, decode %d, want 2 each", np, nd)
			}
			if lp, _ := p.LoRAStats(); lp != 1 {
				t.Errorf("prefill loads %d", lp)
			}
			if ld, _ := d.LoRAStats(); ld != 1 {
				t.Errorf("decode loads %d", ld)
			}
		})
	}
}

// wantAdapterFailure checks a 503 adapter_load_failed answer and returns its envelope.
func wantAdapterFailure(t *testing.T, resp *http.Response, body string) envelope {
	t.Helper()
	var e envelope
	if err := json.Unmarshal([]byte(body), &e); err != nil || resp.StatusCode != http.StatusServiceUnavailable || e.Error.Code != "adapter_load_failed" {
		t.Fatalf("want 503 adapter_load_failed, got %d %s", resp.StatusCode, body)
	}
	// A 503 says when to try again (the soak found this one without it).
	if resp.Header.Get("Retry-After") == "" {
		t.Errorf("503 adapter_load_failed without Retry-After")
	}
	return e
}

func kvConnectorFor(engine string) string {
	if engine == sim.EngineVLLM {
		return sim.ConnectorNixl
	}
	return ""
}

func grepLines(text, sub string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// An adapter loaded on an engine behind Baton's back is learned on the next load poll: its
// requests are served, not refused as a model nobody serves.
func TestAdapterLoadedOutsideBatonIsLearned(t *testing.T) {
	t.Parallel()
	e := loraEngine(t, sim.Config{Model: "base"})
	cfg := testConfig(e.URL())
	cfg.LoadPollInterval = 20 * time.Millisecond
	g, gw := startGateway(t, cfg)
	if resp, _ := adapterReq(t, gw.URL, "late"); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("before the load: %d", resp.StatusCode)
	}
	if resp, body := gwtest.PostTimeout(t, e.URL()+"/v1/load_lora_adapter", `{"lora_name":"late","lora_path":"/adapters/late"}`); resp.StatusCode != 200 {
		t.Fatalf("load on the engine: %d %s", resp.StatusCode, body)
	}
	poll.Until(t, "Baton learns the adapter", func() bool { return g.Registry.Snapshot().Parent("late") == "base" })
	if resp, body := adapterReq(t, gw.URL, "late"); resp.StatusCode != 200 || e.AdapterRequests("late") != 1 {
		t.Fatalf("after the load: %d %s", resp.StatusCode, body)
	}
}

// An SGLang release that reads no adapter from the model name (base:adapter) would answer an
// adapter's request from its base model with a 200: Baton names the adapter in lora_path too,
// so the adapter runs — on every route, and a client's own lora_path null is replaced. One
// naming another adapter than "model" (which SGLang would run instead of the one Baton routed
// and counted) is refused 400 invalid_lora_path.
func TestSGLangAdapterNeverAnsweredByTheBase(t *testing.T) {
	t.Parallel()
	e := loraEngine(t, sim.Config{Engine: sim.EngineSGLang, Model: "base", SGLangModelAdapterIgnored: true, LoRAAdapters: []string{"other"}})
	cfg := testConfig(e.URL())
	cfg.Adapters = []config.Adapter{{Name: "sql", Path: "/adapters/sql", Base: "base"}, {Name: "other", Path: "/adapters/other", Base: "base"}}
	_, gw := startGateway(t, cfg)
	bodies := []string{
		`{"model":"sql","prompt":"x","max_tokens":2}`,
		`{"model":"sql","messages":[{"role":"user","content":"x"}],"max_tokens":2}`,
		`{"model":"sql","prompt":"x","max_tokens":2,"lora_path":null}`,
		`{"model":"sql","prompt":"x","max_tokens":2,"lora_path":"sql"}`,
	}
	for i, body := range bodies {
		path := "/v1/completions"
		if i == 1 {
			path = "/v1/chat/completions"
		}
		resp, b := gwtest.PostTimeout(t, gw.URL+path, body)
		if resp.StatusCode != 200 {
			t.Fatalf("%s %s: %d %s", path, body, resp.StatusCode, b)
		}
	}
	if resp, b := gwtest.PostTimeout(t, gw.URL+"/v1/completions", `{"model":"sql","prompt":"x","max_tokens":2,"lora_path":"other"}`); resp.StatusCode != 400 || !strings.Contains(b, "invalid_lora_path") {
		t.Errorf("another adapter in lora_path than the model's: %d %s", resp.StatusCode, b)
	}
	if n, o := e.AdapterRequests("sql"), e.AdapterRequests("other"); n != int64(len(bodies)) || o != 0 {
		t.Errorf("requests the adapter ran: %d of %d, the client's lora_path %d (the base or another adapter answered the rest)", n, len(bodies), o)
	}
}

// An adapter another replica unloaded from a worker since this Baton last read its models: the
// engine refuses the request (vLLM 404 "does not exist", SGLang 400 "… are not loaded"); Baton
// loads the adapter again on the same worker and sends the request once more — the client never
// sees the refusal.
func TestAdapterUnloadedByAnotherReplica(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ engine, unload string }{
		{sim.EngineVLLM, "/v1/unload_lora_adapter"},
		{sim.EngineSGLang, "/unload_lora_adapter"},
	} {
		t.Run(c.engine, func(t *testing.T) {
			t.Parallel()
			e := loraEngine(t, sim.Config{Engine: c.engine, Model: "base"})
			cfg := testConfig(e.URL())
			cfg.LoadPollInterval = time.Hour // this replica learns of the unload only from the answer
			cfg.Adapters = []config.Adapter{{Name: "sql", Path: "/adapters/sql", Base: "base"}}
			_, gw := startGateway(t, cfg)
			if resp, b := adapterReq(t, gw.URL, "sql"); resp.StatusCode != 200 {
				t.Fatalf("first: %d %s", resp.StatusCode, b)
			}
			resp, err := http.Post(e.URL()+c.unload, "application/json", strings.NewReader(`{"lora_name":"sql"}`))
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("the other replica's unload: %v %v", resp, err)
			}
			resp.Body.Close()
			for i := 0; i < 3; i++ {
				if resp, b := adapterReq(t, gw.URL, "sql"); resp.StatusCode != 200 {
					t.Fatalf("after the other replica's unload, request %d: %d %s", i, resp.StatusCode, b)
				}
			}
			if l, _ := e.LoRAStats(); l != 2 {
				t.Errorf("loads %d, want 2 (the first, and once again after the unload)", l)
			}
			if n := e.AdapterRequests("sql"); n != 4 {
				t.Errorf("the adapter ran %d requests, want 4", n)
			}
		})
	}
}

// A streamed request whose adapter another replica unloaded: SGLang answers it 200 and refuses
// it in the stream's first event. Baton holds that event as the 400 it is, loads the adapter
// again and sends the request once more — on the OpenAI routes and on /generate — and the client
// gets the adapter's stream, never the engine's error event.
func TestStreamedAdapterUnloadedByAnotherReplicaOnSGLang(t *testing.T) {
	t.Parallel()
	e := loraEngine(t, sim.Config{Engine: sim.EngineSGLang, Model: "base"})
	cfg := testConfig(e.URL())
	cfg.LoadPollInterval = time.Hour // this replica learns of the unload only from the answer
	cfg.Adapters = []config.Adapter{{Name: "sql", Path: "/adapters/sql", Base: "base"}}
	_, gw := startGateway(t, cfg)
	for i, c := range []struct{ path, body string }{
		{"/v1/completions", `{"model":"sql","prompt":"x","max_tokens":2,"stream":true}`},
		{"/v1/chat/completions", `{"model":"sql","messages":[{"role":"user","content":"x"}],"max_tokens":2,"stream":true}`},
		{"/generate", `{"text":"x","lora_path":"sql","stream":true,"sampling_params":{"max_new_tokens":2}}`},
	} {
		resp, err := http.Post(e.URL()+"/unload_lora_adapter", "application/json", strings.NewReader(`{"lora_name":"sql"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close() // the first time, nothing was loaded yet: refused, as another replica's unload would be
		before := e.AdapterRequests("sql")
		resp, b := gwtest.PostTimeout(t, gw.URL+c.path, c.body)
		if resp.StatusCode != 200 || strings.Contains(b, `"error"`) || !strings.HasSuffix(b, "data: [DONE]\n\n") {
			t.Errorf("%s after the other replica's unload: got %d %q, want the adapter's stream", c.path, resp.StatusCode, b)
		}
		if e.AdapterRequests("sql") != before+1 {
			t.Errorf("%s: the adapter ran %d requests, want %d", c.path, e.AdapterRequests("sql"), before+1)
		}
		if l, _ := e.LoRAStats(); l != int64(i+1) {
			t.Errorf("%s: loads %d, want %d (once again after each unload)", c.path, l, i+1)
		}
	}
}

// A client's own lora_path is the model it asks for: on SGLang (every route) and on vLLM alike,
// the adapter it names is routed and loaded on demand and runs; a tenant allowed only the base
// model cannot reach an adapter through it; a lora_path naming no adapter Baton serves, several
// adapters in one batch, or an adapter of another base than "model" is refused 400.
func TestClientLoRAPathIsTheModel(t *testing.T) {
	t.Parallel()
	for _, engine := range []string{sim.EngineSGLang, sim.EngineVLLM} {
		t.Run(engine, func(t *testing.T) {
			t.Parallel()
			e := loraEngine(t, sim.Config{Engine: engine, Model: "base", LoRAAdapters: []string{"preloaded"}})
			cfg := testConfig(e.URL())
			cfg.Adapters = []config.Adapter{{Name: "sql", Path: "/adapters/sql", Base: "base"}}
			cfg.Tenants = []config.Tenant{
				{Name: "base-only", Keys: []string{config.HashKey("sk-base")}, Models: []string{"base"}},
				{Name: "all", Keys: []string{config.HashKey("sk-all")}},
			}
			_, gw := startGateway(t, cfg)
			ok := []struct{ path, body, adapter string }{
				{"/v1/completions", `{"model":"base","prompt":"x","max_tokens":2,"lora_path":"sql"}`, "sql"},
				{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":2,"lora_path":"sql"}`, "sql"},
				{"/v1/completions", `{"model":"base","prompt":"x","max_tokens":2,"lora_path":"preloaded"}`, "preloaded"},
				{"/v1/completions", `{"model":"sql","prompt":"x","max_tokens":2,"lora_path":["sql"]}`, "sql"},
				{"/v1/completions", `{"model":"base","prompt":"x","max_tokens":2,"lora_path":null}`, ""},
				// SGLang's own spelling, base:adapter, names the adapter too.
				{"/v1/completions", `{"model":"base:sql","prompt":"x","max_tokens":2}`, "sql"},
				{"/v1/chat/completions", `{"model":" base : preloaded ","messages":[{"role":"user","content":"x"}],"max_tokens":2}`, "preloaded"},
			}
			if engine == sim.EngineSGLang {
				ok = append(ok, struct{ path, body, adapter string }{"/generate", `{"text":["x","y"],"lora_path":["sql","sql"],"sampling_params":{"max_new_tokens":2}}`, "sql"})
			}
			for _, c := range ok {
				before := e.AdapterRequests(c.adapter)
				resp, b := tenantReq(t, gw.URL+c.path, "sk-all", c.body)
				if resp.StatusCode != 200 {
					t.Fatalf("%s %s: %d %s", c.path, c.body, resp.StatusCode, b)
				}
				if c.adapter != "" && e.AdapterRequests(c.adapter) == before {
					t.Errorf("%s %s: the adapter %s did not run (the base answered)", c.path, c.body, c.adapter)
				}
			}
			// A tenant allowed only the base reaches no adapter through lora_path, nor base:adapter.
			for _, a := range []string{"sql", "preloaded"} {
				for _, body := range []string{`{"model":"base","prompt":"x","max_tokens":2,"lora_path":"` + a + `"}`, `{"model":"base:` + a + `","prompt":"x","max_tokens":2}`} {
					before := e.AdapterRequests(a)
					resp, b := tenantReq(t, gw.URL+"/v1/completions", "sk-base", body)
					if resp.StatusCode == 200 || e.AdapterRequests(a) != before {
						t.Errorf("a base-only tenant's %s: %d %s; the adapter ran %d times more", body, resp.StatusCode, b, e.AdapterRequests(a)-before)
					}
				}
			}
			if resp, b := tenantReq(t, gw.URL+"/v1/completions", "sk-base", `{"model":"base","prompt":"x","max_tokens":2}`); resp.StatusCode != 200 {
				t.Errorf("the base-only tenant's base request: %d %s", resp.StatusCode, b)
			}
			if engine == sim.EngineSGLang {
				// /generate names no model: a tenant held to some models is told to name one.
				if resp, b := tenantReq(t, gw.URL+"/generate", "sk-base", `{"text":"x","sampling_params":{"max_new_tokens":2}}`); resp.StatusCode != 400 || !strings.Contains(b, `"code":"model_required"`) {
					t.Errorf("the base-only tenant's /generate without a model: %d %s", resp.StatusCode, b)
				}
				if resp, b := tenantReq(t, gw.URL+"/generate", "sk-base", `{"model":"base","text":"x","sampling_params":{"max_new_tokens":2}}`); resp.StatusCode != 200 {
					t.Errorf("the base-only tenant's /generate naming the base: %d %s", resp.StatusCode, b)
				}
			}
			for _, body := range []string{
				`{"model":"base","prompt":"x","lora_path":"nope"}`,
				`{"model":"base","prompt":"x","lora_path":""}`,
				`{"model":"base","prompt":"x","lora_path":7}`,
				`{"model":"base","prompt":"x","lora_path":{"a":"sql"}}`,
				`{"model":"base","prompt":["x","y"],"lora_path":["sql","preloaded"]}`,
				`{"model":"base","prompt":["x","y"],"lora_path":["sql",null]}`,
				`{"model":"other-base","prompt":"x","lora_path":"sql"}`,
				`{"model":"preloaded","prompt":"x","lora_path":"sql"}`,
			} {
				resp, b := tenantReq(t, gw.URL+"/v1/completions", "sk-all", body)
				if resp.StatusCode != 400 || !strings.Contains(b, `"code":"invalid_lora_path"`) || !strings.Contains(b, `"param":"lora_path"`) {
					t.Errorf("%s: %d %s", body, resp.StatusCode, b)
				}
			}
		})
	}
}

// A PD leg whose engine no longer has the adapter (another replica unloaded it from the prefill
// or the decode since this Baton loaded it) is refused by the engine before anything reaches the
// client: the adapter is loaded again on the pair and the request sent once more.
func TestAdapterUnloadedFromAPDLegByAnotherReplica(t *testing.T) {
	t.Parallel()
	for _, engine := range []string{sim.EngineVLLM, sim.EngineSGLang} {
		t.Run(engine, func(t *testing.T) {
			t.Parallel()
			p := simEngine(t, sim.Config{Engine: engine, Role: sim.RolePrefill, KVConnector: kvConnectorFor(engine), EngineID: "p", RuntimeLoRA: true})
			d := simEngine(t, sim.Config{Engine: engine, Role: sim.RoleDecode, KVConnector: kvConnectorFor(engine), RuntimeLoRA: true})
			cfg := config.Default()
			cfg.PDDisaggregation = true
			cfg.LoadPollInterval = time.Hour // this replica learns of the unloads only from the answers
			pw := config.Worker{URL: p.URL(), Role: config.RolePrefill}
			unload := "/v1/unload_lora_adapter"
			if engine == sim.EngineSGLang {
				port := p.BootstrapPort()
				pw.BootstrapPort = &port
				unload = "/unload_lora_adapter"
			} else {
				pw.KVConnector = "NixlConnector"
			}
			cfg.Workers = []config.Worker{pw, {URL: d.URL(), Role: config.RoleDecode}}
			cfg.Adapters = []config.Adapter{{Name: "sql", Path: "/adapters/sql", Base: pdModel}}
			_, gw := startGateway(t, cfg)
			ask := func(what string) {
				t.Helper()
				resp, b := gwtest.PostTimeout(t, gw.URL+"/v1/chat/completions", `{"model":"sql","messages":[{"role":"user","content":"adapter through pd"}],"max_tokens":4}`)
				if resp.StatusCode != 200 {
					t.Fatalf("%s: %d %s", what, resp.StatusCode, b)
				}
			}
			ask("first")
			for _, e := range []*sim.Engine{d, p} {
				resp, err := http.Post(e.URL()+unload, "application/json", strings.NewReader(`{"lora_name":"sql"}`))
				if err != nil || resp.StatusCode != 200 {
					t.Fatalf("the other replica's unload: %v %v", resp, err)
				}
				resp.Body.Close()
				ask("after an unload from " + e.URL())
			}
			if lp, _ := p.LoRAStats(); lp != 2 {
				t.Errorf("prefill loads %d, want 2 (the first, and again after its unload)", lp)
			}
			if ld, _ := d.LoRAStats(); ld != 2 {
				t.Errorf("decode loads %d, want 2", ld)
			}
		})
	}
}

// What a client names is bounded before any message quotes it: a "model" or lora_path name of
// megabytes (invalid UTF-8 would grow threefold as U+FFFD) is refused with a small answer, and a
// lora_path list longer than max_batch_size is refused unread.
func TestClientNamesAreBoundedInAnswers(t *testing.T) {
	t.Parallel()
	e := loraEngine(t, sim.Config{Engine: sim.EngineSGLang, Model: "base"})
	cfg := testConfig(e.URL())
	cfg.Adapters = []config.Adapter{{Name: "sql", Path: "/adapters/sql", Base: "base"}}
	_, gw := startGateway(t, cfg)
	huge := strings.Repeat("\xff", 4<<20)
	for _, c := range []struct{ path, body, code string }{
		{"/v1/completions", `{"model":"` + huge + `","prompt":"x"}`, "invalid_model"},
		{"/v1/completions", `{"model":"base","prompt":"x","lora_path":"` + huge + `"}`, "invalid_lora_path"},
		{"/generate", `{"text":"x","lora_path":["` + huge + `"]}`, "invalid_lora_path"},
		{"/generate", `{"text":"x","lora_path":[` + strings.Repeat(`"sql",`, cfg.MaxBatchSize) + `"sql"]}`, "batch_too_large"},
	} {
		resp, b := gwtest.PostTimeout(t, gw.URL+c.path, c.body)
		if resp.StatusCode != 400 || !strings.Contains(b, `"code":"`+c.code+`"`) || len(b) > 8<<10 {
			t.Errorf("%s %.60q…: %d, %d bytes: %.300s", c.path, c.body, resp.StatusCode, len(b), b)
		}
	}
}
