package app

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/kvevents"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

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
