package policy

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

func cacheAware() *CacheAware {
	return &CacheAware{Threshold: 0.3, BalanceAbs: 64, BalanceRel: 1.5, LoadCost: 16, MaxBlocks: 1 << 16, TTL: time.Minute}
}

// system is a shared prompt prefix of many blocks.
var system = strings.Repeat("You are a careful assistant. Answer briefly and cite sources. ", 20)

func TestCacheAwareFollowsThePrefix(t *testing.T) {
	p := cacheAware()
	ws := fleet(4)
	// Four groups of requests, each sharing a long system prompt: after its first request a
	// group stays on the worker that has its prefix, whatever question follows.
	home := map[int]*worker.Worker{}
	for round := 0; round < 5; round++ {
		for g := 0; g < 4; g++ {
			got := p.Pick(context.Background(), ws, chat(fmt.Sprintf("group %d: %s question %d", g, system, round)))
			if round == 0 {
				home[g] = got
				continue
			}
			if got != home[g] {
				t.Fatalf("round %d: group %d went to %s, its prefix is on %s", round, g, got, home[g])
			}
		}
	}
	if p.Size() == 0 {
		t.Fatal("the index is empty after routing")
	}
}

func TestCacheAwareSpreadsAHotPrefixUnderLoad(t *testing.T) {
	p := cacheAware()
	ws := fleet(3)
	first := p.Pick(context.Background(), ws, chat(system+"q0"))
	// The prefix's worker is now busy enough that computing the prompt elsewhere is cheaper
	// (the prompt is ~20 blocks, each request of load costs 16): the next one goes elsewhere.
	busy(t, first, 2)
	second := p.Pick(context.Background(), ws, chat(system+"q1"))
	if second == first {
		t.Fatalf("a loaded worker %s kept the hot prefix", first)
	}
	// Both now hold the prefix; with the first still busy the second keeps it.
	for i := 0; i < 10; i++ {
		if got := p.Pick(context.Background(), ws, chat(fmt.Sprintf("%sq%d", system, i+2))); got != second {
			t.Fatalf("request %d went to %s, want the idle holder %s", i, got, second)
		}
	}
}

func TestCacheAwareFallsBackBelowThreshold(t *testing.T) {
	p := cacheAware()
	ws := fleet(2)
	busy(t, ws[0], 1)
	// Nothing is cached anywhere: below the threshold the least loaded of two is chosen.
	for i := 0; i < 20; i++ {
		if got := p.Pick(context.Background(), ws, chat(fmt.Sprintf("unrelated prompt number %d", i))); got != ws[1] {
			t.Fatalf("with nothing cached, picked the busier %s", got)
		}
	}
}

func TestCacheAwareFallsBackWhenImbalanced(t *testing.T) {
	p := cacheAware()
	p.LoadCost = 0 // cost is the cache alone: only the balance guard moves work
	ws := fleet(2)
	home := p.Pick(context.Background(), ws, chat(system))
	other := ws[0]
	if home == ws[0] {
		other = ws[1]
	}
	busy(t, home, 100) // above 64 and 1.5x the idle one
	for i := 0; i < 20; i++ {
		if got := p.Pick(context.Background(), ws, chat(fmt.Sprintf("%s%d", system, i))); got != other {
			t.Fatalf("an imbalanced fleet sent the prefix to its busy home %s", got)
		}
	}
}

func TestCacheAwareIndexIsBounded(t *testing.T) {
	p := cacheAware()
	p.MaxBlocks = 100
	ws := fleet(3)
	for i := 0; i < 1000; i++ {
		p.Pick(context.Background(), ws, chat(fmt.Sprintf("%d %s", i, system)))
		if n := p.Size(); n > 100 {
			t.Fatalf("index holds %d blocks, bound 100", n)
		}
	}
	if p.Evictions() == 0 {
		t.Fatal("a full index evicted nothing, or did not count it")
	}
	// A prompt longer than the index looks at is cut, not indexed whole.
	huge := strings.Repeat("x", 10*prefixBlock*maxPromptBlocks)
	if n := len(blocksOf("m", []byte(huge))); n != maxPromptBlocks {
		t.Fatalf("a huge prompt made %d blocks, want %d", n, maxPromptBlocks)
	}
}

func TestCacheAwareForgetsAfterTTL(t *testing.T) {
	now := time.Unix(1000, 0)
	p := cacheAware()
	p.TTL, p.Now = time.Minute, func() time.Time { return now }
	ws := fleet(4)
	p.Pick(context.Background(), ws, chat(system))
	keys := blocksOf("m", promptOf(chat(system)))
	total := func() (n int) {
		for _, m := range p.matches(keys, ws, now, p.TTL) {
			n += m
		}
		return n
	}
	now = now.Add(time.Minute - time.Second)
	if got := total(); got != len(keys) {
		t.Fatalf("within the TTL matched %d of %d blocks", got, len(keys))
	}
	now = now.Add(2 * time.Second)
	for i, n := range p.matches(keys, ws, now, p.TTL) {
		if n != 0 {
			t.Fatalf("worker %d still matches %d blocks after the TTL", i, n)
		}
	}
	p.TTL = 0 // no TTL: remembered until evicted
	p.Pick(context.Background(), ws, chat(system))
	now = now.Add(24 * time.Hour)
	if got := total(); got != len(keys) {
		t.Fatalf("without a TTL matched %d of %d blocks", got, len(keys))
	}
}

func BenchmarkCacheAware10kPrefixes(b *testing.B) {
	p := cacheAware()
	p.MaxBlocks = 1 << 20
	ws := fleet(16)
	reqs := make([]*Request, 10000)
	for i := range reqs {
		reqs[i] = chat(fmt.Sprintf("tenant %d %s", i, system))
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for _, r := range reqs {
		p.Pick(context.Background(), ws, r)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	perBlock, blocks := float64(after.HeapAlloc-before.HeapAlloc)/float64(p.Size()), float64(p.Size())
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		p.Pick(context.Background(), ws, reqs[i%len(reqs)])
		i++
	}
	b.ReportMetric(perBlock, "index-B/block")
	b.ReportMetric(blocks, "blocks")
}

func TestCacheAwareSpreadsNewPrefixesOverCaches(t *testing.T) {
	p := cacheAware()
	p.MaxBlocks = 200
	ws := fleet(4)
	// Eight new equal-length prefixes on an idle fleet: two to each worker, not wherever
	// chance puts them (an engine's cache holds only so many).
	count := map[*worker.Worker]int{}
	for g := 0; g < 8; g++ {
		count[p.Pick(context.Background(), ws, chat(fmt.Sprintf("group %d %s", g, system)))]++
	}
	for _, w := range ws {
		if count[w] != 2 {
			t.Fatalf("new prefixes per worker %v, want 2 each", count)
		}
	}
	// The per-worker tally stays consistent with the index through evictions.
	for i := 0; i < 500; i++ {
		p.Pick(context.Background(), ws, chat(fmt.Sprintf("%d %s", i, system)))
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	held := map[*worker.Worker]int{}
	for _, e := range p.index {
		for _, w := range e.workers {
			held[w]++
		}
	}
	if len(held) != len(p.owned) {
		t.Fatalf("tally has %d workers, index %d", len(p.owned), len(held))
	}
	for w, n := range held {
		if p.owned[w] != n {
			t.Fatalf("tally says %d blocks for %s, index holds %d", p.owned[w], w, n)
		}
	}
}

func TestCacheAwareExplains(t *testing.T) {
	p := cacheAware()
	ws := fleet(3)
	_, d := p.explain(context.Background(), ws, chat(system+"first"))
	if d.Reason != ReasonCacheMiss || d.Match != 0 {
		t.Fatalf("first sight: %+v, want cache_miss with match 0", d)
	}
	_, d = p.explain(context.Background(), ws, chat(system+"second"))
	if d.Reason != ReasonCacheMatch || d.Match < 0.9 || d.Match >= 1 {
		t.Fatalf("second: %+v, want cache_match with most of the prompt", d)
	}
	if _, d = p.explain(context.Background(), ws, &Request{Model: "m", Path: "/v1/models"}); d.Reason != ReasonNoPrompt || d.Match != -1 {
		t.Fatalf("no prompt: %+v", d)
	}
	// The same prompt for another model matches nothing: engines cache per model.
	other := chat(system + "second")
	other.Model = "other"
	if _, d = p.explain(context.Background(), ws, other); d.Reason != ReasonCacheMiss || d.Match != 0 {
		t.Fatalf("another model: %+v, want cache_miss", d)
	}
	p.LoadCost = 0
	home := p.Pick(context.Background(), ws, chat(system))
	busy(t, home, 100)
	if _, d = p.explain(context.Background(), ws, chat(system)); d.Reason != ReasonImbalanced {
		t.Fatalf("imbalanced fleet: %+v", d)
	}
}

func TestSelectorRecordsDecisions(t *testing.T) {
	sel, _ := selectorFleet(config.Worker{URL: "http://a", Models: []string{"m"}}, config.Worker{URL: "http://b", Models: []string{"m"}})
	sel.Policies[config.RoleRegular] = cacheAware()
	var seen []Decision
	sel.Observe = func(d Decision) { seen = append(seen, d) }
	req := chat(system)
	req.Explain = true
	w, err := sel.Worker(context.Background(), config.RoleRegular, req, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(req.Decisions) != 1 || len(seen) != 1 || req.Decisions[0] != seen[0] {
		t.Fatalf("decisions %+v, observed %+v", req.Decisions, seen)
	}
	d := req.Decisions[0]
	if d.Role != config.RoleRegular || d.Policy != config.PolicyCacheAware || d.Worker != w.URL || d.Reason != ReasonCacheMiss {
		t.Fatalf("decision %+v", d)
	}
	if got, want := RouteHeader(req.Decisions), "role=regular; policy=cache_aware; reason=cache_miss; load=0; match=0.00"; got != want {
		t.Errorf("header %q, want %q", got, want)
	}
	sel.Policies[config.RoleRegular] = &RoundRobin{}
	req.Decisions = nil
	sel.Worker(context.Background(), config.RoleRegular, req, nil)
	if got, want := RouteHeader(req.Decisions), "role=regular; policy=round_robin; reason=turn; load=0"; got != want {
		t.Errorf("header %q, want %q", got, want)
	}
}

// An engine that queues moves a hot prefix at small concurrency, long before an absolute
// threshold of 64 requests would; a stale report of a queue moves nothing.
func TestCacheAwareReactsToAnEngineThatQueues(t *testing.T) {
	p := cacheAware()
	ws := fleet(2)
	home := p.Pick(context.Background(), ws, chat(system))
	other := ws[0]
	if home == ws[0] {
		other = ws[1]
	}
	now := time.Now()
	home.SetEngineLoad(worker.EngineLoad{Running: 1, Waiting: 1, HasRunning: true, HasWaiting: true, At: now.Add(-time.Hour), Until: now.Add(-time.Minute)})
	if got := p.Pick(context.Background(), ws, chat(system+"stale")); got != home {
		t.Fatalf("a stale queue report moved the prefix to %s", got)
	}
	home.SetEngineLoad(worker.EngineLoad{Running: 1, Waiting: 1, HasRunning: true, HasWaiting: true, At: now, Until: now.Add(time.Minute)})
	if got := p.Pick(context.Background(), ws, chat(system+"queued")); got != other {
		t.Fatalf("an engine with one request queued kept the prefix (load %v)", load(home))
	}
}
