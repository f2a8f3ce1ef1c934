package app

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/sim"
)

// An alias through both PD styles: served, the answer's handoff as without an alias.
func TestModelAliasThroughPD(t *testing.T) {
	for name, fleet := range map[string]func(t *testing.T) config.Config{"vllm nixl": nixlPDFleet, "sglang": sglangPDFleet} {
		t.Run(name, func(t *testing.T) {
			cfg := fleet(t)
			cfg.Models = map[string]config.ModelConfig{"alias": {Serve: pdModel}}
			_, gw := startGateway(t, cfg)
			for _, stream := range []string{"", `,"stream":true`} {
				resp, b := gwtest.PostTimeout(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":"alias","prompt":"alias through pd","max_tokens":4%s}`, stream))
				if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Model") != pdModel || !strings.Contains(b, `"model":"`+pdModel+`"`) {
					t.Errorf("%s: %d %v %s", stream, resp.StatusCode, resp.Header, b)
				}
				if h := resp.Header.Get("X-Baton-Kv-Handoff"); h == "" || strings.HasPrefix(h, "none") {
					t.Errorf("%s: handoff %q", stream, h)
				}
			}
		})
	}
}

// A model's own policy routes its requests; the others keep the fleet's. A reload swaps
// aliases and policies live.
func TestModelPolicyAndReload(t *testing.T) {
	a, b := modelEngine(t, "small", sim.Faults{}), modelEngine(t, "big", sim.Faults{})
	file := filepath.Join(t.TempDir(), "baton.yaml")
	write := func(y string) {
		if err := os.WriteFile(file, []byte(y), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	base := fmt.Sprintf("host: 127.0.0.1\nroute_header: true\nworker_urls: [%s, %s]\n", a.URL(), b.URL())
	write(base + "models:\n  big: {policy: least_load}\n  fast: {serve: small}\n")
	g, gw := startGateway(t, cfgOf(t, file))
	policyOf := func(model string) (string, string) {
		resp, _ := gwtest.PostTimeout(t, gw.URL+"/v1/completions", `{"model":"`+model+`","prompt":"x","max_tokens":1}`)
		_, p, _ := strings.Cut(resp.Header.Get("X-Baton-Route"), "policy=")
		p, _, _ = strings.Cut(p, ";")
		return p, resp.Header.Get("X-Baton-Model")
	}
	if p, _ := policyOf("big"); p != "least_load" {
		t.Errorf("big routed by %q", p)
	}
	if p, served := policyOf("fast"); p != "round_robin" || served != "small" {
		t.Errorf("fast routed by %q to %q", p, served)
	}
	write(base + "models:\n  big: {policy: random}\n  fast: {serve: big}\n")
	if err := g.Reload(); err != nil {
		t.Fatal(err)
	}
	if p, _ := policyOf("big"); p != "random" {
		t.Errorf("after the reload big routed by %q", p)
	}
	if _, served := policyOf("fast"); served != "big" {
		t.Errorf("after the reload fast served by %q", served)
	}
}

// modelEngine is a simulated vLLM engine serving model, with faults.
func modelEngine(t *testing.T, model string, f sim.Faults) *sim.Engine {
	t.Helper()
	return startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: model, Faults: f})
}
