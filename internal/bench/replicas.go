package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/baton-llm/baton/internal/sim"
)

// replicas: scenario 9, Baton scaled out. Four engines with prefix caches that publish KV
// events, the routing workload's prompts sent round robin across 1 or 3 Baton replicas that
// share nothing; cache_aware from the engines' events against its approximate index, a fresh
// fleet (cold caches) per row.
func (r *runner) replicas(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 9. Replicas: cache_aware across gateway replicas from the engines' KV events")
	fmt.Fprintln(r.out)
	n, concurrency := r.n(1200, 96), 12
	w := workload{maxTokens: 8, stream: true}
	prompts := routingPrompts(n)
	fmt.Fprintf(r.out, "%d streamed completions of the routing workload (scenario 8), %d clients back to back, each request sent to the next replica in turn, over 4 simulated vLLM engines (prefix cache of %d blocks, prefill 50 µs per uncached token, decode 1 ms per token) publishing KV events. Replicas share nothing; with events, each subscribes to every engine. Hit share: prompt tokens the engines found cached over prompt tokens.\n\n",
		n, concurrency, routingCacheBlocks)
	fmt.Fprintln(r.out, "| replicas | cache_aware source | hit share | vs 1 replica (events) | TTFT p50 ms | TTFT mean ms | req/s |")
	fmt.Fprintln(r.out, "|---:|---|---:|---:|---:|---:|---:|")
	var base float64
	for _, row := range []struct {
		replicas int
		source   string
	}{{1, "events"}, {3, "events"}, {1, "approx"}, {3, "approx"}} {
		share, m, err := r.replicaRun(ctx, row.replicas, row.source, prompts, w, concurrency)
		if err != nil {
			return err
		}
		if base == 0 {
			base = share
		}
		ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/float64(time.Millisecond)) }
		fmt.Fprintf(r.out, "| %d | %s | %.2f | %.2f× | %s | %s | %.0f |\n", row.replicas, row.source, share, share/base, ms(m.s.TTFT.P50), ms(m.s.TTFT.Mean), m.s.Throughput())
	}
	fmt.Fprintln(r.out)
	return nil
}

func (r *runner) replicaRun(ctx context.Context, replicas int, source string, prompts []string, w workload, concurrency int) (float64, measured, error) {
	var es []*sim.Engine
	defer func() {
		for _, e := range es {
			e.Close()
		}
	}()
	var yaml strings.Builder
	yaml.WriteString("policy: cache_aware\ncache_aware_source: " + source + "\nworkers:\n")
	for i := 0; i < 4; i++ {
		e, err := engine(sim.Config{Engine: sim.EngineVLLM, PrefixCache: true, PrefixCacheBlocks: routingCacheBlocks, KVEvents: true,
			PrefillPerToken: 50 * time.Microsecond, DecodePerToken: time.Millisecond, MaxConcurrency: 8})
		if err != nil {
			return 0, measured{}, err
		}
		es = append(es, e)
		fmt.Fprintf(&yaml, "  - url: %s\n    kv_events_endpoint: %s\n", e.URL(), e.KVEventsEndpoint())
	}
	dir, err := os.MkdirTemp("", "baton-bench-replicas")
	if err != nil {
		return 0, measured{}, err
	}
	defer os.RemoveAll(dir)
	file := filepath.Join(dir, "baton.yaml")
	if err := os.WriteFile(file, []byte(yaml.String()), 0o600); err != nil {
		return 0, measured{}, err
	}
	var bs []*proc
	defer func() {
		for _, b := range bs {
			b.stop()
		}
	}()
	for i := 0; i < replicas; i++ {
		b, err := startBaton(r.o.Binary, 1, "--config", file)
		if err != nil {
			return 0, measured{}, err
		}
		bs = append(bs, b)
	}
	// Every replica's subscriptions up before the load: warm the engines directly until each
	// replica reports all four healthy (ZMQ drops what is published before a subscriber joins).
	deadline := time.Now().Add(30 * time.Second)
	for i := 0; ; i++ {
		for _, e := range es {
			post(ctx, r.client, e.URL()+"/v1/completions", w.body(fmt.Sprintf("warm-up %d %s", i, strings.Repeat("w ", 40))), nil)
		}
		healthy := true
		for _, b := range bs {
			healthy = healthy && strings.Count(workers(b.URL), `"healthy":true`) == len(es)
		}
		if healthy {
			break
		}
		if time.Now().After(deadline) {
			return 0, measured{}, fmt.Errorf("replicas never subscribed to every engine")
		}
		time.Sleep(50 * time.Millisecond)
	}
	var h0, q0 int64
	for _, e := range es {
		h0, q0 = h0+e.Stats().PrefixCacheHits, q0+e.Stats().PrefixCacheQueries
	}
	req := func(ctx context.Context, i int) Result {
		status, body, res := post(ctx, r.client, bs[i%len(bs)].URL+"/v1/completions", w.body(prompts[i]), nil)
		return w.check(status, body, prompts[i], res)
	}
	m := r.run(ctx, fmt.Sprintf("replicas %d %s", replicas, source), req, concurrency, len(prompts), nil)
	var h, q int64
	for _, e := range es {
		h, q = h+e.Stats().PrefixCacheHits, q+e.Stats().PrefixCacheQueries
	}
	return float64(h-h0) / float64(max(q-q0, 1)), m, nil
}

// workers returns GET /workers of the Baton at url ("" when it does not answer).
func workers(url string) string {
	resp, err := http.Get(url + "/workers")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}
