package app

// The PD seam, second pass: each test here failed on the gateway before it (wrong handoffs,
// wasted prefills, outcomes that lied), against simulators as strict as the engines.

import (
	"fmt"
	"io"
	"log/slog"
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
)

// Item 1: a prompt list was tagged like one request; vLLM answers the first prompt's params only,
// and a decode serving the whole list with them fails. The prefill is skipped, visibly.
func TestPDSequentialPromptListIsNotHandedOff(t *testing.T) {
	t.Parallel()
	for _, connector := range []string{"NixlConnector", "MooncakeConnector"} {
		t.Run(connector, func(t *testing.T) {
			t.Parallel()
			p, d, g, gw := vllmPD(t, connector, sim.Config{}, sim.Config{})
			agg := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
			for _, body := range []string{
				`{"model":"m","prompt":["first of two","second of two"],"max_tokens":4}`,
				`{"model":"m","prompt":[[11,12,13],[21,22]],"max_tokens":4}`,
			} {
				_, want := gwtest.PostTimeout(t, agg.URL()+"/v1/completions", body)
				resp, got := gwtest.PostTimeout(t, gw+"/v1/completions", body)
				if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-batch" {
					t.Fatalf("%s: %d, handoff %q: %s", body, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), got)
				}
				if gwtest.StripIDs(got) != gwtest.StripIDs(want) {
					t.Errorf("PD answer\n%s\nwant (aggregated)\n%s", got, want)
				}
			}
			if s := p.Stats(); s.RequestsReceived != 0 {
				t.Errorf("the prefill served %d requests: a batch must not waste one", s.RequestsReceived)
			}
			if s := d.Stats(); s.KVLoadFailures != 0 {
				t.Errorf("%d decode KV loads failed", s.KVLoadFailures)
			}
			if v := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("none-batch", pd.HandoffClass("none-batch"), map[string]string{"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}[connector])); v != 2 {
				t.Errorf("none-batch counted %v, want 2", v)
			}
		})
	}
}

// Item 9: kv_transfer_params that are the request's own tag echoed back (do_remote_decode still
// true) are no handoff; relaying them asks the decode engine to prefill for a remote decode.
func TestPDSequentialEchoedTagIsNoHandoff(t *testing.T) {
	t.Parallel()
	echo := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		tag := b[strings.Index(string(b), `"kv_transfer_params":`)+len(`"kv_transfer_params":`):]
		tag = tag[:strings.IndexByte(string(tag), '}')+1]
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"x"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},"kv_transfer_params":`+string(tag)+`}`)
	})
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Retry.Disable = true
	cfg.Workers = []config.Worker{{URL: echo.URL, Role: config.RolePrefill, KVConnector: "NixlConnector"}, {URL: d.URL(), Role: config.RoleDecode}}
	_, gw := startGateway(t, cfg)
	resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"echo echo","max_tokens":3}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-invalid-params" {
		t.Fatalf("%d, handoff %q: %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), body)
	}
	if src := resp.Header.Get(sim.HeaderKVSource); src != sim.SourceRecompute {
		t.Errorf("decode KV source %q, want recompute", src)
	}
}

// Item 8: every outcome is true. A failed PD request no longer says it handed off, a prefill that
// failed is never counted as a success, and a failed prefill still names its handoff.
func TestPDOutcomesAreTrue(t *testing.T) {
	t.Parallel()
	t.Run("sglang prefill fails", func(t *testing.T) {
		t.Parallel()
		_, _, g, gw := sglangPD(t, sim.Config{Faults: sim.Faults{Status: 503}}, sim.Config{})
		resp, body := gwtest.PostTimeout(t, gw+"/generate", `{"text":"fail me","sampling_params":{"max_new_tokens":2}}`)
		if resp.StatusCode != 503 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-failed" {
			t.Fatalf("%d, handoff %q: %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), body)
		}
		poll.Until(t, "the condition", func() bool {
			return testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("none-failed", pd.HandoffClass("none-failed"), "bootstrap")) == 1
		})
		if v := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("bootstrap", pd.HandoffClass("bootstrap"), "bootstrap")); v != 0 {
			t.Errorf("a failed request counted as %v bootstrap handoffs", v)
		}
	})
	t.Run("prefill fails after the decode answered", func(t *testing.T) {
		t.Parallel()
		release := make(chan struct{})
		prefill := anyModelEngine(t, func(w http.ResponseWriter, r *http.Request) {
			io.ReadAll(r.Body)
			<-release
			w.WriteHeader(400)
			io.WriteString(w, `{"error":{"message":"bad"}}`)
		})
		decode := anyModelEngine(t, func(w http.ResponseWriter, r *http.Request) {
			io.ReadAll(r.Body)
			io.WriteString(w, `{"text":"computed without the prefill"}`)
		})
		cfg := config.Default()
		cfg.PDDisaggregation = true
		cfg.Retry.Disable = true
		cfg.Workers = []config.Worker{{URL: prefill, Role: config.RolePrefill, Runtime: config.RuntimeSGLang}, {URL: decode, Role: config.RoleDecode, Runtime: config.RuntimeSGLang}}
		g, gw := startGateway(t, cfg)
		resp, _ := gwtest.PostTimeout(t, gw.URL+"/generate", `{"text":"late failure"}`)
		close(release)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		poll.Until(t, "the condition", func() bool {
			return testutil.ToFloat64(g.Metrics.PDRequests.WithLabelValues("none", "parallel", "prefill_failed")) == 1
		})
		if v := testutil.ToFloat64(g.Metrics.PDRequests.WithLabelValues("none", "parallel", "success")); v != 0 {
			t.Errorf("a request whose prefill answered 400 counted as %v successes", v)
		}
	})
	t.Run("vllm prefill fails", func(t *testing.T) {
		t.Parallel()
		_, _, g, gw := vllmPD(t, "NixlConnector", sim.Config{Faults: sim.Faults{Status: 503}}, sim.Config{})
		resp, _ := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"fail me","max_tokens":2}`)
		if resp.StatusCode != 503 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-failed" {
			t.Fatalf("%d, handoff %q", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"))
		}
		if v := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("none-failed", pd.HandoffClass("none-failed"), "nixl")); v != 1 {
			t.Errorf("none-failed counted %v", v)
		}
	})
	t.Run("vllm decode fails", func(t *testing.T) {
		t.Parallel()
		_, _, g, gw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{Faults: sim.Faults{Status: 503}})
		resp, _ := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"fail me","max_tokens":2}`)
		if resp.StatusCode != 503 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-failed" {
			t.Fatalf("%d, handoff %q", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"))
		}
		if v := testutil.ToFloat64(g.Metrics.PDHandoffs.WithLabelValues("nixl", pd.HandoffClass("nixl"), "nixl")); v != 0 {
			t.Errorf("a handoff the decode never consumed counted %v times as nixl", v)
		}
	})
}

// Item 10: connector names are the engines' own, in any case; an unknown one is refused with the
// list (it used to mean a silent passthrough); settings that make every request recompute are
// said loudly at registration.
func TestConnectorNamesAndLoudMisconfiguration(t *testing.T) {
	t.Parallel()
	if _, err := config.Parse([]string{"--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "--kv-connector", "Nxl"}, io.Discard); err == nil ||
		!strings.Contains(err.Error(), `kv_connector "Nxl" is unknown`) || !strings.Contains(err.Error(), "NixlConnector") {
		t.Errorf("an unknown connector name: %v", err)
	}
	_, _, _, gw := vllmPD(t, "nixlCONNECTOR", sim.Config{}, sim.Config{}, func(c *config.Config) { c.KVConnector = "Nixl" })
	resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"any case","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "nixl" || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
		t.Errorf("connector nixlCONNECTOR: %d, handoff %q, KV %q: %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), body)
	}

	mooncake := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorMooncake})
	generic := anyModelEngine(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Workers = []config.Worker{{URL: mooncake.URL(), Role: config.RolePrefill, KVConnector: "mooncake"}, {URL: generic, Role: config.RoleDecode}}
	logs := startLogged(t, cfg)
	poll.Until(t, "the condition", func() bool {
		return strings.Contains(logs.String(), "Mooncake prefill worker has no engine id") && strings.Contains(logs.String(), "registered as generic with no model list")
	})
	if !strings.Contains(logs.String(), "level=WARN") {
		t.Errorf("not warnings:\n%s", logs.String())
	}
}

// Item 4: decodes have a connector too. Over a fleet that mixes NIXL and Mooncake pairs on one
// model, every request is paired within its connector and hands off; round robin across them
// used to send half the requests to a decode that could not read the params (a silent
// recompute).
func TestPDPairsWithinAConnector(t *testing.T) {
	t.Parallel()
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Retry.Disable = true
	cfg.DecodePolicy = config.PolicyRandom // not in lockstep with the prefills' round robin
	var decodes []*sim.Engine
	for _, c := range []struct{ sim, name string }{{sim.ConnectorNixl, "NixlConnector"}, {sim.ConnectorMooncake, "MooncakeConnector"}} {
		p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: c.sim, EngineID: "p-" + c.sim})
		d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: c.sim})
		decodes = append(decodes, d)
		pw := config.Worker{URL: p.URL(), Role: config.RolePrefill, KVConnector: c.name, KVEngineID: "p-" + c.sim}
		if bp := p.BootstrapPort(); bp != 0 {
			pw.BootstrapPort = &bp
		}
		cfg.Workers = append(cfg.Workers, pw, config.Worker{URL: d.URL(), Role: config.RoleDecode, KVConnector: c.name})
	}
	_, gw := startGateway(t, cfg)
	for i := 0; i < 12; i++ {
		resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"pair me `+strings.Repeat("x", i)+`","max_tokens":2}`)
		if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
			t.Fatalf("request %d: %d, handoff %q, KV %q: %s", i, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), body)
		}
	}
	for _, d := range decodes {
		if s := d.Stats(); s.KVConnectorMismatches != 0 {
			t.Errorf("a decode got %d handoffs of another connector", s.KVConnectorMismatches)
		}
	}
}

// Item 7: SGLang-only routes go only to workers that serve them. In a fleet with SGLang and vLLM
// pairs on one model, /generate and the info routes used to flap between 200 and 404; a vLLM
// pair's /health_generate checks each leg's /health.
func TestSGLangRoutesSkipVLLMWorkers(t *testing.T) {
	t.Parallel()
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Retry.Disable = true
	cfg.DecodePolicy = config.PolicyRandom // not in lockstep with the prefills' round robin
	sp := simEngine(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill})
	sd := simEngine(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode})
	vp := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	vd := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	bp := sp.BootstrapPort()
	cfg.Workers = []config.Worker{
		{URL: vp.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector"}, {URL: sp.URL(), Role: config.RolePrefill, BootstrapPort: &bp},
		{URL: vd.URL(), Role: config.RoleDecode, KVConnector: "NixlConnector"}, {URL: sd.URL(), Role: config.RoleDecode},
	}
	_, gw := startGateway(t, cfg)
	for i := 0; i < 6; i++ {
		resp, body := gwtest.PostTimeout(t, gw.URL+"/generate", `{"text":"sglang only","sampling_params":{"max_new_tokens":2}}`)
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Prefill-Worker") != sp.URL() {
			t.Fatalf("/generate %d: %d via %s: %s", i, resp.StatusCode, resp.Header.Get("X-Baton-Prefill-Worker"), body)
		}
		info, err := http.Get(gw.URL + "/get_server_info")
		if err != nil {
			t.Fatal(err)
		}
		info.Body.Close()
		if info.StatusCode != 200 {
			t.Fatalf("/get_server_info %d: %d", i, info.StatusCode)
		}
	}
	// Generation routes both runtimes serve pair within a runtime: a vLLM prefill's params never
	// go to an SGLang decode, nor a bootstrap room to a vLLM decode.
	for i := 0; i < 8; i++ {
		resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"runtime pairs `+strings.Repeat("v", i)+`","max_tokens":2}`)
		if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
			t.Fatalf("completion %d: %d, handoff %q, KV %q: %s", i, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), body)
		}
	}
	// A vLLM-only PD fleet: /health_generate checks each leg's /health.
	_, _, _, vgw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{})
	resp, err := http.Get(vgw + "/health_generate")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("/health_generate on a vLLM pair: %d %s", resp.StatusCode, b)
	}
}

// Item 2: the prefill's DP rank and the bootstrap room agree (room % dp_size == rank). An SGLang
// prefill that follows the room refused every request whose round-robin rank disagreed with a
// random room: about half of them.
func TestPDParallelRoomFollowsTheRank(t *testing.T) {
	t.Parallel()
	_, _, _, gw := sglangPD(t, sim.Config{DPSize: 2}, sim.Config{DPSize: 2}, func(c *config.Config) {
		c.Workers[0].DPSize, c.Workers[1].DPSize = 2, 2
	})
	for i := 0; i < 16; i++ {
		resp, body := gwtest.PostTimeout(t, gw+"/generate", `{"text":"rank and room `+strings.Repeat("y", i)+`","sampling_params":{"max_new_tokens":2}}`)
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
	}
	resp, body := gwtest.PostTimeout(t, gw+"/generate", `{"text":["a","b","c"],"sampling_params":{"max_new_tokens":1}}`)
	if resp.StatusCode != 200 {
		t.Fatalf("a batch: %d %s", resp.StatusCode, body)
	}
}

// Item 2: a configured dp_size that is not the engine's is said at registration.
func TestDPSizeCheckedAtRegistration(t *testing.T) {
	t.Parallel()
	p := simEngine(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill})
	d := simEngine(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode})
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, DPSize: 2}, {URL: d.URL(), Role: config.RoleDecode}}
	logs := startLogged(t, cfg)
	poll.Until(t, "the condition", func() bool { return strings.Contains(logs.String(), "configured dp_size differs") })
	if !strings.Contains(logs.String(), "engine_dp_size=1") {
		t.Errorf("the warning does not name the engine's size:\n%s", logs.String())
	}
}

// Item 5: a Mooncake handoff needs the prefill's engine id, which used to be hand-copied into
// Baton's configuration (from flags alone every request recomputed). Baton learns it from the
// prefill's bootstrap server, per DP rank, as vLLM's own proxy does, and learns it anew when the
// engine restarts under another id.
func TestMooncakeEngineIDsAreLearned(t *testing.T) {
	t.Parallel()
	for _, dp := range []int{1, 2} {
		p, _, _, gw := vllmPD(t, "MooncakeConnector", sim.Config{EngineID: "learn-me", DPSize: dp}, sim.Config{}, func(c *config.Config) {
			c.Workers[0].KVEngineID = "" // nothing configured: as from --prefill URL PORT --kv-connector MooncakeConnector
		})
		for i := 0; i < 4; i++ {
			resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"learned `+strings.Repeat("z", i)+`","max_tokens":2}`)
			if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "mooncake" || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
				t.Fatalf("dp %d request %d: %d, handoff %q, KV %q: %s", dp, i, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), body)
			}
		}
		if s := p.Stats(); s.HandoffsPinned != 4 {
			t.Errorf("dp %d: %d handoffs pinned, want 4", dp, s.HandoffsPinned)
		}
	}
}

func TestMooncakeEngineIDsRelearnedAfterARestart(t *testing.T) {
	t.Parallel()
	start := func(id string, port, bport int) *sim.Engine {
		e, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorMooncake, Model: pdModel,
			EngineID: id, Port: port, BootstrapPort: bport})
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	p := start("before-restart", 0, 0)
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorMooncake})
	bp := p.BootstrapPort()
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Retry.Disable = true
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: "MooncakeConnector", BootstrapPort: &bp},
		{URL: d.URL(), Role: config.RoleDecode, KVConnector: "MooncakeConnector"}}
	_, gw := startGateway(t, cfg, func(c *config.Config) { c.HealthCheck.Interval = 50 * time.Millisecond })
	handsOff := func() bool {
		resp, _ := gwtest.PostTimeout(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"restart","max_tokens":2}`)
		return resp.StatusCode == 200 && resp.Header.Get(sim.HeaderKVSource) == sim.SourceRemote
	}
	if !handsOff() {
		t.Fatal("no handoff before the restart")
	}
	var port int
	fmt.Sscanf(p.URL()[strings.LastIndexByte(p.URL(), ':')+1:], "%d", &port)
	p.Close()
	p = start("after-restart", port, bp)
	t.Cleanup(p.Close)
	poll.Until(t, "a handoff with the new engine id", handsOff) // the old id would make every handoff fail: the new one was learned
}

// X-Sim-Fault reaches simulated engines through the gateway only when asked for.
func TestSimFaultsThroughTheGateway(t *testing.T) {
	t.Parallel()
	for _, forward := range []bool{false, true} {
		_, _, gw := simFleet(t, []sim.Config{{}}, func(c *config.Config) { c.ForwardSimFaults = forward; c.Retry.Disable = true })
		req, _ := http.NewRequest(http.MethodPost, gw+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"fault","max_tokens":2}`))
		req.Header.Set("X-Sim-Fault", "status=503")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if want := map[bool]int{false: 200, true: 503}[forward]; resp.StatusCode != want {
			t.Errorf("forward_sim_faults %v: %d, want %d", forward, resp.StatusCode, want)
		}
	}
}

// startLogged starts a gateway for cfg whose log is kept, without waiting for its workers, and
// returns the log.
func startLogged(t *testing.T, cfg config.Config) *syncBuffer {
	t.Helper()
	logs := &syncBuffer{}
	g, err := New(cfg, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Wait)
	return logs
}
