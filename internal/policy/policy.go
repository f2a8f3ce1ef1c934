// Package policy is the selection room: the Selector turns the fleet, a request and the workers
// to avoid into a worker or a prefill/decode pair (filtering by model, role, health, circuit
// state and pair quarantine), and a Policy picks among the candidates left. Policies are pure:
// they read the candidates, the request and live load on the workers, never the network.
package policy

import (
	"context"
	"fmt"
	"math/rand/v2"
	"reflect"
	"sync/atomic"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// Policy picks one of ws for req. ws is never empty, and every worker in it is available.
type Policy interface {
	Pick(ctx context.Context, ws []*worker.Worker, req *Request) *worker.Worker
}

// Kind is a policy as it registers itself (from its own file's init): the name `policy:` and
// --policy take, the reason a decision gives when the policy says nothing itself (one that
// implements explain says why each time), and how it is built from the configuration, whose
// settings it reads itself — nothing is copied for it elsewhere. Chooses and GoodFor are its
// row in the reference's table of policies (docs/REFERENCE.md, generated from the registry).
type Kind struct {
	Name    string
	Reason  string
	New     func(cfg config.Config) Policy
	Chooses string
	GoodFor string
}

var (
	kinds  = map[string]Kind{}
	byType = map[reflect.Type]string{}
)

// Register adds a policy kind, and its name to those the configuration accepts. Call it from
// an init function: the registry is read without a lock once Baton runs.
func Register(k Kind) {
	if _, dup := kinds[k.Name]; dup || k.Name == "" || k.New == nil || k.Chooses == "" || k.GoodFor == "" {
		panic(fmt.Sprintf("policy: bad or second registration of %q", k.Name))
	}
	kinds[k.Name] = k
	byType[reflect.TypeOf(k.New(config.Default()))] = k.Name
	config.RegisterPolicy(k.Name)
}

// New returns the policy named name, built from cfg's settings.
func New(name string, cfg config.Config) (Policy, error) {
	k, ok := kinds[name]
	if !ok {
		return nil, fmt.Errorf("unknown policy %q", name)
	}
	return k.New(cfg), nil
}

func init() {
	Register(Kind{Name: config.PolicyRoundRobin, Reason: ReasonTurn, New: func(config.Config) Policy { return &RoundRobin{} },
		Chooses: "the next worker in turn", GoodFor: "identical workers, even traffic"})
	Register(Kind{Name: config.PolicyRandom, Reason: ReasonRandom, New: func(config.Config) Policy { return Random{} },
		Chooses: "a worker at random", GoodFor: "the same, with many gateway replicas"})
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
