package pd

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
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

// Execute implements Executor.
func (x *Parallel) Execute(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair) error {
	if req.Rec == nil {
		req.Rec = &record.Record{} // a caller that reads nothing back
	}
	pBody, dBody, pRank, dRank, err := bootstrapLegs(req, pair)
	if err != nil {
		x.Metrics.PDBootstrapFailures.Inc()
		return outcome.Answer(&openai.Error{Status: http.StatusBadRequest, Code: openai.CodeBootstrapInjectionFailed, Message: err.Error()})
	}
	return x.run(rw, r, req, pair, concurrentPlan{
		prefillBody: pBody, decodeBody: dBody, prefillRank: pRank + 1, decodeRank: dRank + 1, dispatch: "parallel", handoff: HandoffBootstrap, connector: HandoffBootstrap,
		needPrefill: req.ReturnLogprob,
		rewrite: func(p prefillResult) (func([]byte) []byte, func([]byte) []byte) {
			pre := prefillLogprobs(p.body)
			if len(pre) == 0 {
				return nil, nil
			}
			return func(ev []byte) []byte { return mergeEvent(ev, pre) }, func(b []byte) []byte { return mergeBody(b, pre) }
		},
	}).err
}

// concurrentPlan is one concurrent dispatch: both legs at once.
type concurrentPlan struct {
	prefillBody, decodeBody     []byte
	prefillHeader, decodeHeader http.Header
	prefillRank, decodeRank     int    // the DP rank each leg runs on, plus one; 0: none
	dispatch                    string // metrics label
	// handoff and connector name the handoff for the response header and the counter.
	handoff, connector string
	// needPrefill holds the decode's answer until the prefill answered; rewrite then returns
	// the transforms of the decode's streamed events and of its whole body (nil: unchanged).
	needPrefill bool
	rewrite     func(p prefillResult) (event func([]byte) []byte, body func([]byte) []byte)
	// check, when set, is what the decode's usage says about the handoff (vLLM Mooncake).
	check *kvCheck
}

// concurrentResult is how a concurrent dispatch ended.
type concurrentResult struct {
	err           error
	outcome       Outcome
	decodeStarted bool // the decode's first body byte arrived
}

// prefillResult is how a prefill leg ended.
type prefillResult struct {
	status int
	header http.Header
	body   []byte // kept for logprob merging and error messages
	err    error  // transport or read error; context.Canceled when Baton cancelled it
	took   time.Duration
}

func (p prefillResult) failed() bool {
	return (p.err != nil && !errors.Is(p.err, context.Canceled)) || (p.err == nil && (p.status < 200 || p.status > 299))
}

// run sends both legs at once and relays the decode's answer. A leg that fails before the
// decode's first byte cancels the other; the client gets the failing leg's status.
func (x *Parallel) run(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair, plan concurrentPlan) concurrentResult {
	l := x.newLegs(rw, r, req, pair, plan)
	defer l.close()
	noteHandoff(req.Rec, plan.handoff) // its header leaves with the decode's first byte
	l.startPrefill()
	l.res.err = l.decode()
	if !l.res.decodeStarted {
		noteHandoff(req.Rec, HandoffNoneFailed) // the client gets an error
	}
	res := l.res
	l.ended()
	return res
}

// ended is called once by each leg as it ends; the later one accounts for the request, once
// both legs' outcomes are known (the prefill may outlive the decode's answer).
func (l *legs) ended() {
	if l.ends.Add(1) < 2 {
		return
	}
	o, handoff := l.res.outcome, l.plan.handoff
	if p := l.prefill.v; o == OutcomeSuccess && p.failed() {
		o = OutcomePrefillFailed // the answer did not come from the prefill's KV
	}
	if !l.res.decodeStarted || o == OutcomePrefillFailed || o == OutcomeDecodeFailed {
		handoff = HandoffNoneFailed
	} else if l.plan.check.recomputed() {
		handoff = HandoffRecomputed
	}
	x := l.x
	x.Metrics.PDRequests.WithLabelValues(l.model, l.plan.dispatch, string(o)).Inc()
	x.Metrics.PDHandoffs.WithLabelValues(handoff, HandoffClass(handoff), l.plan.connector).Inc()
	switch {
	case o == OutcomeSuccess:
		x.Pairs.Record(l.pair.Prefill, l.pair.Decode, true)
	case o == OutcomePrefillFailed && l.res.err == nil:
		// the prefill failed after the answer went out: its own status is the seam's verdict
		if outcome.Status(l.prefill.v.status).Seam || l.prefill.v.err != nil {
			x.Pairs.Record(l.pair.Prefill, l.pair.Decode, false)
		}
	case o != OutcomeClientCancelled && seamFailure(l.res.err):
		x.Pairs.Record(l.pair.Prefill, l.pair.Decode, false)
	}
}

// seamFailure reports whether a PD failure is the kind a broken pair produces (the outcome
// table's verdict), not a client error, a cancellation, or Baton's own bug or exhaustion.
func seamFailure(err error) bool {
	f := outcome.FailureOf(err)
	switch {
	case f == nil:
		return false
	case f.Phase == outcome.InBand:
		return outcome.Status(f.Status).Seam
	case f.Edge:
		return f.Phase == outcome.Streaming // the decode failed after its first byte
	}
	return f.Verdict().Seam
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

// noteHandoff writes the request's KV handoff outcome on its record. Never inlined: the frames
// under an open PD stream stay small.
//
//go:noinline
func noteHandoff(rec *record.Record, handoff string) { rec.Handoff = record.Handoff(handoff) }

// noteDecode writes the decode that serves the request on its record (never inlined, as
// noteHandoff).
//
//go:noinline
func noteDecode(rec *record.Record, url string) {
	rec.Decode, rec.Worker = url, url
}
