package app

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/kvevents"
	"github.com/baton-llm/baton/internal/poll"
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
	_, _, gw := simFleet(t, []sim.Config{{}, {}, {}}, func(c *config.Config) { c.Policy = config.PolicyPrefixHash })
	home := ""
	for i := 0; i < 10; i++ {
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
	for i := 0; i < 30; i++ {
		resp, _ := gwtest.PostTimeout(t, gw+"/v1/chat/completions", chatWith(fmt.Sprintf("system prompt of group %d", i), "hi"))
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
		resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/chat/completions", chatWith(longPrompt, fmt.Sprintf("q%d", i)))
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

// least_load sees load Baton did not send: another client (or another replica) keeps one
// engine busy, its /metrics says so, and Baton routes around it; GET /workers shows the signal.
func TestLeastLoadSeesEngineReportedLoad(t *testing.T) {
	t.Parallel()
	es, g, gw := simFleet(t, []sim.Config{{MaxConcurrency: 1, DecodePerToken: 20 * time.Millisecond}, {}},
		func(c *config.Config) { c.Policy = config.PolicyLeastLoad; c.LoadPollInterval = 20 * time.Millisecond })
	busy, idle := es[0], es[1]
	// Another client: three long requests straight to the first engine (one runs, two queue).
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	for i := 0; i < 3; i++ {
		go func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, busy.URL()+"/v1/completions",
				strings.NewReader(`{"model":"m","prompt":"elsewhere","max_tokens":500,"ignore_eos":true}`))
			if resp, err := http.DefaultClient.Do(req); err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	poll.Until(t, "the condition", func() bool { l := g.Registry.Snapshot().Workers[0].EngineLoad(); return l.Waiting >= 2 })
	for i := 0; i < 10; i++ {
		resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"route me","max_tokens":2}`)
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Worker") != idle.URL() {
			t.Fatalf("request %d went to %s (%d): %s", i, resp.Header.Get("X-Baton-Worker"), resp.StatusCode, body)
		}
	}
	wresp, err := http.Get(gw + "/workers")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(wresp.Body)
	wresp.Body.Close()
	if !strings.Contains(string(b), `"engine_load":{"running":1,"waiting":2`) || !strings.Contains(string(b), `"fresh":true`) {
		t.Errorf("GET /workers does not show the engine's load: %s", b)
	}
}

// An engine whose /metrics stops answering is not trusted: its last report goes stale.
func TestStaleEngineLoadIsNotTrusted(t *testing.T) {
	t.Parallel()
	var broken atomic.Bool
	up := fakeEngineWith(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			if broken.Load() {
				w.WriteHeader(500)
				return
			}
			io.WriteString(w, "vllm:num_requests_running 3\nvllm:num_requests_waiting 5\n")
			return
		}
		io.WriteString(w, "{}")
	}, true)
	cfg := testConfig(up.URL)
	cfg.LoadPollInterval = 20 * time.Millisecond
	g, _ := startGateway(t, cfg)
	wk := g.Registry.Snapshot().Workers[0]
	poll.Until(t, "the condition", func() bool { return wk.EngineLoad().Fresh(time.Now()) && wk.EngineLoad().Waiting == 5 })
	broken.Store(true)
	poll.Until(t, "the condition", func() bool { return !wk.EngineLoad().Fresh(time.Now()) })
}

// cache_aware keeps each group of requests sharing a system prompt on a worker that has it
// cached: engines with a small prefix cache find far more of their prompts cached than under
// round_robin, which shows every group to every engine and thrashes their caches.
func TestCacheAwareRaisesEngineCacheHits(t *testing.T) {
	t.Parallel()
	share := func(policy string) float64 {
		engines := make([]sim.Config, 4)
		for i := range engines {
			// Room for about four of the seven groups' prompts (each ~75 blocks of 16 tokens).
			engines[i] = sim.Config{PrefixCache: true, PrefixCacheBlocks: 320}
		}
		es, _, gw := simFleet(t, engines, func(c *config.Config) { c.Policy = policy })
		for round := 0; round < 6; round++ {
			for g := 0; g < 7; g++ { // seven: round_robin over four is not sticky by accident
				system := fmt.Sprintf("group %d. %s", g, strings.Repeat(longPrompt, 4))
				resp, body := gwtest.PostTimeout(t, gw+"/v1/chat/completions", chatWith(system, fmt.Sprintf("question %d", round)))
				if resp.StatusCode != 200 {
					t.Fatalf("%s: %d %s", policy, resp.StatusCode, body)
				}
			}
		}
		var hits, queries int64
		for _, e := range es {
			s := e.Stats()
			hits, queries = hits+s.PrefixCacheHits, queries+s.PrefixCacheQueries
		}
		return float64(hits) / float64(queries)
	}
	rr, ca := share(config.PolicyRoundRobin), share(config.PolicyCacheAware)
	t.Logf("prompt tokens found cached: round_robin %.2f, cache_aware %.2f", rr, ca)
	if ca < 0.6 || ca < 2*rr {
		t.Errorf("cache_aware found %.2f of prompt tokens cached, round_robin %.2f", ca, rr)
	}
}

// PD with --prefill-policy cache_aware --decode-policy power_of_two, on both PD styles: the
// prefill follows the cached prefix, the decode the load, the KV handoff still happens, and
// X-Baton-Route and the route metrics say so.
func TestPDCacheAwareBothStyles(t *testing.T) {
	t.Parallel()
	for _, style := range []string{sim.EngineVLLM, sim.EngineSGLang} {
		t.Run(style, func(t *testing.T) {
			t.Parallel()
			cfg := config.Default()
			cfg.PDDisaggregation, cfg.RouteHeader = true, true
			cfg.PrefillPolicy, cfg.DecodePolicy = config.PolicyCacheAware, config.PolicyPowerOfTwo
			for i := 0; i < 2; i++ {
				if style == sim.EngineVLLM {
					p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl, PrefixCache: true})
					d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
					cfg.Workers = append(cfg.Workers, config.Worker{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector"},
						config.Worker{URL: d.URL(), Role: config.RoleDecode, KVConnector: "NixlConnector"})
					continue
				}
				p := simEngine(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill, PrefixCache: true})
				d := simEngine(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode})
				port := p.BootstrapPort()
				cfg.Workers = append(cfg.Workers, config.Worker{URL: p.URL(), Role: config.RolePrefill, BootstrapPort: &port},
					config.Worker{URL: d.URL(), Role: config.RoleDecode})
			}
			g, gw := startGateway(t, cfg)
			home := ""
			for i := 0; i < 8; i++ {
				resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/chat/completions", chatWith(longPrompt, fmt.Sprintf("q%d", i)))
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
			m := scrape(t, g)
			for _, want := range []string{`baton_route_decisions_total{policy="cache_aware",reason="cache_match",role="prefill"} 7`,
				`baton_route_decisions_total{policy="power_of_two",reason="load",role="decode"} 8`,
				`baton_route_prefix_match_ratio_count{role="prefill"} 8`, `baton_route_cache_index_blocks{role="prefill"}`} {
				if !strings.Contains(m, want) {
					t.Errorf("metrics lack %s", want)
				}
			}
		})
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
	_, _, gw := simFleet(t, engines, func(c *config.Config) { c.Policy = config.PolicyCacheAware })
	hot := strings.Repeat(longPrompt, 4)
	var mu sync.Mutex
	count := map[string]int{}
	var wg sync.WaitGroup
	const clients, each = 16, 5
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
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
		}()
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

// A worker with a KV events endpoint is subscribed to: its engine's blocks reach the index
// under the worker's name and model, and GET /workers and /metrics show the subscription.
func TestKVEventsSubscription(t *testing.T) {
	t.Parallel()
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, PrefixCache: true, KVEvents: true, KVEventsEncoding: sim.KVEventsMap})
	plain := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	cfg := config.Default()
	cfg.Workers = []config.Worker{{URL: e.URL(), KVEventsEndpoint: e.KVEventsEndpoint()}, {URL: plain.URL()}}
	g, gw := startGateway(t, cfg)
	if g.KVEvents == nil {
		t.Fatal("no subscription for a worker with kv_events_endpoint")
	}
	// ZMQ drops what is published before the subscriber joins: send until the index sees blocks.
	poll.Until(t, "the condition", func() bool {
		resp, _ := gwtest.PostTimeout(t, e.URL()+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"warm %d %s","max_tokens":1}`, pdModel, time.Now().UnixNano(), strings.Repeat("w ", 40)))
		n, _ := g.KVEvents.Index.Size()
		return resp.StatusCode == 200 && n > 0
	})
	prompt := strings.Repeat("the baton passes from hand to hand ", 10)
	for i := 0; i < 2; i++ { // round robin: one of the two reaches the publishing engine
		resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, pdModel, prompt))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	keys := kvevents.Keys(pdModel, "", sim.Tokenize(prompt), 16)
	poll.Until(t, "the condition", func() bool { return len(keys) > 0 && g.KVEvents.Index.Match(keys)[e.URL()] == len(keys) })
	wresp, err := http.Get(gw.URL + "/workers")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(wresp.Body)
	wresp.Body.Close()
	if !strings.Contains(string(b), `"kv_events":{"endpoint":"`+e.KVEventsEndpoint()+`","source":"configured","ranks":1,"healthy":true`) || strings.Count(string(b), `"kv_events"`) != 1 {
		t.Errorf("GET /workers does not show the one subscription: %s", b)
	}
	m := scrape(t, g)
	if !strings.Contains(m, `baton_kv_events_healthy{worker="`+e.URL()+`"} 1`) || !strings.Contains(m, "baton_kv_index_blocks ") {
		t.Errorf("metrics lack the subscription")
	}
}

// cache_aware from the engines' own KV events: prompts cached on an engine by traffic that never
// went through this Baton (another replica, a direct client) are routed to that engine; the
// approximate index, which knows only what this Baton routed, cannot.
func TestCacheAwareFollowsEngineEvents(t *testing.T) {
	t.Parallel()
	hits := func(source string) int {
		var es []*sim.Engine
		cfg := config.Default()
		cfg.Policy, cfg.CacheAwareSource, cfg.RouteHeader = config.PolicyCacheAware, source, true
		for i := 0; i < 2; i++ {
			e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, PrefixCache: true, KVEvents: true})
			es = append(es, e)
			cfg.Workers = append(cfg.Workers, config.Worker{URL: e.URL(), KVEventsEndpoint: e.KVEventsEndpoint()})
		}
		g, gw := startGateway(t, cfg)
		waitHealthy(t, es, g)
		return homeHits(t, g, gw.URL, es, 8, "X-Baton-Worker")
	}
	events, approx := hits("auto"), hits("approx")
	t.Logf("requests sent to the engine holding their prefix, of 8: events %d, approx %d", events, approx)
	if events != 8 {
		t.Errorf("from the engines' events, %d of 8 requests went to the engine holding their prefix", events)
	}
}

// Three Baton replicas over the same engines, clients spread across them, share nothing but
// the engines' KV events, and find as much of their prompts cached as one replica does; the
// approximate index, which each replica learns from its own third of the traffic, finds less.
func TestReplicasAgreeThroughEngineEvents(t *testing.T) {
	t.Parallel()
	share := func(replicas int, source string) float64 {
		var es []*sim.Engine
		cfg := config.Default()
		cfg.Policy, cfg.CacheAwareSource = config.PolicyCacheAware, source
		for i := 0; i < 4; i++ {
			// Room for about four of the eight groups' prompts each.
			e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, PrefixCache: true, PrefixCacheBlocks: 170, KVEvents: true})
			es = append(es, e)
			cfg.Workers = append(cfg.Workers, config.Worker{URL: e.URL(), KVEventsEndpoint: e.KVEventsEndpoint()})
		}
		var gs []*Gateway
		var urls []string
		for r := 0; r < replicas; r++ {
			g, gw := startGateway(t, cfg)
			gs, urls = append(gs, g), append(urls, gw.URL)
		}
		waitHealthy(t, es, gs...) // every replica subscribed to every engine
		var h0, q0 int64
		for _, e := range es {
			h0, q0 = h0+e.Stats().PrefixCacheHits, q0+e.Stats().PrefixCacheQueries
		}
		n := 0
		for round := 0; round < 6; round++ {
			for g := 0; g < 8; g++ {
				prompt := fmt.Sprintf("group %d. %s question %d", g, strings.Repeat("shared system prompt words for the group ", 80), round)
				resp, body := gwtest.PostTimeout(t, urls[n%replicas]+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, pdModel, prompt))
				if resp.StatusCode != 200 {
					t.Fatalf("%d %s", resp.StatusCode, body)
				}
				n++
				time.Sleep(5 * time.Millisecond) // the engine's events reach the replicas
			}
		}
		var h, q int64
		for _, e := range es {
			h, q = h+e.Stats().PrefixCacheHits, q+e.Stats().PrefixCacheQueries
		}
		return float64(h-h0) / float64(q-q0)
	}
	one, three, approx := share(1, "auto"), share(3, "auto"), share(3, "approx")
	t.Logf("prompt tokens found cached: 1 replica (events) %.2f, 3 replicas (events) %.2f, 3 replicas (approximate) %.2f", one, three, approx)
	if three < 0.95*one {
		t.Errorf("3 replicas from events found %.2f cached, 1 replica %.2f: want at least 0.95 of it", three, one)
	}
}
