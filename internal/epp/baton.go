package epp

import (
	"cmp"
	"context"
	"errors"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/baton-llm/baton/internal/admit"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/tracing"
	"github.com/baton-llm/baton/internal/worker"
)

// Host is the gateway a picked request is counted in, as a proxied one is: in flight from its
// pick to its end, then reported (metrics, status page, span, access log).
type Host interface {
	Begin()
	Finish(ctx context.Context, rec *record.Record, written int64, status int, span trace.Span, aborted bool)
	// Go runs f in the background, waited for when the gateway stops.
	Go(f func())
}

// Options shape Baton's answers as an Endpoint Picker.
type Options struct {
	// Fallbacks is how many endpoints are named after the choice, in order, for the proxy to
	// retry down: the other available workers of the request's model, least loaded first.
	Fallbacks int
	// A batch-class request is shed (429) when every worker that could serve it is saturated:
	// its engine queues at least ShedQueueDepth requests, or uses at least ShedKVUsage of its
	// KV cache (0: that measure is not used).
	ShedQueueDepth float64
	ShedKVUsage    float64
}

// NewPicker returns Baton's routing as an Endpoint Picker: the director's model names,
// adapters, load and cache views, answering with endpoints instead of forwarding.
func NewPicker(d *director.Director, m *metrics.Metrics, h Host, o Options) Picker {
	return &picker{d: d, sel: d.Selector(), reg: d.Registry(), metrics: m, host: h, o: o}
}

type picker struct {
	d       *director.Director
	sel     *policy.Selector
	reg     *worker.Registry
	metrics *metrics.Metrics
	host    Host
	o       Options
}

// Pick chooses the endpoints of one request the proxy asks about. The request is Baton's from
// then on, as a proxied one is: counted in flight on the worker, in the metrics, the status
// page, the access log and a server span continuing the caller's trace, until Done.
func (p *picker) Pick(ctx context.Context, req *Request) (*Pick, error) {
	start := time.Now()
	if req.Path == "" || req.Path[0] != '/' {
		return nil, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidRequest, Message: "the request has no path"}
	}
	method := cmp.Or(req.Method, http.MethodGet)
	if _, err := url.ParseRequestURI(req.Path); err != nil || !validMethod(method) {
		return nil, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidRequest, Message: "the request's method or path is malformed"}
	}
	if req.Header == nil {
		req.Header = http.Header{}
	}
	rid := openai.RequestID(req.Header)
	var span trace.Span
	if tracing.Enabled() {
		ctx, span = tracing.StartServer(ctx, method, req.Path, req.Header)
	}
	rec := &record.Record{RequestID: rid, Mode: record.ModeRegular, Attempts: 1, Start: start, Route: "other",
		Method: method, Client: clientOf(req.Header.Get("x-forwarded-for"))}
	rt := routes.Of(req.Path)
	if rt.Path != "" {
		rec.Route = method + " " + rt.Path
	}
	p.host.Begin()
	refuse := func(e *openai.Error) (*Pick, error) {
		rec.Code = e.Code
		p.host.Finish(ctx, rec, 0, e.Status, span, false)
		return nil, e
	}

	var parsed *openai.Request
	model := ""
	if len(req.Body) > 0 || req.Body != nil && method == http.MethodPost && rt.Inference {
		var e *openai.Error
		if parsed, e = p.d.Classify(req.Body, req.Path); e != nil {
			return refuse(e)
		}
		model = parsed.Model
	}
	rec.Model, rec.ModelLabel = model, p.metrics.Model(model)
	class, e := director.PriorityClass(req.Header.Get(openai.HeaderPriority), req.Header.Get(openai.HeaderSmgPriority))
	if e != nil {
		return refuse(e)
	}
	rec.Class = record.Class(max(class, admit.Interactive).String()) // critical is a tenant's to give

	disagg := rt.PD && p.d.Disaggregated()
	role := config.RoleRegular
	if disagg {
		role, rec.Mode = config.RoleDecode, record.ModePD
	}
	plan := &director.Plan{Rec: rec, Role: role, Pair: disagg,
		Sel: &policy.Request{Model: model, Path: req.Path, Body: req.Body, Parsed: parsed, Explain: p.d.Explain()}}
	sreq := plan.Sel
	if req.HasSubset {
		if len(req.Subset) == 0 {
			return refuse(&openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeNoEndpointInSubset,
				Message: "the proxy's subset of endpoints for this request is empty"})
		}
		workers := p.reg.Snapshot().Workers
		sreq.Allow = subsetAllow(req.Subset, workers)
		if disagg && !slices.ContainsFunc(workers, func(w *worker.Worker) bool {
			return w.Role == config.RolePrefill && w.Available() && sreq.Allow(w)
		}) {
			// The hint names no prefill that could serve: a decode it names serves alone, as
			// llm-d's picker answers (no x-prefiller-host-port). The protocol's 503 is for a hint
			// of which no endpoint is eligible; an SGLang decode, which cannot serve without a
			// prefill's bootstrap, is not.
			inSubset := sreq.Allow
			plan.Pair, sreq.Allow = false, func(w *worker.Worker) bool { return inSubset(w) && w.Runtime() != config.RuntimeSGLang }
		}
	}
	if class == admit.Batch && p.saturated(role, model, sreq.Allow) {
		return refuse(&openai.Error{Status: http.StatusTooManyRequests, Code: openai.CodeRequestShed, RetryAfter: "1",
			Message: "every worker that could serve this batch request is saturated: it was shed; try again later"})
	}

	if !slices.ContainsFunc(p.reg.Snapshot().Workers, (*worker.Worker).Available) {
		// The protocol's 503 for no ready endpoint, whatever the model: a model no worker names
		// is 404 only while some worker is there to say so.
		return refuse(&openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeNoAvailableWorkers,
			Message: "no endpoint is ready (no worker registered, or all unhealthy, circuits open, draining)"})
	}
	c, err := p.d.Choose(ctx, plan, model, nil)
	if err != nil {
		if f, ok := errors.AsType[*outcome.Failure](err); ok && f.Answer != nil {
			e := *f.Answer
			if req.HasSubset && e.Code == openai.CodeNoAvailableWorkers {
				e.Code = openai.CodeNoEndpointInSubset
				e.Message = "no endpoint of the proxy's subset can serve this request: " + e.Message
			}
			return refuse(&e)
		}
		return refuse(&openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeNoAvailableWorkers, Message: err.Error()})
	}
	dest, prefill := c.Worker, c.Pair.Prefill

	list := append([]*worker.Worker{dest}, p.fallbacks(role, rec.Class, sreq, dest, prefill)...)
	pick := &Pick{Endpoints: make([]string, len(list))}
	for i, w := range list {
		pick.Endpoints[i] = w.Endpoint
	}
	switch {
	case prefill != nil:
		pick.Prefill = prefill.Endpoint
		rec.Prefill, rec.Decode = prefill.URL, dest.URL
	case disagg: // conditional disaggregation: the decode serves it alone, x-prefiller-host-port left out
		p.d.NoteLocalPrefill(plan, dest)
	}
	rec.Worker = dest.URL
	if parsed != nil {
		// The workers' name for the model: the default model, an alias's target, SGLang's
		// base:adapter; the fields Baton owns removed (Classify), and the engine's priority
		// written for a worker marked forward_priority (and, for a pair, its prefill alike).
		// Other bytes stay as the client sent them.
		out := director.WithPriority(director.ForWorkers(parsed.Body, req.Path, parsed.Model, rid, sreq, dest), rec.Class, c.Workers()...)
		if len(out) != len(req.Body) || len(out) > 0 && &out[0] != &req.Body[0] {
			pick.Body = out
		}
	}
	var mu sync.Mutex // Served and Done come from the stream's goroutine; the guard keeps them honest
	serving, probe := dest, dest.Enter()
	pick.Served = func(ep string) {
		mu.Lock()
		defer mu.Unlock()
		if ep == "" || ep == serving.Endpoint {
			return
		}
		for _, w := range list {
			if w.Endpoint == ep { // the proxy went down the list: the load is that worker's
				serving.Leave(probe)
				serving, probe = w, w.Enter()
				rec.Worker, rec.Attempts = w.URL, rec.Attempts+1
				if prefill != nil {
					rec.Decode = w.URL
				}
				p.metrics.EPPServedFallback.Inc()
				return
			}
		}
	}
	pick.Done = func(o Outcome) {
		mu.Lock()
		defer mu.Unlock()
		serving.Leave(probe)
		c.Release()
		status := o.Status
		if status == 0 {
			status = 499 // no response came back through the proxy
			rec.Code = "stream_ended"
		} else {
			serving.Record(status, nil)
		}
		if (status == http.StatusNotFound || status == http.StatusBadRequest) && p.d.DeclaredAdapter(sreq) {
			// The data plane forwards, so the picker cannot send this request again; the
			// engine's refusal may be its adapter gone (another replica unloaded it): the
			// worker's models are read again, so that the next request loads it again.
			w := serving
			p.host.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				_ = p.d.Adapters().Relearn(ctx, w)
			})
		}
		rec.FirstByte = o.FirstByte
		if o.UsageKnown {
			rec.Usage, rec.UsageKnown = o.Usage, true
		}
		p.host.Finish(ctx, rec, o.Bytes, status, span, o.Err != "" && o.Status != 0)
	}
	return pick, nil
}

// validMethod reports whether m is an HTTP token (RFC 9110's method syntax).
func validMethod(m string) bool {
	if m == "" || len(m) > 32 {
		return false
	}
	for i := 0; i < len(m); i++ {
		c := m[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// fallbacks are the endpoints after the choice: the other available workers of its role that
// serve the request's model and route (and, for a decode, can take the prefill's KV), least
// loaded first, at most Fallbacks.
func (p *picker) fallbacks(role string, class record.Class, sreq *policy.Request, chosen, prefill *worker.Worker) []*worker.Worker {
	if p.o.Fallbacks <= 0 {
		return nil
	}
	model := sreq.Model
	if sreq.AdapterBase != "" {
		model = sreq.AdapterBase // any worker of the base model can load the adapter
	}
	cands, _ := p.sel.Candidates(p.reg.Snapshot(), role, model)
	var out []*worker.Worker
	spelling := director.WorkerModel(sreq, chosen)
	cp, cmarked := chosen.EnginePriority(string(class))
	for _, w := range worker.Available(cands) {
		if w == chosen || !policy.Serves(w, sreq.Path) || sreq.Allow != nil && !sreq.Allow(w) {
			continue
		}
		// The body is written once, for the chosen worker: a fallback takes it as it is, so it
		// must spell the model alike (an SGLang adapter's base:adapter is not vLLM's name) and
		// read the priority Baton wrote alike.
		if director.WorkerModel(sreq, w) != spelling {
			continue
		}
		if wp, marked := w.EnginePriority(string(class)); marked != cmarked || marked && wp != cp {
			continue
		}
		if prefill != nil && p.sel.Compatible != nil && !p.sel.Compatible(prefill, w) {
			continue
		}
		if sreq.AdapterBase != "" && !w.Lists(sreq.Model) {
			continue // the adapter is loaded only where Baton chose: a fallback must have it
		}
		out = append(out, w)
	}
	slices.SortStableFunc(out, func(a, b *worker.Worker) int { return cmp.Compare(load(a), load(b)) })
	return out[:min(len(out), p.o.Fallbacks)]
}

// subsetAllow is the subset hint's filter: a worker whose ip:port the hint lists; when no worker
// matches any entry exactly, a worker whose IP it lists (the reference picker matches by IP: a
// data plane may list a pod's IP with another port, or none).
func subsetAllow(subset []string, workers []*worker.Worker) func(*worker.Worker) bool {
	exact := make(map[string]bool, len(subset))
	ips := make(map[string]bool, len(subset))
	for _, e := range subset {
		exact[e] = true
		if host, _, err := net.SplitHostPort(e); err == nil {
			ips[host] = true
		} else {
			ips[strings.Trim(e, "[]")] = true
		}
	}
	if slices.ContainsFunc(workers, func(w *worker.Worker) bool { return exact[w.Endpoint] }) {
		return func(w *worker.Worker) bool { return exact[w.Endpoint] }
	}
	return func(w *worker.Worker) bool {
		host, _, err := net.SplitHostPort(w.Endpoint)
		return err == nil && ips[host]
	}
}

// load is a worker's load for ordering fallbacks: Baton's requests in flight on it, or the
// engine's running and waiting requests when it reports more.
func load(w *worker.Worker) float64 {
	l := w.EngineLoad()
	return max(float64(w.InFlight()), l.Running+l.Waiting)
}

// saturated reports whether every available worker of role that could serve model (of those
// allow lets through) is saturated. A worker whose engine reports no load is not.
func (p *picker) saturated(role, model string, allow func(*worker.Worker) bool) bool {
	if p.o.ShedQueueDepth <= 0 && p.o.ShedKVUsage <= 0 {
		return false
	}
	cands, _ := p.sel.Candidates(p.reg.Snapshot(), role, model)
	seen := false
	for _, w := range worker.Available(cands) {
		if allow != nil && !allow(w) {
			continue
		}
		seen = true
		l := w.EngineLoad()
		full := p.o.ShedQueueDepth > 0 && l.HasWaiting && l.Waiting >= p.o.ShedQueueDepth ||
			p.o.ShedKVUsage > 0 && l.HasKV && l.KVUsage >= p.o.ShedKVUsage
		if !full {
			return false
		}
	}
	return seen
}

// clientOf is the client a gateway's X-Forwarded-For names last (the address it saw), bounded
// for the access log.
func clientOf(xff string) string {
	if i := strings.LastIndexByte(xff, ','); i >= 0 {
		xff = xff[i+1:]
	}
	xff = strings.TrimSpace(xff)
	if len(xff) > maxClientLen {
		xff = xff[:maxClientLen]
	}
	return xff
}

// maxClientLen bounds the client address in the access log.
const maxClientLen = 64
