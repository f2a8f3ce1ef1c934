// Package policy is the selection room: the Selector turns the fleet, a request and the workers
// to avoid into a worker or a prefill/decode pair (filtering by model, role, health, circuit
// state and pair quarantine), and a Policy picks among the candidates left. Policies are pure:
// they read the candidates, the request and live load on the workers, never the network.
package policy

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// Policy picks one of ws for req. ws is never empty, and every worker in it is available.
type Policy interface {
	Pick(ctx context.Context, ws []*worker.Worker, req *Request) *worker.Worker
}

// Options are the settings of the policies that have some.
type Options struct {
	PrefixBytes      int     // prefix_hash: how much of the prompt it hashes
	PrefixLoadFactor float64 // prefix_hash: the load bound, as a multiple of the mean
	// cache_aware: see CacheAware.
	CacheThreshold, BalanceAbs, BalanceRel, CacheLoadCost float64
	CacheMaxChars                                         int // the index bound, in prompt characters
	CacheTTL                                              time.Duration
}

// New returns the policy named name.
func New(name string, o Options) (Policy, error) {
	switch name {
	case config.PolicyRoundRobin:
		return &RoundRobin{}, nil
	case config.PolicyRandom:
		return Random{}, nil
	case config.PolicyLeastLoad:
		return LeastLoad{}, nil
	case config.PolicyPowerOfTwo:
		return PowerOfTwo{}, nil
	case config.PolicyCacheAware:
		return &CacheAware{Threshold: o.CacheThreshold, BalanceAbs: o.BalanceAbs, BalanceRel: o.BalanceRel,
			LoadCost: o.CacheLoadCost, MaxBlocks: max(1, o.CacheMaxChars/prefixBlock), TTL: o.CacheTTL}, nil
	case config.PolicyPrefixHash:
		return &PrefixHash{PrefixBytes: max(1, o.PrefixBytes), LoadFactor: max(1, o.PrefixLoadFactor)}, nil
	}
	return nil, fmt.Errorf("unknown policy %q", name)
}

// RoundRobin cycles through the candidates with one shared counter.
type RoundRobin struct{ n atomic.Uint64 }

var _ Policy = (*RoundRobin)(nil)

// Pick implements Policy.
func (p *RoundRobin) Pick(_ context.Context, ws []*worker.Worker, _ *Request) *worker.Worker {
	return ws[(p.n.Add(1)-1)%uint64(len(ws))]
}

// Random picks uniformly.
type Random struct{}

var _ Policy = Random{}

// Pick implements Policy.
func (Random) Pick(_ context.Context, ws []*worker.Worker, _ *Request) *worker.Worker {
	return ws[rand.IntN(len(ws))]
}
