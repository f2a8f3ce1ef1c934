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
// distributed, on four engines of loraSlots adapter slots each that take loraLoadTime to load one.
const (
	loraAdapters = 32
	loraSlots    = 4
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

// lora: the adapter loads and TTFT of round robin, cache_aware without adapter affinity, and
// with it, each on a fresh fleet with no adapter loaded, Baton loading adapters on demand and
// unloading the least recently used.
func (r *runner) lora(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 13. LoRA adapters: affinity and loading on demand")
	fmt.Fprintln(r.out)
	n, concurrency := r.n(800, 80), 16
	w := workload{promptBytes: 256, maxTokens: 8, stream: true}
	seq := loraSequence(n)
	fmt.Fprintf(r.out, "%d streamed completions, %d clients back to back, over 4 simulated vLLM engines with `--max-loras %d` and a load time of %s, no adapter loaded at start; %d adapters over one base model, declared in `adapters:` with `unload_lru: true`, their popularity Zipf-distributed (s = 1.1). Decode 1 ms per token, 8 requests running at once per engine.\n\n",
		n, concurrency, loraSlots, loraLoadTime, loraAdapters)
	fmt.Fprintln(r.out, "| routing | adapter loads | loads vs round_robin | TTFT p50 ms | TTFT p99 ms | TTFT mean ms | mean TTFT vs round_robin | req/s |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|---:|---:|")
	dir, err := os.MkdirTemp("", "baton-bench-lora")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	var baseLoads int64
	var baseTTFT time.Duration
	for _, c := range []struct{ name, policy, affinity string }{
		{"round_robin", "round_robin", "false"},
		{"cache_aware, no adapter affinity", "cache_aware", "false"},
		{"cache_aware + adapter affinity", "cache_aware", "true"},
	} {
		var es []*sim.Engine
		var urls []string
		for i := 0; i < 4; i++ {
			e, err := engine(sim.Config{Engine: sim.EngineVLLM, RuntimeLoRA: true, MaxLoRAs: loraSlots, LoRALoadTime: loraLoadTime,
				DecodePerToken: time.Millisecond, MaxConcurrency: 8})
			if err != nil {
				return err
			}
			defer e.Close()
			es = append(es, e)
			q, _ := json.Marshal(e.URL())
			urls = append(urls, string(q))
		}
		var y strings.Builder
		fmt.Fprintf(&y, "worker_urls: [%s]\npolicy: %s\nadapter_affinity: %s\nunload_lru: true\nadapters:\n", strings.Join(urls, ", "), c.policy, c.affinity)
		for a := 0; a < loraAdapters; a++ {
			fmt.Fprintf(&y, "  - {name: adapter-%d, path: /adapters/%d, base: %s}\n", a, a, benchModel)
		}
		file := filepath.Join(dir, "lora.yaml")
		if err := os.WriteFile(file, []byte(y.String()), 0o600); err != nil {
			return err
		}
		b, err := startBaton(r.o.Binary, 1, "--config", file, "--access-log=false")
		if err != nil {
			return err
		}
		req := func(ctx context.Context, i int) Result {
			prompt := w.prompt(i)
			body := strings.Replace(string(w.body(prompt)), fmt.Sprintf("%q", benchModel), fmt.Sprintf(`"adapter-%d"`, seq[i]), 1)
			status, out, res := post(ctx, r.client, b.URL+"/v1/completions", []byte(body), nil)
			return w.check(status, out, prompt, res)
		}
		m := r.run(ctx, "lora "+c.name, req, concurrency, n, b)
		b.stop()
		var loads int64
		for _, e := range es {
			l, _ := e.LoRAStats()
			loads += l
			e.Close()
		}
		if baseLoads == 0 {
			baseLoads, baseTTFT = max(loads, 1), m.s.TTFT.Mean
		}
		ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/float64(time.Millisecond)) }
		fmt.Fprintf(r.out, "| %s | %d | %.2f× | %s | %s | %s | %.2f× | %.0f |\n", c.name, loads, float64(loads)/float64(baseLoads),
			ms(m.s.TTFT.P50), ms(m.s.TTFT.P99), ms(m.s.TTFT.Mean), float64(m.s.TTFT.Mean)/float64(baseTTFT), m.s.Throughput())
	}
	fmt.Fprintln(r.out)
	return nil
}
