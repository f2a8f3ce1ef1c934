package bench

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/admit"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/sim"
)

// fairness: scenario 12, sharing a saturated fleet — priority classes and token-fair queueing
// between tenants, against today's first-come-first-served (one tenant for everyone), same run.
func (r *runner) fairness(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 12. Fairness: priorities and token-fair queueing on a saturated fleet")
	fmt.Fprintln(r.out)
	dir, err := os.MkdirTemp("", "baton-bench-fairness")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	e, err := engine(sim.Config{Engine: sim.EngineVLLM, DecodePerToken: time.Millisecond})
	if err != nil {
		return err
	}
	defer e.Close()
	const slots = 4
	file := filepath.Join(dir, "fairness.yaml")
	y := fmt.Sprintf("worker_urls: [%s]\nadmission: {max_concurrent_requests: %d, queue_size: 10000, queue_timeout: 5m, queue_promote_after: 0s}\ntenants:\n", e.URL(), slots)
	for _, t := range []struct {
		name   string
		weight int
	}{{"a", 1}, {"b", 1}, {"c", 2}, {"shared", 1}} {
		y += fmt.Sprintf("  - {name: %s, keys: [%s], weight: %d, max_priority: critical}\n", t.name, config.HashKey("sk-"+t.name), t.weight)
	}
	if err := os.WriteFile(file, []byte(y), 0o600); err != nil {
		return err
	}
	b, err := startBaton(r.o.Binary, 1, "--config", file, "--access-log=false")
	if err != nil {
		return err
	}
	defer b.stop()
	fmt.Fprintf(r.out, "One simulated vLLM engine decoding 1 ms per token behind Baton with %d slots (max_concurrent_requests); completions of 16 tokens unless said; promotion off. \"FIFO\" is today's queue: every client is one tenant.\n\n", slots)

	// 1 and 4: the noisy neighbour, and work conservation.
	nb := r.n(400, 60)
	short := workload{promptBytes: 128, maxTokens: 16, stream: true}
	alone := r.run(ctx, "b alone", tenantReq(r.client, b.URL, short, "sk-b", ""), 2, nb, nil)
	flood := func(key string) (stop func() (tokens int64, took time.Duration)) {
		fctx, cancel := context.WithCancel(ctx)
		var tokens atomic.Int64
		var wg sync.WaitGroup
		start := time.Now()
		for c := 0; c < 24; c++ {
			wg.Go(func() {
				for i := 0; fctx.Err() == nil; i++ {
					if _, ok := usagePost(fctx, r.client, b.URL, workload{promptBytes: 128, maxTokens: 16}, key, "", i); ok {
						tokens.Add(16) // completion tokens, as b's are counted
					}
				}
			})
		}
		time.Sleep(300 * time.Millisecond) // the queue fills
		return func() (int64, time.Duration) { cancel(); wg.Wait(); return tokens.Load(), time.Since(start) }
	}
	stop := flood("sk-shared")
	fifo := r.run(ctx, "b in fifo", tenantReq(r.client, b.URL, short, "sk-shared", ""), 2, nb, nil)
	fifoTokens, fifoTook := stop()
	stop = flood("sk-a")
	fair := r.run(ctx, "b fair", tenantReq(r.client, b.URL, short, "sk-b", ""), 2, nb, nil)
	fairTokens, fairTook := stop()
	bound := alone.s.TTFT.P99 + alone.s.Latency.Mean
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/float64(time.Millisecond)) }
	fmt.Fprintf(r.out, "**1. Noisy neighbour.** Tenant a runs 24 closed-loop clients, tenant b 2 (%d streamed requests), equal weights. Goal: b's p99 TTFT beside a ≤ b's p99 alone + one mean request duration (%s ms), the bound for a scheduler that never preempts.\n\n", nb, ms(bound))
	fmt.Fprintln(r.out, "| b's requests | TTFT p50 ms | TTFT p99 ms | vs the bound |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|")
	fmt.Fprintf(r.out, "| alone | %s | %s | |\n", ms(alone.s.TTFT.P50), ms(alone.s.TTFT.P99))
	fmt.Fprintf(r.out, "| beside a, FIFO (one tenant) | %s | %s | %.2f× |\n", ms(fifo.s.TTFT.P50), ms(fifo.s.TTFT.P99), float64(fifo.s.TTFT.P99)/float64(bound))
	fmt.Fprintf(r.out, "| beside a, fair (two tenants) | %s | %s | %.2f× |\n\n", ms(fair.s.TTFT.P50), ms(fair.s.TTFT.P99), float64(fair.s.TTFT.P99)/float64(bound))
	fifoRate := float64(fifoTokens)/fifoTook.Seconds() + tokensPerSecond(fifo, short)
	fairRate := float64(fairTokens)/fairTook.Seconds() + tokensPerSecond(fair, short)
	fmt.Fprintf(r.out, "**4. Work conservation.** Completion tokens per second served (a's and b's) during the two runs above: FIFO %.0f, fair %.0f: **%.3f×** (goal ≥ 0.97×).\n\n", fifoRate, fairRate, fairRate/fifoRate)

	// 2. Token fairness between three backlogged tenants, weights 1:1:2.
	run := time.Duration(r.n(30, 6)) * time.Second
	window := time.Duration(r.n(10, 2)) * time.Second
	type served struct {
		at     time.Duration
		tokens int
	}
	var mu sync.Mutex
	got := map[string][]served{}
	shapes := map[string]workload{"a": {promptBytes: 2048, maxTokens: 8}, "b": {promptBytes: 128, maxTokens: 32}, "c": {promptBytes: 512, maxTokens: 16}}
	weights := map[string]float64{"a": 1, "b": 1, "c": 2}
	fctx, cancel := context.WithTimeout(ctx, run)
	start := time.Now()
	var wg sync.WaitGroup
	for name, w := range shapes {
		for c := 0; c < 8; c++ {
			wg.Go(func() {
				for i := 0; fctx.Err() == nil; i++ {
					if n, ok := usagePostWeighted(fctx, r.client, b.URL, w, "sk-"+name, i); ok {
						mu.Lock()
						got[name] = append(got[name], served{time.Since(start), n})
						mu.Unlock()
					}
				}
			})
		}
	}
	wg.Wait()
	cancel()
	warm := 2 * time.Second
	if run < 10*time.Second {
		warm = time.Second
	}
	var jains []float64
	maxDiff := 0.0
	for from := warm; from+window <= run; from += window {
		var xs []float64
		for name := range shapes {
			sum := 0
			for _, s := range got[name] {
				if s.at >= from && s.at < from+window {
					sum += s.tokens
				}
			}
			xs = append(xs, float64(sum)/weights[name])
		}
		jains = append(jains, jain(xs))
		sort.Float64s(xs)
		maxDiff = math.Max(maxDiff, xs[len(xs)-1]-xs[0])
	}
	minJain := 1.0
	for _, j := range jains {
		minJain = math.Min(minJain, j)
	}
	fmt.Fprintf(r.out, "**2. Token fairness.** Tenants a, b, c (weights 1:1:2) with 8 closed-loop clients each and different shapes (a: 2 KB prompts, 8 tokens; b: 128 B, 32 tokens; c: 512 B, 16 tokens) for %s; tokens served (prompt + completion ×2, the counters' weights) per tenant over %s windows after %s, divided by weight. Goal: Jain's index ≥ 0.95.\n\n", run, window, warm)
	fmt.Fprintf(r.out, "| windows | Jain's index, lowest | mean | largest weighted-service gap in a window |\n|---:|---:|---:|---:|\n| %d | %.3f | %.3f | %.0f tokens |\n\n", len(jains), minJain, mean(jains), maxDiff)

	// 3. Priority.
	nInt := r.n(300, 40)
	interactive := workload{promptBytes: 128, maxTokens: 16, stream: true}
	iAlone := r.run(ctx, "interactive alone", tenantReq(r.client, b.URL, interactive, "sk-b", "interactive"), 1, nInt, nil)
	bctx, bcancel := context.WithCancel(ctx)
	var bwg sync.WaitGroup
	for c := 0; c < 24; c++ {
		bwg.Go(func() {
			for i := 0; bctx.Err() == nil; i++ {
				usagePost(bctx, r.client, b.URL, workload{promptBytes: 128, maxTokens: 16}, "sk-a", "batch", i)
			}
		})
	}
	time.Sleep(300 * time.Millisecond)
	capacity := float64(slots) / (16 * time.Millisecond).Seconds()
	iUnder := r.runOpen(ctx, tenantReq(r.client, b.URL, interactive, "sk-b", "interactive"), capacity/10, nInt)
	bcancel()
	bwg.Wait()
	iBound := iAlone.s.TTFT.P99 + iAlone.s.Latency.Mean
	fmt.Fprintf(r.out, "**3. Priority.** Interactive requests at about 10 %% of capacity (%.0f a second, %d requests) while tenant a saturates the fleet with batch requests (24 clients). Goal: p99 TTFT ≤ alone + one mean request duration (%s ms).\n\n", capacity/10, nInt, ms(iBound))
	fmt.Fprintf(r.out, "| interactive | TTFT p50 ms | TTFT p99 ms | vs the bound |\n|---|---:|---:|---:|\n| alone | %s | %s | |\n| under batch saturation | %s | %s | %.2f× |\n\n",
		ms(iAlone.s.TTFT.P50), ms(iAlone.s.TTFT.P99), ms(iUnder.TTFT.P50), ms(iUnder.TTFT.P99), float64(iUnder.TTFT.P99)/float64(iBound))

	// 5. Cost of the decision.
	per, allocs := admit.MeasureDecision(1000, r.n(200000, 20000))
	fmt.Fprintf(r.out, "**5. Cost.** The admission decision with 1,000 tenants backlogged (in process): **%s** and %.2f allocations per enqueue+dispatch (goal ≤ 5 µs, none).\n\n", per, allocs)

	// 6. Waiting room.
	return r.waitingRoom(ctx)
}

// waitingRoom: a model whose only worker becomes ready after 3 s, with no_worker_wait 10 s.
func (r *runner) waitingRoom(ctx context.Context) error {
	port, err := freePort()
	if err != nil {
		return err
	}
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	// A configured worker that lists the model: Baton knows it before the engine answers.
	file := filepath.Join(os.TempDir(), fmt.Sprintf("baton-waiting-room-%d.yaml", port))
	if err := os.WriteFile(file, []byte(fmt.Sprintf("workers: [{url: %q, models: [%s], runtime: vllm}]\n", url, benchModel)), 0o600); err != nil {
		return err
	}
	defer os.Remove(file)
	b, err := startBatonServing(r.o.Binary, 1, "--config", file, "--no-worker-wait", "10s", "--detect-interval", "1s", "--access-log=false")
	if err != nil {
		return err
	}
	defer b.stop()
	n := r.n(50, 10)
	var ok atomic.Int64
	var wg sync.WaitGroup
	w := workload{promptBytes: 64, maxTokens: 4}
	for i := 0; i < n; i++ {
		wg.Go(func() {
			if _, good := usagePost(ctx, r.client, b.URL, w, "", "", i); good {
				ok.Add(1)
			}
		})
	}
	time.Sleep(3 * time.Second)
	e, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Model: benchModel, Host: "127.0.0.1", Port: port})
	if err != nil {
		return err
	}
	defer e.Close()
	wg.Wait()
	fmt.Fprintf(r.out, "**6. Waiting room.** %d requests for a model whose only worker becomes ready after 3 s, with `--no-worker-wait 10s`: **%d answered 200**, %d lost (goal: none lost).\n\n", n, ok.Load(), int64(n)-ok.Load())
	return nil
}

// tenantReq sends the workload's completions as the tenant of key, in a priority class.
func tenantReq(client *http.Client, base string, w workload, key, class string) Request {
	hdr := http.Header{}
	if key != "" {
		hdr.Set("Authorization", "Bearer "+key)
	}
	if class != "" {
		hdr.Set("X-Baton-Priority", class)
	}
	return func(ctx context.Context, i int) Result {
		prompt := w.prompt(i)
		status, body, res := post(ctx, client, base+"/v1/completions", w.body(prompt), hdr)
		return w.check(status, body, prompt, res)
	}
}

// usagePost sends one completion and returns its prompt + completion tokens.
func usagePost(ctx context.Context, client *http.Client, base string, w workload, key, class string, i int) (int, bool) {
	hdr := http.Header{}
	if key != "" {
		hdr.Set("Authorization", "Bearer "+key)
	}
	if class != "" {
		hdr.Set("X-Baton-Priority", class)
	}
	status, body, res := post(ctx, client, base+"/v1/completions", w.body(w.prompt(i)), hdr)
	if res.Err != nil || status != http.StatusOK {
		return 0, false
	}
	u, ok := openai.LastUsage(body)
	return u.Prompt + u.Completion, ok
}

// usagePostWeighted is usagePost counting as the scheduler does: prompt + 2 × completion.
func usagePostWeighted(ctx context.Context, client *http.Client, base string, w workload, key string, i int) (int, bool) {
	hdr := http.Header{"Authorization": {"Bearer " + key}}
	status, body, res := post(ctx, client, base+"/v1/completions", w.body(w.prompt(i)), hdr)
	if res.Err != nil || status != http.StatusOK {
		return 0, false
	}
	u, ok := openai.LastUsage(body)
	return u.Prompt + 2*u.Completion, ok
}

// runOpen runs req open-loop at rate.
func (r *runner) runOpen(ctx context.Context, req Request, rate float64, n int) Stats {
	return OpenLoop(ctx, req, rate, n)
}

func tokensPerSecond(m measured, w workload) float64 {
	return float64(m.s.N-m.s.Errors) * float64(w.maxTokens) / m.s.Elapsed.Seconds()
}

// jain is Jain's fairness index of xs: 1 when all are equal, 1/n at worst.
func jain(xs []float64) float64 {
	var sum, sq float64
	for _, x := range xs {
		sum += x
		sq += x * x
	}
	if sq == 0 {
		return 1
	}
	return sum * sum / (float64(len(xs)) * sq)
}

func mean(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}
