package bench

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/sim"
)

// hostileTPM is the hostile tenant's limit.
const hostileTPM = 3000

// hostileTenant is section 11's hostile tenant: at 3,000 tokens per minute it hangs up every
// request after 200 ms — streams during their answer, non-streamed requests while the engine
// generates — and asks max_tokens 100,000 or names no cap at all. Reported: the tokens the
// engine computed for it (the simulator's own counters, less the well-behaved tenant's usage) in
// every 60-second window against its limit, and the well-behaved tenant's p99 TTFT beside it
// against running alone; in memory and over three replicas sharing Redis.
func (r *runner) hostileTenant(ctx context.Context, dir, redisURL string) error {
	d := time.Duration(r.n(180, 15)) * time.Second
	fmt.Fprintf(r.out, "**The hostile tenant.** Tenant h, tokens_per_minute %d, 8 clients for %s, each request hung up after 200 ms (if not answered sooner): in turn a stream naming no cap, a non-streamed chat naming no cap (Baton writes the default, 1024), and a stream asking max_tokens 100,000; prompts of 200 tokens. Tenant g, unlimited, 2 closed-loop clients of streamed 16-token completions on the same engine (2 ms per token). Computed: the engine's prompt and generated tokens (its own counters, cut requests included) less g's usage. A bucket starts full, so the first minute may take its burst (one minute's tokens) plus a minute's refill: that window is held to 2× the limit, every later one to 1×. Goal ≤ 1.05 in every window; g's p99 TTFT ≤ 1.2× alone.\n\n", hostileTPM, d)
	fmt.Fprintln(r.out, "| store | replicas | h's requests (reached the engine / refused) | computed, first 60 s / (2 × limit) | worst later 60-s window / limit | computed over the run / allowed | h charged by Baton | g p99 TTFT alone ms | beside h ms | ratio |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	rows := []struct {
		store    string
		replicas int
	}{{"memory", 1}}
	if redisURL != "" {
		rows = append(rows, struct {
			store    string
			replicas int
		}{"redis", 3})
	}
	for _, row := range rows {
		if err := r.hostileRow(ctx, dir, redisURL, row.store, row.replicas, d); err != nil {
			return err
		}
	}
	fmt.Fprintln(r.out)
	return nil
}

func (r *runner) hostileRow(ctx context.Context, dir, redisURL, store string, replicas int, d time.Duration) error {
	e, err := engine(sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 2 * time.Millisecond, PrefillPerToken: 20 * time.Microsecond})
	if err != nil {
		return err
	}
	defer e.Close()
	file := filepath.Join(dir, fmt.Sprintf("hostile-%s.yaml", store))
	y := fmt.Sprintf("worker_urls: [%s]\ntenants:\n  - name: h\n    keys: [%s]\n    limits: {tokens_per_minute: %d}\n  - name: g\n    keys: [%s]\n",
		e.URL(), config.HashKey("sk-bench-h"), hostileTPM, config.HashKey("sk-bench-g"))
	if err := os.WriteFile(file, []byte(y), 0o600); err != nil {
		return err
	}
	bs, err := r.tenantReplicas(file, store, redisURL, replicas)
	for _, b := range bs {
		defer b.stop()
	}
	if err != nil {
		return err
	}
	var good atomic.Int64 // g's tokens, by its answers' usage
	alone := r.goodTenant(ctx, bs, time.Duration(r.n(20, 4))*time.Second, &good)

	computed := func() int64 {
		s := e.Stats()
		return s.PromptTokensRecompute + s.PromptTokensLocalCache + s.TokensGenerated - good.Load()
	}
	hctx, stop := context.WithTimeout(ctx, d)
	defer stop()
	var reached, refused atomic.Int64
	var wg sync.WaitGroup
	for c := range 8 {
		wg.Go(func() { r.hostileClient(hctx, bs, c, &reached, &refused) })
	}
	var besideTTFT []time.Duration
	wg.Go(func() { besideTTFT = r.goodTenant(hctx, bs, d, &good) })
	start := computed()
	samples := []int64{0}
	tick := time.NewTicker(time.Second)
	for hctx.Err() == nil {
		select {
		case <-hctx.Done():
		case <-tick.C:
			samples = append(samples, computed()-start)
		}
	}
	tick.Stop()
	wg.Wait()
	time.Sleep(500 * time.Millisecond) // the last cut requests settle
	samples = append(samples, computed()-start)

	var chargedTokens float64
	for _, b := range bs {
		chargedTokens += b.metric(`baton_tenant_tokens_total{kind="prompt",model="` + benchModel + `",tenant="h"}`)
		chargedTokens += b.metric(`baton_tenant_tokens_total{kind="completion",model="` + benchModel + `",tenant="h"}`)
	}
	first, later := windows(samples, 60)
	total := samples[len(samples)-1]
	allowed := float64(hostileTPM) * (1 + d.Minutes())
	laterCell := "— (run under 2 min)"
	if later >= 0 {
		laterCell = fmt.Sprintf("%.3f", float64(later)/hostileTPM)
	}
	firstCell := fmt.Sprintf("%.3f", float64(first)/(2*hostileTPM))
	if len(samples) <= 61 {
		firstCell += " (run under 60 s)"
	}
	pa, pb := p99(alone), p99(besideTTFT)
	fmt.Fprintf(r.out, "| %s | %d | %d / %d | %s | %s | %.3f | %.0f | %.1f | %.1f | %.2f× |\n", store, replicas, reached.Load(), refused.Load(),
		firstCell, laterCell, float64(total)/allowed, chargedTokens, ms(pa), ms(pb), float64(pb)/float64(max(pa, 1)))
	return nil
}

// windows returns the tokens computed in the first window of w seconds, and the most in any
// later one (starting at w seconds or after; -1 when the run is shorter than 2w), from
// cumulative samples one second apart.
func windows(samples []int64, w int) (first, later int64) {
	first = samples[min(w, len(samples)-1)]
	later = -1
	for a := w; a+w < len(samples); a++ {
		later = max(later, samples[a+w]-samples[a])
	}
	return first, later
}

// hostileClient sends tenant h's requests until ctx ends, each hung up after 200 ms.
func (r *runner) hostileClient(ctx context.Context, bs []*proc, c int, reached, refused *atomic.Int64) {
	prompt := strings.TrimSpace(strings.Repeat("abc ", 200)) // 200 tokens to the simulator, about 200 estimated
	bodies := []string{
		`{"model":"` + benchModel + `","prompt":"` + prompt + `","stream":true}`,
		`{"model":"` + benchModel + `","messages":[{"role":"user","content":"` + prompt + `"}]}`,
		`{"model":"` + benchModel + `","prompt":"` + prompt + `","max_tokens":100000,"stream":true}`,
	}
	paths := []string{"/v1/completions", "/v1/chat/completions", "/v1/completions"}
	hdr := http.Header{"Authorization": {"Bearer sk-bench-h"}}
	for i := c; ctx.Err() == nil; i += 8 {
		k := i % len(bodies)
		rctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		status, _, res := post(rctx, r.client, bs[i%len(bs)].URL+paths[k], []byte(bodies[k]), hdr)
		cancel()
		switch {
		case status == http.StatusTooManyRequests:
			refused.Add(1)
			sleepCtx(ctx, 20*time.Millisecond)
		case status != 0 || res.Err != nil:
			reached.Add(1)
		}
	}
}

// goodTenant runs tenant g's two closed-loop clients for d, adding its answers' usage to good,
// and returns their TTFTs.
func (r *runner) goodTenant(ctx context.Context, bs []*proc, d time.Duration, good *atomic.Int64) []time.Duration {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	hdr := http.Header{"Authorization": {"Bearer sk-bench-g"}}
	var mu sync.Mutex
	var ttfts []time.Duration
	var wg sync.WaitGroup
	for c := range 2 {
		wg.Go(func() {
			for i := c; ctx.Err() == nil; i += 2 {
				body := fmt.Sprintf(`{"model":%q,"prompt":"good %d abc abc abc abc abc abc","max_tokens":16,"stream":true,"stream_options":{"include_usage":true}}`, benchModel, i)
				status, out, res := post(context.WithoutCancel(ctx), r.client, bs[i%len(bs)].URL+"/v1/completions", []byte(body), hdr)
				if status != http.StatusOK || res.Err != nil {
					continue
				}
				if u, ok := openai.LastUsage(out); ok {
					good.Add(int64(u.Prompt + u.Completion))
				}
				mu.Lock()
				ttfts = append(ttfts, res.TTFT)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return ttfts
}

func p99(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*99/100)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
