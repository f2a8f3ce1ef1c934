package director

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/admit"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/tenant"
	"github.com/baton-llm/baton/internal/worker"
)

// queueSettings bound the inference requests served at once: Max at once (0 or less: no bound),
// QueueSize more waiting per priority class at most QueueTimeout each (Depth and Timeout override
// them per class); Reserved slots are kept for a class and those above it; a request waiting
// PromoteAfter moves up a class; InputWeight and OutputWeight weigh tokens in tenants' shares.
type queueSettings struct {
	Max, QueueSize            int
	QueueTimeout              time.Duration
	Reserved                  [admit.NumClasses]int
	Depth                     [admit.NumClasses]*int
	Timeout                   [admit.NumClasses]time.Duration
	PromoteAfter              time.Duration
	Promote                   [admit.NumClasses]time.Duration // per class, over PromoteAfter
	InputWeight, OutputWeight float64
	// SmgAnswers answers a full queue 429 and a wait past its timeout 408, as smg's priority
	// scheduler does; false: 503 and 504.
	SmgAnswers bool
	// FromEngines sizes Max from the engines' capacity (Director.capacity), recomputed as the
	// fleet changes; Max is the first size, before any worker is known.
	FromEngines bool
	// RetryAfter is the Retry-After of the queue's refusals; 0: a tenth of the default class's
	// timeout, at least a second.
	RetryAfter time.Duration
}

// admission bounds the inference requests served at once: when every slot is taken a request
// waits in its priority class's queue, and the next free slot goes to the highest class waiting,
// the tenant served least in it, that tenant's oldest request (internal/admit). Past a class's
// depth it is 503 queue_full, past its timeout 504 queue_timeout, both with Retry-After; a client
// that leaves leaves the queue; on drain every waiting request gets 503 server_draining at once.
type admission struct {
	s       *admit.Scheduler
	o       admit.Options
	metrics *metrics.Metrics
	smg     bool // smg's statuses: 429 for a full queue, 408 past the timeout
	// retryAfter is the Retry-After of a refusal (0: a tenth of the default class's timeout).
	retryAfter time.Duration
	// log hears of load shed: a WARN at most once a minute while requests are refused for want
	// of a slot, with how many were since the last.
	log  *slog.Logger
	shed shedLog
	// fromEngines: the slots are sized from the engines' capacity (Director.sizeSlots).
	fromEngines bool
}

// shedLog is what the log was told of load shed: a WARN at most every every, counting the
// refusals since the last; a timer set by each WARN says what was refused since it once every
// passed, so that an episode's end is in the log too.
type shedLog struct {
	mu    sync.Mutex
	every time.Duration
	last  time.Time // of the last WARN
	n     int64     // refused since it
	armed bool      // a summary is due
}

// shedEvery is how often at most a WARN says that requests are refused for want of a slot.
const shedEvery = time.Minute

// newAdmission returns admission for a; nil when requests are not bounded.
func newAdmission(a queueSettings, m *metrics.Metrics, log *slog.Logger) *admission {
	if a.Max <= 0 {
		return nil
	}
	o := admit.Options{Slots: a.Max, PromoteAfter: a.PromoteAfter, InputWeight: a.InputWeight, OutputWeight: a.OutputWeight}
	for c := admit.Class(0); c < admit.NumClasses; c++ {
		o.Depth[c], o.Timeout[c], o.Reserved[c] = a.QueueSize, a.QueueTimeout, a.Reserved[c]
		if a.Depth[c] != nil {
			o.Depth[c] = *a.Depth[c]
		}
		if a.Timeout[c] > 0 {
			o.Timeout[c] = a.Timeout[c]
		}
		o.Promote[c] = a.Promote[c]
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ad := &admission{s: admit.New(o), o: o, metrics: m, smg: a.SmgAnswers, retryAfter: a.RetryAfter, log: log, shed: shedLog{every: shedEvery},
		fromEngines: a.FromEngines}
	return ad
}

// start runs promotions while ctx lives: a request that waited long enough moves up a class
// even while no slot frees.
func (a *admission) start(ctx context.Context) {
	if a == nil || a.o.ShortestPromoteWait() <= 0 {
		return
	}
	go every(ctx, max(a.o.ShortestPromoteWait()/4, 50*time.Millisecond), a.s.Tick)
}

// every runs f every interval until ctx ends.
func every(ctx context.Context, interval time.Duration, f func()) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f()
		}
	}
}

// drain refuses every waiting request at once.
func (a *admission) drain() {
	if a != nil {
		a.s.Drain()
	}
}

// acquire takes a slot for the request in class, waiting in the queue if need be. It returns the
// slot's release (which settles the tenant's share with the request's usage on its record) and
// true, or false with the refusal to answer — none when the client left or its deadline passed
// while it waited. Inference handlers call it after reading the body, so that a slot covers
// upstream work only: a client slow to send cannot hold one.
func (a *admission) acquire(ctx context.Context, rec *record.Record, class, ceiling admit.Class, in, out int) (release func(), refusal *openai.Error, ok bool) {
	if a == nil {
		return func() {}, nil, true
	}
	weight := 1.0
	if rec.Who != nil {
		weight = rec.Who.Weight
	}
	a.metrics.QueueDepth.WithLabelValues(class.String()).Inc()
	t, err := a.s.Acquire(ctx, admit.Request{Tenant: rec.TenantName(), Weight: weight, Class: class, Ceiling: ceiling, In: in, Out: out})
	a.metrics.QueueDepth.WithLabelValues(class.String()).Dec()
	rec.QueueWait = t.Waited
	if t.Waited > 0 || err != nil {
		a.metrics.QueueWait.WithLabelValues(t.Class.String()).Observe(t.Waited.Seconds())
	}
	switch err {
	case nil:
		if t.Class != class {
			rec.Class = record.Class(t.Class.String()) // promoted while it waited
		}
		return func() { t.Release(rec.Charge(in, out)) }, nil, true
	case admit.ErrQueueFull:
		return nil, a.reject(openai.CodeQueueFull, &openai.Error{Status: cmp.Or(a.smgStatus(429), statusUnavailable), Code: openai.CodeQueueFull,
			Message: fmt.Sprintf("every slot is taken and the %s queue is full", class)}), false
	case admit.ErrTimeout:
		return nil, a.reject(openai.CodeQueueTimeout, &openai.Error{Status: cmp.Or(a.smgStatus(408), 504), Code: openai.CodeQueueTimeout,
			Message: fmt.Sprintf("waited %s in the %s queue for a slot", a.o.Timeout[t.Class].Round(time.Millisecond), t.Class)}), false
	case admit.ErrDraining:
		return nil, a.reject("draining", &openai.Error{Status: statusUnavailable, Code: openai.CodeDraining,
			Message: "the server is shutting down; retry on another replica"}), false
	}
	return nil, nil, false // the client left: nobody to answer
}

// smgStatus is status when the queue answers as smg's scheduler does, else 0.
func (a *admission) smgStatus(status int) int {
	if a.smg {
		return status
	}
	return 0
}

func (a *admission) reject(reason string, e *openai.Error) *openai.Error {
	a.metrics.Rejections.WithLabelValues(reason).Inc()
	if reason == openai.CodeQueueFull || reason == openai.CodeQueueTimeout {
		a.noteShed(reason)
	}
	after := a.retryAfter
	if after <= 0 {
		after = a.o.Timeout[admit.Default] / 10
	}
	e.RetryAfter = strconv.Itoa(max(1, int(math.Ceil(after.Seconds()))))
	return e
}

// admissionOf is the admission settings of the configuration's section a.
func admissionOf(a config.Admission) queueSettings {
	o := queueSettings{Max: a.MaxConcurrentRequests, FromEngines: a.SlotsFromEngines, QueueSize: a.QueueSize, QueueTimeout: a.QueueTimeout,
		PromoteAfter: a.PromoteAfter, InputWeight: a.FairInputWeight, OutputWeight: a.FairOutputWeight, SmgAnswers: a.QueueAnswers == "smg",
		RetryAfter: a.QueueRetryAfter}
	o.Reserved, o.Depth, o.Timeout, o.Promote = ClassSettings(a)
	if o.FromEngines {
		o.Max = NoWorkerCapacity
	}
	return o
}

// Sized from the engines' capacity, as smg's priority scheduler sizes its slots
// (model_gateway/src/worker/capacity.rs): the sum of what each available worker that runs
// requests (regular, or in PD the decodes) reports it runs at once (Worker.MaxRunning),
// SlotsPerWorker for each that reports nothing, NoWorkerCapacity while none is available.
const (
	SlotsPerWorker   = 64
	NoWorkerCapacity = 1024
)

// capacity is the requests the fleet's engines run at once, as SlotsPerWorker and
// NoWorkerCapacity say.
func (d *Director) capacity() int {
	role := config.RoleRegular
	if d.o.PD {
		role = config.RoleDecode
	}
	n, workers := 0, 0
	for _, w := range worker.Available(d.reg.Snapshot().Workers) {
		if w.Role != role {
			continue
		}
		workers++
		if r := w.MaxRunning(); r > 0 {
			n += r
		} else {
			n += SlotsPerWorker
		}
	}
	if workers == 0 {
		return NoWorkerCapacity
	}
	return min(n, 1<<20)
}

// sizeSlots sizes the slots from the engines' capacity when they are (FromEngines), saying each
// change in the log.
func (d *Director) sizeSlots() {
	a := d.admit
	if a == nil || !a.fromEngines {
		return
	}
	if n, was := d.capacity(), a.s.Slots(); n != was {
		a.s.SetSlots(n)
		d.log.Info("requests served at once sized from the engines' capacity", "slots", n, "was", was)
	}
}

// ClassSettings reads reserved_slots and queue_classes by class name (validated by the
// configuration).
func ClassSettings(a config.Admission) (reserved [admit.NumClasses]int, depth [admit.NumClasses]*int, timeout, promote [admit.NumClasses]time.Duration) {
	for name, n := range a.ReservedSlots {
		if c, ok := admit.ParseClass(name); ok {
			reserved[c] = n
		}
	}
	for name, qc := range a.Classes {
		if c, ok := admit.ParseClass(name); ok {
			depth[c], timeout[c], promote[c] = qc.Size, qc.Timeout, qc.PromoteAfter
		}
	}
	return reserved, depth, timeout, promote
}

// Admitted is what Admit took for a request, given back by End.
type Admitted struct {
	// Class is the priority class the request was given (X-Baton-Priority), "" when its header
	// was refused; Limits its tenant's windows now, for the rate-limit headers (none: zero).
	Class  record.Class
	Limits tenant.Decision
	// Refusal is the answer to a request Admit refused; nil when it was admitted, or when the
	// client left while it waited (nobody to answer).
	Refusal *openai.Error
	// Orders are the tenant's accounting asked of the answer's relay.
	Orders proxy.Orders

	d        *Director
	rec      *record.Record
	inFlight prometheus.Gauge
	ls       *lease
	release  func()
}

// End gives back what was taken, in the reverse order: the slot, the tenant's reservation
// (settled with what the request used), the model's in-flight count.
func (a *Admitted) End() {
	if a.release != nil {
		a.release()
	}
	if a.ls != nil {
		a.d.settleTenant(a.rec, a.ls)
	}
	if a.inFlight != nil {
		a.inFlight.Dec()
	}
}

// Admit takes an inference request from its parsed body to its slot: the model's in-flight
// count, the batch bounds, its priority class (baton and smg are its priority headers' values),
// its tenant's models and limits (a reservation), and a slot. ok is false when one refused
// (Refusal says how) or the client left while it waited. End is to be deferred whatever ok says.
func (d *Director) Admit(ctx context.Context, rec *record.Record, preq *pd.Request, baton, smg string) (a *Admitted, ok bool) {
	req := preq.Request
	a = &Admitted{d: d, rec: rec}
	rec.ModelLabel = d.metrics.Model(req.Model) // the report reads it too
	a.inFlight = d.metrics.ModelInFlight.WithLabelValues(rec.ModelLabel)
	a.inFlight.Inc()
	if a.Refusal = d.CountBatch(preq); a.Refusal != nil {
		return a, false
	}
	class, ceiling, e := d.priority(rec, baton, smg)
	if e != nil {
		a.Refusal = e
		return a, false
	}
	a.Class = rec.Class
	est := tokenEstimate{d: d, preq: preq}
	if a.ls, a.Limits, a.Refusal, ok = d.admitTenant(ctx, rec, preq, &est); !ok {
		return a, false
	}
	if a.ls != nil {
		a.Orders = proxy.Orders{CountUsage: rec.ByStreamUsage, StripUsage: a.ls.ask.include, AskedEach: a.ls.ask.each, ClientEach: a.ls.ask.clientEach}
	}
	if d.o.Advisor != nil && req.Stream && !a.Orders.StripUsage && routes.Of(preq.Path).StreamOptions {
		// The advisor fits the decodes' pace from streams' usage: a stream not asking for it
		// asks the engine, the relay keeping it from the client (as for a tenant's).
		if body, ask := askUsage(req.Body, false); ask.include && req.SetBody(body) == nil {
			a.Orders.StripUsage = true
		}
	}
	if d.admit == nil {
		return a, true
	}
	in, out := est.get()
	a.release, a.Refusal, ok = d.admit.acquire(ctx, rec, class, ceiling, in, out)
	return a, ok
}

// priority is the request's class: its X-Baton-Priority (or smg's X-Smg-Priority), else
// default, clamped to its tenant's max_priority, written on the record; and the tenant's
// ceiling. An unknown value is 400 naming the valid ones.
func (d *Director) priority(rec *record.Record, baton, smg string) (class, ceiling admit.Class, e *openai.Error) {
	class, e = PriorityClass(baton, smg)
	if e != nil {
		return 0, 0, e
	}
	ceiling = admit.Interactive
	who := rec.Who
	if set := d.Tenants(); who == nil && set.Open() {
		who = set.Identify("") // every request is tenant default's
	}
	if who != nil {
		ceiling, _ = admit.ParseClass(who.MaxPriority)
	}
	if class < ceiling {
		class = ceiling
	}
	rec.Class = record.Class(class.String())
	return class, ceiling, nil
}

// Acquire takes a slot in the default class for a request without a body to read first; see
// Admit for what the results say.
func (d *Director) Acquire(ctx context.Context, rec *record.Record) (release func(), refusal *openai.Error, ok bool) {
	return d.admit.acquire(ctx, rec, admit.Default, admit.Default, 0, 0)
}

// Start runs the queue's promotions, and the look at which models can be served, while ctx lives.
func (d *Director) Start(ctx context.Context) {
	d.admit.start(ctx)
	d.sizeSlots()
	d.bg.Go(func() {
		var last map[string]string
		every(ctx, ServableEvery, func() { last = d.noteServable(last); d.sizeSlots() })
	})
	if d.o.LocalRule != nil && d.o.Advisor != nil {
		d.bg.Go(func() { every(ctx, LocalRefresh, d.RefreshLocal) })
	}
}

// Drain refuses every request waiting for a slot at once.
func (d *Director) Drain() { d.admit.drain() }

// Settled waits for the tenants' settlements still waiting on a worker's count of a prompt.
func (d *Director) Settled() { d.settling.Wait() }

// Wait waits for the tenants' settlements still waiting on a worker's count of a prompt, and
// for the background work Start began.
func (d *Director) Wait() { d.settling.Wait(); d.bg.Wait() }

// Queues are the slots and the queues now, for the status page; nil when requests are not
// bounded.
func (d *Director) Queues() map[string]any {
	a := d.admit
	if a == nil {
		return nil
	}
	waiting := map[string]int{}
	for c := admit.Class(0); c < admit.NumClasses; c++ {
		waiting[c.String()] = a.s.Waiting(c)
	}
	return map[string]any{"slots": a.o.Slots, "in_use": a.s.InUse(), "waiting": waiting, "served": a.s.Served(5)}
}

// noteShed counts a request refused for want of a slot, and says so in a WARN at most once a
// minute (the first at once): an operator sees load shed in the log as well as in
// baton_rejections_total, without a line per refusal. A minute after a WARN, one more counts what
// was refused since, if anything was, so that an episode's end is in the log.
func (a *admission) noteShed(reason string) {
	l := &a.shed
	l.mu.Lock()
	defer l.mu.Unlock()
	l.n++
	if l.last.IsZero() || time.Since(l.last) >= l.every {
		a.warnShedLocked(reason)
	}
}

// warnShedLocked logs the refusals since the last WARN, and sets the summary's timer.
func (a *admission) warnShedLocked(reason string) {
	l := &a.shed
	since := "start"
	if !l.last.IsZero() {
		since = time.Since(l.last).Round(time.Second).String()
	}
	a.log.Warn("shedding load: requests refused for want of a slot (every slot taken and the queue full, or the wait past its timeout)",
		"refused", l.n, "since", since, "last_reason", reason,
		"max_concurrent_requests", a.o.Slots, "queue_size", a.o.Depth[admit.Default])
	l.n, l.last = 0, time.Now()
	a.armShedLocked(l.every, reason)
}

func (a *admission) armShedLocked(after time.Duration, reason string) {
	if !a.shed.armed {
		a.shed.armed = true
		time.AfterFunc(after, func() { a.shedSummary(reason) })
	}
}

// shedSummary is the timer's: the refusals since the last WARN, once it is a minute old; nothing
// when none came (the episode ended).
func (a *admission) shedSummary(reason string) {
	l := &a.shed
	l.mu.Lock()
	defer l.mu.Unlock()
	l.armed = false
	switch {
	case l.n == 0:
	case time.Since(l.last) < l.every: // a WARN came meanwhile
		a.armShedLocked(l.every-time.Since(l.last), reason)
	default:
		a.warnShedLocked(reason)
	}
}
