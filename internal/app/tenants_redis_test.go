package app

import (
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/redistest"
	"github.com/baton-llm/baton/internal/sim"
)

// Three replicas sharing one real Redis hold a tenant to its tokens per minute: over a sustained
// run the tokens admitted (the engines' usage of the answers) are the bucket's first minute's
// worth plus its refill, within 5 %. The bench scenario tenants reports the ratio itself.
func TestReplicasShareTokenLimitsThroughRedis(t *testing.T) {
	rs := redistest.Start(t)
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	const tpm = 30_000
	var urls []string
	for i := 0; i < 3; i++ {
		cfg := testConfig(e.URL())
		cfg.RateLimitStore = rs.URL()
		cfg.RateLimitStoreTimeout = 2 * time.Second // a slow call (the race detector) must not fall back to counting alone
		cfg.Tenants = []config.Tenant{{Name: "team", Keys: []string{config.HashKey("sk-team")}, Limits: &config.Limits{TokensPerMinute: intp(tpm)}}}
		_, gw := startGateway(t, cfg)
		urls = append(urls, gw.URL)
	}
	body := `{"model":"m","prompt":"a steady load","max_tokens":300,"ignore_eos":true}`
	var admitted, refused, okCount atomic.Int64
	start := time.Now()
	run := 4 * time.Second
	var last atomic.Int64 // when the last admitted request started, ns after start
	var wg sync.WaitGroup
	for c := 0; c < 6; c++ {
		wg.Go(func() {
			for time.Since(start) < run {
				began := time.Since(start)
				resp, b := tenantReq(t, urls[c%3]+"/v1/completions", "sk-team", body)
				switch resp.StatusCode {
				case 200:
					n, ok := clientUsage(t, b)
					if !ok {
						t.Errorf("no usage: %s", b)
						return
					}
					admitted.Add(int64(n))
					okCount.Add(1)
					if int64(began) > last.Load() {
						last.Store(int64(began))
					}
				case 429:
					refused.Add(1)
					time.Sleep(20 * time.Millisecond)
				default:
					t.Errorf("%d %s", resp.StatusCode, b)
					return
				}
			}
		})
	}
	wg.Wait()
	want := tpm * (1 + time.Duration(last.Load()).Minutes())
	ratio := float64(admitted.Load()) / want
	t.Logf("admitted %d tokens over %s (%d refusals): %.3f of the limit's", admitted.Load(), time.Duration(last.Load()), refused.Load(), ratio)
	if ratio < 0.95 || ratio > 1.05 || refused.Load() == 0 {
		t.Errorf("admitted %d tokens, %.3f of the %0.f the limit allows", admitted.Load(), ratio, want)
	}
	// One script call per reservation and one per settlement: Redis counted them.
	calls := scriptCalls(t, rs)
	want2 := refused.Load() + 2*okCount.Load()
	// The first calls of each script on a fresh Redis are EVALSHA, refused (NOSCRIPT), then EVAL:
	// at most once per client racing to be first, 6 clients and 2 scripts.
	if calls < want2 || calls > want2+24 {
		t.Errorf("Redis ran %d script calls for %d refusals and %d admitted requests (want %d)", calls, refused.Load(), okCount.Load(), want2)
	}
}

// scriptCalls is the EVALSHA and EVAL calls Redis has served.
func scriptCalls(t *testing.T, rs *redistest.Server) int64 {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: rs.Addr})
	defer c.Close()
	info, err := c.Info(t.Context(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, line := range strings.Split(info, "\n") {
		for _, cmd := range []string{"cmdstat_evalsha:calls=", "cmdstat_eval:calls="} {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), cmd); ok {
				n, _ := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
				total += n
			}
		}
	}
	return total
}

// Redis killed mid-run: a replica failing open serves (counting alone, and says so), one
// failing closed answers 503 rate_limit_store_unavailable; Redis back, both count in it again.
func TestRedisLostAndBack(t *testing.T) {
	rs := redistest.Start(t)
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	gateway := func(mode string) (*Gateway, string) {
		cfg := testConfig(e.URL())
		cfg.RateLimitStore, cfg.RateLimitStoreFailure = rs.URL(), mode
		cfg.Tenants = []config.Tenant{{Name: "team", Keys: []string{config.HashKey("sk-team")}, Limits: &config.Limits{RequestsPerMinute: intp(100)}}}
		g, gw := startGateway(t, cfg)
		return g, gw.URL
	}
	open, openURL := gateway("open")
	_, closedURL := gateway("closed")
	body := `{"model":"m","prompt":"x","max_tokens":1}`
	for _, u := range []string{openURL, closedURL} {
		if resp, b := tenantReq(t, u+"/v1/completions", "sk-team", body); resp.StatusCode != 200 {
			t.Fatalf("with Redis: %d %s", resp.StatusCode, b)
		}
	}
	rs.Stop()
	if resp, b := tenantReq(t, openURL+"/v1/completions", "sk-team", body); resp.StatusCode != 200 {
		t.Errorf("failing open without Redis: %d %s", resp.StatusCode, b)
	}
	if !strings.Contains(scrape(t, open), "baton_rate_limit_store_up 0") {
		t.Error("baton_rate_limit_store_up does not say the store is down")
	}
	if n := open.Server.Notices(); len(n) == 0 || !strings.Contains(n[0].Text, "cannot be reached") {
		t.Errorf("status page notices: %v", n)
	}
	resp, b := tenantReq(t, closedURL+"/v1/completions", "sk-team", body)
	if resp.StatusCode != 503 || !strings.Contains(b, "rate_limit_store_unavailable") || resp.Header.Get("Retry-After") == "" {
		t.Errorf("failing closed without Redis: %d %s", resp.StatusCode, b)
	}
	if err := rs.StartAgain(); err != nil {
		t.Fatal(err)
	}
	// Redis is asked again a second after it failed: both replicas count in it again.
	for i := 0; ; i++ {
		r1, _ := tenantReq(t, openURL+"/v1/completions", "sk-team", body)
		r2, _ := tenantReq(t, closedURL+"/v1/completions", "sk-team", body)
		if r1.StatusCode == 200 && r2.StatusCode == 200 && strings.Contains(scrape(t, open), "baton_rate_limit_store_up 1") {
			break
		}
		if i == 50 {
			t.Fatal("the replicas did not count in Redis again")
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The count is shared again: a request through one replica pushes the shared bucket's reset
	// further (by 600 ms, a request of 100 a minute) in the other's view.
	before := requestsReset(t, open)
	if resp, _ := tenantReq(t, closedURL+"/v1/completions", "sk-team", body); resp.StatusCode != 200 {
		t.Fatal("after Redis came back")
	}
	if after := requestsReset(t, open); after <= before {
		t.Errorf("a request through the other replica is not in this one's count: reset %s then %s", before, after)
	}
}

// requestsReset is how long until the tenant's request bucket is whole, as g's limiter sees it.
func requestsReset(t *testing.T, g *Gateway) time.Duration {
	t.Helper()
	r := g.tenants.set.Load().Tenants()[0].Rules()[0]
	d, err := g.tenants.limiter.Peek(t.Context(), r)
	if err != nil {
		t.Fatal(err)
	}
	return d.Requests.Reset
}
