package tenant

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// The limits are GCRA (a token bucket kept as one "theoretical arrival time" per limit): a rule
// of N per minute holds up to N at once and refills at N per minute, so that a tenant held at its
// limit is admitted N per minute exactly over any longer run. A reservation that asks more
// tokens than a whole minute's is admitted when the bucket is full and leaves it in debt.
// Requests at once are a count (in Redis a sorted set of reservations that expire, so that a
// replica that dies does not hold its slots for ever).

// period is what the limits are per.
const period = time.Minute

// Reasons a reservation is refused.
const (
	ReasonRequests    = "requests"
	ReasonTokens      = "tokens"
	ReasonConcurrency = "concurrency"
)

// Window is one limit's state, for OpenAI's rate-limit headers: its limit, what remains, and how
// long until it is whole again.
type Window struct {
	Limit, Remaining int
	Reset            time.Duration
}

// Decision is what a reservation found: admitted, or refused with why and when to retry; the
// rule's request and token windows after it (Limit 0: no such limit).
type Decision struct {
	OK                bool
	Reason            string
	RetryAfter        time.Duration
	Requests, Tokens  Window
	InFlight, MaxConc int
}

// ErrStoreUnavailable: the shared store cannot be reached and the limiter fails closed.
var ErrStoreUnavailable = errors.New("the rate limit store cannot be reached")

// state is the raw state of a rule's limits, as the stores keep it: the request and token
// buckets' theoretical arrival times (µs since the epoch) and the requests at once.
type state struct {
	reqTAT, tokTAT float64
	inflight       int
}

// store keeps rules' counts: this replica's memory, or Redis.
type store interface {
	// reserve admits one request costing tokens under r, or refuses it changing nothing; id
	// names the reservation (its slot among the requests at once, held at most hold).
	reserve(ctx context.Context, r *Rule, id string, tokens int, hold time.Duration) (reason string, retry time.Duration, s state, now float64, err error)
	// settle adds delta tokens (negative: gives back) and frees the reservation's slot.
	settle(ctx context.Context, r *Rule, id string, delta int) error
	// peek reads r's state without changing it.
	peek(ctx context.Context, r *Rule) (s state, now float64, err error)
	// cancel undoes a reservation of tokens under r whole: the request, the tokens and the slot
	// go back, as if it had never been made.
	cancel(ctx context.Context, r *Rule, id string, tokens int) error
}

// decide turns a store's answer into a Decision.
func decide(r *Rule, reason string, retry time.Duration, s state, now float64) Decision {
	d := Decision{OK: reason == "", Reason: reason, RetryAfter: retry, InFlight: s.inflight, MaxConc: r.Concurrent}
	d.Requests = window(r.RPM, s.reqTAT, now)
	d.Tokens = window(r.TPM, s.tokTAT, now)
	return d
}

func window(limit int, tat, now float64) Window {
	if limit <= 0 {
		return Window{}
	}
	ahead := math.Max(0, tat-now) // µs of the minute in use
	perUnit := float64(period.Microseconds()) / float64(limit)
	rem := int(math.Floor((float64(period.Microseconds()) - ahead) / perUnit))
	return Window{Limit: limit, Remaining: max(0, min(limit, rem)), Reset: time.Duration(ahead) * time.Microsecond}
}

// gcra is the admission rule both stores apply: with the bucket at tat (µs), may cost more
// units of a limit per minute be taken at now; over is by how much it is too early (µs).
func gcra(tat, now float64, limit, cost int) (next, over float64) {
	per := float64(period.Microseconds()) / float64(limit)
	tat = math.Max(tat, now)
	over = tat - now + float64(min(cost, limit))*per - float64(period.Microseconds())
	return tat + float64(cost)*per, over
}

// memStore counts in this replica.
type memStore struct {
	mu    sync.Mutex
	rules map[string]*state
}

func newMemStore() *memStore { return &memStore{rules: map[string]*state{}} }

func nowMicros() float64 { return float64(time.Now().UnixMicro()) }

func (m *memStore) get(id string) *state {
	s := m.rules[id]
	if s == nil {
		s = &state{}
		m.rules[id] = s
	}
	return s
}

func (m *memStore) reserve(_ context.Context, r *Rule, _ string, tokens int, _ time.Duration) (string, time.Duration, state, float64, error) {
	now := nowMicros()
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.get(r.ID)
	reason, over := "", 0.0
	var req, tok float64
	if r.Concurrent > 0 && s.inflight >= r.Concurrent {
		reason, over = ReasonConcurrency, float64(time.Second.Microseconds())
	}
	if r.RPM > 0 {
		var o float64
		if req, o = gcra(s.reqTAT, now, r.RPM, 1); reason == "" && o > 0 {
			reason, over = ReasonRequests, o
		}
	}
	if r.TPM > 0 {
		var o float64
		if tok, o = gcra(s.tokTAT, now, r.TPM, tokens); reason == "" && o > 0 {
			reason, over = ReasonTokens, o
		}
	}
	if reason == "" {
		if r.RPM > 0 {
			s.reqTAT = req
		}
		if r.TPM > 0 {
			s.tokTAT = tok
		}
		if r.Concurrent > 0 {
			s.inflight++
		}
	}
	return reason, time.Duration(over) * time.Microsecond, *s, now, nil
}

func (m *memStore) settle(_ context.Context, r *Rule, _ string, delta int) error {
	now := nowMicros()
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.get(r.ID)
	if r.TPM > 0 && delta != 0 {
		s.tokTAT = math.Max(math.Max(s.tokTAT, now)+float64(delta)*float64(period.Microseconds())/float64(r.TPM), now)
	}
	if r.Concurrent > 0 && s.inflight > 0 {
		s.inflight--
	}
	return nil
}

func (m *memStore) cancel(_ context.Context, r *Rule, _ string, tokens int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.get(r.ID)
	if r.RPM > 0 {
		s.reqTAT -= float64(period.Microseconds()) / float64(r.RPM)
	}
	if r.TPM > 0 {
		s.tokTAT -= float64(tokens) * float64(period.Microseconds()) / float64(r.TPM)
	}
	if r.Concurrent > 0 && s.inflight > 0 {
		s.inflight--
	}
	return nil
}

func (m *memStore) peek(_ context.Context, r *Rule) (state, float64, error) {
	now := nowMicros()
	m.mu.Lock()
	defer m.mu.Unlock()
	return *m.get(r.ID), now, nil
}

// Limiter reserves and settles tenants' use against their rules, in this replica's memory or in
// a shared Redis; when Redis cannot be reached it fails open (counting in memory meanwhile) or
// closed (ErrStoreUnavailable).
type Limiter struct {
	mem    *memStore
	shared store // nil: memory only
	// FailClosed refuses requests while the shared store cannot be reached.
	FailClosed bool
	// Timeout bounds one call to the shared store.
	Timeout time.Duration
	// Hold bounds how long a reservation keeps its slot among the requests at once in the
	// shared store (a replica that dies frees its slots after it).
	Hold time.Duration
	Log  *slog.Logger

	down     atomic.Int64 // unix ns until which the shared store is not asked again
	downNow  atomic.Bool  // the last call to the shared store failed
	lastWarn atomic.Int64
	seq      atomic.Uint64
	prefix   string
	charged  sync.Map // rule ID -> *atomic.Int64: tokens settled by this replica
}

// Charged is the tokens this replica has settled against rule ID since it started: what its
// tenants were charged, after the usage the engines reported.
func (l *Limiter) Charged(id string) int64 {
	if v, ok := l.charged.Load(id); ok {
		return v.(*atomic.Int64).Load()
	}
	return 0
}

// retryStoreAfter is how long a shared store that failed is left alone before it is asked again:
// a store that is down costs a request one timeout per interval, not one each.
const retryStoreAfter = time.Second

// NewLimiter returns a limiter counting in memory.
func NewLimiter(log *slog.Logger) *Limiter {
	return &Limiter{mem: newMemStore(), Timeout: 100 * time.Millisecond, Hold: 31 * time.Minute, Log: log,
		prefix: strconv.FormatInt(time.Now().UnixNano(), 36) + "-"}
}

// Shared reports whether the limiter counts in a shared store.
func (l *Limiter) Shared() bool { return l.shared != nil }

// StoreUp reports whether the shared store answered its last call (true without one).
func (l *Limiter) StoreUp() bool { return !l.downNow.Load() }

// A Lease is one admitted request's reservation, settled once with what it used.
type Lease struct {
	rule     *Rule
	id       string
	reserved int
	st       store
	settled  atomic.Bool
}

// Reserve admits a request costing tokens (an estimate, settled later) under r, or refuses it.
// A nil lease with a nil error is a refusal (the Decision says why).
func (l *Limiter) Reserve(ctx context.Context, r *Rule, tokens int) (*Lease, Decision, error) {
	var id string
	if l.shared != nil && r.Concurrent > 0 { // a slot among the requests at once, in Redis
		id = l.prefix + strconv.FormatUint(l.seq.Add(1), 36)
	}
	st := l.store()
	var (
		reason string
		retry  time.Duration
		s      state
		now    float64
		err    error
	)
	switch {
	case st == store(l.mem) && l.shared == nil:
		reason, retry, s, now, _ = l.mem.reserve(ctx, r, id, tokens, l.Hold)
	case st == store(l.mem):
		err = ErrStoreUnavailable // the shared store failed a moment ago: asked again later
	default:
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.Timeout)
		reason, retry, s, now, err = st.reserve(ctx, r, id, tokens, l.Hold)
		cancel()
		l.note(err)
	}
	if err != nil {
		if l.FailClosed {
			return nil, Decision{}, ErrStoreUnavailable
		}
		st = l.mem
		reason, retry, s, now, _ = l.mem.reserve(ctx, r, id, tokens, l.Hold)
	}
	d := decide(r, reason, retry, s, now)
	if !d.OK {
		return nil, d, nil
	}
	return &Lease{rule: r, id: id, reserved: tokens, st: st}, d, nil
}

// store is the store to ask now: the shared one unless it failed a moment ago (a failure is
// noted: the store is left alone for retryStoreAfter, and a warning is logged at most once a
// minute).
func (l *Limiter) store() store {
	if l.shared != nil && time.Now().UnixNano() >= l.down.Load() {
		return l.shared
	}
	return l.mem
}

// note records how a call to the shared store went.
func (l *Limiter) note(err error) {
	if err == nil {
		if l.downNow.Swap(false) {
			l.Log.Info("rate limit store: answering again; counts are shared again")
		}
		return
	}
	l.downNow.Store(true)
	l.down.Store(time.Now().Add(retryStoreAfter).UnixNano())
	now := time.Now().UnixNano()
	if last := l.lastWarn.Load(); now-last >= int64(time.Minute) && l.lastWarn.CompareAndSwap(last, now) {
		mode := "open: serving, counting in this replica meanwhile"
		if l.FailClosed {
			mode = "closed: refusing requests with 503 rate_limit_store_unavailable"
		}
		l.Log.Warn("rate limit store: cannot be reached; failing "+mode, "err", err)
	}
}

// Settle ends a lease with the tokens the request used: the difference from its reservation is
// given back or charged, and its slot freed. Settling twice does nothing.
func (l *Limiter) Settle(lease *Lease, used int) {
	if lease == nil || !lease.settled.CompareAndSwap(false, true) {
		return
	}
	c, ok := l.charged.Load(lease.rule.ID)
	if !ok {
		c, _ = l.charged.LoadOrStore(lease.rule.ID, new(atomic.Int64))
	}
	c.(*atomic.Int64).Add(int64(used))
	delta := used - lease.reserved
	if lease.st == store(l.mem) {
		_ = l.mem.settle(context.Background(), lease.rule, lease.id, delta)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.Timeout)
	defer cancel()
	err := lease.st.settle(ctx, lease.rule, lease.id, delta)
	l.note(err)
	// A settle that did not reach the store is lost there: its slot expires after Hold and its
	// tokens stay as reserved. It is not replayed in memory, where nothing was reserved.
}

// Cancel undoes an admitted lease whole, as if it had never been reserved: a request admitted
// under one of its rules and refused under another takes nothing from the first. Settling or
// cancelling again does nothing.
func (l *Limiter) Cancel(lease *Lease) {
	if lease == nil || !lease.settled.CompareAndSwap(false, true) {
		return
	}
	if lease.st == store(l.mem) {
		_ = l.mem.cancel(context.Background(), lease.rule, lease.id, lease.reserved)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.Timeout)
	defer cancel()
	l.note(lease.st.cancel(ctx, lease.rule, lease.id, lease.reserved))
}

// Peek reads a rule's windows without reserving anything (for GET /tenants).
func (l *Limiter) Peek(ctx context.Context, r *Rule) (Decision, error) {
	st := l.store()
	if st == store(l.mem) {
		s, now, _ := l.mem.peek(ctx, r)
		return decide(r, "", 0, s, now), nil
	}
	ctx, cancel := context.WithTimeout(ctx, l.Timeout)
	defer cancel()
	s, now, err := st.peek(ctx, r)
	l.note(err)
	if err != nil {
		s, now, _ = l.mem.peek(ctx, r)
	}
	return decide(r, "", 0, s, now), err
}
