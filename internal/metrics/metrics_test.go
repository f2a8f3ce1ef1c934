package metrics

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/baton-llm/baton/internal/config"
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
				m.ObserveTTFT("m"+strconv.Itoa(i), "regular", 0.01)
				m.AddTokens("m"+strconv.Itoa(i), 3, 2, i%2)
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
	if n := testutil.CollectAndCount(m.TTFT); n != maxChildren+100 {
		t.Fatalf("%d TTFT series, want %d", n, maxChildren+100)
	}
	// a model whose generations cached nothing has no cached series: 2 series for half the
	// models, 3 for the others
	if n, want := testutil.CollectAndCount(m.Tokens), (maxChildren+100)*5/2; n != want {
		t.Fatalf("%d token series, want %d", n, want)
	}
	for _, i := range []int{0, 1, maxChildren - 1, maxChildren + 99} {
		model := "m" + strconv.Itoa(i)
		var d dto.Metric
		if err := m.TTFT.WithLabelValues(model, "regular").(prometheus.Metric).Write(&d); err != nil || d.GetHistogram().GetSampleCount() != 4 {
			t.Fatalf("TTFT for %s observed %d times (%v), want 4", model, d.GetHistogram().GetSampleCount(), err)
		}
		for kind, want := range map[string]float64{"prompt": 12, "completion": 8, "cached": float64(4 * (i % 2))} {
			if got := testutil.ToFloat64(m.Tokens.WithLabelValues(model, kind)); got != want {
				t.Fatalf("%s %s tokens counted %v, want %v", model, kind, got, want)
			}
		}
	}
	if n := m.ttfts.Len() + m.tokens.Len(); n > 2*maxChildren {
		t.Fatalf("%d series remembered, bound %d", n, 2*maxChildren)
	}
	if got := testutil.ToFloat64(m.RouteDecisions.WithLabelValues("regular", "round_robin", "turn")); got != 40 {
		t.Fatalf("route decisions counted %v, want 40", got)
	}
	if n := m.requests.Len(); n > maxChildren {
		t.Fatalf("%d series remembered, bound %d", n, maxChildren)
	}
}

// baton_worker_health_failures_total counts a worker's failed health probes by cause, every
// cause of the fixed set a series (none grows the label's values).
func TestHealthFailuresCountedByCause(t *testing.T) {
	engine := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) { rw.WriteHeader(http.StatusServiceUnavailable) }))
	defer engine.Close()
	w := worker.New(config.Worker{URL: engine.URL})
	w.SetInfo(&worker.Info{Runtime: "generic"})
	w.SetReady(true)
	reg := worker.NewRegistry(w)
	m := New(reg)
	h := &worker.HealthChecker{Registry: reg, Client: engine.Client(), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Interval: time.Hour, Timeout: time.Second, FailureThreshold: 3, SuccessThreshold: 1, Endpoint: "/health"}
	h.CheckAll(context.Background())
	h.CheckAll(context.Background())
	want := "# HELP baton_worker_health_failures_total Failed health probes of a worker by cause: status_4xx, status_5xx, status_other (the engine answered outside 2xx), timeout, refused, reset, dns, tls, error (no answer).\n# TYPE baton_worker_health_failures_total counter\n"
	for _, cause := range worker.HealthCauses {
		n := 0
		if cause == worker.HealthStatus5xx {
			n = 2
		}
		want += fmt.Sprintf("baton_worker_health_failures_total{cause=%q,worker=%q} %d\n", cause, engine.URL, n)
	}
	if err := testutil.GatherAndCompare(m.Registry, strings.NewReader(want), "baton_worker_health_failures_total"); err != nil {
		t.Error(err)
	}
}
