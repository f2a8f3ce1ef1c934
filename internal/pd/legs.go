package pd

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/worker"
)

// legs is one concurrent dispatch in progress: both legs of one request at once. The prefill
// runs on its own goroutine and may outlive the request (it can answer around the time the
// decode starts streaming); it is cancelled when the client leaves or the decode fails, and the
// decode is cancelled when the prefill fails.
type legs struct {
	x    *Parallel
	rw   http.ResponseWriter
	r    *http.Request
	req  *Request
	pair worker.Pair
	plan concurrentPlan

	model, runtime string
	start          time.Time
	res            concurrentResult
	prefill        future       // the prefill leg's result
	ends           atomic.Int32 // legs ended: the second accounts for the request

	dleg      proxy.Leg
	computed  bool // what the record said of an answer computed before this decode leg was sent
	dCtx      context.Context
	dCancel   context.CancelCauseFunc
	closeDCtx context.CancelFunc
	unlink    func() bool // detaches the prefill from the decode's cancellation
}

// future is a value set once by one goroutine and read by others, any number of times.
type future struct {
	done chan struct{}
	v    prefillResult
}

func (f *future) set(v prefillResult) { f.v = v; close(f.done) }
func (f *future) wait() prefillResult { <-f.done; return f.v }

func (x *Parallel) newLegs(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair, plan concurrentPlan) *legs {
	l := &legs{x: x, rw: rw, r: r, req: req, pair: pair, plan: plan, start: time.Now(),
		model: x.Metrics.Model(req.Model), runtime: pair.Prefill.Runtime(), prefill: future{done: make(chan struct{})}}
	var ctx context.Context
	ctx, l.closeDCtx = context.WithTimeout(r.Context(), x.Proxy.Timeout)
	l.dCtx, l.dCancel = context.WithCancelCause(ctx)
	l.dleg.Start(pair.Decode, LegDecode)
	l.dleg.OnRank(plan.decodeRank - 1)
	l.res.outcome = OutcomeSuccess
	return l
}

func (l *legs) close() {
	l.dleg.Excuse() // a decode not ended otherwise failed because of its prefill, or was cancelled
	l.dCancel(nil)
	l.closeDCtx()
}

// startPrefill sends the prefill leg on its own goroutine.
func (l *legs) startPrefill() {
	x, r := l.x, l.r
	pCtx, pCancel := context.WithCancelCause(context.WithoutCancel(r.Context()))
	pCtx, pTimeout := context.WithTimeout(pCtx, x.Proxy.Timeout)
	l.unlink = context.AfterFunc(l.dCtx, func() { pCancel(context.Cause(l.dCtx)) })
	pleg := &proxy.Leg{}
	pleg.Start(l.pair.Prefill, LegPrefill)
	pleg.OnRank(l.plan.prefillRank - 1)
	x.wg.Go(func() {
		defer pCancel(nil)
		defer pTimeout()
		defer pleg.Excuse() // a leg Baton cancelled, or a panic: no sample
		p := x.safePrefill(pCtx, r, l.req, pleg, l.plan)
		if p.failed() {
			l.dCancel(errPrefillFailed)
		} else if p.err == nil {
			p.took = time.Since(l.start)
			x.Metrics.PDPrefillDuration.WithLabelValues(l.model, l.runtime).Observe(p.took.Seconds())
		}
		l.prefill.set(p)
		l.ended()
	})
}

// decode sends the decode leg and relays its answer, once the prefill answered when the plan
// needs it.
func (l *legs) decode() error {
	l.computed = l.req.Rec.AnswerComputed
	dresp, err := l.x.Proxy.Send(l.dCtx, l.r, &l.dleg, proxy.Call{Path: l.req.Path, Body: l.plan.decodeBody, Header: l.plan.decodeHeader, Rec: l.req.Rec})
	if err != nil {
		return l.decodeFailed(0, err)
	}
	defer dresp.Body.Close()
	if dresp.StatusCode < 200 || dresp.StatusCode > 299 {
		body, _ := io.ReadAll(io.LimitReader(dresp.Body, 1<<20))
		return l.decodeFailed(dresp.StatusCode, upstreamError(LegDecode, l.pair.Decode, dresp.StatusCode, dresp.Header, body))
	}
	var eventT, bodyT func([]byte) []byte
	if l.plan.needPrefill {
		p := l.prefill.wait()
		if p.failed() {
			l.dCancel(errPrefillFailed)
			return l.prefillError(p)
		}
		eventT, bodyT = l.plan.rewrite(p)
	}
	return l.relay(dresp, eventT, bodyT)
}

// relay relays the decode's answer, through the transforms when set.
func (l *legs) relay(dresp *http.Response, eventT, bodyT func([]byte) []byte) error {
	dresp.Body = onFirstByte(dresp.Body, func() {
		l.res.decodeStarted = true
		l.x.Metrics.PDTTFT.WithLabelValues(l.model, l.runtime).Observe(time.Since(l.start).Seconds())
	})

	var err error
	if bodyT != nil && !isStream(dresp) {
		err = relayBody(l.req.Rec, l.rw, dresp, bodyT)
	} else {
		err = l.x.Proxy.Relay(l.r.Context(), l.rw, dresp, eventT, l.req.Rec, l.req.Orders.On(l.dleg.W), l.dCancel)
	}
	prefillFailed := context.Cause(l.dCtx) == errPrefillFailed
	var re *proxy.ReadError
	switch {
	case err != nil && prefillFailed && errors.As(err, &re) && !re.Written:
		return l.prefillError(l.prefill.wait())
	case err != nil && prefillFailed:
		l.res.outcome = OutcomePrefillFailed
		l.x.Log.Warn("prefill leg failed after the decode began answering; aborting", "prefill", l.pair.Prefill.URL)
		return proxy.ErrAbort
	case err == nil:
		l.unlink() // the decode is complete: let the prefill leg finish on its own
		select {
		case <-l.prefill.done: // it has (it usually has, long before): its time is known
			l.req.Rec.PrefillTime = l.prefill.v.took
		default:
		}
	}
	err = l.x.Proxy.Finish(l.r, &l.dleg, dresp.StatusCode, err)
	l.res.outcome = outcomeOf(err, OutcomeDecodeFailed)
	return err
}

// decodeFailed handles a decode that did not answer (err) or answered non-2xx (status). A
// decode often fails because its prefill did (the bootstrap it waits for is gone): the prefill
// is cancelled and, if it had failed on its own, its failure is the client's answer and the
// decode is not penalised.
func (l *legs) decodeFailed(status int, err error) error {
	switch {
	case proxy.ClientGone(l.r):
		l.res.outcome = OutcomeClientCancelled
		return proxy.ErrClientGone
	case context.Cause(l.dCtx) == errPrefillFailed:
		return l.prefillError(l.prefill.wait())
	}
	l.dCancel(errDecodeFailed)
	p := l.prefill.wait()
	if p.failed() {
		return l.prefillError(p)
	}
	l.prefillAnswered(p)
	l.res.outcome = OutcomeDecodeFailed
	if status == 0 {
		return l.x.Proxy.Failure(l.r, &l.dleg, err)
	}
	l.dleg.Done(status, nil)
	l.x.Log.Warn("decode leg failed; prefill leg cancelled", "decode", l.pair.Decode.URL, "prefill", l.pair.Prefill.URL, "status", status)
	return err
}

// prefillAnswered notes on the record that a prefill whose decode failed had computed the
// prompt (it answered 2xx: its tenant is charged the prompt, record.Charge), with the prompt's
// count when its answer gave one. A prefill Baton cancelled when its decode failed is not noted:
// whether it had begun is not known.
func (l *legs) prefillAnswered(p prefillResult) {
	if p.err != nil || p.failed() {
		return
	}
	rec := l.req.Rec
	rec.PrefillComputed = true
	if pu := readPrefillUsage(p.body); pu.ok && rec.EnginePrompt == 0 {
		rec.EnginePrompt = pu.prompt
	}
}

// prefillError is the client's error for a failed prefill leg. A decode that had not begun its
// answer computed nothing for the request: it waits for the KV the prefill was to send (SGLang's
// decode holds a request in its prealloc and transfer queues until the transfer finished, and
// skips the prefill forward: python/sglang/srt/disaggregation/decode.py), and Baton cancelled
// it; its tenant is not charged for it (record.Charge), only for the prompt when the prefill
// failed after it was given it.
func (l *legs) prefillError(p prefillResult) error {
	l.res.outcome = OutcomePrefillFailed
	if rec := l.req.Rec; !l.res.decodeStarted {
		rec.AnswerComputed = l.computed
		rec.PrefillComputed = rec.PrefillComputed || p.err != nil && !proxy.Unreached(p.err)
	}
	if p.err == nil {
		l.x.Log.Warn("prefill leg failed; decode leg cancelled", "prefill", l.pair.Prefill.URL, "decode", l.pair.Decode.URL, "status", p.status)
	} else {
		l.x.Log.Warn("prefill leg failed; decode leg cancelled", "prefill", l.pair.Prefill.URL, "decode", l.pair.Decode.URL, "err", proxy.LogCause(p.err))
	}
	if p.err != nil {
		return proxy.Classify(l.pair.Prefill, LegPrefill, l.x.Proxy.Timeout, p.err)
	}
	return upstreamError(LegPrefill, l.pair.Prefill, p.status, p.header, p.body)
}

// safePrefill runs prefill on the leg's own goroutine: a panic there fails the request (500),
// never the process.
func (x *Parallel) safePrefill(ctx context.Context, r *http.Request, req *Request, leg *proxy.Leg, plan concurrentPlan) (p prefillResult) {
	defer func() {
		if v := recover(); v != nil {
			p = prefillResult{err: x.Proxy.Recovered("prefill_leg", v)}
		}
	}()
	return x.prefill(ctx, r, req, leg, plan)
}

// prefill sends the prefill leg and reads its whole answer (keeping it when the plan needs it or
// the leg failed), ending the leg with its outcome.
func (x *Parallel) prefill(ctx context.Context, r *http.Request, req *Request, leg *proxy.Leg, plan concurrentPlan) prefillResult {
	resp, err := x.Proxy.Send(ctx, r, leg, proxy.Call{Path: req.Path, Body: plan.prefillBody, Header: plan.prefillHeader, Rec: req.Rec})
	if err != nil {
		return x.prefillFailed(ctx, leg, 0, err)
	}
	defer resp.Body.Close()
	ok := resp.StatusCode >= 200 && resp.StatusCode <= 299
	var b []byte
	if ok && !plan.needPrefill {
		_, err = io.Copy(io.Discard, resp.Body)
	} else {
		b, err = proxy.ReadBody(resp.Body, resp.ContentLength)
	}
	if err != nil {
		return x.prefillFailed(ctx, leg, resp.StatusCode, err)
	}
	leg.Done(resp.StatusCode, nil)
	return prefillResult{status: resp.StatusCode, header: resp.Header, body: b}
}

// prefillFailed ends a prefill leg that could not answer: no sample when Baton cancelled it.
func (x *Parallel) prefillFailed(ctx context.Context, leg *proxy.Leg, status int, err error) prefillResult {
	if cancelled(ctx, err) {
		return prefillResult{status: status, err: context.Canceled}
	}
	leg.Done(0, err)
	return prefillResult{status: status, err: err}
}

// outcomeOf names how a request ended from the error that ended it; failed names a failure.
func outcomeOf(err error, failed Outcome) Outcome {
	switch f := outcome.FailureOf(err); {
	case f == nil:
		return OutcomeSuccess
	case f.Kind() == outcome.KindClientGone:
		return OutcomeClientCancelled
	case f.Phase == outcome.Streaming:
		return OutcomeAborted
	}
	return failed
}
