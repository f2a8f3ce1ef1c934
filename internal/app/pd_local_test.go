package app

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/advisor"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// Conditional disaggregation: a prompt with fewer uncached tokens on its chosen decode than
// pd_local_prefill_threshold is served by that decode alone — no prefill leg, no handoff
// fields, the decode computes it, and every place says so (the handoff header, both counters);
// a longer one goes through the pair; the same long prompt again, now held by the decode (the
// cache-aware index), is served there alone.
func TestPDLocalPrefillByUncachedTokens(t *testing.T) {
	t.Parallel()
	p, d, g, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{}, func(c *config.Config) {
		c.PDLocalPrefillThreshold = 60
		c.DecodePolicy = "cache_aware"
	})
	short := `{"model":"m","prompt":"a short question","max_tokens":4}` // 58 bytes: 15 tokens
	long := `{"model":"m","prompt":"` + strings.Repeat("a long document of many words ", 20) + `","max_tokens":4}`
	handoff := func(body string) string {
		t.Helper()
		resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", body)
		if resp.StatusCode != 200 || !strings.Contains(out, `"cmpl-`) {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
		return resp.Header.Get("X-Baton-Kv-Handoff")
	}
	if h := handoff(short); h != "none-local-prefill" || p.Stats().RequestsReceived != 0 {
		t.Errorf("a short prompt: handoff %q, the prefill received %d requests", h, p.Stats().RequestsReceived)
	}
	if ds := d.Stats(); ds.PromptTokensRemote != 0 || ds.PromptTokensRecompute == 0 {
		t.Errorf("the decode alone computed %d prompt tokens, loaded %d", ds.PromptTokensRecompute, ds.PromptTokensRemote)
	}
	if h := handoff(long); h != "nixl" || p.Stats().RequestsReceived != 1 {
		t.Errorf("a long prompt: handoff %q, the prefill received %d requests", h, p.Stats().RequestsReceived)
	}
	if h := handoff(long); h != "none-local-prefill" || p.Stats().RequestsReceived != 1 {
		t.Errorf("the long prompt again, held by the decode: handoff %q, the prefill received %d requests", h, p.Stats().RequestsReceived)
	}
	// A request is counted as it ends, which may be just after its client has the last byte.
	poll.Until(t, "baton_pd_local_prefill_total reaches 2", func() bool {
		return g.Server.Director().LocalPrefills() >= 2 // the last of CountLocalPrefill's counts
	})
	if n := testutil.ToFloat64(g.Metrics.PDLocalPrefill.WithLabelValues("m")); n != 2 {
		t.Errorf("baton_pd_local_prefill_total %v, want 2", n)
	}
	if n := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("none-local-prefill", "by_design", "")); n != 2 {
		t.Errorf("baton_pd_kv_handoffs_total{none-local-prefill, by_design} %v, want 2", n)
	}
	// The status page says how many were served alone, and under what threshold.
	status := httptest.NewServer(g.Server.StatusHandler())
	defer status.Close()
	var st struct {
		LocalPrefill struct{ Threshold, Served int } `json:"local_prefill"`
	}
	sr, err := http.Get(status.URL + "/status.json")
	if err != nil {
		t.Fatal(err)
	}
	raw := readAll(t, sr.Body)
	if err := json.Unmarshal([]byte(raw), &st); err != nil || st.LocalPrefill.Threshold != 60 || st.LocalPrefill.Served != 2 {
		t.Errorf("status.json local_prefill %+v (%v)", st.LocalPrefill, err)
	}
	t.Run("status page in a browser", func(t *testing.T) {
		dom := browse(t, chromium(t), status.URL+"/", "--dump-dom")
		if !bytes.Contains(dom, []byte("Served by a decode alone (conditional disaggregation: fewer than 60 uncached prompt tokens, or every prefill busier than the decode alone): 2")) {
			t.Errorf("the rendered status page does not say it:\n%s", dom)
		}
	})
	// A stream alone on the decode streams whole.
	resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"short again","max_tokens":4,"stream":true}`)
	if resp.Header.Get("X-Baton-Kv-Handoff") != "none-local-prefill" || !strings.HasSuffix(strings.TrimSpace(out), "data: [DONE]") {
		t.Errorf("a short stream: %q\n%s", resp.Header.Get("X-Baton-Kv-Handoff"), out)
	}
}

// SGLang's decodes refuse a request without a bootstrap room: under a threshold every request
// still goes through the pair, and the decode's registration says so, loudly.
func TestPDLocalPrefillNeverOnSGLang(t *testing.T) {
	t.Parallel()
	cfg, p, _ := sglangPair(t, sim.Config{}, sim.Config{})
	cfg.Retry.Disable = true
	cfg.PDLocalPrefillThreshold = 1_000_000
	logs := &gwtest.SyncBuffer{}
	g, err := New(cfg, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := g.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); g.Wait() }()
	for _, w := range g.Registry.Snapshot().Workers {
		poll.Until(t, "the worker registered and ready", func() bool { return w.Registered() && w.Ready() })
	}
	srv := serveAPI(t, cfg, g.Server.Handler())
	resp, out := gwtest.PostTimeout(t, srv.URL+"/v1/completions", `{"model":"m","prompt":"a short question","max_tokens":4}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") == "none-local-prefill" || p.Stats().RequestsReceived != 1 {
		t.Errorf("an SGLang pair under a threshold: %d %q, the prefill received %d\n%s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), p.Stats().RequestsReceived, out)
	}
	var warned bool
	for _, l := range strings.Split(logs.String(), "\n") {
		warned = warned || strings.Contains(l, "level=WARN") && strings.Contains(l, "pd_local_prefill_threshold") && strings.Contains(l, "bootstrap room")
	}
	if !warned {
		t.Errorf("no WARN about the SGLang decode under the threshold:\n%s", logs.String())
	}
}

// The threshold needs disaggregation, and contradicts strict mode; the advisor's SLOs are from 1ms
// to 1h: all refused at startup.
func TestPDLocalPrefillSettingsRefused(t *testing.T) {
	var out bytes.Buffer
	for _, args := range [][]string{
		{"--pd-local-prefill-threshold", "100", "--worker-urls", "http://127.0.0.1:1"},
		{"--pd-disaggregation", "--pd-local-prefill-threshold", "100", "--pd-require-handoff", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"},
		{"--pd-disaggregation", "--pd-local-prefill-threshold", "-1", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"},
		{"--pd-local-prefill-auto", "--worker-urls", "http://127.0.0.1:1"},
		{"--pd-disaggregation", "--pd-local-prefill-auto", "--pd-require-handoff", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"},
		{"--pd-disaggregation", "--pd-advice-ttft-slo", "2h", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"},
		{"--pd-disaggregation", "--pd-advice-tpot-slo", "100us", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"},
		{"--pd-disaggregation", "--pd-advice-window", "5s", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"},
		{"--pd-disaggregation", "--pd-advice-window", "2h", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"},
	} {
		if _, err := config.Parse(args, &out); err == nil || !strings.Contains(err.Error(), "pd_local_prefill_") && !strings.Contains(err.Error(), "pd-local-prefill-threshold") &&
			!strings.Contains(err.Error(), "pd_advice_") {
			t.Errorf("%v: %v", args, err)
		}
	}
	// Each refusal says what the setting does: the mirror case serves a request on a prefill.
	args := []string{"--pd-disaggregation", "--pd-prefill-serves-whole", "--pd-require-handoff", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"}
	if _, err := config.Parse(args, &out); err == nil || !strings.Contains(err.Error(), "pd_prefill_serves_whole serves a request whole on an idle prefill") {
		t.Errorf("%v: %v", args, err)
	}
}

// The picker decides the same way: a short prompt's pick names no prefill
// (x-prefiller-host-port left out), and the decode-side sidecar serves it alone; a long one
// names its prefill.
func TestEPPConditionalDisaggregation(t *testing.T) {
	t.Parallel()
	p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	pw := config.Worker{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector"}
	side := config.Default()
	side.PDDisaggregation, side.PDPrefillerHeader = true, true
	side.Workers = []config.Worker{pw, {URL: d.URL(), Role: config.RoleDecode}}
	_, sidecar := startGateway(t, side)
	pick := config.Default()
	pick.PDDisaggregation, pick.PDLocalPrefillThreshold = true, 60
	pick.Workers = []config.Worker{pw, {URL: sidecar.URL, Role: config.RoleDecode, Runtime: sim.EngineVLLM, KVConnector: "NixlConnector"}}
	eg, conn := startEPP(t, pick)
	dp, srv := dataPlane(t, conn)

	resp := post(t, srv.URL+"/v1/completions", `{"model":"`+pdModel+`","prompt":"a short one","max_tokens":3}`)
	body := readAll(t, resp.Body)
	if ex := dp.Last(); resp.StatusCode != 200 || ex.Prefiller != "" || resp.Header.Get("X-Baton-Kv-Handoff") != "none-local-prefill" || p.Stats().RequestsReceived != 0 {
		t.Errorf("a short prompt through the picker: %d, prefiller %q, handoff %q, the prefill received %d\n%s",
			resp.StatusCode, ex.Prefiller, resp.Header.Get("X-Baton-Kv-Handoff"), p.Stats().RequestsReceived, body)
	}
	// The picker counts a local prefill when the proxy's stream ends (Done), which may come
	// after the client has its answer.
	poll.Until(t, "the picker's baton_pd_local_prefill_total is 1", func() bool {
		return testutil.ToFloat64(eg.Metrics.PDLocalPrefill.WithLabelValues(pdModel)) == 1
	})
	resp = post(t, srv.URL+"/v1/completions", `{"model":"`+pdModel+`","prompt":"`+strings.Repeat("a long document of many words ", 20)+`","max_tokens":3}`)
	body = readAll(t, resp.Body)
	if ex := dp.Last(); resp.StatusCode != 200 || ex.Prefiller != endpointOf(p.URL()) || resp.Header.Get("X-Baton-Kv-Handoff") != "nixl" {
		t.Errorf("a long prompt through the picker: %d, prefiller %q, handoff %q\n%s", resp.StatusCode, ex.Prefiller, resp.Header.Get("X-Baton-Kv-Handoff"), body)
	}
}

// The advisor learns from the PD traffic served: after enough requests GET /pd/advice (status
// listener) answers with its fit — the rates and the requests they came from — a recommended
// split of the fleet and the predictions for it and the current one; the metrics carry the
// recommendation. A what-if outside its bounds is refused in the error envelope.
func TestPDAdviceFromTraffic(t *testing.T) {
	t.Parallel()
	_, _, g, gw := vllmPD(t, "NixlConnector", sim.Config{PrefillPerToken: 20 * time.Microsecond}, sim.Config{DecodePerToken: 2 * time.Millisecond})
	status := httptest.NewServer(g.metricsMux(config.Default())) // the metrics listener's own routes
	defer status.Close()
	for i := range 40 {
		body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":%d,"ignore_eos":true,"stream":%v,"stream_options":{"include_usage":true}}`, strings.Repeat("word ", 20+40*(i%10)), 3+i%5, i%4 != 0)
		if i%4 == 0 {
			body = fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":%d,"ignore_eos":true}`, strings.Repeat("word ", 20+40*(i%10)), 3+i%5)
		}
		if resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", body); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
	}
	var adv struct {
		Total       int
		Recommended struct{ Prefill, Decode int }
		Current     struct {
			Prefill, Decode int
			TTFT            float64 `json:"ttft_p90_s"`
		}
		Fit struct {
			Requests          int
			PrefillFrom       int     `json:"prefill_from"`
			DecodeFrom        int     `json:"decode_from"`
			PrefillTokensPerS float64 `json:"prefill_tokens_per_s"`
		}
		Why string
	}
	get := func(q string) (int, string) {
		resp, err := http.Get(status.URL + "/pd/advice" + q)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, readAll(t, resp.Body)
	}
	code, raw := get("?total=8&ttft_slo=2s&tpot_slo=0.05")
	if err := json.Unmarshal([]byte(raw), &adv); code != 200 || err != nil {
		t.Fatalf("%d %v %s", code, err, raw)
	}
	// Every request's prefill leg counts; only the streams' pace (a whole answer's first byte
	// is its last token's).
	if adv.Fit.Requests != 40 || adv.Fit.PrefillFrom != 40 || adv.Fit.DecodeFrom != 30 || adv.Fit.PrefillTokensPerS <= 0 {
		t.Errorf("the fit: %+v\n%s", adv.Fit, raw)
	}
	if adv.Total != 8 || adv.Recommended.Prefill < 1 || adv.Recommended.Decode < 1 || adv.Recommended.Prefill+adv.Recommended.Decode != 8 ||
		adv.Current.Prefill != 1 || adv.Current.Decode != 1 || adv.Current.TTFT <= 0 || adv.Why == "" {
		t.Errorf("the advice: %+v\n%s", adv, raw)
	}
	mfs, err := g.Metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var roles int
	for _, mf := range mfs {
		if mf.GetName() == "baton_pd_recommended_workers" {
			for _, m := range mf.GetMetric() {
				roles++
				if m.GetGauge().GetValue() < 1 {
					t.Errorf("recommended %v workers of a role", m.GetGauge().GetValue())
				}
			}
		}
	}
	if roles != 2 {
		t.Errorf("baton_pd_recommended_workers has %d roles", roles)
	}
	t.Run("status page in a browser", func(t *testing.T) {
		dom := browse(t, chromium(t), status.URL+"/", "--dump-dom")
		for _, want := range []string{"PD sizing advice", ">recommended<", "From 40 requests over", "legs to an idle prefill"} {
			if !bytes.Contains(dom, []byte(want)) {
				t.Errorf("the rendered status page lacks %q", want)
			}
		}
	})
	for _, q := range []string{"?total=1", "?total=99999999999999999999", "?total=x", "?ttft_slo=-1s", "?tpot_slo=NaN", "?tpot_slo=1e400", "?ttft_slo=2h", "?tpot_slo=0",
		"?total=5&total=abc", "?total=%zz", "?totl=8", "?Total=8", "?total=", "?total", "?tpot_slo=", "?total=5&total=5", "?total=8&" + strings.Repeat("x", 5000) + "=1", "?ttft_slo=0x1p-2", "?ttft_slo=0x_1p0", "?tpot_slo=1ns", "?tpot_slo=0.0001", "?ttft_slo=1e1"} {
		if code, raw := get(q); code != 400 || len(raw) > 1000 || !strings.Contains(raw, `"invalid_request_error"`) && !strings.Contains(raw, `"code":"invalid_request"`) {
			t.Errorf("%s: %d %s", q, code, raw)
		}
	}
	if _, raw := get("?total=5&total=5"); !strings.Contains(raw, `"param":"total"`) {
		t.Errorf("a repeated parameter not named: %s", raw)
	}
	// The listener's other answers are the API's: a method or path it does not serve is a 404
	// in the OpenAI error envelope.
	for _, mp := range [][2]string{{http.MethodPost, "/pd/advice"}, {http.MethodGet, "/nope"}, {http.MethodDelete, "/metrics"}} {
		req, _ := http.NewRequest(mp[0], status.URL+mp[1], nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if raw := readAll(t, resp.Body); resp.StatusCode != 404 || !strings.Contains(raw, `"code":"not_found"`) {
			t.Errorf("%s %s: %d %s", mp[0], mp[1], resp.StatusCode, raw)
		}
	}
}

// A local prefill is counted once per request that a decode served alone, however many attempts
// it took: a decode refusing every request makes each request's first attempt fail and the
// retry go to the healthy one — five requests, five counted; a request every attempt of which
// failed is not counted at all.
func TestPDLocalPrefillCountedOncePerRequest(t *testing.T) {
	t.Parallel()
	p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	bad := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl, Faults: sim.Faults{Status: 503}})
	good := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	cfg := config.Default()
	cfg.PDDisaggregation, cfg.PDLocalPrefillThreshold = true, 50
	cfg.CircuitBreaker.Disable = true // the failing decode stays in turn
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector"}, {URL: bad.URL(), Role: config.RoleDecode}, {URL: good.URL(), Role: config.RoleDecode}}
	g, srv := startGateway(t, cfg)
	for range 5 {
		resp, out := gwtest.PostTimeout(t, srv.URL+"/v1/completions", `{"model":"`+pdModel+`","prompt":"a short one","max_tokens":3}`)
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-local-prefill" {
			t.Fatalf("%d %q %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), out)
		}
	}
	poll.Until(t, "baton_pd_local_prefill_total reaches 5", func() bool {
		return g.Server.Director().LocalPrefills() >= 5 // the last of CountLocalPrefill's counts
	})
	if n := testutil.ToFloat64(g.Metrics.PDLocalPrefill.WithLabelValues(pdModel)); n != 5 || g.Server.Director().LocalPrefills() != 5 {
		t.Errorf("5 requests served alone counted %v (status page %d)", n, g.Server.Director().LocalPrefills())
	}
	if n := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("none-local-prefill", "by_design", "")); n != 5 {
		t.Errorf("baton_pd_kv_handoffs_total{none-local-prefill} %v, want 5", n)
	}
	if bad.Stats().RequestsReceived == 0 {
		t.Error("no request met the failing decode: the case was not made")
	}
}

// A threshold never makes a health check's pair lose its prefill: GET /health_generate checks a
// whole pair (it carries no prompt, which the threshold would take for a short one).
func TestPDLocalPrefillLeavesHealthGenerateAPair(t *testing.T) {
	t.Parallel()
	p, _, _, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{}, func(c *config.Config) { c.PDLocalPrefillThreshold = 1_000_000 })
	resp, err := http.Get(gw + "/health_generate")
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(t, resp.Body)
	if resp.StatusCode != 200 || !strings.Contains(body, "prefill="+p.URL()) {
		t.Errorf("health_generate under a threshold: %d %s", resp.StatusCode, body)
	}
}

// pdWarmTraffic sends the advisor 40 PD requests of varied lengths, most streamed: enough to
// fit every rate.
func pdWarmTraffic(t *testing.T, gw string) {
	t.Helper()
	for i := range 40 {
		body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":%d,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, strings.Repeat("word ", 200+40*(i%10)), 3+i%5)
		if i%4 == 0 {
			body = fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":%d,"ignore_eos":true}`, strings.Repeat("word ", 200+40*(i%10)), 3+i%5)
		}
		if resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", body); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
	}
}

// In auto mode the threshold is the advisor's: it starts at the configured one (0: every
// request split), and once the advisor has fitted the fleet it is the recommendation for the
// fleet's decodes, under which a short prompt is served by its decode alone; the status page
// says the threshold is the advisor's.
func TestPDLocalPrefillAuto(t *testing.T) {
	t.Parallel()
	p, _, g, gw := vllmPD(t, "NixlConnector", sim.Config{PrefillPerToken: 20 * time.Microsecond}, sim.Config{DecodePerToken: 2 * time.Millisecond},
		func(c *config.Config) {
			c.PDLocalPrefillAuto, c.PDAdviceTTFTSLO, c.PDAdviceTPOTSLO = true, 2*time.Second, time.Second
		})
	d := g.Server.Director()
	short := `{"model":"m","prompt":"a short question","max_tokens":3}`
	if resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", short); resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "nixl" || d.LocalPrefillThreshold() != 0 {
		t.Fatalf("before any fit: %d %q, threshold %d\n%s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), d.LocalPrefillThreshold(), out)
	}
	pdWarmTraffic(t, gw)
	d.RefreshLocal()
	f := d.Advice(0, 0, 0).Fit
	if want := f.ThresholdFor(1, 1, advisor.SLO{TTFT: 2 * time.Second, TPOT: time.Second}); d.LocalPrefillThreshold() != want || want <= 0 {
		t.Fatalf("auto threshold %d, the advisor's for one decode %d (fit %+v)", d.LocalPrefillThreshold(), want, f)
	}
	before := p.Stats().RequestsReceived
	if resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", short); resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-local-prefill" || p.Stats().RequestsReceived != before {
		t.Errorf("under the advisor's threshold %d: %d %q\n%s", d.LocalPrefillThreshold(), resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), out)
	}
	status := httptest.NewServer(g.Server.StatusHandler())
	defer status.Close()
	var st struct {
		LocalPrefill struct {
			Threshold int
			Auto      bool
		} `json:"local_prefill"`
	}
	sr, err := http.Get(status.URL + "/status.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(readAll(t, sr.Body)), &st); err != nil || !st.LocalPrefill.Auto || st.LocalPrefill.Threshold != d.LocalPrefillThreshold() {
		t.Errorf("status.json local_prefill %+v (%v)", st.LocalPrefill, err)
	}
}

// A prompt over the threshold still goes to its decode alone when every prefill it could use
// has so much in flight that the decode would finish it sooner; once they are free it is split
// again. Before the advisor has fitted the prefill's rate the rule is the threshold alone.
func TestPDLocalPrefillWhenEveryPrefillIsBusy(t *testing.T) {
	t.Parallel()
	p, _, g, gw := vllmPD(t, "NixlConnector", sim.Config{PrefillPerToken: 20 * time.Microsecond}, sim.Config{DecodePerToken: 2 * time.Millisecond},
		func(c *config.Config) {
			// A TPOT SLO the moved prompt's compute cannot pass (the rule's guard is tested on its own).
			c.PDLocalPrefillThreshold, c.ForwardSimFaults, c.PDAdviceTPOTSLO = 1, true, time.Hour
		})
	d := g.Server.Director()
	prompt := `{"model":"m","prompt":"` + strings.Repeat("a question of some length ", 10) + `","max_tokens":3}`
	handoff := func() string {
		t.Helper()
		resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", prompt)
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
		return resp.Header.Get("X-Baton-Kv-Handoff")
	}
	busy := func() (release func()) {
		base := p.Stats().RequestsReceived
		var wg sync.WaitGroup
		// Long documents, whose own compute on the decode would outlast the wait: each stays
		// split (the rule applies to them too), and holds the prefill for 2 s.
		for range 4 {
			wg.Go(func() {
				req, _ := http.NewRequest(http.MethodPost, gw+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"`+strings.Repeat("a long document ", 1000)+`","max_tokens":2}`))
				req.Header.Set(sim.HeaderFault, "latency=2s")
				if resp, err := http.DefaultClient.Do(req); err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			})
		}
		pw := g.Registry.Snapshot().Workers[0]
		if pw.Role != config.RolePrefill {
			pw = g.Registry.Snapshot().Workers[1]
		}
		// Dispatched by Baton, and received by the engine (a moment later).
		poll.Until(t, "the prefill has 4 requests in flight", func() bool { return pw.InFlight() >= 4 && p.Stats().RequestsReceived >= base+4 })
		return wg.Wait
	}
	// Not fitted: the threshold alone decides, busy or not.
	release := busy()
	if h := handoff(); h != "nixl" {
		t.Errorf("unfitted, every prefill busy: handoff %q, want the pair's", h)
	}
	release()
	pdWarmTraffic(t, gw)
	d.RefreshLocal()
	if h := handoff(); h != "nixl" {
		t.Errorf("fitted, the prefill free: handoff %q, want the pair's", h)
	}
	release = busy()
	before := p.Stats().RequestsReceived
	if h := handoff(); h != "none-local-prefill" || p.Stats().RequestsReceived != before {
		t.Errorf("fitted, the prefill 4 requests deep: handoff %q, the prefill received %d more", h, p.Stats().RequestsReceived-before)
	}
	release()
	if h := handoff(); h != "nixl" {
		t.Errorf("the prefill free again: handoff %q, want the pair's", h)
	}
}

// The mirror case: with pd_prefill_serves_whole, once the advisor has fitted the decode's pace,
// a request whose busy decode would give a token slower than the TPOT SLO goes whole to an idle
// prefill, which decodes it too — said in the handoff header, counted once, shown on the status
// page — and a busy prefill is left alone. Before the fit every request is split.
func TestPDPrefillServesWhole(t *testing.T) {
	t.Parallel()
	p, d, g, gw := vllmPD(t, "NixlConnector", sim.Config{PrefillPerToken: 20 * time.Microsecond}, sim.Config{DecodePerToken: 2 * time.Millisecond},
		func(c *config.Config) {
			c.PDPrefillServesWhole, c.PDAdviceTPOTSLO, c.ForwardSimFaults = true, 10*time.Millisecond, true
		})
	dir := g.Server.Director()
	body := `{"model":"m","prompt":"a question for whoever is free","max_tokens":4,"ignore_eos":true}`
	send := func(body string) (handoff, out string) {
		t.Helper()
		resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", body)
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
		return resp.Header.Get("X-Baton-Kv-Handoff"), out
	}
	if h, _ := send(body); h != "nixl" {
		t.Fatalf("before the fit: handoff %q, want the pair's", h)
	}
	pdWarmTraffic(t, gw)
	// The simulator's pace does not slow with its batch; an engine's does. The advisor is
	// shown streams decoded beside 3 to 12 others at 2 ms + 6 ms per request decoding beside
	// them: alone a decode is within the 10 ms SLO (6–8 ms a token, as the fit weighs the
	// simulator's own streams), with one request beside it past it (12–14 ms).
	for b := 3; b <= 12; b++ {
		for range 3 {
			ttft, tpot := 50*time.Millisecond, 2*time.Millisecond+time.Duration(b)*6*time.Millisecond
			dur := ttft + 10*tpot
			dir.ObserveEnded(&record.Record{Prefill: "p", Decode: "d", Stream: true, Usage: openai.Usage{Prompt: 100, Completion: 11},
				Start: time.Now().Add(-dur), PrefillTime: 20 * time.Millisecond, DecodeBusy: b}, ttft, dur)
		}
	}
	dir.RefreshLocal()
	var pw, dw *worker.Worker
	for _, w := range g.Registry.Snapshot().Workers {
		switch w.Role {
		case config.RolePrefill:
			pw = w
		case config.RoleDecode:
			dw = w
		}
	}
	// An idle decode is left alone, however slow its pace: a prefill would be no faster.
	if h, _ := send(body); h != "nixl" {
		t.Errorf("an idle decode slower than the SLO: handoff %q, want the pair's", h)
	}
	// A long answer holds the decode (split while the decode was idle) for the rest of the test.
	ctx, cancel := context.WithCancel(context.Background())
	held := make(chan struct{})
	d0 := d.Stats().RequestsReceived
	go func() {
		defer close(held)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"a long answer","max_tokens":10000,"ignore_eos":true}`))
		if resp, err := http.DefaultClient.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	defer func() { cancel(); <-held }()
	// Baton counts the decode's request in flight before the engine has it: wait for the engine too.
	poll.Until(t, "the decode holds a request, the prefill none", func() bool {
		return dw.InFlight() >= 1 && pw.InFlight() == 0 && d.Stats().RequestsReceived > d0
	})
	pb, db := p.Stats().RequestsReceived, d.Stats().RequestsReceived
	h, out := send(body)
	if h != "none-prefill-whole" || p.Stats().RequestsReceived != pb+1 || d.Stats().RequestsReceived != db || !strings.Contains(out, `"completion_tokens":4`) {
		t.Errorf("a saturated decode, an idle prefill: handoff %q, the prefill received %d, the decode %d more\n%s", h, p.Stats().RequestsReceived-pb, d.Stats().RequestsReceived-db, out)
	}
	h, out = send(`{"model":"m","prompt":"a stream for whoever is free","max_tokens":4,"ignore_eos":true,"stream":true}`)
	if h != "none-prefill-whole" || !strings.HasSuffix(strings.TrimSpace(out), "data: [DONE]") {
		t.Errorf("a stream: handoff %q\n%s", h, out)
	}
	poll.Until(t, "two requests served whole are counted", func() bool { return dir.PrefillWholes() >= 2 })
	if n := testutil.ToFloat64(g.Metrics.PDPrefillWhole.WithLabelValues("m")); n != 2 || dir.PrefillWholes() != 2 || dir.LocalPrefills() != 0 {
		t.Errorf("baton_pd_prefill_whole_total %v (status %d, local prefills %d), want 2", n, dir.PrefillWholes(), dir.LocalPrefills())
	}
	if n := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("none-prefill-whole", "by_design", "")); n != 2 {
		t.Errorf("baton_pd_kv_handoffs_total{none-prefill-whole, by_design} %v, want 2", n)
	}
	// A prefill with a request in flight is not idle: the pair again. (The request holding it
	// is itself served whole there, the prefill being idle when it came: a third.)
	busy := make(chan struct{})
	go func() {
		defer close(busy)
		req, _ := http.NewRequest(http.MethodPost, gw+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"a long document to hold the prefill","max_tokens":2}`))
		req.Header.Set(sim.HeaderFault, "latency=2s")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	poll.Until(t, "the prefill has a request in flight", func() bool { return pw.InFlight() >= 1 })
	if h, _ := send(body); h != "nixl" {
		t.Errorf("the prefill busy: handoff %q, want the pair's", h)
	}
	<-busy
	status := httptest.NewServer(g.Server.StatusHandler())
	defer status.Close()
	t.Run("status page in a browser", func(t *testing.T) {
		dom := browse(t, chromium(t), status.URL+"/", "--dump-dom")
		if !bytes.Contains(dom, []byte("Served whole by an idle prefill (its decode past the TPOT SLO): 3")) {
			t.Errorf("the rendered status page does not say it:\n%s", dom)
		}
	})
}

// In auto mode a starting threshold above every prompt still lets the advisor see prefills:
// while it has too few prefill legs to fit from, one request in ten under the threshold is
// split anyway.
func TestPDLocalPrefillAutoExplores(t *testing.T) {
	t.Parallel()
	p, _, _, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{}, func(c *config.Config) {
		c.PDLocalPrefillAuto, c.PDLocalPrefillThreshold = true, 1_000_000
	})
	split := 0
	for i := range 30 {
		resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"question %d","max_tokens":2}`, i))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
		if resp.Header.Get("X-Baton-Kv-Handoff") == "nixl" {
			split++
		}
	}
	if split != 3 || p.Stats().RequestsReceived != 3 {
		t.Errorf("30 requests under an unfitted auto threshold: %d split (the prefill received %d), want 3", split, p.Stats().RequestsReceived)
	}
}

// With every prefill down, a prompt under the threshold is still served by its decode alone
// (it needs no prefill); one over it fails as before, for want of a prefill (503).
func TestPDLocalPrefillWithEveryPrefillDown(t *testing.T) {
	t.Parallel()
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	cfg := config.Default()
	cfg.PDDisaggregation, cfg.PDLocalPrefillThreshold = true, 50
	cfg.Retry.Disable = true
	cfg.Workers = []config.Worker{{URL: gwtest.RefusingURL(t), Role: config.RolePrefill, KVConnector: "NixlConnector"}, {URL: d.URL(), Role: config.RoleDecode}}
	g := runGateway(t, cfg)
	for _, w := range g.Registry.Snapshot().Workers {
		if w.URL == d.URL() {
			poll.Until(t, "the decode registered and ready", func() bool { return w.Registered() && w.Ready() })
		}
	}
	srv := serveAPI(t, cfg, g.Server.Handler())
	for _, stream := range []string{"false", "true"} {
		resp, out := gwtest.PostTimeout(t, srv.URL+"/v1/completions", `{"model":"`+pdModel+`","prompt":"a short one","max_tokens":3,"stream":`+stream+`}`)
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-local-prefill" {
			t.Errorf("a short prompt (stream %s) with the prefill down: %d %q %s", stream, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), out)
		}
	}
	long := `{"model":"` + pdModel + `","prompt":"` + strings.Repeat("a long document of many words ", 20) + `","max_tokens":3}`
	if resp, out := gwtest.PostTimeout(t, srv.URL+"/v1/completions", long); resp.StatusCode != 503 || !strings.Contains(out, "prefill") {
		t.Errorf("a long prompt with the prefill down: %d %s", resp.StatusCode, out)
	}
}

// A request served alone is counted once its answer reached the client whole: a client that
// hangs up mid-stream is not counted in baton_pd_local_prefill_total, its handoff or the status
// page (it was, as if served).
func TestPDLocalPrefillNotCountedWhenTheClientLeaves(t *testing.T) {
	t.Parallel()
	_, _, g, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{DecodePerToken: 20 * time.Millisecond}, func(c *config.Config) {
		c.PDLocalPrefillThreshold = 60
	})
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"a short one","max_tokens":200,"ignore_eos":true,"stream":true}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.Header.Get("X-Baton-Kv-Handoff") != "none-local-prefill" {
		t.Fatalf("handoff %q", resp.Header.Get("X-Baton-Kv-Handoff"))
	}
	if _, err := resp.Body.Read(make([]byte, 64)); err != nil {
		t.Fatal(err)
	}
	cancel() // the client hangs up, a few tokens in
	resp.Body.Close()
	poll.Until(t, "the cut request ended", func() bool { return g.Server.InFlight() == 0 })
	if n, m := g.Server.Director().LocalPrefills(), testutil.ToFloat64(g.Metrics.PDLocalPrefill.WithLabelValues("m")); n != 0 || m != 0 {
		t.Errorf("a stream its client left counted as served alone: status page %d, baton_pd_local_prefill_total %v", n, m)
	}
	if n := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("none-local-prefill", "by_design", "")); n != 0 {
		t.Errorf("baton_pd_kv_handoffs_total{none-local-prefill} %v for a stream its client left", n)
	}
	// One that ends whole is counted.
	if resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"a short one","max_tokens":3,"stream":true}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, out)
	}
	poll.Until(t, "the whole one counted", func() bool { return g.Server.Director().LocalPrefills() == 1 })
}

// The picker refuses what it cannot do, at startup: auto (it sees no prefill leg to fit) and
// the mirror case (a pick names a decode pod's sidecar); the fixed threshold is its own.
func TestEPPRefusesAutoAndServesWhole(t *testing.T) {
	for _, flag := range []string{"--pd-local-prefill-auto", "--pd-prefill-serves-whole"} {
		var out, errs bytes.Buffer
		args := []string{"--pd-disaggregation", flag, "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--grpc-port", "0", "--port", "0"}
		err := RunEPP(context.Background(), args, &out, &errs)
		name := strings.ReplaceAll(strings.TrimPrefix(flag, "--"), "-", "_")
		if err == nil || !strings.Contains(err.Error(), name+" is not for the Endpoint Picker") {
			t.Errorf("baton epp %s: %v", flag, err)
		}
	}
}

// The advisor fits the decodes' pace from streams' usage: a PD stream whose client did not ask
// for usage is asked for it, and the client's stream stays as it asked — no usage event.
func TestPDAdvisorSeesStreamsWithoutUsage(t *testing.T) {
	t.Parallel()
	_, _, g, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{})
	d := g.Server.Director()
	for i, body := range []string{
		`{"model":"m","prompt":"a stream","max_tokens":4,"ignore_eos":true,"stream":true}`,
		`{"model":"m","prompt":"a stream","max_tokens":4,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":false}}`,
		`{"model":"m","messages":[{"role":"user","content":"a chat stream"}],"max_tokens":4,"ignore_eos":true,"stream":true}`,
	} {
		path := "/v1/completions"
		if strings.Contains(body, "messages") {
			path = "/v1/chat/completions"
		}
		resp, out := gwtest.PostTimeout(t, gw+path, body)
		if resp.StatusCode != 200 || strings.Contains(out, `"usage"`) || !strings.HasSuffix(strings.TrimSpace(out), "data: [DONE]") {
			t.Fatalf("%s: %d (a usage event the client did not ask for?)\n%s", body, resp.StatusCode, out)
		}
		poll.Until(t, "the advisor saw the stream", func() bool { return d.Advice(2, 0, 0).Fit.Requests == i+1 })
	}
	// A client that asked for usage still gets it.
	resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"a stream","max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`)
	if resp.StatusCode != 200 || !strings.Contains(out, `"usage"`) {
		t.Errorf("usage asked for: %d\n%s", resp.StatusCode, out)
	}
}

// A request its decode was to serve alone that failed says so — none-failed, as a pair's
// failure does, not none-local-prefill — and is not counted as served alone.
func TestPDLocalPrefillFailureSaysFailed(t *testing.T) {
	t.Parallel()
	_, _, g, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{Faults: sim.Faults{Status: 503}}, func(c *config.Config) {
		c.PDLocalPrefillThreshold = 60
		c.CircuitBreaker.Disable = true
	})
	resp, out := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"a short one","max_tokens":3}`)
	if resp.StatusCode == 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-failed" {
		t.Errorf("a failed request served alone: %d, handoff %q\n%s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), out)
	}
	poll.Until(t, "the request ended", func() bool { return g.Server.InFlight() == 0 })
	if n := g.Server.Director().LocalPrefills(); n != 0 {
		t.Errorf("a failed request counted as served alone: %d", n)
	}
}
