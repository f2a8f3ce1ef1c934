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
	"sync"
	"time"

	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/worker"
)

// maxPrefillBody bounds what Baton keeps of a prefill response (for logprob merging).
const maxPrefillBody = 64 << 20

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

	wg sync.WaitGroup // prefill legs still finishing after their decode completed
}

var _ Executor = (*Parallel)(nil)

// Wait waits for prefill legs that outlived their requests.
func (x *Parallel) Wait() { x.wg.Wait() }

// prefillResult is how a prefill leg ended.
type prefillResult struct {
	status int
	body   []byte // kept for logprob merging and error messages
	err    error  // transport or read error; context.Canceled when Baton cancelled it
}

func (p prefillResult) failed() bool {
	return (p.err != nil && !errors.Is(p.err, context.Canceled)) || (p.err == nil && (p.status < 200 || p.status > 299))
}

// Execute implements Executor.
func (x *Parallel) Execute(rw http.ResponseWriter, r *http.Request, req *Request, pair Pair) error {
	model := x.Metrics.Model(req.Model)
	runtime := pair.Prefill.Runtime()
	pBody, dBody, err := BootstrapBodies(req, pair)
	if err != nil {
		x.Metrics.PDBootstrapFailures.Inc()
		e := &openai.Error{Status: http.StatusBadRequest, Code: "bootstrap_injection_failed", Message: err.Error()}
		openai.WriteError(rw, e)
		return e
	}
	start := time.Now()
	timeout := x.Proxy.Timeout
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	dCtx, dCancel := context.WithCancelCause(ctx)
	defer dCancel(nil)
	// The prefill leg may outlive the handler (it answers after the transfer, around the time
	// the decode starts streaming); it is cancelled when the client leaves or the decode fails.
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
		res := x.prefill(pCtx, r, req, pair.Prefill, pBody)
		if res.failed() {
			dCancel(errPrefillFailed)
		} else if res.err == nil {
			x.Metrics.PDPrefillDuration.WithLabelValues(model, runtime).Observe(time.Since(start).Seconds())
		}
		pres <- res
	})
	outcome := "success"
	defer func() { x.Metrics.PDRequests.WithLabelValues(model, "parallel", outcome).Inc() }()

	dresp, derr := x.Proxy.Send(dCtx, r, pair.Decode, req.Path, dBody, nil)
	if derr == nil && (dresp.StatusCode < 200 || dresp.StatusCode > 299) {
		body, _ := io.ReadAll(io.LimitReader(dresp.Body, 1<<20))
		dresp.Body.Close()
		if context.Cause(dCtx) != errPrefillFailed {
			pair.Decode.Record(dresp.StatusCode, nil)
			dCancel(errDecodeFailed)
			outcome = "decode_failed"
			e := upstreamError(LegDecode, pair.Decode, dresp.StatusCode, body)
			x.Log.Warn("decode leg failed", "decode", pair.Decode.URL, "prefill", pair.Prefill.URL, "status", dresp.StatusCode)
			openai.WriteError(rw, e)
			return e
		}
	}
	if derr != nil || context.Cause(dCtx) == errPrefillFailed {
		return x.legFailed(rw, r, req, pair, derr, dCtx, pres, &outcome)
	}
	defer dresp.Body.Close()

	var transform func([]byte) []byte
	if req.ReturnLogprob {
		p := <-pres
		pres <- p
		if p.failed() {
			dCancel(errPrefillFailed)
			return x.legFailed(rw, r, req, pair, errPrefillFailed, dCtx, pres, &outcome)
		}
		pre := prefillLogprobs(p.body)
		if len(pre) > 0 {
			if req.Stream {
				transform = func(ev []byte) []byte { return mergeEvent(ev, pre) }
			} else {
				return x.relayMerged(rw, r, req, pair, dresp, pre, start, model, runtime, &outcome)
			}
		}
	}
	dresp.Body = &firstByte{ReadCloser: dresp.Body, at: func() {
		x.Metrics.PDTTFT.WithLabelValues(model, runtime).Observe(time.Since(start).Seconds())
	}}
	err = x.Proxy.Relay(rw, dresp, transform)
	var re *proxy.ReadError
	if errors.As(err, &re) && !re.Written && context.Cause(dCtx) == errPrefillFailed {
		return x.legFailed(rw, r, req, pair, errPrefillFailed, dCtx, pres, &outcome)
	}
	if err == nil {
		unlink() // the decode is complete: let the prefill leg finish on its own
		pair.Decode.Record(dresp.StatusCode, nil)
	} else if context.Cause(dCtx) == errPrefillFailed {
		outcome = "prefill_failed"
		x.Log.Warn("prefill leg failed after the decode began answering; aborting", "prefill", pair.Prefill.URL)
		return proxy.ErrAbort
	}
	err = x.Proxy.Finish(rw, r, pair.Decode, LegDecode, err)
	switch {
	case errors.Is(err, proxy.ErrClientGone):
		outcome = "client_cancelled"
	case errors.Is(err, proxy.ErrAbort):
		outcome = "aborted"
	case err != nil:
		outcome = "decode_failed"
	}
	return err
}

// legFailed answers a request whose decode leg did not answer: because its prefill failed
// (the prefill's error is the client's), because the client left, or on its own.
func (x *Parallel) legFailed(rw http.ResponseWriter, r *http.Request, req *Request, pair Pair, derr error, dCtx context.Context, pres chan prefillResult, outcome *string) error {
	if context.Cause(dCtx) == errPrefillFailed {
		p := <-pres
		pres <- p
		*outcome = "prefill_failed"
		x.Log.Warn("prefill leg failed; decode leg cancelled", "prefill", pair.Prefill.URL, "decode", pair.Decode.URL, "status", p.status, "err", p.err)
		var e *openai.Error
		if p.err != nil {
			e = proxy.Classify(pair.Prefill, LegPrefill, x.Proxy.Timeout, p.err)
		} else {
			e = upstreamError(LegPrefill, pair.Prefill, p.status, p.body)
		}
		openai.WriteError(rw, e)
		return e
	}
	if r.Context().Err() != nil {
		*outcome = "client_cancelled"
		return proxy.ErrClientGone
	}
	*outcome = "decode_failed"
	return x.Proxy.Fail(rw, r, pair.Decode, LegDecode, derr)
}

// prefill sends the prefill leg and reads its whole answer, recording its outcome.
func (x *Parallel) prefill(ctx context.Context, r *http.Request, req *Request, w *worker.Worker, body []byte) prefillResult {
	resp, err := x.Proxy.Send(ctx, r, w, req.Path, body, nil)
	if err != nil {
		if ctx.Err() != nil { // Baton cancelled the leg: not the worker's fault
			return prefillResult{err: context.Canceled}
		}
		w.Record(0, err)
		return prefillResult{err: err}
	}
	defer resp.Body.Close()
	ok := resp.StatusCode >= 200 && resp.StatusCode <= 299
	var b []byte
	if ok && !req.ReturnLogprob {
		_, err = io.Copy(io.Discard, resp.Body)
	} else {
		b, err = io.ReadAll(io.LimitReader(resp.Body, maxPrefillBody))
	}
	if err != nil {
		if ctx.Err() != nil {
			return prefillResult{status: resp.StatusCode, err: context.Canceled}
		}
		w.Record(0, err)
		return prefillResult{status: resp.StatusCode, err: err}
	}
	w.Record(resp.StatusCode, nil)
	return prefillResult{status: resp.StatusCode, body: b}
}

// relayMerged answers a non-streamed decode with the prefill's logprobs merged in.
func (x *Parallel) relayMerged(rw http.ResponseWriter, r *http.Request, req *Request, pair Pair, dresp *http.Response, pre map[int][]byte, start time.Time, model, runtime string, outcome *string) error {
	body, err := io.ReadAll(dresp.Body)
	if err != nil {
		*outcome = "decode_failed"
		return x.Proxy.Fail(rw, r, pair.Decode, LegDecode, err)
	}
	x.Metrics.PDTTFT.WithLabelValues(model, runtime).Observe(time.Since(start).Seconds())
	pair.Decode.Record(dresp.StatusCode, nil)
	merged := mergeBody(body, pre)
	h := rw.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(merged)))
	rw.WriteHeader(dresp.StatusCode)
	if _, err := rw.Write(merged); err != nil {
		*outcome = "client_cancelled"
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
func BootstrapBodies(req *Request, pair Pair) (prefill, decode []byte, err error) {
	host, _ := json.Marshal(pair.Prefill.BootstrapHost)
	port := []byte("null")
	if p := pair.Prefill.BootstrapPort; p != nil {
		port = strconv.AppendInt(nil, int64(*p), 10)
	}
	var room []byte
	if n := BatchSize(req); n > 0 {
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
	if rank, ok := pair.Prefill.NextRank(); ok {
		v := strconv.AppendInt(nil, int64(rank), 10)
		pFields = append(pFields[:len(pFields):len(pFields)], openai.Field{Key: "routed_dp_rank", Value: v})
		dFields = append(dFields[:len(dFields):len(dFields)], openai.Field{Key: "disagg_prefill_dp_rank", Value: v})
	}
	if rank, ok := pair.Decode.NextRank(); ok {
		dFields = append(dFields[:len(dFields):len(dFields)], openai.Field{Key: "routed_dp_rank", Value: strconv.AppendInt(nil, int64(rank), 10)})
	}
	if prefill, err = openai.Edit(req.Body, pFields, nil); err != nil {
		return nil, nil, err
	}
	if decode, err = openai.Edit(req.Body, dFields, nil); err != nil {
		return nil, nil, err
	}
	return prefill, decode, nil
}

// newRoom returns a bootstrap room: uniform in [0, 2^63-1].
func newRoom() uint64 { return rand.Uint64() & (1<<63 - 1) }
