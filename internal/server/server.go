// Package server holds Baton's HTTP front: routes, middleware (request id, request deadline,
// auth, metrics, panic recovery), bounded body reading, admission, the retry loop around
// selection and the executors, health and readiness.
package server

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"slices"

	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/admit"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/lora"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/retry"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/tenant"
	"github.com/baton-llm/baton/internal/tracing"
	"github.com/baton-llm/baton/internal/worker"
)

// Options are a Server's settings, converted once from the configuration, and the parts it
// drives.
type Options struct {
	// PD sends the generation routes through a prefill/decode pair (Dispatcher).
	PD bool
	// APIKey, when set, is required as "Authorization: Bearer <key>" on API routes: tenant
	// default's key, when Tenancy is not given.
	APIKey string
	// Tenancy is who may call and how much; zero: APIKey's tenant alone, unlimited.
	Tenancy Tenancy
	// NoWorkerWait holds a request for a known model without a ready worker this long for one
	// (the waiting room); 0: refused at once.
	NoWorkerWait time.Duration
	// Models returns the names clients use (aliases, fallbacks) and the model of a request
	// naming none, now (a reload swaps them); nil: none.
	Models func() (map[string]config.ModelConfig, string)
	// Adapters, when set, loads a declared LoRA adapter on the chosen workers before a request
	// for it is sent, and counts its requests in flight (for least-recently-used unloading).
	Adapters *lora.Manager
	// MaxPayloadSize bounds a request body, in bytes.
	MaxPayloadSize int64
	// MaxBufferedBodyBytes bounds the request body bytes held at once over every request (0: no
	// bound); BodyTimeout bounds how long a body may take to arrive (0: the request deadline).
	MaxBufferedBodyBytes int64
	BodyTimeout          time.Duration
	// MaxBatchSize bounds "n" and the prompts of one request.
	MaxBatchSize int
	// RequestTimeout bounds one request from its arrival to its last byte.
	RequestTimeout time.Duration
	// StalledClientTimeout drops a client that sends or accepts no bytes for this long.
	StalledClientTimeout time.Duration
	// Retry is how failed attempts are retried.
	Retry Retry
	// Admission bounds the inference requests served at once.
	Admission Admission
	// KVConnector is the connector of vLLM prefill workers that configure none (GET /workers).
	KVConnector string
	// RouteHeader adds X-Baton-Route: why each worker was chosen.
	RouteHeader bool
	// PrefillerHeader lets a PD request's x-prefiller-host-port name its prefill worker; a request
	// without it goes to a decode worker alone unless PrefillerAbsentPicks (then Baton picks a
	// prefill itself).
	PrefillerHeader      bool
	PrefillerAbsentPicks bool
	// KVEventsView, when set, gives a worker's KV event subscription for GET /workers (nil:
	// not subscribed).
	KVEventsView func(*worker.Worker) any
	// Admin is the admin API (the worker routes).
	Admin Admin
	// AccessLog writes one info line per request (never bodies or keys).
	AccessLog bool
	// Version is shown on the status page.
	Version string
	// Notices, when set, are shown at the top of the status page: conditions an operator must
	// see (an API server discovery lost).
	Notices func() []Notice

	Registry   *worker.Registry
	Selector   *policy.Selector
	Proxy      *proxy.Proxy
	Dispatcher pd.Executor // runs PD requests; nil without PD
	Metrics    *metrics.Metrics
	Log        *slog.Logger
}

// Retry is how a failed attempt is retried.
type Retry struct {
	Attempts int // in total, the first included; 1 disables retries
	Backoff  retry.Backoff
}

// Admission bounds the inference requests served at once: Max at once (0 or less: no bound),
// QueueSize more waiting per priority class at most QueueTimeout each (Depth and Timeout override
// them per class); Reserved slots are kept for a class and those above it; a request waiting
// PromoteAfter moves up a class; InputWeight and OutputWeight weigh tokens in tenants' shares.
type Admission struct {
	Max, QueueSize            int
	QueueTimeout              time.Duration
	Reserved                  [admit.NumClasses]int
	Depth                     [admit.NumClasses]*int
	Timeout                   [admit.NumClasses]time.Duration
	PromoteAfter              time.Duration
	Promote                   [admit.NumClasses]time.Duration // per class, over PromoteAfter
	InputWeight, OutputWeight float64
	// SmgAnswers answers a full queue 429 and a wait past its timeout 408, as smg's priority
	// scheduler does; false: 503 and 504.
	SmgAnswers bool
}

// Server is Baton's API server.
type Server struct {
	opts     Options
	reg      *worker.Registry
	sel      *policy.Selector
	proxy    *proxy.Proxy
	pd       pd.Executor
	metrics  *metrics.Metrics
	log      *slog.Logger
	admit    *admission
	draining atomic.Bool
	status   *recorder    // recent traffic, for the status page
	inflight atomic.Int64 // client requests being served (streams included)
	uploads  uploads      // request bodies being read
	bodies   bodyBudget   // request body bytes held
	bg       sync.WaitGroup
	settling sync.WaitGroup // tenants' settlements waiting on a worker's count of a prompt
	// tenantCounters keeps the tenant metrics' series by tenant, model and status.
	tenantCounters counterCache
}

// New returns a server with o.
func New(o Options) *Server {
	if o.Tenancy.Set == nil {
		o.Tenancy = defaultTenancy(o.APIKey)
	}
	if o.Tenancy.Limiter == nil {
		o.Tenancy.Limiter = tenant.NewLimiter(o.Log)
	}
	a := o.Admission
	return &Server{opts: o, reg: o.Registry, sel: o.Selector, proxy: o.Proxy, pd: o.Dispatcher, metrics: o.Metrics, log: o.Log,
		admit: newAdmission(a, o.Metrics), status: &recorder{}, bodies: bodyBudget{limit: o.MaxBufferedBodyBytes}}
}

// Handler returns the API handler with its middleware.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	for _, route := range routes.Inference() {
		h := http.HandlerFunc(s.serveInference)
		if s.opts.PD && route.PD {
			h = s.servePD
		}
		mux.Handle("POST "+route.Path, s.authed(h))
	}
	if s.opts.PD {
		mux.Handle("GET /health_generate", s.authed(s.admit.wrap(http.HandlerFunc(s.serveHealthGenerate))))
		mux.Handle("GET /get_server_info", s.authed(http.HandlerFunc(s.servePrefillInfo)))
		mux.Handle("GET /get_model_info", s.authed(http.HandlerFunc(s.servePrefillInfo)))
	}
	mux.Handle("GET /v1/models", s.authed(http.HandlerFunc(s.serveModels)))
	if s.opts.Admin.Separate {
		mux.Handle("GET /workers", s.apiWorkers())
	} else {
		s.adminRoutes(mux, false)
	}
	mux.HandleFunc("GET /health", s.serveLiveness)
	mux.HandleFunc("GET /liveness", s.serveLiveness)
	mux.HandleFunc("GET /readiness", s.serveReadiness)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		openai.WriteError(w, &openai.Error{Status: http.StatusNotFound, Code: openai.CodeNotFound,
			Message: noRoute(r)})
	})
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
	s.admit.drain()
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

	rc       *http.ResponseController
	body     stallReader   // the request body's reader, kept here to save an allocation
	stall    time.Duration // the stalled-client timeout
	deadline time.Time     // the request deadline plus writeGrace
	armed    time.Time     // when the write deadline was last moved
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
	set := func(k, v string) {
		if v != "" {
			h[k] = []string{v}
		}
	}
	if rec.Prefill != "" {
		set(openai.HeaderPrefillWorker, rec.Prefill)
		set(openai.HeaderDecodeWorker, rec.Decode)
	}
	set(openai.HeaderWorker, rec.Worker)
	set(openai.HeaderModel, rec.Served)
	set(openai.HeaderKVHandoff, rec.Handoff)
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
		if w.status == http.StatusOK && w.metrics != nil && strings.HasPrefix(w.Header().Get("Content-Type"), "text/event-stream") {
			w.itl = w.metrics.InterToken.WithLabelValues(w.metrics.Model(w.rec.Model), w.rec.Mode)
		}
	} else if w.itl != nil {
		w.itl.Observe(now.Sub(w.lastWrite).Seconds())
	}
	w.lastWrite = now
	n, err := w.ResponseWriter.Write(b)
	w.written += int64(n)
	return n, err
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// observe is the outer middleware: request id, the request deadline (on the context and on
// writes to the client), in-flight count, metrics and the access log. It records requests that
// end in an aborted connection too, then lets the abort through. A panic anywhere below fails
// the request with 500 (or aborts it after the first byte) and is logged and counted; the
// process lives on.
func (s *Server) observe(next http.Handler) http.Handler {
	timeout, stall := s.opts.RequestTimeout, s.opts.StalledClientTimeout
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rid := requestID(r.Header)
		w.Header().Set(openai.HeaderRequestID, rid)
		var span trace.Span
		if tracing.Enabled() {
			var tctx context.Context
			tctx, span = tracing.StartServer(r)
			r = r.WithContext(tctx)
		}
		ctx, cancel := context.WithDeadlineCause(r.Context(), start.Add(timeout), outcome.ErrRequestTimeout)
		defer cancel()
		rec := &record.Record{RequestID: rid, Mode: "regular", Attempts: 1, Start: start}
		r = r.WithContext(record.With(ctx, rec))
		sw := &statusWriter{ResponseWriter: w, rc: http.NewResponseController(w), stall: stall, deadline: start.Add(timeout + writeGrace),
			rec: rec, metrics: s.metrics}
		sw.arm(start)
		s.inflight.Add(1)
		defer func() {
			v := recover()
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
			rec.Route = r.Pattern
			if rec.Route == "" || rec.Route == "/" {
				rec.Route = "other"
			}
			s.finish(sw.rec, sw.written, r, status, span, v == http.ErrAbortHandler)
			if v == http.ErrAbortHandler {
				panic(v)
			}
		}()
		next.ServeHTTP(sw, r)
	})
}

// finish records what a request's answer says once it ended, from its record and the body
// bytes written: its count and duration, TTFT and tokens of a successful generation, the PD
// pair's handoff, the status page, the server span and the access log line.
func (s *Server) finish(rec *record.Record, written int64, r *http.Request, status int, span trace.Span, aborted bool) {
	model := rec.ModelLabel
	if model == "" {
		model = s.metrics.Model(rec.Model)
	}
	e := ended{rec: rec, model: model, status: status, dur: time.Since(rec.Start), bytes: written, aborted: aborted}
	s.metrics.ObserveRequest(rec.Route, e.model, status, e.dur.Seconds())
	generation := r.Method == http.MethodPost && rec.Route != "other" && !strings.HasPrefix(rec.Route, "POST /workers")
	if generation && status == http.StatusOK && !rec.FirstByte.IsZero() {
		e.ttft = rec.FirstByte.Sub(rec.Start)
		s.metrics.TTFT.WithLabelValues(e.model, rec.Mode).Observe(e.ttft.Seconds())
		if e.usage = rec.UsageKnown; e.usage && !aborted {
			s.metrics.Tokens.WithLabelValues(e.model, "prompt").Add(float64(rec.Usage.Prompt))
			s.metrics.Tokens.WithLabelValues(e.model, "completion").Add(float64(rec.Usage.Completion))
			if rec.Usage.Cached > 0 {
				s.metrics.Tokens.WithLabelValues(e.model, "cached").Add(float64(rec.Usage.Cached))
			}
		}
	}
	if rec.TenantName() != "" && generation {
		c := s.tenantCounters.get(s.metrics, rec.TenantName(), e.model, status)
		c.requests.Inc()
		if rec.UsageKnown {
			c.prompt.Add(float64(rec.Usage.Prompt))
			c.completion.Add(float64(rec.Usage.Completion))
			if rec.Usage.Cached > 0 {
				c.cached.Add(float64(rec.Usage.Cached))
			}
		}
	}
	if rec.Prefill != "" && rec.Decode != "" && rec.Handoff != "" {
		s.metrics.PairHandoffs.WithLabelValues(rec.Prefill, rec.Decode, rec.Handoff).Inc()
	}
	if rec.Route != "other" {
		s.status.record(rec.Start.Add(e.dur), rec.Route, e.model, status, rec.Code, errorWorker(rec), e.ttft)
	}
	if span != nil {
		endSpan(span, e)
	}
	if s.opts.AccessLog && s.log.Enabled(r.Context(), slog.LevelInfo) {
		s.accessLog(r, e)
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
		attribute.String("baton.mode", rec.Mode), attribute.Int64("http.response.body.size", e.bytes), attribute.String("baton.tenant", rec.TenantName()),
		attribute.String("baton.priority", rec.Class), attribute.Float64("baton.queue_wait_ms", float64(rec.QueueWait)/1e6))
	if rec.Worker != "" && rec.Prefill == "" {
		span.SetAttributes(attribute.String("baton.worker", rec.Worker))
	}
	if rec.Prefill != "" {
		span.SetAttributes(attribute.String("baton.prefill_worker", rec.Prefill), attribute.String("baton.decode_worker", rec.Decode))
	}
	if rec.Handoff != "" {
		span.SetAttributes(attribute.String("baton.pd.handoff", rec.Handoff))
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
func (s *Server) accessLog(r *http.Request, e ended) {
	rec := e.rec
	var buf [24]slog.Attr
	route := rec.Route // "POST /v1/completions": the method is its own field
	if _, path, ok := strings.Cut(route, " "); ok {
		route = path
	}
	attrs := append(buf[:0], slog.String("method", openai.Clip(r.Method, 32)), slog.String("route", route), slog.String("client", r.RemoteAddr),
		slog.String("model", e.model), slog.Int("status", e.status),
		slog.String("request_id", rec.RequestID), slog.Float64("duration_ms", float64(e.dur)/1e6), slog.Int("attempts", rec.Attempts), slog.Int64("bytes", e.bytes))
	if rec.TenantName() != "" {
		attrs = append(attrs, slog.String("tenant", rec.TenantName()))
	}
	if rec.Class != "" {
		attrs = append(attrs, slog.String("class", rec.Class))
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
		attrs = append(attrs, slog.String("handoff", rec.Handoff))
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
	if tid := tracing.TraceID(r.Context()); tid != "" {
		attrs = append(attrs, slog.String("trace_id", tid))
	}
	s.log.LogAttrs(r.Context(), slog.LevelInfo, "request", attrs...)
}

// maxRequestIDLen bounds a client's X-Request-Id; a longer one is replaced.
const maxRequestIDLen = 128

// requestID returns the request's id: the client's X-Request-Id when it sent exactly one of at
// most maxRequestIDLen visible ASCII characters, else a fresh one. The header is set to it, so
// that workers see the same id.
func requestID(h http.Header) string {
	if v := h[openai.HeaderRequestID]; len(v) == 1 && validRequestID(v[0]) {
		return v[0]
	}
	rid := newRequestID()
	h[openai.HeaderRequestID] = []string{rid}
	return rid
}

func validRequestID(s string) bool {
	if s == "" || len(s) > maxRequestIDLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
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
func (s *Server) readRequest(w http.ResponseWriter, r *http.Request) (req *openai.Request, release func()) {
	body, release, oerr := s.readBody(w, r)
	if oerr != nil {
		openai.WriteError(w, oerr)
		return nil, release
	}
	req, e := s.parseRequest(body, r.URL.Path)
	if e != nil {
		openai.WriteError(w, e)
		return nil, release
	}
	record.From(r.Context()).Model = req.Model
	return req, release
}

// parseRequest parses the body of an inference request to path: the default model set in it
// when it names none, its batch bounded; bad input is the error to answer.
func (s *Server) parseRequest(body []byte, path string) (*openai.Request, *openai.Error) {
	req, err := openai.ParseRequest(body)
	if err != nil {
		e := &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidJSON, Message: err.Error()}
		if dk, ok := errors.AsType[*openai.DuplicateKeyError](err); ok {
			e.Code, e.Param = openai.CodeDuplicateKey, dk.Key
		}
		return nil, e
	}
	if len(req.Model) > maxModelName {
		return nil, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidModel, Param: "model",
			Message: fmt.Sprintf(`"model" is longer than %d bytes: no model Baton serves has such a name`, maxModelName)}
	}
	if e := s.sglangAdapterModel(req, path); e != nil {
		return nil, e
	}
	if e := s.loraPathModel(req, path); e != nil {
		return nil, e
	}
	if _, def := s.models(); req.Model == "" && path != "/generate" {
		if def == "" {
			return nil, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeModelRequired, Param: "model",
				Message: `the request names no model: give "model"`}
		}
		q, _ := json.Marshal(def)
		if b, err := openai.Set(req.Body, "model", q); err == nil && req.SetBody(b) == nil {
			req.Model = def
		}
	}
	if req.N > s.opts.MaxBatchSize {
		return nil, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeBatchTooLarge, Param: "n",
			Message: fmt.Sprintf(`"n" is %d, above the limit of %d (max_batch_size)`, req.N, s.opts.MaxBatchSize)}
	}
	return req, nil
}

// maxModelName bounds a model's (or an adapter's) name read from a request: every message that
// names the model quotes at most this much of what the client sent.
const maxModelName = 1024

// loraPathModel reads a client's own lora_path (SGLang's way to name an adapter, on /generate
// and its OpenAI routes) as the model the request asks for: the adapter it names is routed,
// loaded, counted and checked against the tenant's models like a "model" naming it — never
// passed to an engine unseen, where it would run any adapter loaded there. Outside /generate the
// body's "model" becomes the adapter too (vLLM runs the adapter its model names). A lora_path
// naming no adapter Baton knows, several adapters at once, or an adapter of another base than the
// model's is refused 400; null (or a list of nulls) is the base model.
func (s *Server) loraPathModel(req *openai.Request, path string) *openai.Error {
	raw, ok := req.Get("lora_path")
	if !ok {
		return nil
	}
	refuse := func(format string, a ...any) *openai.Error {
		return &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidLoRAPath, Param: "lora_path", Message: fmt.Sprintf(format, a...)}
	}
	var name string
	switch v := bytes.TrimSpace(raw); {
	case string(v) == "null":
		return nil
	case len(v) > 0 && v[0] == '"':
		if json.Unmarshal(v, &name) != nil || name == "" || len(name) > maxModelName {
			return refuse(`"lora_path" must name an adapter (at most %d bytes)`, maxModelName)
		}
	case len(v) > 0 && v[0] == '[':
		var names []*string
		if json.Unmarshal(v, &names) != nil {
			return refuse(`"lora_path" must be an adapter's name, null, or a list of them (one per prompt)`)
		}
		if len(names) > max(s.opts.MaxBatchSize, 1) {
			return &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeBatchTooLarge, Param: "lora_path",
				Message: fmt.Sprintf(`"lora_path" lists %d entries, above the limit of %d prompts (max_batch_size)`, len(names), s.opts.MaxBatchSize)}
		}
		nulls := 0
		for _, n := range names {
			switch {
			case n == nil:
				nulls++
			case *n == "" || len(*n) > maxModelName || name != "" && *n != name:
				return refuse(`"lora_path" names more than one adapter in one batch: send one request per adapter`)
			default:
				name = *n
			}
		}
		if name == "" {
			return nil // the base model for every prompt
		}
		if nulls > 0 {
			return refuse(`"lora_path" names the base model beside an adapter in one batch: send one request per adapter`)
		}
	default:
		return refuse(`"lora_path" must be an adapter's name, null, or a list of them (one per prompt)`)
	}
	base := s.adapterBase(name)
	if base == "" {
		return refuse(`"lora_path" names %q, which is no adapter Baton serves (declared in adapters:, or listed by a worker)`, name)
	}
	if req.Model != "" && req.Model != name && req.Model != base && s.modelChain(req.Model)[0] != base {
		return refuse(`"lora_path" names adapter %q of base model %q, but "model" is %q`, name, base, req.Model)
	}
	return setModel(req, name, path)
}

// adapterBase is the base model of adapter name, declared or listed by a worker; "" when name
// is no adapter Baton knows.
func (s *Server) adapterBase(name string) string {
	if s.opts.Adapters != nil {
		return s.opts.Adapters.Base(s.reg.Snapshot(), name)
	}
	return s.reg.Snapshot().Parent(name)
}

// sglangAdapterModel reads SGLang's own spelling of an adapter, "model": "base:adapter" (its
// OpenAI serving splits at the first colon and trims both parts, serving_base.py,
// _parse_model_parameter), as the adapter: a client moving from SGLang, or sending back the
// model an answer named, asks for the adapter, routed and tenant-checked as such. A model of
// that name that Baton or a worker knows keeps its name.
func (s *Server) sglangAdapterModel(req *openai.Request, path string) *openai.Error {
	base, a, ok := strings.Cut(req.Model, ":")
	if !ok {
		return nil
	}
	if models, _ := s.models(); models != nil {
		if _, known := models[req.Model]; known {
			return nil
		}
	}
	if s.reg.Snapshot().Lists(req.Model) {
		return nil
	}
	base, a = strings.TrimSpace(base), strings.TrimSpace(a)
	if b := s.adapterBase(a); a == "" || b == "" || b != base && s.modelChain(base)[0] != b {
		return nil // no adapter of that base: the name is left to be found, or not, as it is
	}
	return setModel(req, a, path)
}

// setModel makes name the model req asks for, and — but on SGLang's /generate, which takes no
// "model" — its body's "model".
func setModel(req *openai.Request, name, path string) *openai.Error {
	req.Model = name
	if path == "/generate" {
		return nil
	}
	q, _ := json.Marshal(name)
	b, err := openai.Set(req.Body, "model", q)
	if err == nil {
		err = req.SetBody(b)
	}
	if err != nil {
		return &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidJSON, Message: err.Error()}
	}
	return nil
}

// serveInference forwards an inference request to one regular worker serving its model.
func (s *Server) serveInference(w http.ResponseWriter, r *http.Request) {
	req, done := s.readRequest(w, r)
	defer done()
	if req == nil {
		return
	}
	preq := &pd.Request{Request: req, Path: r.URL.Path}
	adm, ok := s.admitRequest(w, r, preq)
	defer adm.end()
	if !ok {
		return
	}
	if s.opts.PD && !s.sel.HasRole(config.RoleRegular) {
		openai.WriteError(w, &openai.Error{Status: http.StatusNotImplemented, Code: openai.CodeNotImplementedInPD,
			Message: fmt.Sprintf("%s is not served through prefill/decode; add regular workers to serve it", r.URL.Path)})
		return
	}
	sreq := &policy.Request{Model: req.Model, Path: r.URL.Path, Body: req.Body, Parsed: req, Explain: s.opts.RouteHeader || tracing.Enabled()}
	s.serveOne(w, r, req, sreq, config.RoleRegular)
}

// serveOne serves a request on one worker of role, chosen (and chosen again on a retry or a
// fallback model) by the request's policy.
func (s *Server) serveOne(w http.ResponseWriter, r *http.Request, req *openai.Request, sreq *policy.Request, role string) {
	client := req.Model
	waited := false // the waiting room holds a request once
	s.withRetries(w, r, func(r *http.Request, avoid map[string]bool) error {
		return s.withContextFallbacks(r, client, func(name string, fallbackLeft bool) error {
			var wk *worker.Worker
			inFlight, err := s.choose(r, name, sreq, &waited, avoid, func() (err error) {
				wk, err = s.sel.Worker(r.Context(), role, sreq, avoid)
				return err
			}, func() []*worker.Worker { return []*worker.Worker{wk} })
			if err != nil {
				return err
			}
			defer inFlight()
			rec := record.From(r.Context())
			rec.Worker = wk.URL
			if role == config.RoleDecode {
				rec.Decode = wk.URL
			}
			s.noteDecisions(r, sreq)
			call := proxy.Call{Path: r.URL.Path, Body: withPriority(forWorkers(req.Body, r.URL.Path, client, sreq, wk), rec.Class, wk)}
			if fallbackLeft {
				call.Hold = []int{http.StatusBadRequest} // a context overflow goes to the fallback
			}
			if !s.declaredAdapter(sreq) {
				return s.proxy.Forward(w, r, wk, call)
			}
			// An adapter another replica unloaded since this one chose: the engine's refusal is
			// held, the adapter loaded again on the same worker, and the request sent once more —
			// a bounded number of times; the last refusal reaches the client as the engine said it.
			hold := call.Hold
			for try := 1; ; try++ {
				call.Hold = hold
				if try < maxAdapterGone {
					call.Hold = append(slices.Clip(hold), http.StatusNotFound, http.StatusBadRequest)
				}
				err = s.proxy.Forward(w, r, wk, call)
				if try >= maxAdapterGone || !adapterGone(err) {
					return err
				}
				again, rerr := s.readyAgain(r, sreq.Model, wk, err, wk)
				if rerr != nil {
					return rerr
				}
				defer again()
			}
		})
	})
}

// declaredAdapter reports whether the request's model is an adapter Baton declares (and so
// loads, and loads again when another replica unloaded it).
func (s *Server) declaredAdapter(sreq *policy.Request) bool {
	return sreq.AdapterBase != "" && s.opts.Adapters != nil && declared(s.opts.Adapters, sreq.Model)
}

// readyAgain readies model once more on ws after gone's engine refused a request because the
// adapter is not there (refused, its refusal): gone's models are read again and the adapter
// loaded where it is missing, ws being where the request is sent again. The returned func ends
// the request's count in flight; an error is the request's answer — refused itself when the
// adapter cannot be readied there (the engine's refusal, as it said it).
func (s *Server) readyAgain(r *http.Request, model string, gone *worker.Worker, refused error, ws ...*worker.Worker) (func(), error) {
	if s.opts.Adapters.Relearn(r.Context(), gone) != nil {
		return nil, refused
	}
	again, err := s.adapterReady(r, model, ws...)
	if errors.Is(err, lora.ErrReselect) {
		// Loaded on another worker meanwhile; this request stays where it was sent.
		again, err = s.adapterReady(r, model, ws...)
	}
	if errors.Is(err, lora.ErrReselect) {
		return nil, refused
	}
	if err != nil {
		return nil, err
	}
	s.log.Info("adapter gone from its worker (another replica unloaded it): loaded again, request sent once more", "adapter", model, "worker", gone.URL)
	return again, nil
}

// maxAdapterGone bounds how often a request is sent to a worker that then answered that its
// adapter is gone (another replica unloaded it between this one's load and the request).
const maxAdapterGone = 6

func declared(m *lora.Manager, model string) bool {
	_, ok := m.Loadable(model)
	return ok
}

// adapterGone reports whether err is an engine's refusal of an adapter it does not have: vLLM's
// 404 "The model `X` does not exist." (vllm/entrypoints/openai/serving_engine.py's model check),
// SGLang's 400 "The following requested LoRA adapters are not loaded: X"
// (python/sglang/srt/lora/lora_registry.py, acquire).
func adapterGone(err error) bool {
	var f *outcome.Failure
	return errors.As(err, &f) && f.Answer == nil && goneAnswer(f.Status, string(f.Body))
}

// goneAnswer reports whether an engine's answer of status saying text refuses a request because
// its adapter is not loaded there (adapterGone names the engines' words).
func goneAnswer(status int, text string) bool {
	return status == http.StatusNotFound && strings.Contains(text, "does not exist") ||
		status == http.StatusBadRequest && strings.Contains(text, "requested LoRA adapters are not loaded")
}

// choose runs the selection (pickModel over sel) and readies the request's adapter on the
// workers chosen (adapterReady), choosing again — a bounded number of times — when the adapter
// was loaded on another worker meanwhile. The returned func ends the request's count in flight
// on the adapter.
func (s *Server) choose(r *http.Request, name string, sreq *policy.Request, waited *bool, avoid map[string]bool, sel func() error, chosen func() []*worker.Worker) (func(), error) {
	for tries := 0; ; tries++ {
		sreq.Decisions, sreq.Ranks = sreq.Decisions[:0], nil
		end := s.selectSpan(r)
		err := s.pickModel(r, name, sreq, waited, avoid, sel)
		end(sreq, err)
		if err != nil {
			return nil, selectionError(err)
		}
		if sreq.AdapterBase == "" {
			return noop, nil // no adapter: nothing to load, nothing to count
		}
		inFlight, err := s.adapterReady(r, sreq.Model, chosen()...)
		if errors.Is(err, lora.ErrReselect) && tries < maxReselect {
			continue // the adapter was loaded elsewhere meanwhile: choose again
		}
		return inFlight, err
	}
}

// maxReselect bounds how often a request chooses again because its adapter was loaded on
// another worker while it waited.
const maxReselect = 3

// contextPhrases are how the engines refuse a prompt longer than the model's context (400):
// vLLM ("This model's maximum context length is N tokens. However, …", "… is longer than the
// maximum model length …") and SGLang ("The input (N tokens) is longer than the model's context
// length (M tokens).", "Requested token count exceeds the model's maximum context length …").
var contextPhrases = []string{"maximum context length", "longer than the model's context length", "longer than the maximum model length"}

// contextOverflow reports whether err is an engine's refusal of a prompt too long for its model.
func contextOverflow(err error) bool {
	var f *outcome.Failure
	if !errors.As(err, &f) || f.Status != http.StatusBadRequest {
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

// withContextFallbacks runs attempt for the client's model, then — while the engine refuses the
// prompt as longer than the model's context — for each of its context_window_fallbacks in turn
// (a tenant's only where it may use them). attempt holds the refusal to be read only while a
// fallback is left (fallbackLeft); the last one reaches the client as the engine answered it.
func (s *Server) withContextFallbacks(r *http.Request, client string, attempt func(name string, fallbackLeft bool) error) error {
	models, _ := s.models()
	cw := models[client].ContextWindowFallbacks
	rec := record.From(r.Context())
	name := client
	for k := 0; ; k++ {
		for k < len(cw) && rec.Who != nil && !rec.Who.Allows(cw[k]) {
			k++
		}
		err := attempt(name, k < len(cw))
		if k >= len(cw) || !contextOverflow(err) {
			return err
		}
		s.metrics.ModelFallbacks.WithLabelValues(s.metrics.KnownLabel(s.modelChain(client)[0]), s.metrics.KnownLabel(s.modelChain(cw[k])[0])).Inc()
		rec.NextAttempt()
		name = cw[k]
	}
}

// models are the configuration's model names and default model now.
func (s *Server) models() (map[string]config.ModelConfig, string) {
	if s.opts.Models == nil {
		return nil, ""
	}
	return s.opts.Models()
}

// modelChain is the models a request for name may be served by, in order: the workers' name
// for it (an alias's target), then its fallbacks' (those allow lets the request use; nil: all).
func (s *Server) modelChain(name string, allow ...func(string) bool) []string {
	models, _ := s.models()
	served := func(n string) string {
		if m, ok := models[n]; ok && m.Serve != "" {
			return m.Serve
		}
		return n
	}
	chain := []string{served(name)}
	if m, ok := models[name]; ok {
		for _, f := range m.Fallbacks {
			if len(allow) == 0 || allow[0](f) {
				chain = append(chain, served(f))
			}
		}
	}
	return chain
}

// pickModel runs sel over the request's models (modelChain) until one has an available worker:
// the model it asked for, then each fallback in turn — also once every worker of a model failed
// this request with a retryable error (a retry goes to the fallback) — before anything was
// sent, so never after a first byte. The waiting room holds the first model once when none had one. The model chosen
// is on the record (X-Baton-Model) and a fallback is counted.
func (s *Server) pickModel(r *http.Request, client string, sreq *policy.Request, waited *bool, avoid map[string]bool, sel func() error) error {
	var one [1]string
	chain := append(one[:0], client) // a model the configuration does not name: itself alone
	if models, _ := s.models(); len(models) > 0 {
		if who := record.From(r.Context()).Who; who != nil {
			chain = s.modelChain(client, who.Allows) // a tenant's fallbacks only where it may go
		} else {
			chain = s.modelChain(client)
		}
	}
	var err error
	for i, m := range chain {
		if i+1 < len(chain) && s.spent(m, avoid) {
			continue // every worker of m failed this request already: its fallback next
		}
		sreq.Model = m
		if err = sel(); err == nil || !fallbackable(err) {
			break
		}
	}
	if err != nil && fallbackable(err) && !*waited {
		*waited = true
		if sreq.Model = chain[0]; s.waitingRoom(r, chain[0], err) {
			err = sel()
		}
	}
	if err != nil {
		return err
	}
	if sreq.Model != chain[0] {
		s.metrics.ModelFallbacks.WithLabelValues(s.metrics.KnownLabel(chain[0]), s.metrics.KnownLabel(sreq.Model)).Inc()
	}
	if rec := record.From(r.Context()); sreq.Model != rec.Model {
		rec.Served = sreq.Model // not the name the client gave: an alias's target, a fallback
	}
	return nil
}

// spent reports whether every worker of model (of the roles a request needs) failed this
// request already.
func (s *Server) spent(model string, avoid map[string]bool) bool {
	if len(avoid) == 0 {
		return false
	}
	roles := []string{config.RoleRegular}
	if s.opts.PD && !s.sel.HasRole(config.RoleRegular) {
		roles = []string{config.RoleDecode}
	}
	snap := s.reg.Snapshot()
	for _, role := range roles {
		cands, _ := s.candidates(snap, role, model)
		for _, w := range cands {
			if !avoid[w.URL] {
				return false
			}
		}
		if len(cands) == 0 {
			return false
		}
	}
	return true
}

// candidates are the workers of role that may serve model: the selector's (a declared
// adapter's are those of its base model).
func (s *Server) candidates(snap *worker.Snapshot, role, model string) ([]*worker.Worker, bool) {
	if s.sel == nil {
		return snap.Candidates(role, model)
	}
	return s.sel.Candidates(snap, role, model)
}

// fallbackable: the selection found no available worker for the model (not a route the
// model's workers cannot serve).
func fallbackable(err error) bool {
	nw, ok := errors.AsType[*policy.NoWorkerError](err)
	return ok && !nw.Kind().RouteRefused()
}

// forWorkers is body as ws take it: its "model" the workers' name for the request's (not on
// SGLang's /generate, which takes none) and, on SGLang, its adapter in lora_path.
func forWorkers(body []byte, path, client string, sreq *policy.Request, ws ...*worker.Worker) []byte {
	if path != "/generate" {
		body = withModel(body, client, workerModel(sreq, ws...))
	}
	return withLoRAPath(body, sreq, ws...)
}

// withModel is body with its "model" the workers' name for it, when that differs from the
// client's; the other bytes untouched.
func withModel(body []byte, client, served string) []byte {
	if served == client || served == "" {
		return body
	}
	q, err := json.Marshal(served)
	if err != nil {
		return body
	}
	if b, err := openai.Set(body, "model", q); err == nil {
		return b
	}
	return body
}

// adapterReady loads the request's adapter (model) on ws where it is not loaded — the legs of a
// pair at once — and counts the request in flight on it until the returned func is called. A
// load that failed is a 503 adapter_load_failed naming the adapter, not retried elsewhere.
func (s *Server) adapterReady(r *http.Request, model string, ws ...*worker.Worker) (func(), error) {
	m := s.opts.Adapters
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
		wg.Go(func() { errs[i] = m.Ensure(r.Context(), w, model) })
	}
	wg.Wait()
	for _, err := range errs {
		if le, ok := errors.AsType[*lora.Error](err); ok {
			end()
			return nil, outcome.FinalAnswer(&openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeAdapterLoadFailed, Param: "model", Message: le.Error()})
		}
		if err != nil {
			end()
			return nil, err // the client left, or the adapter was loaded elsewhere (lora.ErrReselect)
		}
	}
	return end, nil
}

func noop() {}

// workerModel is the name the workers take for the request's model: an adapter in SGLang's
// form base:adapter when the workers are SGLang's (its OpenAI routes take an adapter's name that
// way; a bare adapter name would be served by the base model), the model itself otherwise.
func workerModel(sreq *policy.Request, ws ...*worker.Worker) string {
	if sreq.AdapterBase == "" {
		return sreq.Model
	}
	for _, w := range ws {
		if w.Runtime() != config.RuntimeSGLang {
			return sreq.Model
		}
	}
	return sreq.AdapterBase + ":" + sreq.Model
}

// withLoRAPath is body with SGLang's lora_path set to the adapter a request names, when every
// worker of ws is SGLang: SGLang releases that read no adapter from the model name
// (base:adapter) would run the base model and answer 200 — never an adapter request answered
// silently by its base. A client's own lora_path is replaced: SGLang runs lora_path before the
// model name, and the adapter Baton routed, loaded and counted is the one that must run.
func withLoRAPath(body []byte, sreq *policy.Request, ws ...*worker.Worker) []byte {
	if sreq.AdapterBase == "" || len(ws) == 0 {
		return body
	}
	for _, w := range ws {
		if w.Runtime() != config.RuntimeSGLang {
			return body
		}
	}
	q, _ := json.Marshal(sreq.Model) // a client's own lora_path (another adapter, null) replaced
	if b, err := openai.Set(body, "lora_path", q); err == nil {
		return b
	}
	return body
}

// withPriority is body with the engine's "priority" field set for class when the worker is
// marked forward_priority (the client's own value replaced); body as it is otherwise.
func withPriority(body []byte, class string, ws ...*worker.Worker) []byte {
	v, ok := 0, len(ws) > 0
	for i, w := range ws {
		wv, marked := w.EnginePriority(class)
		if !marked || i > 0 && wv != v {
			return body // a worker not marked, or legs that read it differently: none is sent
		}
		v = wv
	}
	if !ok {
		return body
	}
	if b, err := openai.Set(body, "priority", []byte(strconv.Itoa(v))); err == nil {
		return b
	}
	return body
}

// selectSpan starts the selection's span when tracing; the returned func ends it with the
// choices made (policy, worker, reason) or the error.
func (s *Server) selectSpan(r *http.Request) func(*policy.Request, error) {
	if !tracing.Enabled() {
		return func(*policy.Request, error) {}
	}
	_, span := tracing.Start(r.Context(), "select")
	return func(req *policy.Request, err error) {
		for i, d := range req.Decisions {
			p := fmt.Sprintf("baton.select.%d.", i)
			span.SetAttributes(attribute.String(p+"role", d.Role), attribute.String(p+"policy", d.Policy),
				attribute.String(p+"worker", d.Worker), attribute.String(p+"reason", d.Reason), attribute.Float64(p+"load", d.Load))
			if d.Match >= 0 {
				span.SetAttributes(attribute.Float64(p+"cached_share", d.Match))
			}
		}
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// noteDecisions writes req's decisions on the record, for X-Baton-Route, when the option is on.
func (s *Server) noteDecisions(r *http.Request, req *policy.Request) {
	if s.opts.RouteHeader {
		record.From(r.Context()).Decisions = policy.RouteHeader(req.Decisions)
	}
}

// selectionError is the failure of a selection: 404 for a model no worker serves, 501 for a
// route none of its workers serves, else 503 (retried: a worker may come back).
func selectionError(err error) *outcome.Failure {
	kind := policy.NoneAvailable
	if nw, ok := errors.AsType[*policy.NoWorkerError](err); ok {
		kind = nw.Kind()
	}
	switch kind {
	case policy.ModelUnserved:
		return outcome.Answer(&openai.Error{Status: http.StatusNotFound, Code: openai.CodeModelNotFound, Param: "model", Message: err.Error()})
	case policy.RouteSGLangOnly:
		return outcome.FinalAnswer(&openai.Error{Status: http.StatusNotImplemented, Code: openai.CodeRouteNotServed, Message: err.Error()})
	case policy.RouteNotDisaggregated:
		return outcome.FinalAnswer(&openai.Error{Status: http.StatusNotImplemented, Code: openai.CodeNotImplementedInPD, Message: err.Error()})
	}
	f := outcome.Answer(&openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeNoAvailableWorkers, Message: err.Error()})
	f.NoWorker = true
	return f
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
	models, missing := s.readiness()
	private := s.fleetPrivate() && !s.adminKeyOK(r)
	if len(missing) > 0 {
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
	// Workers that have not registered are said, with why: by URL with the admin key, or where
	// no client needs a key (anyone may read GET /workers there), else by cause only.
	if pending := s.reg.Snapshot().PendingWorkers(); len(pending) > 0 {
		byCause := map[string]int{}
		var named []map[string]string
		for _, wk := range pending {
			cause := "pending"
			if e := wk.LastRegistrationError(); e != nil {
				cause = e.Cause
			}
			byCause[cause]++
			named = append(named, map[string]string{"url": config.RedactURL(wk.URL), "cause": cause})
		}
		if s.adminKeyOK(r) || !private && s.tenants().Open() {
			answer["unregistered"] = named
		} else {
			answer["unregistered"] = byCause
		}
	}
	body := openai.MarshalJSON(answer)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(body)
}

// Ready reports what /readiness answers: true when not draining and every model the workers
// name can be served; else why not.
func (s *Server) Ready() (bool, string) {
	if s.draining.Load() {
		return false, "shutting down"
	}
	if _, missing := s.readiness(); len(missing) > 0 {
		return false, strings.Join(missing, "; ")
	}
	return true, ""
}

// readiness returns the models the fleet serves — those its workers list or their
// configuration names, and those Baton's configuration names (a models: entry, an alias's
// target, the default model) — and, per model it cannot serve now, why.
func (s *Server) readiness() (models []string, missing []string) {
	snap := s.reg.Snapshot()
	models = snap.Models()
	aliases := map[string][]string{} // a target -> the names clients use for it
	if cfg, def := s.models(); len(cfg) > 0 || def != "" {
		for name, m := range cfg {
			models = append(models, cmp.Or(m.Serve, name))
			if m.Serve != "" {
				aliases[m.Serve] = append(aliases[m.Serve], name)
			}
		}
		if def != "" {
			models = append(models, s.modelChain(def)[0])
		}
		slices.Sort(models)
		models = slices.Compact(models)
	}
	if len(models) == 0 {
		models = []string{""} // workers that take any model, or none registered yet
	}
	unserved := snap.Unserved()
	for _, m := range models {
		why := s.unservable(snap, m)
		switch {
		case why == "":
			continue
		case slices.Contains(unserved, m):
			why = "named in the configuration of workers whose engines do not serve it"
		}
		switch names := aliases[m]; {
		case m == "":
			why = "no model is known yet: " + why
		case len(names) > 0:
			slices.Sort(names)
			why = fmt.Sprintf("model %q (served for %s): %s", m, strings.Join(names, ", "), why)
		default:
			why = fmt.Sprintf("model %q: %s", m, why)
		}
		missing = append(missing, why)
	}
	if models[0] == "" {
		models = []string{}
	}
	return models, missing
}

// unservable says why no request for model could be dispatched now ("" when one could): a
// worker of it ready with its circuit not open — with PD, a prefill and a decode that are, and
// can hand KV to each other.
func (s *Server) unservable(snap *worker.Snapshot, model string) string {
	open := false   // a ready worker was left out for its open circuit
	serves := false // some worker of the role asked serves the model at all
	available := func(role string) []*worker.Worker {
		ws, _ := s.candidates(snap, role, model)
		serves = len(ws) > 0
		var out []*worker.Worker
		for _, w := range ws {
			switch {
			case w.Available():
				out = append(out, w)
			case w.Ready():
				open = true
			}
		}
		return out
	}
	why := func(what string) string {
		if open {
			return fmt.Sprintf("no available %s (the circuit of every ready one is open: its engine failed requests)", what)
		}
		if !serves && !s.opts.PD {
			return "no worker serves it"
		}
		return fmt.Sprintf("no ready %s (unreachable, still registering, unhealthy or drained)", what)
	}
	if !s.opts.PD {
		if len(available(config.RoleRegular)) == 0 {
			return why("worker")
		}
		return ""
	}
	prefills := available(config.RolePrefill)
	if len(prefills) == 0 {
		return why("prefill worker")
	}
	decodes := available(config.RoleDecode)
	if len(decodes) == 0 {
		return why("decode worker")
	}
	for _, p := range prefills {
		for _, d := range decodes {
			if s.sel == nil || s.sel.Compatible == nil || s.sel.Compatible(p, d) {
				return ""
			}
		}
	}
	return "no available prefill and decode can hand KV to each other (their runtimes or KV connectors differ)"
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
