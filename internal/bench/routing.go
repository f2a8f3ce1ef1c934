package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/baton-llm/baton/internal/sim"
)

// The routing workload: the shapes that make cache locality pay. Groups of requests share a long
// system prompt, conversations grow turn by turn (each turn's prompt is the last one plus a
// reply and a new question), and one hot group carries a large share of all traffic. The
// engines' prefix caches together could hold most of it, each alone only a fraction.
const (
	routingGroups        = 24
	routingConversations = 8
	routingSystemBytes   = 4000 // ~1,000 tokens, ~63 blocks of 16
	routingCacheBlocks   = 512  // per engine: about 8 system prompts
)

// routingPrompts returns the workload's n prompts, deterministic for a given n.
func routingPrompts(n int) []string {
	rng := rand.New(rand.NewPCG(13, 13))
	filler := func(seed string, size int) string {
		var sb strings.Builder
		words := []string{" relay", " baton", " prefill", " decode", " handoff", " engine", " stream", " token", " cache", " route"}
		sb.WriteString(seed)
		for j := 0; sb.Len() < size; j++ {
			sb.WriteString(words[(j*7+len(seed))%len(words)])
		}
		return sb.String()
	}
	system := func(g int) string {
		return filler(fmt.Sprintf("You are assistant %d of the relay team.", g), routingSystemBytes)
	}
	turns := make([]int, routingConversations)
	out := make([]string, n)
	for i := range out {
		switch x := rng.Float64(); {
		case x < 0.2: // the hot group
			out[i] = fmt.Sprintf("%s\nQuestion %d: what is next?", system(-1), i)
		case x < 0.8:
			out[i] = fmt.Sprintf("%s\nQuestion %d: what is next?", system(rng.IntN(routingGroups)), i)
		default:
			c := rng.IntN(routingConversations)
			var sb strings.Builder
			sb.WriteString(filler(fmt.Sprintf("Conversation %d.", c), 1200))
			for t := 0; t <= turns[c]; t++ {
				sb.WriteString(filler(fmt.Sprintf("\nUser turn %d:", t), 160))
				sb.WriteString(filler(fmt.Sprintf("\nAssistant turn %d:", t), 320))
			}
			turns[c]++
			fmt.Fprintf(&sb, "\nUser (request %d): and then?", i)
			out[i] = sb.String()
		}
	}
	return out
}

// routing: scenario 8, each policy over four simulated engines with prefix caches, a fresh fleet
// (cold caches) per policy, the same requests in the same order.
func (r *runner) routing(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 8. Routing: cache- and load-aware policies")
	fmt.Fprintln(r.out)
	n, concurrency := r.n(1600, 64), 16
	w := workload{maxTokens: 8, stream: true}
	prompts := routingPrompts(n)
	fmt.Fprintf(r.out, "%d streamed completions, %d clients back to back, over 4 simulated vLLM engines, each with a prefix cache of %d blocks of 16 tokens (LRU), prefill 50 µs per uncached token, decode 1 ms per token, 8 requests running at once. Workload: 20%% one hot group, 60%% %d groups sharing a ~1,000-token system prompt, 20%% %d conversations that grow each turn. Hit share: prompt tokens the engines found cached over prompt tokens. Busiest: requests on the busiest engine over the mean.\n\n",
		n, concurrency, routingCacheBlocks, routingGroups, routingConversations)
	fmt.Fprintln(r.out, "| policy | hit share | TTFT p50 ms | TTFT p99 ms | TTFT mean ms | mean TTFT vs round_robin | req/s | busiest / mean |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|---:|---:|")
	var base time.Duration
	for _, policy := range []string{"round_robin", "power_of_two", "least_load", "prefix_hash", "cache_aware"} {
		es, urls, err := routingFleet()
		if err != nil {
			return err
		}
		defer closeAll(es)
		b, err := startBaton(r.o.Binary, 1, append([]string{"--policy", policy, "--worker-urls"}, urls...)...)
		if err != nil {
			return err
		}
		req := func(ctx context.Context, i int) Result {
			status, body, res := post(ctx, r.client, b.URL+"/v1/completions", w.body(prompts[i]), nil)
			return w.check(status, body, prompts[i], res)
		}
		m := r.run(ctx, "routing "+policy, req, concurrency, n, b)
		b.stop()
		var hits, queries, most, total int64
		for _, e := range es {
			s := e.Stats()
			hits, queries = hits+s.PrefixCacheHits, queries+s.PrefixCacheQueries
			most, total = max(most, s.RequestsReceived), total+s.RequestsReceived
			e.Close()
		}
		if base == 0 {
			base = m.s.TTFT.Mean
		}
		ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/float64(time.Millisecond)) }
		fmt.Fprintf(r.out, "| %s | %.2f | %s | %s | %s | %.2f× | %.0f | %.2f |\n", policy, float64(hits)/float64(max(queries, 1)),
			ms(m.s.TTFT.P50), ms(m.s.TTFT.P99), ms(m.s.TTFT.Mean), float64(m.s.TTFT.Mean)/float64(base), m.s.Throughput(), float64(most)*4/float64(max(total, 1)))
	}
	fmt.Fprintln(r.out)
	return nil
}

// routingFleet starts the routing workload's four engines, with small prefix caches and a
// latency model; the caller closes them.
func routingFleet() ([]*sim.Engine, []string, error) {
	var es []*sim.Engine
	var urls []string
	for i := 0; i < 4; i++ {
		e, err := engine(sim.Config{Engine: sim.EngineVLLM, PrefixCache: true, PrefixCacheBlocks: routingCacheBlocks,
			PrefillPerToken: 50 * time.Microsecond, DecodePerToken: time.Millisecond, MaxConcurrency: 8})
		if err != nil {
			closeAll(es)
			return nil, nil, err
		}
		es, urls = append(es, e), append(urls, e.URL())
	}
	return es, urls, nil
}

// closeAll closes engines (closing one twice is harmless).
func closeAll(es []*sim.Engine) {
	for _, e := range es {
		e.Close()
	}
}
