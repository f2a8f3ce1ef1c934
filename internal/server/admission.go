package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/admit"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/record"
)

// Priority headers: Baton's, and smg's (with its class names system and bulk) for switchers.
const (
	HeaderPriority    = "X-Baton-Priority"
	HeaderSmgPriority = "X-Smg-Priority"
)

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
}

// newAdmission returns admission for a; nil when requests are not bounded.
func newAdmission(a Admission, m *metrics.Metrics) *admission {
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
	ad := &admission{s: admit.New(o), o: o, metrics: m, smg: a.SmgAnswers}
	return ad
}

// start runs promotions while ctx lives: a request that waited long enough moves up a class
// even while no slot frees.
func (a *admission) start(ctx context.Context) {
	if a == nil || a.o.ShortestPromoteWait() <= 0 {
		return
	}
	go func() {
		t := time.NewTicker(max(a.o.ShortestPromoteWait()/4, 50*time.Millisecond))
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				a.s.Tick()
			}
		}
	}()
}

// drain refuses every waiting request at once.
func (a *admission) drain() {
	if a != nil {
		a.s.Drain()
	}
}

// wrap admits requests to next, for routes without a body to read first.
func (a *admission) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		release, ok := a.acquire(w, r, admit.Default, admit.Default, 0, 0)
		if !ok {
			return
		}
		defer release()
		next.ServeHTTP(w, r)
	})
}

// acquire takes a slot for r in class, waiting in the queue if need be. It returns the slot's
// release (which settles the tenant's share with the request's usage on its record) and true,
// or false after answering the client itself, or when the client left or its deadline passed
// while it waited. Inference handlers call it after reading the body, so that a slot covers
// upstream work only: a client slow to send cannot hold one.
func (a *admission) acquire(w http.ResponseWriter, r *http.Request, class, ceiling admit.Class, in, out int) (release func(), ok bool) {
	if a == nil {
		return func() {}, true
	}
	rec := record.From(r.Context())
	weight := 1.0
	if rec.Who != nil {
		weight = rec.Who.Weight
	}
	a.metrics.QueueDepth.WithLabelValues(class.String()).Inc()
	t, err := a.s.Acquire(r.Context(), admit.Request{Tenant: rec.TenantName(), Weight: weight, Class: class, Ceiling: ceiling, In: in, Out: out})
	a.metrics.QueueDepth.WithLabelValues(class.String()).Dec()
	rec.QueueWait = t.Waited
	if t.Waited > 0 || err != nil {
		a.metrics.QueueWait.WithLabelValues(t.Class.String()).Observe(t.Waited.Seconds())
	}
	switch err {
	case nil:
		if t.Class != class {
			rec.Class = t.Class.String() // promoted while it waited
		}
		return func() { t.Release(rec.Charge(in, out)) }, true
	case admit.ErrQueueFull:
		a.reject(w, openai.CodeQueueFull, &openai.Error{Status: cmp.Or(a.smgStatus(http.StatusTooManyRequests), http.StatusServiceUnavailable), Code: openai.CodeQueueFull,
			Message: fmt.Sprintf("every slot is taken and the %s queue is full", class)})
	case admit.ErrTimeout:
		a.reject(w, openai.CodeQueueTimeout, &openai.Error{Status: cmp.Or(a.smgStatus(http.StatusRequestTimeout), http.StatusGatewayTimeout), Code: openai.CodeQueueTimeout,
			Message: fmt.Sprintf("waited %s in the %s queue for a slot", a.o.Timeout[t.Class].Round(time.Millisecond), t.Class)})
	case admit.ErrDraining:
		a.reject(w, "draining", &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeDraining,
			Message: "the server is shutting down; retry on another replica"})
	}
	return nil, false // or the client left: nobody to answer
}

// smgStatus is status when the queue answers as smg's scheduler does, else 0.
func (a *admission) smgStatus(status int) int {
	if a.smg {
		return status
	}
	return 0
}

func (a *admission) reject(w http.ResponseWriter, reason string, e *openai.Error) {
	a.metrics.Rejections.WithLabelValues(reason).Inc()
	e.RetryAfter = strconv.Itoa(max(1, int(a.o.Timeout[admit.Default].Seconds()/10)))
	openai.WriteError(w, e)
}

// priorityOf is the request's class: its X-Baton-Priority (or smg's X-Smg-Priority), else
// default, clamped to its tenant's max_priority; echoed in the response's X-Baton-Priority. An
// unknown value is 400 naming the valid ones.
func (s *Server) priorityOf(w http.ResponseWriter, r *http.Request) (class, ceiling admit.Class, ok bool) {
	class, e := headerClass(r.Header)
	if e != nil {
		openai.WriteError(w, e)
		return 0, 0, false
	}
	rec := record.From(r.Context())
	ceiling = admit.Interactive
	who := rec.Who
	if set := s.tenants(); who == nil && set.Open() {
		who = set.Identify("") // every request is tenant default's
	}
	if who != nil {
		ceiling, _ = admit.ParseClass(who.MaxPriority)
	}
	if class < ceiling {
		class = ceiling
	}
	rec.Class = class.String()
	w.Header()[HeaderPriority] = []string{rec.Class}
	return class, ceiling, true
}

// headerClass is the class a request's X-Baton-Priority (or smg's X-Smg-Priority) names,
// default without one; an unknown X-Baton-Priority is 400 naming the valid ones, an unknown
// X-Smg-Priority default, as smg reads its header.
func headerClass(h http.Header) (admit.Class, *openai.Error) {
	for _, name := range []string{HeaderPriority, HeaderSmgPriority} {
		v := h.Get(name)
		if v == "" {
			continue
		}
		c, ok := admit.ParseClass(strings.ToLower(strings.TrimSpace(v)))
		if !ok && name == HeaderSmgPriority {
			return admit.Default, nil
		}
		if !ok {
			return 0, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidPriority, Param: name,
				Message: fmt.Sprintf("%s %.40q is no priority class: want critical, interactive, default or batch (smg's system and bulk too)", name, v)}
		}
		return c, nil
	}
	return admit.Default, nil
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

// waitingRoom holds a request whose selection found no ready worker for its model, when the
// model is one Baton knows and no_worker_wait is set: until a worker for it is ready (then true:
// select again), the wait passes, or the client leaves. baton_model_waiting_requests counts the
// requests held: what scales an engine up from zero.
func (s *Server) waitingRoom(r *http.Request, model string, err error) bool {
	nw, ok := errors.AsType[*policy.NoWorkerError](err)
	if s.opts.NoWorkerWait <= 0 || !ok || (nw.Kind() != policy.NoneAvailable && nw.Kind() != policy.ModelUnserved) || !s.metrics.Known(model) {
		return false // only a worker's coming can mend it: not a route refused, nor pairs that cannot meet
	}
	g := s.metrics.ModelWaiting.WithLabelValues(s.metrics.KnownLabel(model))
	g.Inc()
	defer g.Dec()
	deadline := time.NewTimer(s.opts.NoWorkerWait)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-r.Context().Done():
			return false
		case <-deadline.C:
			return false
		case <-tick.C:
			if s.readyFor(model) {
				return true
			}
		}
	}
}

// readyFor reports whether model has a ready worker of every role a request needs.
func (s *Server) readyFor(model string) bool {
	roles := []string{config.RoleRegular}
	if s.opts.PD && !s.sel.HasRole(config.RoleRegular) {
		roles = []string{config.RolePrefill, config.RoleDecode}
	}
	snap := s.reg.Snapshot()
	for _, role := range roles {
		cands, _ := s.candidates(snap, role, model)
		ready := false
		for _, w := range cands {
			ready = ready || w.Ready()
		}
		if !ready {
			return false
		}
	}
	return true
}

// admitted is what admitRequest took for a request, given back by end.
type admitted struct {
	s        *Server
	r        *http.Request
	inFlight prometheus.Gauge
	ls       *lease
	release  func()
}

// end gives back what was taken, in the reverse order: the slot, the tenant's reservation
// (settled with what the request used), the model's in-flight count.
func (a *admitted) end() {
	if a.release != nil {
		a.release()
	}
	if a.ls != nil {
		a.s.settleTenant(a.r, a.ls)
	}
	if a.inFlight != nil {
		a.inFlight.Dec()
	}
}

// admitRequest takes an inference request from its parsed body to its slot: the model's
// in-flight count, the batch bounds, its priority class, its tenant's models and limits (a
// reservation), and a slot. It answers the client itself when one refuses (false). Its end is
// to be deferred whatever ok says.
func (s *Server) admitRequest(w http.ResponseWriter, r *http.Request, preq *pd.Request) (a admitted, ok bool) {
	req := preq.Request
	a.s, a.r = s, r
	rec := record.From(r.Context())
	rec.ModelLabel = s.metrics.Model(req.Model) // finish reads it too
	a.inFlight = s.metrics.ModelInFlight.WithLabelValues(rec.ModelLabel)
	a.inFlight.Inc()
	if e := s.countBatch(preq); e != nil {
		openai.WriteError(w, e)
		return a, false
	}
	class, ceiling, ok := s.priorityOf(w, r)
	if !ok {
		return a, false
	}
	est := tokenEstimate{s: s, preq: preq}
	if a.ls, ok = s.admitTenant(w, r, preq, &est); !ok {
		return a, false
	}
	if s.admit == nil {
		return a, true
	}
	in, out := est.get()
	a.release, ok = s.admit.acquire(w, r, class, ceiling, in, out)
	return a, ok
}
