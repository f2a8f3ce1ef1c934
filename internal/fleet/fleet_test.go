package fleet

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/kvfleet"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// fixture is a fleet over an empty registry, registering workers against real simulated
// engines; closed records the URLs whose idle connections were closed.
type fixture struct {
	f      *Fleet
	reg    *worker.Registry
	mu     sync.Mutex
	closed []string
}

func newFixture(t *testing.T, drain time.Duration) *fixture {
	t.Helper()
	cfg := config.Default()
	reg := worker.NewRegistry()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	m := metrics.New(reg)
	x := &fixture{reg: reg}
	x.f = New(cfg, reg, nil, kvfleet.New(cfg, nil, reg, log), m, log, drain)
	x.f.Registrar = &worker.Registrar{Registry: reg, Client: http.DefaultClient, Log: log, MaxInterval: 100 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	x.f.Registrar.Start(ctx)
	x.f.CloseIdle = func(url string) { x.mu.Lock(); x.closed = append(x.closed, url); x.mu.Unlock() }
	t.Cleanup(func() { cancel(); x.f.Registrar.Wait(); x.f.Wait() })
	return x
}

func engine(t *testing.T) string {
	t.Helper()
	e, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e.URL()
}

func (x *fixture) urls() map[string]bool {
	out := map[string]bool{}
	for _, w := range x.reg.Snapshot().Workers {
		out[w.URL] = true
	}
	return out
}

// Each source owns its workers: a configuration reload adds, updates and drains its own, never
// the admin API's; a URL another source has is left to it.
func TestSourcesOwnTheirWorkers(t *testing.T) {
	x := newFixture(t, time.Second)
	a, b, c := engine(t), engine(t), engine(t)
	if err := x.f.Sync([]config.Worker{{URL: a}, {URL: b + "/"}}, SourceConfig); err != nil {
		t.Fatal(err)
	}
	if _, err := x.f.Add(config.Worker{URL: c}, SourceAdmin); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the workers registered", func() bool {
		for _, w := range x.reg.Snapshot().Workers {
			if !w.Registered() {
				return false
			}
		}
		return len(x.reg.Snapshot().Workers) == 3
	})
	if x.f.SourceOf(a) != SourceConfig || x.f.SourceOf(b) != SourceConfig || x.f.SourceOf(c) != SourceAdmin {
		t.Fatalf("sources %q %q %q", x.f.SourceOf(a), x.f.SourceOf(b), x.f.SourceOf(c))
	}
	// The file now lists a (with a label), and c — which the admin API owns.
	if err := x.f.Sync([]config.Worker{{URL: a, Labels: map[string]string{"zone": "x"}}, {URL: c}}, SourceConfig); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "b drained and left", func() bool { return !x.urls()[b] })
	got := x.reg.Snapshot().Get(a)
	if got == nil || got.Configured().Labels["zone"] != "x" || !got.Registered() {
		t.Fatalf("a was not updated in place with what registration learned: %+v", got)
	}
	if !x.urls()[c] || x.f.SourceOf(c) != SourceAdmin {
		t.Error("the configuration took or removed the admin API's worker")
	}
	if x.f.SourceOf(b) != "" {
		t.Errorf("b left but its source is still %q", x.f.SourceOf(b))
	}
	for op, n := range map[string]float64{"add": 2, "update": 1, "remove": 1} {
		if got := testutil.ToFloat64(x.f.changes.WithLabelValues(op, SourceConfig)); got != n {
			t.Errorf("baton_fleet_changes_total{op=%q,source=config} = %v, want %v", op, got, n)
		}
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if len(x.closed) != 1 || x.closed[0] != b {
		t.Errorf("idle connections closed for %v, want [%s]", x.closed, b)
	}
}

// A removal drains: the worker takes no new request but stays until the ones on it finish —
// or, past the drain timeout, leaves with them still on it. An update keeps what the old worker
// learned (its engine info, readiness and cordon) and its requests finish on it.
func TestRemovalsDrainAndUpdatesCarryOver(t *testing.T) {
	x := newFixture(t, 300*time.Millisecond)
	a, b := engine(t), engine(t)
	wa, err := x.f.Add(config.Worker{URL: a}, SourceAdmin)
	if err != nil {
		t.Fatal(err)
	}
	wb, err := x.f.Add(config.Worker{URL: b}, SourceAdmin)
	if err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "registered", func() bool { return wa.Registered() && wb.Registered() })

	probe := wa.Enter() // a request in flight on a
	if _, err := x.f.Remove(wa.ID, SourceAdmin); err != nil {
		t.Fatal(err)
	}
	if !wa.Draining() || x.reg.Snapshot().Get(a) == nil {
		t.Fatal("a removal did not drain, or removed the worker with a request on it")
	}
	if _, err := x.f.Remove(wa.ID, SourceAdmin); !errors.Is(err, ErrWorkerNotFound) {
		t.Errorf("a second removal of a draining worker: %v", err)
	}
	time.Sleep(50 * time.Millisecond)
	if x.reg.Snapshot().Get(a) == nil {
		t.Fatal("left before its request finished")
	}
	wa.Leave(probe)
	poll.Until(t, "a left once its request finished", func() bool { return x.reg.Snapshot().Get(a) == nil })

	wb.SetCordoned(true)
	held := wb.Enter() // never leaves: the drain timeout ends the wait
	label := map[string]string{"pool": "blue"}
	next, err := x.f.Update(wb.ID, config.WorkerPatch{Labels: label}, SourceAdmin)
	if err != nil {
		t.Fatal(err)
	}
	if next == wb || !next.Registered() || !next.Cordoned() || next.Ready() != wb.Ready() || next.Configured().Labels["pool"] != "blue" {
		t.Fatalf("the update lost what the worker learned: registered %v cordoned %v", next.Registered(), next.Cordoned())
	}
	if _, err := x.f.Remove(next.ID, SourceAdmin); err != nil {
		t.Fatal(err)
	}
	next.Enter()
	poll.Until(t, "removed at the drain timeout with a request still on it", func() bool { return x.reg.Snapshot().Get(b) == nil })
	wb.Leave(held)
}

// The admin API's errors: a worker that exists, one that does not, settings that are invalid.
func TestFleetChangeErrors(t *testing.T) {
	x := newFixture(t, time.Second)
	a := engine(t)
	if _, err := x.f.Add(config.Worker{URL: a}, SourceAdmin); err != nil {
		t.Fatal(err)
	}
	if _, err := x.f.Add(config.Worker{URL: a}, SourceAdmin); !errors.Is(err, ErrWorkerExists) {
		t.Errorf("a second add: %v", err)
	}
	if _, err := x.f.Add(config.Worker{URL: "ftp://nowhere"}, SourceAdmin); !errors.Is(err, ErrWorkerInvalid) {
		t.Errorf("an invalid worker: %v", err)
	}
	if _, err := x.f.Update("no-such-id", config.WorkerPatch{}, SourceAdmin); !errors.Is(err, ErrWorkerNotFound) {
		t.Errorf("an update of nothing: %v", err)
	}
	if _, err := x.f.Remove("no-such-id", SourceAdmin); !errors.Is(err, ErrWorkerNotFound) {
		t.Errorf("a removal of nothing: %v", err)
	}
	if x.f.Cordon("http://nowhere:1", true) {
		t.Error("cordoned a worker that does not exist")
	}
	if !x.f.Cordon(a+"/", true) || !x.reg.Snapshot().Get(a).Cordoned() {
		t.Error("a worker was not cordoned by its URL")
	}
}
