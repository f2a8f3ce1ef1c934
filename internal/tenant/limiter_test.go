package tenant

import (
	"context"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/redistest"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// limiters are a memory limiter and one over a real redis-server: every behaviour is tested on
// both, the same way.
func limiters(t *testing.T) map[string]*Limiter {
	t.Helper()
	rs := redistest.Start(t)
	shared := NewLimiter(quiet())
	shared.Timeout = 5 * time.Second // these tests are about the counts, not the deadline (the race detector is slow)
	o, err := RedisOptions(rs.URL(), os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	shared.UseRedis(o)
	t.Cleanup(func() { shared.Close() })
	return map[string]*Limiter{"memory": NewLimiter(quiet()), "redis": shared}
}

// Requests per minute: a minute's worth at once, then refused with the wait until the next
// one, and nothing changed by a refusal; the headers' windows count down.
func TestRequestsPerMinute(t *testing.T) {
	for name, l := range limiters(t) {
		t.Run(name, func(t *testing.T) {
			r := &Rule{ID: "rpm-" + name, RPM: 3}
			for i := 0; i < 3; i++ {
				lease, d, err := l.Reserve(t.Context(), r, 0)
				if err != nil || lease == nil || !d.OK || d.Requests.Limit != 3 || d.Requests.Remaining != 2-i {
					t.Fatalf("request %d: %+v %v", i, d, err)
				}
				l.Settle(lease, 0)
			}
			lease, d, err := l.Reserve(t.Context(), r, 0)
			if err != nil || lease != nil || d.OK || d.Reason != ReasonRequests || d.RetryAfter <= 0 || d.RetryAfter > 20*time.Second || d.Requests.Remaining != 0 {
				t.Fatalf("the fourth: %+v %v", d, err)
			}
			// The refusal took nothing: the wait did not grow.
			_, d2, _ := l.Reserve(t.Context(), r, 0)
			if d2.RetryAfter > d.RetryAfter {
				t.Errorf("a refusal was charged: retry %s then %s", d.RetryAfter, d2.RetryAfter)
			}
		})
	}
}

// A cancelled lease gives back everything it took — its request, its tokens and its slot — so
// that a request admitted under one rule and refused under another costs the first nothing.
func TestCancelGivesEverythingBack(t *testing.T) {
	for name, l := range limiters(t) {
		t.Run(name, func(t *testing.T) {
			r := &Rule{ID: "cancel-" + name, RPM: 2, TPM: 1000, Concurrent: 1}
			for i := 0; i < 10; i++ {
				lease, d, err := l.Reserve(t.Context(), r, 600)
				if err != nil || lease == nil {
					t.Fatalf("reservation %d after %d cancelled: %+v %v", i+1, i, d, err)
				}
				l.Cancel(lease)
				l.Cancel(lease) // a second cancel does nothing
			}
			d, err := l.Peek(t.Context(), r)
			if err != nil || d.Requests.Remaining != 2 || d.Tokens.Remaining != 1000 || d.InFlight != 0 {
				t.Errorf("after ten cancelled reservations: %+v %v", d, err)
			}
		})
	}
}

// Tokens: reserve, then settle with what was used — the unused part comes back, an overrun is
// charged — and a request larger than a whole minute is admitted once the bucket is full.
func TestTokensReserveThenSettle(t *testing.T) {
	for name, l := range limiters(t) {
		t.Run(name, func(t *testing.T) {
			r := &Rule{ID: "tpm-" + name, TPM: 1000}
			lease, d, _ := l.Reserve(t.Context(), r, 800)
			if lease == nil || d.Tokens.Remaining != 200 {
				t.Fatalf("reserve 800: %+v", d)
			}
			if _, d, _ := l.Reserve(t.Context(), r, 300); d.OK || d.Reason != ReasonTokens {
				t.Fatalf("300 more while 800 are reserved: %+v", d)
			}
			l.Settle(lease, 100) // used 100 of 800: 700 back
			lease, d, _ = l.Reserve(t.Context(), r, 300)
			if lease == nil || d.Tokens.Remaining < 595 || d.Tokens.Remaining > 600 {
				t.Fatalf("after giving 700 back: %+v", d)
			}
			l.Settle(lease, 900) // an overrun: 600 more charged
			if _, d, _ := l.Reserve(t.Context(), r, 1); d.OK {
				t.Fatalf("admitted after an overrun past the limit: %+v", d)
			}
			fresh := &Rule{ID: "tpm-big-" + name, TPM: 1000}
			lease, d, _ = l.Reserve(t.Context(), fresh, 5000)
			if lease == nil {
				t.Fatalf("a request above a minute's tokens refused on a full bucket: %+v", d)
			}
			if _, d, _ := l.Reserve(t.Context(), fresh, 1); d.OK || d.RetryAfter < 3*time.Minute {
				t.Errorf("after a 5-minute request: %+v", d)
			}
			l.Settle(lease, 5000)
			l.Settle(lease, 0) // twice: nothing
		})
	}
}

// Requests at once: the slot is taken at reserve, freed at settle.
func TestConcurrency(t *testing.T) {
	for name, l := range limiters(t) {
		t.Run(name, func(t *testing.T) {
			r := &Rule{ID: "conc-" + name, Concurrent: 2}
			a, _, _ := l.Reserve(t.Context(), r, 0)
			b, _, _ := l.Reserve(t.Context(), r, 0)
			if a == nil || b == nil {
				t.Fatal("two slots of two refused")
			}
			if c, d, _ := l.Reserve(t.Context(), r, 0); c != nil || d.Reason != ReasonConcurrency {
				t.Fatalf("a third: %+v", d)
			}
			l.Settle(a, 0)
			c, d, _ := l.Reserve(t.Context(), r, 0)
			if c == nil || d.InFlight != 2 {
				t.Fatalf("after one ended: %+v", d)
			}
			l.Settle(b, 0)
			l.Settle(c, 0)
			if d, _ := l.Peek(t.Context(), r); d.InFlight != 0 {
				t.Errorf("in flight after all ended: %d", d.InFlight)
			}
		})
	}
}

// Concurrent reservations from many goroutines admit exactly the limit (the Redis script is
// atomic; the memory store locks).
func TestNoOverAdmissionUnderRace(t *testing.T) {
	for name, l := range limiters(t) {
		t.Run(name, func(t *testing.T) {
			r := &Rule{ID: "race-" + name, RPM: 50}
			var mu sync.Mutex
			admitted := 0
			var wg sync.WaitGroup
			for i := 0; i < 200; i++ {
				wg.Go(func() {
					if lease, _, err := l.Reserve(context.Background(), r, 0); lease != nil && err == nil {
						mu.Lock()
						admitted++
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			if admitted != 50 {
				t.Errorf("admitted %d of a limit of 50", admitted)
			}
		})
	}
}

// Redis goes away: failing open serves and counts in memory, failing closed refuses; neither
// waits longer than the store deadline; Redis back, counting is shared again.
func TestStoreFailure(t *testing.T) {
	rs := redistest.Start(t)
	o, _ := RedisOptions(rs.URL(), os.Getenv)
	var logs strings.Builder
	var mu sync.Mutex
	open := NewLimiter(slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return logs.Write(p) }), nil)))
	open.UseRedis(o)
	defer open.Close()
	o2, _ := RedisOptions(rs.URL(), os.Getenv)
	closed := NewLimiter(quiet())
	closed.FailClosed = true
	closed.UseRedis(o2)
	defer closed.Close()
	r := &Rule{ID: "failure", RPM: 1000}
	if lease, _, err := open.Reserve(t.Context(), r, 0); lease == nil || err != nil || !open.StoreUp() {
		t.Fatalf("with Redis up: %v", err)
	}
	rs.Stop()
	start := time.Now()
	lease, _, err := open.Reserve(t.Context(), r, 0)
	if lease == nil || err != nil || open.StoreUp() {
		t.Fatalf("fail open with Redis down: %v, store up %v", err, open.StoreUp())
	}
	if _, _, err := closed.Reserve(t.Context(), r, 0); err != ErrStoreUnavailable {
		t.Fatalf("fail closed with Redis down: %v", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("two calls to a dead store took %s", took)
	}
	mu.Lock()
	if !strings.Contains(logs.String(), "rate limit store: cannot be reached; failing open") {
		t.Errorf("no warning: %s", logs.String())
	}
	mu.Unlock()
	if err := rs.StartAgain(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(retryStoreAfter + 100*time.Millisecond)
	if lease, _, err := closed.Reserve(t.Context(), r, 0); lease == nil || err != nil {
		t.Fatalf("fail closed with Redis back: %v", err)
	}
	if d, err := open.Peek(t.Context(), r); err != nil || d.Requests.Remaining != 999 {
		t.Errorf("the shared count after Redis came back (empty, one request since): %+v %v", d, err)
	}
	if !open.StoreUp() {
		t.Error("the store still shown down")
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// Rules: the most specific wins; models restrict; the open set makes everyone default.
func TestSetRulesAndKeys(t *testing.T) {
	n := func(v int) *int { return &v }
	cfg := config.Default()
	cfg.Tenants = []config.Tenant{{Name: "a", Keys: []string{config.HashKey("key-a")}, Models: []string{"llama-*", "qwen"},
		Limits:      &config.Limits{TokensPerMinute: n(1000)},
		ModelLimits: []config.Limits{{Model: "llama-*", RequestsPerMinute: n(5)}, {Model: "llama-70b", RequestsPerMinute: n(1)}}}}
	cfg.TenantAPIKeys = []string{"b:key-b"}
	s, err := Build(cfg, os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	a := s.Identify("key-a")
	if a == nil || a.Name != "a" || s.Identify("key-b").Name != "b" || s.Identify("nope") != nil || s.Identify("") != nil || s.Open() {
		t.Fatalf("identify: %v", a)
	}
	// The most specific model rule, and the tenant's own beside it: both hold.
	for model, want := range map[string]string{"llama-70b": "a/llama-70b a", "llama-8b": "a/llama-* a", "qwen": "a"} {
		var ids []string
		for _, r := range a.RulesFor(model) {
			if r != nil {
				ids = append(ids, r.ID)
			}
		}
		if got := strings.Join(ids, " "); got != want {
			t.Errorf("rules for %s: %s, want %s", model, got, want)
		}
	}
	if !a.Allows("llama-x") || !a.Allows("qwen") || a.Allows("qwen2") || !s.Identify("key-b").Allows("anything") {
		t.Error("models")
	}
	open, _ := Build(config.Default(), os.Getenv)
	if t0 := open.Identify(""); t0 == nil || t0.Name != "default" || !open.Open() {
		t.Errorf("no keys: %v", t0)
	}
}

// What a limited request costs in this replica: one reservation and its settlement.
func BenchmarkReserveSettle(b *testing.B) {
	l := NewLimiter(quiet())
	r := &Rule{ID: "bench", RPM: 1 << 30, TPM: 1 << 30, Concurrent: 1 << 20}
	b.ReportAllocs()
	for b.Loop() {
		lease, _, _ := l.Reserve(b.Context(), r, 100)
		l.Settle(lease, 90)
	}
}
