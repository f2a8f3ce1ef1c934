package outcome

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/baton-llm/baton/internal/openai"
)

// ErrInternal marks Baton's own fault (a recovered panic): never a worker's, never retried,
// never a breaker sample or a broken pair.
var ErrInternal = errors.New("internal error")

// Failure is a request's failure before any byte of an answer reached the client, classified
// once where it happened: which leg and worker, the worker's status or the cause that kept it
// from answering, and what the client is told. Its Verdict — the table above — is the only
// thing that decides a retry, the worker a retry avoids, and whether it is a broken pair's.
type Failure struct {
	Leg    string // the PD leg that failed ("prefill", "decode"); "" for a regular request
	Worker string // the worker at fault, avoided by a retry; "" when none is
	// Status is the worker's answer, or — for a failure no worker answered (no worker to
	// select, a pair that cannot hand off) — the status Baton answers with; 0 with a Cause.
	Status int
	Cause  error // what kept the worker from answering (a transport failure, a deadline, a panic)
	Final  bool  // no retry can help (n>1 without a handoff, a route no worker serves)
	// NoWorker marks a selection that found no worker to try (after retries avoided those that
	// failed): a worker's earlier answer, if there was one, is the client's answer instead.
	NoWorker bool

	// The client's answer: Baton's envelope, or — Answer nil — the worker's own error answer
	// as it sent it (Header, Body), held so that a retry could replace it.
	Answer *openai.Error
	Header http.Header
	Body   []byte
}

// Answer is the failure Baton itself answers with e, judged by its status.
func Answer(e *openai.Error) *Failure { return &Failure{Status: e.Status, Answer: e} }

// FinalAnswer is Answer for a failure no retry can help.
func FinalAnswer(e *openai.Error) *Failure { return &Failure{Status: e.Status, Answer: e, Final: true} }

func (f *Failure) Error() string {
	switch {
	case f.Answer != nil:
		return f.Answer.Error()
	case f.Cause != nil:
		return fmt.Sprintf("worker %s: %v", f.Worker, f.Cause)
	}
	return fmt.Sprintf("worker %s answered %d", f.Worker, f.Status)
}

func (f *Failure) Unwrap() error { return f.Cause }

// Verdict is the outcome table's verdict on f: on its cause when it has one, else its status;
// never retryable when Final.
func (f *Failure) Verdict() Verdict {
	v := Status(f.Status)
	if f.Cause != nil {
		v = Err(f.Cause)
	}
	if f.Final {
		v.Retryable = false
	}
	return v
}

// ClientStatus is the status the client is answered with.
func (f *Failure) ClientStatus() int {
	if f.Answer != nil {
		return f.Answer.Status
	}
	return f.Status
}
