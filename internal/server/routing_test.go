package server

// Where the routing policies send requests, through the HTTP door, over simulated engines with
// prefix caches: a shared prefix stays home, different ones spread, a hot one spreads when its
// home is busy, and in PD the prefill follows the prefix while the decode follows the load.

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/sim"
)

func chatWith(system, question string) string {
	return fmt.Sprintf(`{"model":"m","messages":[{"role":"system","content":%q},{"role":"user","content":%q}],"max_tokens":2}`, system, question)
}

// longPrompt is a system prompt longer than the prefix prefix_hash hashes (256 tokens, about
// 1,024 characters), as shared system prompts are.
var longPrompt = strings.Repeat("you are the anchor leg of a relay team; ", 30)

// routedFleet is a gateway routing by policyName over simulated vLLM engines (engines, serving
// "m").
func routedFleet(t *testing.T, policyName string, engines []sim.Config) ([]*sim.Engine, string) {
	t.Helper()
	es, _, gw := simulatedFleet(t, engines, func(o *Options) { o.Director.Selector.Policies[config.RoleRegular] = policyOf(t, policyName) })
	return es, gw
}

// prefix_hash keeps a shared prefix on one worker and spreads different ones.
func TestPrefixHashRouting(t *testing.T) {
	t.Parallel()
	_, gw := routedFleet(t, config.PolicyPrefixHash, []sim.Config{{}, {}, {}})
	home := ""
	for i := range 10 {
		resp, body := gwtest.PostTimeout(t, gw+"/v1/chat/completions", chatWith(longPrompt, fmt.Sprintf("question %d", i)))
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
	for i := range 30 {
		resp, _ := gwtest.PostTimeout(t, gw+"/v1/chat/completions", chatWith(fmt.Sprintf("system prompt of group %d", i), "hi"))
		seen[resp.Header.Get("X-Baton-Worker")] = true
	}
	if len(seen) < 2 {
		t.Errorf("30 different prefixes all went to %v", seen)
	}
}

// Routed by cache_aware, prompts that share a long system prompt per group find it cached:
// engines with a small prefix cache find far more of their prompts cached than under
// round_robin, which shows every group to every engine and thrashes their caches.
func TestCacheAwareRaisesEngineCacheHits(t *testing.T) {
	t.Parallel()
	share := func(policyName string) float64 {
		engines := make([]sim.Config, 4)
		for i := range engines {
			// Room for about four of the seven groups' prompts (each ~75 blocks of 16 tokens).
			engines[i] = sim.Config{PrefixCache: true, PrefixCacheBlocks: 320}
		}
		es, gw := routedFleet(t, policyName, engines)
		for round := range 6 {
			for g := range 7 { // seven: round_robin over four is not sticky by accident
				system := fmt.Sprintf("group %d. %s", g, strings.Repeat(longPrompt, 4))
				resp, body := gwtest.PostTimeout(t, gw+"/v1/chat/completions", chatWith(system, fmt.Sprintf("question %d", round)))
				if resp.StatusCode != 200 {
					t.Fatalf("%s: %d %s", policyName, resp.StatusCode, body)
				}
			}
		}
		var hits, queries int64
		for _, e := range es {
			st := e.Stats()
			hits, queries = hits+st.PrefixCacheHits, queries+st.PrefixCacheQueries
		}
		return float64(hits) / float64(queries)
	}
	rr, ca := share(config.PolicyRoundRobin), share(config.PolicyCacheAware)
	t.Logf("prompt tokens found cached: round_robin %.2f, cache_aware %.2f", rr, ca)
	if ca < 0.6 || ca < 2*rr {
		t.Errorf("cache_aware found %.2f of prompt tokens cached, round_robin %.2f", ca, rr)
	}
}

// A hot prefix that one engine cannot serve alone spreads: with many clients sending the same
// long system prompt at once, its first engine's queue makes computing the prompt elsewhere
// cheaper, and no engine serves more than half of the requests.
func TestCacheAwareSpreadsAHotPrefix(t *testing.T) {
	t.Parallel()
	engines := make([]sim.Config, 4)
	for i := range engines {
		engines[i] = sim.Config{PrefixCache: true, MaxConcurrency: 2, DecodePerToken: 5 * time.Millisecond}
	}
	_, gw := routedFleet(t, config.PolicyCacheAware, engines)
	hot := strings.Repeat(longPrompt, 4)
	var mu sync.Mutex
	count := map[string]int{}
	var wg sync.WaitGroup
	const clients, each = 16, 5
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				resp, body := gwtest.PostTimeout(t, gw+"/v1/chat/completions",
					fmt.Sprintf(`{"model":"m","messages":[{"role":"system","content":%q},{"role":"user","content":"c%d q%d"}],"max_tokens":8,"ignore_eos":true}`, hot, c, i))
				if resp.StatusCode != 200 {
					t.Errorf("%d %s", resp.StatusCode, body)
					return
				}
				mu.Lock()
				count[resp.Header.Get("X-Baton-Worker")]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	t.Logf("requests per engine: %v", count)
	for w, n := range count {
		if n > clients*each/2 {
			t.Errorf("engine %s served %d of %d requests of the hot prefix", w, n, clients*each)
		}
	}
	if len(count) < 3 {
		t.Errorf("the hot prefix reached %d engines of 4", len(count))
	}
}

// pdRouted is a PD gateway over two pairs of simulated engines of style (vLLM through NIXL, or
// SGLang), prefills with a prefix cache, routed by prefillPolicy and decodePolicy, each choice's
// reasons in X-Baton-Route.
func pdRouted(t *testing.T, style, prefillPolicy, decodePolicy string) (*Server, string) {
	t.Helper()
	var ws []config.Worker
	m := []string{"m"}
	for range 2 {
		if style == sim.EngineVLLM {
			p := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl, PrefixCache: true})
			d := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
			ws = append(ws, config.Worker{URL: p.URL(), Role: config.RolePrefill, Runtime: config.RuntimeVLLM, KVConnector: "NixlConnector", Models: m},
				config.Worker{URL: d.URL(), Role: config.RoleDecode, Runtime: config.RuntimeVLLM, KVConnector: "NixlConnector", Models: m})
			continue
		}
		p := pdSim(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill, PrefixCache: true})
		d := pdSim(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode})
		port := p.BootstrapPort()
		ws = append(ws, config.Worker{URL: p.URL(), Role: config.RolePrefill, Runtime: config.RuntimeSGLang, BootstrapPort: &port, Models: m},
			config.Worker{URL: d.URL(), Role: config.RoleDecode, Runtime: config.RuntimeSGLang, Models: m})
	}
	s, gw, _ := gateway(t, nil, pdFleetOf(t, prefillPolicy, decodePolicy, ws...), func(o *Options) { o.Director.RouteHeader = true })
	return s, gw
}

// PD: the prefill follows the prefix (prefix_hash), the decode the load; the handoff still
// happens.
func TestPDPrefixHashAndPowerOfTwo(t *testing.T) {
	t.Parallel()
	_, gw := pdRouted(t, sim.EngineVLLM, config.PolicyPrefixHash, config.PolicyPowerOfTwo)
	home := ""
	for i := range 8 {
		resp, body := gwtest.PostTimeout(t, gw+"/v1/chat/completions", chatWith(longPrompt, fmt.Sprintf("q%d", i)))
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

// PD with cache_aware prefills and power_of_two decodes, on both PD styles: the prefill follows
// the cached prefix, the decode the load, the KV handoff still happens, and X-Baton-Route and the
// route metrics say so.
func TestPDCacheAwareBothStyles(t *testing.T) {
	t.Parallel()
	for _, style := range []string{sim.EngineVLLM, sim.EngineSGLang} {
		t.Run(style, func(t *testing.T) {
			t.Parallel()
			s, gw := pdRouted(t, style, config.PolicyCacheAware, config.PolicyPowerOfTwo)
			home := ""
			for i := range 8 {
				resp, body := gwtest.PostTimeout(t, gw+"/v1/chat/completions", chatWith(longPrompt, fmt.Sprintf("q%d", i)))
				if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
					t.Fatalf("%d %q: %s", resp.StatusCode, resp.Header.Get(sim.HeaderKVSource), body)
				}
				route := resp.Header.Get("X-Baton-Route")
				if !strings.Contains(route, "role=decode; policy=power_of_two; reason=load") {
					t.Errorf("request %d: X-Baton-Route %q lacks the decode's decision", i, route)
				}
				if p := resp.Header.Get("X-Baton-Prefill-Worker"); home == "" {
					home = p
					continue
				} else if p != home {
					t.Fatalf("a shared prefix went to prefills %s and %s", home, p)
				}
				if !strings.Contains(route, "role=prefill; policy=cache_aware; reason=cache_match;") || !strings.Contains(route, "; match=0.9") {
					t.Errorf("request %d: X-Baton-Route %q, want the prefill's cache match", i, route)
				}
			}
			m := scrape(t, s)
			for _, want := range []string{`baton_route_decisions_total{policy="cache_aware",reason="cache_match",role="prefill"} 7`,
				`baton_route_decisions_total{policy="power_of_two",reason="load",role="decode"} 8`,
				`baton_route_prefix_match_ratio_count{role="prefill"} 8`} {
				if !strings.Contains(m, want) {
					t.Errorf("metrics lack %s", want)
				}
			}
		})
	}
}
