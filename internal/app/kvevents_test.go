package app

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/kvevents"
	"github.com/baton-llm/baton/internal/kvfleet"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// freeAddr returns a loopback address nothing listens on (for engines that must know the
// gateway's address before it starts).
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// warmUntil sends prompts straight to e until cond holds (ZMQ drops what is published before a
// subscriber joins).
func warmUntil(t *testing.T, e *sim.Engine, cond func() bool) {
	t.Helper()
	poll.Until(t, "the condition", func() bool {
		resp, _ := gwtest.PostTimeout(t, e.URL()+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"warm %d %s","max_tokens":1}`, pdModel, time.Now().UnixNano(), strings.Repeat("w ", 40)))
		return resp.StatusCode == 200 && cond()
	})
}

// waitHealthy warms each engine until every gateway's subscription to it is healthy (engine i
// is each gateway's worker i).
func waitHealthy(t *testing.T, es []*sim.Engine, gs ...*Gateway) {
	t.Helper()
	for i, e := range es {
		warmUntil(t, e, func() bool {
			for _, g := range gs {
				if v, _ := g.KVEvents.View(g.Registry.Snapshot().Workers[i]).(*kvfleet.KVEventsView); v == nil || !v.Healthy {
					return false
				}
			}
			return true
		})
	}
}

// homeHits caches n prompts on the engines in turn, behind Baton's back, waits until g's index
// holds each, then sends each (with a question added) through Baton at url, and counts the
// requests whose header names the engine that held the prompt.
func homeHits(t *testing.T, g *Gateway, url string, es []*sim.Engine, n int, header string) int {
	t.Helper()
	right := 0
	for p := 0; p < n; p++ {
		prompt := fmt.Sprintf("tenant %d: %s", p, strings.Repeat("a long shared system prompt for this tenant ", 8))
		home := es[p%len(es)]
		resp, body := gwtest.PostTimeout(t, home.URL()+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, pdModel, prompt))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		keys := kvevents.Keys(pdModel, "", sim.Tokenize(prompt), 16)
		poll.Until(t, "the condition", func() bool { return g.KVEvents.Index.Match(keys)[home.URL()] == len(keys) })
		resp, body = gwtest.PostTimeout(t, url+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":4}`, pdModel, prompt+" and a question"))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		if resp.Header.Get(header) == home.URL() {
			right++
		}
	}
	return right
}

func workersJSON(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url + "/workers")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// --kv-events-listen: engines that connect out to Baton and name themselves by the topic
// kv@<ip>:<port>@<model> feed the index under the worker the topic names; a topic that names
// no worker is counted and dropped; cache_aware routes on what arrives.
func TestKVEventsListen(t *testing.T) {
	t.Parallel()
	addr := "tcp://" + freeAddr(t)
	var es []*sim.Engine
	cfg := config.Default()
	cfg.Policy, cfg.RouteHeader, cfg.KVEventsListen = config.PolicyCacheAware, true, addr
	for i := 0; i < 2; i++ {
		e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, PrefixCache: true, KVEvents: true, KVEventsConnect: addr})
		es = append(es, e)
		cfg.Workers = append(cfg.Workers, config.Worker{URL: e.URL()})
	}
	stranger := simEngine(t, sim.Config{Engine: sim.EngineVLLM, PrefixCache: true, KVEvents: true, KVEventsConnect: addr, KVEventsTopic: "kv@10.9.8.7:8000@m"})
	g, gw := startGateway(t, cfg)
	if g.KVEvents.ListenAddr() != addr {
		t.Fatalf("listening on %q, want %q", g.KVEvents.ListenAddr(), addr)
	}
	waitHealthy(t, es, g)
	warmUntil(t, stranger, func() bool { _, _, unrouted, _ := g.KVEvents.ListenerCounts(); return unrouted > 0 })
	right := homeHits(t, g, gw.URL, es, 6, "X-Baton-Worker")
	if right != 6 {
		t.Errorf("%d of 6 requests went to the engine holding their prefix", right)
	}
	if w := workersJSON(t, gw.URL); strings.Count(w, `"kv_events":{"endpoint":"listen","source":"listen","ranks":1,"healthy":true`) != 2 {
		t.Errorf("GET /workers: %s", w)
	}
	m := scrape(t, g)
	if !strings.Contains(m, `baton_kv_events_listener_total{result="unrouted"}`) || strings.Contains(m, `baton_kv_events_listener_total{result="unrouted"} 0`) {
		t.Errorf("the stranger's messages are not counted unrouted")
	}
	if strings.Contains(m, "10.9.8.7") {
		t.Errorf("a topic naming no worker became a label")
	}
}

// An SGLang engine that reports its KV events publisher in /server_info is subscribed to when it
// registers, with nothing configured: at the worker's host and the reported port, with the
// reported block size, its events decoded in SGLang's field layout.
func TestKVEventsFromSGLangServerInfo(t *testing.T) {
	t.Parallel()
	e := simEngine(t, sim.Config{Engine: sim.EngineSGLang, PrefixCache: true, KVEvents: true})
	cfg := config.Default()
	cfg.Workers = []config.Worker{{URL: e.URL()}}
	g, gw := startGateway(t, cfg)
	w := g.Registry.Snapshot().Workers[0]
	v, _ := g.KVEvents.View(w).(*kvfleet.KVEventsView)
	if v == nil || v.Source != "server_info" || v.Endpoint != e.KVEventsEndpoint() {
		t.Fatalf("subscription %+v, want %s from server_info", v, e.KVEventsEndpoint())
	}
	if bs := g.KVEvents.BlockSize(w.URL); bs != 16 {
		t.Errorf("block size %d before any event, want the reported 16", bs)
	}
	warmUntil(t, e, func() bool { v, _ := g.KVEvents.View(w).(*kvfleet.KVEventsView); return v.Healthy })
	prompt := strings.Repeat("sglang publishes blocks too ", 12)
	resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, pdModel, prompt))
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	keys := kvevents.Keys(pdModel, "", sim.Tokenize(prompt), 16)
	poll.Until(t, "the condition", func() bool { return len(keys) > 0 && g.KVEvents.Index.Match(keys)[e.URL()] == len(keys) })
	if v, _ := g.KVEvents.View(w).(*kvfleet.KVEventsView); v.Malformed != 0 || v.Ignored != 0 {
		t.Errorf("SGLang's events: %+v", v)
	}
}

// PD: the prefill choice follows the prefill engines' events. Prompts cached on one prefill
// engine behind Baton's back send their PD requests' prefill legs there.
func TestPDPrefillChoiceFromEvents(t *testing.T) {
	t.Parallel()
	var ps []*sim.Engine
	cfg := config.Default()
	cfg.PDDisaggregation, cfg.Policy = true, config.PolicyCacheAware
	for i := 0; i < 2; i++ {
		p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl, PrefixCache: true, KVEvents: true})
		ps = append(ps, p)
		cfg.Workers = append(cfg.Workers, config.Worker{URL: p.URL(), Role: config.RolePrefill, KVEventsEndpoint: p.KVEventsEndpoint()})
	}
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	cfg.Workers = append(cfg.Workers, config.Worker{URL: d.URL(), Role: config.RoleDecode})
	g, gw := startGateway(t, cfg)
	waitHealthy(t, ps, g)
	right := homeHits(t, g, gw.URL, ps, 6, "X-Baton-Prefill-Worker")
	if right != 6 {
		t.Errorf("%d of 6 PD requests had their prefill on the engine holding their prefix", right)
	}
}
