package admit

import (
	"fmt"
	"runtime"
	"time"
)

// MeasureDecision measures the admission decision with tenants backlogged in one class: n
// times, a slot frees, the next request is chosen and granted, and it comes back as a new
// request of its tenant. It returns the time and the heap allocations per enqueue+dispatch
// (for baton bench; go test -bench EnqueueDispatch measures the same).
func MeasureDecision(tenants, n int) (time.Duration, float64) {
	s := New(Options{Slots: 1, InputWeight: 1, OutputWeight: 2})
	s.inUse = 1
	ws := make([]*Waiter, tenants)
	for i := range ws {
		w := &Waiter{ch: make(chan error, 1)}
		w.fl = s.flow(Default, fmt.Sprint("tenant-", i), 1)
		w.class, w.cost = Default, float64(i%7+1)
		s.enqueue(w)
		ws[i] = w
	}
	byFlow := make(map[*flow]*Waiter, tenants)
	for _, w := range ws {
		byFlow[w.fl] = w
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	start := time.Now()
	for i := 0; i < n; i++ {
		s.mu.Lock()
		fl := s.classes[Default].flows[0]
		s.inUse--
		s.dispatch(time.Time{})
		w := byFlow[fl]
		<-w.ch
		w.granted = false
		s.enqueue(w)
		s.mu.Unlock()
	}
	took := time.Since(start)
	runtime.ReadMemStats(&after)
	return took / time.Duration(n), float64(after.Mallocs-before.Mallocs) / float64(n)
}
