package policy

import (
	"context"
	"reflect"
	"strconv"
	"strings"

	"github.com/baton-llm/baton/internal/worker"
)

// Decision says why a worker was chosen: for the opt-in X-Baton-Route header, the route
// decision metrics and debugging. Every field is Baton's own (policy and reason names from a
// fixed set, a configured worker URL, numbers), never a client's bytes.
type Decision struct {
	Role, Policy, Reason string
	Worker               string
	Match                float64 // share of the prompt the chosen worker was found to have cached; -1: not known
	Load                 float64 // the chosen worker's load when chosen
}

// The reasons a worker is chosen.
const (
	ReasonTurn       = "turn"        // round_robin: the next in turn
	ReasonRandom     = "random"      // random
	ReasonLoad       = "load"        // least_load, power_of_two: the less loaded
	ReasonHash       = "hash"        // prefix_hash: the prompt's hash ranks it first among the unloaded
	ReasonCacheMatch = "cache_match" // cache_aware: the cheapest by cached prompt and load
	ReasonCacheMiss  = "cache_miss"  // cache_aware: no worker had cache_threshold of the prompt
	ReasonImbalanced = "imbalanced"  // cache_aware: the fleet's load was out of balance
	ReasonNoPrompt   = "no_prompt"   // cache_aware: the request had no prompt to match
)

// Name is the configured name of p ("custom" for a policy no kind registered).
func Name(p Policy) string {
	if n, ok := byType[reflect.TypeOf(p)]; ok {
		return n
	}
	return "custom"
}

// explainer is a policy that says why it chose.
type explainer interface {
	explain(ctx context.Context, ws []*worker.Worker, req *Request) (*worker.Worker, Decision)
}

// reasonOf is the reason p's kind gives for a decision it does not explain.
func reasonOf(p Policy) string {
	if k, ok := kinds[Name(p)]; ok && k.Reason != "" {
		return k.Reason
	}
	return ReasonLoad
}

// pick has role's policy choose among ws, recording the decision on req and with Observe.
func (s *Selector) pick(ctx context.Context, role string, ws []*worker.Worker, req *Request) *worker.Worker {
	w, _ := s.pickDecision(ctx, role, ws, req)
	return w
}

// pickDecision is pick, with the decision it made.
func (s *Selector) pickDecision(ctx context.Context, role string, ws []*worker.Worker, req *Request) (*worker.Worker, Decision) {
	var p Policy
	if req != nil {
		p = s.PolicyFor(role, req.Model)
	} else {
		p = s.Policy(role)
	}
	var w *worker.Worker
	var d Decision
	if e, ok := p.(explainer); ok {
		w, d = e.explain(ctx, ws, req)
	} else {
		w, d = p.Pick(ctx, ws, req), Decision{Reason: reasonOf(p), Match: -1}
	}
	d.Role, d.Policy, d.Worker, d.Load = role, Name(p), w.URL, load(w)
	if req != nil && req.Explain {
		req.Decisions = append(req.Decisions, d)
	}
	if s.Observe != nil {
		s.Observe(d)
	}
	return w, d
}

// RouteHeader formats decisions for the X-Baton-Route header: per decision
// "role=R; policy=P; reason=X; load=L" with "; match=M" when known, comma separated.
func RouteHeader(ds []Decision) string {
	var b strings.Builder
	for i, d := range ds {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("role=" + d.Role + "; policy=" + d.Policy + "; reason=" + d.Reason + "; load=" + strconv.FormatFloat(d.Load, 'f', -1, 64))
		if d.Match >= 0 {
			b.WriteString("; match=" + strconv.FormatFloat(d.Match, 'f', 2, 64))
		}
	}
	return b.String()
}
