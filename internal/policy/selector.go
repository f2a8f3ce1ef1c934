package policy

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/lora"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/worker"
)

// LocalPrefillFunc decides whether a PD request's chosen decode serves it alone, computing the
// prompt itself: match is the share of the prompt the decode's policy found cached there (-1:
// not known); prefills are those that could otherwise take its prefill (the decode can take
// their KV).
type LocalPrefillFunc func(ctx context.Context, decode *worker.Worker, match float64, req *Request, prefills []*worker.Worker) bool

// Request is what selection sees of one request: its model, its route and the client's raw
// body, from which a policy may read the prompt (text or tokens). Live load is on the workers.
type Request struct {
	Model string
	Path  string
	Body  []byte
	// Parsed, when set, is the parsed request whose Body this is: its member index spares a
	// scan of the body (prompt members for prefix routing).
	Parsed *openai.Request
	// Explain asks each choice made for the request to append its Decision to Decisions
	// (X-Baton-Route); off, nothing is kept on the request.
	Explain   bool
	Decisions []Decision
	// Ranks, set by a choice that knows (cache_aware from the engines' events), names per worker
	// URL the DP rank holding the longest cached prefix of the prompt.
	Ranks map[string]int
	// AdapterBase, set by the selection, is the base model when Model is a LoRA adapter
	// (declared, or listed by an engine); "" otherwise.
	AdapterBase string
	// Allow, when set, is a strict filter on the available workers (an Endpoint Picker's subset
	// hint): a worker it refuses is never chosen, even when that leaves none.
	Allow func(*worker.Worker) bool
}

// available returns the available workers of ws that req allows. It allocates only when
// some are not.
func available(ws []*worker.Worker, req *Request) []*worker.Worker {
	ws = worker.Available(ws)
	if req.Allow == nil {
		return ws
	}
	return worker.Keep(ws, req.Allow)
}

// NoWorkerError says why no worker could be chosen.
type NoWorkerError struct {
	Role  string // the role that had none
	Model string // the request's model, "" for none
	// Unserved means no worker of any role serves the model at all (rather than none being
	// available now: unhealthy, circuits open, or still registering).
	Unserved bool
	// Incompatible means decodes are available, but none can take an available prefill's KV
	// (their KV connectors differ).
	Incompatible bool
	// Route, when set, is a route no available prefill can serve disaggregated, whatever its
	// load: a failure no retry mends.
	Route string
	// Unrouted, when set, is an SGLang-only route asked of workers that are all vLLM: a failure
	// no retry mends.
	Unrouted string
}

// NoWorkerKind is what a NoWorkerError means for the request, one value per meaning: every
// caller reads the kind, none decodes the flags.
type NoWorkerKind int

const (
	// NoneAvailable: the model's workers exist but none is available now (unhealthy, circuits
	// open, registering, draining): a retry, a fallback or the waiting room may find one.
	NoneAvailable NoWorkerKind = iota
	// ModelUnserved: no worker of any role serves the model.
	ModelUnserved
	// KVIncompatible: decodes are available, but none can take an available prefill's KV.
	KVIncompatible
	// RouteNotDisaggregated: the route cannot be served through the model's PD pairs.
	RouteNotDisaggregated
	// RouteSGLangOnly: an SGLang-only route asked of workers that are all vLLM.
	RouteSGLangOnly
)

// Kind is what e means, in the order a request is answered by: a model nobody serves first,
// then a route its workers cannot serve, then a pair that cannot meet, then none available.
func (e *NoWorkerError) Kind() NoWorkerKind {
	switch {
	case e.Unserved:
		return ModelUnserved
	case e.Unrouted != "":
		return RouteSGLangOnly
	case e.Route != "":
		return RouteNotDisaggregated
	case e.Incompatible:
		return KVIncompatible
	}
	return NoneAvailable
}

// RouteRefused reports whether e refuses the request's route (no retry, fallback or wait
// mends it).
func (k NoWorkerKind) RouteRefused() bool { return k == RouteNotDisaggregated || k == RouteSGLangOnly }

func (e *NoWorkerError) Error() string {
	switch {
	case e.Unrouted != "":
		return fmt.Sprintf("%s is SGLang's native route, and every worker serving model %q is vLLM, which answers it 404; send /v1/completions or /v1/chat/completions, or add SGLang workers", e.Unrouted, e.Model)
	case e.Route != "":
		return fmt.Sprintf("%s cannot be served through SGLang prefill/decode pairs: SGLang's %s request carries no bootstrap fields, so its legs would never meet; send /v1/chat/completions, or add vLLM pairs or regular workers", e.Route, e.Route)
	case e.Unserved:
		return fmt.Sprintf("the model %q is not served by any worker", e.Model)
	case e.Incompatible:
		return fmt.Sprintf("no available decode worker shares a KV connector with an available prefill worker (model %q)", e.Model)
	case e.Model != "":
		return fmt.Sprintf("no %s worker is available to serve model %q (all unhealthy, circuits open, or still registering)", e.Role, e.Model)
	}
	return fmt.Sprintf("no %s worker is available (all unhealthy, circuits open, or still registering)", e.Role)
}

// Selector chooses workers for requests: the candidates are the registered workers of a role
// serving the request's model and route; of those, the available ones (healthy, circuit admitting), those
// not in avoid (the workers that already failed this request) when any remain, and for a
// decode those not quarantined with the chosen prefill when any remain. The role's policy picks
// among what is left.
type Selector struct {
	Registry *worker.Registry
	Policies map[string]Policy  // by role, as built; SetPolicies replaces them while serving
	Pairs    *worker.PairHealth // nil: no pair quarantine
	// Compatible reports whether a decode can take a prefill's KV (their connectors agree);
	// nil: any pair.
	Compatible func(prefill, decode *worker.Worker) bool
	// Observe, when set, sees every decision (for metrics).
	Observe func(Decision)
	// Adapters, when set, lets any worker of a declared adapter's base model be a candidate for
	// it (Baton loads it there), and with adapter_affinity keeps, of the available workers, those
	// in the best adapter tier (running, loaded, free slot) for the policy to choose among.
	Adapters *lora.Manager
	// LocalPrefill, when set, makes a PD generation request's decode (one with a parsed body)
	// chosen first and asks whether it serves the request alone (conditional
	// disaggregation); nil, or a request without a body (a health check): always a pair.
	LocalPrefill LocalPrefillFunc
	// ServeWhole, when set, makes a PD generation request's decode chosen first too, and asks
	// before LocalPrefill for a prefill worker to serve the request whole instead (the mirror
	// case: that decode saturated, a prefill idle); nil: none.
	ServeWhole func(ctx context.Context, decode *worker.Worker, req *Request, prefills []*worker.Worker) *worker.Worker

	live atomic.Pointer[policySet] // set by SetPolicies
}

// policySet is the policies of every role, and those some models have of their own.
type policySet struct {
	byRole  map[string]Policy
	byModel map[string]map[string]Policy // model -> role -> policy
}

// SetPolicies makes ps (by role) the policies of every selection from now on, and byModel
// (model -> role -> policy) those of the models that have their own: at startup and on a reload
// that changes one. Selections in progress finish with the policy they began with.
func (s *Selector) SetPolicies(ps map[string]Policy, byModel map[string]map[string]Policy) {
	s.live.Store(&policySet{byRole: ps, byModel: byModel})
}

// Policy is role's policy now.
func (s *Selector) Policy(role string) Policy {
	if ps := s.live.Load(); ps != nil {
		return ps.byRole[role]
	}
	return s.Policies[role]
}

// PolicyFor is role's policy for model now: the model's own when it has one.
func (s *Selector) PolicyFor(role, model string) Policy {
	if ps := s.live.Load(); ps != nil {
		if m := ps.byModel[model]; m != nil && m[role] != nil {
			return m[role]
		}
		return ps.byRole[role]
	}
	return s.Policies[role]
}

// Serves reports whether w serves path: an SGLang-only route (routes.Route.SGLangOnly) is never
// sent to a vLLM worker.
func Serves(w *worker.Worker, path string) bool {
	return !routes.Of(path).SGLangOnly || w.Runtime() != config.RuntimeVLLM
}

// serving returns the workers of ws that serve path. It allocates only when some do not.
func serving(ws []*worker.Worker, path string) []*worker.Worker {
	if !routes.Of(path).SGLangOnly {
		return ws
	}
	return worker.Keep(ws, func(w *worker.Worker) bool { return Serves(w, path) })
}

// Candidates are the registered workers of role that may serve model: for a declared adapter,
// those serving its base model (Baton loads it where it is not); otherwise snap.Candidates.
func (s *Selector) Candidates(snap *worker.Snapshot, role, model string) ([]*worker.Worker, bool) {
	if s.Adapters == nil {
		return snap.Candidates(role, model)
	}
	a, ok := s.Adapters.Loadable(model)
	if !ok {
		return snap.Candidates(role, model)
	}
	ws, pending := snap.Candidates(role, a.Base)
	var out []*worker.Worker
	for _, w := range ws {
		if w.Lists(a.Base) {
			out = append(out, w)
		}
	}
	return out, pending
}

// adapter notes on req whether its model is a LoRA adapter (AdapterBase).
func (s *Selector) adapter(snap *worker.Snapshot, req *Request) {
	req.AdapterBase = ""
	if s.Adapters != nil {
		req.AdapterBase = s.Adapters.Base(snap, req.Model)
	}
}

// affine returns the workers of ws in the best adapter tier for req's model, when it is an
// adapter and adapter_affinity is on; ws otherwise.
func (s *Selector) affine(ws []*worker.Worker, req *Request) []*worker.Worker {
	if req.AdapterBase == "" || len(ws) < 2 || !s.Adapters.Settings().Affinity {
		return ws
	}
	best, _ := s.Adapters.Best(ws, req.Model, time.Now())
	return best
}

// Worker chooses a worker of role for req, or returns a *NoWorkerError.
func (s *Selector) Worker(ctx context.Context, role string, req *Request, avoid map[string]bool) (*worker.Worker, error) {
	snap := s.Registry.Snapshot()
	s.adapter(snap, req)
	cands, pending := s.Candidates(snap, role, req.Model)
	if len(cands) == 0 && !pending && req.Model != "" {
		return nil, &NoWorkerError{Role: role, Model: req.Model, Unserved: true}
	}
	served := serving(cands, req.Path)
	if len(served) == 0 && len(cands) > 0 {
		return nil, &NoWorkerError{Role: role, Model: req.Model, Unrouted: req.Path}
	}
	avail := preferOthers(available(served, req), avoid)
	if len(avail) == 0 {
		return nil, &NoWorkerError{Role: role, Model: req.Model}
	}
	return s.pick(ctx, role, s.affine(avail, req), req), nil
}

// Pair chooses a prefill and a decode worker for req, each by its role's policy, or returns a
// *NoWorkerError.
func (s *Selector) Pair(ctx context.Context, req *Request, avoid map[string]bool) (worker.Pair, error) {
	snap := s.Registry.Snapshot()
	s.adapter(snap, req)
	pc, pPending := s.Candidates(snap, config.RolePrefill, req.Model)
	dc, dPending := s.Candidates(snap, config.RoleDecode, req.Model)
	if req.Model != "" && len(pc) == 0 && len(dc) == 0 && !pPending && !dPending {
		return worker.Pair{}, &NoWorkerError{Role: config.RolePrefill, Model: req.Model, Unserved: true}
	}
	if served := serving(pc, req.Path); len(served) == 0 && len(pc) > 0 {
		return worker.Pair{}, &NoWorkerError{Role: config.RolePrefill, Model: req.Model, Unrouted: req.Path}
	}
	// A generation request (a health check's pair stays whole) may be served by its decode
	// alone: without a prefill it can use, it still goes to its decode, which serves it alone
	// if conditional disaggregation lets it.
	decideFirst := (s.LocalPrefill != nil || s.ServeWhole != nil) && req.Parsed != nil
	var noPrefill *NoWorkerError
	prefills := preferOthers(available(serving(pc, req.Path), req), avoid)
	if len(prefills) == 0 {
		noPrefill = &NoWorkerError{Role: config.RolePrefill, Model: req.Model}
	} else if prefills = handingOff(prefills, req.Path); len(prefills) == 0 {
		noPrefill = &NoWorkerError{Role: config.RolePrefill, Model: req.Model, Route: req.Path}
	}
	if noPrefill != nil && (!decideFirst || s.LocalPrefill == nil) {
		return worker.Pair{}, noPrefill
	}
	decodes := preferOthers(available(serving(dc, req.Path), req), avoid)
	if len(decodes) == 0 {
		return worker.Pair{}, &NoWorkerError{Role: config.RoleDecode, Model: req.Model}
	}
	if noPrefill == nil {
		if prefills = s.withPartners(prefills, decodes); len(prefills) == 0 {
			return worker.Pair{}, &NoWorkerError{Role: config.RoleDecode, Model: req.Model, Incompatible: true}
		}
	}
	var p worker.Pair
	if decideFirst {
		return s.decodeFirst(ctx, req, prefills, decodes, noPrefill)
	}
	p.Prefill = s.pick(ctx, config.RolePrefill, s.affine(prefills, req), req)
	p.Decode = s.pick(ctx, config.RoleDecode, s.affine(s.unquarantined(p.Prefill, s.partners(p.Prefill, decodes)), req), req)
	return p, nil
}

// decodeFirst chooses a PD request's decode first, among those that can take some prefill's
// KV; asks ServeWhole whether an idle prefill should serve the request whole instead (a pair
// of that prefill alone), and LocalPrefill whether the decode serves it alone (a pair without a
// prefill); else a prefill whose KV it can take, preferring one not quarantined with it. With
// no prefill to use (noPrefill says why), the decode serves the request alone or it fails.
func (s *Selector) decodeFirst(ctx context.Context, req *Request, prefills, decodes []*worker.Worker, noPrefill *NoWorkerError) (worker.Pair, error) {
	if s.Compatible != nil && len(prefills) > 0 {
		decodes = worker.Keep(decodes, func(d *worker.Worker) bool {
			return slices.ContainsFunc(prefills, func(p *worker.Worker) bool { return s.Compatible(p, d) })
		})
	}
	var p worker.Pair
	var dec Decision
	p.Decode, dec = s.pickDecision(ctx, config.RoleDecode, s.affine(decodes, req), req)
	ps := prefills
	if s.Compatible != nil {
		ps = worker.Keep(prefills, func(w *worker.Worker) bool { return s.Compatible(w, p.Decode) })
	}
	if s.ServeWhole != nil {
		if w := s.ServeWhole(ctx, p.Decode, req, ps); w != nil {
			return worker.Pair{Decode: w}, nil // a prefill serves it alone, as the pair's only worker
		}
	}
	if s.LocalPrefill != nil && s.LocalPrefill(ctx, p.Decode, dec.Match, req, ps) {
		return p, nil
	}
	if noPrefill != nil {
		return worker.Pair{}, noPrefill
	}
	if s.Pairs != nil {
		if free := worker.Keep(ps, func(w *worker.Worker) bool { return !s.Pairs.Quarantined(w, p.Decode) }); len(free) > 0 {
			ps = free
		}
	}
	p.Prefill = s.pick(ctx, config.RolePrefill, s.affine(ps, req), req)
	return p, nil
}

// handingOff returns the prefills of ws that can serve path disaggregated: SGLang's
// ResponsesRequest has no bootstrap_host/port/room (python/sglang/srt/entrypoints/openai/
// protocol.py), so /v1/responses reaches an SGLang pair without them and its decode waits out
// its bootstrap timeout; only vLLM prefills (the sequential relay) take it. It allocates only
// when some cannot.
func handingOff(ws []*worker.Worker, path string) []*worker.Worker {
	if r := routes.Of(path); !r.PD || r.SGLangPD {
		return ws
	}
	return worker.Keep(ws, func(w *worker.Worker) bool { return w.Runtime() == config.RuntimeVLLM })
}

// withPartners returns the prefills that some decode of decodes can take the KV of.
func (s *Selector) withPartners(prefills, decodes []*worker.Worker) []*worker.Worker {
	if s.Compatible == nil {
		return prefills
	}
	return worker.Keep(prefills, func(p *worker.Worker) bool { return len(s.partners(p, decodes)) > 0 })
}

// partners returns the decodes that can take prefill's KV. It allocates only when some cannot.
func (s *Selector) partners(prefill *worker.Worker, decodes []*worker.Worker) []*worker.Worker {
	if s.Compatible == nil {
		return decodes
	}
	return worker.Keep(decodes, func(d *worker.Worker) bool { return s.Compatible(prefill, d) })
}

// Decode chooses another decode worker for prefill's handoff: one serving req's model and
// route, available, able to take prefill's KV, not in avoid (strictly: none left is a
// *NoWorkerError), preferring one not quarantined with prefill.
func (s *Selector) Decode(ctx context.Context, prefill *worker.Worker, req *Request, avoid map[string]bool) (*worker.Worker, error) {
	snap := s.Registry.Snapshot()
	s.adapter(snap, req)
	dc, _ := s.Candidates(snap, config.RoleDecode, req.Model)
	var ds []*worker.Worker
	for _, d := range s.partners(prefill, available(serving(dc, req.Path), req)) {
		if !avoid[d.URL] {
			ds = append(ds, d)
		}
	}
	if len(ds) == 0 {
		return nil, &NoWorkerError{Role: config.RoleDecode, Model: req.Model}
	}
	return s.pick(ctx, config.RoleDecode, s.affine(s.unquarantined(prefill, ds), req), req), nil
}

// HasRole reports whether any worker of role is configured.
func (s *Selector) HasRole(role string) bool {
	for _, w := range s.Registry.Snapshot().Workers {
		if w.Role == role {
			return true
		}
	}
	return false
}

// preferOthers returns the workers of ws not in avoid, or ws when that would leave none.
func preferOthers(ws []*worker.Worker, avoid map[string]bool) []*worker.Worker {
	if len(avoid) == 0 {
		return ws
	}
	var out []*worker.Worker
	for _, w := range ws {
		if !avoid[w.URL] {
			out = append(out, w)
		}
	}
	if len(out) == 0 {
		return ws
	}
	return out
}

// unquarantined returns the decodes not quarantined with prefill, or all of them when every
// pair is quarantined.
func (s *Selector) unquarantined(prefill *worker.Worker, decodes []*worker.Worker) []*worker.Worker {
	if s.Pairs == nil {
		return decodes
	}
	var out []*worker.Worker
	for _, d := range decodes {
		if !s.Pairs.Quarantined(prefill, d) {
			out = append(out, d)
		}
	}
	if len(out) == 0 {
		return decodes
	}
	return out
}
