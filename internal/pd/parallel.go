package pd

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"sync"

	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
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

// Execute implements Executor.
func (x *Parallel) Execute(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair) error {
	pBody, dBody, err := BootstrapBodies(req, pair)
	if err != nil {
		x.Metrics.PDBootstrapFailures.Inc()
		return &openai.Error{Status: http.StatusBadRequest, Code: "bootstrap_injection_failed", Message: err.Error()}
	}
	rw.Header().Set(openai.HeaderKVHandoff, HandoffBootstrap)
	x.Metrics.PDHandoffs.WithLabelValues(HandoffBootstrap, HandoffBootstrap).Inc()
	return x.run(rw, r, req, pair, concurrentPlan{
		prefillBody: pBody, decodeBody: dBody, dispatch: "parallel",
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
	dispatch                    string // metrics label
	// needPrefill holds the decode's answer until the prefill answered; rewrite then returns
	// the transforms of the decode's streamed events and of its whole body (nil: unchanged).
	needPrefill bool
	rewrite     func(p prefillResult) (event func([]byte) []byte, body func([]byte) []byte)
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
}

func (p prefillResult) failed() bool {
	return (p.err != nil && !errors.Is(p.err, context.Canceled)) || (p.err == nil && (p.status < 200 || p.status > 299))
}

// run sends both legs at once and relays the decode's answer. A leg that fails before the
// decode's first byte cancels the other; the client gets the failing leg's status.
func (x *Parallel) run(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair, plan concurrentPlan) concurrentResult {
	l := x.newLegs(rw, r, req, pair, plan)
	defer l.close()
	l.startPrefill()
	l.res.err = l.decode()
	x.Metrics.PDRequests.WithLabelValues(l.model, plan.dispatch, string(l.res.outcome)).Inc()
	switch {
	case l.res.outcome == OutcomeSuccess:
		x.Pairs.Record(pair.Prefill, pair.Decode, true)
	case l.res.outcome != OutcomeClientCancelled && seamFailure(l.res.err):
		x.Pairs.Record(pair.Prefill, pair.Decode, false)
	}
	return l.res
}

// seamFailure reports whether a PD failure is the kind a broken pair produces (package outcome
// says which statuses), not a client error, a cancellation or Baton's own bug.
func seamFailure(err error) bool {
	var e *openai.Error
	if errors.As(err, &e) {
		return outcome.Status(e.Status).Seam && e.Code != openai.CodeInternalError
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
