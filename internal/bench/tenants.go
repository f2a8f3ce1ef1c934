package bench

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/redistest"
	"github.com/baton-llm/baton/internal/sim"
)

// tenants: scenario 11, tenants' limits — how exactly a token limit holds (one replica in
// memory, three sharing a Redis), what limits cost in CPU, and whether a tenant far over its
// limit slows another.
func (r *runner) tenants(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 11. Tenants: limit accuracy, cost, isolation")
	fmt.Fprintln(r.out)
	dir, err := os.MkdirTemp("", "baton-bench-tenants")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	e, err := engine(sim.Config{Engine: sim.EngineVLLM})
	if err != nil {
		return err
	}
	defer e.Close()

	// 1. Accuracy.
	run := time.Duration(r.n(20, 4)) * time.Second
	const tpm = 60_000
	fmt.Fprintf(r.out, "**Limit accuracy.** Tenant a, tokens_per_minute %d, 8 closed-loop clients for %s (completions of 300 tokens; a 429 waits 20 ms). Admitted: the engines' usage of the answers. Allowed: a full bucket (one minute's tokens) plus its refill over the run. Goal 0.95–1.05.\n\n", tpm, run)
	fmt.Fprintln(r.out, "| store | replicas | admitted tokens | allowed | admitted / allowed | 429s |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|")
	yaml := func(limits string) (string, error) {
		p := filepath.Join(dir, fmt.Sprintf("tenants-%d.yaml", time.Now().UnixNano()))
		y := fmt.Sprintf("worker_urls: [%s]\ntenants:\n  - name: a\n    keys: [%s]\n    limits: {%s}\n  - name: b\n    keys: [%s]\n",
			e.URL(), config.HashKey("sk-bench-a"), limits, config.HashKey("sk-bench-b"))
		return p, os.WriteFile(p, []byte(y), 0o600)
	}
	file, err := yaml("tokens_per_minute: " + strconv.Itoa(tpm))
	if err != nil {
		return err
	}
	rows := []struct {
		store    string
		replicas int
	}{{"memory", 1}}
	redis, err := redistest.New(dir)
	redisURL := "" // no Redis rows without one
	switch {
	case errors.Is(err, redistest.ErrNotInstalled):
		fmt.Fprintln(r.out, "_(no redis-server on this machine: the Redis row is left out; Debian's redis-server package provides it)_")
		fmt.Fprintln(r.out)
	case err != nil:
		return err
	default:
		defer redis.Stop()
		redisURL = redis.URL()
		rows = append(rows, struct {
			store    string
			replicas int
		}{"redis", 3})
	}
	for _, row := range rows {
		bs, err := r.tenantReplicas(file, row.store, redisURL, row.replicas)
		for _, b := range bs {
			defer b.stop()
		}
		if err != nil {
			return err
		}
		admitted, refused, last := r.hammer(ctx, bs, "sk-bench-a", run)
		allowed := tpm * (1 + last.Minutes())
		fmt.Fprintf(r.out, "| %s | %d | %d | %.0f | %.3f | %d |\n", row.store, row.replicas, admitted, allowed, float64(admitted)/allowed, refused)
		for _, b := range bs {
			b.stop()
		}
	}
	fmt.Fprintln(r.out)

	// 2. Cost.
	n := r.n(20000, 600)
	w := workload{promptBytes: 512, maxTokens: 16}
	fmt.Fprintf(r.out, "**Cost.** %d non-streamed completions per row, 64 clients, one engine: Baton's CPU per request with tenants and limits (a tenant with requests and tokens per minute far above the load, so that every request is reserved and settled) against none, in the same run. Redis: one script call per reservation and one per settlement.\n\n", n)
	fmt.Fprintln(r.out, "| tenants | store | req/s | CPU µs / request | vs no tenants |")
	fmt.Fprintln(r.out, "|---|---|---:|---:|---:|")
	big, err := yaml("requests_per_minute: 100000000, tokens_per_minute: 1000000000")
	if err != nil {
		return err
	}
	var base float64
	costRows := []struct{ name, store, key string }{{"off", "–", ""}, {"on", "memory", "sk-bench-a"}}
	if redisURL != "" {
		costRows = append(costRows, struct{ name, store, key string }{"on", "redis", "sk-bench-a"})
	}
	for _, row := range costRows {
		args := []string{"--worker-urls", e.URL(), "--access-log=false"}
		if row.key != "" {
			args = []string{"--config", big, "--access-log=false"}
			if row.store == "redis" {
				args = append(args, "--rate-limit-store", redisURL)
			}
		}
		b, err := startBaton(r.o.Binary, 1, args...)
		if err != nil {
			return err
		}
		m := r.run(ctx, "tenants cost "+row.store, keyed(completion(r.client, b.URL, w), r.client, b.URL, w, row.key), 64, n, b)
		b.stop()
		per := m.cpu / float64(m.s.N) * 1e6
		if base == 0 {
			base = per
		}
		fmt.Fprintf(r.out, "| %s | %s | %.0f | %s | %s |\n", row.name, row.store, m.s.Throughput(), r.cpuCell(m, "%.1f", per), ratioF(per, base))
	}
	fmt.Fprintln(r.out)
	r.cpuNote()

	// 3. Isolation.
	slow, err := engine(sim.Config{Engine: sim.EngineVLLM, DecodePerToken: time.Millisecond})
	if err != nil {
		return err
	}
	defer slow.Close()
	iso := filepath.Join(dir, "isolation.yaml")
	if err := os.WriteFile(iso, []byte(fmt.Sprintf("worker_urls: [%s]\ntenants:\n  - name: a\n    keys: [%s]\n    limits: {requests_per_minute: 60}\n  - name: b\n    keys: [%s]\n",
		slow.URL(), config.HashKey("sk-bench-a"), config.HashKey("sk-bench-b"))), 0o600); err != nil {
		return err
	}
	b, err := startBaton(r.o.Binary, 1, "--config", iso, "--access-log=false")
	if err != nil {
		return err
	}
	defer b.stop()
	nb := r.n(2000, 100)
	wb := workload{promptBytes: 256, maxTokens: 16, stream: true}
	alone := r.run(ctx, "tenant b alone", keyed(nil, r.client, b.URL, wb, "sk-bench-b"), 2, nb, nil)
	hammerCtx, stopHammer := context.WithCancel(ctx)
	var sent, refused atomic.Int64
	var wg sync.WaitGroup
	for c := 0; c < 16; c++ {
		wg.Go(func() {
			req := keyed(nil, r.client, b.URL, workload{promptBytes: 256, maxTokens: 16}, "sk-bench-a")
			for i := 0; hammerCtx.Err() == nil; i++ {
				sent.Add(1)
				if res := req(hammerCtx, i); res.Err != nil {
					refused.Add(1)
				}
				time.Sleep(280 * time.Millisecond) // about 50 requests a second over 16 clients: 50× a's 1 a second
			}
		})
	}
	for deadline := time.Now().Add(15 * time.Second); refused.Load() == 0 && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond) // a's bucket is spent: from now on it is held to its limit
	}
	sent.Store(0)
	refused.Store(0)
	start := time.Now()
	under := r.run(ctx, "tenant b beside a", keyed(nil, r.client, b.URL, wb, "sk-bench-b"), 2, nb, nil)
	stopHammer()
	wg.Wait()
	rate := float64(sent.Load()) / time.Since(start).Seconds()
	fmt.Fprintf(r.out, "**Isolation.** Tenant a (requests_per_minute 60: a bucket of 60, then 1 a second) sends %.0f requests a second (%.0f× its limit; %d of %d refused); tenant b, 2 closed-loop clients, %d streamed completions of 16 tokens on an engine decoding 1 ms per token. b's TTFT beside a against b alone, same run.\n\n",
		rate, rate/1, refused.Load(), sent.Load(), nb)
	fmt.Fprintln(r.out, "| tenant b | TTFT p50 ms | TTFT p99 ms | p99 vs alone |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|")
	msf := func(d time.Duration) string { return fmt.Sprintf("%.2f", ms(d)) }
	fmt.Fprintf(r.out, "| alone | %s | %s | 1.00× |\n", msf(alone.s.TTFT.P50), msf(alone.s.TTFT.P99))
	fmt.Fprintf(r.out, "| beside a, far over its limit | %s | %s | %.2f× |\n\n", msf(under.s.TTFT.P50), msf(under.s.TTFT.P99), float64(under.s.TTFT.P99)/float64(alone.s.TTFT.P99))
	b.stop()

	// 4. The hostile tenant.
	return r.hostileTenant(ctx, dir, redisURL)
}

// keyed sends the workload's completions with a tenant's key (none: the plain request, or req).
func keyed(req Request, client *http.Client, base string, w workload, key string) Request {
	if key == "" && req != nil {
		return req
	}
	hdr := http.Header{"Authorization": {"Bearer " + key}}
	return func(ctx context.Context, i int) Result {
		prompt := w.prompt(i)
		status, body, res := post(ctx, client, base+"/v1/completions", w.body(prompt), hdr)
		return w.check(status, body, prompt, res)
	}
}

// hammer runs 8 clients of tenant key over the replicas bs for d, and returns the tokens
// admitted (the answers' usage), the 429s, and when the last admitted request was sent.
func (r *runner) hammer(ctx context.Context, bs []*proc, key string, d time.Duration) (admitted, refused int64, last time.Duration) {
	w := workload{promptBytes: 64, maxTokens: 300}
	hdr := http.Header{"Authorization": {"Bearer " + key}}
	var adm, ref, lastNs atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for c := 0; c < 8; c++ {
		wg.Go(func() {
			for i := c; time.Since(start) < d && ctx.Err() == nil; i += 8 {
				sent := time.Since(start)
				status, body, res := post(ctx, r.client, bs[i%len(bs)].URL+"/v1/completions", w.body(w.prompt(i)), hdr)
				switch {
				case res.Err != nil:
					return
				case status == http.StatusOK:
					if u, ok := openai.LastUsage(body); ok {
						adm.Add(int64(u.Prompt + u.Completion))
						for {
							cur := lastNs.Load()
							if int64(sent) <= cur || lastNs.CompareAndSwap(cur, int64(sent)) {
								break
							}
						}
					}
				case status == http.StatusTooManyRequests:
					ref.Add(1)
					time.Sleep(20 * time.Millisecond)
				}
			}
		})
	}
	wg.Wait()
	return adm.Load(), ref.Load(), time.Duration(lastNs.Load())
}

// tenantReplicas starts n Batons over the configuration file, counting tenants' limits in memory or
// (store redis) in the Redis at redisURL. Those started are returned even on an error, to stop.
func (r *runner) tenantReplicas(file, store, redisURL string, n int) ([]*proc, error) {
	var bs []*proc
	for range n {
		args := []string{"--config", file, "--access-log=false"}
		if store == "redis" {
			args = append(args, "--rate-limit-store", redisURL)
		}
		b, err := startBaton(r.o.Binary, 1, args...)
		if err != nil {
			return bs, err
		}
		bs = append(bs, b)
	}
	return bs, nil
}

// freePort is a TCP port free on 127.0.0.1 now.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}
