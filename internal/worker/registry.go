package worker

import (
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
				s.byModel[m.ID] = append(s.byModel[m.ID], w)
			}
		}
	}
	return s
}

// Candidates returns the registered workers of role that serve model (all of role when model is
// empty), whatever their readiness, and whether some worker of role is still registering and
// might serve it.
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
	for _, w := range s.pending {
		if w.Role == role {
			maybePending = true
			break
		}
	}
	return ws, maybePending
}

// Lists reports whether some registered worker lists model among its models.
func (s *Snapshot) Lists(model string) bool {
	_, ok := s.byModel[model]
	return ok
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
