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

var (
	// ErrClientGone means the client went away; nothing more can be written.
	ErrClientGone = errors.New("client disconnected")
	// ErrAbort means the upstream failed after the first byte reached the client: the handler
	// must abort the client connection (panic(http.ErrAbortHandler)) so the client sees a broken
	// response, never a silently truncated one.
	ErrAbort = errors.New("upstream failed after the first byte")
)

// InBandError is an engine's error event inside a stream it had answered 200: the whole stream
// reached the client as the engine sent it, and the request failed.
type InBandError struct {
	Status  int    // the status the event names (500 when it names none)
	Message string // the event's message, bounded
	Unnamed bool   // the event names no status (Status is then 500)
}

func (e *InBandError) Error() string {
	return fmt.Sprintf("the engine reported an error inside its stream (%d): %s", e.Status, e.Message)
}

// ReadError is an upstream body read failure during a relay. Written reports whether any byte
// of the response had reached the client; when not, the caller can still answer with a status.
type ReadError struct {
	Err     error
	Written bool
}

func (e *ReadError) Error() string { return "reading upstream response: " + e.Err.Error() }
func (e *ReadError) Unwrap() error { return e.Err }

// Phase is how far an exchange got when it failed.
type Phase uint8

const (
	// BeforeHead: nothing reached the client; the door answers it, or tries again.
	BeforeHead Phase = iota
	// Streaming: a part of the answer went out; the client's connection is aborted.
	Streaming
	// InBand: the whole stream went out, the engine's error event inside it.
	InBand
)

// Kind is whose a failure is, and what the client is told of it.
type Kind uint8

const (
	KindWorker        Kind = iota // a worker failed or refused: its status, or what kept it from answering
	KindNoWorker                  // no worker could be chosen (503, retried: one may come back)
	KindModelUnserved             // no worker serves the model (404)
	KindRouteUnserved             // no worker serves the route (501)
	KindClientGone                // the client left: nobody to answer
	KindTimeout                   // a deadline passed
	KindRefused                   // Baton refused the request itself (its own answer)
	KindInternal                  // Baton's own fault: a recovered panic, an error nothing classified
)

var kindNames = [...]string{"worker", "no_worker", "model_unserved", "route_unserved", "client_gone", "timeout", "refused", "internal"}

func (k Kind) String() string { return kindNames[k] }

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

	// Phase is how far the exchange got. Edge marks a failure made at the attempt boundary
	// from a bare error (FailureOf): no worker's answer, never retried, never a sample.
	Phase Phase
	Edge  bool
}

// FailureOf is err at the attempt boundary, the one place the request path's errors are read:
// nil for nil, a *Failure as it is, and any other error as the failure it is — an engine's
// error event in a stream (InBand), a failure after the first byte (Streaming), the client gone,
// a deadline passed, a relay's read error, or, for anything else, Baton's own (internal).
func FailureOf(err error) *Failure {
	if err == nil {
		return nil
	}
	var (
		f  *Failure
		ib *InBandError
		re *ReadError
	)
	switch {
	case errors.As(err, &f):
		return f
	case errors.As(err, &ib):
		return &Failure{Phase: InBand, Status: ib.Status, Cause: err, Edge: true}
	case errors.Is(err, ErrAbort):
		return &Failure{Phase: Streaming, Cause: err, Edge: true}
	case errors.As(err, &re):
		f := &Failure{Cause: err, Edge: true}
		if re.Written {
			f.Phase = Streaming
		}
		return f
	case errors.Is(err, ErrClientGone), IsTimeout(err):
		return &Failure{Cause: err, Edge: true}
	}
	return &Failure{Cause: fmt.Errorf("%w: %w", ErrInternal, err), Edge: true}
}

// Unread is the read error that ended a relay before its first byte reached the client; nil for
// any other failure.
func (f *Failure) Unread() error {
	var re *ReadError
	if errors.As(f.Cause, &re) && !re.Written {
		return re.Err
	}
	return nil
}

// Event is the engine's error event that failed a stream relayed whole; nil for any other
// failure.
func (f *Failure) Event() *InBandError {
	var ib *InBandError
	if errors.As(f.Cause, &ib) {
		return ib
	}
	return nil
}

// Kind is whose the failure is: the cause that kept a worker from answering when there is one,
// else who answered.
func (f *Failure) Kind() Kind {
	switch {
	case errors.Is(f.Cause, ErrClientGone):
		return KindClientGone
	case errors.Is(f.Cause, ErrInternal):
		return KindInternal
	case IsTimeout(f.Cause):
		return KindTimeout
	case f.NoWorker:
		return KindNoWorker
	case f.Answer != nil && f.Worker == "":
		switch f.Answer.Code {
		case openai.CodeModelNotFound:
			return KindModelUnserved
		case openai.CodeRouteNotServed, openai.CodeNotImplementedInPD:
			return KindRouteUnserved
		}
		return KindRefused
	}
	return KindWorker
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
	if f.Edge {
		return Verdict{Client: f.Kind() == KindClientGone}
	}
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
