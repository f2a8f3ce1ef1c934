package metrics

import (
	"net/http/httptest"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/worker"
)

// TestLiveHeapIsWhatTheLastCollectionKept: go_gc_heap_live_bytes is served, and garbage made
// after a collection raises the heap in use (go_memstats_heap_alloc_bytes) but not the live heap,
// which is what the memory benchmark reads as held.
func TestLiveHeapIsWhatTheLastCollectionKept(t *testing.T) {
	m := New(worker.NewRegistry())
	defer debug.SetGCPercent(debug.SetGCPercent(-1)) // no collection but the test's own
	runtime.GC()
	before := scrape(t, m)
	if before["go_gc_heap_live_bytes"] <= 0 {
		t.Fatalf("go_gc_heap_live_bytes = %v, want the live heap", before["go_gc_heap_live_bytes"])
	}
	var sink [][]byte
	for range 4096 {
		sink = append(sink, make([]byte, 1024)) // 4 MiB, garbage once sink is dropped
	}
	runtime.KeepAlive(sink)
	sink = nil
	after := scrape(t, m)
	if grown := after["go_memstats_heap_alloc_bytes"] - before["go_memstats_heap_alloc_bytes"]; grown < 4<<20 {
		t.Fatalf("heap in use grew %v bytes after 4 MiB of garbage; the test made no garbage", grown)
	}
	if after["go_gc_heap_live_bytes"] != before["go_gc_heap_live_bytes"] {
		t.Fatalf("live heap moved from %v to %v without a collection: it counts garbage", before["go_gc_heap_live_bytes"], after["go_gc_heap_live_bytes"])
	}
	runtime.GC()
	if collected := scrape(t, m)["go_gc_heap_live_bytes"]; collected > before["go_gc_heap_live_bytes"]+1<<20 {
		t.Fatalf("live heap %v after collecting the garbage, %v before it", collected, before["go_gc_heap_live_bytes"])
	}
}

// scrape reads m's unlabelled samples.
func scrape(t *testing.T, m *Metrics) map[string]float64 {
	t.Helper()
	rr := httptest.NewRecorder()
	m.Handler().ServeHTTP(rr, httptest.NewRequest("GET", "/metrics", nil))
	out := map[string]float64{}
	for line := range strings.SplitSeq(rr.Body.String(), "\n") {
		name, v, ok := strings.Cut(line, " ")
		if !ok || strings.HasPrefix(line, "#") || strings.Contains(name, "{") {
			continue
		}
		f, err := strconv.ParseFloat(v, 64)
		if err == nil {
			out[name] = f
		}
	}
	return out
}

// TestRememberedSeriesCountInTheScrape: requests observed through the remembered children show
// in the scrape under their labels, from goroutines racing on new series, and series past the
// bound still count.
func TestRememberedSeriesCountInTheScrape(t *testing.T) {
	m := New(worker.NewRegistry())
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range maxChildren + 100 {
				m.ObserveRequest("POST /v1/completions", "m"+strconv.Itoa(i), 200+g, 0.01)
			}
			for range 10 {
				m.ObserveRoute(policy.Decision{Role: "regular", Policy: "round_robin", Reason: "turn", Match: -1})
			}
		})
	}
	wg.Wait()
	for _, i := range []int{0, maxChildren - 1, maxChildren + 99} {
		for g := range 4 {
			if got := testutil.ToFloat64(m.Requests.WithLabelValues("POST /v1/completions", "m"+strconv.Itoa(i), strconv.Itoa(200+g))); got != 1 {
				t.Fatalf("series m%d status %d counted %v, want 1", i, 200+g, got)
			}
		}
	}
	if n := testutil.CollectAndCount(m.Duration); n != maxChildren+100 {
		t.Fatalf("%d duration series, want %d", n, maxChildren+100)
	}
	if got := testutil.ToFloat64(m.RouteDecisions.WithLabelValues("regular", "round_robin", "turn")); got != 40 {
		t.Fatalf("route decisions counted %v, want 40", got)
	}
	if n := m.requests.Len(); n > maxChildren {
		t.Fatalf("%d series remembered, bound %d", n, maxChildren)
	}
}
