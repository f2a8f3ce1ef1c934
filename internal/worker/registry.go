package worker

import (
	"errors"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

// Registry holds the fleet as an immutable Snapshot behind an atomic pointer. Readers never lock;
// writers build a new snapshot and swap it whole.
type Registry struct {
	mu   sync.Mutex // serialises writers
	snap atomic.Pointer[Snapshot]
}

// Snapshot is one immutable view of the fleet.
type Snapshot struct {
	// Workers in registration order.
	Workers  []*Worker
	byModel  map[string][]*Worker // registered workers that list the model
	anyModel []*Worker            // registered workers that accept any model
	pending  []*Worker            // workers whose registration has not succeeded yet
	parents  map[string]string    // LoRA adapter -> its base model, as the engines list them
	unserved map[string]bool      // models configured on workers whose engines do not serve them
}

// Pending is how many workers have not registered yet.
func (s *Snapshot) Pending() int { return len(s.pending) }

// PendingWorkers are the workers that have not registered yet.
func (s *Snapshot) PendingWorkers() []*Worker { return s.pending }

// Unserved are the models workers' configurations name that their engines do not serve, and
// that no worker serves: each a readiness failure.
func (s *Snapshot) Unserved() []string {
	var out []string
	for m := range s.unserved {
		if len(s.byModel[m]) == 0 {
			out = append(out, m)
		}
	}
	slices.Sort(out)
	return out
}

// NewRegistry returns a registry holding ws.
func NewRegistry(ws ...*Worker) *Registry {
	r := &Registry{}
	r.snap.Store(build(ws))
	return r
}

// Snapshot returns the current view of the fleet.
func (r *Registry) Snapshot() *Snapshot { return r.snap.Load() }

// Rebuild recomputes the model index after a worker's Info changed.
func (r *Registry) Rebuild() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.snap.Store(build(r.snap.Load().Workers))
}

// ErrExists is an addition of a URL the registry already holds.
var ErrExists = errors.New("a worker with that URL already exists")

// ErrNotFound is a change to a worker the registry does not hold (or that is leaving).
var ErrNotFound = errors.New("no worker with that id")

// Add appends w, unless a worker with its URL is there.
func (r *Registry) Add(w *Worker) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	ws := r.snap.Load().Workers
	for _, o := range ws {
		if o.URL == w.URL {
			return ErrExists
		}
	}
	r.snap.Store(build(append(slices.Clip(ws), w)))
	return nil
}

// Remove takes w out (requests already holding it finish with it) and marks it removed.
func (r *Registry) Remove(w *Worker) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ws := slices.DeleteFunc(slices.Clone(r.snap.Load().Workers), func(o *Worker) bool { return o == w })
	w.removed.Store(true)
	r.snap.Store(build(ws))
}

// Replace puts next in old's place (same position); false when old is no longer there.
func (r *Registry) Replace(old, next *Worker) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	ws := slices.Clone(r.snap.Load().Workers)
	i := slices.Index(ws, old)
	if i < 0 {
		return false
	}
	ws[i] = next
	old.removed.Store(true)
	r.snap.Store(build(ws))
	return true
}

// Get returns the worker with id (or URL), nil when there is none.
func (s *Snapshot) Get(id string) *Worker {
	url := strings.TrimRight(id, "/") // a worker URL is kept without its trailing slashes
	for _, w := range s.Workers {
		if w.ID == id || w.URL == url {
			return w
		}
	}
	return nil
}

func build(ws []*Worker) *Snapshot {
	s := &Snapshot{Workers: ws, byModel: map[string][]*Worker{}}
	for _, w := range ws {
		in := w.Info()
		switch {
		case in == nil:
			s.pending = append(s.pending, w)
		case len(in.Models) == 0:
			s.anyModel = append(s.anyModel, w)
		default:
			for _, m := range in.Models {
				if slices.Contains(in.Unserved, m.ID) {
					// Configured, but its engine does not serve it: no candidate for it. The
					// model stays known (readiness names it as served by no engine).
					if s.unserved == nil {
						s.unserved = map[string]bool{}
					}
					s.unserved[m.ID] = true
					continue
				}
				s.byModel[m.ID] = append(s.byModel[m.ID], w)
				if m.Parent != "" {
					if s.parents == nil {
						s.parents = map[string]string{}
					}
					s.parents[m.ID] = m.Parent
				}
			}
		}
	}
	return s
}

// Candidates returns the registered workers of role that serve model (all of role when model is
// empty), whatever their readiness, and whether some worker of role is still registering that
// may serve it.
func (s *Snapshot) Candidates(role, model string) (ws []*Worker, maybePending bool) {
	add := func(list []*Worker) {
		for _, w := range list {
			if w.Role == role {
				ws = append(ws, w)
			}
		}
	}
	if model == "" {
		for _, w := range s.Workers {
			if w.Role == role && w.Registered() {
				ws = append(ws, w)
			}
		}
	} else {
		add(s.byModel[model])
		add(s.anyModel)
	}
	// A worker still registering may serve model when its configuration names it, or — when it
	// names none — while its first registration has not answered yet, or no worker has
	// registered at all (nothing is known of any model). An engine that failed to register (it
	// is down, and keeps being retried) makes no model known: a model no worker names is a 404,
	// not a 503 that OpenAI's SDKs retry for as long as the engine stays down.
	known := len(s.pending) < len(s.Workers)
	for _, w := range s.pending {
		if w.Role != role {
			continue
		}
		cm := w.Configured().Models
		if model == "" || slices.Contains(cm, model) || len(cm) == 0 && (!known || w.LastRegistrationError() == nil) {
			maybePending = true
			break
		}
	}
	return ws, maybePending
}

// Parent returns the base model of the LoRA adapter model as some engine lists it; "" when no
// engine lists model as an adapter.
func (s *Snapshot) Parent(model string) string { return s.parents[model] }

// Lists reports whether some registered worker lists model among its models.
func (s *Snapshot) Lists(model string) bool {
	_, ok := s.byModel[model]
	return ok
}

// Models returns, sorted, the models the workers name: those their configuration lists and
// those their engines reported at registration.
func (s *Snapshot) Models() []string {
	seen := map[string]bool{}
	for m := range s.byModel {
		seen[m] = true
	}
	for _, w := range s.Workers {
		for _, m := range w.Configured().Models {
			seen[m] = true
		}
	}
	return slices.Sorted(maps.Keys(seen))
}

// HasReady reports whether some worker of role is ready.
func (s *Snapshot) HasReady(role string) bool {
	for _, w := range s.Workers {
		if w.Role == role && w.Ready() {
			return true
		}
	}
	return false
}
