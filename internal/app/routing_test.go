package app

import (
	"fmt"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
)

func chatWith(system, question string) string {
	return fmt.Sprintf(`{"model":"m","messages":[{"role":"system","content":%q},{"role":"user","content":%q}],"max_tokens":2}`, system, question)
}

// longPrompt is a system prompt longer than the prefix prefix_hash hashes (256 tokens, about
// 1,024 characters), as shared system prompts are.
var longPrompt = strings.Repeat("you are the anchor leg of a relay team; ", 30)

// prefix_hash keeps a shared prefix on one worker and spreads different ones.
func TestPrefixHashRouting(t *testing.T) {
	t.Parallel()
	_, _, gw := fleet(t, []sim.Config{{}, {}, {}}, func(c *config.Config) { c.Policy = config.PolicyPrefixHash })
	home := ""
	for i := 0; i < 10; i++ {
		resp, body := postTimeout(t, gw+"/v1/chat/completions", chatWith(longPrompt, fmt.Sprintf("question %d", i)))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		if w := resp.Header.Get("X-Baton-Worker"); home == "" {
			home = w
		} else if w != home {
			t.Fatalf("a shared prefix went to %s and %s", home, w)
		}
	}
	seen := map[string]bool{}
	for i := 0; i < 30; i++ {
		resp, _ := postTimeout(t, gw+"/v1/chat/completions", chatWith(fmt.Sprintf("system prompt of group %d", i), "hi"))
		seen[resp.Header.Get("X-Baton-Worker")] = true
	}
	if len(seen) < 2 {
		t.Errorf("30 different prefixes all went to %v", seen)
	}
}

// PD: the prefill follows the prefix, the decode the load; the handoff still happens.
func TestPDPrefixHashAndPowerOfTwo(t *testing.T) {
	t.Parallel()
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.PrefillPolicy, cfg.DecodePolicy = config.PolicyPrefixHash, config.PolicyPowerOfTwo
	for i := 0; i < 2; i++ {
		p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
		d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
		cfg.Workers = append(cfg.Workers, config.Worker{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector"},
			config.Worker{URL: d.URL(), Role: config.RoleDecode, KVConnector: "NixlConnector"})
	}
	_, gw := startGateway(t, cfg)
	home := ""
	for i := 0; i < 8; i++ {
		resp, body := postTimeout(t, gw.URL+"/v1/chat/completions", chatWith(longPrompt, fmt.Sprintf("q%d", i)))
		if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
			t.Fatalf("%d %q: %s", resp.StatusCode, resp.Header.Get(sim.HeaderKVSource), body)
		}
		if p := resp.Header.Get("X-Baton-Prefill-Worker"); home == "" {
			home = p
		} else if p != home {
			t.Fatalf("a shared prefix went to prefills %s and %s", home, p)
		}
	}
}
