package tracing

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/gwtest"
)

// lossCounter records what a Watch is told of lost spans.
type lossCounter struct {
	mu     sync.Mutex
	counts map[string][2]int // cause: exports, spans
}

func (c *lossCounter) lost(cause string, exports, spans int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.counts == nil {
		c.counts = map[string][2]int{}
	}
	v := c.counts[cause]
	c.counts[cause] = [2]int{v[0] + exports, v[1] + spans}
}

func (c *lossCounter) get(cause string) [2]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.counts[cause]
}

// endSpans makes n sampled spans and ends them.
func endSpans(n int) {
	for range n {
		_, s := Start(context.Background(), "work")
		s.End()
	}
}

// A collector that refuses the spans: every failed export is counted with its spans, the state
// says it is failing, the WARN is said once however many exports fail within the minute (and
// again after it), and when exports succeed again an INFO says it recovered. No credential of the
// endpoint is said: only its host.
func TestAFailingCollectorIsSeen(t *testing.T) {
	var refuse atomic.Bool
	refuse.Store(true)
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if refuse.Load() {
			http.Error(w, "no", http.StatusBadRequest) // not retried by the exporter: fails at once
			return
		}
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	defer collector.Close()
	var logs gwtest.SyncBuffer
	now := time.Unix(1_000_000, 0)
	var lc lossCounter
	w := &Watch{Lost: lc.lost, Log: slog.New(slog.NewTextHandler(&logs, nil)), Now: func() time.Time { return now }}
	endpoint := strings.Replace(collector.URL, "http://", "http://user:secret@", 1)
	round := func(spans int) {
		stop, err := Setup(context.Background(), Config{Endpoint: endpoint, Ratio: 1, Watch: w})
		if err != nil {
			t.Fatal(err)
		}
		endSpans(spans)
		_ = stop(context.Background()) // flushes: one export
	}
	round(5)
	round(7)
	st := w.State()
	if got := lc.get(CauseExportFailed); got != [2]int{2, 12} || !st.Failing || st.Failures != 2 || st.SpansLost != 12 || !strings.Contains(st.LastError, "400") {
		t.Fatalf("after two failed exports: told %v, state %+v", got, st)
	}
	if n := strings.Count(logs.String(), "trace export failing"); n != 1 {
		t.Errorf("%d WARN lines for two failures within a minute:\n%s", n, logs.String())
	}
	now = now.Add(61 * time.Second)
	round(1)
	if n := strings.Count(logs.String(), "trace export failing"); n != 2 || !strings.Contains(logs.String(), "failures=2") {
		t.Errorf("a minute later, %d WARN lines (the second counting the failures since the first):\n%s", n, logs.String())
	}
	refuse.Store(false)
	round(1)
	if st := w.State(); st.Failing || !strings.Contains(logs.String(), "trace export recovered") {
		t.Errorf("after an export succeeded: state %+v\n%s", st, logs.String())
	}
	if strings.Contains(logs.String(), "secret") || strings.Contains(w.State().Collector, "user") {
		t.Errorf("the endpoint's credentials were said:\n%s", logs.String())
	}
}

// A collector that never answers while spans keep ending: the spans past the 2,048 waiting for
// their export are dropped, counted as queue_full — never silently by the batch processor.
func TestSpansPastTheQueueAreCounted(t *testing.T) {
	release := make(chan struct{})
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		select {
		case <-release:
		case <-r.Context().Done():
		}
		http.Error(w, "gone", http.StatusBadRequest)
	}))
	defer collector.Close()
	defer close(release)
	var lc lossCounter
	w := &Watch{Lost: lc.lost}
	stop, err := Setup(context.Background(), Config{Endpoint: collector.URL, Ratio: 1, Watch: w})
	if err != nil {
		t.Fatal(err)
	}
	endSpans(3000)
	dropped := lc.get(CauseQueueFull)[1]
	if dropped < 3000-maxQueued || int64(dropped) != w.State().SpansDropped {
		t.Errorf("%d of 3,000 spans dropped past a queue of %d (state %+v)", dropped, maxQueued, w.State())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_ = stop(ctx)
}
