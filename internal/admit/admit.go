// Package admit decides which waiting request gets the next free slot when the fleet is full:
// the highest priority class first; inside a class, the tenant that has been served least
// (weighted Virtual Token Counter: Sheng et al., "Fairness in Serving Large Language Models",
// OSDI 2024); inside a tenant, first come first served. A request that has waited longer than a
// bound moves up a class; each class has a depth limit and a wait timeout; slots may be reserved
// for a class and those above it. A free slot never stays idle while a request that may take it
// waits.
package admit

import (
	"container/heap"
	"context"
	"errors"
	"sync"
	"time"
)

// Class is a priority class; a lower value is served first.
type Class int

// The classes, highest first.
const (
	Critical Class = iota
	Interactive
	Default
	Batch
	NumClasses
)

var classNames = [NumClasses]string{"critical", "interactive", "default", "batch"}

func (c Class) String() string { return classNames[c] }

// ParseClass reads a class name: Baton's four, and smg's "system" and "bulk".
func ParseClass(s string) (Class, bool) {
	switch s {
	case "critical", "system":
		return Critical, true
	case "interactive":
		return Interactive, true
	case "default":
		return Default, true
	case "batch", "bulk":
		return Batch, true
	}
	return 0, false
}

// Options shape a Scheduler.
type Options struct {
	// Slots are the requests served at once; 0 or less: no bound (every request goes at once).
	Slots int
	// Reserved[c] slots are kept for class c and the classes above it: a request of a lower
	// class takes a slot only while more than the reservations above it are free.
	Reserved [NumClasses]int
	// Depth[c] bounds the requests of class c waiting; Timeout[c] how long one waits.
	Depth   [NumClasses]int
	Timeout [NumClasses]time.Duration
	// PromoteAfter moves a request that has waited this long in its class up one class (0:
	// never); Promote[c], when above 0, is class c's own wait.
	PromoteAfter time.Duration
	Promote      [NumClasses]time.Duration
	// InputWeight and OutputWeight weigh prompt and completion tokens in a tenant's counter.
	InputWeight, OutputWeight float64
}

// PromoteWait is how long a request waits in class c before it moves up one class; 0: never.
func (o *Options) PromoteWait(c Class) time.Duration {
	if o.Promote[c] > 0 {
		return o.Promote[c]
	}
	return o.PromoteAfter
}

// ShortestPromoteWait is the shortest wait after which some class promotes; 0: none does.
func (o *Options) ShortestPromoteWait() time.Duration {
	var d time.Duration
	for c := Class(1); c < NumClasses; c++ {
		if w := o.PromoteWait(c); w > 0 && (d == 0 || w < d) {
			d = w
		}
	}
	return d
}

// Errors a request is refused with.
var (
	ErrQueueFull = errors.New("the queue of its class is full")
	ErrTimeout   = errors.New("waited its class's timeout for a slot")
	ErrDraining  = errors.New("the server is draining")
)

// Scheduler hands out slots.
type Scheduler struct {
	o        Options
	mu       sync.Mutex
	inUse    int
	waiting  [NumClasses]int
	classes  [NumClasses]classQueue
	flows    map[flowKey]*flow
	draining bool
	seq      uint64
	pool     sync.Pool
	// served counts weighted tokens served per tenant (the counters' increments, not divided
	// by weight) per minute, the last servedMinutes minutes: the status page's fairness view.
	served [servedMinutes]minuteServed
}

// servedMinutes is how many minutes of service the scheduler keeps per tenant.
const servedMinutes = 10

type minuteServed struct {
	minute int64
	tokens map[string]float64
}

type flowKey struct {
	class  Class
	tenant string
}

// classQueue is one class's backlog: its backlogged flows by counter, and its waiters in the
// order they entered the class (for promotion).
type classQueue struct {
	flows flowHeap
	order waiterList // by entry into the class
}

// flow is one tenant's requests in one class.
type flow struct {
	key     flowKey
	weight  float64
	counter float64 // weighted tokens served (VTC)
	q       waiterList
	index   int    // in the class heap; -1 when not backlogged
	since   uint64 // when it became backlogged: equal counters go to the longer backlogged
}

// A Waiter is a request waiting for a slot (pooled).
type Waiter struct {
	ch      chan error
	timer   *time.Timer
	fl      *flow
	class   Class
	ceiling Class     // the highest class it may be promoted to
	entered time.Time // into its current class
	arrived time.Time
	cost    float64 // its estimated weighted tokens
	granted bool
	queued  bool
	f, o    links // in its flow, in its class order
}

// New returns a scheduler.
func New(o Options) *Scheduler {
	if o.InputWeight == 0 && o.OutputWeight == 0 {
		o.InputWeight, o.OutputWeight = 1, 2
	}
	s := &Scheduler{o: o, flows: map[flowKey]*flow{}}
	for c := range s.classes {
		s.classes[c].order.at = inOrder
	}
	s.pool.New = func() any { return &Waiter{ch: make(chan error, 1)} }
	return s
}

// A Ticket is a slot held; Release gives it back and settles the tenant's counter.
type Ticket struct {
	s      *Scheduler
	fl     *flow
	cost   float64
	Class  Class         // the class it was served in (after promotions)
	Waited time.Duration // time in the queue
	held   bool
}

// Request is what the scheduler needs of a request.
type Request struct {
	Tenant string
	Weight float64 // the tenant's share (default 1)
	Class  Class
	// Ceiling is the highest class the request may reach by promotion: its tenant's
	// max_priority. Critical (the zero value) lets it rise to the top.
	Ceiling Class
	// In and Out are its estimated prompt and completion tokens, charged to the tenant's
	// counter when it is served and corrected when it ends.
	In, Out int
}

// Acquire waits for a slot for req until one is given (a Ticket), the class's timeout passes
// (ErrTimeout), its queue is full (ErrQueueFull), the server drains (ErrDraining) or ctx ends
// (its error: a client that left leaves the queue at once).
func (s *Scheduler) Acquire(ctx context.Context, req Request) (Ticket, error) {
	weight := req.Weight
	if weight <= 0 {
		weight = 1
	}
	cost := (float64(req.In)*s.o.InputWeight + float64(req.Out)*s.o.OutputWeight) / weight
	s.mu.Lock()
	if s.draining {
		s.mu.Unlock()
		return Ticket{}, ErrDraining
	}
	fl := s.flow(req.Class, req.Tenant, weight)
	if s.o.Slots <= 0 || (s.nothingWaitingFor(req.Class) && s.free() > s.reservedAbove(req.Class)) {
		s.inUse++
		s.charge(fl, cost)
		s.mu.Unlock()
		return Ticket{s: s, fl: fl, cost: cost, Class: req.Class, held: true}, nil
	}
	if s.o.Depth[req.Class] > 0 && s.waiting[req.Class] >= s.o.Depth[req.Class] || s.o.Depth[req.Class] <= 0 {
		s.mu.Unlock()
		return Ticket{}, ErrQueueFull
	}
	w := s.pool.Get().(*Waiter)
	now := time.Now()
	w.fl, w.class, w.ceiling, w.entered, w.arrived, w.cost, w.granted = fl, req.Class, req.Ceiling, now, now, cost, false
	s.enqueue(w)
	s.mu.Unlock()

	timeout := s.o.Timeout[req.Class]
	if timeout <= 0 {
		timeout = time.Minute
	}
	if w.timer == nil {
		w.timer = time.NewTimer(timeout)
	} else {
		w.timer.Reset(timeout)
	}
	var err error
	select {
	case err = <-w.ch:
	case <-w.timer.C:
		err = ErrTimeout
	case <-ctx.Done():
		err = ctx.Err()
	}
	w.timer.Stop()
	s.mu.Lock()
	switch {
	case w.queued: // gave up waiting: the timeout, or the client left
		s.remove(w)
	case w.granted && err != nil:
		// Granted as it gave up: the slot goes on to the next, never to a gone client.
		s.inUse--
		s.settleLocked(w.fl, -w.cost)
		s.dispatch(time.Now())
	}
	select { // a grant or a drain that raced the timer or the client: the pooled channel is emptied
	case e := <-w.ch:
		if e == ErrDraining {
			err = e
		}
	default:
	}
	t := Ticket{s: s, fl: w.fl, cost: w.cost, Class: w.class, Waited: time.Since(w.arrived), held: err == nil}
	s.mu.Unlock()
	w.fl, w.f, w.o = nil, links{}, links{}
	s.pool.Put(w)
	if err != nil {
		return Ticket{Waited: t.Waited, Class: t.Class}, err
	}
	return t, nil
}

// Release gives the slot back and corrects the tenant's counter with the tokens the request
// used (its estimate when inUsed and outUsed are both negative).
func (t *Ticket) Release(inUsed, outUsed int) {
	if t == nil || !t.held {
		return
	}
	t.held = false
	s := t.s
	s.mu.Lock()
	if inUsed >= 0 || outUsed >= 0 {
		actual := (float64(max(0, inUsed))*s.o.InputWeight + float64(max(0, outUsed))*s.o.OutputWeight) / t.fl.weight
		s.settleLocked(t.fl, actual-t.cost)
	}
	s.inUse--
	s.dispatch(time.Now())
	s.mu.Unlock()
}

// Drain refuses every waiting request at once (ErrDraining) and every later one.
func (s *Scheduler) Drain() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.draining = true
	for c := range s.classes {
		for w := s.classes[c].order.head; w != nil; {
			next := w.o.next
			s.remove(w)
			w.ch <- ErrDraining
			w = next
		}
	}
}

// Waiting is the requests waiting in class c; InUse the slots held.
func (s *Scheduler) Waiting(c Class) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.waiting[c]
}

// InUse is the slots held.
func (s *Scheduler) InUse() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inUse
}

// Served returns the weighted tokens each tenant was served over the last minutes (at most
// servedMinutes): its counters' increments, not divided by its weight, as a fresh map.
func (s *Scheduler) Served(minutes int) map[string]float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now().Unix() / 60
	out := map[string]float64{}
	for i := range s.served {
		m := &s.served[i]
		if m.tokens != nil && now-m.minute < int64(min(minutes, servedMinutes)) {
			for k, v := range m.tokens {
				out[k] += v
			}
		}
	}
	return out
}

// account adds weighted tokens served to tenant's current minute.
func (s *Scheduler) account(tenant string, tokens float64) {
	now := time.Now().Unix() / 60
	m := &s.served[now%servedMinutes]
	if m.minute != now || m.tokens == nil {
		if m.tokens == nil {
			m.tokens = map[string]float64{}
		}
		clear(m.tokens)
		m.minute = now
	}
	m.tokens[tenant] += tokens
}

func (s *Scheduler) free() int { return s.o.Slots - s.inUse }

// reservedAbove is the slots kept for the classes above c: a request of class c leaves them
// free.
func (s *Scheduler) reservedAbove(c Class) int {
	n := 0
	for k := Class(0); k < c; k++ {
		n += s.o.Reserved[k]
	}
	return n
}

// nothingWaitingFor reports whether no request of class c or above waits (a new one would
// otherwise jump them).
func (s *Scheduler) nothingWaitingFor(c Class) bool {
	for k := Class(0); k <= c; k++ {
		if s.waiting[k] > 0 {
			return false
		}
	}
	return true
}

func (s *Scheduler) flow(c Class, tenant string, weight float64) *flow {
	k := flowKey{c, tenant}
	fl := s.flows[k]
	if fl == nil {
		fl = &flow{key: k, index: -1, q: waiterList{at: inFlow}}
		s.flows[k] = fl
	}
	fl.weight = weight
	return fl
}

// charge adds a served request's cost to its flow's counter.
func (s *Scheduler) charge(fl *flow, cost float64) {
	fl.counter += cost
	s.account(fl.key.tenant, cost*fl.weight)
	if fl.index >= 0 {
		heap.Fix(&s.classes[fl.key.class].flows, fl.index)
	}
}

func (s *Scheduler) settleLocked(fl *flow, delta float64) {
	fl.counter += delta
	s.account(fl.key.tenant, delta*fl.weight)
	if fl.index >= 0 {
		heap.Fix(&s.classes[fl.key.class].flows, fl.index)
	}
}

// enqueue adds w to its flow and class. A flow that was idle is lifted to the smallest counter
// of the class's backlogged flows, so that it cannot bank credit while away.
func (s *Scheduler) enqueue(w *Waiter) {
	fl := w.fl
	cq := &s.classes[w.class]
	if fl.q.head == nil {
		if len(cq.flows) > 0 && cq.flows[0].counter > fl.counter {
			fl.counter = cq.flows[0].counter
		}
		s.seq++
		fl.since = s.seq
		heap.Push(&cq.flows, fl)
	}
	fl.q.push(w)
	cq.order.push(w)
	w.queued = true
	s.waiting[w.class]++
}

// remove takes w out of its flow and class.
func (s *Scheduler) remove(w *Waiter) {
	fl := w.fl
	cq := &s.classes[w.class]
	fl.q.remove(w)
	cq.order.remove(w)
	if fl.q.head == nil && fl.index >= 0 {
		heap.Remove(&cq.flows, fl.index)
	}
	w.queued = false
	s.waiting[w.class]--
}

// dispatch gives free slots to waiters: promotions first, then the highest class a slot may go
// to, the flow with the smallest counter in it, that flow's oldest request.
func (s *Scheduler) dispatch(now time.Time) {
	s.promote(now)
	for s.free() > 0 {
		w := s.next()
		if w == nil {
			return
		}
		s.remove(w)
		s.inUse++
		s.charge(w.fl, w.cost)
		w.granted = true
		w.ch <- nil
	}
}

// next is the waiter the next free slot goes to, nil for none.
func (s *Scheduler) next() *Waiter {
	for c := Class(0); c < NumClasses; c++ {
		if s.waiting[c] == 0 {
			continue
		}
		if s.free() <= s.reservedAbove(c) {
			return nil // kept for a class above; the classes below may not take it either
		}
		return s.classes[c].flows[0].q.head
	}
	return nil
}

// promote moves the requests that waited PromoteAfter in their class up one class, never above
// their ceiling: a request at its ceiling stays, however long it waits.
func (s *Scheduler) promote(now time.Time) {
	for c := Class(1); c < NumClasses; c++ {
		after := s.o.PromoteWait(c)
		if after <= 0 {
			continue
		}
		var next *Waiter
		for w := s.classes[c].order.head; w != nil && now.Sub(w.entered) >= after; w = next {
			next = w.o.next
			if c-1 < w.ceiling {
				continue
			}
			s.remove(w)
			w.fl = s.flow(c-1, w.fl.key.tenant, w.fl.weight)
			w.class, w.entered = c-1, now
			s.enqueue(w)
		}
	}
}

// SetSlots makes the requests served at once n (at least 1): more slots are handed to the
// waiting at once; fewer take effect as requests end (none is stopped). For slots sized from the
// engines' capacity, which changes as workers come and go.
func (s *Scheduler) SetSlots(n int) {
	s.mu.Lock()
	s.o.Slots = max(n, 1)
	s.dispatch(time.Now())
	s.mu.Unlock()
}

// Slots is the requests served at once.
func (s *Scheduler) Slots() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.o.Slots
}

// Tick runs promotions and hands out free slots; the server calls it periodically so that a
// promotion does not wait for a request to end.
func (s *Scheduler) Tick() {
	s.mu.Lock()
	s.dispatch(time.Now())
	s.mu.Unlock()
}

// links are a waiter's place in one list.
type links struct{ prev, next *Waiter }

// waiterList is an intrusive FIFO of waiters through one of their two link pairs (at: the
// flow's or the class order's).
type waiterList struct {
	head, tail *Waiter
	at         func(*Waiter) *links
}

func inFlow(w *Waiter) *links  { return &w.f }
func inOrder(w *Waiter) *links { return &w.o }

func (l *waiterList) push(w *Waiter) {
	*l.at(w) = links{prev: l.tail}
	if l.tail != nil {
		l.at(l.tail).next = w
	} else {
		l.head = w
	}
	l.tail = w
}

func (l *waiterList) remove(w *Waiter) {
	lw := l.at(w)
	if lw.prev != nil {
		l.at(lw.prev).next = lw.next
	} else {
		l.head = lw.next
	}
	if lw.next != nil {
		l.at(lw.next).prev = lw.prev
	} else {
		l.tail = lw.prev
	}
	*lw = links{}
}

// flowHeap orders a class's backlogged flows by counter.
type flowHeap []*flow

func (h flowHeap) Len() int { return len(h) }
func (h flowHeap) Less(i, j int) bool {
	return h[i].counter < h[j].counter || h[i].counter == h[j].counter && h[i].since < h[j].since
}
func (h flowHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *flowHeap) Push(x any) {
	f := x.(*flow)
	f.index = len(*h)
	*h = append(*h, f)
}
func (h *flowHeap) Pop() any {
	old := *h
	f := old[len(old)-1]
	old[len(old)-1] = nil
	f.index = -1
	*h = old[:len(old)-1]
	return f
}
