package tracing

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// maxQueued bounds the spans ended and not yet exported or lost: the batch processor's queue
// (which would drop past it without a word) never fills; Baton drops and counts instead.
const maxQueued = 2048

// warnEvery is how often, at most, a failing export is said at WARN.
const warnEvery = time.Minute

// Watch is told of spans lost, and says so: a counter per cause (Lost), at most one WARN line a
// minute while exports fail, an INFO line when they recover, and the state the status page
// shows (State).
type Watch struct {
	// Lost, when set, counts failed exports (spans: how many went with each) and spans dropped
	// because the queue was full.
	Lost func(cause string, exports, spans int)
	Log  *slog.Logger
	// Now is the clock (tests); nil: time.Now.
	Now func() time.Time

	mu       sync.Mutex
	state    State
	lastWarn time.Time
	unsaid   int // failures since the last WARN
	// lastOther is when another OpenTelemetry error was last said.
	lastOther time.Time
	queued    atomic.Int64
}

// State is what the status page says of span export.
type State struct {
	Collector    string    `json:"collector"` // host:port, never credentials
	Failing      bool      `json:"failing"`
	FailingSince time.Time `json:"failing_since,omitzero"`
	LastError    string    `json:"last_error,omitempty"`
	Failures     int64     `json:"failures"`      // failed exports since start
	SpansLost    int64     `json:"spans_lost"`    // spans in them
	SpansDropped int64     `json:"spans_dropped"` // spans dropped with the queue full
}

// Causes of lost spans, as Lost is told.
const (
	CauseExportFailed = "export_failed"
	CauseQueueFull    = "queue_full"
)

func (w *Watch) now() time.Time {
	if w.Now != nil {
		return w.Now()
	}
	return time.Now()
}

// State returns the export's state now.
func (w *Watch) State() State {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.state
}

func (w *Watch) failed(spans int, err error) {
	if w.Lost != nil {
		w.Lost(CauseExportFailed, 1, spans)
	}
	now := w.now()
	w.mu.Lock()
	defer w.mu.Unlock()
	s := &w.state
	if !s.Failing {
		s.Failing, s.FailingSince = true, now
	}
	s.Failures++
	s.SpansLost += int64(spans)
	s.LastError = err.Error()
	w.unsaid++
	if w.Log != nil && (w.lastWarn.IsZero() || now.Sub(w.lastWarn) >= warnEvery) {
		w.Log.Warn("trace export failing: spans are lost", "collector", s.Collector, "failures", w.unsaid,
			"failing_since", s.FailingSince.UTC().Format(time.RFC3339), "spans_lost_total", s.SpansLost, "err", s.LastError)
		w.lastWarn, w.unsaid = now, 0
	}
}

func (w *Watch) exported() {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := &w.state
	if !s.Failing {
		return
	}
	if w.Log != nil {
		w.Log.Info("trace export recovered", "collector", s.Collector, "failing_for", w.now().Sub(s.FailingSince).Round(time.Second).String(),
			"failures_total", s.Failures, "spans_lost_total", s.SpansLost)
	}
	s.Failing, s.FailingSince, w.lastWarn, w.unsaid = false, time.Time{}, time.Time{}, 0
}

func (w *Watch) dropped() {
	if w.Lost != nil {
		w.Lost(CauseQueueFull, 0, 1)
	}
	w.mu.Lock()
	w.state.SpansDropped++
	w.mu.Unlock()
}

// lostError is a failed export the watch has been told of.
type lostError struct {
	spans int
	err   error
}

func (e *lostError) Error() string { return fmt.Sprintf("%d spans lost: %v", e.spans, e.err) }
func (e *lostError) Unwrap() error { return e.err }

// handle is OpenTelemetry's error handler: a failed export the watch was told of is not said
// again (the batch processor hands each to the handler too); any other error is said at WARN, at
// most once a minute.
func (w *Watch) handle(err error) {
	var lost *lostError
	if errors.As(err, &lost) || w.Log == nil {
		return
	}
	now := w.now()
	w.mu.Lock()
	say := w.lastOther.IsZero() || now.Sub(w.lastOther) >= warnEvery
	if say {
		w.lastOther = now
	}
	w.mu.Unlock()
	if say {
		w.Log.Warn("opentelemetry: " + err.Error())
	}
}

// watchedExporter tells w of every export's result.
type watchedExporter struct {
	sdktrace.SpanExporter
	w *Watch
}

func (e watchedExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	err := e.SpanExporter.ExportSpans(ctx, spans)
	e.w.queued.Add(-int64(len(spans)))
	if err != nil {
		e.w.failed(len(spans), err)
		return &lostError{spans: len(spans), err: err}
	}
	e.w.exported()
	return nil
}

// boundedProcessor admits a sampled span to the batch processor only while fewer than maxQueued
// are waiting for their export, and drops (counted) past it.
type boundedProcessor struct {
	sdktrace.SpanProcessor
	w *Watch
}

func (p boundedProcessor) OnEnd(s sdktrace.ReadOnlySpan) {
	if s.SpanContext().IsSampled() {
		if p.w.queued.Add(1) > maxQueued {
			p.w.queued.Add(-1)
			p.w.dropped()
			return
		}
	}
	p.SpanProcessor.OnEnd(s)
}
