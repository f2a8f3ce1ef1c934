package worker

import (
	"sync"
	"sync/atomic"
	"time"
)

// BreakerState is a circuit breaker's state; its value is the baton_worker_circuit_state gauge.
type BreakerState int32

// Breaker states.
const (
	BreakerClosed   BreakerState = 0
	BreakerOpen     BreakerState = 1
	BreakerHalfOpen BreakerState = 2
)

// String names the state for labels and logs.
func (s BreakerState) String() string {
	switch s {
	case BreakerOpen:
		return "open"
	case BreakerHalfOpen:
		return "half_open"
	}
	return "closed"
}

// BreakerConfig configures a worker's circuit breaker.
type BreakerConfig struct {
	FailureThreshold int           // consecutive failures that open the circuit
	SuccessThreshold int           // successes in half-open that close it; also the probe limit
	Timeout          time.Duration // time open before half-open
	Disabled         bool          // never open
	// OnTransition, when set, is called on every state change (for metrics and logs).
	OnTransition func(w *Worker, from, to BreakerState)
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// breaker is a consecutive-failure circuit breaker. It is written here rather than taken from
// sony/gobreaker because Baton learns outcomes after the fact and some are no sample at all
// (429, cancellations): gobreaker's two-step API must be told success or failure for every
// admitted request, or its half-open admission count drifts. Reads are atomic; transitions
// take a mutex, never held across I/O.
type breaker struct {
	cfg   *BreakerConfig
	w     *Worker
	state atomic.Int32 // a BreakerState
	// probes counts requests in flight that were admitted in half-open.
	probes atomic.Int32

	mu         sync.Mutex
	fails, oks int
	openedAt   time.Time
}

func (b *breaker) now() time.Time {
	if b.cfg.Now != nil {
		return b.cfg.Now()
	}
	return time.Now()
}

func (b *breaker) setLocked(to BreakerState) {
	from := BreakerState(b.state.Load())
	if from == to {
		return
	}
	b.state.Store(int32(to))
	b.fails, b.oks = 0, 0
	if to == BreakerOpen {
		b.openedAt = b.now()
	}
	if b.cfg.OnTransition != nil {
		b.cfg.OnTransition(b.w, from, to)
	}
}

// allow reports whether the worker may take a request now: closed, or half-open with room for
// another probe. An open circuit turns half-open once its timeout has passed.
func (b *breaker) allow() bool {
	switch BreakerState(b.state.Load()) {
	case BreakerClosed:
		return true
	case BreakerOpen:
		b.mu.Lock()
		if BreakerState(b.state.Load()) == BreakerOpen && b.now().Sub(b.openedAt) >= b.cfg.Timeout {
			b.setLocked(BreakerHalfOpen)
		}
		b.mu.Unlock()
		if BreakerState(b.state.Load()) != BreakerHalfOpen {
			return false
		}
	}
	return int(b.probes.Load()) < b.cfg.SuccessThreshold
}

// record takes one outcome sample.
func (b *breaker) record(failure bool) {
	if b.cfg.Disabled {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	switch BreakerState(b.state.Load()) {
	case BreakerClosed:
		if !failure {
			b.fails = 0
			return
		}
		b.fails++
		if b.fails >= b.cfg.FailureThreshold {
			b.setLocked(BreakerOpen)
		}
	case BreakerHalfOpen:
		if failure {
			b.setLocked(BreakerOpen)
			return
		}
		b.oks++
		if b.oks >= b.cfg.SuccessThreshold {
			b.setLocked(BreakerClosed)
		}
	}
}

// UseBreaker gives w a circuit breaker with cfg (shared by all workers).
func (w *Worker) UseBreaker(cfg *BreakerConfig) { w.breaker = &breaker{cfg: cfg, w: w} }

// BreakerState returns the worker's circuit state (BreakerClosed without a breaker).
func (w *Worker) BreakerState() BreakerState {
	if w.breaker == nil {
		return BreakerClosed
	}
	return BreakerState(w.breaker.state.Load())
}

// Available reports whether the worker may be selected: registered, healthy and its circuit
// admitting requests.
func (w *Worker) Available() bool {
	return w.Ready() && (w.breaker == nil || w.breaker.allow())
}

// Routable reports, as a read that changes nothing, whether the worker can be sent requests
// now: ready, and its circuit closed, half-open, or open past its timeout (the next request
// turns it half-open). What GET /workers and the status page call ready; selection asks
// Available, which may turn the circuit half-open and counts its probes.
func (w *Worker) Routable() bool {
	return w.Ready() && (w.breaker == nil || w.breaker.admits())
}

// admits reports, without a transition, whether the circuit takes requests now.
func (b *breaker) admits() bool {
	if BreakerState(b.state.Load()) != BreakerOpen {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return BreakerState(b.state.Load()) != BreakerOpen || b.now().Sub(b.openedAt) >= b.cfg.Timeout
}

// Available returns the available workers among ws, in order. It allocates only when some are
// not available.
func Available(ws []*Worker) []*Worker { return Keep(ws, (*Worker).Available) }

// Keep returns the workers of ws that keep holds for, in order: ws itself when it holds for all
// (no allocation), else a new slice.
func Keep(ws []*Worker, keep func(*Worker) bool) []*Worker {
	for i, w := range ws {
		if !keep(w) {
			out := append([]*Worker(nil), ws[:i]...)
			for _, w := range ws[i+1:] {
				if keep(w) {
					out = append(out, w)
				}
			}
			return out
		}
	}
	return ws
}
