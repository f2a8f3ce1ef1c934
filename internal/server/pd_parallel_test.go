package server

// SGLang's parallel dispatch through the HTTP door: both legs at once, met at the prefill's
// bootstrap server, over a fleet of simulated engines.

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// sglangPD starts a simulated SGLang prefill (pc) and decode (dc) and a PD gateway over them,
// retries off (these cases look at one attempt); tune changes the options after the fleet.
func sglangPD(t *testing.T, pc, dc sim.Config, tune ...func(*Options)) (p, d *sim.Engine, s *Server, url string) {
	t.Helper()
	pc.Engine, pc.Role = sim.EngineSGLang, sim.RolePrefill
	dc.Engine, dc.Role = sim.EngineSGLang, sim.RoleDecode
	p, d = pdSim(t, pc), pdSim(t, dc)
	port := p.BootstrapPort()
	fleet := pdFleet(t, config.Worker{URL: p.URL(), Runtime: config.RuntimeSGLang, BootstrapPort: &port, Models: []string{"m"}},
		config.Worker{URL: d.URL(), Runtime: config.RuntimeSGLang, Models: []string{"m"}})
	s, url, _ = gateway(t, nil, append([]func(*Options){noRetries, fleet}, tune...)...)
	return p, d, s, url
}

// dpSizes configures the fleet's prefill and decode (in that order) with DP ranks.
func dpSizes(p, d int) func(*Options) {
	return func(o *Options) {
		ws := o.Director.Registry.Snapshot().Workers
		ws[0].DPSize, ws[1].DPSize = p, d
	}
}

// workersOf is s's fleet: in a PD fleet, the prefill then the decode.
func workersOf(s *Server) []*worker.Worker { return s.opts.Director.Registry.Snapshot().Workers }

var pdCases = []struct{ name, route, body string }{
	{"chat", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"relay race baton"}],"max_tokens":7}`},
	{"chat stream", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"relay race baton"}],"max_tokens":7,"stream":true,"stream_options":{"include_usage":true}}`},
	{"completions", "/v1/completions", `{"model":"m","prompt":"the quick brown fox","max_tokens":5}`},
	{"completions stream", "/v1/completions", `{"model":"m","prompt":"the quick brown fox","max_tokens":5,"stream":true}`},
	{"generate", "/generate", `{"text":"one two three","sampling_params":{"max_new_tokens":6}}`},
	{"generate stream", "/generate", `{"text":"one two three","sampling_params":{"max_new_tokens":6},"stream":true}`},
	{"generate ids", "/generate", `{"input_ids":[5,6,7,8],"sampling_params":{"max_new_tokens":4}}`},
}

func TestPDParallelSameTextAsAggregated(t *testing.T) {
	t.Parallel()
	p, d, _, gw := sglangPD(t, sim.Config{}, sim.Config{})
	agg := pdSim(t, sim.Config{Engine: sim.EngineSGLang})
	for _, tc := range pdCases {
		t.Run(tc.name, func(t *testing.T) {
			_, want := gwtest.PostTimeout(t, agg.URL()+tc.route, tc.body)
			resp, got := gwtest.PostTimeout(t, gw+tc.route, tc.body)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			if a, b := gwtest.AnswerText(t, got), gwtest.AnswerText(t, want); a != b || a == "" {
				t.Errorf("PD text %q, aggregated %q", a, b)
			}
			if src := resp.Header.Get(sim.HeaderKVSource); src != sim.SourceRemote {
				t.Errorf("decode KV source %q, want remote", src)
			}
			if h := resp.Header.Get("X-Baton-Kv-Handoff"); h != "bootstrap" {
				t.Errorf("handoff header %q, want bootstrap", h)
			}
			if resp.Header.Get("X-Baton-Prefill-Worker") != p.URL() || resp.Header.Get("X-Baton-Decode-Worker") != d.URL() {
				t.Errorf("worker headers %q %q", resp.Header.Get("X-Baton-Prefill-Worker"), resp.Header.Get("X-Baton-Decode-Worker"))
			}
		})
	}
	// The last prefill leg may still be finishing after its decode answered.
	poll.Until(t, "every prefill leg answered", func() bool { return p.Stats().RequestsOK == int64(len(pdCases)) })
	if s := p.Stats(); s.RequestsCancelled != 0 {
		t.Errorf("prefill stats %+v", s)
	}
}

func TestPDParallelBatch(t *testing.T) {
	t.Parallel()
	_, d, _, gw := sglangPD(t, sim.Config{}, sim.Config{})
	agg := pdSim(t, sim.Config{Engine: sim.EngineSGLang})
	for _, body := range []string{
		`{"text":["alpha beta","gamma delta epsilon"],"sampling_params":{"max_new_tokens":3}}`,
		`{"input_ids":[[1,2,3],[4,5]],"sampling_params":{"max_new_tokens":3}}`,
	} {
		_, want := gwtest.PostTimeout(t, agg.URL()+"/generate", body)
		resp, got := gwtest.PostTimeout(t, gw+"/generate", body)
		if resp.StatusCode != 200 || gwtest.StripIDs(got) != gwtest.StripIDs(want) {
			t.Errorf("batch %s: %d\n got %s\nwant %s", body, resp.StatusCode, got, want)
		}
	}
	_, want := gwtest.PostTimeout(t, agg.URL()+"/v1/completions", `{"model":"m","prompt":["a b","c d"],"max_tokens":3}`)
	if resp, got := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":["a b","c d"],"max_tokens":3}`); resp.StatusCode != 200 || !strings.Contains(got, gwtest.AnswerText(t, want)) {
		t.Errorf("completions batch: %d %s", resp.StatusCode, got)
	}
	if d.Stats().RequestsOK != 3 {
		t.Errorf("decode stats %+v", d.Stats())
	}
}

func TestPDParallelDPRanks(t *testing.T) {
	t.Parallel()
	p, _, _, gw := sglangPD(t, sim.Config{DPSize: 2}, sim.Config{DPSize: 2}, dpSizes(2, 2))
	ranks := map[string]bool{}
	for i := 0; i < 4; i++ {
		resp, body := gwtest.PostTimeout(t, gw+"/generate", `{"text":"dp ranks","sampling_params":{"max_new_tokens":2}}`)
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
		ranks[resp.Header.Get(sim.HeaderDPRank)] = true
	}
	if len(ranks) != 2 {
		t.Errorf("decode ranks used %v, want both", ranks)
	}
	poll.Until(t, "every prefill leg answered", func() bool { return p.Stats().RequestsOK == 4 })
}

func TestPDParallelLogprobMerge(t *testing.T) {
	t.Parallel()
	_, _, _, gw := sglangPD(t, sim.Config{}, sim.Config{})
	agg := pdSim(t, sim.Config{Engine: sim.EngineSGLang})
	body := `{"text":"a b c d e f","sampling_params":{"max_new_tokens":3,"ignore_eos":true},"return_logprob":true}`
	inputLP := func(s string) string {
		var v map[string]any
		json.Unmarshal([]byte(s), &v)
		b, _ := json.Marshal(v["meta_info"].(map[string]any)["input_token_logprobs"])
		return string(b)
	}
	_, want := gwtest.PostTimeout(t, agg.URL()+"/generate", body)
	resp, got := gwtest.PostTimeout(t, gw+"/generate", body)
	if resp.StatusCode != 200 || inputLP(got) != inputLP(want) {
		t.Fatalf("merged %s\nwant %s", inputLP(got), inputLP(want))
	}
	sbody := strings.Replace(body, `"return_logprob":true`, `"return_logprob":true,"stream":true`, 1)
	resp, got = gwtest.PostTimeout(t, gw+"/generate", sbody)
	events := 0
	for _, ev := range strings.Split(strings.TrimSpace(got), "\n\n") {
		d := strings.TrimPrefix(ev, "data: ")
		if d == "[DONE]" {
			continue
		}
		events++
		if inputLP(d) != inputLP(want) {
			t.Errorf("streamed event logprobs %s, want %s", inputLP(d), inputLP(want))
		}
	}
	if resp.StatusCode != 200 || events != 3 {
		t.Errorf("stream: %d, %d events", resp.StatusCode, events)
	}
}

func TestPDParallelFailures(t *testing.T) {
	t.Parallel()
	const body = `{"text":"fail fast","sampling_params":{"max_new_tokens":3}}`
	for _, tc := range []struct {
		name           string
		pc, dc         sim.Config
		status         int
		code           string
		penalised      string // prefill, decode or none
		cancelledOther string // the leg the simulator shows cancelled
	}{
		{"prefill 503", sim.Config{Faults: sim.Faults{Status: 503}}, sim.Config{}, 503, "prefill_upstream_error", "prefill", "decode"},
		{"prefill 400", sim.Config{Faults: sim.Faults{Status: 400}}, sim.Config{}, 400, "prefill_upstream_error", "none", "decode"},
		{"prefill 429", sim.Config{Faults: sim.Faults{Status: 429}}, sim.Config{}, 429, "prefill_upstream_error", "none", "decode"},
		{"decode 500", sim.Config{}, sim.Config{Faults: sim.Faults{Status: 500}}, 500, "decode_upstream_error", "decode", "prefill"},
		{"decode 404", sim.Config{}, sim.Config{Faults: sim.Faults{Status: 404}}, 404, "decode_upstream_error", "none", "prefill"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, d, s, gw := sglangPD(t, tc.pc, tc.dc)
			for _, stream := range []bool{false, true} {
				b := body
				if stream {
					b = strings.Replace(body, "{", `{"stream":true,`, 1)
				}
				resp, got := gwtest.PostTimeout(t, gw+"/generate", b)
				var e refusal
				if resp.StatusCode != tc.status || json.Unmarshal([]byte(got), &e) != nil || e.Error.Code != tc.code {
					t.Fatalf("stream=%v: %d %s, want %d %s", stream, resp.StatusCode, got, tc.status, tc.code)
				}
			}
			// The other leg was cancelled: every request it received ended cancelled (a leg
			// cancelled before it was sent never reaches the engine).
			other := map[string]*sim.Engine{"prefill": p, "decode": d}[tc.cancelledOther]
			poll.Until(t, "the other leg's requests ended", func() bool { s := other.Stats(); return s.RequestsCancelled == s.RequestsReceived })
			if s := other.Stats(); s.RequestsOK != 0 || s.RequestsFailed != 0 {
				t.Errorf("%s leg not cancelled: %+v", tc.cancelledOther, s)
			}
			ws := workersOf(s)
			_, pf := ws[0].Outcomes()
			_, df := ws[1].Outcomes()
			want := map[string][2]int64{"prefill": {2, 0}, "decode": {0, 2}, "none": {0, 0}}[tc.penalised]
			if pf != want[0] || df != want[1] {
				t.Errorf("failures prefill=%d decode=%d, want %v", pf, df, want)
			}
			poll.Until(t, "no leg in flight", func() bool { return ws[0].InFlight() == 0 && ws[1].InFlight() == 0 })
		})
	}
}

func TestPDParallelPrefillDown(t *testing.T) {
	t.Parallel()
	p, d, s, gw := sglangPD(t, sim.Config{}, sim.Config{})
	p.Close() // the prefill dies after registration: connection refused
	resp, got := gwtest.PostTimeout(t, gw+"/generate", `{"text":"anyone there","sampling_params":{"max_new_tokens":2}}`)
	var e refusal
	json.Unmarshal([]byte(got), &e)
	if resp.StatusCode != 502 || e.Error.Code != "prefill_upstream_unreachable" {
		t.Fatalf("%d %s", resp.StatusCode, got)
	}
	// The decode either was cancelled by Baton or failed on its own to reach the dead bootstrap
	// server; it never answered with a result.
	poll.Until(t, "the decode's requests ended without a result", func() bool {
		s := d.Stats()
		return s.RequestsCancelled+s.RequestsFailed == s.RequestsReceived && s.RequestsOK == 0
	})
	ws := workersOf(s)
	if _, f := ws[0].Outcomes(); f != 1 {
		t.Errorf("prefill failures %d, want 1", f)
	}
	if _, f := ws[1].Outcomes(); f != 0 {
		t.Errorf("decode penalised for the prefill's failure: %d", f)
	}
}

func TestPDParallelClientDisconnectCancelsBoth(t *testing.T) {
	t.Parallel()
	_, d, s, gw := sglangPD(t, sim.Config{}, sim.Config{DecodePerToken: 200 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw+"/generate", strings.NewReader(`{"text":"long answer","sampling_params":{"max_new_tokens":50},"stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	resp.Body.Read(buf) // the stream is flowing
	cancel()
	resp.Body.Close()
	poll.Until(t, "the decode cancelled", func() bool { return d.Stats().RequestsCancelled == 1 })
	ws := workersOf(s)
	poll.Until(t, "no leg in flight", func() bool { return ws[0].InFlight() == 0 && ws[1].InFlight() == 0 })
	if _, f := ws[1].Outcomes(); f != 0 {
		t.Errorf("client cancel counted against decode: %d", f)
	}
}

func TestPDHealthAndInfo(t *testing.T) {
	t.Parallel()
	_, _, _, gw := sglangPD(t, sim.Config{}, sim.Config{})
	get := func(path string) (*http.Response, string) {
		t.Helper()
		resp, err := http.Get(gw + path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, string(b)
	}
	if resp, body := get("/health_generate"); resp.StatusCode != 200 || !strings.Contains(body, "prefill=") {
		t.Errorf("health_generate: %d %s", resp.StatusCode, body)
	}
	if _, body := get("/get_server_info"); !strings.Contains(body, `"disaggregation_mode":"prefill"`) {
		t.Errorf("get_server_info: %s", body)
	}
	if resp, _ := get("/readiness"); resp.StatusCode != 200 {
		t.Errorf("readiness %d", resp.StatusCode)
	}
	// Non-PD routes without regular workers: 501.
	resp, body := post(t, gw+"/v1/embeddings", `{"model":"m","input":"x"}`)
	wantRefusal(t, resp, body, 501, "not_implemented_in_pd_mode")
	resp, body = post(t, gw+"/v1/chat/completions", `{"model":"nope","messages":[]}`)
	wantRefusal(t, resp, body, 404, "model_not_found")
}

func TestBootstrapInjection(t *testing.T) {
	t.Parallel()
	got := make(chan string, 4)
	leg := func(role string) string {
		return engine(t, func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			if r.Method == http.MethodPost {
				got <- role + " " + string(b)
			}
			io.WriteString(w, `{"text":"x","meta_info":{}}`)
		})
	}
	port := 9001
	pw := config.Worker{URL: leg("prefill"), Runtime: config.RuntimeSGLang, BootstrapPort: &port, DPSize: 4, Models: []string{"m"}}
	dw := config.Worker{URL: leg("decode"), Runtime: config.RuntimeSGLang, DPSize: 2, Models: []string{"m"}}
	_, gw, _ := gateway(t, nil, pdFleet(t, pw, dw))
	body := `{"zeta":1,"text":["a","b"],"bootstrap_room":5,"seed":9007199254740993}`
	if resp, out := post(t, gw+"/generate", body); resp.StatusCode != 200 {
		t.Fatal(resp.StatusCode, out)
	}
	legs := map[string]map[string]json.RawMessage{}
	raws := map[string]string{}
	var mu sync.Mutex
	for i := 0; i < 2; i++ {
		s := <-got
		role, b, _ := strings.Cut(s, " ")
		var m map[string]json.RawMessage
		if err := json.Unmarshal([]byte(b), &m); err != nil {
			t.Fatalf("%s leg body %s: %v", role, b, err)
		}
		mu.Lock()
		legs[role], raws[role] = m, b
		mu.Unlock()
	}
	for _, role := range []string{"prefill", "decode"} {
		b := raws[role]
		// The client's bootstrap_room is removed on arrival; Baton's fields follow its bytes.
		if !strings.HasPrefix(b, `{"zeta":1,"text":["a","b"],"seed":9007199254740993,"bootstrap_host":[`) {
			t.Errorf("%s leg does not keep the client's bytes: %s", role, b)
		}
		if string(legs[role]["bootstrap_host"]) != `["127.0.0.1","127.0.0.1"]` || string(legs[role]["bootstrap_port"]) != `[9001,9001]` {
			t.Errorf("%s leg bootstrap fields: %s", role, b)
		}
	}
	if string(legs["prefill"]["bootstrap_room"]) != string(legs["decode"]["bootstrap_room"]) {
		t.Errorf("rooms differ: %s vs %s", legs["prefill"]["bootstrap_room"], legs["decode"]["bootstrap_room"])
	}
	var rooms []uint64
	json.Unmarshal(legs["prefill"]["bootstrap_room"], &rooms)
	if len(rooms) != 2 || rooms[0] == rooms[1] || rooms[0] >= 1<<63 || rooms[1] >= 1<<63 {
		t.Errorf("rooms %v", rooms)
	}
	if legs["prefill"]["routed_dp_rank"] == nil || string(legs["decode"]["disagg_prefill_dp_rank"]) != string(legs["prefill"]["routed_dp_rank"]) || legs["decode"]["routed_dp_rank"] == nil {
		t.Errorf("dp ranks: prefill %s, decode %s", raws["prefill"], raws["decode"])
	}
	if _, ok := legs["prefill"]["disagg_prefill_dp_rank"]; ok {
		t.Error("prefill leg got disagg_prefill_dp_rank")
	}
}

func TestPDParallelMetrics(t *testing.T) {
	t.Parallel()
	_, _, s, gw := sglangPD(t, sim.Config{}, sim.Config{Faults: sim.Faults{Status: 503, Rate: 0}})
	// The outcome is counted as the handler returns, which may be just after the client has
	// read the whole answer.
	gwtest.PostTimeout(t, gw+"/generate", `{"text":"x","model":"m"}`)
	poll.Until(t, "the failed request counted", func() bool {
		return testutil.ToFloat64(s.metrics.PDRequests.WithLabelValues("m", "parallel", "decode_failed")) == 1
	})
	_, _, s2, gw2 := sglangPD(t, sim.Config{}, sim.Config{})
	gwtest.PostTimeout(t, gw2+"/generate", `{"text":"x","model":"m"}`)
	poll.Until(t, "the request counted", func() bool {
		return testutil.ToFloat64(s2.metrics.PDRequests.WithLabelValues("m", "parallel", "success")) == 1
	})
	if n := testutil.CollectAndCount(s2.metrics.PDTTFT); n != 1 {
		t.Errorf("ttft series %d", n)
	}
	poll.Until(t, "the prefill's duration observed", func() bool { return testutil.CollectAndCount(s2.metrics.PDPrefillDuration) == 1 })
}

// Baton counts its legs per DP rank and sends new work to the idle rank: while a long stream
// holds one decode rank, requests go to the other; when all end, every count is back to zero.
func TestPDDPRankFollowsLoad(t *testing.T) {
	t.Parallel()
	_, _, _, gw := sglangPD(t, sim.Config{DPSize: 2}, sim.Config{DPSize: 2, DecodePerToken: 5 * time.Millisecond}, dpSizes(2, 2))
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw+"/generate",
		strings.NewReader(`{"text":"long","sampling_params":{"max_new_tokens":2000,"ignore_eos":true},"stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	busy := resp.Header.Get(sim.HeaderDPRank)
	defer resp.Body.Close()
	for i := 0; i < 6; i++ {
		r, body := gwtest.PostTimeout(t, gw+"/generate", `{"text":"short","sampling_params":{"max_new_tokens":1}}`)
		if r.StatusCode != 200 || r.Header.Get(sim.HeaderDPRank) == busy {
			t.Fatalf("request %d: %d on decode rank %q while rank %q streams: %s", i, r.StatusCode, r.Header.Get(sim.HeaderDPRank), busy, body)
		}
	}
	cancel()
	resp.Body.Close()
	poll.Until(t, "every rank's count back to zero", func() bool {
		r, err := http.Get(gw + "/workers")
		if err != nil {
			return false
		}
		b, _ := io.ReadAll(r.Body)
		r.Body.Close()
		return strings.Count(string(b), `"dp_in_flight":[0,0]`) == 2
	})
}
