package app

// The PD seam, third pass: each test here fails on the gateway before it, against simulators
// that behave as the engines' current source does. These need the whole gateway: KV-event
// subscriptions wired by the fleet, engine ids learned at registration and by health probes.
// (The cases of the PD executor and the HTTP door are the server's own:
// internal/server/pd_seam_engines_test.go.)

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/kvevents"
	"github.com/baton-llm/baton/internal/kvfleet"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// Item 9: the tokenize call for a chat sent the messages alone, so an agentic request's tools
// (and the template's arguments, add_generation_prompt, continue_final_message) were missing from
// its token ids, and its blocks never matched what the engine had cached.
func TestCacheAwareChatWithToolsFollowsEngineEvents(t *testing.T) {
	t.Parallel()
	es, g, gw := eventsFleet(t, sim.Config{Engine: sim.EngineVLLM})
	waitHealthy(t, es, g)
	tools := `[{"type":"function","function":{"name":"search","description":"` + strings.Repeat("look things up in the corpus ", 12) + `","parameters":{"type":"object"}}}]`
	for p, h := range []int{0, 0, 1, 1, 1, 0} { // not the turn a fallback would take
		home := es[h]
		chat := func(question string) string {
			return fmt.Sprintf(`{"model":%q,"tools":%s,"chat_template_kwargs":{"thinking":%v},"messages":[{"role":"system","content":"agent %d"},{"role":"user","content":%q}],"max_tokens":2}`,
				pdModel, tools, p%3 == 0, p, question)
		}
		if resp, body := gwtest.PostTimeout(t, home.URL()+"/v1/chat/completions", chat("first")); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		_, tok := gwtest.PostTimeout(t, home.URL()+"/tokenize", chat("first"))
		var v struct{ Tokens []uint32 }
		if err := json.Unmarshal([]byte(tok), &v); err != nil || len(v.Tokens) < 64 {
			t.Fatalf("tokenize: %v %s", err, tok)
		}
		keys := kvevents.Keys(pdModel, "", v.Tokens, 16)
		poll.Until(t, "the condition", func() bool { return g.KVEvents.Index.Match(keys)[home.URL()] == len(keys) })
		resp, body := gwtest.PostTimeout(t, gw+"/v1/chat/completions", chat("first"))
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Worker") != home.URL() || !strings.Contains(resp.Header.Get("X-Baton-Route"), "reason=cache_match") {
			t.Fatalf("agent %d: %d, sent to %s, not to %s that holds its prefix (route %s): %s", p, resp.StatusCode,
				resp.Header.Get("X-Baton-Worker"), home.URL(), resp.Header.Get("X-Baton-Route"), body)
		}
	}
}

// Item 8: a hybrid-attention model announces each block once per KV-cache group, and its
// sliding-window group frees a prompt's early blocks at once; read as removals of the prompt's
// blocks they erased the full-attention prefix, and routing from events found nothing. Only
// full-attention groups are indexed.
func TestCacheAwareOnHybridAttentionEvents(t *testing.T) {
	t.Parallel()
	for _, encoding := range []string{sim.KVEventsArray, sim.KVEventsMap} {
		t.Run(encoding, func(t *testing.T) {
			t.Parallel()
			es, g, gw := eventsFleet(t, sim.Config{Engine: sim.EngineVLLM, HybridKV: true, KVEventsEncoding: encoding})
			waitHealthy(t, es, g)
			routesHome(t, g, gw, es, pdModel, "")
		})
	}
}

// Item 10 (should): a request for a LoRA adapter was matched against the base model's chain,
// while the engine's events root the adapter's blocks on its lora_name: routing from events
// never found an adapter's prefix. It is matched against the adapter's chain.
func TestCacheAwareLoRAFollowsEngineEvents(t *testing.T) {
	t.Parallel()
	es, g, gw := eventsFleet(t, sim.Config{Engine: sim.EngineVLLM, LoRAAdapters: []string{"sql-adapter"}})
	waitHealthy(t, es, g)
	routesHome(t, g, gw, es, "sql-adapter", "sql-adapter")
}

// eventsFleet starts two engines of c publishing KV events (their prefix caches on), and a
// cache_aware gateway subscribed to them, with the route header.
func eventsFleet(t *testing.T, c sim.Config) ([]*sim.Engine, *Gateway, string) {
	t.Helper()
	var es []*sim.Engine
	cfg := config.Default()
	cfg.Policy, cfg.RouteHeader = config.PolicyCacheAware, true
	c.PrefixCache, c.KVEvents = true, true
	for i := 0; i < 2; i++ {
		e := simEngine(t, c)
		es = append(es, e)
		cfg.Workers = append(cfg.Workers, config.Worker{URL: e.URL(), KVEventsEndpoint: e.KVEventsEndpoint()})
	}
	g, gw := startGateway(t, cfg)
	return es, g, gw.URL
}

// routesHome caches a prompt for model on one engine ("home", in an order no fallback's turn
// follows), waits until the index knows it from the events (under adapter lora), and checks that
// the gateway sends the prompt's continuation there.
func routesHome(t *testing.T, g *Gateway, gw string, es []*sim.Engine, model, lora string) {
	t.Helper()
	for p, h := range []int{1, 1, 0, 0, 1, 0} {
		home := es[h]
		prompt := fmt.Sprintf("home %d: %s", p, strings.Repeat("a long shared system prompt for this agent ", 8))
		if resp, body := gwtest.PostTimeout(t, home.URL()+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, model, prompt)); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		keys := kvevents.Keys(pdModel, lora, sim.Tokenize(prompt), 16)
		poll.Until(t, "the condition", func() bool { return g.KVEvents.Index.Match(keys)[home.URL()] == len(keys) })
		resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, model, prompt+" and a question"))
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Worker") != home.URL() {
			t.Fatalf("prompt %d: %d, sent to %s, not to %s that holds its prefix (route %s): %s", p, resp.StatusCode,
				resp.Header.Get("X-Baton-Worker"), home.URL(), resp.Header.Get("X-Baton-Route"), body)
		}
	}
}

// Item 18 (should): one vLLM release answers the Mooncake bootstrap server's /query keyed by
// engine id, and 503 until every worker registered; Baton learned nothing from it until a later
// health probe, and every request recomputed. Both shapes are read, and a 503 is asked again
// soon.
func TestMooncakeEngineIDsFromBothQueryShapes(t *testing.T) {
	t.Parallel()
	for _, dp := range []int{1, 2} {
		p, _, _, gw := vllmPD(t, "MooncakeConnector",
			sim.Config{EngineID: "by-engine", DPSize: dp, MooncakeQueryByEngineID: true, MooncakeRegistering: 600 * time.Millisecond}, sim.Config{},
			func(c *config.Config) { c.Workers[0].KVEngineID = "" },
			func(c *config.Config) { c.HealthCheck.Interval = time.Hour }) // no probe to learn it later
		for i := 0; i < 4; i++ {
			resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"by engine id `+strings.Repeat("q", i)+`","max_tokens":2}`)
			if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "mooncake" || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
				t.Fatalf("dp %d request %d: %d, handoff %q, KV %q: %s", dp, i, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), body)
			}
		}
		if s := p.Stats(); s.HandoffsPinned != 4 {
			t.Errorf("dp %d: %d handoffs pinned, want 4", dp, s.HandoffsPinned)
		}
	}
}

// Item 12 (should): older SGLang hashes each block's tokens alone and names a parent even for a
// prompt's first block, so nothing it announces can be chained from a prompt's start; its
// subscription looked healthy, every precise match was 0, and routing ignored the cache. Such a
// worker is said unindexable (once, in the log and GET /workers) and routed from the
// approximate index.
func TestCacheAwareOlderSGLangHashesFallBack(t *testing.T) {
	t.Parallel()
	es, g, gw := eventsFleet(t, sim.Config{Engine: sim.EngineSGLang, SGLangLegacyHashes: true})
	// What this gateway routed a moment ago counts beside the events for 5 s: shortened, so
	// that the second request of each prompt is routed on what the events (or the approximate
	// index standing in for them) say, not on the first request's routing.
	g.Selector.Policies[config.RoleRegular].(*policy.CacheAware).Speculative = time.Nanosecond
	for i, e := range es {
		w := g.Registry.Snapshot().Workers[i]
		warmUntil(t, e, func() bool {
			v, _ := g.KVEvents.View(w).(*kvfleet.KVEventsView)
			return v != nil && v.Unindexable && !v.Healthy
		})
	}
	for p := 0; p < 6; p++ {
		prompt := fmt.Sprintf("legacy %d: %s", p, strings.Repeat("a long shared system prompt for this tenant ", 8))
		first, body := gwtest.PostTimeout(t, gw+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, pdModel, prompt))
		if first.StatusCode != 200 {
			t.Fatalf("%d %s", first.StatusCode, body)
		}
		again, body := gwtest.PostTimeout(t, gw+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, pdModel, prompt+" and a question"))
		if again.StatusCode != 200 || again.Header.Get("X-Baton-Worker") != first.Header.Get("X-Baton-Worker") ||
			!strings.Contains(again.Header.Get("X-Baton-Route"), "reason=cache_match") {
			t.Fatalf("prompt %d: sent to %s, then to %s (route %s): %s", p, first.Header.Get("X-Baton-Worker"),
				again.Header.Get("X-Baton-Worker"), again.Header.Get("X-Baton-Route"), body)
		}
	}
}

// Item 11 (should): the prefill's DP rank was chosen by turn and load alone, while the index
// knows which rank holds the prompt's prefix; the prefill leg goes to that rank.
func TestPDPrefillRankFollowsTheCachedPrefix(t *testing.T) {
	t.Parallel()
	p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl, DPSize: 2,
		PrefixCache: true, KVEvents: true, KVEventsPerRank: true})
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.PrefillPolicy = config.PolicyCacheAware
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector", DPSize: 2, KVEventsEndpoint: p.KVEventsEndpoint()},
		{URL: d.URL(), Role: config.RoleDecode}}
	g, gw := startGateway(t, cfg)
	waitHealthy(t, []*sim.Engine{p}, g) // every rank's subscription hears its events
	for i, home := range []int{1, 1, 0, 1, 0, 0} {
		prompt := fmt.Sprintf("rank %d: %s", i, strings.Repeat("a long shared system prompt for this rank ", 8))
		req, _ := http.NewRequest(http.MethodPost, p.URL()+"/v1/completions", strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, pdModel, prompt)))
		req.Header.Set("X-Data-Parallel-Rank", fmt.Sprint(home))
		resp, err := http.DefaultClient.Do(req)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("warming rank %d: %v %v", home, err, resp)
		}
		resp.Body.Close()
		keys := kvevents.Keys(pdModel, "", sim.Tokenize(prompt), 16)
		holder := kvevents.Holder{Worker: p.URL(), Rank: home}
		poll.Until(t, "the condition", func() bool { return g.KVEvents.Index.MatchHolders(keys)[holder] == len(keys) })
		before := p.Stats().PrefixCacheHits
		resp2, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, pdModel, prompt+" and a question"))
		if resp2.StatusCode != 200 {
			t.Fatalf("%d %s", resp2.StatusCode, body)
		}
		if hits := p.Stats().PrefixCacheHits - before; hits < int64(16*len(keys)) {
			t.Fatalf("prompt %d: the prefill leg found %d of its tokens cached: it ran on another rank than %d, which holds its prefix", i, hits, home)
		}
	}
}
