// Package worker holds the inference engines Baton routes to: each Worker's fixed settings and
// live state (in atomics), the Registry (an immutable snapshot swapped atomically) and runtime
// detection at registration.
package worker

import (
	"encoding/json"
	"strings"
	"sync/atomic"

	"github.com/baton-llm/baton/internal/config"
)

// Model is one model a worker serves: its id and the card the worker reported in /v1/models.
type Model struct {
	ID   string
	Card json.RawMessage // nil when the model was configured rather than reported
}

// Info is what registration learned about a worker. It is replaced whole, never mutated.
type Info struct {
	Runtime string  // vllm, sglang or generic
	Models  []Model // empty means the worker accepts any model
}

// Worker is one engine. Its identity and settings are fixed at construction; its live state is
// in atomics, safe to read on the hot path.
type Worker struct {
	URL    string // base URL without a trailing slash
	Role   string // regular, prefill or decode
	Labels map[string]string
	APIKey string // bearer token for this worker; empty forwards the client's

	configured config.Worker
	info       atomic.Pointer[Info] // nil until registration succeeds
	ready      atomic.Bool
	inflight   atomic.Int64
}

// New returns a worker for c, not yet registered and not ready.
func New(c config.Worker) *Worker {
	role := c.Role
	if role == "" {
		role = config.RoleRegular
	}
	return &Worker{
		URL:        strings.TrimRight(c.URL, "/"),
		Role:       role,
		Labels:     c.Labels,
		APIKey:     c.APIKey,
		configured: c,
	}
}

// String returns the worker's URL.
func (w *Worker) String() string { return w.URL }

// Info returns what registration learned, or nil before registration succeeded.
func (w *Worker) Info() *Info { return w.info.Load() }

// Registered reports whether registration has succeeded.
func (w *Worker) Registered() bool { return w.info.Load() != nil }

// Runtime returns the worker's runtime, or "" before registration.
func (w *Worker) Runtime() string {
	if in := w.info.Load(); in != nil {
		return in.Runtime
	}
	return w.configured.Runtime
}

// Ready reports whether the worker may receive traffic.
func (w *Worker) Ready() bool { return w.ready.Load() }

// SetReady sets whether the worker may receive traffic.
func (w *Worker) SetReady(ok bool) { w.ready.Store(ok) }

// InFlight returns the number of requests the worker is serving through Baton.
func (w *Worker) InFlight() int64 { return w.inflight.Load() }

// Acquire counts one request in flight on w and returns the function that releases it. The
// release function is safe to call more than once; only the first call counts.
func (w *Worker) Acquire() (release func()) {
	w.inflight.Add(1)
	var done atomic.Bool
	return func() {
		if done.CompareAndSwap(false, true) {
			w.inflight.Add(-1)
		}
	}
}

// Serves reports whether the registered worker serves model. A worker that reported no models
// accepts any.
func (w *Worker) Serves(model string) bool {
	in := w.info.Load()
	if in == nil {
		return false
	}
	if len(in.Models) == 0 {
		return true
	}
	for _, m := range in.Models {
		if m.ID == model {
			return true
		}
	}
	return false
}

func (w *Worker) setInfo(in *Info) { w.info.Store(in) }
