package server

import (
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
)

// admission bounds the inference requests served at once. Up to queueSize more wait, each at
// most timeout; beyond that a request is refused at once with 503 and Retry-After. Nothing waits
// forever: the wait ends with a slot, the timeout, or the client leaving.
type admission struct {
	slots     chan struct{}
	waiting   atomic.Int64
	queueSize int64
	timeout   time.Duration
	metrics   *metrics.Metrics
}

func newAdmission(max, queue int, timeout time.Duration, m *metrics.Metrics) *admission {
	if max <= 0 {
		return nil
	}
	return &admission{slots: make(chan struct{}, max), queueSize: int64(queue), timeout: timeout, metrics: m}
}

// wrap admits requests to next, for routes without a body to read first.
func (a *admission) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		release, ok := a.acquire(w, r)
		if !ok {
			return
		}
		defer release()
		next.ServeHTTP(w, r)
	})
}

// acquire takes a slot for r, waiting in the queue if need be. It returns the slot's release
// function and true, or false after answering the client itself (503), or when the client left
// or its deadline passed while it waited. Inference handlers call it after reading the body, so
// that a slot covers upstream work only: a client slow to send cannot hold one.
func (a *admission) acquire(w http.ResponseWriter, r *http.Request) (release func(), ok bool) {
	if a == nil {
		return func() {}, true
	}
	select {
	case a.slots <- struct{}{}:
		return a.release, true
	default:
	}
	if a.waiting.Add(1) > a.queueSize {
		a.waiting.Add(-1)
		a.reject(w, "queue_full", "too many requests in flight and the queue is full")
		return nil, false
	}
	a.metrics.QueueDepth.Inc()
	start := time.Now()
	t := time.NewTimer(a.timeout)
	got := false
	select {
	case a.slots <- struct{}{}:
		got = true
	case <-t.C:
	case <-r.Context().Done():
	}
	t.Stop()
	a.waiting.Add(-1)
	a.metrics.QueueDepth.Dec()
	a.metrics.QueueWait.Observe(time.Since(start).Seconds())
	if !got {
		if r.Context().Err() == nil {
			a.reject(w, "queue_timeout", "waited "+a.timeout.String()+" for a slot")
		}
		return nil, false
	}
	return a.release, true
}

func (a *admission) release() { <-a.slots }

func (a *admission) reject(w http.ResponseWriter, reason, msg string) {
	a.metrics.Rejections.WithLabelValues(reason).Inc()
	openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeOverloaded, Message: msg,
		RetryAfter: strconv.Itoa(max(1, int(a.timeout.Seconds()/10)))})
}
