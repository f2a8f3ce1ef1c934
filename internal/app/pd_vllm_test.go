package app

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// vllmPD starts a vLLM prefill and decode pair and a PD gateway over them.
func vllmPD(t *testing.T, connector string, pc, dc sim.Config, tweak ...func(*config.Config)) (p, d *sim.Engine, g *Gateway, url string) {
	t.Helper()
	cfg, p, d := vllmPair(t, connector, pc, dc)
	cfg.Retry.Disable = true // these tests look at one attempt; retries are tested on their own
	g, srv := startGateway(t, cfg, tweak...)
	return p, d, g, srv.URL
}

// vllmPair starts a vLLM prefill and decode pair handing off through connector, and returns a
// PD configuration over them.
func vllmPair(t *testing.T, connector string, pc, dc sim.Config) (cfg config.Config, p, d *sim.Engine) {
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
	p, d = simEngine(t, pc), simEngine(t, dc)
	cfg = config.Default()
	cfg.PDDisaggregation = true
	pw := config.Worker{URL: p.URL(), Role: config.RolePrefill, KVConnector: connector, KVEngineID: pc.EngineID}
	if bp := p.BootstrapPort(); bp != 0 {
		pw.BootstrapPort = &bp
	}
	cfg.Workers = []config.Worker{pw, {URL: d.URL(), Role: config.RoleDecode}}
	return cfg, p, d
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
			p, d, g, gw := vllmPD(t, conn.connector, sim.Config{}, sim.Config{}, func(c *config.Config) {
				if conn.dispatch != "" {
					c.PDMooncakeDispatch = conn.dispatch
				}
			})
			agg := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
			handed, recompute := 0, 0
			for _, tc := range vllmCases {
				// vLLM's ResponsesRequest carries no kv_transfer_params: that route is not
				// handed off, visibly, and its decode recomputes the prompt.
				handsOff := tc.route != "/v1/responses"
				_, want := postTimeout(t, agg.URL()+tc.route, tc.body)
				resp, got := postTimeout(t, gw+tc.route, tc.body)
				if resp.StatusCode != 200 {
					t.Fatalf("%s: %d %s", tc.name, resp.StatusCode, got)
				}
				if a, b := answerText(t, got), answerText(t, want); a != b || a == "" {
					t.Errorf("%s: PD text %q, aggregated %q", tc.name, a, b)
				}
				wantSource, wantHandoff := sim.SourceRemote, map[string]string{"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}[conn.connector]
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
			if s := d.Stats(); s.PromptTokensRecompute != int64(recompute) {
				t.Errorf("decode recomputed %d prompt tokens, want %d (KV loaded remotely where handed off)", s.PromptTokensRecompute, recompute)
			}
			poll.Until(t, "the condition", func() bool { s := p.Stats(); return s.HandoffsPulled == int64(handed) })
			if v := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues(map[string]string{"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}[conn.connector], pd.HandoffClass(map[string]string{"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}[conn.connector]), map[string]string{"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}[conn.connector])); v != float64(handed) {
				t.Errorf("handoff counter %v", v)
			}
		})
	}
}

func TestPDSequentialNGreaterThanOne(t *testing.T) {
	t.Parallel()
	p, d, g, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{})
	resp, got := postTimeout(t, gw+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"two answers"}],"max_tokens":3,"n":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-n>1" || strings.Count(got, `"index"`) != 2 {
		t.Fatalf("%d %q %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), got)
	}
	if p.Stats().RequestsReceived != 0 || d.Stats().RequestsOK != 1 {
		t.Errorf("prefill contacted (%d) or decode not (%+v)", p.Stats().RequestsReceived, d.Stats())
	}
	if v := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("none-n>1", pd.HandoffClass("none-n>1"), "nixl")); v != 1 {
		t.Errorf("counter %v", v)
	}
}

// The simulated prefill has two DP ranks with engine ids mc_dp0 and mc_dp1 and serves the rank
// named by X-Data-Parallel-Rank; the decode fails to load KV under a wrong engine id. Every
// request succeeding with remote KV shows the minted id and the rank served agree.
func TestPDSequentialDPRankPinning(t *testing.T) {
	t.Parallel()
	for _, dispatch := range []string{"sequential", "concurrent"} {
		p, d, _, gw := vllmPD(t, "MooncakeConnector", sim.Config{DPSize: 2, EngineID: "mc"}, sim.Config{}, func(c *config.Config) {
			c.Workers[0].DPSize = 2
			c.PDMooncakeDispatch = dispatch
		})
		for i := 0; i < 4; i++ {
			resp, got := postTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"ranks and ids","max_tokens":2}`)
			if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
				t.Fatalf("%s request %d: %d %q %s", dispatch, i, resp.StatusCode, resp.Header.Get(sim.HeaderKVSource), got)
			}
		}
		poll.Until(t, "the condition", func() bool { return p.Stats().HandoffsPulled == 4 })
		if d.Stats().KVLoadFailures != 0 {
			t.Errorf("%s: decode %+v", dispatch, d.Stats())
		}
	}
}

func TestPDSequentialInvalidDPSizeFailsClosed(t *testing.T) {
	t.Parallel()
	p, d, _, gw := vllmPD(t, "MooncakeConnector", sim.Config{EngineID: "mc"}, sim.Config{}, func(c *config.Config) {
		c.Workers[0].Labels = map[string]string{"dp_size": "zero"}
	})
	resp, got := postTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"fail closed","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-no-engine-id" || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRecompute {
		t.Fatalf("%d %q %q %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), got)
	}
	if p.Stats().RequestsReceived != 0 || d.Stats().RequestsOK != 1 {
		t.Errorf("prefill %+v decode %+v", p.Stats(), d.Stats())
	}
	// Without an engine id at all, and a bootstrap server that cannot tell one: the same.
	closed := 1
	_, _, _, gw2 := vllmPD(t, "MooncakeConnector", sim.Config{}, sim.Config{}, func(c *config.Config) {
		c.Workers[0].KVEngineID, c.Workers[0].BootstrapPort = "", &closed
	})
	if resp, _ := postTimeout(t, gw2+"/v1/completions", `{"model":"m","prompt":"no id","max_tokens":2}`); resp.Header.Get("X-Baton-Kv-Handoff") != "none-no-engine-id" {
		t.Errorf("no engine id: %q", resp.Header.Get("X-Baton-Kv-Handoff"))
	}
}

func TestPDSequentialPassthroughAndStrict(t *testing.T) {
	t.Parallel()
	// No connector configured: the prefill is untagged, returns no params, the decode recomputes
	// — visibly.
	_, d, g, gw := vllmPD(t, "", sim.Config{}, sim.Config{})
	resp, got := postTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"silent no more","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-missing-params" || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRecompute {
		t.Fatalf("%d %q %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), got)
	}
	if v := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("none-missing-params", pd.HandoffClass("none-missing-params"), "passthrough")); v != 1 {
		t.Errorf("counter %v", v)
	}
	_ = d
	// Strict mode: the would-be recompute is a 502.
	_, d2, _, gw2 := vllmPD(t, "", sim.Config{}, sim.Config{}, func(c *config.Config) { c.PDRequireHandoff = true })
	resp, got = postTimeout(t, gw2+"/v1/completions", `{"model":"m","prompt":"strict","max_tokens":2}`)
	var e envelope
	json.Unmarshal([]byte(got), &e)
	if resp.StatusCode != 502 || e.Error.Code != "kv_handoff_unavailable" || resp.Header.Get("X-Baton-Kv-Handoff") != "none-missing-params" {
		t.Errorf("strict: %d %s", resp.StatusCode, got)
	}
	if d2.Stats().RequestsReceived != 0 {
		t.Error("strict mode still sent the decode")
	}
	// A default connector for vLLM prefill workers: --kv-connector.
	_, _, _, gw3 := vllmPD(t, "", sim.Config{}, sim.Config{}, func(c *config.Config) { c.KVConnector = "NixlConnector" })
	if resp, _ := postTimeout(t, gw3+"/v1/completions", `{"model":"m","prompt":"default connector","max_tokens":2}`); resp.Header.Get("X-Baton-Kv-Handoff") != "nixl" {
		t.Errorf("--kv-connector default: %q", resp.Header.Get("X-Baton-Kv-Handoff"))
	}
}

// Passthrough relays whatever kv_transfer_params the prefill returns, verbatim.
func TestPDSequentialPassthroughRelaysParams(t *testing.T) {
	t.Parallel()
	const params = `{"custom":"connector","ids":[1,2,9007199254740993],"nested":{"x":null}}`
	prefill := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		io.WriteString(w, `{"choices":[{"text":" x"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},"kv_transfer_params":`+params+`}`)
	})
	got := make(chan string, 1)
	decode := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- string(b)
		io.WriteString(w, `{"choices":[{"text":" y"}]}`)
	})
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Workers = []config.Worker{{URL: prefill.URL, Role: config.RolePrefill, KVConnector: "LMCacheConnectorV1"}, {URL: decode.URL, Role: config.RoleDecode}}
	_, gw := startGateway(t, cfg)
	resp := post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"a b c","kv_transfer_params":{"client":"forged"}}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "passthrough" {
		t.Fatalf("%d %q", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"))
	}
	if b := <-got; b != `{"model":"m","prompt":"a b c","kv_transfer_params":`+params+`}` {
		t.Errorf("decode body %s", b)
	}
}

func TestPrefillProbePerRoute(t *testing.T) {
	t.Parallel()
	got := make(chan string, 8)
	prefill := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- string(b)
		io.WriteString(w, `{"kv_transfer_params":null}`)
	})
	decode := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) { io.ReadAll(r.Body); io.WriteString(w, "{}") })
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Workers = []config.Worker{{URL: prefill.URL, Role: config.RolePrefill, KVConnector: "NixlConnector"}, {URL: decode.URL, Role: config.RoleDecode}}
	_, gw := startGateway(t, cfg)
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
		post(t, gw.URL+tc.route, tc.in)
		if probe := <-got; probe != tc.want {
			t.Errorf("%s probe\n got %s\nwant %s", tc.route, probe, tc.want)
		}
	}
	// vLLM's responses route takes no kv_transfer_params: no prefill is wasted on it.
	resp := post(t, gw.URL+"/v1/responses", `{"model":"m","input":"hi","max_output_tokens":30}`)
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
		p, d, g, gw := vllmPD(t, "NixlConnector", sim.Config{Faults: sim.Faults{Status: status}}, sim.Config{})
		_ = p
		resp, got := postTimeout(t, gw+"/v1/completions", body)
		var e envelope
		json.Unmarshal([]byte(got), &e)
		if resp.StatusCode != status || e.Error.Code != "prefill_upstream_error" || !strings.Contains(e.Error.Message, "injected fault") {
			t.Errorf("prefill %d: got %d %s", status, resp.StatusCode, got)
		}
		if d.Stats().RequestsReceived != 0 {
			t.Errorf("prefill %d: decode contacted", status)
		}
		ws := g.Registry.Snapshot().Workers
		_, pf := ws[0].Outcomes()
		dok, df := ws[1].Outcomes()
		if wantPF := map[int]int64{408: 1, 429: 0, 503: 1}[status]; pf != wantPF || dok != 0 || df != 0 {
			t.Errorf("prefill %d: prefill failures %d (want %d), decode samples %d/%d", status, pf, wantPF, dok, df)
		}
	}
	t.Run("prefill transport error", func(t *testing.T) {
		p, d, g, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{})
		p.Close()
		resp, got := postTimeout(t, gw+"/v1/completions", body)
		if resp.StatusCode != 502 || !strings.Contains(got, "prefill_upstream_unreachable") || d.Stats().RequestsReceived != 0 {
			t.Errorf("%d %s", resp.StatusCode, got)
		}
		if _, df := g.Registry.Snapshot().Workers[1].Outcomes(); df != 0 {
			t.Error("decode penalised")
		}
	})
	t.Run("decode failure after a good prefill", func(t *testing.T) {
		p, _, g, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{Faults: sim.Faults{Status: 500}})
		resp, got := postTimeout(t, gw+"/v1/completions", body)
		if resp.StatusCode != 500 || !strings.Contains(got, "decode_upstream_error") {
			t.Errorf("%d %s", resp.StatusCode, got)
		}
		if v := testutil.ToFloat64(g.Metrics.PDHandoffsAbandoned.WithLabelValues("nixl")); v != 1 {
			t.Errorf("abandoned %v", v)
		}
		// The refusing decode told the prefill to free the KV at once, as vLLM's serving layer does.
		if s := p.Stats(); s.HandoffsPinned != 1 || s.HandoffsReleased != 1 || len(pinnedOn(t, p)) != 0 {
			t.Errorf("prefill %+v", s)
		}
		if _, pf := g.Registry.Snapshot().Workers[0].Outcomes(); pf != 0 {
			t.Error("prefill penalised for the decode's failure")
		}
	})
}

func pinnedOn(t *testing.T, e *sim.Engine) []any {
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
		p, d, g, gw := vllmPD(t, "NixlConnector", sim.Config{Faults: sim.Faults{Latency: 5 * time.Second}}, sim.Config{})
		cancelAfter(t, gw+"/v1/completions", `{"model":"m","prompt":"leaving early","max_tokens":3}`, func() bool { return p.Stats().RequestsReceived == 1 })
		poll.Until(t, "the condition", func() bool { return p.Stats().RequestsCancelled == 1 })
		if d.Stats().RequestsReceived != 0 {
			t.Error("decode contacted after the client left")
		}
		ws := g.Registry.Snapshot().Workers
		poll.Until(t, "the condition", func() bool { return ws[0].InFlight() == 0 })
		if _, f := ws[0].Outcomes(); f != 0 {
			t.Error("client cancel counted against the prefill")
		}
	})
	t.Run("during decode", func(t *testing.T) {
		_, d, g, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{Faults: sim.Faults{Latency: 5 * time.Second}})
		cancelAfter(t, gw+"/v1/completions", `{"model":"m","prompt":"leaving early","max_tokens":3}`, func() bool { return d.Stats().RequestsReceived == 1 })
		poll.Until(t, "the condition", func() bool { return d.Stats().RequestsCancelled == 1 })
		poll.Until(t, "the condition", func() bool { return testutil.ToFloat64(g.Metrics.PDHandoffsAbandoned.WithLabelValues("nixl")) == 1 })
		ws := g.Registry.Snapshot().Workers
		poll.Until(t, "the condition", func() bool { return ws[1].InFlight() == 0 })
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
	poll.Until(t, "the workers registered", ready)
	cancel()
	<-done
}

func TestWorkersAdminShowsConnector(t *testing.T) {
	t.Parallel()
	_, _, _, gw := vllmPD(t, "MooncakeConnector", sim.Config{}, sim.Config{})
	resp, err := http.Get(gw + "/workers")
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(t, resp.Body)
	if !strings.Contains(body, `"kv_connector":"mooncake"`) || !strings.Contains(body, `"role":"decode"`) {
		t.Errorf("/workers %s", body)
	}
}

// Registration logs each vLLM prefill worker's effective connector and warns about one that
// has none.
func TestConnectorLoggedAtRegistration(t *testing.T) {
	t.Parallel()
	p1 := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	p2 := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode})
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Workers = []config.Worker{{URL: p1.URL(), Role: "prefill", KVConnector: "NixlConnector"}, {URL: p2.URL(), Role: "prefill"}, {URL: d.URL(), Role: "decode"}}
	logs := &syncBuffer{}
	g, err := New(cfg, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	g.Start(ctx)
	defer func() { cancel(); g.Wait() }()
	poll.Until(t, "the condition", func() bool {
		return strings.Contains(logs.String(), "no KV connector configured") && strings.Contains(logs.String(), "mode=nixl")
	})
	out := logs.String()
	if strings.Count(out, "no KV connector configured") != 1 || !strings.Contains(out, p2.URL()) {
		t.Errorf("want one warning naming %s:\n%s", p2.URL(), out)
	}
}
