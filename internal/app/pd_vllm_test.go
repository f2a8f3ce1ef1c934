package app

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
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

// A Mooncake prefill configured with no engine id, whose bootstrap server cannot tell one at
// registration (nothing listens on its port), leaves none to mint: the decode recomputes,
// visibly. (Learning engine ids from the bootstrap server is the gateway's registration wiring;
// the request path's dispatch is tested in package server.)
func TestPDSequentialNoEngineIDLearned(t *testing.T) {
	t.Parallel()
	closed := 1
	_, _, _, gw := vllmPD(t, "MooncakeConnector", sim.Config{}, sim.Config{}, func(c *config.Config) {
		c.Workers[0].KVEngineID, c.Workers[0].BootstrapPort = "", &closed
	})
	if resp, _ := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"no id","max_tokens":2}`); resp.Header.Get("X-Baton-Kv-Handoff") != "none-no-engine-id" {
		t.Errorf("no engine id: %q", resp.Header.Get("X-Baton-Kv-Handoff"))
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
	logs := &gwtest.SyncBuffer{}
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
