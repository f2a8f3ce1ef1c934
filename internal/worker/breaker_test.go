package worker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func TestBreakerTransitions(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	var transitions []string
	cfg := &BreakerConfig{FailureThreshold: 3, SuccessThreshold: 2, Timeout: time.Minute, Now: c.now,
		OnTransition: func(_ *Worker, from, to BreakerState) {
			transitions = append(transitions, []string{"closed", "open", "half"}[int(from)]+">"+[]string{"closed", "open", "half"}[int(to)])
		}}
	w := New(config.Worker{URL: "http://w"})
	w.UseBreaker(cfg)
	w.SetReady(true)
	fail := func() { w.Record(503, nil) }
	fail()
	fail()
	w.Record(200, nil) // a success resets the count
	fail()
	fail()
	w.Record(429, nil) // busy, not broken: no sample
	w.Record(0, context.Canceled)
	if !w.Available() {
		t.Fatal("open after 2 consecutive failures (429 and cancellations are no samples)")
	}
	fail()
	if w.Available() || w.BreakerState() != BreakerOpen {
		t.Fatalf("state %d after 3 consecutive failures, want open", w.BreakerState())
	}
	c.t = c.t.Add(59 * time.Second)
	if w.Available() {
		t.Fatal("half-open before the timeout")
	}
	c.t = c.t.Add(time.Second)
	// Half-open admits SuccessThreshold probes at once (selection asks first, then enters).
	if !w.Available() {
		t.Fatal("not half-open after the timeout")
	}
	r1 := w.Enter()
	if !w.Available() {
		t.Fatal("half-open refused the second probe")
	}
	r2 := w.Enter()
	if w.Available() {
		t.Fatal("half-open admitted a third probe")
	}
	w.Leave(r1)
	w.Leave(r2)
	w.Record(200, nil)
	w.Record(200, nil)
	if w.BreakerState() != BreakerClosed {
		t.Fatalf("state %d after 2 probe successes, want closed", w.BreakerState())
	}
	// A failure in half-open opens again.
	for i := 0; i < 3; i++ {
		fail()
	}
	c.t = c.t.Add(time.Minute)
	w.Available()
	fail()
	if w.BreakerState() != BreakerOpen {
		t.Fatalf("state %d after a half-open failure, want open", w.BreakerState())
	}
	want := []string{"closed>open", "open>half", "half>closed", "closed>open", "open>half", "half>open"}
	if len(transitions) != len(want) {
		t.Fatalf("transitions %v, want %v", transitions, want)
	}
	for i := range want {
		if transitions[i] != want[i] {
			t.Fatalf("transitions %v, want %v", transitions, want)
		}
	}
}

func TestBreakerDisabled(t *testing.T) {
	w := New(config.Worker{URL: "http://w"})
	w.UseBreaker(&BreakerConfig{FailureThreshold: 1, SuccessThreshold: 1, Timeout: time.Hour, Disabled: true})
	w.SetReady(true)
	for i := 0; i < 5; i++ {
		w.Record(0, errors.New("refused"))
	}
	if !w.Available() {
		t.Fatal("disabled breaker opened")
	}
}

func TestHealthChecker(t *testing.T) {
	var healthy atomic.Bool
	healthy.Store(true)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health" || !healthy.Load() {
			w.WriteHeader(503)
		}
	}))
	defer srv.Close()
	w := New(config.Worker{URL: srv.URL})
	w.SetInfo(&Info{Runtime: "generic"})
	w.SetReady(true)
	var probes, backs atomic.Int32
	h := &HealthChecker{Registry: NewRegistry(w), Client: srv.Client(), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Interval: time.Hour, Timeout: time.Second, FailureThreshold: 2, SuccessThreshold: 2, Endpoint: "/health",
		OnProbe: func(*Worker, bool) { probes.Add(1) },
		OnBack: func(b *Worker) {
			if b != w || b.Ready() {
				t.Errorf("OnBack for %s, ready %v (before it is back in rotation)", b.URL, b.Ready())
			}
			backs.Add(1)
		}}
	ctx := context.Background()
	healthy.Store(false)
	h.CheckAll(ctx)
	if !w.Ready() {
		t.Fatal("out of rotation after one failed probe (threshold 2)")
	}
	h.CheckAll(ctx)
	if w.Ready() {
		t.Fatal("still in rotation after two failed probes")
	}
	healthy.Store(true)
	h.CheckAll(ctx)
	if w.Ready() {
		t.Fatal("back after one good probe (threshold 2)")
	}
	h.CheckAll(ctx)
	if !w.Ready() || probes.Load() != 4 || backs.Load() != 1 {
		t.Fatalf("ready %v after two good probes; %d probes, back %d times", w.Ready(), probes.Load(), backs.Load())
	}
	h.CheckAll(ctx)
	if backs.Load() != 1 {
		t.Errorf("back %d times while it never left", backs.Load())
	}
}

func TestPairHealth(t *testing.T) {
	c := &clock{t: time.Unix(0, 0)}
	p, d1, d2 := New(config.Worker{URL: "http://p"}), New(config.Worker{URL: "http://d1"}), New(config.Worker{URL: "http://d2"})
	ph := &PairHealth{Threshold: 2, Quarantine: 30 * time.Second, Now: c.now}
	ph.Record(p, d1, false)
	ph.Record(p, d1, true)
	ph.Record(p, d1, false)
	if ph.Quarantined(p, d1) {
		t.Fatal("quarantined without 2 consecutive failures")
	}
	ph.Record(p, d1, false)
	if !ph.Quarantined(p, d1) || ph.Quarantined(p, d2) {
		t.Fatal("pair (p,d1) not quarantined alone")
	}
	c.t = c.t.Add(30 * time.Second)
	if ph.Quarantined(p, d1) {
		t.Fatal("quarantine did not end")
	}
	var nilPH *PairHealth
	nilPH.Record(p, d1, false)
	if nilPH.Quarantined(p, d1) {
		t.Fatal("nil PairHealth quarantines")
	}
}

func TestBreakerStateString(t *testing.T) {
	for s, want := range map[BreakerState]string{BreakerClosed: "closed", BreakerOpen: "open", BreakerHalfOpen: "half_open"} {
		if s.String() != want {
			t.Errorf("%d.String() = %q, want %q", int(s), s.String(), want)
		}
	}
}

// A worker that leaves takes its pairs' records with it.
func TestPairHealthForget(t *testing.T) {
	p := &PairHealth{Threshold: 5, Quarantine: time.Minute}
	a, b, c := New(config.Worker{URL: "http://a"}), New(config.Worker{URL: "http://b"}), New(config.Worker{URL: "http://c"})
	p.Record(a, b, false)
	p.Record(a, c, false)
	p.Record(c, b, false)
	p.Forget(b)
	if p.Len() != 1 {
		t.Fatalf("%d pairs after forgetting b, want 1 (a, c)", p.Len())
	}
}

// The rank holding a prompt's prefix takes its leg unless it already carries rankSlack more legs
// than the least loaded rank.
func TestRankFor(t *testing.T) {
	w := New(config.Worker{URL: "http://w", DPSize: 4})
	if r, ok := w.RankFor(2, 4); !ok || r != 2 {
		t.Fatalf("RankFor(2) = %d, %v", r, ok)
	}
	for i := 0; i < rankSlack+1; i++ {
		w.EnterRank(2)
	}
	if r, _ := w.RankFor(2, 4); r == 2 {
		t.Error("an overloaded rank still took the leg")
	}
	if r, ok := w.RankFor(-1, 4); !ok || r == 2 {
		t.Errorf("no preference: rank %d", r)
	}
	if _, ok := w.RankFor(0, 1); ok {
		t.Error("a worker without DP ranks got one")
	}
}

// A failed health check says what the probe got: the cause (a status class, a timeout, a refused
// or reset connection), the status and the start of the engine's answer, in the worker's last
// failure, its count by cause, and the log line that takes it out of rotation.
func TestHealthCheckSaysWhatTheProbeGot(t *testing.T) {
	overloaded := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		rw.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(rw, "engine overloaded\n")
	}))
	defer overloaded.Close()
	forbidden := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) { rw.WriteHeader(http.StatusForbidden) }))
	defer forbidden.Close()
	silent := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	defer silent.Close()
	reset := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		conn, _, err := rw.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close() // closed before any answer
		}
	}))
	defer reset.Close()
	closed := httptest.NewServer(http.NotFoundHandler())
	closed.Close() // nothing listens there now: refused
	for _, c := range []struct {
		url, cause, detail string
		status             int
	}{
		{overloaded.URL, HealthStatus5xx, "engine overloaded", 503},
		{forbidden.URL, HealthStatus4xx, "", 403},
		{silent.URL, HealthTimeout, "", 0},
		{reset.URL, HealthReset, "", 0},
		{closed.URL, HealthRefused, "", 0},
	} {
		t.Run(c.cause, func(t *testing.T) {
			w := New(config.Worker{URL: c.url})
			w.SetInfo(&Info{Runtime: "generic"})
			w.SetReady(true)
			var log strings.Builder
			var mu sync.Mutex
			h := &HealthChecker{Registry: NewRegistry(w), Client: &http.Client{}, Log: slog.New(slog.NewTextHandler(lockedWriter{&mu, &log}, nil)),
				Interval: time.Hour, Timeout: 100 * time.Millisecond, FailureThreshold: 2, SuccessThreshold: 1, Endpoint: "/health"}
			h.CheckAll(context.Background())
			h.CheckAll(context.Background())
			if w.Ready() {
				t.Fatal("ready after two failed probes")
			}
			failing, last := w.HealthCheck()
			if failing != 2 || last == nil || last.Cause != c.cause || last.Status != c.status || last.Detail != c.detail && c.detail != "" || last.At.IsZero() {
				t.Errorf("got %d failing, last %+v; want 2, cause %s, status %d, detail %q", failing, last, c.cause, c.status, c.detail)
			}
			counts := w.HealthFailures()
			for i, cause := range HealthCauses {
				if want := map[bool]int64{true: 2}[cause == c.cause]; counts[i] != want {
					t.Errorf("failures of cause %s: got %d, want %d", cause, counts[i], want)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if line := log.String(); !strings.Contains(line, "out of rotation") || !strings.Contains(line, "cause="+c.cause) ||
				c.status != 0 && !strings.Contains(line, fmt.Sprintf("status=%d", c.status)) {
				t.Errorf("the log line says nothing of what the probe got: %s", line)
			}
		})
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}
