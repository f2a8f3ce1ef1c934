package server

import (
	"context"
	"errors"
	"net/http"
	"strconv"

	"go.opentelemetry.io/otel/attribute"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/tracing"
)

// attemptFunc is one try at a request. r carries the request's total deadline; avoid holds the
// URLs of workers that already failed this request. It returns nil once the response is
// complete, proxy.ErrClientGone or proxy.ErrAbort, or an unwritten *outcome.Failure.
type attemptFunc func(r *http.Request, avoid map[string]bool) error

// withRetries runs attempt until it succeeds, fails for good, or runs out of tries or time:
// retries happen only on 408/429/500/502/503/504 and transport errors, only before any byte
// reached the client, after a jittered exponential wait, each retry re-selecting the worker and
// avoiding those that failed, all within the request deadline r carries. The final failure is
// written here.
//
// When the tries end because no worker is left to try, the client gets the last worker's
// answer (or failure) instead of "no available workers": the final failure is the last
// worker's answer, unchanged.
func (s *Server) withRetries(w http.ResponseWriter, r *http.Request, rec *record.Record, attempt attemptFunc) {
	var avoid map[string]bool
	var last *outcome.Failure // the last failure a worker answered or caused
	for n := 1; ; n++ {
		ar := r
		if n > 1 {
			ar = retryRequest(r, n)
		}
		err := attempt(ar, avoid)
		if err == nil {
			return
		}
		var f *outcome.Failure
		answer := err
		if errors.As(err, &f) {
			switch {
			case f.Worker != "":
				last = f
			case f.NoWorker && last != nil:
				answer = lastAnswer{err: err, last: last}
			}
		}
		var again bool
		if avoid, again = s.afterFailure(w, r, rec, n, avoid, answer); !again {
			return
		}
	}
}

// lastAnswer is a selection that found no worker, after a worker's failure: it is retried as
// the selection's failure, and answered as the worker's.
type lastAnswer struct {
	err  error
	last *outcome.Failure
}

func (e lastAnswer) Error() string { return e.err.Error() }
func (e lastAnswer) Unwrap() error { return e.err }

// retryRequest is r for attempt n > 1: its own copy of the headers, with a fresh engine request
// id — the client's X-Request-Id suffixed "-retry-<n>" — so that no engine sees one id twice
// (a leg of an earlier attempt may still be alive there, and engines key requests, aborts and
// some KV handoffs by it). The client's id stays in logs and in the response.
func retryRequest(r *http.Request, n int) *http.Request {
	ctx := r.Context()
	if tracing.Enabled() {
		ctx = tracing.WithAttempt(ctx, n)
	}
	ar := r.Clone(ctx)
	if rid := r.Header.Get(openai.HeaderRequestID); rid != "" {
		ar.Header.Set(openai.HeaderRequestID, rid+"-retry-"+strconv.Itoa(n))
	}
	return ar
}

// afterFailure decides what follows attempt n's failure: another attempt (after the backoff,
// avoiding the worker that failed), or the client's answer. It is its own function so that
// withRetries, under every open stream, keeps a small stack frame.
func (s *Server) afterFailure(w http.ResponseWriter, r *http.Request, rec *record.Record, n int, avoid map[string]bool, err error) (map[string]bool, bool) {
	reason, retryable := retryReason(err)
	if retryable && s.d.TriesLeft(n) {
		s.metrics.Retries.WithLabelValues(r.Pattern, reason).Inc()
		tracing.Event(r.Context(), "retry", attribute.Int("baton.attempt", n), attribute.String("baton.retry.reason", reason))
		rec.Attempts = n + 1
		s.log.Debug("retrying", "route", r.Pattern, "reason", reason, "attempt", n, "err", err)
		if s.d.Backoff(r.Context(), n) {
			avoid = failed(avoid, err)
			rec.NextAttempt()
			return avoid, true
		}
		err, retryable = context.Cause(r.Context()), false // the deadline passed or the client left
	}
	if retryable {
		s.metrics.RetriesExhausted.WithLabelValues(r.Pattern).Inc()
	}
	if la, ok := err.(lastAnswer); ok {
		err = la.last
		if rec.Worker == "" {
			rec.Worker = la.last.Worker // the answer's head names the worker that gave it
		}
	}
	s.writeFailure(w, r, rec, err)
	return avoid, false
}

// failed adds the worker err belongs to, if known, to avoid.
func failed(avoid map[string]bool, err error) map[string]bool {
	if u := failedWorker(err); u != "" {
		if avoid == nil {
			avoid = map[string]bool{}
		}
		avoid[u] = true
	}
	return avoid
}

// writeFailure answers the client for the final failure of a request.
func (s *Server) writeFailure(w http.ResponseWriter, r *http.Request, rec *record.Record, err error) {
	var (
		f  *outcome.Failure
		ib *proxy.InBandError
	)
	switch {
	case errors.Is(err, proxy.ErrAbort):
		panic(http.ErrAbortHandler)
	case errors.As(err, &ib):
		// The stream went out whole, the engine's error event in it; the request failed. The
		// code is for the access log and the status page (the head left long ago).
		rec.Code = openai.CodeUpstreamStreamError
	case errors.As(err, &f):
		proxy.WriteFailure(w, f)
	case errors.Is(err, proxy.ErrClientGone), proxy.ClientGone(r):
	case outcome.IsTimeout(err):
		openai.WriteError(w, &openai.Error{Status: http.StatusGatewayTimeout, Code: openai.CodeUpstreamTimeout,
			Message: "the request did not complete within request_timeout_secs"})
	default:
		s.log.Error("request failed with an unclassified error", "err", err)
		openai.WriteError(w, proxy.InternalError())
	}
}

// retryReason reports whether err may be retried and why (a metrics label): the outcome
// table's verdict on the failure.
func retryReason(err error) (string, bool) {
	var f *outcome.Failure
	if !errors.As(err, &f) {
		return "", false
	}
	v := f.Verdict()
	return v.Reason, v.Retryable
}

// failedWorker returns the URL of the worker a failure belongs to, if known.
func failedWorker(err error) string {
	var f *outcome.Failure
	if errors.As(err, &f) {
		return f.Worker
	}
	return ""
}
