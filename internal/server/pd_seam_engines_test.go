package server

// The PD seam through the HTTP door, third pass: each case here failed on the gateway before it,
// against simulators that behave as the engines' current source does. (The cases that need the
// whole gateway — KV-event subscriptions, engine ids learned at registration — stay in package
// app.)

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/sim"
)

// enginesConnectors maps Baton's connector names to the simulator's.
var enginesConnectors = map[string]string{"NixlConnector": sim.ConnectorNixl, "MooncakeConnector": sim.ConnectorMooncake}

// enginesRedecode lets the fleet's sequential executor retry a decode alone on another decode,
// chosen as Baton chooses one, within the retry budget: as the gateway wires it when retries
// are on.
func enginesRedecode(o *Options) {
	x := sequentialOf(o)
	x.RedecodeAttempts = o.Director.Retry.MaxRetries - 1
	x.Redecode = pd.RedecodeOver(o.Director.Selector)
}

// enginesDecodes starts a simulated vLLM prefill handing off through connector and the given
// decodes, and a PD gateway over them: retries on (a decode retried alone too), Mooncake
// dispatched sequentially, and no circuit breaker (the fixture's workers have none), so that
// every decode stays in rotation.
func enginesDecodes(t *testing.T, connector string, decodes []sim.Config) (*sim.Engine, []*sim.Engine, *Server, string) {
	t.Helper()
	mode := enginesConnectors[connector]
	p := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: mode, EngineID: "p"})
	pw := config.Worker{URL: p.URL(), Runtime: config.RuntimeVLLM, KVConnector: connector, KVEngineID: "p", Models: []string{"m"}}
	if bp := p.BootstrapPort(); bp != 0 {
		pw.BootstrapPort = &bp
	}
	var ds []*sim.Engine
	var dws []config.Worker
	for _, dc := range decodes {
		dc.Engine, dc.Role, dc.KVConnector = sim.EngineVLLM, sim.RoleDecode, mode
		d := pdSim(t, dc)
		ds = append(ds, d)
		dws = append(dws, config.Worker{URL: d.URL(), Role: config.RoleDecode, Runtime: config.RuntimeVLLM, Models: []string{"m"}})
	}
	more := func(o *Options) {
		for _, dw := range dws[1:] {
			serving(t, o, dw)
		}
	}
	s, url, _ := gateway(t, nil, pdFleet(t, pw, dws[0]), more, mooncakeDispatch("sequential"), enginesRedecode)
	return p, ds, s, url
}

// A decode that answered (here 503, as vLLM's admission control does) has spent the handoff:
// vLLM's serving layer tells the prefill to free the blocks. Sending the same params to another
// decode read freed blocks and answered 200 with a wrong text. The request starts over with a
// new prefill instead.
func TestPDDecodeAnswerStartsOverWithANewPrefill(t *testing.T) {
	t.Parallel()
	for connector := range enginesConnectors {
		t.Run(connector, func(t *testing.T) {
			t.Parallel()
			p, ds, s, gw := enginesDecodes(t, connector, []sim.Config{{Faults: sim.Faults{Status: 503}}, {}})
			agg := pdSim(t, sim.Config{Engine: sim.EngineVLLM})
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
			st := p.Stats()
			if st.StaleKVReads != 0 {
				t.Errorf("%d decodes read KV the prefill had freed", st.StaleKVReads)
			}
			if st.HandoffsReleased == 0 || st.RequestsReceived != n+st.HandoffsReleased {
				t.Errorf("prefill served %d requests, %d handoffs released by the busy decode: want one new prefill per refusal", st.RequestsReceived, st.HandoffsReleased)
			}
			if v := testutil.ToFloat64(s.metrics.PDDecodeRetries); v != 0 {
				t.Errorf("%v decodes retried alone after an answer", v)
			}
		})
	}
}

// The other side: a decode whose connection cannot even be opened never saw the request, so
// the KV is still pinned: the decode alone goes to another worker with the same handoff, and
// the prefill is not run again.
func TestPDDecodeUnreachableRetriedAlone(t *testing.T) {
	t.Parallel()
	for connector := range enginesConnectors {
		t.Run(connector, func(t *testing.T) {
			t.Parallel()
			p, ds, s, gw := enginesDecodes(t, connector, []sim.Config{{}, {}})
			// In the fleet, then gone: its port refuses connections. (A pooled connection to it
			// would fail with a reset rather than a refusal — the engine might have read the
			// request: no decode-alone retry; nothing was sent to it yet, and as when a worker
			// leaves the fleet, its idle connections are closed.)
			ds[0].Close()
			proxy.CloseIdle(s.opts.Proxy.Transport, ds[0].URL())
			const n = 6
			for i := 0; i < n; i++ {
				resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"unreachable `+strings.Repeat("u", i)+`","max_tokens":2}`)
				if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
					t.Fatalf("request %d: %d, KV %q: %s", i, resp.StatusCode, resp.Header.Get(sim.HeaderKVSource), body)
				}
			}
			if st := p.Stats(); st.RequestsReceived != n || st.StaleKVReads != 0 {
				t.Errorf("the prefill served %d requests for %d (%d stale reads): an unreachable decode re-ran it", st.RequestsReceived, n, st.StaleKVReads)
			}
			if v := testutil.ToFloat64(s.metrics.PDDecodeRetries); v == 0 {
				t.Error("no decode was retried alone")
			}
		})
	}
}

// A client's kv_transfer_params reached a vLLM engine on the regular path (pinning KV for
// minutes, or making the engine connect where the client said), and SGLang's bootstrap and DP
// rank fields likewise. Baton owns them: they never reach an engine from a client, on any route,
// while every other byte passes unchanged.
func TestClientNeverSetsHandoffFields(t *testing.T) {
	t.Parallel()
	got := make(chan string, 8)
	record := func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- string(b)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"x"}]}`)
	}
	_, gw, _ := gateway(t, nil, func(o *Options) {
		serving(t, o, config.Worker{URL: engine(t, record), Runtime: config.RuntimeVLLM, Models: []string{"m"}})
		serving(t, o, config.Worker{URL: engine(t, record), Runtime: config.RuntimeSGLang, Models: []string{"m"}})
	})
	body := `{"model":"m","prompt":"p","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.0.0.1","remote_port":1},` +
		`"x":18446744073709551617,"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":7,"bootstrap_pair_key":"k",` +
		`"routed_dp_rank":1,"disagg_prefill_dp_rank":1,"data_parallel_rank":1,"u":"\u00e9"}`
	for _, route := range []string{"/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses", "/v1/messages"} {
		resp, answer := gwtest.PostTimeout(t, gw+route, body)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", route, resp.StatusCode, answer)
		}
		// An SGLang engine is given Baton's own rid on the routes it names answers on.
		want := `{"model":"m","prompt":"p","x":18446744073709551617,"u":"\u00e9"}`
		sglang := want[:len(want)-1] + `,"rid":"` + routes.Of(route).AnswerID + resp.Header.Get("X-Request-Id") + `"}`
		if b := <-got; b != want && (b != sglang || route == "/v1/responses" || route == "/v1/messages") {
			t.Errorf("%s: the engine received\n%s\nwant\n%s", route, b, want)
		}
	}
}

// SGLang's /v1/responses drops the bootstrap fields, so its legs never met and the decode
// waited out its bootstrap timeout. On SGLang pairs it is refused at once, clearly, and no leg
// is sent.
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

// A prompt_embeds list is a batch like a prompt list: counted against max_batch_size, and never
// handed off as one request.
func TestPDPromptEmbedsListIsABatch(t *testing.T) {
	t.Parallel()
	p, _, _, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{}, nil, func(o *Options) { o.Director.MaxBatchSize = 2 })
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

// The decode's own usage is the engine's only word on whether it used the KV. A decode that was
// handed params but computed the prompt (here its connector reads none of them: a silent
// recompute) used to be reported as a NIXL handoff; now it is "recomputed", in the header of a
// whole answer and the counter (and the log), for streams too.
func TestPDDecodeThatComputedThePromptIsARecompute(t *testing.T) {
	t.Parallel()
	p := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	d := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorMooncake})
	s, gw, _ := gateway(t, nil, pdFleet(t,
		config.Worker{URL: p.URL(), Runtime: config.RuntimeVLLM, KVConnector: "NixlConnector", Models: []string{"m"}},
		config.Worker{URL: d.URL(), Runtime: config.RuntimeVLLM, Models: []string{"m"}}))
	resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"computed again after all","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "recomputed" || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRecompute {
		t.Fatalf("%d, handoff %q, KV %q: %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), body)
	}
	resp, body = gwtest.PostTimeout(t, gw+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"again"}],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}`)
	if resp.StatusCode != 200 || !strings.Contains(body, "[DONE]") {
		t.Fatalf("stream: %d %s", resp.StatusCode, body)
	}
	poll.Until(t, "both recomputes counted", func() bool {
		return testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("recomputed", pd.HandoffClass("recomputed"), "nixl")) == 2
	})
	if v := testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("nixl", pd.HandoffClass("nixl"), "nixl")); v != 0 {
		t.Errorf("%v recomputes counted as NIXL handoffs", v)
	}
}

// A stream the engine answered 200 and then failed inside (a KV load failure, an SGLang
// transfer abort) was counted as a success. The client still gets every byte as the engine sent
// it; the request is counted as failed, against the worker that failed it.
func TestStreamErrorsInsideTheStreamAreFailures(t *testing.T) {
	t.Parallel()
	const stream = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n" +
		"data: {\"error\": {\"message\": \"KV load failed\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\ndata: [DONE]\n\n"
	failing := func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, stream)
	}
	t.Run("regular", func(t *testing.T) {
		t.Parallel()
		e := engine(t, failing)
		s, gw, ws := gateway(t, []string{e}) // no circuit breaker
		resp, body := gwtest.PostTimeout(t, gw+"/v1/chat/completions", `{"model":"m","messages":[],"stream":true}`)
		if resp.StatusCode != 200 || body != stream {
			t.Fatalf("%d, the client got\n%q\nwant the engine's bytes\n%q", resp.StatusCode, body, stream)
		}
		poll.Until(t, "the in-band error counted", func() bool {
			return testutil.ToFloat64(s.metrics.UpstreamErrors.WithLabelValues(e, "in_band")) == 1
		})
		if _, failures := ws[0].Outcomes(); failures != 1 {
			t.Errorf("the worker's failures: %d, want 1", failures)
		}
	})
	t.Run("pd decode", func(t *testing.T) {
		t.Parallel()
		p := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
		s, gw, _ := gateway(t, nil, pdFleet(t,
			config.Worker{URL: p.URL(), Runtime: config.RuntimeVLLM, KVConnector: "NixlConnector", Models: []string{"m"}},
			vllmFake(t, "", failing)))
		resp, body := gwtest.PostTimeout(t, gw+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}`)
		if resp.StatusCode != 200 || body != stream {
			t.Fatalf("%d, the client got\n%q\nwant the engine's bytes\n%q", resp.StatusCode, body, stream)
		}
		poll.Until(t, "the decode failure counted", func() bool {
			return testutil.ToFloat64(s.metrics.PDRequests.WithLabelValues("m", "sequential", "decode_failed")) == 1
		})
		if v := testutil.ToFloat64(s.metrics.PDRequests.WithLabelValues("m", "sequential", "success")); v != 0 {
			t.Errorf("counted as %v successes", v)
		}
		if v := testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("none-failed", pd.HandoffClass("none-failed"), "nixl")); v != 1 {
			t.Errorf("none-failed counted %v times", v)
		}
	})
}

// SGLang runs each of n samples as a request of its own and gives a scalar room r to sample k
// as r + k; with one routed_dp_rank beside it, the samples whose room fell on another rank
// failed follow_bootstrap_room. Baton sends one scalar room and pins no rank: every sample meets
// its decode, and the answer is the aggregated one.
func TestPDSGLangSamplesOnDataParallelRanks(t *testing.T) {
	t.Parallel()
	_, _, _, gw := sglangPD(t, sim.Config{DPSize: 2}, sim.Config{DPSize: 2}, dpSizes(2, 2))
	agg := pdSim(t, sim.Config{Engine: sim.EngineSGLang})
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

// A retried request reached the engines again under the same X-Request-Id, which engines key
// requests, aborts and some handoffs by. Each attempt has its own engine id; the client's id
// stays in the response.
func TestRetriesUseAFreshEngineRequestID(t *testing.T) {
	t.Parallel()
	e, ids := busyOnce(t)
	_, gw, _ := gateway(t, []string{e}) // no circuit breaker: the one worker is tried again
	resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"x"}`, "X-Request-Id", "client-id-1")
	if resp.StatusCode != 200 || resp.Header.Get("X-Request-Id") != "client-id-1" {
		t.Fatalf("%d, X-Request-Id %q: %s", resp.StatusCode, resp.Header.Get("X-Request-Id"), body)
	}
	if first, second := <-ids, <-ids; first != "client-id-1" || second != "client-id-1-retry-2" {
		t.Errorf("engine request ids %q then %q", first, second)
	}
}

// /generate on a fleet with no SGLang worker was a retryable 503 saying no worker was
// available; it is a clear 501 naming the reason, never retried (retries are on, in PD and
// regular mode alike).
func TestGenerateWithoutSGLangWorkers(t *testing.T) {
	t.Parallel()
	_, _, ps, pdURL := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{}, nil, func(o *Options) { o.Director.Retry.Disable = false })
	regular := pdSim(t, sim.Config{Engine: sim.EngineVLLM})
	rs, gw, _ := gateway(t, []string{regular.URL()})
	for _, url := range []string{pdURL, gw} {
		resp, body := post(t, url+"/generate", `{"model":"m","text":"native route","sampling_params":{"max_new_tokens":2}}`)
		e := wantRefusal(t, resp, body, 501, "route_not_served")
		if !strings.Contains(e.Error.Message, "SGLang") || !strings.Contains(e.Error.Message, "/v1/completions") {
			t.Errorf("%s: message %q", url, e.Error.Message)
		}
	}
	for _, s := range []*Server{ps, rs} {
		if v := testutil.ToFloat64(s.metrics.Retries.WithLabelValues("POST /generate", "status_501")); v != 0 {
			t.Errorf("%v retries", v)
		}
	}
}

// vLLM's messages request has no ignore_eos, so a one-token prefill whose token is the end of
// sequence ends by stop and hands nothing off. What Baton does about it is visible:
// none-missing-params (header, counter, log), the answer still right; strict mode refuses it.
func TestPDMessagesFirstTokenEOS(t *testing.T) {
	t.Parallel()
	agg := pdSim(t, sim.Config{Engine: sim.EngineVLLM})
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
		_, _, s, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{}, nil, func(o *Options) { sequentialOf(o).RequireHandoff = strict })
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
		if v := testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("none-missing-params", pd.HandoffClass("none-missing-params"), "nixl")); v != 1 {
			t.Errorf("none-missing-params counted %v", v)
		}
	}
}

// NIXL's pull and push connectors are accepted and never paired with each other (their
// handshake fails); a MultiConnector prefill hands off through the connector its
// --kv-transfer-config wraps.
func TestPDConnectorVariantsAndMultiConnector(t *testing.T) {
	t.Parallel()
	p := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	pull := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	push := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	multi := `{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":{"connectors":[{"kv_connector":"NixlConnector","kv_role":"kv_both"},{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}]}}`
	pushDecode := func(o *Options) {
		serving(t, o, config.Worker{URL: push.URL(), Role: config.RoleDecode, Runtime: config.RuntimeVLLM, KVConnector: "NixlPushConnector", Models: []string{"m"}})
	}
	_, gw, _ := gateway(t, nil, pdFleet(t,
		config.Worker{URL: p.URL(), Runtime: config.RuntimeVLLM, KVConnector: multi, Models: []string{"m"}},
		config.Worker{URL: pull.URL(), Runtime: config.RuntimeVLLM, KVConnector: "NixlPullConnector", Models: []string{"m"}}), pushDecode)
	for i := 0; i < 6; i++ {
		resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"variants `+strings.Repeat("x", i)+`","max_tokens":2}`)
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "nixl" || resp.Header.Get("X-Baton-Decode-Worker") != pull.URL() {
			t.Fatalf("request %d: %d, handoff %q, decode %s: %s", i, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get("X-Baton-Decode-Worker"), body)
		}
	}
	if n := push.Stats().RequestsReceived; n != 0 {
		t.Errorf("the push decode got %d requests of a pull prefill", n)
	}
}

// busyOnce is an engine that answers its first request 503 and the others 200, and gives the
// X-Request-Id of each request it got.
func busyOnce(t *testing.T) (string, <-chan string) {
	ids := make(chan string, 8)
	var n atomic.Int32
	return engine(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		ids <- r.Header.Get("X-Request-Id")
		if n.Add(1) == 1 {
			w.WriteHeader(503)
			io.WriteString(w, `{"error":{"message":"busy"}}`)
			return
		}
		io.WriteString(w, `{"choices":[]}`)
	}), ids
}

// A retry's engine request id stays within the length Baton takes from a client, however long
// the client's own: a Baton in front of another Baton would otherwise see the inner one replace
// its retries' ids, and refuse their echoed answers as another request's.
func TestARetryIDStaysWithinTheIDBound(t *testing.T) {
	t.Parallel()
	e, ids := busyOnce(t)
	_, gw, _ := gateway(t, []string{e})
	long := strings.Repeat("r", openai.MaxRequestIDLen)
	if resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"x"}`, "X-Request-Id", long); resp.StatusCode != 200 {
		t.Fatalf("%d: %s", resp.StatusCode, body)
	}
	first, second := <-ids, <-ids
	if first != long || len(second) > openai.MaxRequestIDLen || !strings.HasSuffix(second, "-retry-2") || second == first {
		t.Errorf("engine request ids %q then %q (%d bytes)", first, second, len(second))
	}
	h := http.Header{"X-Request-Id": {second}}
	if got := openai.RequestID(h); got != second {
		t.Errorf("a Baton behind would replace the retry's id %q with %q", second, got)
	}
}
