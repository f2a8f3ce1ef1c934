package server

import (
	"context"
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
// avoiding those that failed, all within the request deadline r carries. Every attempt's error
// is read once, as the failure it is (outcome.FailureOf); the final one is written here.
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
		f := outcome.FailureOf(attempt(ar, avoid))
		if f == nil {
			return
		}
		if f.Worker != "" {
			last = f
		}
		var again bool
		if avoid, again = s.afterFailure(w, r, rec, n, avoid, f, last); !again {
			return
		}
	}
}

// retryRequest is r for attempt n > 1: its own copy of the headers, with a fresh engine request
// id — the client's X-Request-Id suffixed "-retry-<n>" (retryID) — so that no engine sees one id twice
// (a leg of an earlier attempt may still be alive there, and engines key requests, aborts and
// some KV handoffs by it). The client's id stays in logs and in the response.
func retryRequest(r *http.Request, n int) *http.Request {
	ctx := r.Context()
	if tracing.Enabled() {
		ctx = tracing.WithAttempt(ctx, n)
	}
	ar := r.Clone(ctx)
	if rid := r.Header.Get(openai.HeaderRequestID); rid != "" {
		ar.Header.Set(openai.HeaderRequestID, retryID(rid, n))
	}
	return ar
}

// retryID is attempt n's engine request id for the client's id rid: rid-retry-<n>, rid cut so
// that the whole stays within the length Baton takes from a client (a Baton in front of another
// would otherwise see its retries' ids replaced, and refuse their answers as another request's).
func retryID(rid string, n int) string {
	suffix := "-retry-" + strconv.Itoa(n)
	return rid[:min(len(rid), openai.MaxRequestIDLen-len(suffix))] + suffix
}

// afterFailure decides what follows attempt n's failure f: another attempt (after the backoff,
// avoiding the worker that failed), or the client's answer — last, the last worker's failure,
// when f is a selection that found no worker left. It is its own function so that withRetries,
// under every open stream, keeps a small stack frame.
func (s *Server) afterFailure(w http.ResponseWriter, r *http.Request, rec *record.Record, n int, avoid map[string]bool, f, last *outcome.Failure) (map[string]bool, bool) {
	v := f.Verdict()
	if v.Retryable && s.d.TriesLeft(n) {
		s.metrics.Retries.WithLabelValues(r.Pattern, v.Reason).Inc()
		tracing.Event(r.Context(), "retry", attribute.Int("baton.attempt", n), attribute.String("baton.retry.reason", v.Reason))
		rec.Attempts = n + 1
		s.log.Debug("retrying", "route", r.Pattern, "reason", v.Reason, "attempt", n, "err", proxy.LogCause(f))
		if s.d.Backoff(r.Context(), n) {
			if f.Worker != "" {
				if avoid == nil {
					avoid = map[string]bool{}
				}
				avoid[f.Worker] = true
			}
			rec.NextAttempt()
			return avoid, true
		}
		f, v.Retryable = outcome.FailureOf(context.Cause(r.Context())), false // the deadline passed or the client left
	}
	if v.Retryable {
		s.metrics.RetriesExhausted.WithLabelValues(r.Pattern).Inc()
	}
	if f.NoWorker && last != nil {
		f = last
		if rec.Worker == "" {
			rec.Worker = last.Worker // the answer's head names the worker that gave it
		}
	}
	s.writeFailure(w, r, rec, f)
	return avoid, false
}

// writeFailure answers the client for the final failure of a request, by its phase and kind.
func (s *Server) writeFailure(w http.ResponseWriter, r *http.Request, rec *record.Record, f *outcome.Failure) {
	switch {
	case f.Phase == outcome.Streaming:
		panic(http.ErrAbortHandler)
	case f.Phase == outcome.InBand:
		// The stream went out whole, the engine's error event in it; the request failed. The
		// code is for the access log and the status page (the head left long ago).
		rec.Code = openai.CodeUpstreamStreamError
	case !f.Edge:
		proxy.WriteFailure(w, f)
	case f.Kind() == outcome.KindClientGone, proxy.ClientGone(r):
	case f.Kind() == outcome.KindTimeout:
		openai.WriteError(w, &openai.Error{Status: http.StatusGatewayTimeout, Code: openai.CodeUpstreamTimeout, RetryAfter: "1",
			Message: "the request did not complete within request_timeout_secs"})
	default:
		s.log.Error("request failed with an unclassified error", "err", proxy.LogCause(f.Cause))
		openai.WriteError(w, proxy.InternalError())
	}
}
