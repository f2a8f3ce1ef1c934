// Package server holds Baton's HTTP front: routes, middleware (request id, request deadline,
// auth, metrics, panic recovery), bounded body reading, admission, the retry loop around
// selection and the executors, health and readiness.
package server

import (
	"context"
	"slices"

	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/admin"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/tracing"
)

// Options are a Server's settings, converted once from the configuration, and the parts it
// drives.
type Options struct {
	// Director is the middle of every request (its settings and parts: the registry, the
	// selection, the models, adapters, tenants, admission, retries), handed to it whole.
	Director director.Options
	// MaxPayloadSize bounds a request body, in bytes.
	MaxPayloadSize int64
	// MaxBufferedBodyBytes bounds the request body bytes held at once over every request (0: no
	// bound); BodyTimeout bounds how long a body may take to arrive (0: the request deadline).
	MaxBufferedBodyBytes int64
	BodyTimeout          time.Duration
	// RequestTimeout bounds one request from its arrival to its last byte.
	RequestTimeout time.Duration
	// StalledClientTimeout drops a client that sends or accepts no bytes for this long.
	StalledClientTimeout time.Duration
	// PrefillerHeader lets a PD request's x-prefiller-host-port name its prefill worker; a request
	// without it goes to a decode worker alone unless PrefillerAbsentPicks (then Baton picks a
	// prefill itself).
	PrefillerHeader      bool
	PrefillerAbsentPicks bool
	// Admin is the admin API (the worker routes, GET /workers and /tenants).
	Admin admin.Options
	// AccessLog writes one info line per request (never bodies or keys).
	AccessLog bool
	// Version is shown on the status page.
	Version string
	// Notices, when set, are shown at the top of the status page: conditions an operator must
	// see (an API server discovery lost).
	Notices func() []Notice

	Proxy      *proxy.Proxy
	Dispatcher pd.Executor // runs PD requests; nil without PD
}

// Server is Baton's API server.
type Server struct {
	opts     Options
	d        *director.Director
	admin    *admin.API
	proxy    *proxy.Proxy
	pd       pd.Executor
	metrics  *metrics.Metrics
	log      *slog.Logger
	draining atomic.Bool
	status   *recorder    // recent traffic, for the status page
	inflight atomic.Int64 // client requests being served (streams included)
	uploads  uploads      // request bodies being read
	bodies   bodyBudget   // request body bytes held
	bg       sync.WaitGroup
	// tenantCounters keeps the tenant metrics' series by tenant, model and status.
	tenantCounters counterCache
}

// New returns a server with o.
func New(o Options) *Server {
	d := director.New(o.Director)
	return &Server{opts: o, d: d, admin: admin.New(o.Admin, d), proxy: o.Proxy, pd: o.Dispatcher, metrics: o.Director.Metrics, log: d.Log(),
		status: &recorder{}, bodies: bodyBudget{limit: o.MaxBufferedBodyBytes}}
}

// Handler returns the API handler with its middleware.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	for _, route := range s.d.Routes() {
		h := http.HandlerFunc(s.serveInference)
		if route.PD {
			h = s.servePD
		}
		mux.Handle("POST "+route.Path, s.authed(h))
	}
	if s.d.PD() {
		mux.Handle("GET /health_generate", s.authed(s.admitted(http.HandlerFunc(s.serveHealthGenerate))))
		mux.Handle("GET /get_server_info", s.authed(http.HandlerFunc(s.servePrefillInfo)))
		mux.Handle("GET /get_model_info", s.authed(http.HandlerFunc(s.servePrefillInfo)))
	}
	mux.Handle("GET /v1/models", s.authed(http.HandlerFunc(s.serveModels)))
	if s.opts.Admin.Separate {
		mux.Handle("GET /workers", s.admin.APIWorkers(s.authed))
	} else {
		s.admin.Routes(mux, false, s.authed)
	}
	mux.HandleFunc("GET /health", s.serveLiveness)
	mux.HandleFunc("GET /liveness", s.serveLiveness)
	mux.HandleFunc("GET /readiness", s.serveReadiness)
	mux.Handle("/", NoRoute())
	return s.observe(mux)
}

// noRoute says which request no route serves, quoting at most a few hundred bytes of its
// method and path: both are the client's, of any length its headers allow.
func noRoute(r *http.Request) string {
	return fmt.Sprintf("no route for %s %s", openai.Clip(r.Method, 32), openai.Clip(r.URL.Path, 256))
}

// SetDraining marks the server as shutting down: readiness answers 503 from now on.
func (s *Server) SetDraining() {
	s.draining.Store(true)
	s.uploads.cut()
	s.d.Drain()
}

// InFlight returns the number of client requests being served.
func (s *Server) InFlight() int64 { return s.inflight.Load() }

// statusWriter records the status written and the first byte's time, renders Baton's response
// headers from the request's record as the head goes out, and keeps the connection's write
// deadline armed: a client that accepts no bytes for the stalled-client timeout, or is still
// being written to at the request deadline, is dropped instead of pinning its handler. Unwrap
// keeps http.ResponseController working.
type statusWriter struct {
	http.ResponseWriter
	status int
	rec    *record.Record // the request's record: the head's headers, the histogram's labels

	lastWrite time.Time
	itl       prometheus.Observer // a stream's inter-token histogram, resolved at its first byte
	metrics   *metrics.Metrics
	written   int64 // body bytes written to the client
	gone      bool  // a write to the client failed: it left, or stalled past its deadline

	rc       *http.ResponseController
	body     stallReader   // the request body's reader, kept here to save an allocation
	stall    time.Duration // the stalled-client timeout
	deadline time.Time     // the request deadline plus writeGrace
	armed    time.Time     // when the write deadline was last moved

	span   trace.Span         // the request's server span (nil without tracing)
	cancel context.CancelFunc // ends the request's context
}

// writeGrace is how long after the request deadline writes to the client may still go on: the
// 504 that answers a timed-out request must be able to leave.
const writeGrace = 2 * time.Second

// arm moves the write deadline to min(now+stall, request deadline+writeGrace) unless it was moved less
// than stall/8 ago: the deadline stays at least 7/8 of stall ahead of every write, at the cost
// of a clock read per write.
func (w *statusWriter) arm(now time.Time) {
	if now.Sub(w.armed) < w.stall/8 {
		return
	}
	w.armed = now
	_ = w.rc.SetWriteDeadline(earlier(now.Add(w.stall), w.deadline))
}

// observed returns the observing middleware's writer under w, or nil.
func observed(w http.ResponseWriter) *statusWriter {
	for {
		switch sw := w.(type) {
		case *statusWriter:
			return sw
		case interface{ Unwrap() http.ResponseWriter }:
			w = sw.Unwrap()
		default:
			return nil
		}
	}
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.head(code)
	}
	w.ResponseWriter.WriteHeader(code)
}

// head renders the record's part of the response head, once, as it goes out: which worker or
// pair answered, the KV handoff and (when asked for) the routing decisions.
func (w *statusWriter) head(code int) {
	w.status = code
	if w.rec.LocalPrefill && code != http.StatusOK {
		// A request a worker was to serve alone by design that failed says so, as a pair's
		// failure does: nothing was served alone.
		w.rec.Handoff = pd.HandoffNoneFailed
	}
	renderHead(w.Header(), w.rec)
}

// NoteErrorCode keeps the code of an error answer Baton writes (openai.WriteError) on the record.
func (w *statusWriter) NoteErrorCode(code string) {
	if w.rec.Code == "" {
		w.rec.Code = code
	}
}

// renderHead sets Baton's headers on h from rec.
func renderHead(h http.Header, rec *record.Record) {
	var vals []string // one backing array for the values (each capped at its one element)
	set := func(k, v string) {
		if v != "" {
			if vals == nil {
				vals = make([]string, 0, 6)
			}
			vals = append(vals, v)
			h[k] = vals[len(vals)-1 : len(vals) : len(vals)]
		}
	}
	if rec.Prefill != "" {
		set(openai.HeaderPrefillWorker, rec.Prefill)
		set(openai.HeaderDecodeWorker, rec.Decode)
	}
	set(openai.HeaderWorker, rec.Worker)
	set(openai.HeaderModel, rec.Served)
	set(openai.HeaderKVHandoff, string(rec.Handoff))
	set(openai.HeaderRoute, rec.Decisions)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.head(http.StatusOK)
	}
	now := time.Now()
	w.arm(now)
	if w.rec.FirstByte.IsZero() {
		w.rec.FirstByte = now
		// A stream's gaps between writes are its inter-token latency.
		if w.status == http.StatusOK && w.metrics != nil && openai.IsEventStream(w.Header().Get("Content-Type")) {
			w.itl = w.metrics.InterToken.WithLabelValues(w.metrics.Model(w.rec.Model), string(w.rec.Mode))
		}
	} else if w.itl != nil {
		w.itl.Observe(now.Sub(w.lastWrite).Seconds())
	}
	w.lastWrite = now
	n, err := w.ResponseWriter.Write(b)
	w.written += int64(n)
	w.gone = w.gone || err != nil
	return n, err
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// observe is the outer middleware: request id, the request deadline (on the context and on
// writes to the client), in-flight count, metrics and the access log. It records requests that
// end in an aborted connection too, then lets the abort through. A panic anywhere below fails
// the request with 500 (or aborts it after the first byte) and is logged and counted; the
// process lives on.
func (s *Server) observe(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sw, r := s.begin(w, r)
		defer func() { s.end(sw, r, recover()) }()
		next.ServeHTTP(sw, r)
	})
}

// begin starts observing a request: its id, span, deadline and record, and the writer that
// watches its answer. (Apart from observe's handler, with end, so that a stream waits under a
// small frame.)
//
//go:noinline
func (s *Server) begin(w http.ResponseWriter, r *http.Request) (*statusWriter, *http.Request) {
	start := time.Now()
	rid := openai.RequestID(r.Header)
	w.Header().Set(openai.HeaderRequestID, rid)
	var span trace.Span
	if tracing.Enabled() {
		var tctx context.Context
		tctx, span = tracing.StartServer(r.Context(), r.Method, r.URL.Path, r.Header)
		r = r.WithContext(tctx)
	}
	timeout := s.opts.RequestTimeout
	ctx, cancel := context.WithDeadlineCause(r.Context(), start.Add(timeout), outcome.ErrRequestTimeout)
	rec := &record.Record{RequestID: rid, Mode: record.ModeRegular, Attempts: 1, Start: start, Method: r.Method, Client: r.RemoteAddr}
	r = r.WithContext(record.With(ctx, rec))
	sw := &statusWriter{ResponseWriter: w, rc: http.NewResponseController(w), stall: s.opts.StalledClientTimeout, deadline: start.Add(timeout + writeGrace),
		rec: rec, metrics: s.metrics, span: span, cancel: cancel}
	sw.arm(start)
	s.inflight.Add(1)
	return sw, r
}

// end ends observing a request, given what recover returned in observe's handler.
//
//go:noinline
func (s *Server) end(sw *statusWriter, r *http.Request, v any) {
	defer sw.cancel()
	if v != nil && v != http.ErrAbortHandler {
		s.proxy.Recovered("handler", v)
		if sw.status == 0 {
			openai.WriteError(sw, proxy.InternalError())
		} else {
			v = http.ErrAbortHandler // a part of the answer went out: break it visibly
		}
	}
	s.inflight.Add(-1)
	status := sw.status
	if r.Context().Err() != nil && status == 0 {
		status = 499 // client closed the request
	}
	rec := sw.rec
	rec.Route = r.Pattern
	if rec.Route == "" || rec.Route == "/" {
		rec.Route = "other"
	}
	// The answer reached its client whole only if every write did and the client did not leave
	// (nor the deadline pass) before the handler returned.
	cut := sw.gone || r.Context().Err() != nil
	s.finish(r.Context(), rec, sw.written, status, sw.span, v == http.ErrAbortHandler, cut)
	if v == http.ErrAbortHandler {
		panic(v)
	}
}

// finish records what a request's answer says once it ended, from its record and the body
// bytes written: its count and duration, TTFT and tokens of a successful generation, the PD
// pair's handoff, the status page, the server span and the access log line. aborted: Baton cut
// the answer after its head; cut: it did not reach the client whole (the client left).
func (s *Server) finish(ctx context.Context, rec *record.Record, written int64, status int, span trace.Span, aborted, cut bool) {
	model := rec.ModelLabel
	if model == "" {
		model = s.metrics.Model(rec.Model)
	}
	e := ended{rec: rec, model: model, status: status, dur: time.Since(rec.Start), bytes: written, aborted: aborted}
	s.metrics.ObserveRequest(rec.Route, e.model, status, e.dur.Seconds())
	generation := rec.Method == http.MethodPost && rec.Route != "other" && !strings.HasPrefix(rec.Route, "POST /workers")
	if generation && status == http.StatusOK && !rec.FirstByte.IsZero() {
		e.ttft = rec.FirstByte.Sub(rec.Start)
		s.metrics.ObserveTTFT(e.model, string(rec.Mode), e.ttft.Seconds())
		if e.usage = rec.UsageKnown; e.usage && !aborted {
			s.metrics.AddTokens(e.model, rec.Usage.Prompt, rec.Usage.Completion, rec.Usage.Cached)
		}
	}
	if rec.TenantName() != "" && generation {
		c := s.tenantCounters.get(s.metrics, rec.TenantName(), e.model, status)
		c.requests.Inc()
		if rec.UsageKnown && !rec.Reserved { // a reserved request's charge is counted as it is settled
			c.prompt.Add(float64(rec.Usage.Prompt))
			c.completion.Add(float64(rec.Usage.Completion))
			if rec.Usage.Cached > 0 {
				c.cached.Add(float64(rec.Usage.Cached))
			}
		}
	}
	if rec.Prefill != "" && rec.Decode != "" && rec.Handoff != "" {
		s.metrics.PairHandoffs.WithLabelValues(rec.Prefill, rec.Decode, string(rec.Handoff)).Inc()
	}
	s.d.PDEnded(rec, status == http.StatusOK && !aborted && !cut, e.usage && !aborted, e.ttft, e.dur)
	if rec.Route != "other" {
		s.status.record(rec.Start.Add(e.dur), rec.Route, e.model, status, rec.Code, errorWorker(rec), e.ttft, aborted)
	}
	if span != nil {
		endSpan(span, e)
	}
	if s.opts.AccessLog && s.log.Enabled(ctx, slog.LevelInfo) {
		s.accessLog(ctx, e)
	}
}

// ended is what finish reports of a request: its record and what the writer and the clock saw.
type ended struct {
	rec     *record.Record
	model   string // the model's metric label
	status  int
	dur     time.Duration
	ttft    time.Duration // zero: not a successful generation
	bytes   int64         // body bytes written to the client
	usage   bool          // the record's usage is known and reported
	aborted bool
}

// endSpan names the server span after the route and ends it with what the request did.
func endSpan(span trace.Span, e ended) {
	rec := e.rec
	span.SetName(rec.Route)
	span.SetAttributes(attribute.String("http.route", rec.Route), attribute.Int("http.response.status_code", e.status),
		attribute.String("gen_ai.request.model", e.model), attribute.String("baton.request_id", rec.RequestID), attribute.Int("baton.attempts", rec.Attempts),
		attribute.String("baton.mode", string(rec.Mode)), attribute.Int64("http.response.body.size", e.bytes), attribute.String("baton.tenant", rec.TenantName()),
		attribute.String("baton.priority", string(rec.Class)), attribute.Float64("baton.queue_wait_ms", float64(rec.QueueWait)/1e6))
	if rec.Worker != "" && rec.Prefill == "" {
		span.SetAttributes(attribute.String("baton.worker", rec.Worker))
	}
	if rec.Prefill != "" {
		span.SetAttributes(attribute.String("baton.prefill_worker", rec.Prefill), attribute.String("baton.decode_worker", rec.Decode))
	}
	if rec.Handoff != "" {
		span.SetAttributes(attribute.String("baton.pd.handoff", string(rec.Handoff)))
	}
	if e.ttft > 0 {
		span.SetAttributes(attribute.Float64("baton.ttft_ms", float64(e.ttft)/1e6))
	}
	if e.usage {
		span.SetAttributes(attribute.Int("gen_ai.usage.input_tokens", rec.Usage.Prompt), attribute.Int("gen_ai.usage.output_tokens", rec.Usage.Completion))
	}
	if e.status >= 500 || e.aborted {
		span.SetStatus(codes.Error, rec.Code)
	}
	span.End()
}

// errorWorker is the worker a request's error names on the status page: a PD leg's error code
// (prefill_*, decode_*) names that leg's worker, another PD error the pair.
func errorWorker(rec *record.Record) string {
	switch {
	case rec.Prefill == "":
		return rec.Worker
	case strings.HasPrefix(rec.Code, pd.LegPrefill+"_"):
		return rec.Prefill
	case strings.HasPrefix(rec.Code, pd.LegDecode+"_"):
		return rec.Decode
	}
	return rec.Prefill + " → " + rec.Decode
}

// accessLog writes the request's access log line (never a body or a key).
func (s *Server) accessLog(ctx context.Context, e ended) {
	rec := e.rec
	var buf [24]slog.Attr
	route := rec.Route // "POST /v1/completions": the method is its own field
	if _, path, ok := strings.Cut(route, " "); ok {
		route = path
	}
	attrs := append(buf[:0], slog.String("method", openai.Clip(rec.Method, 32)), slog.String("route", route), slog.String("client", rec.Client),
		slog.String("model", e.model), slog.Int("status", e.status),
		slog.String("request_id", rec.RequestID), slog.Float64("duration_ms", float64(e.dur)/1e6), slog.Int("attempts", rec.Attempts), slog.Int64("bytes", e.bytes))
	if rec.TenantName() != "" {
		attrs = append(attrs, slog.String("tenant", rec.TenantName()))
	}
	if rec.Class != "" {
		attrs = append(attrs, slog.String("class", string(rec.Class)))
	}
	if rec.QueueWait > 0 {
		attrs = append(attrs, slog.Float64("queue_wait_ms", float64(rec.QueueWait)/1e6))
	}
	if rec.Prefill != "" {
		attrs = append(attrs, slog.String("prefill", rec.Prefill), slog.String("decode", rec.Decode))
	} else if rec.Worker != "" {
		attrs = append(attrs, slog.String("worker", rec.Worker))
	}
	if rec.Handoff != "" {
		attrs = append(attrs, slog.String("handoff", string(rec.Handoff)))
	}
	if e.ttft > 0 {
		attrs = append(attrs, slog.Float64("ttft_ms", float64(e.ttft)/1e6))
	}
	if e.usage {
		attrs = append(attrs, slog.Int("prompt_tokens", rec.Usage.Prompt), slog.Int("completion_tokens", rec.Usage.Completion), slog.Int("cached_tokens", rec.Usage.Cached))
	}
	if rec.Code != "" {
		attrs = append(attrs, slog.String("error", rec.Code))
	}
	if e.aborted {
		attrs = append(attrs, slog.Bool("aborted", true))
	}
	if tid := tracing.TraceID(ctx); tid != "" {
		attrs = append(attrs, slog.String("trace_id", tid))
	}
	s.log.LogAttrs(ctx, slog.LevelInfo, "request", attrs...)
}

// authed names the request's tenant from its key (identify), or answers it.
func (s *Server) authed(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.identify(w, r) {
			next.ServeHTTP(w, r)
		}
	})
}

func tooLarge(limit int64) *openai.Error {
	return &openai.Error{Status: http.StatusRequestEntityTooLarge, Code: openai.CodePayloadTooLarge,
		Message: fmt.Sprintf("request body exceeds the limit of %d bytes", limit)}
}

// readRequest reads and parses the body of an inference request, answering bad input itself.
// The body's bytes stay held (the process-wide body budget) until release is called, once the
// request ended.
func (s *Server) readRequest(w http.ResponseWriter, r *http.Request, rec *record.Record) (req *openai.Request, release func()) {
	body, release, oerr := s.readBody(w, r)
	if oerr != nil {
		openai.WriteError(w, oerr)
		return nil, release
	}
	req, e := s.d.Classify(body, r.URL.Path)
	if e != nil {
		openai.WriteError(w, e)
		return nil, release
	}
	rec.Model, rec.Stream = req.Model, req.Stream
	return req, release
}

// recordOf is the record the observing middleware put on the request's context: the one place
// the HTTP door reads it from there; everything below is handed it.
func recordOf(r *http.Request) *record.Record { return record.From(r.Context()) }

// serveInference forwards an inference request to one regular worker serving its model.
func (s *Server) serveInference(w http.ResponseWriter, r *http.Request) {
	a := s.admitRegular(w, r)
	defer a.end()
	if a.plan != nil {
		s.serveOne(w, r, a.req, a.plan, a.adm.Orders)
	}
}

// admittedRegular is a regular request read, admitted and planned (plan nil: answered already).
type admittedRegular struct {
	req     *openai.Request
	plan    *director.Plan
	adm     *director.Admitted
	release func()
}

func (a *admittedRegular) end() {
	if a.adm != nil {
		a.adm.End()
	}
	a.release()
}

// admitRegular reads, admits and plans a regular inference request, answering it itself when
// it goes no further. (Apart from serveInference, so that a stream waits under a small frame.)
//
//go:noinline
func (s *Server) admitRegular(w http.ResponseWriter, r *http.Request) *admittedRegular {
	rec := recordOf(r)
	a := &admittedRegular{}
	a.req, a.release = s.readRequest(w, r, rec)
	if a.req == nil {
		return a
	}
	preq := &pd.Request{Request: a.req, Path: r.URL.Path, Rec: rec}
	adm, ok := s.admitRequest(w, r, rec, preq)
	a.adm = adm
	if !ok {
		return a
	}
	if s.d.Disaggregated() {
		openai.WriteError(w, &openai.Error{Status: http.StatusNotImplemented, Code: openai.CodeNotImplementedInPD,
			Message: fmt.Sprintf("%s is not served through prefill/decode; add regular workers to serve it", r.URL.Path)})
		return a
	}
	a.plan = s.d.PlanRegular(rec, a.req, r.URL.Path)
	return a
}

// serveOne serves a request on one worker of the plan's role, chosen (and chosen again on a
// retry or a fallback model) by the request's policy.
func (s *Server) serveOne(w http.ResponseWriter, r *http.Request, req *openai.Request, p *director.Plan, orders proxy.Orders) {
	client, rec, sreq := req.Model, p.Rec, p.Sel
	s.withRetries(w, r, rec, func(r *http.Request, avoid map[string]bool) error {
		return s.d.ContextFallbacks(rec, client, func(name string, fallbackLeft bool) error {
			c, call, err := s.callOne(r, req, p, name, avoid, fallbackLeft, orders)
			if err != nil {
				return err
			}
			defer c.Release()
			if !s.d.DeclaredAdapter(sreq) {
				return s.proxy.Forward(w, r, c.Worker, call)
			}
			return s.forwardAdapter(w, r, c, sreq.Model, call)
		})
	})
}

// callOne chooses the worker of one attempt of serveOne, and the call to send it.
//
//go:noinline
func (s *Server) callOne(r *http.Request, req *openai.Request, p *director.Plan, name string, avoid map[string]bool, fallbackLeft bool, orders proxy.Orders) (director.Choice, *proxy.Call, error) {
	c, err := s.d.Choose(r.Context(), p, name, avoid)
	if err != nil {
		return c, nil, err
	}
	wk, rec, sreq := c.Worker, p.Rec, p.Sel
	p.NoteWorker(wk)
	call := &proxy.Call{Path: r.URL.Path, Body: director.WithPriority(director.ForWorkers(req.Body, r.URL.Path, req.Model, r.Header.Get(openai.HeaderRequestID), sreq, wk), rec.Class, wk),
		Rec: rec, Orders: orders, Stream: req.Stream}
	if fallbackLeft {
		call.Hold = []int{http.StatusBadRequest} // a context overflow goes to the fallback
	}
	return c, call, nil
}

// forwardAdapter forwards a request for a declared adapter. An adapter another replica unloaded
// since this one chose: the engine's refusal is held, the adapter loaded again on the same
// worker, and the request sent once more — a bounded number of times; the last refusal reaches
// the client as the engine said it.
//
//go:noinline
func (s *Server) forwardAdapter(w http.ResponseWriter, r *http.Request, c director.Choice, adapter string, call *proxy.Call) error {
	wk, hold := c.Worker, call.Hold
	for try := 1; ; try++ {
		call.Hold = hold
		if try < director.MaxAdapterGone {
			call.Hold = append(slices.Clip(hold), http.StatusNotFound, http.StatusBadRequest)
		}
		err := s.proxy.Forward(w, r, wk, call)
		if try >= director.MaxAdapterGone || !director.AdapterGone(err) {
			return err
		}
		again, rerr := s.d.ReadyAgain(r.Context(), adapter, wk, err, wk)
		if rerr != nil {
			return rerr
		}
		defer again()
	}
}

func (s *Server) serveLiveness(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = io.WriteString(w, "ok\n")
}

// serveReadiness answers 200 while a routable worker exists and the server is not draining.
// serveReadiness answers 200 when every model the workers name can be served — a ready worker
// of it, or in PD a ready prefill and a ready decode of it that can hand KV to each other —
// and 503 naming, per model, what is missing (or that the server is draining).
//
// The probe needs no key; where the fleet is private (there are tenants, each seeing only its
// models) it names no model unless asked with the admin key: the count of models, and of those
// it cannot serve.
func (s *Server) serveReadiness(w http.ResponseWriter, r *http.Request) {
	if s.draining.Load() {
		openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeDraining, Message: "shutting down"})
		return
	}
	models, missing := s.d.Readiness()
	private := s.admin.FleetPrivate() && !s.admin.KeyOK(r)
	if !director.Servable(models, missing) {
		msg := "not ready: " + strings.Join(missing, "; ")
		if private {
			msg = fmt.Sprintf("not ready: %d of %d models cannot be served now (the admin key shows which)", len(missing), max(1, len(models)))
		}
		openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeNoAvailableWorkers, Message: msg})
		return
	}
	var listed any = models
	if private {
		listed = len(models)
	}
	answer := map[string]any{"status": "ready", "models": listed}
	if len(missing) > 0 { // ready while any model can be served: those that cannot are said
		answer["unservable"] = map[bool]any{true: len(missing), false: missing}[private]
	}
	// Workers that have not registered are said, with why: by URL with the admin key, or where
	// no client needs a key (anyone may read GET /workers there), else by cause only.
	if named, byCause := s.d.Unregistered(); len(named) > 0 {
		if s.admin.KeyOK(r) || !private && s.d.Tenants().Open() {
			answer["unregistered"] = named
		} else {
			answer["unregistered"] = byCause
		}
	}
	body := openai.MarshalJSON(answer)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(body)
}

// Ready reports what /readiness answers: true when not draining and any model the workers or
// the configuration name can be served; else why not.
func (s *Server) Ready() (bool, string) {
	if s.draining.Load() {
		return false, "shutting down"
	}
	if models, missing := s.d.Readiness(); !director.Servable(models, missing) {
		return false, strings.Join(missing, "; ")
	}
	return true, ""
}
