package proxy

import (
	"net/http"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/worker"
)

// Leg is one upstream request on a worker. Start counts it in flight on the worker; its outcome
// is recorded against the worker exactly once — by the first of Done, Excuse, Failure or
// Finish — and the in-flight count is released then. A deferred Excuse makes every path end it.
type Leg struct {
	W     *worker.Worker
	Name  string // prefill, decode, or "" for a regular request
	probe bool   // admitted as a half-open circuit's probe
	rank  int    // the DP rank the leg runs on, plus one; 0: none
	ended atomic.Bool
	span  trace.Span // the leg's client span when tracing; nil otherwise
}

// OnRank counts the leg on DP rank r of its worker until it ends; r < 0 means no rank.
func (l *Leg) OnRank(r int) {
	if r >= 0 {
		l.rank = r + 1
		l.W.EnterRank(r)
	}
}

func (l *Leg) leaveRank() {
	if l.rank > 0 {
		l.W.LeaveRank(l.rank - 1)
	}
}

// Start starts the leg, named name, on w. A Leg is started once, and may live on the stack.
func (l *Leg) Start(w *worker.Worker, name string) {
	l.W, l.Name, l.probe = w, name, w.Enter()
}

// Done records the worker's answer with status, or the error that kept it from answering or
// ended its answer, and releases the worker; only the first end of a leg counts.
func (l *Leg) Done(status int, err error) {
	if err == nil && KeyRefusedBy(l.W, status) {
		err = outcome.ErrKeyRefused // the worker's failure, whichever path read the answer
	}
	if l.ended.CompareAndSwap(false, true) {
		if l.span == nil {
			l.W.Record(status, err)
		} else {
			before := l.W.BreakerState()
			l.W.Record(status, err)
			if after := l.W.BreakerState(); after != before {
				l.span.AddEvent("circuit_breaker", trace.WithAttributes(attribute.String("baton.breaker.from", before.String()), attribute.String("baton.breaker.to", after.String())))
			}
			if err != nil {
				l.span.SetStatus(codes.Error, LogCause(err))
			} else if status >= 500 {
				l.span.SetStatus(codes.Error, http.StatusText(status))
			}
			l.span.End()
		}
		l.W.Leave(l.probe)
		l.leaveRank()
	}
}

// Excuse ends the leg without a sample: Baton or the client ended it, or the other leg's
// failure caused its own, or it outlived the request deadline while the worker was answering.
func (l *Leg) Excuse() {
	if l.ended.CompareAndSwap(false, true) {
		if l.span != nil {
			l.span.SetAttributes(attribute.Bool("baton.excused", true))
			l.span.End()
		}
		l.W.Leave(l.probe)
		l.leaveRank()
	}
}
