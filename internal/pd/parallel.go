package pd

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/worker"
)

// errPrefillFailed is the cancel cause of a decode leg whose prefill failed.
var errPrefillFailed = errors.New("prefill leg failed")

// errDecodeFailed is the cancel cause of a prefill leg whose decode failed.
var errDecodeFailed = errors.New("decode leg failed")

// Parallel dispatches both legs at once with SGLang bootstrap fields; the engines rendezvous by
// bootstrap_room. A leg that fails cancels the other at once: a decode must never sit waiting
// for a bootstrap that will not come.
type Parallel struct {
	Proxy   *proxy.Proxy
	Metrics *metrics.Metrics
	Log     *slog.Logger
	// Pairs learns which pairs fail at the seam; nil learns nothing.
	Pairs *worker.PairHealth

	wg sync.WaitGroup // prefill legs still finishing after their decode completed
}

var _ Executor = (*Parallel)(nil)

// Wait waits for prefill legs that outlived their requests.
func (x *Parallel) Wait() { x.wg.Wait() }

// prefillResult is how a prefill leg ended.
type prefillResult struct {
	status int
	header http.Header
	body   []byte // kept for logprob merging and error messages
	err    error  // transport or read error; context.Canceled when Baton cancelled it
}

func (p prefillResult) failed() bool {
	return (p.err != nil && !errors.Is(p.err, context.Canceled)) || (p.err == nil && (p.status < 200 || p.status > 299))
}

// Execute implements Executor.
func (x *Parallel) Execute(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair) error {
	pBody, dBody, err := BootstrapBodies(req, pair)
	if err != nil {
		x.Metrics.PDBootstrapFailures.Inc()
		e := &openai.Error{Status: http.StatusBadRequest, Code: "bootstrap_injection_failed", Message: err.Error()}
		return e
	}
	rw.Header().Set(openai.HeaderKVHandoff, HandoffBootstrap)
	x.Metrics.PDHandoffs.WithLabelValues(HandoffBootstrap, HandoffBootstrap).Inc()
	res := x.run(rw, r, req, pair, concurrentPlan{
		prefillBody: pBody, decodeBody: dBody, dispatch: "parallel",
		needPrefill: req.ReturnLogprob,
		rewrite: func(p prefillResult) (func([]byte) []byte, func([]byte) []byte) {
			pre := prefillLogprobs(p.body)
			if len(pre) == 0 {
				return nil, nil
			}
			return func(ev []byte) []byte { return mergeEvent(ev, pre) }, func(b []byte) []byte { return mergeBody(b, pre) }
		},
	})
	return res.err
}

// concurrentPlan is one concurrent dispatch: both legs at once.
type concurrentPlan struct {
	prefillBody, decodeBody     []byte
	prefillHeader, decodeHeader http.Header
	dispatch                    string // metrics label
	// needPrefill holds the decode's answer until the prefill answered; rewrite then returns
	// the transforms of the decode's streamed events and of its whole body (nil: unchanged).
	needPrefill bool
	rewrite     func(p prefillResult) (event func([]byte) []byte, body func([]byte) []byte)
}

// concurrentResult is how a concurrent dispatch ended.
type concurrentResult struct {
	err           error
	outcome       string // success, prefill_failed, decode_failed, client_cancelled, aborted
	decodeStarted bool   // the decode's first body byte arrived
}

// run sends both legs at once and relays the decode's answer. A leg that fails before the
// decode's first byte cancels the other; the client gets the failing leg's status.
func (x *Parallel) run(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair, plan concurrentPlan) (res concurrentResult) {
	model := x.Metrics.Model(req.Model)
	runtime := pair.Prefill.Runtime()
	start := time.Now()
	timeout := x.Proxy.Timeout
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	dCtx, dCancel := context.WithCancelCause(ctx)
	defer dCancel(nil)
	// The prefill leg may outlive the handler (it can answer around the time the decode starts
	// streaming); it is cancelled when the client leaves or the decode fails.
	pCtx, pCancel := context.WithCancelCause(context.WithoutCancel(r.Context()))
	pCtx, pTimeout := context.WithTimeout(pCtx, timeout)
	unlink := context.AfterFunc(dCtx, func() { pCancel(context.Cause(dCtx)) })

	releaseP := pair.Prefill.Acquire()
	releaseD := pair.Decode.Acquire()
	defer releaseD()
	pres := make(chan prefillResult, 1)
	x.wg.Go(func() {
		defer pCancel(nil)
		defer pTimeout()
		defer releaseP()
		p := x.safePrefill(pCtx, r, req, pair.Prefill, plan.prefillBody, plan.prefillHeader, plan.needPrefill)
		if p.failed() {
			dCancel(errPrefillFailed)
		} else if p.err == nil {
			x.Metrics.PDPrefillDuration.WithLabelValues(model, runtime).Observe(time.Since(start).Seconds())
		}
		pres <- p
	})
	res.outcome = "success"
	defer func() {
		x.Metrics.PDRequests.WithLabelValues(model, plan.dispatch, res.outcome).Inc()
		switch res.outcome {
		case "success":
			x.Pairs.Record(pair.Prefill, pair.Decode, true)
		case "prefill_failed", "decode_failed", "aborted":
			if seamFailure(res.err) {
				x.Pairs.Record(pair.Prefill, pair.Decode, false)
			}
		}
	}()
	fail := func(derr error) concurrentResult {
		res.err = x.legFailed(r, pair, derr, dCtx, pres, &res.outcome)
		return res
	}

	dresp, derr := x.Proxy.Send(dCtx, r, pair.Decode, req.Path, plan.decodeBody, plan.decodeHeader)
	if derr == nil && (dresp.StatusCode < 200 || dresp.StatusCode > 299) {
		body, _ := io.ReadAll(io.LimitReader(dresp.Body, 1<<20))
		dresp.Body.Close()
		res.err = x.decodeFailed(r, pair, dresp.StatusCode, upstreamError(LegDecode, pair.Decode, dresp.StatusCode, dresp.Header, body), dCancel, pres, &res.outcome)
		return res
	}
	if derr != nil {
		res.err = x.decodeFailed(r, pair, 0, derr, dCancel, pres, &res.outcome)
		return res
	}
	defer dresp.Body.Close()

	var eventT, bodyT func([]byte) []byte
	if plan.needPrefill {
		p := <-pres
		pres <- p
		if p.failed() {
			dCancel(errPrefillFailed)
			return fail(errPrefillFailed)
		}
		eventT, bodyT = plan.rewrite(p)
	}
	dresp.Body = &firstByte{ReadCloser: dresp.Body, at: func() {
		res.decodeStarted = true
		x.Metrics.PDTTFT.WithLabelValues(model, runtime).Observe(time.Since(start).Seconds())
	}}
	var err error
	if bodyT != nil && !isStream(dresp) {
		err = relayBody(rw, dresp, bodyT)
	} else {
		err = x.Proxy.Relay(rw, dresp, eventT)
	}
	var re *proxy.ReadError
	if errors.As(err, &re) && !re.Written && context.Cause(dCtx) == errPrefillFailed {
		return fail(errPrefillFailed)
	}
	if err == nil {
		unlink() // the decode is complete: let the prefill leg finish on its own
		pair.Decode.Record(dresp.StatusCode, nil)
	} else if context.Cause(dCtx) == errPrefillFailed {
		res.outcome = "prefill_failed"
		x.Log.Warn("prefill leg failed after the decode began answering; aborting", "prefill", pair.Prefill.URL)
		res.err = proxy.ErrAbort
		return res
	}
	res.err = x.Proxy.Finish(r, pair.Decode, LegDecode, err)
	switch {
	case errors.Is(res.err, proxy.ErrClientGone):
		res.outcome = "client_cancelled"
	case errors.Is(res.err, proxy.ErrAbort):
		res.outcome = "aborted"
	case res.err != nil:
		res.outcome = "decode_failed"
	}
	return res
}

func isStream(resp *http.Response) bool {
	return strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
}

// decodeFailed handles a decode that did not answer (err) or answered non-2xx (status). A
// decode often fails because its prefill did (the bootstrap it waits for is gone): the prefill
// is cancelled and, if it had failed on its own, its failure is the client's answer and the
// decode is not penalised.
func (x *Parallel) decodeFailed(r *http.Request, pair worker.Pair, status int, err error, dCancel context.CancelCauseFunc, pres chan prefillResult, outcome *string) error {
	if proxy.ClientGone(r) {
		*outcome = "client_cancelled"
		return proxy.ErrClientGone
	}
	dCancel(errDecodeFailed)
	p := <-pres
	pres <- p
	if p.failed() {
		return x.prefillError(pair, p, outcome)
	}
	*outcome = "decode_failed"
	if status == 0 {
		return x.Proxy.Failure(r, pair.Decode, LegDecode, err)
	}
	pair.Decode.Record(status, nil)
	x.Log.Warn("decode leg failed; prefill leg cancelled", "decode", pair.Decode.URL, "prefill", pair.Prefill.URL, "status", status)
	return err
}

// prefillError is the client's error for a failed prefill leg.
func (x *Parallel) prefillError(pair worker.Pair, p prefillResult, outcome *string) error {
	*outcome = "prefill_failed"
	x.Log.Warn("prefill leg failed; decode leg cancelled", "prefill", pair.Prefill.URL, "decode", pair.Decode.URL, "status", p.status, "err", p.err)
	if p.err != nil {
		return proxy.Classify(pair.Prefill, LegPrefill, x.Proxy.Timeout, p.err)
	}
	return upstreamError(LegPrefill, pair.Prefill, p.status, p.header, p.body)
}

// legFailed answers a request whose decode leg did not answer: because its prefill failed
// (the prefill's error is the client's), because the client left, or on its own.
func (x *Parallel) legFailed(r *http.Request, pair worker.Pair, derr error, dCtx context.Context, pres chan prefillResult, outcome *string) error {
	if context.Cause(dCtx) == errPrefillFailed {
		p := <-pres
		pres <- p
		return x.prefillError(pair, p, outcome)
	}
	if proxy.ClientGone(r) {
		*outcome = "client_cancelled"
		return proxy.ErrClientGone
	}
	*outcome = "decode_failed"
	return x.Proxy.Failure(r, pair.Decode, LegDecode, derr)
}

// safePrefill runs prefill on the leg's own goroutine: a panic there fails the request (500),
// never the process.
func (x *Parallel) safePrefill(ctx context.Context, r *http.Request, req *Request, w *worker.Worker, body []byte, hdr http.Header, keep bool) (p prefillResult) {
	defer func() {
		if v := recover(); v != nil {
			p = prefillResult{err: x.Proxy.Recovered("prefill_leg", v)}
		}
	}()
	return x.prefill(ctx, r, req, w, body, hdr, keep)
}

// prefill sends the prefill leg and reads its whole answer (keeping it when keep is set or the
// leg failed), recording its outcome.
func (x *Parallel) prefill(ctx context.Context, r *http.Request, req *Request, w *worker.Worker, body []byte, hdr http.Header, keep bool) prefillResult {
	resp, err := x.Proxy.Send(ctx, r, w, req.Path, body, hdr)
	if err != nil {
		if cancelled(ctx, err) { // Baton cancelled the leg: not the worker's fault
			return prefillResult{err: context.Canceled}
		}
		w.Record(0, err)
		return prefillResult{err: err}
	}
	defer resp.Body.Close()
	ok := resp.StatusCode >= 200 && resp.StatusCode <= 299
	var b []byte
	if ok && !keep {
		_, err = io.Copy(io.Discard, resp.Body)
	} else {
		b, err = proxy.ReadBody(resp.Body)
	}
	if err != nil {
		if cancelled(ctx, err) {
			return prefillResult{status: resp.StatusCode, err: context.Canceled}
		}
		w.Record(0, err)
		return prefillResult{status: resp.StatusCode, err: err}
	}
	w.Record(resp.StatusCode, nil)
	return prefillResult{status: resp.StatusCode, header: resp.Header, body: b}
}

// relayBody answers with the decode's whole non-streamed body passed through transform.
func relayBody(rw http.ResponseWriter, dresp *http.Response, transform func([]byte) []byte) error {
	body, err := proxy.ReadBody(dresp.Body)
	if err != nil {
		return &proxy.ReadError{Err: err}
	}
	out := transform(body)
	h := rw.Header()
	proxy.CopyResponseHeaders(h, dresp.Header)
	h.Set("Content-Length", strconv.Itoa(len(out)))
	rw.WriteHeader(dresp.StatusCode)
	if _, err := rw.Write(out); err != nil {
		return proxy.ErrClientGone
	}
	return nil
}

// firstByte calls at once, when the first body bytes are read.
type firstByte struct {
	io.ReadCloser
	at   func()
	done bool
}

func (f *firstByte) Read(p []byte) (int, error) {
	n, err := f.ReadCloser.Read(p)
	if n > 0 && !f.done {
		f.done = true
		f.at()
	}
	return n, err
}

// BootstrapBodies returns the prefill and decode leg bodies: the client's bytes plus
// bootstrap_host, bootstrap_port and bootstrap_room (arrays of length N for a batch of N, with a
// fresh room each), and, for workers with DP ranks, routed_dp_rank on each leg and
// disagg_prefill_dp_rank on the decode. Client values of these keys are replaced.
func BootstrapBodies(req *Request, pair worker.Pair) (prefill, decode []byte, err error) {
	host, _ := json.Marshal(pair.Prefill.BootstrapHost)
	port := []byte("null")
	if p := pair.Prefill.BootstrapPort; p != nil {
		port = strconv.AppendInt(nil, int64(*p), 10)
	}
	var room []byte
	if n := req.Batch; n > 0 {
		hosts, ports, rooms := []byte{'['}, []byte{'['}, []byte{'['}
		for i := 0; i < n; i++ {
			if i > 0 {
				hosts, ports, rooms = append(hosts, ','), append(ports, ','), append(rooms, ',')
			}
			hosts, ports = append(hosts, host...), append(ports, port...)
			rooms = strconv.AppendUint(rooms, newRoom(), 10)
		}
		host, port, room = append(hosts, ']'), append(ports, ']'), append(rooms, ']')
	} else {
		room = strconv.AppendUint(nil, newRoom(), 10)
	}
	common := []openai.Field{{Key: "bootstrap_host", Value: host}, {Key: "bootstrap_port", Value: port}, {Key: "bootstrap_room", Value: room}}
	pFields, dFields := common, common
	// The DP rank fields are Baton's: a client's values never reach a leg, where they would
	// send the KV to a rank the other leg does not look at.
	pDel, dDel := []string{keyDPRankDeprecated, keyPrefillDPRank}, []string{keyDPRankDeprecated}
	if rank, ok := pair.Prefill.NextRank(); ok {
		v := strconv.AppendInt(nil, int64(rank), 10)
		pFields = append(pFields[:len(pFields):len(pFields)], openai.Field{Key: keyRoutedDPRank, Value: v})
		dFields = append(dFields[:len(dFields):len(dFields)], openai.Field{Key: keyPrefillDPRank, Value: v})
	} else {
		pDel, dDel = append(pDel, keyRoutedDPRank), append(dDel, keyPrefillDPRank)
	}
	if rank, ok := pair.Decode.NextRank(); ok {
		dFields = append(dFields[:len(dFields):len(dFields)], openai.Field{Key: keyRoutedDPRank, Value: strconv.AppendInt(nil, int64(rank), 10)})
	} else {
		dDel = append(dDel, keyRoutedDPRank)
	}
	if prefill, err = openai.Edit(req.Body, pFields, pDel); err != nil {
		return nil, nil, err
	}
	if decode, err = openai.Edit(req.Body, dFields, dDel); err != nil {
		return nil, nil, err
	}
	return prefill, decode, nil
}

// SGLang's DP rank fields (python/sglang/srt/managers/io_struct.py): the rank a leg runs on,
// the prefill rank a decode pulls from, and the deprecated alias of the first.
const (
	keyRoutedDPRank     = "routed_dp_rank"
	keyPrefillDPRank    = "disagg_prefill_dp_rank"
	keyDPRankDeprecated = "data_parallel_rank"
)

// newRoom returns a bootstrap room: uniform in [0, 2^63-1].
func newRoom() uint64 { return rand.Uint64() & (1<<63 - 1) }

// seamFailure reports whether a PD failure is the kind a broken pair produces: a 5xx or a
// transport error, not a client error, and not a cancellation.
func seamFailure(err error) bool {
	var e *openai.Error
	if errors.As(err, &e) {
		return e.Status >= 500 && e.Code != openai.CodeInternalError
	}
	return errors.Is(err, proxy.ErrAbort)
}

// cancelled reports whether err is the cancellation of ctx (by Baton or the client), as opposed
// to a failure that happened before it.
func cancelled(ctx context.Context, err error) bool {
	if errors.Is(err, context.Canceled) {
		return true
	}
	cause := context.Cause(ctx)
	return cause != nil && errors.Is(err, cause)
}
