package app

// The PD seam where the whole gateway is needed: what registration says and learns about a PD
// fleet (connector names, DP sizes, Mooncake engine ids, also after a restart) and what the
// configuration forwards. The seam's per-request outcomes are internal/server's tests.

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

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
func startLogged(t *testing.T, cfg config.Config) *gwtest.SyncBuffer {
	t.Helper()
	logs := &gwtest.SyncBuffer{}
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

// A start with nothing amiss warns of nothing: a WARN at startup means something to act on (so
// that the misconfigurations above are heard).
func TestAHealthyStartWarnsOfNothing(t *testing.T) {
	t.Parallel()
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	r := startRun(t, "--worker-urls", e.URL())
	poll.Until(t, "the worker registered", func() bool { return strings.Contains(r.logs.String(), "worker registered") })
	if strings.Contains(r.logs.String(), "level=WARN") {
		t.Errorf("a healthy start warned:\n%s", r.logs.String())
	}
}
