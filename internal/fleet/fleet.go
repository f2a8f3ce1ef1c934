// Package fleet changes the set of workers while Baton runs — from the configuration file, the
// admin API and Kubernetes discovery — each source owning its own workers.
package fleet

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/discovery"
	"github.com/baton-llm/baton/internal/kvfleet"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/worker"
)

// Where a worker came from: a fleet change from one source never touches another's workers
// (a config reload does not remove what the admin API added, nor discovery what the file lists).
const (
	SourceConfig     = "config"
	SourceAdmin      = "admin"
	SourceKubernetes = discovery.SourceKubernetes
)

// Errors of fleet changes, for the admin API's statuses.
var (
	ErrWorkerExists   = worker.ErrExists
	ErrWorkerNotFound = worker.ErrNotFound
	ErrWorkerInvalid  = config.ErrInvalidWorker
)

// Fleet changes the set of workers while Baton runs: additions register in the background as at
// startup; updates replace the worker (requests already on it finish there); removals drain —
// no new requests, the ones in flight (streams included) finish — then leave. Every change is
// logged and counted in baton_fleet_changes_total{op,source}.
type Fleet struct {
	cfg     config.Config
	reg     *worker.Registry
	breaker *worker.BreakerConfig
	// Pairs forgets the pairs of a worker that left; Registrar registers added workers.
	Pairs     *worker.PairHealth
	Registrar *worker.Registrar
	kv        *kvfleet.KVEvents
	metrics   *metrics.Metrics
	log       *slog.Logger
	// OnRegistered is what registration runs for a worker before it is ready (engine ids, KV
	// event subscription); an updated worker that was registered runs it again.
	OnRegistered func(*worker.Worker)
	// drainTimeout bounds a removal's wait for requests in flight.
	drainTimeout time.Duration
	// CloseIdle closes the idle upstream connections to a worker that left (nil: none kept):
	// a pod that leaves must not strand descriptors.
	CloseIdle func(url string)

	mu      sync.Mutex // serialises changes
	smu     sync.Mutex // guards sources (read by GET /workers while a change is in progress)
	sources map[string]string
	drains  sync.WaitGroup
	changes *prometheus.CounterVec
}

// New is the fleet over reg; Registrar, OnRegistered, Pairs and CloseIdle are set once the
// gateway built them.
func New(cfg config.Config, reg *worker.Registry, breaker *worker.BreakerConfig, kv *kvfleet.KVEvents, m *metrics.Metrics, log *slog.Logger, drain time.Duration) *Fleet {
	f := &Fleet{cfg: cfg, reg: reg, breaker: breaker, kv: kv, metrics: m, log: log, drainTimeout: drain, sources: map[string]string{},
		changes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_fleet_changes_total",
			Help: "Workers added, updated and removed while Baton runs, by source (config, admin, kubernetes)."}, []string{"op", "source"})}
	for _, w := range reg.Snapshot().Workers {
		f.sources[w.URL] = SourceConfig
	}
	m.Registry.MustRegister(f.changes)
	return f
}

// Add adds a worker with settings c from source and starts its registration.
func (f *Fleet) Add(c config.Worker, source string) (*worker.Worker, error) {
	c = f.cfg.WithEngineKey(c)
	if err := f.cfg.CheckWorker(c); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrWorkerInvalid, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	w := worker.New(c)
	w.UseBreaker(f.breaker)
	if err := f.reg.Add(w); err != nil {
		return nil, err
	}
	f.setSource(w.URL, source)
	f.kv.Configured(w)
	f.Registrar.Register(w)
	f.changed("add", source, w)
	return w, nil
}

// Update changes the worker id's settings by p.
func (f *Fleet) Update(id string, p config.WorkerPatch, source string) (*worker.Worker, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	old := f.reg.Snapshot().Get(id)
	if old == nil || old.Draining() {
		return nil, ErrWorkerNotFound
	}
	return f.replace(old, p.Apply(old.Configured()), source)
}

// replace puts a worker made from c in old's place: what registration learned carries over (an
// engine id the connector change needs is learned again), requests already on old finish there.
// Called with f.mu held.
func (f *Fleet) replace(old *worker.Worker, c config.Worker, source string) (*worker.Worker, error) {
	if err := f.cfg.CheckWorker(c); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrWorkerInvalid, err)
	}
	next := worker.New(c)
	next.UseBreaker(f.breaker)
	if in := old.Info(); in != nil {
		next.SetInfo(in)
		if f.OnRegistered != nil {
			f.OnRegistered(next)
		}
		next.SetReady(old.Ready())
	}
	next.SetCordoned(old.Cordoned())
	if !f.reg.Replace(old, next) {
		return nil, ErrWorkerNotFound
	}
	f.Pairs.Forget(old)
	f.setSource(next.URL, source)
	if next.KVEventsEndpoint != old.KVEventsEndpoint || next.KVEventsReplayEndpoint != old.KVEventsReplayEndpoint || next.DPSize != old.DPSize {
		f.kv.Remove(old)
		f.kv.Configured(next)
		if next.Registered() {
			f.kv.Registered(next) // an engine-reported or default endpoint, when none is configured
		}
	}
	if !next.Registered() {
		f.Registrar.Register(next)
	}
	f.changed("update", source, next)
	return next, nil
}

// Remove drains the worker id in the background and removes it once its requests finished (or
// the drain timeout passed).
func (f *Fleet) Remove(id, source string) (*worker.Worker, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	w := f.reg.Snapshot().Get(id)
	if w == nil || w.Draining() {
		return nil, ErrWorkerNotFound
	}
	f.drain(w, source)
	return w, nil
}

// drain starts w's removal. Called with f.mu held.
func (f *Fleet) drain(w *worker.Worker, source string) {
	w.SetDraining()
	f.log.Info("fleet: draining worker", "worker", w.URL, "id", w.ID, "in_flight", w.InFlight(), "source", source)
	f.drains.Go(func() {
		deadline := time.Now().Add(f.drainTimeout)
		for w.InFlight() > 0 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if n := w.InFlight(); n > 0 {
			f.log.Warn("fleet: drain timed out; removing the worker with requests still on it", "worker", w.URL, "in_flight", n)
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		f.reg.Remove(w)
		f.Pairs.Forget(w)
		if cur := f.reg.Snapshot().Get(w.URL); cur == nil {
			f.setSource(w.URL, "")
			f.kv.Remove(w)
			f.metrics.ForgetWorker(w.URL)
			if f.CloseIdle != nil {
				f.CloseIdle(w.URL)
			}
		}
		f.changed("remove", source, w)
	})
}

// Cordon holds the worker at url out of rotation (its pod is not ready) or lets it back; false
// when there is no such worker.
func (f *Fleet) Cordon(url string, on bool) bool {
	w := f.reg.Snapshot().Get(strings.TrimRight(url, "/"))
	if w == nil || w.Draining() {
		return false
	}
	if w.Cordoned() != on {
		w.SetCordoned(on)
		f.log.Info("fleet: worker cordoned", "worker", w.URL, "cordoned", on)
	}
	return true
}

// SourceOf names where the worker at url came from ("" when unknown).
func (f *Fleet) SourceOf(url string) string {
	f.smu.Lock()
	defer f.smu.Unlock()
	return f.sources[url]
}

func (f *Fleet) setSource(url, source string) {
	f.smu.Lock()
	defer f.smu.Unlock()
	if source == "" {
		delete(f.sources, url)
	} else {
		f.sources[url] = source
	}
}

// Wait waits for removals in progress.
func (f *Fleet) Wait() { f.drains.Wait() }

// Sync makes source's workers those of want: it adds the new URLs, updates the ones whose
// settings changed and drains the ones no longer listed. Workers from other sources are left
// alone; a URL another source already has is skipped (logged).
func (f *Fleet) Sync(want []config.Worker, source string) error {
	var errs []error
	wanted := map[string]config.Worker{}
	for _, c := range want {
		c.URL = strings.TrimRight(c.URL, "/")
		wanted[c.URL] = f.cfg.WithEngineKey(c)
	}
	f.mu.Lock()
	have := map[string]*worker.Worker{}
	for _, w := range f.reg.Snapshot().Workers {
		if !w.Draining() {
			have[w.URL] = w
		}
	}
	owned := map[string]bool{}
	f.smu.Lock()
	for url, s := range f.sources {
		if s == source {
			owned[url] = true
		}
	}
	f.smu.Unlock()
	for _, url := range slices.Sorted(maps.Keys(owned)) {
		if w := have[url]; w != nil {
			if _, ok := wanted[url]; !ok {
				f.drain(w, source)
			}
		}
	}
	var adds []config.Worker
	for _, url := range slices.Sorted(maps.Keys(wanted)) {
		c := wanted[url]
		w := have[url]
		switch {
		case w == nil:
			adds = append(adds, c)
		case !owned[url]:
			f.log.Warn("fleet: a worker with this URL comes from another source; leaving it", "worker", url, "source", source, "owner", f.SourceOf(url))
		case !sameWorker(w.Configured(), c):
			if _, err := f.replace(w, c, source); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", config.RedactURL(url), err))
			}
		}
	}
	f.mu.Unlock()
	for _, c := range adds {
		if _, err := f.Add(c, source); errors.Is(err, ErrWorkerExists) {
			errs = append(errs, fmt.Errorf("%s: still draining; reload again once it has left", config.RedactURL(c.URL)))
		} else if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", config.RedactURL(c.URL), err))
		}
	}
	return errors.Join(errs...)
}

// changed logs and counts one change.
func (f *Fleet) changed(op, source string, w *worker.Worker) {
	f.changes.WithLabelValues(op, source).Inc()
	f.log.Info(map[string]string{"add": "fleet: worker added", "update": "fleet: worker updated", "remove": "fleet: worker removed"}[op], "op", op, "worker", w.URL, "id", w.ID, "role", w.Role, "source", source)
}

// sameWorker reports whether two settings describe the same worker.
func sameWorker(a, b config.Worker) bool {
	norm := func(c config.Worker) config.Worker {
		c.URL = strings.TrimRight(c.URL, "/")
		c.Role = cmp.Or(c.Role, config.RoleRegular)
		if len(c.Labels) == 0 {
			c.Labels = nil
		}
		if len(c.Models) == 0 {
			c.Models = nil
		}
		return c
	}
	return reflect.DeepEqual(norm(a), norm(b)) // every setting, those added later included
}
