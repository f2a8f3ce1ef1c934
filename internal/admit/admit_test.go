package admit

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

// queueing enqueues requests one at a time (each waits until it is counted), and records the
// order in which they are granted; each granted request keeps its slot until released.
type queueing struct {
	t       *testing.T
	s       *Scheduler
	mu      sync.Mutex
	order   []string
	tickets map[string]*Ticket
	errs    map[string]error
	wg      sync.WaitGroup
}

func newQueueing(t *testing.T, s *Scheduler) *queueing {
	return &queueing{t: t, s: s, tickets: map[string]*Ticket{}, errs: map[string]error{}}
}

func (q *queueing) add(ctx context.Context, name string, r Request) {
	q.t.Helper()
	before := q.s.Waiting(r.Class)
	q.wg.Go(func() {
		tk, err := q.s.Acquire(ctx, r)
		q.mu.Lock()
		defer q.mu.Unlock()
		if err != nil {
			q.errs[name] = err
			return
		}
		q.order = append(q.order, name)
		q.tickets[name] = &tk
	})
	deadline := time.Now().Add(5 * time.Second)
	for q.s.Waiting(r.Class) == before {
		if time.Now().After(deadline) {
			q.t.Fatalf("%s never queued", name)
		}
		time.Sleep(time.Millisecond)
	}
}

// releaseNext releases the oldest granted ticket not yet released with usage in/out, and waits
// until the next request is granted (or none is waiting).
func (q *queueing) release(name string, in, out int) {
	q.t.Helper()
	q.mu.Lock()
	tk := q.tickets[name]
	n := len(q.order)
	q.mu.Unlock()
	if tk == nil {
		q.t.Fatalf("%s holds no slot (order %v)", name, q.order)
	}
	waiting := 0
	for c := Class(0); c < NumClasses; c++ {
		waiting += q.s.Waiting(c)
	}
	tk.Release(in, out)
	if waiting == 0 {
		return
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		q.mu.Lock()
		m := len(q.order)
		q.mu.Unlock()
		if m > n {
			return
		}
		if time.Now().After(deadline) {
			q.t.Fatal("no request was granted the freed slot")
		}
		time.Sleep(time.Millisecond)
	}
}

// waitN waits until n requests were granted.
func (q *queueing) waitN(n int) {
	q.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		q.mu.Lock()
		m := len(q.order)
		q.mu.Unlock()
		if m >= n {
			return
		}
		if time.Now().After(deadline) {
			q.t.Fatalf("%d granted, want %d", m, n)
		}
		time.Sleep(time.Millisecond)
	}
}

func (q *queueing) count() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.order)
}

func (q *queueing) last() string {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.order[len(q.order)-1]
}

func hold(t *testing.T, s *Scheduler) *Ticket {
	t.Helper()
	tk, err := s.Acquire(context.Background(), Request{Tenant: "holder", Class: Critical})
	if err != nil {
		t.Fatal(err)
	}
	return &tk
}

func opts(slots int) Options {
	o := Options{Slots: slots, InputWeight: 1, OutputWeight: 2}
	for c := range o.Depth {
		o.Depth[c], o.Timeout[c] = 100, 10*time.Second
	}
	return o
}

// Classes: the highest waiting class is served first, whatever arrived first.
func TestHigherClassFirst(t *testing.T) {
	s := New(opts(1))
	h := hold(t, s)
	q := newQueueing(t, s)
	q.add(t.Context(), "batch", Request{Tenant: "a", Class: Batch})
	q.add(t.Context(), "default", Request{Tenant: "a", Class: Default})
	q.add(t.Context(), "critical", Request{Tenant: "a", Class: Critical})
	q.add(t.Context(), "interactive", Request{Tenant: "a", Class: Interactive})
	h.Release(0, 0)
	q.waitN(1)
	for q.last() != "critical" {
		t.Fatalf("first %s", q.last())
	}
	for _, want := range []string{"interactive", "default", "batch"} {
		q.release(q.last(), 0, 0)
		if got := q.last(); got != want {
			t.Fatalf("served %s, want %s", got, want)
		}
	}
	q.release("batch", 0, 0)
	q.wg.Wait()
}

// Weighted VTC inside a class: the tenant with the smallest counter (tokens served, divided by
// its weight) goes next; inside a tenant, first come first served. Deterministic order.
func TestWeightedFairOrder(t *testing.T) {
	s := New(opts(1))
	h := hold(t, s)
	q := newQueueing(t, s)
	// a (weight 1) and b (weight 2) each queue 4 requests of 100 output tokens (cost 200 a
	// request): b is served about twice as often.
	for i := 0; i < 4; i++ {
		q.add(t.Context(), fmt.Sprintf("a%d", i), Request{Tenant: "a", Weight: 1, Class: Default, Out: 100})
		q.add(t.Context(), fmt.Sprintf("b%d", i), Request{Tenant: "b", Weight: 2, Class: Default, Out: 100})
	}
	h.Release(0, 0)
	q.waitN(1)
	for q.count() < 8 {
		q.release(q.last(), -1, -1)
	}
	got := strings.Join(q.order, " ")
	// Counters: a +200 a request, b +100. Equal counters go to the flow backlogged longer (a).
	if want := "a0 b0 b1 a1 b2 b3 a2 a3"; got != want {
		t.Errorf("order %s, want %s", got, want)
	}
	q.release(q.last(), -1, -1)
	q.wg.Wait()
}

// A tenant back from idle is lifted to the smallest active counter: it cannot bank credit.
func TestReturningTenantBanksNothing(t *testing.T) {
	s := New(opts(1))
	// b is served alone for a while: its counter grows.
	for i := 0; i < 10; i++ {
		tk, _ := s.Acquire(t.Context(), Request{Tenant: "b", Class: Default, Out: 100})
		tk.Release(-1, -1)
	}
	h := hold(t, s)
	q := newQueueing(t, s)
	q.add(t.Context(), "b0", Request{Tenant: "b", Class: Default, Out: 100})
	q.add(t.Context(), "b1", Request{Tenant: "b", Class: Default, Out: 100})
	// a arrives (never served, counter 0): lifted to b's counter, so it does not get the next
	// many slots in a row.
	q.add(t.Context(), "a0", Request{Tenant: "a", Class: Default, Out: 100})
	q.add(t.Context(), "a1", Request{Tenant: "a", Class: Default, Out: 100})
	h.Release(0, 0)
	q.waitN(1)
	for q.count() < 4 {
		q.release(q.last(), -1, -1)
	}
	if got := strings.Join(q.order, " "); got != "b0 a0 b1 a1" {
		t.Errorf("order %s: a banked credit while away", got)
	}
	q.release(q.last(), -1, -1)
	q.wg.Wait()
}

// Settlement corrects the counter: a request that used less than estimated gives it back.
func TestSettlementCorrectsCounters(t *testing.T) {
	s := New(opts(1))
	a, _ := s.Acquire(t.Context(), Request{Tenant: "a", Class: Default, Out: 1000})
	a.Release(0, 10) // used 10 of 1,000
	b, _ := s.Acquire(t.Context(), Request{Tenant: "b", Class: Default, Out: 100})
	b.Release(-1, -1)
	if got := s.Served(5); got["a"] != 20 || got["b"] != 200 {
		t.Errorf("served %v, want a 20 (10 output tokens ×2) and b 200", got)
	}
}

// Promotion: a request that waited PromoteAfter moves up a class.
func TestPromotion(t *testing.T) {
	o := opts(1)
	o.PromoteAfter = 50 * time.Millisecond
	s := New(o)
	h := hold(t, s)
	q := newQueueing(t, s)
	q.add(t.Context(), "old batch", Request{Tenant: "a", Class: Batch})
	time.Sleep(60 * time.Millisecond)
	s.Tick() // promotes it to default
	q.add(t.Context(), "new default", Request{Tenant: "b", Class: Default})
	if s.Waiting(Default) != 2 || s.Waiting(Batch) != 0 {
		t.Fatalf("waiting: default %d, batch %d", s.Waiting(Default), s.Waiting(Batch))
	}
	h.Release(0, 0)
	q.waitN(1)
	if q.last() != "old batch" {
		t.Errorf("served %s first, want the promoted request", q.last())
	}
	q.release(q.last(), 0, 0)
	q.release(q.last(), 0, 0)
	q.wg.Wait()
	if tk := q.tickets["old batch"]; tk.Class != Default {
		t.Errorf("served in class %s", tk.Class)
	}
}

// A class's own promotion wait (smg's starvation_threshold_secs per class) holds over the
// global one: batch waiters move up after theirs while default's waiters, whose wait is longer,
// stay.
func TestPromotionPerClass(t *testing.T) {
	o := opts(1)
	o.PromoteAfter = time.Hour
	o.Promote[Batch] = 20 * time.Millisecond
	s := New(o)
	hold(t, s)
	q := newQueueing(t, s)
	q.add(t.Context(), "batch", Request{Tenant: "a", Class: Batch})
	q.add(t.Context(), "default", Request{Tenant: "b", Class: Default})
	time.Sleep(30 * time.Millisecond)
	s.Tick()
	if s.Waiting(Batch) != 0 || s.Waiting(Default) != 2 || s.Waiting(Interactive) != 0 {
		t.Fatalf("waiting: interactive %d, default %d, batch %d; want the batch request promoted to default only",
			s.Waiting(Interactive), s.Waiting(Default), s.Waiting(Batch))
	}
	if o.ShortestPromoteWait() != 20*time.Millisecond || o.PromoteWait(Default) != time.Hour {
		t.Errorf("shortest %v, default's %v", o.ShortestPromoteWait(), o.PromoteWait(Default))
	}
}

// Promotion never lifts a request above its ceiling (its tenant's max_priority), however long it
// waits — nor so into the slots reserved for critical work: a batch tenant's request that waited
// many promotion periods is still batch, still waiting, while a request whose ceiling allows it
// rises and takes the reserved slot.
func TestPromotionStopsAtTheCeiling(t *testing.T) {
	o := opts(2)
	o.Reserved[Critical] = 1
	o.PromoteAfter = 10 * time.Millisecond
	s := New(o)
	h := hold(t, s) // one slot taken; the other is critical's
	q := newQueueing(t, s)
	q.add(t.Context(), "capped", Request{Tenant: "a", Class: Batch, Ceiling: Batch})
	for range 10 {
		time.Sleep(15 * time.Millisecond)
		s.Tick()
	}
	if s.Waiting(Batch) != 1 || s.InUse() != 1 {
		t.Fatalf("after 10 promotion periods: waiting in batch %d, in use %d; want the capped request still waiting in batch", s.Waiting(Batch), s.InUse())
	}
	q.add(t.Context(), "free", Request{Tenant: "b", Class: Batch, Ceiling: Critical})
	for deadline := time.Now().Add(5 * time.Second); s.InUse() < 2 && time.Now().Before(deadline); {
		time.Sleep(15 * time.Millisecond)
		s.Tick()
	}
	q.waitN(1)
	if q.last() != "free" || q.tickets["free"].Class != Critical {
		t.Fatalf("served %s in %s, want the request allowed critical, promoted into the reserved slot", q.last(), q.tickets[q.last()].Class)
	}
	h.Release(0, 0)
	q.release("free", 0, 0) // two slots free, one beyond the reserve: the capped request's, as batch
	q.waitN(2)
	if tk := q.tickets["capped"]; tk.Class != Batch {
		t.Errorf("the capped request was served in %s", tk.Class)
	}
	q.release("capped", 0, 0)
	q.wg.Wait()
}

// Reserved slots: a burst of batch work cannot take the slots kept for critical requests.
func TestReservedSlots(t *testing.T) {
	o := opts(3)
	o.Reserved[Critical] = 2
	s := New(o)
	b1, err := s.Acquire(t.Context(), Request{Tenant: "a", Class: Batch})
	if err != nil {
		t.Fatal(err)
	}
	q := newQueueing(t, s)
	q.add(t.Context(), "batch 2", Request{Tenant: "a", Class: Batch}) // waits: 2 free, both reserved
	c1, err := s.Acquire(t.Context(), Request{Tenant: "c", Class: Critical})
	if err != nil {
		t.Fatal("a critical request found no reserved slot")
	}
	if s.Waiting(Batch) != 1 || s.InUse() != 2 {
		t.Errorf("waiting %d, in use %d", s.Waiting(Batch), s.InUse())
	}
	c1.Release(0, 0)
	b1.Release(0, 0) // now 3 free: 1 above the reservation, the batch request goes
	q.wg.Wait()
	if q.order[0] != "batch 2" {
		t.Errorf("order %v", q.order)
	}
}

// Depth, timeout, a client that leaves, and drain.
func TestLimitsAndLeaving(t *testing.T) {
	o := opts(1)
	o.Depth[Batch], o.Timeout[Batch] = 1, 30*time.Millisecond
	s := New(o)
	h := hold(t, s)
	start := time.Now()
	if _, err := s.Acquire(t.Context(), Request{Tenant: "a", Class: Batch}); !errors.Is(err, ErrTimeout) || time.Since(start) < 30*time.Millisecond {
		t.Errorf("timeout: %v after %s", err, time.Since(start))
	}
	q := newQueueing(t, s)
	q.add(t.Context(), "waits", Request{Tenant: "a", Class: Default})
	ctx, cancel := context.WithCancel(t.Context())
	q.add(ctx, "leaves", Request{Tenant: "b", Class: Default})
	cancel()
	deadline := time.Now().Add(5 * time.Second)
	for s.Waiting(Default) != 1 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if s.Waiting(Default) != 1 {
		t.Fatal("a client that left is still queued")
	}
	o2 := opts(1)
	o2.Depth[Default] = 1
	s2 := New(o2)
	h2 := hold(t, s2)
	q2 := newQueueing(t, s2)
	q2.add(t.Context(), "one", Request{Tenant: "a", Class: Default})
	if _, err := s2.Acquire(t.Context(), Request{Tenant: "a", Class: Default}); !errors.Is(err, ErrQueueFull) {
		t.Errorf("past the depth: %v", err)
	}
	s2.Drain()
	q2.wg.Wait()
	if !errors.Is(q2.errs["one"], ErrDraining) {
		t.Errorf("a queued request on drain: %v", q2.errs["one"])
	}
	if _, err := s2.Acquire(t.Context(), Request{Tenant: "a", Class: Critical}); !errors.Is(err, ErrDraining) {
		t.Errorf("after drain: %v", err)
	}
	h2.Release(0, 0)
	h.Release(0, 0)
	q.wg.Wait()
	if _, ok := q.tickets["leaves"]; ok {
		t.Error("a slot was given to a client that left")
	}
	q.tickets["waits"].Release(0, 0)
	if s.InUse() != 0 {
		t.Errorf("%d slots still in use", s.InUse())
	}
}

// Work conservation under churn: many clients, some leaving, some timing out; every slot is
// given back and nothing is left queued.
func TestNoSlotLeaks(t *testing.T) {
	o := opts(4)
	for c := range o.Timeout {
		o.Timeout[c] = 20 * time.Millisecond
	}
	s := New(o)
	var wg sync.WaitGroup
	for i := 0; i < 400; i++ {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i%7)*3*time.Millisecond)
			defer cancel()
			tk, err := s.Acquire(ctx, Request{Tenant: fmt.Sprint("t", i%5), Class: Class(i % 4), Out: i % 50})
			if err == nil {
				time.Sleep(time.Millisecond)
				tk.Release(1, 1)
			}
		})
	}
	wg.Wait()
	if s.InUse() != 0 {
		t.Errorf("%d slots leaked", s.InUse())
	}
	for c := Class(0); c < NumClasses; c++ {
		if s.Waiting(c) != 0 {
			t.Errorf("%d still waiting in %s", s.Waiting(c), c)
		}
	}
}

// The admission decision with 1,000 tenants backlogged: one enqueue and one dispatch.
func BenchmarkEnqueueDispatch(b *testing.B) {
	s := New(opts(1))
	s.inUse = 1
	var ws []*Waiter
	for i := 0; i < 1000; i++ {
		w := &Waiter{ch: make(chan error, 1)}
		w.fl = s.flow(Default, fmt.Sprint("tenant-", i), 1)
		w.class, w.cost = Default, float64(i%7)
		s.enqueue(w)
		ws = append(ws, w)
	}
	b.ReportAllocs()
	for b.Loop() {
		s.mu.Lock()
		s.inUse--
		s.dispatch(time.Time{})
		s.mu.Unlock()
		// The granted waiter comes back as a new request of its tenant.
		for _, w := range ws {
			if w.granted {
				<-w.ch
				w.granted = false
				s.mu.Lock()
				s.enqueue(w)
				s.mu.Unlock()
				break
			}
		}
	}
}

// More slots (the engines' capacity grew) go to the waiting at once; fewer take effect as
// requests end.
func TestSetSlots(t *testing.T) {
	s := New(opts(1))
	h := hold(t, s)
	q := newQueueing(t, s)
	q.add(t.Context(), "a", Request{Tenant: "a", Class: Default})
	q.add(t.Context(), "b", Request{Tenant: "b", Class: Default})
	s.SetSlots(3)
	q.waitN(2)
	s.SetSlots(1)
	if s.Slots() != 1 || s.InUse() != 3 {
		t.Errorf("slots %d, in use %d: want 1 and the 3 already served", s.Slots(), s.InUse())
	}
	h.Release(0, 0)
	q.release("a", 0, 0)
	q.release("b", 0, 0)
	q.wg.Wait()
}
