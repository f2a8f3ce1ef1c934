package app

// The PD seam, third pass: each test here fails on the gateway before it, against simulators
// that behave as the engines' current source does.

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/kvevents"
	"github.com/baton-llm/baton/internal/kvfleet"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// connectorModes maps Baton's connector names to the simulator's and to the metrics label.
var connectorModes = map[string]string{"NixlConnector": sim.ConnectorNixl, "MooncakeConnector": sim.ConnectorMooncake}

// decodePairFleet starts one vLLM prefill and the given decodes with connector, and a gateway
// over them (Mooncake dispatched sequentially, the breaker off so that every decode stays in
// rotation).
func decodePairFleet(t *testing.T, connector string, decodes []sim.Config, tune ...func(*config.Config)) (*sim.Engine, []*sim.Engine, *Gateway, string) {
	t.Helper()
	mode := connectorModes[connector]
	p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: mode, EngineID: "p"})
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.PDMooncakeDispatch = "sequential"
	cfg.CircuitBreaker.Disable = true
	pw := config.Worker{URL: p.URL(), Role: config.RolePrefill, KVConnector: connector, KVEngineID: "p"}
	if bp := p.BootstrapPort(); bp != 0 {
		pw.BootstrapPort = &bp
	}
	cfg.Workers = []config.Worker{pw}
	var ds []*sim.Engine
	for _, dc := range decodes {
		dc.Engine, dc.Role, dc.KVConnector = sim.EngineVLLM, sim.RoleDecode, mode
		d := simEngine(t, dc)
		ds = append(ds, d)
		cfg.Workers = append(cfg.Workers, config.Worker{URL: d.URL(), Role: config.RoleDecode})
	}
	g, gw := startGateway(t, cfg, tune...)
	return p, ds, g, gw.URL
}

// Item 1: a decode that answered (here 503, as vLLM's admission control does) has spent the
// handoff: vLLM's serving layer tells the prefill to free the blocks. Sending the same params to
// another decode read freed blocks and answered 200 with a wrong text. The request starts over
// with a new prefill instead.
func TestPDDecodeAnswerStartsOverWithANewPrefill(t *testing.T) {
	t.Parallel()
	for connector := range connectorModes {
		t.Run(connector, func(t *testing.T) {
			t.Parallel()
			p, ds, g, gw := decodePairFleet(t, connector, []sim.Config{{Faults: sim.Faults{Status: 503}}, {}})
			agg := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
			const n = 6
			for i := 0; i < n; i++ {
				body := `{"model":"m","prompt":"decode again ` + strings.Repeat("w", i) + `","max_tokens":4}`
				_, want := gwtest.PostTimeout(t, agg.URL()+"/v1/completions", body)
				resp, got := gwtest.PostTimeout(t, gw+"/v1/completions", body)
				if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote || resp.Header.Get("X-Baton-Decode-Worker") != ds[1].URL() {
					t.Fatalf("request %d: %d, KV %q, decode %s: %s", i, resp.StatusCode, resp.Header.Get(sim.HeaderKVSource), resp.Header.Get("X-Baton-Decode-Worker"), got)
				}
				if gwtest.StripIDs(got) != gwtest.StripIDs(want) {
					t.Fatalf("request %d: PD answer\n%s\nwant (aggregated)\n%s", i, got, want)
				}
			}
			s := p.Stats()
			if s.StaleKVReads != 0 {
				t.Errorf("%d decodes read KV the prefill had freed", s.StaleKVReads)
			}
			if s.HandoffsReleased == 0 || s.RequestsReceived != n+s.HandoffsReleased {
				t.Errorf("prefill served %d requests, %d handoffs released by the busy decode: want one new prefill per refusal", s.RequestsReceived, s.HandoffsReleased)
			}
			if v := testutil.ToFloat64(g.Metrics.PDDecodeRetries); v != 0 {
				t.Errorf("%v decodes retried alone after an answer", v)
			}
		})
	}
}

// Item 1, the other side: a decode whose connection cannot even be opened never saw the
// request, so the KV is still pinned: the decode alone goes to another worker with the same
// handoff, and the prefill is not run again.
func TestPDDecodeUnreachableRetriedAlone(t *testing.T) {
	t.Parallel()
	for connector := range connectorModes {
		t.Run(connector, func(t *testing.T) {
			t.Parallel()
			p, ds, g, gw := decodePairFleet(t, connector, []sim.Config{{}, {}}, func(c *config.Config) { c.HealthCheck.Interval = time.Hour })
			ds[0].Close() // registered, then gone: its port refuses connections
			// A connection the registration left in the pool would fail with a reset rather
			// than a refusal (the engine might have read the request: no decode-alone retry),
			// and only by a race; as when a worker leaves the fleet, it is closed.
			g.Fleet.CloseIdle(ds[0].URL())
			const n = 6
			for i := 0; i < n; i++ {
				resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"unreachable `+strings.Repeat("u", i)+`","max_tokens":2}`)
				if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
					t.Fatalf("request %d: %d, KV %q: %s", i, resp.StatusCode, resp.Header.Get(sim.HeaderKVSource), body)
				}
			}
			if s := p.Stats(); s.RequestsReceived != n || s.StaleKVReads != 0 {
				t.Errorf("the prefill served %d requests for %d (%d stale reads): an unreachable decode re-ran it", s.RequestsReceived, n, s.StaleKVReads)
			}
			if v := testutil.ToFloat64(g.Metrics.PDDecodeRetries); v == 0 {
				t.Error("no decode was retried alone")
			}
		})
	}
}

// Item 2: a client's kv_transfer_params reached a vLLM engine on the regular path (pinning KV
// for minutes, or making the engine connect where the client said), and SGLang's bootstrap and
// DP rank fields likewise. Baton owns them: they never reach an engine from a client, on any
// route, while every other byte passes unchanged.
func TestClientNeverSetsHandoffFields(t *testing.T) {
	t.Parallel()
	got := make(chan string, 8)
	record := func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return // registration probes
		}
		b, _ := io.ReadAll(r.Body)
		got <- string(b)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"x"}]}`)
	}
	vllm, sglang := fakeEngine(t, "vllm", []string{"m"}, record), fakeEngine(t, "sglang", []string{"m"}, record)
	_, gw := startGateway(t, testConfig(vllm.URL, sglang.URL))
	body := `{"model":"m","prompt":"p","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.0.0.1","remote_port":1},` +
		`"x":18446744073709551617,"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":7,"bootstrap_pair_key":"k",` +
		`"routed_dp_rank":1,"disagg_prefill_dp_rank":1,"data_parallel_rank":1,"u":"\u00e9"}`
	for _, route := range []string{"/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses", "/v1/messages"} {
		resp, answer := gwtest.PostTimeout(t, gw.URL+route, body)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", route, resp.StatusCode, answer)
		}
		if b, want := <-got, `{"model":"m","prompt":"p","x":18446744073709551617,"u":"\u00e9"}`; b != want {
			t.Errorf("%s: the engine received\n%s\nwant\n%s", route, b, want)
		}
	}
}

// Item 4: SGLang's /v1/responses drops the bootstrap fields, so its legs never met and the
// decode waited out its bootstrap timeout. On SGLang pairs it is refused at once, clearly, and
// no leg is sent.
func TestPDSGLangResponsesRefused(t *testing.T) {
	t.Parallel()
	p, d, _, gw := sglangPD(t, sim.Config{}, sim.Config{})
	resp, body := gwtest.PostTimeout(t, gw+"/v1/responses", `{"model":"m","input":"hello","max_output_tokens":3}`)
	if resp.StatusCode != 501 || !strings.Contains(body, "not_implemented_in_pd_mode") || !strings.Contains(body, "bootstrap") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if p.Stats().RequestsReceived+d.Stats().RequestsReceived != 0 {
		t.Error("a leg was sent")
	}
	if resp, body := gwtest.PostTimeout(t, gw+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":3}`); resp.StatusCode != 200 {
		t.Errorf("chat on the same pair: %d %s", resp.StatusCode, body)
	}
}

// Item 5: a prompt_embeds list is a batch like a prompt list: counted against max_batch_size,
// and never handed off as one request.
func TestPDPromptEmbedsListIsABatch(t *testing.T) {
	t.Parallel()
	p, _, _, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{}, func(c *config.Config) { c.MaxBatchSize = 2 })
	resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt_embeds":["QUFB","QkJC","Q0ND"],"max_tokens":2}`)
	if resp.StatusCode != 400 || !strings.Contains(body, "batch_too_large") {
		t.Fatalf("3 prompt_embeds with max_batch_size 2: %d %s", resp.StatusCode, body)
	}
	resp, body = gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"x","prompt_embeds":["QUFB"],"max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-batch" {
		t.Fatalf("%d, handoff %q: %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), body)
	}
	if n := p.Stats().RequestsReceived; n != 0 {
		t.Errorf("the prefill served %d requests", n)
	}
}

// Item 7: the decode's own usage is the engine's only word on whether it used the KV. A decode
// that was handed params but computed the prompt (here its connector reads none of them: a
// silent recompute) used to be reported as a NIXL handoff; now it is "recomputed", in the
// header of a whole answer, the counter and the log, for streams too.
func TestPDDecodeThatComputedThePromptIsARecompute(t *testing.T) {
	t.Parallel()
	p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorMooncake})
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector"}, {URL: d.URL(), Role: config.RoleDecode}}
	g, gw := startGateway(t, cfg)
	resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"computed again after all","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "recomputed" || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRecompute {
		t.Fatalf("%d, handoff %q, KV %q: %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), body)
	}
	resp, body = gwtest.PostTimeout(t, gw.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"again"}],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}`)
	if resp.StatusCode != 200 || !strings.Contains(body, "[DONE]") {
		t.Fatalf("stream: %d %s", resp.StatusCode, body)
	}
	poll.Until(t, "the condition", func() bool {
		return testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("recomputed", pd.HandoffClass("recomputed"), "nixl")) == 2
	})
	if v := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("nixl", pd.HandoffClass("nixl"), "nixl")); v != 0 {
		t.Errorf("%v recomputes counted as NIXL handoffs", v)
	}
}

// Item 6: a stream the engine answered 200 and then failed inside (a KV load failure, an SGLang
// transfer abort) was counted as a success. The client still gets every byte as the engine sent
// it; the request is counted as failed, against the worker that failed it.
func TestStreamErrorsInsideTheStreamAreFailures(t *testing.T) {
	t.Parallel()
	const stream = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n" +
		"data: {\"error\": {\"message\": \"KV load failed\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\ndata: [DONE]\n\n"
	failing := func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return
		}
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, stream)
	}
	t.Run("regular", func(t *testing.T) {
		t.Parallel()
		engine := fakeEngine(t, "vllm", []string{"m"}, failing)
		cfg := testConfig(engine.URL)
		cfg.CircuitBreaker.Disable = true
		g, gw := startGateway(t, cfg)
		resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/chat/completions", `{"model":"m","messages":[],"stream":true}`)
		if resp.StatusCode != 200 || body != stream {
			t.Fatalf("%d, the client got\n%q\nwant the engine's bytes\n%q", resp.StatusCode, body, stream)
		}
		poll.Until(t, "the condition", func() bool {
			return testutil.ToFloat64(g.Metrics.UpstreamErrors.WithLabelValues(engine.URL, "in_band")) == 1
		})
		if _, failures := g.Registry.Snapshot().Workers[0].Outcomes(); failures != 1 {
			t.Errorf("the worker's failures: %d, want 1", failures)
		}
	})
	t.Run("pd decode", func(t *testing.T) {
		t.Parallel()
		p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
		d := fakeEngine(t, "vllm", []string{"m"}, failing)
		cfg := config.Default()
		cfg.PDDisaggregation = true
		cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector"}, {URL: d.URL, Role: config.RoleDecode}}
		g, gw := startGateway(t, cfg)
		resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}`)
		if resp.StatusCode != 200 || body != stream {
			t.Fatalf("%d, the client got\n%q\nwant the engine's bytes\n%q", resp.StatusCode, body, stream)
		}
		poll.Until(t, "the condition", func() bool {
			return testutil.ToFloat64(g.Metrics.PDRequests.WithLabelValues("m", "sequential", "decode_failed")) == 1
		})
		if v := testutil.ToFloat64(g.Metrics.PDRequests.WithLabelValues("m", "sequential", "success")); v != 0 {
			t.Errorf("counted as %v successes", v)
		}
		if v := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("none-failed", pd.HandoffClass("none-failed"), "nixl")); v != 1 {
			t.Errorf("none-failed counted %v times", v)
		}
	})
}

// Item 3: SGLang runs each of n samples as a request of its own and gives a scalar room r to
// sample k as r + k; with one routed_dp_rank beside it, the samples whose room fell on another
// rank failed follow_bootstrap_room. Baton sends one scalar room and pins no rank: every sample
// meets its decode, and the answer is the aggregated one.
func TestPDSGLangSamplesOnDataParallelRanks(t *testing.T) {
	t.Parallel()
	_, _, _, gw := sglangPD(t, sim.Config{DPSize: 2}, sim.Config{DPSize: 2}, func(c *config.Config) {
		c.Workers[0].DPSize, c.Workers[1].DPSize = 2, 2
	})
	agg := simEngine(t, sim.Config{Engine: sim.EngineSGLang})
	for _, tc := range []struct{ route, body string }{
		{"/generate", `{"text":"samples on ranks","sampling_params":{"n":3,"max_new_tokens":3,"sampling_seed":5}}`},
		{"/generate", `{"text":["two","prompts"],"sampling_params":{"n":2,"max_new_tokens":2}}`},
		{"/v1/completions", `{"model":"m","prompt":"four samples","n":4,"max_tokens":3,"seed":7}`},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"two choices"}],"n":2,"max_tokens":3}`},
	} {
		for i := 0; i < 4; i++ { // rooms are random: several tries meet both parities
			resp, got := gwtest.PostTimeout(t, gw+tc.route, tc.body)
			if resp.StatusCode != 200 {
				t.Fatalf("%s %s: %d %s", tc.route, tc.body, resp.StatusCode, got)
			}
			if _, want := gwtest.PostTimeout(t, agg.URL()+tc.route, tc.body); gwtest.StripIDs(got) != gwtest.StripIDs(want) {
				t.Fatalf("%s %s: PD answer\n%s\nwant (aggregated)\n%s", tc.route, tc.body, got, want)
			}
		}
	}
}

// Item 9: the tokenize call for a chat sent the messages alone, so an agentic request's tools
// (and the template's arguments, add_generation_prompt, continue_final_message) were missing from
// its token ids, and its blocks never matched what the engine had cached.
func TestCacheAwareChatWithToolsFollowsEngineEvents(t *testing.T) {
	t.Parallel()
	es, g, gw := eventsFleet(t, sim.Config{Engine: sim.EngineVLLM})
	waitHealthy(t, es, g)
	tools := `[{"type":"function","function":{"name":"search","description":"` + strings.Repeat("look things up in the corpus ", 12) + `","parameters":{"type":"object"}}}]`
	for p, h := range []int{0, 0, 1, 1, 1, 0} { // not the turn a fallback would take
		home := es[h]
		chat := func(question string) string {
			return fmt.Sprintf(`{"model":%q,"tools":%s,"chat_template_kwargs":{"thinking":%v},"messages":[{"role":"system","content":"agent %d"},{"role":"user","content":%q}],"max_tokens":2}`,
				pdModel, tools, p%3 == 0, p, question)
		}
		if resp, body := gwtest.PostTimeout(t, home.URL()+"/v1/chat/completions", chat("first")); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		_, tok := gwtest.PostTimeout(t, home.URL()+"/tokenize", chat("first"))
		var v struct{ Tokens []uint32 }
		if err := json.Unmarshal([]byte(tok), &v); err != nil || len(v.Tokens) < 64 {
			t.Fatalf("tokenize: %v %s", err, tok)
		}
		keys := kvevents.Keys(pdModel, "", v.Tokens, 16)
		poll.Until(t, "the condition", func() bool { return g.KVEvents.Index.Match(keys)[home.URL()] == len(keys) })
		resp, body := gwtest.PostTimeout(t, gw+"/v1/chat/completions", chat("first"))
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Worker") != home.URL() || !strings.Contains(resp.Header.Get("X-Baton-Route"), "reason=cache_match") {
			t.Fatalf("agent %d: %d, sent to %s, not to %s that holds its prefix (route %s): %s", p, resp.StatusCode,
				resp.Header.Get("X-Baton-Worker"), home.URL(), resp.Header.Get("X-Baton-Route"), body)
		}
	}
}

// Item 8: a hybrid-attention model announces each block once per KV-cache group, and its
// sliding-window group frees a prompt's early blocks at once; read as removals of the prompt's
// blocks they erased the full-attention prefix, and routing from events found nothing. Only
// full-attention groups are indexed.
func TestCacheAwareOnHybridAttentionEvents(t *testing.T) {
	t.Parallel()
	for _, encoding := range []string{sim.KVEventsArray, sim.KVEventsMap} {
		t.Run(encoding, func(t *testing.T) {
			t.Parallel()
			es, g, gw := eventsFleet(t, sim.Config{Engine: sim.EngineVLLM, HybridKV: true, KVEventsEncoding: encoding})
			waitHealthy(t, es, g)
			routesHome(t, g, gw, es, pdModel, "")
		})
	}
}

// Item 10 (should): a request for a LoRA adapter was matched against the base model's chain,
// while the engine's events root the adapter's blocks on its lora_name: routing from events
// never found an adapter's prefix. It is matched against the adapter's chain.
func TestCacheAwareLoRAFollowsEngineEvents(t *testing.T) {
	t.Parallel()
	es, g, gw := eventsFleet(t, sim.Config{Engine: sim.EngineVLLM, LoRAAdapters: []string{"sql-adapter"}})
	waitHealthy(t, es, g)
	routesHome(t, g, gw, es, "sql-adapter", "sql-adapter")
}

// eventsFleet starts two engines of c publishing KV events (their prefix caches on), and a
// cache_aware gateway subscribed to them, with the route header.
func eventsFleet(t *testing.T, c sim.Config) ([]*sim.Engine, *Gateway, string) {
	t.Helper()
	var es []*sim.Engine
	cfg := config.Default()
	cfg.Policy, cfg.RouteHeader = config.PolicyCacheAware, true
	c.PrefixCache, c.KVEvents = true, true
	for i := 0; i < 2; i++ {
		e := simEngine(t, c)
		es = append(es, e)
		cfg.Workers = append(cfg.Workers, config.Worker{URL: e.URL(), KVEventsEndpoint: e.KVEventsEndpoint()})
	}
	g, gw := startGateway(t, cfg)
	return es, g, gw.URL
}

// routesHome caches a prompt for model on one engine ("home", in an order no fallback's turn
// follows), waits until the index knows it from the events (under adapter lora), and checks that
// the gateway sends the prompt's continuation there.
func routesHome(t *testing.T, g *Gateway, gw string, es []*sim.Engine, model, lora string) {
	t.Helper()
	for p, h := range []int{1, 1, 0, 0, 1, 0} {
		home := es[h]
		prompt := fmt.Sprintf("home %d: %s", p, strings.Repeat("a long shared system prompt for this agent ", 8))
		if resp, body := gwtest.PostTimeout(t, home.URL()+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, model, prompt)); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		keys := kvevents.Keys(pdModel, lora, sim.Tokenize(prompt), 16)
		poll.Until(t, "the condition", func() bool { return g.KVEvents.Index.Match(keys)[home.URL()] == len(keys) })
		resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, model, prompt+" and a question"))
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Worker") != home.URL() {
			t.Fatalf("prompt %d: %d, sent to %s, not to %s that holds its prefix (route %s): %s", p, resp.StatusCode,
				resp.Header.Get("X-Baton-Worker"), home.URL(), resp.Header.Get("X-Baton-Route"), body)
		}
	}
}

// Item 16 (should): a retried request reached the engines again under the same X-Request-Id,
// which engines key requests, aborts and some handoffs by. Each attempt has its own engine id;
// the client's id stays in the response.
func TestRetriesUseAFreshEngineRequestID(t *testing.T) {
	t.Parallel()
	ids := make(chan string, 8)
	var n atomic.Int32
	engine := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return
		}
		io.ReadAll(r.Body)
		ids <- r.Header.Get("X-Request-Id")
		if n.Add(1) == 1 {
			w.WriteHeader(503)
			io.WriteString(w, `{"error":{"message":"busy"}}`)
			return
		}
		io.WriteString(w, `{"choices":[]}`)
	})
	cfg := testConfig(engine.URL)
	cfg.CircuitBreaker.Disable = true
	_, gw := startGateway(t, cfg)
	resp := post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"x"}`, "X-Request-Id", "client-id-1")
	if resp.StatusCode != 200 || resp.Header.Get("X-Request-Id") != "client-id-1" {
		t.Fatalf("%d, X-Request-Id %q", resp.StatusCode, resp.Header.Get("X-Request-Id"))
	}
	if first, second := <-ids, <-ids; first != "client-id-1" || second != "client-id-1-retry-2" {
		t.Errorf("engine request ids %q then %q", first, second)
	}
}

// Item 17 (should): /generate on a fleet with no SGLang worker was a retryable 503 saying no
// worker was available; it is a clear 501 naming the reason, never retried.
func TestGenerateWithoutSGLangWorkers(t *testing.T) {
	t.Parallel()
	_, _, g, pdURL := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{})
	regular := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	_, gw := startGateway(t, testConfig(regular.URL()))
	for _, url := range []string{pdURL, gw.URL} {
		resp := post(t, url+"/generate", `{"model":"m","text":"native route","sampling_params":{"max_new_tokens":2}}`)
		e := wantEnvelope(t, resp, 501, "route_not_served")
		if !strings.Contains(e.Error.Message, "SGLang") || !strings.Contains(e.Error.Message, "/v1/completions") {
			t.Errorf("%s: message %q", url, e.Error.Message)
		}
	}
	if v := testutil.ToFloat64(g.Metrics.Retries.WithLabelValues("POST /generate", "status_501")); v != 0 {
		t.Errorf("%v retries", v)
	}
}

// Item 14 (should): vLLM's messages request has no ignore_eos, so a one-token prefill whose
// token is the end of sequence ends by stop and hands nothing off. What Baton does about it is
// visible: none-missing-params (header, counter, log), the answer still right; strict mode
// refuses it.
func TestPDMessagesFirstTokenEOS(t *testing.T) {
	t.Parallel()
	agg := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	var prompt string
	for i := 0; i < 400 && prompt == ""; i++ {
		p := fmt.Sprintf("ends at once %d", i)
		_, b := gwtest.PostTimeout(t, agg.URL()+"/v1/messages", fmt.Sprintf(`{"model":"m","max_tokens":1,"ignore_eos":true,"messages":[{"role":"user","content":%q}]}`, p))
		if strings.Contains(b, `"stop_reason":"end_turn"`) {
			prompt = p
		}
	}
	if prompt == "" {
		t.Fatal("no prompt whose first token ends the sequence")
	}
	body := fmt.Sprintf(`{"model":"m","max_tokens":8,"messages":[{"role":"user","content":%q}]}`, prompt)
	_, want := gwtest.PostTimeout(t, agg.URL()+"/v1/messages", body)
	for _, strict := range []bool{false, true} {
		_, _, g, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{}, func(c *config.Config) { c.PDRequireHandoff = strict })
		resp, got := gwtest.PostTimeout(t, gw+"/v1/messages", body)
		if strict {
			if resp.StatusCode != 502 || !strings.Contains(got, "kv_handoff_unavailable") {
				t.Errorf("strict: %d %s", resp.StatusCode, got)
			}
			continue
		}
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-missing-params" || gwtest.StripIDs(got) != gwtest.StripIDs(want) {
			t.Errorf("%d, handoff %q:\n%s\nwant\n%s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), got, want)
		}
		if v := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("none-missing-params", pd.HandoffClass("none-missing-params"), "nixl")); v != 1 {
			t.Errorf("none-missing-params counted %v", v)
		}
	}
}

// Item 18 (should): one vLLM release answers the Mooncake bootstrap server's /query keyed by
// engine id, and 503 until every worker registered; Baton learned nothing from it until a later
// health probe, and every request recomputed. Both shapes are read, and a 503 is asked again
// soon.
func TestMooncakeEngineIDsFromBothQueryShapes(t *testing.T) {
	t.Parallel()
	for _, dp := range []int{1, 2} {
		p, _, _, gw := vllmPD(t, "MooncakeConnector",
			sim.Config{EngineID: "by-engine", DPSize: dp, MooncakeQueryByEngineID: true, MooncakeRegistering: 600 * time.Millisecond}, sim.Config{},
			func(c *config.Config) { c.Workers[0].KVEngineID = "" },
			func(c *config.Config) { c.HealthCheck.Interval = time.Hour }) // no probe to learn it later
		for i := 0; i < 4; i++ {
			resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"by engine id `+strings.Repeat("q", i)+`","max_tokens":2}`)
			if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "mooncake" || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
				t.Fatalf("dp %d request %d: %d, handoff %q, KV %q: %s", dp, i, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), body)
			}
		}
		if s := p.Stats(); s.HandoffsPinned != 4 {
			t.Errorf("dp %d: %d handoffs pinned, want 4", dp, s.HandoffsPinned)
		}
	}
}

// Item 15 (should): NIXL's pull and push connectors are accepted and never paired with each
// other (their handshake fails); a MultiConnector prefill hands off through the connector its
// --kv-transfer-config wraps.
func TestPDConnectorVariantsAndMultiConnector(t *testing.T) {
	t.Parallel()
	p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	pull := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	push := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	multi := `{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":{"connectors":[{"kv_connector":"NixlConnector","kv_role":"kv_both"},{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}]}}`
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: multi},
		{URL: pull.URL(), Role: config.RoleDecode, KVConnector: "NixlPullConnector"}, {URL: push.URL(), Role: config.RoleDecode, KVConnector: "NixlPushConnector"}}
	_, gw := startGateway(t, cfg)
	for i := 0; i < 6; i++ {
		resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"variants `+strings.Repeat("x", i)+`","max_tokens":2}`)
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "nixl" || resp.Header.Get("X-Baton-Decode-Worker") != pull.URL() {
			t.Fatalf("request %d: %d, handoff %q, decode %s: %s", i, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get("X-Baton-Decode-Worker"), body)
		}
	}
	if n := push.Stats().RequestsReceived; n != 0 {
		t.Errorf("the push decode got %d requests of a pull prefill", n)
	}
}

// Item 12 (should): older SGLang hashes each block's tokens alone and names a parent even for a
// prompt's first block, so nothing it announces can be chained from a prompt's start; its
// subscription looked healthy, every precise match was 0, and routing ignored the cache. Such a
// worker is said unindexable (once, in the log and GET /workers) and routed from the
// approximate index.
func TestCacheAwareOlderSGLangHashesFallBack(t *testing.T) {
	t.Parallel()
	es, g, gw := eventsFleet(t, sim.Config{Engine: sim.EngineSGLang, SGLangLegacyHashes: true})
	// What this gateway routed a moment ago counts beside the events for 5 s: shortened, so
	// that the second request of each prompt is routed on what the events (or the approximate
	// index standing in for them) say, not on the first request's routing.
	g.Selector.Policies[config.RoleRegular].(*policy.CacheAware).Speculative = time.Nanosecond
	for i, e := range es {
		w := g.Registry.Snapshot().Workers[i]
		warmUntil(t, e, func() bool {
			v, _ := g.KVEvents.View(w).(*kvfleet.KVEventsView)
			return v != nil && v.Unindexable && !v.Healthy
		})
	}
	for p := 0; p < 6; p++ {
		prompt := fmt.Sprintf("legacy %d: %s", p, strings.Repeat("a long shared system prompt for this tenant ", 8))
		first, body := gwtest.PostTimeout(t, gw+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, pdModel, prompt))
		if first.StatusCode != 200 {
			t.Fatalf("%d %s", first.StatusCode, body)
		}
		again, body := gwtest.PostTimeout(t, gw+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, pdModel, prompt+" and a question"))
		if again.StatusCode != 200 || again.Header.Get("X-Baton-Worker") != first.Header.Get("X-Baton-Worker") ||
			!strings.Contains(again.Header.Get("X-Baton-Route"), "reason=cache_match") {
			t.Fatalf("prompt %d: sent to %s, then to %s (route %s): %s", p, first.Header.Get("X-Baton-Worker"),
				again.Header.Get("X-Baton-Worker"), again.Header.Get("X-Baton-Route"), body)
		}
	}
}

// Item 11 (should): the prefill's DP rank was chosen by turn and load alone, while the index
// knows which rank holds the prompt's prefix; the prefill leg goes to that rank.
func TestPDPrefillRankFollowsTheCachedPrefix(t *testing.T) {
	t.Parallel()
	p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl, DPSize: 2,
		PrefixCache: true, KVEvents: true, KVEventsPerRank: true})
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.PrefillPolicy = config.PolicyCacheAware
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector", DPSize: 2, KVEventsEndpoint: p.KVEventsEndpoint()},
		{URL: d.URL(), Role: config.RoleDecode}}
	g, gw := startGateway(t, cfg)
	waitHealthy(t, []*sim.Engine{p}, g) // every rank's subscription hears its events
	for i, home := range []int{1, 1, 0, 1, 0, 0} {
		prompt := fmt.Sprintf("rank %d: %s", i, strings.Repeat("a long shared system prompt for this rank ", 8))
		req, _ := http.NewRequest(http.MethodPost, p.URL()+"/v1/completions", strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, pdModel, prompt)))
		req.Header.Set("X-Data-Parallel-Rank", fmt.Sprint(home))
		resp, err := http.DefaultClient.Do(req)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("warming rank %d: %v %v", home, err, resp)
		}
		resp.Body.Close()
		keys := kvevents.Keys(pdModel, "", sim.Tokenize(prompt), 16)
		holder := kvevents.Holder{Worker: p.URL(), Rank: home}
		poll.Until(t, "the condition", func() bool { return g.KVEvents.Index.MatchHolders(keys)[holder] == len(keys) })
		before := p.Stats().PrefixCacheHits
		resp2, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, pdModel, prompt+" and a question"))
		if resp2.StatusCode != 200 {
			t.Fatalf("%d %s", resp2.StatusCode, body)
		}
		if hits := p.Stats().PrefixCacheHits - before; hits < int64(16*len(keys)) {
			t.Fatalf("prompt %d: the prefill leg found %d of its tokens cached: it ran on another rank than %d, which holds its prefix", i, hits, home)
		}
	}
}
