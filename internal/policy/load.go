package policy

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// Load-aware policies. A worker's load is the requests Baton has in flight on it (streams
// included, released exactly once however they end) or, when the engine's own report is fresh
// and higher (it counts every replica's requests), what the engine runs and queues; a request
// waiting in the engine's queue counts twice, the strongest sign that a worker is full. A stale
// engine report is ignored, never believed.

// load is w's load for the policies.
func load(w *worker.Worker) float64 {
	in := float64(w.InFlight())
	l := w.EngineLoad()
	if !l.Fresh(time.Now()) {
		return in
	}
	return max(in, l.Running+l.Waiting) + l.Waiting
}

func init() {
	Register(Kind{Name: config.PolicyLeastLoad, Reason: ReasonLoad, New: func(config.Config) Policy { return LeastLoad{} },
		Chooses: "the least loaded worker, ties at random", GoodFor: "uneven request lengths"})
	Register(Kind{Name: config.PolicyPowerOfTwo, Reason: ReasonLoad, New: func(config.Config) Policy { return PowerOfTwo{} },
		Chooses: "the less loaded of two random workers", GoodFor: "near least_load at constant cost; decode legs"})
}

// LeastLoad picks the least loaded worker, breaking ties at random (a fixed tie-break sends
// every idle moment's requests to the same worker).
type LeastLoad struct{}

var _ Policy = LeastLoad{}

// Pick implements Policy.
func (LeastLoad) Pick(_ context.Context, ws []*worker.Worker, _ *Request) *worker.Worker {
	best, ties := ws[0], 1
	for _, w := range ws[1:] {
		switch l, b := load(w), load(best); {
		case l < b:
			best, ties = w, 1
		case l == b:
			ties++
			if rand.IntN(ties) == 0 { // reservoir: each tied worker equally likely
				best = w
			}
		}
	}
	return best
}

// PowerOfTwo samples two distinct workers at random and picks the less loaded: near the
// balance of least_load at constant cost, and without sending a burst all to one worker.
type PowerOfTwo struct{}

var _ Policy = PowerOfTwo{}

// Pick implements Policy.
func (PowerOfTwo) Pick(_ context.Context, ws []*worker.Worker, _ *Request) *worker.Worker {
	if len(ws) == 1 {
		return ws[0]
	}
	i := rand.IntN(len(ws))
	j := rand.IntN(len(ws) - 1)
	if j >= i {
		j++
	}
	a, b := ws[i], ws[j]
	if load(b) < load(a) {
		return b
	}
	return a
}
