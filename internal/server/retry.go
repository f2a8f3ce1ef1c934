package server

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/retry"
)

// attemptFunc is one try at a request. r carries the request's total deadline; avoid holds the
// URLs of workers that already failed this request. It returns nil once the response is
// complete, proxy.ErrClientGone or proxy.ErrAbort, or an unwritten *openai.Error or
// *proxy.UpstreamError.
type attemptFunc func(r *http.Request, avoid map[string]bool) error

// withRetries runs attempt until it succeeds, fails for good, or runs out of tries or time:
// retries happen only on 408/429/500/502/503/504 and transport errors, only before any byte
// reached the client, after a jittered exponential wait, each retry re-selecting the worker and
// avoiding those that failed, all within the request deadline r carries. The final failure is
// written here.
func (s *Server) withRetries(w http.ResponseWriter, r *http.Request, attempt attemptFunc) {
	var avoid map[string]bool
	for n := 1; ; n++ {
		err := attempt(r, avoid)
		if err == nil {
			return
		}
		reason, retryable := retryReason(err)
		if retryable && n < s.opts.Retry.Attempts {
			s.metrics.Retries.WithLabelValues(r.Pattern, reason).Inc()
			s.log.Debug("retrying", "route", r.Pattern, "reason", reason, "attempt", n, "err", err)
			if retry.Sleep(r.Context(), s.opts.Retry.Backoff.Delay(n)) {
				avoid = failed(avoid, err)
				for _, h := range openai.AttemptHeaders {
					w.Header().Del(h)
				}
				continue
			}
			err, retryable = context.Cause(r.Context()), false // the deadline passed or the client left
		}
		if retryable {
			s.metrics.RetriesExhausted.WithLabelValues(r.Pattern).Inc()
		}
		s.writeFailure(w, r, err)
		return
	}
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
func (s *Server) writeFailure(w http.ResponseWriter, r *http.Request, err error) {
	var (
		oe *openai.Error
		ue *proxy.UpstreamError
	)
	switch {
	case errors.Is(err, proxy.ErrAbort):
		panic(http.ErrAbortHandler)
	case errors.As(err, &oe):
		openai.WriteError(w, oe)
	case errors.As(err, &ue):
		ue.Write(w)
	case errors.Is(err, proxy.ErrClientGone), proxy.ClientGone(r):
	case proxy.IsTimeout(err):
		openai.WriteError(w, &openai.Error{Status: http.StatusGatewayTimeout, Code: openai.CodeUpstreamTimeout,
			Message: "the request did not complete within request_timeout_secs"})
	default:
		s.log.Error("request failed with an unclassified error", "err", err)
		openai.WriteError(w, proxy.InternalError())
	}
}

// retryReason reports whether err may be retried and why (a metrics label).
func retryReason(err error) (string, bool) {
	var (
		oe *openai.Error
		ue *proxy.UpstreamError
	)
	switch {
	case errors.As(err, &oe):
		if oe.NoRetry || !proxy.RetryableStatus(oe.Status) {
			return "", false
		}
		switch {
		case strings.HasSuffix(oe.Code, openai.CodeUpstreamUnreachable):
			return "transport", true
		case strings.HasSuffix(oe.Code, openai.CodeUpstreamTimeout):
			return "timeout", true
		}
		return "status_" + strconv.Itoa(oe.Status), true
	case errors.As(err, &ue):
		return "status_" + strconv.Itoa(ue.Status), proxy.RetryableStatus(ue.Status)
	}
	return "", false
}

// failedWorker returns the URL of the worker a failure belongs to, if known.
func failedWorker(err error) string {
	var (
		oe *openai.Error
		ue *proxy.UpstreamError
	)
	switch {
	case errors.As(err, &oe):
		return oe.Worker
	case errors.As(err, &ue):
		return ue.Worker
	}
	return ""
}
