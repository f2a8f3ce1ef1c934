// Package outcome is the one table that says what an upstream result means to Baton: whether a
// retry on another worker may help, whether it is a sample for the worker's circuit breaker and
// a failure there, whether a broken prefill/decode pair produces it, and whether the client
// caused it. Every decision about an upstream result reads it from here: a request's failure is
// one Failure (failure.go), and its Verdict decides.
package outcome

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"syscall"
)

// ErrRequestTimeout is the cause of a request whose total deadline (request_timeout_secs)
// passed.
var ErrRequestTimeout = errors.New("request deadline exceeded")

// ErrStalled is the cause of a stream given up on because its engine sent nothing for the
// stream stall timeout after its first byte.
var ErrStalled = errors.New("the engine sent nothing for the stream stall timeout")

// Verdict is how Baton treats one upstream result.
type Verdict struct {
	Retryable bool   // a retry on another worker may succeed
	Sample    bool   // the result says something about the worker (a breaker sample)
	Failure   bool   // the sample counts against the worker
	Seam      bool   // a broken prefill/decode pair produces this (pair quarantine)
	Client    bool   // the client caused it by leaving: never the worker's fault
	Reason    string // why a retry happens (metrics label): status_<code>, transport, timeout
}

// Of returns the verdict on a worker's answer with status, or, when err is set, on the error
// that kept the worker from answering (or ended its answer).
func Of(status int, err error) Verdict {
	if err != nil {
		return Err(err)
	}
	return Status(status)
}

// Status is the verdict on a worker's answer with status:
//
//	408                  retryable, failure
//	429                  retryable, no sample (busy, not broken)
//	500 502 503 504      retryable, failure, seam
//	other 5xx            not retryable, success sample, seam
//	anything else        not retryable, success sample
func Status(status int) Verdict {
	switch status {
	case http.StatusRequestTimeout:
		return Verdict{Retryable: true, Sample: true, Failure: true, Reason: statusReason(status)}
	case http.StatusTooManyRequests:
		return Verdict{Retryable: true, Reason: statusReason(status)}
	case http.StatusInternalServerError, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return Verdict{Retryable: true, Sample: true, Failure: true, Seam: true, Reason: statusReason(status)}
	}
	return Verdict{Sample: true, Seam: status >= 500}
}

// statusReason is the retry reason of a retryable status (made only for those: every answer's
// status is judged).
func statusReason(status int) string { return "status_" + strconv.Itoa(status) }

// Err is the verdict on an error instead of (or in the middle of) an answer:
//
//	cancellation (the client left, or Baton ended the leg)   no sample, not retryable
//	Baton's own fault (ErrInternal: a recovered panic)       no sample, not retryable: internal
//	Baton out of descriptors, ports or buffers (Local)       no sample, not retryable: local
//	the engine refused Baton's own key (ErrKeyRefused)       retryable, failure: key_refused
//	a deadline passing (the request's or a leg's)            retryable, failure, seam: timeout
//	any other transport or read failure                      retryable, failure, seam: transport
func Err(err error) Verdict {
	switch {
	case errors.Is(err, ErrKeyRefused):
		return Verdict{Retryable: true, Sample: true, Failure: true, Reason: "key_refused"}
	case errors.Is(err, context.Canceled):
		return Verdict{Client: true}
	case errors.Is(err, ErrInternal):
		return Verdict{Reason: "internal"}
	case Local(err):
		// Baton's own descriptors or ports ran out: no worker is at fault, and another is no
		// better placed.
		return Verdict{Reason: "local"}
	case IsTimeout(err):
		return Verdict{Retryable: true, Sample: true, Failure: true, Seam: true, Reason: "timeout"}
	}
	return Verdict{Retryable: true, Sample: true, Failure: true, Seam: true, Reason: "transport"}
}

// ErrKeyRefused is an engine answering 401 or 403 to the key Baton sent it (a worker's api_key,
// --worker-api-key, --api-key): every request of that worker would be refused, and the client's
// own key had no part in it.
var ErrKeyRefused = errors.New("the engine refused the key Baton sends it")

// Local reports whether err is Baton running out of its own resources to open a connection —
// descriptors (EMFILE, ENFILE), local ports (EADDRNOTAVAIL) or socket buffers (ENOBUFS) — which
// says nothing of the worker it was opening one to.
func Local(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.EADDRNOTAVAIL) || errors.Is(err, syscall.ENOBUFS)
}

// IsTimeout reports whether err is a deadline passing: the request's own (ErrRequestTimeout)
// or a leg's.
func IsTimeout(err error) bool {
	return errors.Is(err, ErrRequestTimeout) || errors.Is(err, context.DeadlineExceeded)
}
