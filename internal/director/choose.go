package director

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/lora"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/tracing"
	"github.com/baton-llm/baton/internal/worker"
)

// Plan is one request's way through the model chain and the selection, over all its attempts.
type Plan struct {
	Rec *record.Record
	Sel *policy.Request
	// Role is the role of the worker a request goes to alone (regular; decode for a PD request
	// a decode serves alone); Pair sends it to a prefill/decode pair instead.
	Role string
	Pair bool

	waited bool // the waiting room holds a request once
}

// newPlan is the plan of a request whose parsed body is req, sent to path, served by a worker
// of role alone.
func (d *Director) newPlan(rec *record.Record, req *openai.Request, path, role string) *Plan {
	return &Plan{Rec: rec, Role: role, Sel: &policy.Request{Model: req.Model, Path: path, Body: req.Body, Parsed: req, Explain: d.Explain()}}
}

// PlanRegular is the plan of a request a regular worker serves.
func (d *Director) PlanRegular(rec *record.Record, req *openai.Request, path string) *Plan {
	return d.newPlan(rec, req, path, config.RoleRegular)
}

// PlanPair is the plan of a request a prefill/decode pair serves; prefiller, when set, holds
// its prefill to the one an Endpoint Picker named (Prefiller).
func (d *Director) PlanPair(rec *record.Record, req *openai.Request, path string, prefiller func(*worker.Worker) bool) *Plan {
	p := d.newPlan(rec, req, path, config.RoleDecode)
	p.Pair, p.Sel.Allow = true, prefiller
	return p
}

// PlanDecodeAlone is the plan of a PD request a decode worker serves alone, as a regular
// request: no handoff fields, the decode computes the prompt — by design, and said so
// (X-Baton-Kv-Handoff none-local-prefill, baton_pd_kv_handoffs_total class by_design, the access
// log's handoff). SGLang's decodes refuse a request without a bootstrap: only others serve it.
func (d *Director) PlanDecodeAlone(rec *record.Record, req *openai.Request, path string) *Plan {
	p := d.newPlan(rec, req, path, config.RoleDecode)
	p.Sel.Allow = func(w *worker.Worker) bool { return w.Runtime() != config.RuntimeSGLang }
	return p
}

// NoteLocalPrefill writes on a PD request's record that its decode, w, serves this attempt alone
// — by design, the prompt's uncached part being short (pd_local_prefill_threshold):
// X-Baton-Kv-Handoff none-local-prefill. A later attempt may go through a pair again; the
// request is counted once it ended (CountLocalPrefill).
//
// A prefill worker serving it whole (the mirror case, pd_prefill_serves_whole) is written
// alike, as none-prefill-whole.
func (d *Director) NoteLocalPrefill(p *Plan, w *worker.Worker) {
	p.NoteWorker(w)
	p.Rec.Prefill, p.Rec.Mode = "", record.ModeRegular
	p.Rec.PrefillTime, p.Rec.PrefillBusy, p.Rec.DecodeBusy = 0, 0, int(w.InFlight())
	p.Rec.Handoff, p.Rec.LocalPrefill = pd.HandoffNoneLocalPrefill, true
	if w.Role == config.RolePrefill {
		p.Rec.Handoff = pd.HandoffNonePrefillWhole
	}
}

// CountLocalPrefill counts one PD request of model that one worker served alone by design —
// a decode by the threshold (baton_pd_local_prefill_total), or a prefill in the mirror case
// (baton_pd_prefill_whole_total), as handoff says — in baton_pd_kv_handoffs_total class
// by_design and on the status page: once per request, when its answer ended whole (PDEnded,
// from either door).
func (d *Director) CountLocalPrefill(model, handoff string) {
	d.metrics.PDHandoffs.WithLabelValues(handoff, pd.HandoffClass(handoff), "").Inc()
	if handoff == pd.HandoffNonePrefillWhole {
		d.metrics.PDPrefillWhole.WithLabelValues(d.metrics.Model(model)).Inc()
		d.prefillWholes.Add(1)
		return
	}
	d.metrics.PDLocalPrefill.WithLabelValues(d.metrics.Model(model)).Inc()
	d.localPrefills.Add(1)
}

// PrefillWholes is how many PD requests an idle prefill served whole since start.
func (d *Director) PrefillWholes() int64 { return d.prefillWholes.Load() }

// LocalPrefills is how many PD requests a decode served alone by the threshold since start.
func (d *Director) LocalPrefills() int64 { return d.localPrefills.Load() }

// NoteWorker writes the worker chosen to serve the request alone on its record (a decode
// serving alone as the decode too; for a plan of a decode alone, PlanDecodeAlone's, by design:
// none-local-prefill, counted once the request ended whole, as CountLocalPrefill says).
func (p *Plan) NoteWorker(w *worker.Worker) {
	p.Rec.Worker = w.URL
	if p.Role == config.RoleDecode {
		p.Rec.Decode = w.URL
		if !p.Pair {
			p.Rec.Handoff, p.Rec.LocalPrefill = pd.HandoffNoneLocalPrefill, true
		}
	}
}

// NotePair writes the chosen pair and its mode on the request's record. A function of its own,
// never inlined, so that the attempt's frame, under every open PD stream, stays small.
//
//go:noinline
func (p *Plan) NotePair(pair worker.Pair) {
	p.Rec.Mode, p.Rec.Prefill, p.Rec.Decode, p.Rec.Worker = pd.Mode(pair), pair.Prefill.URL, pair.Decode.URL, pair.Decode.URL
	p.Rec.PrefillBusy, p.Rec.DecodeBusy = int(pair.Prefill.InFlight()), int(pair.Decode.InFlight())
}

// HealthPair chooses a pair for a health check end to end (GET /health_generate).
func (d *Director) HealthPair(ctx context.Context) (worker.Pair, error) {
	return d.sel.Pair(ctx, &policy.Request{Path: "/health"}, nil)
}

// PrefillFor chooses a prefill worker serving path (SGLang's info routes).
func (d *Director) PrefillFor(ctx context.Context, path string) (*worker.Worker, error) {
	return d.sel.Worker(ctx, config.RolePrefill, &policy.Request{Path: path}, nil)
}

// Serves reports whether w serves path.
func Serves(w *worker.Worker, path string) bool { return policy.Serves(w, path) }

// Explain reports whether choices are to say why they were made: for X-Baton-Route, or a trace.
func (d *Director) Explain() bool { return d.o.RouteHeader || tracing.Enabled() }

// Choice is where one attempt goes: a worker alone, or a pair.
type Choice struct {
	Worker *worker.Worker // the worker alone, or the pair's decode
	Pair   worker.Pair    // set for a pair
	end    func()
}

// Workers are the chosen workers, a pair's prefill first.
func (c Choice) Workers() []*worker.Worker {
	if c.Pair.Prefill != nil {
		return []*worker.Worker{c.Pair.Prefill, c.Pair.Decode}
	}
	return []*worker.Worker{c.Worker}
}

// Release ends the request's count in flight on its adapter (nothing without one).
func (c Choice) Release() {
	if c.end != nil {
		c.end()
	}
}

// Choose runs the selection over the request's models (the model asked for as name, then its
// fallbacks; the waiting room once) and readies its adapter on the workers chosen, choosing
// again — a bounded number of times — when the adapter was loaded on another worker meanwhile.
// Its error is a failure to render (selectionError's for no worker), or the adapter's.
func (d *Director) Choose(ctx context.Context, p *Plan, name string, avoid map[string]bool) (Choice, error) {
	sreq := p.Sel
	for tries := 0; ; tries++ {
		var c Choice
		sel := func() (err error) {
			if p.Pair {
				c.Pair, err = d.sel.Pair(ctx, sreq, avoid)
				c.Worker = c.Pair.Decode
				return err
			}
			c.Worker, err = d.sel.Worker(ctx, p.Role, sreq, avoid)
			return err
		}
		sreq.Decisions, sreq.Ranks = sreq.Decisions[:0], nil
		end := d.selectSpan(ctx)
		err := d.pickModel(ctx, p, name, avoid, sel)
		end(sreq, err)
		if err != nil {
			return Choice{}, SelectionError(err)
		}
		if sreq.AdapterBase != "" {
			c.end, err = d.adapterReady(ctx, sreq.Model, c.Workers()...)
			if errors.Is(err, lora.ErrReselect) && tries < maxReselect {
				continue // the adapter was loaded elsewhere meanwhile: choose again
			}
			if err != nil {
				return Choice{}, err
			}
		}
		if d.o.RouteHeader {
			p.Rec.Decisions = policy.RouteHeader(sreq.Decisions)
		}
		return c, nil
	}
}

// maxReselect bounds how often a request chooses again because its adapter was loaded on
// another worker while it waited.
const maxReselect = 3

// pickModel runs sel over the request's models (ModelChain) until one has an available worker:
// the model it asked for, then each fallback in turn — also once every worker of a model failed
// this request with a retryable error (a retry goes to the fallback) — before anything was
// sent, so never after a first byte. The waiting room holds the first model once when none had
// one. The model chosen is on the record (X-Baton-Model) and a fallback is counted.
func (d *Director) pickModel(ctx context.Context, p *Plan, client string, avoid map[string]bool, sel func() error) error {
	sreq := p.Sel
	var one [1]string
	chain := append(one[:0], client) // a model the configuration does not name: itself alone
	if models, _ := d.Models(); len(models) > 0 {
		if who := p.Rec.Who; who != nil {
			chain = d.ModelChain(client, who.Allows) // a tenant's fallbacks only where it may go
		} else {
			chain = d.ModelChain(client)
		}
	}
	var err error
	for i, m := range chain {
		if i+1 < len(chain) && d.spent(m, avoid) {
			continue // every worker of m failed this request already: its fallback next
		}
		sreq.Model = m
		if err = sel(); err == nil || !fallbackable(err) {
			break
		}
	}
	if err != nil && fallbackable(err) && !p.waited {
		p.waited = true
		if sreq.Model = chain[0]; d.waitingRoom(ctx, chain[0], err) {
			err = sel()
		}
	}
	if err != nil {
		return err
	}
	if sreq.Model != chain[0] {
		d.metrics.ModelFallbacks.WithLabelValues(d.metrics.KnownLabel(chain[0]), d.metrics.KnownLabel(sreq.Model)).Inc()
	}
	if sreq.Model != p.Rec.Model {
		p.Rec.Served = sreq.Model // not the name the client gave: an alias's target, a fallback
	}
	return nil
}

// spent reports whether every worker of model (of the roles a request needs) failed this
// request already.
func (d *Director) spent(model string, avoid map[string]bool) bool {
	if len(avoid) == 0 {
		return false
	}
	role := config.RoleRegular
	if d.Disaggregated() {
		role = config.RoleDecode
	}
	cands, _ := d.Candidates(d.reg.Snapshot(), role, model)
	if len(cands) == 0 {
		return false
	}
	for _, w := range cands {
		if !avoid[w.URL] {
			return false
		}
	}
	return true
}

// fallbackable: the selection found no available worker for the model (not a route the
// model's workers cannot serve).
func fallbackable(err error) bool {
	nw, ok := errors.AsType[*policy.NoWorkerError](err)
	return ok && !nw.Kind().RouteRefused()
}

// waitingRoom holds a request whose selection found no ready worker for its model, when the
// model is one Baton knows and no_worker_wait is set: until a worker for it is ready (then true:
// select again), the wait passes, or the client leaves. baton_model_waiting_requests counts the
// requests held: what scales an engine up from zero.
func (d *Director) waitingRoom(ctx context.Context, model string, err error) bool {
	nw, ok := errors.AsType[*policy.NoWorkerError](err)
	if d.o.Admission.NoWorkerWait <= 0 || !ok || (nw.Kind() != policy.NoneAvailable && nw.Kind() != policy.ModelUnserved) || !d.metrics.Known(model) {
		return false // only a worker's coming can mend it: not a route refused, nor pairs that cannot meet
	}
	g := d.metrics.ModelWaiting.WithLabelValues(d.metrics.KnownLabel(model))
	g.Inc()
	defer g.Dec()
	deadline := time.NewTimer(d.o.Admission.NoWorkerWait)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-deadline.C:
			return false
		case <-tick.C:
			if d.readyFor(model) {
				return true
			}
		}
	}
}

// readyFor reports whether model has a ready worker of every role a request needs.
func (d *Director) readyFor(model string) bool {
	roles := []string{config.RoleRegular}
	if d.Disaggregated() {
		roles = []string{config.RolePrefill, config.RoleDecode}
	}
	snap := d.reg.Snapshot()
	for _, role := range roles {
		cands, _ := d.Candidates(snap, role, model)
		ready := false
		for _, w := range cands {
			ready = ready || w.Ready()
		}
		if !ready {
			return false
		}
	}
	return true
}

// selectSpan starts the selection's span when tracing; the returned func ends it with the
// choices made (policy, worker, reason) or the error.
func (d *Director) selectSpan(ctx context.Context) func(*policy.Request, error) {
	if !tracing.Enabled() {
		return func(*policy.Request, error) {}
	}
	_, span := tracing.Start(ctx, "select")
	return func(req *policy.Request, err error) {
		for i, dc := range req.Decisions {
			p := fmt.Sprintf("baton.select.%d.", i)
			span.SetAttributes(attribute.String(p+"role", dc.Role), attribute.String(p+"policy", dc.Policy),
				attribute.String(p+"worker", dc.Worker), attribute.String(p+"reason", dc.Reason), attribute.Float64(p+"load", dc.Load))
			if dc.Match >= 0 {
				span.SetAttributes(attribute.Float64(p+"cached_share", dc.Match))
			}
		}
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// SelectionError is the failure of a selection, the director's or one a door ran itself: 404
// for a model no worker serves, 501 for a route none of its workers serves, else 503 (retried:
// a worker may come back).
func SelectionError(err error) *outcome.Failure {
	kind, model := policy.NoneAvailable, ""
	if nw, ok := errors.AsType[*policy.NoWorkerError](err); ok {
		kind, model = nw.Kind(), nw.Model
	}
	switch kind {
	case policy.ModelUnserved:
		// The answer of a model nobody serves is the answer of a model the caller's tenant may
		// not use (a tenant cannot learn another's models), so it says what is true of both.
		return outcome.Answer(&openai.Error{Status: statusNotFound, Code: openai.CodeModelNotFound, Param: "model",
			Message: fmt.Sprintf("the model %q does not exist or you do not have access to it", model)})
	case policy.RouteSGLangOnly:
		return outcome.FinalAnswer(&openai.Error{Status: statusNotImplemented, Code: openai.CodeRouteNotServed, Message: err.Error()})
	case policy.RouteNotDisaggregated:
		return outcome.FinalAnswer(&openai.Error{Status: statusNotImplemented, Code: openai.CodeNotImplementedInPD, Message: err.Error()})
	}
	// A worker may be back within seconds (a circuit half-opens, a health check passes, an
	// engine restarts): the client is told when to try again, as for every other 503 of Baton's.
	f := outcome.Answer(&openai.Error{Status: statusUnavailable, Code: openai.CodeNoAvailableWorkers, RetryAfter: "1", Message: err.Error()})
	f.NoWorker = true
	return f
}

// contextPhrases are how the engines refuse a prompt longer than the model's context (400):
// vLLM ("This model's maximum context length is N tokens. However, …", "… is longer than the
// maximum model length …") and SGLang ("The input (N tokens) is longer than the model's context
// length (M tokens).", "Requested token count exceeds the model's maximum context length …").
var contextPhrases = []string{"maximum context length", "longer than the model's context length", "longer than the maximum model length"}

// contextOverflow reports whether err is an engine's refusal of a prompt too long for its model.
func contextOverflow(err error) bool {
	var f *outcome.Failure
	if !errors.As(err, &f) || f.Status != statusBadRequest {
		return false
	}
	text := string(f.Body)
	if f.Answer != nil {
		text += f.Answer.Message
	}
	text = strings.ToLower(text)
	for _, p := range contextPhrases {
		if strings.Contains(text, p) {
			return true
		}
	}
	return false
}

// ContextFallbacks runs attempt for the client's model, then — while the engine refuses the
// prompt as longer than the model's context — for each of its context_window_fallbacks in turn
// (a tenant's only where it may use them). attempt holds the refusal to be read only while a
// fallback is left (fallbackLeft); the last one reaches the client as the engine answered it.
func (d *Director) ContextFallbacks(rec *record.Record, client string, attempt func(name string, fallbackLeft bool) error) error {
	cw := d.contextWindowFallbacks(client)
	name := client
	for k := 0; ; k++ {
		for k < len(cw) && rec.Who != nil && !rec.Who.Allows(cw[k]) {
			k++
		}
		err := attempt(name, k < len(cw))
		if k >= len(cw) || !contextOverflow(err) {
			return err
		}
		d.fellBack(rec, client, cw[k])
		name = cw[k]
	}
}

// contextWindowFallbacks are the models client falls back to past its context window.
//
//go:noinline
func (d *Director) contextWindowFallbacks(client string) []string {
	models, _ := d.Models()
	return models[client].ContextWindowFallbacks
}

// fellBack counts a request for client going on to the fallback model to.
//
//go:noinline
func (d *Director) fellBack(rec *record.Record, client, to string) {
	d.metrics.ModelFallbacks.WithLabelValues(d.metrics.KnownLabel(d.ModelChain(client)[0]), d.metrics.KnownLabel(d.ModelChain(to)[0])).Inc()
	rec.NextAttempt()
}

// adapterReady loads the request's adapter (model) on ws where it is not loaded — the legs of a
// pair at once — and counts the request in flight on it until the returned func is called. A
// load that failed is a 503 adapter_load_failed naming the adapter, not retried elsewhere.
func (d *Director) adapterReady(ctx context.Context, model string, ws ...*worker.Worker) (func(), error) {
	m := d.o.Adapters
	// Counted in flight first: an adapter with a request in flight is never chosen to be
	// unloaded, so none is unloaded between its load and the request reaching the engine.
	ends := make([]func(), len(ws))
	for i, w := range ws {
		ends[i] = m.Begin(w, model)
	}
	end := func() {
		for _, e := range ends {
			e()
		}
	}
	errs := make([]error, len(ws))
	var wg sync.WaitGroup
	for i, w := range ws {
		wg.Go(func() { errs[i] = m.Ensure(ctx, w, model) })
	}
	wg.Wait()
	for _, err := range errs {
		if le, ok := errors.AsType[*lora.Error](err); ok {
			end()
			// A worker that lost its adapters (an engine restarted) may load it again within
			// seconds: the client is told when to try, as for Baton's other 503s.
			return nil, outcome.FinalAnswer(&openai.Error{Status: statusUnavailable, Code: openai.CodeAdapterLoadFailed, Param: "model", RetryAfter: "1", Message: le.Error()})
		}
		if err != nil {
			end()
			return nil, err // the client left, or the adapter was loaded elsewhere (lora.ErrReselect)
		}
	}
	return end, nil
}

// DeclaredAdapter reports whether the request's model is an adapter Baton declares (and so
// loads, and loads again when another replica unloaded it).
func (d *Director) DeclaredAdapter(sreq *policy.Request) bool {
	if sreq.AdapterBase == "" || d.o.Adapters == nil {
		return false
	}
	_, ok := d.o.Adapters.Loadable(sreq.Model)
	return ok
}

// MaxAdapterGone bounds how often a request is sent to a worker that then answered that its
// adapter is gone (another replica unloaded it between this one's load and the request).
const MaxAdapterGone = 6

// ReadyAgain readies model once more on ws after gone's engine refused a request because the
// adapter is not there (refused, its refusal): gone's models are read again and the adapter
// loaded where it is missing, ws being where the request is sent again. The returned func ends
// the request's count in flight; an error is the request's answer: refused itself (the engine's
// refusal, as it said it) when gone's models cannot be read again or another load keeps taking
// the adapter elsewhere, the load's failure (503 adapter_load_failed) when it cannot be loaded
// there.
func (d *Director) ReadyAgain(ctx context.Context, model string, gone *worker.Worker, refused error, ws ...*worker.Worker) (func(), error) {
	if d.o.Adapters.Relearn(ctx, gone) != nil {
		return nil, refused
	}
	again, err := d.adapterReady(ctx, model, ws...)
	if errors.Is(err, lora.ErrReselect) {
		// Loaded on another worker meanwhile; this request stays where it was sent.
		again, err = d.adapterReady(ctx, model, ws...)
	}
	if errors.Is(err, lora.ErrReselect) {
		return nil, refused
	}
	if err != nil {
		return nil, err
	}
	d.log.Info("adapter gone from its worker (another replica unloaded it): loaded again, request sent once more", "adapter", model, "worker", gone.URL)
	return again, nil
}

// AdapterGone reports whether err is an engine's refusal of an adapter it does not have (see
// GoneAnswer).
func AdapterGone(err error) bool {
	var f *outcome.Failure
	return errors.As(err, &f) && f.Answer == nil && GoneAnswer(f.Status, string(f.Body))
}

// GoneAnswer reports whether an engine's answer of status saying text refuses a request because
// its adapter is not loaded there: vLLM's 404 "The model `X` does not exist."
// (vllm/entrypoints/openai/serving_engine.py's model check), SGLang's 400 "The following
// requested LoRA adapters are not loaded: X" (python/sglang/srt/lora/lora_registry.py, acquire).
func GoneAnswer(status int, text string) bool {
	return status == statusNotFound && strings.Contains(text, "does not exist") ||
		status == statusBadRequest && strings.Contains(text, "requested LoRA adapters are not loaded")
}

// LegAdapterGone is the worker of pair whose engine refused a PD leg because the request's
// adapter is not there; nil for any other outcome.
func LegAdapterGone(err error, pair worker.Pair) *worker.Worker {
	var f *outcome.Failure
	if !errors.As(err, &f) || f.Leg == "" || f.Answer == nil || !GoneAnswer(f.Status, f.Answer.Message) {
		return nil
	}
	switch f.Worker {
	case pair.Prefill.URL:
		return pair.Prefill
	case pair.Decode.URL:
		return pair.Decode
	}
	return nil
}
