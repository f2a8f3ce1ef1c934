// Package proxy sends requests to workers and relays their answers: the client's bytes out,
// the worker's status, headers and body back, SSE flushed as it arrives, every buffer bounded.
// It maps a failure before the first byte to the client's status and error code (Classify),
// and decides when a failure after it aborts the client's connection (Finish).
package proxy

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/tracing"
	"github.com/baton-llm/baton/internal/upstream"
	"github.com/baton-llm/baton/internal/worker"
)

// The failures of a relay, outcome's (read at the attempt boundary by outcome.FailureOf).
var (
	ErrClientGone = outcome.ErrClientGone
	ErrAbort      = outcome.ErrAbort
)

// WriteFailure answers the client for a failure: Baton's envelope, or the worker's own error
// answer held back for a retry — status, headers and body as the worker sent them.
func WriteFailure(rw http.ResponseWriter, f *outcome.Failure) {
	if f.Answer != nil {
		openai.WriteError(rw, f.Answer)
		return
	}
	h := rw.Header()
	CopyResponseHeaders(h, f.Header)
	h.Set("Content-Length", strconv.Itoa(len(f.Body)))
	rw.WriteHeader(f.Status)
	_, _ = rw.Write(f.Body)
}

// PanicError is a panic recovered while serving a request. It is Baton's fault, never a
// worker's: the request fails with 500, nothing counts against a worker, and no retry follows.
type PanicError struct {
	Where string // handler, prefill_leg, health_generate
	Value any
}

func (e *PanicError) Error() string { return fmt.Sprintf("internal error in %s: %v", e.Where, e.Value) }

// Unwrap makes a panic Baton's own fault in the outcome table.
func (e *PanicError) Unwrap() error { return outcome.ErrInternal }

// Recovered turns a value recovered from a panic into a *PanicError, logging it with its stack
// and counting it.
func (p *Proxy) Recovered(where string, v any) *PanicError {
	if p.Metrics != nil {
		p.Metrics.Panics.WithLabelValues(where).Inc()
	}
	p.Log.Error("panic while serving a request; the request fails with 500", "where", where, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
	return &PanicError{Where: where, Value: v}
}

// InternalError is the client's answer for a panic.
func InternalError() *openai.Error {
	return &openai.Error{Status: http.StatusInternalServerError, Code: openai.CodeInternalError,
		Message: "internal error while serving the request (logged; please report it)"}
}

// ClientGone reports whether the client of r went away (as opposed to a deadline passing).
func ClientGone(r *http.Request) bool { return r.Context().Err() == context.Canceled }

// maxErrorBody bounds an error answer held back for a retry. A longer one is not relayed cut
// short as if complete: the client gets the worker's status with a minted envelope instead.
const maxErrorBody = 1 << 20

// MaxRewriteBody bounds a worker's non-streamed answer that Baton holds whole to rewrite it
// (PD usage and logprobs) and a prefill answer Baton keeps.
const MaxRewriteBody = 64 << 20

// ErrBodyTooLarge is a worker's answer longer than Baton holds: an upstream failure.
var ErrBodyTooLarge = errors.New("worker's answer exceeds 64 MiB, the most Baton holds to rewrite")

// ReadBody reads a worker's whole answer, failing with ErrBodyTooLarge past MaxRewriteBody.
// size is the length the answer declared (-1: none): a buffer is made to hold it and the end at
// once, where growing from nothing would make it three times over, up to maxFirstBuffer (an
// engine's word is not taken for what Baton allocates before a byte came); an answer longer
// than that, or than it declared, grows as it comes.
func ReadBody(r io.Reader, size int64) ([]byte, error) {
	c := 512
	if size >= 0 && size < maxFirstBuffer {
		c = int(size) + 1 // the last read, that meets the end, has room
	} else if size >= maxFirstBuffer {
		c = maxFirstBuffer
	}
	b := make([]byte, 0, c)
	for {
		n, err := r.Read(b[len(b):min(cap(b), MaxRewriteBody+1)])
		b = b[:len(b)+n]
		if len(b) > MaxRewriteBody {
			return nil, ErrBodyTooLarge
		}
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return b, err
		}
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)] // grows as io.ReadAll does
		}
	}
}

// maxFirstBuffer bounds the buffer ReadBody makes on an answer's declared length.
const maxFirstBuffer = 256 << 10

// MaxResponseHeaderBytes bounds the headers of a worker's answer.
const MaxResponseHeaderBytes = 64 << 10

// ReadError is an upstream body read failure during Relay (outcome.ReadError).
type ReadError = outcome.ReadError

// NewTransport returns the pooled upstream transport Baton uses for every worker: client "baton"
// (the default) is Baton's own HTTP/1.1 client (package upstream: no goroutines per connection,
// one write per request, less memory per open stream; it checks a connection for stray bytes
// just before it writes a request on it), with net/http's transport behind it for https workers; "net" is net/http's
// transport (StdTransport), which reads every idle connection in the background and drops one
// an engine writes to unasked. Under either, an answer out of step is caught where the engine
// names its answers after the request id (correlate). Compression is left to the engines and
// clients: Baton never asks for it, so bodies pass through untouched.
func NewTransport(client string) http.RoundTripper {
	if client == "baton" {
		return upstream.New(StdTransport(), MaxResponseHeaderBytes)
	}
	return StdTransport()
}

// WithoutReuse makes t open a connection for every request and close it after the answer
// (--upstream-reuse off): no answer on a connection can be another request's.
func WithoutReuse(t http.RoundTripper) http.RoundTripper {
	switch t := t.(type) {
	case *upstream.Transport:
		t.MaxIdlePerHost = 0
		if f, ok := t.Fallback.(*http.Transport); ok {
			f.DisableKeepAlives = true
		}
	case *http.Transport:
		t.DisableKeepAlives = true
	}
	return t
}

// freshOf holds, per transport, the one that sends each request on a new connection (fresh).
var freshOf sync.Map

// fresh is t for a request that must go on a connection of its own (unprovable): Baton's own
// client takes no idle connection for a request that closes its connection; net/http's
// transport would, so such a request goes through a copy of it that keeps none (Baton's client
// alike for the https workers it hands to net/http).
func fresh(t http.RoundTripper) http.RoundTripper {
	if f, ok := freshOf.Load(t); ok {
		return f.(http.RoundTripper)
	}
	var f http.RoundTripper
	switch t := t.(type) {
	case *http.Transport:
		c := t.Clone()
		c.DisableKeepAlives = true
		f = c
	case *upstream.Transport:
		f = t
		if std, ok := t.Fallback.(*http.Transport); ok {
			c := std.Clone()
			c.DisableKeepAlives = true
			f = &schemeSplit{http: t, other: c}
		}
	default:
		f = t
	}
	g, _ := freshOf.LoadOrStore(t, f)
	return g.(http.RoundTripper)
}

// schemeSplit sends http requests through one transport and the rest through another.
type schemeSplit struct{ http, other http.RoundTripper }

func (s *schemeSplit) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Scheme == "http" {
		return s.http.RoundTrip(r)
	}
	return s.other.RoundTrip(r)
}

// CloseIdle closes the idle connections t keeps to the worker at url: Baton's own client those
// to its host alone; net/http's transport, which cannot single one host out, every idle
// connection (a worker leaving is rare; the others reconnect once).
func CloseIdle(t http.RoundTripper, url string) {
	switch t := t.(type) {
	case *upstream.Transport:
		t.CloseIdleTo(url)
	case interface{ CloseIdleConnections() }:
		t.CloseIdleConnections()
	}
}

// TellUnsolicited has Baton's own client call f for every idle connection it drops because its
// engine wrote to it unasked (net/http's transport tells it through its log line instead).
func TellUnsolicited(t http.RoundTripper, f func()) {
	if t, ok := t.(*upstream.Transport); ok {
		t.OnUnsolicited = f
	}
}

// Rejudge sees w's engine anew — after its circuit opened, or it came back from failing its
// health checks, when it may be another engine process with other settings (one that no longer
// echoes X-Request-Id would otherwise have every answer refused until it registers again): its
// idle connections are closed first, so that its next answers come on connections nothing went
// out of step on, and its answers are not proven until it names one after its request again.
func Rejudge(t http.RoundTripper, w *worker.Worker) {
	CloseIdle(t, w.URL)
	w.ForgetCorrelation()
}

// StdTransport is net/http's transport as Baton configures it.
func StdTransport() *http.Transport {
	return &http.Transport{
		DialContext: (&net.Dialer{
			Timeout:   10 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		MaxIdleConnsPerHost: 512,
		// Under uvicorn's 5 s keep-alive (vLLM's and SGLang's server): a POST is not sent on a
		// connection the engine is closing (net/http resends only what it never wrote).
		IdleConnTimeout:    upstream.DefaultIdleTimeout,
		DisableCompression: true,
		// Engines answer with a few short headers; a worker that sends megabytes of them is
		// broken, and its answer is a transport failure rather than memory spent relaying it.
		MaxResponseHeaderBytes: MaxResponseHeaderBytes,
		// Held per upstream connection, so per open stream: 4 KiB each measured 25.5 KiB per
		// open stream against 50.6 KiB at 16 KiB (docs/BENCHMARKS.md).
		WriteBufferSize: 4 << 10,
		ReadBufferSize:  4 << 10,
	}
}

// Proxy sends requests to workers.
type Proxy struct {
	// Transport sends upstream requests.
	Transport http.RoundTripper
	// Timeout bounds one upstream request from send to the end of its body.
	Timeout time.Duration
	// StallTimeout gives up on a stream whose engine sent nothing for this long after its first
	// byte (0: never before Timeout).
	StallTimeout time.Duration
	// Metrics records upstream errors; nil records nothing.
	Metrics *metrics.Metrics
	// Log receives upstream failures.
	Log *slog.Logger
	// ExtraHeaders are client headers forwarded besides the allowlist (X-Sim-Fault in tests).
	ExtraHeaders []string
}

// singleHeaders are client headers sent to workers when the client sent exactly one of them
// (besides Content-Type, which Baton sets): two would make the worker choose.
var singleHeaders = []string{"Authorization", openai.HeaderRequestID, openai.HeaderTraceparent}

// hopHeaders are never relayed in either direction.
var hopHeaders = []string{"Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// Relay buffers: 16 KiB for whole answers (fewer reads of large bodies), 4 KiB for streams,
// which send small events and may stay open for minutes — thousands at once.
var (
	bufPool       = sync.Pool{New: func() any { b := make([]byte, 16<<10); return &b }}
	streamBufPool = sync.Pool{New: func() any { b := make([]byte, 4<<10); return &b }}
)

// Call is one upstream POST of a leg: the route path (the same on the worker), the body, and
// headers beyond the client's allowlisted ones (nil: none).
type Call struct {
	Path   string
	Body   []byte
	Header http.Header
	// Hold, for Forward, are answer statuses to hold to be read rather than relay, besides the
	// retryable ones: a 400 while a context-window fallback is left, an adapter request's 404
	// and 400 (its adapter gone). A stream whose first event is an engine's refusal of such a
	// status is held as that answer (holdRefusal: SGLang refuses streams inside them). The
	// caller's order for this one call.
	Hold []int
	// Rec is the request's record: what the call learns goes there (nil: nowhere); Orders are
	// the tenant's accounting asked of the answer's relay.
	Rec    *record.Record
	Orders Orders
	// Stream, for Forward: the client asked a stream, which a stall watch guards once it began.
	Stream bool
}

// Orders are what a relay is asked beyond relaying, for a tenant's accounting: CountUsage reads
// the usage a stream's events carry into the record (a tenant's stream that ends without its
// final usage is charged the completion last reported); StripUsage: Baton asked the engine for
// the stream's usage, which the client did not: the relay reads it from the usage-only event and
// keeps that event from the client. AskedEach: Baton asked the engine for usage on every event
// (continuous_usage_stats), and ClientEach says whether the client had asked it too: the relay
// takes the usage out of every event its client would not have had it on (On, by the engine),
// so that the client's bytes stay as the engine would have sent them.
type Orders struct {
	CountUsage, StripUsage bool
	AskedEach, ClientEach  bool
	// stripEach and nullEach are On's: the usage is taken out of every event but the usage-only
	// one, written null where the engine writes a null usage on every event (SGLang), removed
	// where it writes none (vLLM).
	stripEach, nullEach bool
}

// On is o for a stream from w's engine. vLLM puts usage on every event only when both
// include_usage and continuous_usage_stats are asked (should_include_usage,
// vllm/entrypoints/openai/serving_engine.py) and leaves the member out otherwise; SGLang on
// continuous_usage_stats alone, and writes "usage":null otherwise (serving_chat.py and
// serving_completions.py dump every stream response whole).
func (o Orders) On(w *worker.Worker) Orders {
	if !o.AskedEach {
		return o
	}
	sglang := w != nil && w.Runtime() == config.RuntimeSGLang
	clientGets := o.ClientEach && (!o.StripUsage || sglang)
	o.stripEach, o.nullEach = !clientGets, sglang
	return o
}

// Send POSTs c to the leg's worker with the client's allowlisted headers, under ctx.
func (p *Proxy) Send(ctx context.Context, in *http.Request, leg *Leg, c Call) (*http.Response, error) {
	body := newPayload(c.Body)
	out, err := newPost(ctx, leg.W, c.Path, body)
	if err != nil {
		return nil, err
	}
	out.GetBody = body.again
	// The client's query string is not forwarded: the engines' routes take none.
	CopyRequestHeaders(out.Header, in.Header, leg.W)
	for _, k := range p.ExtraHeaders {
		if v := in.Header[k]; len(v) > 0 {
			out.Header[k] = v
		}
	}
	for k, v := range c.Header {
		out.Header[k] = v
	}
	out.Header["Content-Type"] = jsonType
	out.ContentLength = int64(len(c.Body))
	named := Named(leg.W, c.Path, c.Body, out.Header.Get(openai.HeaderRequestID)) // once: it may scan the body
	out.Close = unprovable(leg.W.Proof(), named)
	if tracing.Enabled() {
		return p.sendTraced(ctx, out, leg, &c, named)
	}
	return letGo(p.exchange(out, leg, named, c.Rec))
}

// newPost is http.NewRequestWithContext(ctx, POST, w.URL+path, body), with the URL parsed once
// per path on the worker (Worker.Target) instead of once per leg: the request is made for no URL,
// then given a copy of the worker's, its Host as NewRequestWithContext derives it.
func newPost(ctx context.Context, w *worker.Worker, path string, body io.Reader) (*http.Request, error) {
	target, err := w.Target(path)
	if err != nil {
		return nil, err
	}
	out, err := http.NewRequestWithContext(ctx, http.MethodPost, "", body)
	if err != nil {
		return nil, err
	}
	*out.URL = *target
	out.URL.Host = strings.TrimSuffix(target.Host, ":") // an empty port goes, from both
	out.Host = out.URL.Host
	return out, nil
}

// exchange sends out to the leg's worker and proves the answer its request's (correlate; named:
// its engine names it after the id Baton chose, Named), by the worker's proof as it stood when
// the request was sent; the record learns what came.
func (p *Proxy) exchange(out *http.Request, leg *Leg, named bool, rec *record.Record) (*http.Response, error) {
	proof := leg.W.Proof()
	rt := p.Transport
	if out.Close {
		rt = fresh(rt) // a connection of its own, never one from the pool
	}
	resp, err := informational(rt.RoundTrip(out))
	resp, err = p.correlate(out, named, leg.W, proof, resp, err)
	given(rec, leg, resp, err)
	return resp, err
}

// sendTraced is Send's exchange under a client span. (Apart from Send, so that an untraced
// request waits for its answer under a small frame: the span's attributes take a kilobyte of
// stack, and a goroutine that waits on more than a quarter of its stack keeps all of it.)
//
//go:noinline
func (p *Proxy) sendTraced(ctx context.Context, out *http.Request, leg *Leg, c *Call, named bool) (*http.Response, error) {
	name := "upstream"
	if leg.Name != "" {
		name = leg.Name
	}
	start := time.Now()
	_, leg.span = tracing.StartClient(ctx, name, out.Header, attribute.String("baton.worker", leg.W.URL), attribute.String("baton.leg", cmp.Or(leg.Name, "regular")),
		attribute.String("baton.runtime", leg.W.Runtime()), attribute.Int("baton.attempt", tracing.Attempt(ctx)),
		attribute.String("url.path", c.Path), attribute.Int("http.request.body.size", len(c.Body)))
	if leg.W.KVConnector != "" {
		leg.span.SetAttributes(attribute.String("baton.kv_connector", leg.W.KVConnector))
	}
	resp, err := p.exchange(out, leg, named, c.Rec)
	if err != nil {
		leg.span.SetStatus(codes.Error, LogCause(err))
	} else {
		leg.span.SetAttributes(attribute.Int("http.response.status_code", resp.StatusCode), attribute.Float64("baton.ttfb_ms", float64(time.Since(start))/1e6))
	}
	return letGo(resp, err)
}

// letGo unties an answer from the request that obtained it once its head is in: the request was
// sent (its body, headers and URL are no longer read; a transport still writing a body holds its
// own reference), and an open stream must not hold them while it waits — for a PD decode leg,
// the body Baton built for it.
func letGo(resp *http.Response, err error) (*http.Response, error) {
	if err == nil {
		resp.Request = nil
	}
	return resp, err
}

// given notes on the request's record that a leg that generates (a regular or decode leg) was
// given the request and did not refuse it: a connection was made, and no answer came (the
// client left, the deadline passed, the engine failed) or a 2xx did — so the engine computed
// for it and the tenant is charged (record.Charge). A prefill leg is the PD executor's to note:
// SGLang's runs on a goroutine of its own, and the record has one writer.
func given(rec *record.Record, leg *Leg, resp *http.Response, err error) {
	if rec == nil || leg.Name == "prefill" || Unreached(err) || err == nil && resp.StatusCode >= 300 {
		return
	}
	rec.AnswerComputed = true
}

// Unreached reports whether err is a failure to open a connection to the worker: the request
// never left Baton, so no engine saw it.
func Unreached(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// payload is an upstream request's body: the bytes Baton holds, readable as a stream by
// net/http's transport and lent whole (Bytes) to Baton's own client, so that they are never
// copied again on the way out.
type payload struct {
	bytes.Reader
	b []byte
}

func newPayload(b []byte) *payload {
	p := &payload{b: b}
	p.Reset(b)
	return p
}

// Bytes returns the whole body.
func (p *payload) Bytes() []byte { return p.b }

// Close implements io.Closer.
func (p *payload) Close() error { return nil }

// again is the request's GetBody: the same bytes, read from their start.
func (p *payload) again() (io.ReadCloser, error) { return newPayload(p.b), nil }

// jsonType is every upstream request's Content-Type, one slice for all: a request's header
// values are replaced, never written in place, and appending to it copies (its capacity is its
// length).
var jsonType = []string{"application/json"}

// ErrInformational is a worker's answer with a final status below 200 (a 101 Switching
// Protocols nobody asked for): relayed, it would turn the client's connection into a tunnel
// past every proxy rule in front of Baton. It is a failure of the worker's (502).
var ErrInformational = errors.New("the worker answered with an informational status as its final answer")

// informational turns an answer with a status below 200 into ErrInformational.
func informational(resp *http.Response, err error) (*http.Response, error) {
	if err == nil && resp.StatusCode < 200 {
		resp.Body.Close()
		return nil, fmt.Errorf("%w (%d)", ErrInformational, resp.StatusCode)
	}
	return resp, err
}

// Forward POSTs body to path on w and relays the response to rw (regular mode). It returns nil
// when the whole response reached the client, ErrClientGone, ErrAbort (the caller must abort the
// connection), or, with nothing written yet, an *outcome.Failure for the caller to retry or
// write.
//
// The request's deadline is r's: the caller sets it once for all attempts.
func (p *Proxy) Forward(rw http.ResponseWriter, r *http.Request, w *worker.Worker, c *Call) error {
	f, err := p.forwardHead(r, w, c)
	if f == nil {
		return err
	}
	defer f.close()
	return p.Finish(r, &f.leg, f.resp.StatusCode, p.Relay(r.Context(), rw, f.resp, nil, c.Rec, c.Orders.On(w), f.abort))
}

// forwarding is a Forward whose answer is being relayed. It lives on the heap, so that the
// frames a relayed stream waits under stay small (a goroutine's stack shrinks to half only when
// it uses under a quarter of it).
type forwarding struct {
	leg  Leg
	resp *http.Response
	// abort ends a stream's upstream exchange (its stall watch's); nil for a whole answer.
	abort context.CancelCauseFunc
}

func (f *forwarding) close() {
	f.resp.Body.Close()
	f.leg.Excuse()
	if f.abort != nil {
		f.abort(nil)
	}
}

// Streamed returns ctx, and for a stream when a stall timeout is set, ctx under a cancel that
// the relay's stall watch may call (nil otherwise): the exchange it sends is given up on when its
// engine goes silent mid-stream. The caller calls abort(nil) once the exchange ended.
func (p *Proxy) Streamed(ctx context.Context, stream bool) (context.Context, context.CancelCauseFunc) {
	if !stream || p.StallTimeout <= 0 {
		return ctx, nil
	}
	return context.WithCancelCause(ctx)
}

// forwardHead sends c to w and returns the answer to relay, or (nil, the call's result) when it
// ends here: a failure to send, a refused key, an answer held to be read.
//
//go:noinline
func (p *Proxy) forwardHead(r *http.Request, w *worker.Worker, c *Call) (*forwarding, error) {
	f := &forwarding{}
	f.leg.Start(w, "")
	ctx, abort := p.Streamed(r.Context(), c.Stream)
	resp, err := p.Send(ctx, r, &f.leg, *c)
	if err != nil || KeyRefusedBy(w, resp.StatusCode) || outcome.Status(resp.StatusCode).Retryable || slices.Contains(c.Hold, resp.StatusCode) {
		if abort != nil {
			defer abort(nil)
		}
	} else {
		f.abort = abort
	}
	if err != nil {
		defer f.leg.Excuse()
		return nil, p.Failure(r, &f.leg, err)
	}
	if resp.StatusCode >= 500 {
		p.countError(w, metrics.KindStatus)
	}
	if KeyRefusedBy(w, resp.StatusCode) || outcome.Status(resp.StatusCode).Retryable || slices.Contains(c.Hold, resp.StatusCode) {
		defer f.leg.Excuse()
		defer resp.Body.Close()
		if KeyRefusedBy(w, resp.StatusCode) {
			return nil, p.KeyRefused(&f.leg, resp)
		}
		return nil, p.HoldError(r, &f.leg, resp)
	}
	if c.Stream && len(c.Hold) > 0 && resp.StatusCode == http.StatusOK && openai.IsEventStream(resp.Header.Get("Content-Type")) {
		if err := p.holdRefusal(r, &f.leg, resp, c.Hold); err != nil {
			defer f.leg.Excuse()
			resp.Body.Close()
			if f.abort != nil {
				f.abort(nil)
			}
			return nil, err
		}
	}
	f.resp = resp
	return f, nil
}

// KeyRefusedBy reports whether status is w's engine refusing the key Baton sent it (w has one:
// without it the client's own Authorization went, and the refusal is the client's).
func KeyRefusedBy(w *worker.Worker, status int) bool {
	return w.APIKey != "" && (status == http.StatusUnauthorized || status == http.StatusForbidden)
}

// KeyRefused ends a leg whose engine refused Baton's key: the worker's failure (retried
// elsewhere, counted against its circuit), told to the client as such — 502 naming the worker,
// never the engine's 401 as if the client's key were wrong.
func (p *Proxy) KeyRefused(leg *Leg, resp *http.Response) error {
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxErrorBody))
	leg.Done(0, outcome.ErrKeyRefused)
	return KeyRefusedFailure("", leg.W, resp.StatusCode)
}

// KeyRefusedFailure is the failure of a leg (named leg, "" for a regular request) whose engine
// refused Baton's key with status.
func KeyRefusedFailure(leg string, w *worker.Worker, status int) *outcome.Failure {
	what := "worker"
	if leg != "" {
		what = leg + " worker"
	}
	return &outcome.Failure{Leg: leg, Worker: w.URL, Status: status, Cause: outcome.ErrKeyRefused, Answer: &openai.Error{Status: http.StatusBadGateway, Code: openai.CodeUpstreamKeyRefused,
		Message: fmt.Sprintf("%s %s answered %d: it refuses the key Baton sends it (--api-key, --worker-api-key or the worker's api_key)", what, w.URL, status)}}
}

// HoldError reads a retryable error answer whole, so that the request can be retried elsewhere,
// and ends the leg with it. An answer too large to hold keeps its status in a minted envelope.
func (p *Proxy) HoldError(r *http.Request, leg *Leg, resp *http.Response) error {
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody+1))
	if err != nil {
		return p.Failure(r, leg, err)
	}
	leg.Done(resp.StatusCode, nil)
	if len(b) > maxErrorBody {
		return &outcome.Failure{Worker: leg.W.URL, Status: resp.StatusCode, Answer: &openai.Error{Status: resp.StatusCode, Code: openai.CodeUpstreamErrorTooLarge,
			RetryAfter: resp.Header.Get("Retry-After"),
			Message:    fmt.Sprintf("worker %s answered %d with an error body over %d bytes (not relayed)", leg.W.URL, resp.StatusCode, maxErrorBody)}}
	}
	return &outcome.Failure{Worker: leg.W.URL, Status: resp.StatusCode, Header: resp.Header, Body: b}
}

// Finish ends a leg whose answer with status was relayed, given Relay's result: success ends
// it with status; a stream that reported an error inside it ends with that error's status and
// returns its *InBandError (nothing more can be written); a read failure before the first byte is a failure like a send failure
// (nothing was written: the caller may retry); after it the connection must be aborted.
func (p *Proxy) Finish(r *http.Request, leg *Leg, status int, err error) error {
	f := outcome.FailureOf(err)
	switch {
	case f == nil:
		leg.Done(status, nil)
		return nil
	case f.Phase == outcome.InBand:
		ib := f.Event()
		// Every byte reached the client; the engine's own verdict is the leg's outcome.
		leg.Done(ib.Status, nil)
		p.countError(leg.W, metrics.KindInBand)
		p.Log.Warn("the engine reported an error inside its stream; relayed as sent", "worker", leg.W.URL, "leg", leg.Name, "status", ib.Status, "message", ib.Message)
		return err
	case f.Kind() == outcome.KindClientGone, ClientGone(r):
		leg.Excuse()
		return ErrClientGone
	case f.Unread() != nil:
		return p.Failure(r, leg, f.Unread())
	}
	w := leg.W
	if errors.Is(err, outcome.ErrStalled) {
		// The engine went silent mid-stream: a failure of the worker's, which its circuit hears.
		leg.Done(0, err)
		p.countError(w, metrics.KindStalled)
		p.Log.Warn("the engine sent nothing mid-stream for the stream stall timeout; aborting the client connection", "worker", w.URL, "leg", leg.Name,
			"stream_stall_timeout", p.StallTimeout)
		return ErrAbort
	}
	if outcome.IsTimeout(err) {
		// The worker was producing bytes: a request longer than the deadline is no failure of
		// the worker's, and must not open its circuit for everyone else.
		leg.Excuse()
		p.countError(w, metrics.KindTimeout)
		p.Log.Warn("request deadline passed mid-response; aborting the client connection", "worker", w.URL, "leg", leg.Name)
		return ErrAbort
	}
	leg.Done(0, err)
	p.countError(w, metrics.KindMidStream)
	p.Log.Warn("upstream failed mid-response; aborting the client connection", "worker", w.URL, "leg", leg.Name, "err", LogCause(err))
	return ErrAbort
}

// Relay writes resp to rw: status, headers and body. The head is written only once the first
// body bytes arrived, so a failure before them leaves the client unanswered (ReadError with
// Written false). SSE bodies are flushed after every read; with transform set, they are split
// into events and each is passed through transform (which may return it unchanged). A stream
// relayed whole that carried an engine's error event returns an *InBandError (inband.go). A 200
// answer relayed to its end leaves its usage on rec (nil: nowhere), and o asks a stream's
// accounting of it. abort, when set, ends the exchange of a stream whose engine sends nothing
// for StallTimeout after its first byte: the relay then returns a ReadError of ErrStalled.
func (p *Proxy) Relay(ctx context.Context, rw http.ResponseWriter, resp *http.Response, transform func(event []byte) []byte, rec *record.Record, o Orders, abort context.CancelCauseFunc) error {
	var stall *stallWatch
	if abort != nil && p.StallTimeout > 0 {
		stall = &stallWatch{after: p.StallTimeout, abort: abort}
	}
	rl := newRelay(rw, resp, transform, rec, o, stall)
	defer rl.done()
	for {
		if err, end := rl.step(); end {
			return err
		}
	}
}

// relay is one Relay's state. It lives on the heap, and the loop's steps are calls, so that a
// stream waits for its next event under small frames (a goroutine's stack shrinks to half only
// when it uses under a quarter of it).
type relay struct {
	out    relayOut
	in     source
	w      watch
	tail   usageTail
	rec    *record.Record
	seen   *streamUsage
	sum    *openai.SampleSum // a whole answer that is a list: its samples' usage
	begun  bool              // the whole answer's first byte was seen
	bp     *[]byte
	pool   *sync.Pool
	ended  bool
	status int
	stall  *stallWatch // nil: no stall watch
}

//go:noinline
func newRelay(rw http.ResponseWriter, resp *http.Response, transform func(event []byte) []byte, rec *record.Record, o Orders, stall *stallWatch) *relay {
	rl := &relay{out: relayOut{rw: rw, rc: http.NewResponseController(rw), resp: resp, rewrites: transform != nil,
		stream: openai.IsEventStream(resp.Header.Get("Content-Type"))}, rec: rec, status: resp.StatusCode}
	if rl.rec == nil {
		rl.rec = &record.Record{} // nobody reads what is learnt
	}
	if rl.out.stream && resp.StatusCode == http.StatusOK && (o.CountUsage || o.StripUsage || o.stripEach) {
		transform, rl.seen = accounting(rl.rec, o, transform)
		rl.out.rewrites = true
	}
	rl.in.body = resp.Body
	if rl.out.stream && resp.StatusCode == http.StatusOK {
		rl.stall = stall // a stream's silence is watched; a whole answer's is the deadline's
	}
	if transform != nil && rl.out.stream {
		rl.in.events, rl.in.transform = openai.NewEventReader(resp.Body), transform
		if rl.stall != nil {
			// Events are passed on whole: the engine's progress is every byte read, however
			// slowly an event arrives (a wrapper would hide the body's own views).
			rl.in.events.OnProgress(rl.stall.progress)
		}
	} else if v, ok := resp.Body.(viewer); ok && rl.out.stream {
		rl.in.view = v // a stream holds no buffer while it waits for its next event
	} else {
		rl.pool = &bufPool
		if rl.out.stream {
			rl.pool = &streamBufPool
		}
		rl.bp = rl.pool.Get().(*[]byte)
		rl.in.buf, rl.in.whole = *rl.bp, !rl.out.stream
	}
	return rl
}

// step relays the next chunk; end is true once the relay ended, with its result err.
func (rl *relay) step() (err error, end bool) {
	chunk, flush, rerr := rl.in.next()
	if len(chunk) > 0 {
		if rl.stall != nil {
			rl.stall.progress()
			rl.stall.busy.Store(true) // a client slow to take it is not the engine's silence
		}
		werr := rl.emit(chunk, flush)
		if rl.stall != nil {
			rl.stall.progress()
			rl.stall.busy.Store(false)
		}
		if werr != nil {
			return werr, true
		}
	} else if flush {
		if werr := rl.out.release(); werr != nil {
			return werr, true
		}
	}
	if rerr == nil {
		return nil, false
	}
	return rl.end(rerr), true
}

// emit watches and keeps what the relay must learn of a chunk of a 200, then writes it.
func (rl *relay) emit(chunk []byte, flush bool) error {
	if rl.status == http.StatusOK {
		if rl.out.stream {
			rl.w.see(chunk)
			rl.tail.keepStream(chunk)
		} else {
			rl.keepWhole(chunk)
		}
	}
	return rl.out.emit(chunk, flush)
}

// keepWhole keeps what a whole answer's usage is read from: its tail, and every sample's usage
// of an answer that is a list (SGLang's /generate of a batch or of n samples, whose tail holds
// the last sample's only).
func (rl *relay) keepWhole(chunk []byte) {
	if !rl.begun {
		if b := bytes.TrimLeft(chunk, " \t\r\n"); len(b) > 0 {
			rl.begun = true
			if b[0] == '[' {
				rl.sum = &openai.SampleSum{}
			}
		}
	}
	if rl.sum != nil {
		rl.sum.Feed(chunk)
		return
	}
	rl.tail.keep(chunk)
}

// end is the relay's result once its body ended with err.
func (rl *relay) end(err error) error {
	if err != io.EOF {
		if rl.stall != nil && rl.stall.fired.Load() {
			err = outcome.ErrStalled
		}
		return &ReadError{Err: err, Written: rl.out.written}
	}
	rl.out.head()
	rl.ended = true
	if rl.w.err != nil {
		return rl.w.err
	}
	return nil
}

// done learns the answer's usage once it ended, and gives the buffers back.
func (rl *relay) done() {
	if rl.stall != nil {
		rl.stall.stop()
	}
	rl.tail.done(rl.rec, rl.ended)
	if rl.seen != nil && rl.ended {
		if u, ok := rl.seen.whole(rl.rec.Samples); ok {
			rl.rec.Usage, rl.rec.UsageKnown = u, true
		}
	}
	if rl.sum != nil && rl.ended {
		rl.rec.Usage, rl.rec.UsageKnown = rl.sum.Usage(rl.rec.Samples)
	}
	if rl.seen != nil {
		rl.rec.Streamed, rl.rec.StreamCounted = rl.seen.completion()
		if u, _ := rl.seen.whole(rl.rec.Samples); u.Prompt > rl.rec.EnginePrompt {
			rl.rec.EnginePrompt = u.Prompt // a batch's prompts, not its last sample's
		}
		rl.rec.PromptsReported = rl.seen.prompts(rl.rec.Samples, rl.rec.Prompts)
	}
	if rl.bp != nil {
		rl.pool.Put(rl.bp)
	}
}

// relayOut is the client's side of one Relay.
type relayOut struct {
	rw       http.ResponseWriter
	rc       *http.ResponseController
	resp     *http.Response
	stream   bool // SSE: flush as events arrive
	rewrites bool // the body is transformed: its Content-Length no longer holds
	written  bool // the head went out
	held     bool // a stream's bytes were written and not yet flushed
}

// head writes the status and headers, once.
func (o *relayOut) head() {
	if o.written {
		return
	}
	h := o.rw.Header()
	CopyResponseHeaders(h, o.resp.Header)
	if o.rewrites {
		h.Del("Content-Length")
	}
	o.rw.WriteHeader(o.resp.StatusCode)
	o.written = true
	// Nothing reads the engine's head past here: an open stream does not hold it.
	o.resp.Header = nil
}

// emit writes one chunk (after the head), flushing a stream when asked.
func (o *relayOut) emit(b []byte, flush bool) error {
	o.head()
	if _, err := o.rw.Write(b); err != nil {
		return ErrClientGone
	}
	o.held = o.stream && !flush
	if o.stream && flush {
		if err := o.rc.Flush(); err != nil {
			return ErrClientGone
		}
	}
	return nil
}

// release flushes what a stream held back for an event that was buffered behind it, where that
// event went out as nothing (a usage event taken out of the stream): no event waits for a later
// one.
func (o *relayOut) release() error {
	if !o.held {
		return nil
	}
	o.held = false
	if err := o.rc.Flush(); err != nil {
		return ErrClientGone
	}
	return nil
}

// source is the worker's side of one Relay: the body as it arrives, or as SSE events passed
// through transform.
type source struct {
	body io.Reader
	view viewer // body's own buffer, when it lends it
	// whole: a whole answer (not a stream), read a buffer full at a time, so that one whose
	// framing breaks within its first buffer (a bad chunk, a trailer past its bound) fails before
	// a byte of it is written — the client's 502 — instead of after; begun: a part of it went out.
	whole, begun bool
	buf          []byte
	events       *openai.EventReader
	transform    func([]byte) []byte
}

// viewer is a body that lends views of its own read buffer (internal/upstream's), each valid
// until the next call.
type viewer interface {
	Next() ([]byte, error)
}

// next returns the next chunk to write and whether to flush after it: every read of a plain
// body; after an event, only when no other event is already buffered (events that arrived
// together leave together).
func (s *source) next() ([]byte, bool, error) {
	if s.view != nil {
		v, err := s.view.Next()
		return v, true, err
	}
	if s.whole {
		n, err := fill(s.body, s.buf)
		if err != nil && err != io.EOF && !s.begun {
			n = 0 // nothing of a first part that broke goes out
		}
		s.begun = s.begun || n > 0
		return s.buf[:n], true, err
	}
	if s.events == nil {
		n, err := s.body.Read(s.buf)
		return s.buf[:n], true, err
	}
	ev, err := s.events.Next()
	if len(ev) > 0 {
		ev = s.transform(ev)
	}
	return ev, !s.events.Pending(), err
}

// fill reads from r until buf is full or r fails, and returns what it read with r's error
// (io.EOF at its end) — unlike io.ReadFull, which reports a body cut short by its engine
// (io.ErrUnexpectedEOF from the body) and a body that merely ended before buf filled alike.
func fill(r io.Reader, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := r.Read(buf[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// Classify makes an error that kept worker w from answering (before any response byte) a
// failure: the cause decides its verdict, and the client's answer names the leg ("prefill",
// "decode" or "") in its code.
func Classify(w *worker.Worker, leg string, timeout time.Duration, err error) *outcome.Failure {
	f := &outcome.Failure{Leg: leg, Worker: w.URL, Cause: err}
	prefix := ""
	if leg != "" {
		prefix = leg + "_"
	}
	switch outcome.Err(err).Reason {
	case "internal":
		f.Worker, f.Answer = "", InternalError()
	case "local":
		f.Worker, f.Answer = "", &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeOverloaded, RetryAfter: "1",
			Message: "Baton ran out of its own connections (file descriptors or local ports): send the request again shortly"}
	case "timeout":
		f.Answer = &openai.Error{Status: http.StatusGatewayTimeout, Code: prefix + openai.CodeUpstreamTimeout, RetryAfter: "1",
			Message: fmt.Sprintf("%sworker %s did not answer within %s", legWord(leg), w.URL, timeout)}
	default:
		f.Answer = &openai.Error{Status: http.StatusBadGateway, Code: prefix + openai.CodeUpstreamUnreachable,
			Message: fmt.Sprintf("%sworker %s: %s", legWord(leg), w.URL, safeCause(err))}
	}
	return f
}

// safeCause says what kept a worker from answering without quoting anything the worker sent:
// the HTTP clients' parse errors quote the bytes of a malformed answer, which may be another
// request's (a stray answer on a reused connection). Connection errors are the system's own
// words; anything else is named by its kind, and logged whole by the caller.
func safeCause(err error) string {
	var op *net.OpError
	switch {
	case errors.As(err, &op):
		return op.Op + ": " + op.Err.Error()
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "the connection closed before a whole answer"
	case errors.Is(err, ErrBodyTooLarge), errors.Is(err, upstream.ErrHeaderTooLarge), errors.Is(err, ErrInformational), errors.Is(err, ErrAnotherAnswer):
		return err.Error()
	case strings.Contains(err.Error(), "server response headers exceeded"): // net/http's, unexported
		return fmt.Sprintf("its answer's headers exceed %d bytes", MaxResponseHeaderBytes)
	}
	return "its answer is not valid HTTP/1.1 (details in Baton's log)"
}

// LogCause is err as Baton logs it and puts on a trace: whole, except the bytes net/http's
// client quotes from what a worker sent where an answer's head should be ("malformed HTTP
// response", its version and status code, a malformed header line): on a connection out of step
// they may be another request's answer, and they are withheld. Baton's own client quotes none.
func LogCause(err error) string {
	if err == nil {
		return ""
	}
	msg := err.Error()
	for _, quoting := range netQuotes {
		i := strings.Index(msg, quoting)
		if i < 0 {
			continue
		}
		if j := strings.IndexAny(msg[i:], "\":;"); j >= 0 {
			msg = msg[:i+j] + " (what the worker sent is not quoted: it may be another request's answer)"
		}
	}
	return msg
}

// netQuotes begin net/http's client errors that quote what a worker sent in an answer's head
// (net/http's response.go, transfer.go and textproto): the quote follows the first '"', ':' or
// ';' after them.
var netQuotes = []string{"malformed HTTP ", "malformed MIME header", "bad Content-Length", "invalid empty Content-Length",
	"multiple Content-Length headers", "unsupported transfer encoding", "too many transfer encodings", "invalid Trailer key",
	"bad trailer key"}

func legWord(leg string) string {
	if leg == "" {
		return ""
	}
	return leg + " "
}

// Failure classifies a failure before any response byte, ends the leg with it, and returns
// the error for the client (not written: the caller may retry), or ErrClientGone.
func (p *Proxy) Failure(r *http.Request, leg *Leg, err error) error {
	if ClientGone(r) {
		leg.Excuse()
		return ErrClientGone
	}
	w := leg.W
	f := Classify(w, leg.Name, p.Timeout, err)
	leg.Done(0, err)
	kind := metrics.KindTransport
	switch {
	case outcome.IsTimeout(err):
		kind = metrics.KindTimeout
	case errors.Is(err, ErrAnotherAnswer):
		kind = metrics.KindMismatch
	}
	p.countError(w, kind)
	p.Log.Warn("upstream request failed", "worker", w.URL, "leg", leg.Name, "status", f.ClientStatus(), "err", LogCause(err))
	return f
}

func (p *Proxy) countError(w *worker.Worker, kind string) {
	if p.Metrics != nil {
		p.Metrics.UpstreamErrors.WithLabelValues(w.URL, kind).Inc()
	}
}

// CopyRequestHeaders copies the allowlisted client headers to an upstream request. The worker's
// own API key, when it has one, replaces the client's authorization. (Baton's own key never
// gets here: the server removes it once checked.)
func CopyRequestHeaders(dst, src http.Header, w *worker.Worker) {
	for _, k := range singleHeaders {
		if v := src[k]; len(v) == 1 {
			dst[k] = v
		}
	}
	if v := src[openai.HeaderTracestate]; len(v) > 0 {
		dst[openai.HeaderTracestate] = v // a list: several headers are one value, joined
	}
	if w.APIKey != "" {
		dst.Set("Authorization", "Bearer "+w.APIKey)
	}
}

// CopyResponseHeaders copies an upstream response's headers except hop-by-hop ones and those
// Baton owns (X-Request-Id, X-Baton-*), which keep Baton's values.
func CopyResponseHeaders(dst, src http.Header) {
	for k, v := range src {
		if k == openai.HeaderRequestID || strings.HasPrefix(k, openai.HeaderBatonPrefix) {
			continue
		}
		dst[k] = v
	}
	for _, f := range src.Values("Connection") {
		for _, k := range strings.Split(f, ",") {
			dst.Del(strings.TrimSpace(k))
		}
	}
	for _, k := range hopHeaders {
		dst.Del(k)
	}
}

// stallWatch gives up on a stream whose engine sends nothing for after once its first byte came:
// a timer, armed by the first chunk, that finds the last byte's time too old and aborts the
// exchange (an engine hung mid-stream held its client until the request deadline, unseen).
// While the relay writes to the client (busy), the engine is not waited on: a client slow to
// read is the stalled-client timeout's, never the engine's stall.
type stallWatch struct {
	after             time.Duration
	abort             context.CancelCauseFunc
	last              atomic.Int64 // unix nanoseconds of the last byte read or written
	t                 atomic.Pointer[time.Timer]
	fired, done, busy atomic.Bool
}

// progress notes a chunk; the first arms the watch.
func (s *stallWatch) progress() {
	s.last.Store(time.Now().UnixNano())
	if s.t.Load() == nil {
		s.t.Store(time.AfterFunc(s.after, s.check))
	}
}

// check aborts the exchange when no chunk came for after, else waits for the rest of it.
func (s *stallWatch) check() {
	if s.done.Load() {
		return
	}
	idle := time.Duration(time.Now().UnixNano() - s.last.Load())
	if idle < s.after || s.busy.Load() {
		if idle >= s.after {
			idle = 0 // writing to the client: look again a whole timeout on
		}
		if t := s.t.Load(); t != nil {
			t.Reset(s.after - idle)
		}
		return
	}
	s.fired.Store(true)
	s.abort(outcome.ErrStalled)
}

func (s *stallWatch) stop() {
	s.done.Store(true)
	if t := s.t.Load(); t != nil {
		t.Stop()
	}
}
