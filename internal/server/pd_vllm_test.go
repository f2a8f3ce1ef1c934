package server

// vLLM's sequential dispatch through the HTTP door: the prefill leg first, its
// kv_transfer_params handed to the decode leg (NIXL, Mooncake, or passed through), over a fleet
// of simulated engines.

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// vllmPD starts a simulated vLLM prefill (pc) and decode (dc) handing off through connector
// ("" configures none: passthrough) and a PD gateway over them, retries off (these cases look
// at one attempt) and Mooncake's legs dispatched concurrently, as the configuration's defaults
// have it. prefill, when not nil, changes the prefill worker's configuration; tune changes the
// options after the fleet.
func vllmPD(t *testing.T, connector string, pc, dc sim.Config, prefill func(*config.Worker), tune ...func(*Options)) (p, d *sim.Engine, s *Server, url string) {
	t.Helper()
	pc.Engine, pc.Role = sim.EngineVLLM, sim.RolePrefill
	dc.Engine, dc.Role = sim.EngineVLLM, sim.RoleDecode
	if pc.KVConnector == "" {
		pc.KVConnector = map[string]string{"NixlConnector": sim.ConnectorNixl, "MooncakeConnector": sim.ConnectorMooncake}[connector]
		if pc.KVConnector == "" {
			pc.KVConnector = sim.ConnectorNixl // an engine that could hand off, if asked
		}
	}
	dc.KVConnector = pc.KVConnector
	if pc.EngineID == "" {
		pc.EngineID = "engine-p"
	}
	p, d = pdSim(t, pc), pdSim(t, dc)
	pw := config.Worker{URL: p.URL(), Runtime: config.RuntimeVLLM, KVConnector: connector, KVEngineID: pc.EngineID, Models: []string{"m"}}
	if bp := p.BootstrapPort(); bp != 0 {
		pw.BootstrapPort = &bp
	}
	if prefill != nil {
		prefill(&pw)
	}
	fleet := pdFleet(t, pw, config.Worker{URL: d.URL(), Runtime: config.RuntimeVLLM, Models: []string{"m"}})
	s, url, _ = gateway(t, nil, append([]func(*Options){noRetries, fleet, mooncakeDispatch(config.Default().PDMooncakeDispatch)}, tune...)...)
	return p, d, s, url
}

// sequentialOf is the fleet's sequential executor, set as the configuration sets it.
func sequentialOf(o *Options) *pd.Sequential {
	return o.Dispatcher.(*pd.Dispatcher).Sequential.(*pd.Sequential)
}

// mooncakeDispatch sends Mooncake's legs as pd_mooncake_dispatch says: concurrent or sequential.
func mooncakeDispatch(dispatch string) func(*Options) {
	return func(o *Options) { sequentialOf(o).MooncakeConcurrent = dispatch == "concurrent" }
}

// defaultConnector is --kv-connector: the connector of vLLM prefill workers that name none.
func defaultConnector(name string) func(*Options) {
	return func(o *Options) {
		sequentialOf(o).DefaultConnector, o.Admin.KVConnector = name, name
		o.Director.Selector.Compatible = func(p, d *worker.Worker) bool { return pd.Compatible(p, d, name) }
	}
}

var vllmCases = []struct{ name, route, body string }{
	{"chat", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hand the baton over"}],"max_tokens":6}`},
	{"chat stream", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hand the baton over"}],"max_completion_tokens":6,"stream":true,"stream_options":{"include_usage":true}}`},
	{"completions", "/v1/completions", `{"model":"m","prompt":"the relay has four legs","max_tokens":5}`},
	{"completions stream", "/v1/completions", `{"model":"m","prompt":"the relay has four legs","max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`},
	{"responses", "/v1/responses", `{"model":"m","input":"who runs the anchor leg","max_output_tokens":4}`},
	{"responses stream", "/v1/responses", `{"model":"m","input":"who runs the anchor leg","max_output_tokens":4,"stream":true}`},
	{"messages", "/v1/messages", `{"model":"m","system":"be brief, please","messages":[{"role":"user","content":"pass the baton"}],"max_tokens":5,"stop_sequences":["zzz"]}`},
	{"messages stream", "/v1/messages", `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"pass the baton"}]}],"max_tokens":5,"stream":true}`},
}

// usageOf returns prompt, cached and completion tokens of an answer (the usage chunk when
// streamed), in either API shape; ok is false when the answer has no usage.
func usageOf(t *testing.T, body string) (prompt, cached, completion int, ok bool) {
	t.Helper()
	objs := []string{body}
	if strings.HasPrefix(body, "data: ") || strings.HasPrefix(body, "event: ") {
		objs = nil
		for _, ev := range strings.Split(body, "\n\n") {
			for _, line := range strings.Split(ev, "\n") {
				if d, found := strings.CutPrefix(line, "data: "); found && d != "[DONE]" {
					objs = append(objs, d)
				}
			}
		}
	}
	for i := len(objs) - 1; i >= 0; i-- { // the last usage of a stream is the whole answer's
		var v struct {
			Usage    map[string]any `json:"usage"`
			Response struct {
				Usage map[string]any `json:"usage"`
			} `json:"response"`
		}
		json.Unmarshal([]byte(objs[i]), &v)
		u := v.Usage
		if u == nil {
			u = v.Response.Usage
		}
		if u == nil {
			continue
		}
		num := func(k string) int { f, _ := u[k].(float64); return int(f) }
		if _, has := u["prompt_tokens"]; has {
			d, _ := u["prompt_tokens_details"].(map[string]any)
			c, _ := d["cached_tokens"].(float64)
			return num("prompt_tokens"), int(c), num("completion_tokens"), true
		}
		if _, has := u["cache_read_input_tokens"]; has { // messages
			return num("input_tokens"), num("cache_read_input_tokens"), num("output_tokens"), true
		}
		d, _ := u["input_tokens_details"].(map[string]any)
		c, _ := d["cached_tokens"].(float64)
		return num("input_tokens"), int(c), num("output_tokens"), true
	}
	return 0, 0, 0, false
}

func TestPDSequentialEndToEnd(t *testing.T) {
	t.Parallel()
	for _, conn := range []struct {
		name, connector, dispatch string
	}{{"nixl", "NixlConnector", ""}, {"mooncake concurrent", "MooncakeConnector", "concurrent"}, {"mooncake sequential", "MooncakeConnector", "sequential"}} {
		t.Run(conn.name, func(t *testing.T) {
			var tune []func(*Options)
			if conn.dispatch != "" {
				tune = append(tune, mooncakeDispatch(conn.dispatch))
			}
			p, d, s, gw := vllmPD(t, conn.connector, sim.Config{}, sim.Config{}, nil, tune...)
			agg := pdSim(t, sim.Config{Engine: sim.EngineVLLM})
			mode := map[string]string{"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}[conn.connector]
			handed, recompute := 0, 0
			for _, tc := range vllmCases {
				// vLLM's ResponsesRequest carries no kv_transfer_params: that route is not
				// handed off, visibly, and its decode recomputes the prompt.
				handsOff := tc.route != "/v1/responses"
				_, want := gwtest.PostTimeout(t, agg.URL()+tc.route, tc.body)
				resp, got := gwtest.PostTimeout(t, gw+tc.route, tc.body)
				if resp.StatusCode != 200 {
					t.Fatalf("%s: %d %s", tc.name, resp.StatusCode, got)
				}
				if a, b := gwtest.AnswerText(t, got), gwtest.AnswerText(t, want); a != b || a == "" {
					t.Errorf("%s: PD text %q, aggregated %q", tc.name, a, b)
				}
				wantSource, wantHandoff := sim.SourceRemote, mode
				if !handsOff {
					wantSource, wantHandoff = sim.SourceRecompute, "none-unsupported-route"
				}
				if src := resp.Header.Get(sim.HeaderKVSource); src != wantSource {
					t.Errorf("%s: decode KV source %q, want %q", tc.name, src, wantSource)
				}
				if h := resp.Header.Get("X-Baton-Kv-Handoff"); h != wantHandoff {
					t.Errorf("%s: handoff header %q, want %q", tc.name, h, wantHandoff)
				}
				// Usage as the client should see it: the aggregated engine's numbers.
				wp, wc, wo, wok := usageOf(t, want)
				gp, gc, gotO, gok := usageOf(t, got)
				if wok != gok || wp != gp || wc != gc || wo != gotO {
					t.Errorf("%s: usage prompt/cached/completion %d/%d/%d (%v), want %d/%d/%d (%v)", tc.name, gp, gc, gotO, gok, wp, wc, wo, wok)
				}
				if handsOff {
					handed, recompute = handed+1, recompute+1 // the last prompt token
				} else {
					recompute += wp // the whole prompt
				}
			}
			if st := d.Stats(); st.PromptTokensRecompute != int64(recompute) {
				t.Errorf("decode recomputed %d prompt tokens, want %d (KV loaded remotely where handed off)", st.PromptTokensRecompute, recompute)
			}
			poll.Until(t, "the prefill's handoffs pulled", func() bool { st := p.Stats(); return st.HandoffsPulled == int64(handed) })
			if v := testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues(mode, pd.HandoffClass(mode), mode)); v != float64(handed) {
				t.Errorf("handoff counter %v", v)
			}
		})
	}
}

func TestPDSequentialNGreaterThanOne(t *testing.T) {
	t.Parallel()
	p, d, s, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{}, nil)
	resp, got := gwtest.PostTimeout(t, gw+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"two answers"}],"max_tokens":3,"n":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-n>1" || strings.Count(got, `"index"`) != 2 {
		t.Fatalf("%d %q %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), got)
	}
	if p.Stats().RequestsReceived != 0 || d.Stats().RequestsOK != 1 {
		t.Errorf("prefill contacted (%d) or decode not (%+v)", p.Stats().RequestsReceived, d.Stats())
	}
	if v := testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("none-n>1", pd.HandoffClass("none-n>1"), "nixl")); v != 1 {
		t.Errorf("counter %v", v)
	}
}

// The simulated prefill has two DP ranks with engine ids mc_dp0 and mc_dp1 and serves the rank
// named by X-Data-Parallel-Rank; the decode fails to load KV under a wrong engine id. Every
// request succeeding with remote KV shows the minted id and the rank served agree.
func TestPDSequentialDPRankPinning(t *testing.T) {
	t.Parallel()
	for _, dispatch := range []string{"sequential", "concurrent"} {
		p, d, _, gw := vllmPD(t, "MooncakeConnector", sim.Config{DPSize: 2, EngineID: "mc"}, sim.Config{},
			func(w *config.Worker) { w.DPSize = 2 }, mooncakeDispatch(dispatch))
		for i := 0; i < 4; i++ {
			resp, got := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"ranks and ids","max_tokens":2}`)
			if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
				t.Fatalf("%s request %d: %d %q %s", dispatch, i, resp.StatusCode, resp.Header.Get(sim.HeaderKVSource), got)
			}
		}
		poll.Until(t, "the prefill's handoffs pulled", func() bool { return p.Stats().HandoffsPulled == 4 })
		if d.Stats().KVLoadFailures != 0 {
			t.Errorf("%s: decode %+v", dispatch, d.Stats())
		}
	}
}

// A dp_size label that is no positive integer leaves no engine id to mint: the decode
// recomputes, visibly, and the prefill is not sent. (A Mooncake prefill whose bootstrap server
// cannot tell its engine id is learned at registration: that case stays in package app.)
func TestPDSequentialInvalidDPSizeFailsClosed(t *testing.T) {
	t.Parallel()
	p, d, _, gw := vllmPD(t, "MooncakeConnector", sim.Config{EngineID: "mc"}, sim.Config{},
		func(w *config.Worker) { w.Labels = map[string]string{"dp_size": "zero"} })
	resp, got := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"fail closed","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-no-engine-id" || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRecompute {
		t.Fatalf("%d %q %q %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), got)
	}
	if p.Stats().RequestsReceived != 0 || d.Stats().RequestsOK != 1 {
		t.Errorf("prefill %+v decode %+v", p.Stats(), d.Stats())
	}
}

func TestPDSequentialPassthroughAndStrict(t *testing.T) {
	t.Parallel()
	// No connector configured: the prefill is untagged, returns no params, the decode recomputes
	// — visibly.
	_, _, s, gw := vllmPD(t, "", sim.Config{}, sim.Config{}, nil)
	resp, got := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"silent no more","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-missing-params" || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRecompute {
		t.Fatalf("%d %q %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), got)
	}
	if v := testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("none-missing-params", pd.HandoffClass("none-missing-params"), "passthrough")); v != 1 {
		t.Errorf("counter %v", v)
	}
	// Strict mode: the would-be recompute is a 502.
	_, d2, _, gw2 := vllmPD(t, "", sim.Config{}, sim.Config{}, nil, func(o *Options) { sequentialOf(o).RequireHandoff = true })
	resp, got = gwtest.PostTimeout(t, gw2+"/v1/completions", `{"model":"m","prompt":"strict","max_tokens":2}`)
	var e refusal
	json.Unmarshal([]byte(got), &e)
	if resp.StatusCode != 502 || e.Error.Code != "kv_handoff_unavailable" || resp.Header.Get("X-Baton-Kv-Handoff") != "none-missing-params" {
		t.Errorf("strict: %d %s", resp.StatusCode, got)
	}
	if d2.Stats().RequestsReceived != 0 {
		t.Error("strict mode still sent the decode")
	}
	// A default connector for vLLM prefill workers: --kv-connector.
	_, _, _, gw3 := vllmPD(t, "", sim.Config{}, sim.Config{}, nil, defaultConnector("NixlConnector"))
	if resp, _ := gwtest.PostTimeout(t, gw3+"/v1/completions", `{"model":"m","prompt":"default connector","max_tokens":2}`); resp.Header.Get("X-Baton-Kv-Handoff") != "nixl" {
		t.Errorf("--kv-connector default: %q", resp.Header.Get("X-Baton-Kv-Handoff"))
	}
}

// vllmFake is a vLLM worker's configuration over a fake engine answering with h.
func vllmFake(t *testing.T, connector string, h http.HandlerFunc) config.Worker {
	return config.Worker{URL: engine(t, h), Runtime: config.RuntimeVLLM, KVConnector: connector, Models: []string{"m"}}
}

// Passthrough relays whatever kv_transfer_params the prefill returns, verbatim.
func TestPDSequentialPassthroughRelaysParams(t *testing.T) {
	t.Parallel()
	const params = `{"custom":"connector","ids":[1,2,9007199254740993],"nested":{"x":null}}`
	prefill := vllmFake(t, "LMCacheConnectorV1", func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		io.WriteString(w, `{"choices":[{"text":" x"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},"kv_transfer_params":`+params+`}`)
	})
	got := make(chan string, 1)
	decode := vllmFake(t, "", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- string(b)
		io.WriteString(w, `{"choices":[{"text":" y"}]}`)
	})
	_, gw, _ := gateway(t, nil, pdFleet(t, prefill, decode))
	resp, out := post(t, gw+"/v1/completions", `{"model":"m","prompt":"a b c","kv_transfer_params":{"client":"forged"}}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "passthrough" {
		t.Fatalf("%d %q %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), out)
	}
	if b := <-got; b != `{"model":"m","prompt":"a b c","kv_transfer_params":`+params+`}` {
		t.Errorf("decode body %s", b)
	}
}

func TestPrefillProbePerRoute(t *testing.T) {
	t.Parallel()
	got := make(chan string, 8)
	prefill := vllmFake(t, "NixlConnector", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- string(b)
		io.WriteString(w, `{"kv_transfer_params":null}`)
	})
	decode := vllmFake(t, "", func(w http.ResponseWriter, r *http.Request) { io.ReadAll(r.Body); io.WriteString(w, "{}") })
	_, gw, _ := gateway(t, nil, pdFleet(t, prefill, decode))
	tag := `"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}`
	for _, tc := range []struct{ route, in, want string }{
		{"/v1/chat/completions",
			`{"model":"m","messages":[{"role":"user","content":"caf\u00e9"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"min_tokens":5,"stop":["x"],"stop_token_ids":[2],"n":1,"seed":9007199254740993,"extra":{"k":[1,2]},"kv_transfer_params":{"forged":true}}`,
			`{"model":"m","messages":[{"role":"user","content":"caf\u00e9"}],"stream":false,"max_tokens":1,"n":1,"seed":9007199254740993,"extra":{"k":[1,2]},"ignore_eos":true,` + tag + `}`}, // the client's kv_transfer_params never reach an engine
		{"/v1/chat/completions",
			`{"model":"m","messages":[],"max_completion_tokens":50,"max_tokens":40}`,
			`{"model":"m","messages":[],"max_completion_tokens":1,"stream":false,"ignore_eos":true,` + tag + `}`},
		{"/v1/completions",
			`{"model":"m","prompt":"p","ignore_eos":false,"logprobs":2}`,
			`{"model":"m","prompt":"p","ignore_eos":true,"logprobs":2,"stream":false,"max_tokens":1,` + tag + `}`},
		{"/v1/messages", // stop_sequences is the messages API's stop: a stop on the one token loses the handoff
			`{"model":"m","max_tokens":100,"messages":[{"role":"user","content":"hi"}],"stop_sequences":["\n"]}`,
			`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}],"stream":false,"ignore_eos":true,` + tag + `}`},
	} {
		post(t, gw+tc.route, tc.in)
		if probe := <-got; probe != tc.want {
			t.Errorf("%s probe\n got %s\nwant %s", tc.route, probe, tc.want)
		}
	}
	// vLLM's responses route takes no kv_transfer_params: no prefill is wasted on it.
	resp, _ := post(t, gw+"/v1/responses", `{"model":"m","input":"hi","max_output_tokens":30}`)
	if h := resp.Header.Get("X-Baton-Kv-Handoff"); resp.StatusCode != 200 || h != "none-unsupported-route" {
		t.Errorf("/v1/responses: %d, handoff %q, want none-unsupported-route", resp.StatusCode, h)
	}
	select {
	case probe := <-got:
		t.Errorf("/v1/responses sent a prefill: %s", probe)
	default:
	}
}

func TestPDSequentialFailures(t *testing.T) {
	t.Parallel()
	const body = `{"model":"m","prompt":"failure branches","max_tokens":3}`
	for _, status := range []int{408, 429, 503} {
		_, d, s, gw := vllmPD(t, "NixlConnector", sim.Config{Faults: sim.Faults{Status: status}}, sim.Config{}, nil)
		resp, got := gwtest.PostTimeout(t, gw+"/v1/completions", body)
		var e refusal
		json.Unmarshal([]byte(got), &e)
		if resp.StatusCode != status || e.Error.Code != "prefill_upstream_error" || !strings.Contains(e.Error.Message, "injected fault") {
			t.Errorf("prefill %d: got %d %s", status, resp.StatusCode, got)
		}
		if d.Stats().RequestsReceived != 0 {
			t.Errorf("prefill %d: decode contacted", status)
		}
		ws := workersOf(s)
		_, pf := ws[0].Outcomes()
		dok, df := ws[1].Outcomes()
		if wantPF := map[int]int64{408: 1, 429: 0, 503: 1}[status]; pf != wantPF || dok != 0 || df != 0 {
			t.Errorf("prefill %d: prefill failures %d (want %d), decode samples %d/%d", status, pf, wantPF, dok, df)
		}
	}
	t.Run("prefill transport error", func(t *testing.T) {
		p, d, s, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{}, nil)
		p.Close()
		resp, got := gwtest.PostTimeout(t, gw+"/v1/completions", body)
		if resp.StatusCode != 502 || !strings.Contains(got, "prefill_upstream_unreachable") || d.Stats().RequestsReceived != 0 {
			t.Errorf("%d %s", resp.StatusCode, got)
		}
		if _, df := workersOf(s)[1].Outcomes(); df != 0 {
			t.Error("decode penalised")
		}
	})
	t.Run("decode failure after a good prefill", func(t *testing.T) {
		p, _, s, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{Faults: sim.Faults{Status: 500}}, nil)
		resp, got := gwtest.PostTimeout(t, gw+"/v1/completions", body)
		if resp.StatusCode != 500 || !strings.Contains(got, "decode_upstream_error") {
			t.Errorf("%d %s", resp.StatusCode, got)
		}
		if v := testutil.ToFloat64(s.metrics.PDHandoffsAbandoned.WithLabelValues("nixl")); v != 1 {
			t.Errorf("abandoned %v", v)
		}
		// The refusing decode told the prefill to free the KV at once, as vLLM's serving layer does.
		if st := p.Stats(); st.HandoffsPinned != 1 || st.HandoffsReleased != 1 || len(pinnedOn(t, p)) != 0 {
			t.Errorf("prefill %+v", st)
		}
		if _, pf := workersOf(s)[0].Outcomes(); pf != 0 {
			t.Error("prefill penalised for the decode's failure")
		}
	})
}

// pinnedOn is the KV blocks e holds for decodes that have not pulled them.
func pinnedOn(t *testing.T, e *sim.Engine) []any {
	t.Helper()
	resp, err := http.Get(e.URL() + "/debug/kv")
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Pinned []any `json:"pinned"`
	}
	json.NewDecoder(resp.Body).Decode(&v)
	resp.Body.Close()
	return v.Pinned
}

func TestPDSequentialClientDisconnect(t *testing.T) {
	t.Parallel()
	t.Run("during prefill", func(t *testing.T) {
		p, d, s, gw := vllmPD(t, "NixlConnector", sim.Config{Faults: sim.Faults{Latency: 5 * time.Second}}, sim.Config{}, nil)
		cancelAfter(t, gw+"/v1/completions", `{"model":"m","prompt":"leaving early","max_tokens":3}`, func() bool { return p.Stats().RequestsReceived == 1 })
		poll.Until(t, "the prefill cancelled", func() bool { return p.Stats().RequestsCancelled == 1 })
		if d.Stats().RequestsReceived != 0 {
			t.Error("decode contacted after the client left")
		}
		ws := workersOf(s)
		poll.Until(t, "no prefill leg in flight", func() bool { return ws[0].InFlight() == 0 })
		if _, f := ws[0].Outcomes(); f != 0 {
			t.Error("client cancel counted against the prefill")
		}
	})
	t.Run("during decode", func(t *testing.T) {
		_, d, s, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{Faults: sim.Faults{Latency: 5 * time.Second}}, nil)
		cancelAfter(t, gw+"/v1/completions", `{"model":"m","prompt":"leaving early","max_tokens":3}`, func() bool { return d.Stats().RequestsReceived == 1 })
		poll.Until(t, "the decode cancelled", func() bool { return d.Stats().RequestsCancelled == 1 })
		poll.Until(t, "the handoff abandoned", func() bool { return testutil.ToFloat64(s.metrics.PDHandoffsAbandoned.WithLabelValues("nixl")) == 1 })
		ws := workersOf(s)
		poll.Until(t, "no decode leg in flight", func() bool { return ws[1].InFlight() == 0 })
	})
}

// cancelAfter sends a request and cancels it once ready reports true.
func cancelAfter(t *testing.T, url, body string, ready func() bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	poll.Until(t, "the leg reached its engine", ready)
	cancel()
	<-done
}

func TestWorkersAdminShowsConnector(t *testing.T) {
	t.Parallel()
	_, _, _, gw := vllmPD(t, "MooncakeConnector", sim.Config{}, sim.Config{}, nil)
	resp, err := http.Get(gw + "/workers")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if body := string(b); !strings.Contains(body, `"kv_connector":"mooncake"`) || !strings.Contains(body, `"role":"decode"`) {
		t.Errorf("/workers %s", body)
	}
}
