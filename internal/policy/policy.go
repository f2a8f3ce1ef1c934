// Package policy chooses one worker among the ready candidates for a request. Policies are pure:
// they read the candidates and their own state, never the network.
package policy

import (
	"fmt"
	"math/rand/v2"
	"sync/atomic"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// Policy picks one of ws, which is never empty.
type Policy interface {
	Pick(ws []*worker.Worker) *worker.Worker
}

// New returns the policy named name.
func New(name string) (Policy, error) {
	switch name {
	case config.PolicyRoundRobin:
		return &RoundRobin{}, nil
	case config.PolicyRandom:
		return Random{}, nil
	}
	return nil, fmt.Errorf("unknown policy %q", name)
}

// RoundRobin cycles through the candidates with one shared counter.
type RoundRobin struct{ n atomic.Uint64 }

var _ Policy = (*RoundRobin)(nil)

// Pick implements Policy.
func (p *RoundRobin) Pick(ws []*worker.Worker) *worker.Worker {
	return ws[(p.n.Add(1)-1)%uint64(len(ws))]
}

// Random picks uniformly.
type Random struct{}

var _ Policy = Random{}

// Pick implements Policy.
func (Random) Pick(ws []*worker.Worker) *worker.Worker { return ws[rand.IntN(len(ws))] }
