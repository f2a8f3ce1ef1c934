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

// wrap admits requests to next.
func (a *admission) wrap(next http.Handler) http.Handler {
	if a == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case a.slots <- struct{}{}:
		default:
			if a.waiting.Add(1) > a.queueSize {
				a.waiting.Add(-1)
				a.reject(w, "queue_full", "too many requests in flight and the queue is full")
				return
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
				return
			}
		}
		defer func() { <-a.slots }()
		next.ServeHTTP(w, r)
	})
}

func (a *admission) reject(w http.ResponseWriter, reason, msg string) {
	a.metrics.Rejections.WithLabelValues(reason).Inc()
	openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Code: "overloaded", Message: msg,
		RetryAfter: strconv.Itoa(max(1, int(a.timeout.Seconds()/10)))})
}
