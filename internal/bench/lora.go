package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/baton-llm/baton/internal/sim"
)

// The LoRA workload: loraAdapters adapters over one base model, their popularity Zipf
// distributed, on four engines that take loraLoadTime to load one: vLLM with `--max-loras
// loraSlots` (the adapters one batch runs; it holds any number loaded), SGLang with
// `--max-loaded-loras loraLoaded` (the adapters it holds: Baton unloads the least recently used
// to load another).
const (
	loraAdapters = 100
	loraSlots    = 4
	loraLoaded   = 8
	loraLoadTime = 200 * time.Millisecond
)

// loraSequence is the adapter of each of n requests, deterministic for a given n.
func loraSequence(n int) []int {
	z := rand.NewZipf(rand.New(rand.NewPCG(28, 28)), 1.1, 1, loraAdapters-1)
	out := make([]int, n)
	for i := range out {
		out[i] = int(z.Uint64())
	}
	return out
}

// lora: the adapter loads and TTFT of round robin, cache_aware without adapter affinity, with
// it, and with it on two Baton replicas sharing the engines (clients alternate between them),
// each on a fresh fleet with no adapter loaded, Baton loading adapters on demand and unloading
// the least recently used where the engine bounds what it holds — on vLLM and on SGLang.
func (r *runner) lora(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 13. LoRA adapters: affinity and loading on demand")
	fmt.Fprintln(r.out)
	n, concurrency := r.n(800, 80), 16
	w := workload{promptBytes: 256, maxTokens: 8, stream: true}
	seq := loraSequence(n)
	fmt.Fprintf(r.out, "%d streamed completions, %d clients back to back, over 4 simulated engines with a load time of %s, no adapter loaded at start; %d adapters over one base model, declared in `adapters:` with `unload_lru: true`, their popularity Zipf-distributed (s = 1.1). vLLM with `--max-loras %d` (adapters per batch; it holds any number), SGLang with `--max-loaded-loras %d` (adapters held: Baton unloads one to load another). Decode 1 ms per token, 8 requests running at once per engine. Two replicas: two Baton processes over the same engines, clients alternating.\n\n",
		n, concurrency, loraLoadTime, loraAdapters, loraSlots, loraLoaded)
	fmt.Fprintln(r.out, "| engine | routing | adapter loads | unloads | loads vs round_robin | TTFT p50 ms | TTFT p99 ms | p99 vs round_robin | TTFT mean ms | mean TTFT vs round_robin | req/s | failed |")
	fmt.Fprintln(r.out, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	dir, err := os.MkdirTemp("", "baton-bench-lora")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	for _, engineKind := range []string{sim.EngineVLLM, sim.EngineSGLang} {
		var baseLoads int64
		var baseTTFT, baseP99 time.Duration
		for _, c := range []struct {
			name, policy, affinity string
			replicas               int
		}{
			{"round_robin", "round_robin", "false", 1},
			{"cache_aware, no adapter affinity", "cache_aware", "false", 1},
			{"cache_aware + adapter affinity", "cache_aware", "true", 1},
			{"cache_aware + adapter affinity, two replicas", "cache_aware", "true", 2},
		} {
			row, err := r.loraRow(ctx, dir, engineKind, c.policy, c.affinity, c.replicas, n, concurrency, w, seq)
			if err != nil {
				return err
			}
			if baseLoads == 0 {
				baseLoads, baseTTFT, baseP99 = max(row.loads, 1), row.m.s.TTFT.Mean, row.m.s.TTFT.P99
			}
			ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/float64(time.Millisecond)) }
			fmt.Fprintf(r.out, "| %s | %s | %d | %d | %.2f× | %s | %s | %.2f× | %s | %.2f× | %.0f | %d |\n", engineKind, c.name, row.loads, row.unloads,
				float64(row.loads)/float64(baseLoads), ms(row.m.s.TTFT.P50), ms(row.m.s.TTFT.P99), float64(row.m.s.TTFT.P99)/float64(max(baseP99, 1)),
				ms(row.m.s.TTFT.Mean), float64(row.m.s.TTFT.Mean)/float64(max(baseTTFT, 1)), row.m.s.Throughput(), row.m.s.Errors)
		}
	}
	fmt.Fprintln(r.out)
	return nil
}

type loraResult struct {
	m              measured
	loads, unloads int64
}

// loraRow runs the LoRA workload once on a fresh fleet of engineKind behind replicas Baton
// processes of the given routing.
func (r *runner) loraRow(ctx context.Context, dir, engineKind, policy, affinity string, replicas, n, concurrency int, w workload, seq []int) (loraResult, error) {
	var es []*sim.Engine
	var urls []string
	defer func() {
		for _, e := range es {
			e.Close()
		}
	}()
	for i := 0; i < 4; i++ {
		bound := loraSlots
		if engineKind == sim.EngineSGLang {
			bound = loraLoaded
		}
		e, err := engine(sim.Config{Engine: engineKind, RuntimeLoRA: true, MaxLoRAs: bound, LoRALoadTime: loraLoadTime,
			DecodePerToken: time.Millisecond, MaxConcurrency: 8})
		if err != nil {
			return loraResult{}, err
		}
		es = append(es, e)
		q, _ := json.Marshal(e.URL())
		urls = append(urls, string(q))
	}
	var y strings.Builder
	fmt.Fprintf(&y, "worker_urls: [%s]\npolicy: %s\nadapter_affinity: %s\nunload_lru: true\nadapters:\n", strings.Join(urls, ", "), policy, affinity)
	for a := 0; a < loraAdapters; a++ {
		fmt.Fprintf(&y, "  - {name: adapter-%d, path: /adapters/%d, base: %s}\n", a, a, benchModel)
	}
	file := filepath.Join(dir, "lora.yaml")
	if err := os.WriteFile(file, []byte(y.String()), 0o600); err != nil {
		return loraResult{}, err
	}
	var bs []*proc
	defer func() {
		for _, b := range bs {
			b.stop()
		}
	}()
	for i := 0; i < replicas; i++ {
		b, err := startBaton(r.o.Binary, 1, "--config", file, "--access-log=false")
		if err != nil {
			return loraResult{}, err
		}
		bs = append(bs, b)
	}
	req := func(ctx context.Context, i int) Result {
		prompt := w.prompt(i)
		body := strings.Replace(string(w.body(prompt)), fmt.Sprintf("%q", benchModel), fmt.Sprintf(`"adapter-%d"`, seq[i]), 1)
		status, out, res := post(ctx, r.client, bs[i%len(bs)].URL+"/v1/completions", []byte(body), nil)
		return w.check(status, out, prompt, res)
	}
	m := r.run(ctx, fmt.Sprintf("lora %s %s affinity=%s replicas=%d", engineKind, policy, affinity, replicas), req, concurrency, n, bs[0])
	var out loraResult
	out.m = m
	for _, e := range es {
		l, u := e.LoRAStats()
		out.loads += l
		out.unloads += u
	}
	return out, nil
}
