package server

import (
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/proxy"
)

// attemptFunc is one try at a request. r carries the request's total deadline; avoid holds the
// URLs of workers that already failed this request. It returns nil once the response is
// complete, proxy.ErrClientGone or proxy.ErrAbort, or an unwritten *openai.Error or
// *proxy.UpstreamError.
type attemptFunc func(r *http.Request, avoid map[string]bool) error

// headers an attempt sets that must not leak into the next one.
var attemptHeaders = []string{openai.HeaderWorker, "X-Baton-Prefill-Worker", "X-Baton-Decode-Worker", "X-Baton-Kv-Handoff"}

// withRetries runs attempt until it succeeds, fails for good, or runs out of tries or time:
// retries happen only on 408/429/500/502/503/504 and transport errors, only before any byte
// reached the client, waiting an exponential, jittered backoff (cancelled with the client), each
// retry re-selecting the worker, all within the request deadline r carries. The final failure is
// written here.
func (s *Server) withRetries(w http.ResponseWriter, r *http.Request, attempt attemptFunc) {
	timeout := time.Duration(s.cfg.RequestTimeoutSecs) * time.Second
	ctx := r.Context() // carries the request deadline, set on arrival (observe)
	rc := s.cfg.Retry
	tries := uint(rc.MaxRetries)
	if rc.Disable {
		tries = 1
	}
	route := r.Pattern
	var avoid map[string]bool
	// step runs one attempt and classifies its failure for the backoff loop.
	step := func(err error) (struct{}, error) {
		if err == nil {
			return struct{}{}, nil
		}
		if _, ok := retryReason(err); !ok {
			return struct{}{}, backoff.Permanent(err)
		}
		if u := failedWorker(err); u != "" {
			if avoid == nil {
				avoid = map[string]bool{}
			}
			avoid[u] = true
		}
		return struct{}{}, err
	}
	clear := func() {
		for _, h := range attemptHeaders {
			w.Header().Del(h)
		}
	}
	// The first attempt runs outside the backoff loop, which most requests never need.
	_, err := step(attempt(r, avoid))
	if err != nil && tries > 1 && !isPermanent(err) {
		b := &backoff.ExponentialBackOff{
			InitialInterval:     time.Duration(rc.InitialBackoffMs) * time.Millisecond,
			RandomizationFactor: rc.JitterFactor,
			Multiplier:          rc.BackoffMultiplier,
			MaxInterval:         time.Duration(rc.MaxBackoffMs) * time.Millisecond,
		}
		first := true
		_, err = backoff.Retry(ctx, func() (struct{}, error) {
			if first { // the attempt above, already made: the loop waits, then retries
				first = false
				return struct{}{}, err
			}
			clear()
			return step(attempt(r, avoid))
		},
			backoff.WithBackOff(b), backoff.WithMaxTries(tries), backoff.WithMaxElapsedTime(timeout),
			backoff.WithNotify(func(err error, d time.Duration) {
				reason, _ := retryReason(err)
				s.metrics.Retries.WithLabelValues(route, reason).Inc()
				s.log.Debug("retrying", "route", route, "reason", reason, "backoff", d, "err", err)
			}))
	}
	var perm *backoff.PermanentError
	if errors.As(err, &perm) {
		err = perm.Unwrap()
	}
	if err == nil {
		return
	}
	if _, ok := retryReason(err); ok {
		s.metrics.RetriesExhausted.WithLabelValues(route).Inc()
	}
	s.writeFailure(w, r, err)
}

func isPermanent(err error) bool {
	var perm *backoff.PermanentError
	return errors.As(err, &perm)
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
