package bench

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/sim"
)

// Options configures a benchmark run.
type Options struct {
	Binary   string // the baton binary to measure; it runs as its own process
	Baseline string // an earlier baton binary the hotpath scenario measures in the same run; "" none
	// PDSidecar is llm-d's pd-sidecar binary, which the hotpath scenario measures beside Baton's
	// PD path on the same engines; "" none.
	PDSidecar string
	Quick     bool          // small runs: checks the harness works, not for publishing
	Streams   int           // open streams in the memory scenario; 0: 1,500 (50 with Quick)
	Duration  time.Duration // how long the soak scenario runs; 0: 30 minutes (3 with Quick)
	// BatonFlags are more flags for the Batons the soak scenario starts.
	BatonFlags []string
	// Plot is a PNG file the soak scenario draws its fault timeline into, and pd-sizing its
	// goodput per split; "" none.
	Plot string
	// Mixes are the pd-sizing and pd-advice workloads to run (chat, rag); empty: both.
	Mixes     []string
	Scenarios []string // names to run; empty runs all
	Out       io.Writer
}

// Scenario names: all run by default; optIn only when named.
var (
	allScenarios = []string{"latency", "throughput", "streaming", "memory", "bodysize", "workers", "hardening", "routing", "replicas", "hotpath", "tenants", "fairness", "lora", "epp"}
	optIn        = []string{"soak", "pd-sizing", "pd-advice"}
)

// runner holds what the scenarios share.
type runner struct {
	o      Options
	out    io.Writer
	client *http.Client
	lowCPU bool     // a CPU figure of the table being written is below the measuring resolution
	failed []string // correctness failures: any fails the run
}

// Run runs the scenarios and writes a markdown report. It fails when any answer was wrong.
func Run(ctx context.Context, o Options) error {
	r := &runner{o: o, out: o.Out, client: &http.Client{Transport: &http.Transport{
		MaxIdleConnsPerHost: 2048, MaxConnsPerHost: 0, DisableCompression: true, IdleConnTimeout: time.Minute,
	}}}
	defer r.client.CloseIdleConnections()
	if err := CheckScenarios(o.Scenarios); err != nil {
		return err
	}
	r.header()
	for _, name := range append(allScenarios, optIn...) {
		if len(o.Scenarios) > 0 && !contains(o.Scenarios, name) || len(o.Scenarios) == 0 && contains(optIn, name) {
			continue
		}
		start := time.Now()
		var err error
		switch name {
		case "latency":
			err = r.latency(ctx)
		case "throughput":
			err = r.throughput(ctx)
		case "streaming":
			err = r.streaming(ctx)
		case "memory":
			err = r.memory(ctx)
		case "bodysize":
			err = r.bodySize(ctx)
		case "workers":
			err = r.workers(ctx)
		case "hardening":
			err = r.hardening(ctx)
		case "routing":
			err = r.routing(ctx)
		case "replicas":
			err = r.replicas(ctx)
		case "hotpath":
			err = r.hotpath(ctx)
		case "tenants":
			err = r.tenants(ctx)
		case "fairness":
			err = r.fairness(ctx)
		case "lora":
			err = r.lora(ctx)
		case "epp":
			err = r.epp(ctx)
		case "soak":
			err = r.soak(ctx)
		case "pd-sizing":
			err = r.pdSizing(ctx)
		case "pd-advice":
			err = r.pdAdvice(ctx)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		fmt.Fprintf(r.out, "_(%s took %s)_\n\n", name, time.Since(start).Round(100*time.Millisecond))
	}
	if len(r.failed) > 0 {
		return fmt.Errorf("%d runs had wrong or failed answers: %s", len(r.failed), strings.Join(r.failed, "; "))
	}
	return nil
}

// CheckScenarios reports the names that are not scenarios, with the list of those that are.
func CheckScenarios(names []string) error {
	var bad []string
	for _, n := range names {
		if !contains(allScenarios, n) && !contains(optIn, n) {
			bad = append(bad, fmt.Sprintf("%q", n))
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("unknown scenario %s (want some of %s)", strings.Join(bad, ", "), strings.Join(append(allScenarios, optIn...), ","))
	}
	return nil
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

func (r *runner) n(full, quick int) int {
	if r.o.Quick {
		return quick
	}
	return full
}

func (r *runner) header() {
	model := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "model name"); ok {
				model = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
				break
			}
		}
	}
	pin := "not pinned (one core, or no taskset)"
	if len(pinned(1, "x")) > 1 {
		pin = "Baton (and nginx) pinned to CPU 1; the load generator and simulators on CPU 0"
	}
	fmt.Fprintf(r.out, "Machine: %d CPUs (%s), %s, %s/%s. %s.\n\n", numCPU(), model, runtime.Version(), runtime.GOOS, runtime.GOARCH, pin)
}

// engine starts a simulated engine for the benchmark model.
func engine(c sim.Config) (*sim.Engine, error) {
	c.Model = benchModel
	if c.MaxConcurrency == 0 {
		c.MaxConcurrency = 4096
	}
	if c.QueueSize == 0 {
		c.QueueSize = 4096
	}
	return sim.Start(c)
}

// measured is one row: a target's stats and the CPU its proxy process used.
type measured struct {
	name string
	s    Stats
	cpu  float64 // seconds of the proxy process during the run; 0 for a baseline
	// harness is the seconds of CPU of the bench process itself (load generator, simulators)
	// during the run, where the hotpath scenario measures it.
	harness float64
	// rounds are the hotpath scenario's rounds, one by one: each share's requests, time and CPU.
	rounds []measured
}

// minCPUTicks is the least CPU, in ticks of /proc's clock (10 ms), a figure is measured over
// to be within ±5 %.
const minCPUTicks = 20

// cpuCell formats value, a CPU figure derived from m's CPU; one measured over fewer than
// minCPUTicks ticks (a --quick run, mostly) is marked † and explained under the table (cpuNote).
func (r *runner) cpuCell(m measured, format string, value float64) string {
	s := fmt.Sprintf(format, value)
	if m.cpu*clockTicks < minCPUTicks {
		r.lowCPU = true
		s += " †"
	}
	return s
}

// cpuNote ends a table with CPU figures: the note a figure marked by cpuCell refers to.
func (r *runner) cpuNote() {
	if r.lowCPU {
		fmt.Fprintf(r.out, "† below the measuring resolution: the run used fewer than %d ticks of /proc's 10 ms CPU clock, so the figure is off by 5 %% or more (0 is under one tick); run without --quick for figures to compare.\n\n", minCPUTicks)
		r.lowCPU = false
	}
}

// run runs req closed-loop and records the CPU of p (nil for a baseline).
func (r *runner) run(ctx context.Context, name string, req Request, concurrency, n int, p *proc) measured {
	var before float64
	if p != nil {
		before = p.cpuSeconds()
	}
	s := ClosedLoop(ctx, req, concurrency, n)
	m := measured{name: name, s: s}
	if p != nil {
		m.cpu = p.cpuSeconds() - before
	}
	r.verify(name, s)
	return m
}

func (r *runner) verify(name string, s Stats) {
	if s.Errors > 0 {
		r.failed = append(r.failed, fmt.Sprintf("%s: %d of %d failed (first: %v)", name, s.Errors, s.N, s.FirstError))
	}
}

func us(d time.Duration) string { return fmt.Sprintf("%.0f", float64(d)/float64(time.Microsecond)) }

func ratio(a, b time.Duration) string {
	if b == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f×", float64(a)/float64(b))
}

// latencyTable writes p50/p90/p99 of each row and the added p50 against base.
func (r *runner) latencyTable(rows []measured, base measured) {
	fmt.Fprintln(r.out, "| target | p50 µs | p90 µs | p99 µs | added p50 µs | p50 vs baseline |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|")
	for _, m := range rows {
		added := "–"
		if m.name != base.name {
			added = us(m.s.Latency.P50 - base.s.Latency.P50)
		}
		fmt.Fprintf(r.out, "| %s | %s | %s | %s | %s | %s |\n", m.name, us(m.s.Latency.P50), us(m.s.Latency.P90), us(m.s.Latency.P99), added, ratio(m.s.Latency.P50, base.s.Latency.P50))
	}
	fmt.Fprintln(r.out)
}

// latency: scenario 1, the latency Baton adds per request.
func (r *runner) latency(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 1. Added latency per request")
	fmt.Fprintln(r.out)
	n := r.n(2000, 60)
	fmt.Fprintf(r.out, "One client, back to back, %d requests per row; completions with a 512-byte prompt and 16 output tokens; simulators with no latency model, so the numbers are the pure cost of each hop. Baseline: the simulated engine directly (PD: the two legs sent by the client itself).\n\n", n)
	for _, stream := range []bool{false, true} {
		w := workload{promptBytes: 512, maxTokens: 16, stream: stream}
		fmt.Fprintf(r.out, "### stream=%v\n\n", stream)
		// Regular.
		e, err := engine(sim.Config{Engine: sim.EngineVLLM})
		if err != nil {
			return err
		}
		rows, b, err := r.threeWay(ctx, e, w, 1, n)
		if err != nil {
			return err
		}
		b.stop()
		e.Close()
		for i := range rows {
			rows[i].name = "regular: " + rows[i].name
		}
		r.latencyTable(rows, rows[0])
		// PD SGLang and PD vLLM NIXL.
		for _, kind := range []string{"sglang", "nixl"} {
			var p, d *sim.Engine
			var args []string
			if kind == "sglang" {
				p, err = engine(sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill})
				if err == nil {
					d, err = engine(sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode})
				}
				if err == nil {
					args = []string{"--pd-disaggregation", "--prefill", p.URL(), fmt.Sprint(p.BootstrapPort()), "--decode", d.URL()}
				}
			} else {
				p, err = engine(sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
				if err == nil {
					d, err = engine(sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
				}
				if err == nil {
					args = []string{"--pd-disaggregation", "--kv-connector", "NixlConnector", "--prefill", p.URL(), "--decode", d.URL()}
				}
			}
			if err != nil {
				return err
			}
			legs := map[string]func(*http.Client, *sim.Engine, *sim.Engine, workload) Request{"sglang": sglangLegs, "nixl": nixlLegs}[kind]
			label := map[string]string{"sglang": "PD SGLang", "nixl": "PD vLLM NIXL"}[kind]
			rows := []measured{r.run(ctx, label+": legs sent by the client", legs(r.client, p, d, w), 1, n, nil)}
			b, err := startBaton(r.o.Binary, 1, args...)
			if err != nil {
				return err
			}
			rows = append(rows, r.run(ctx, label+": Baton", completion(r.client, b.URL, w), 1, n, b))
			b.stop()
			p.Close()
			d.Close()
			r.latencyTable(rows, rows[0])
		}
	}
	return nil
}

// threeWay measures w against engine e directly, through nginx (when installed) and through
// Baton, closed loop. It returns the rows and the running Baton, which the caller stops.
func (r *runner) threeWay(ctx context.Context, e *sim.Engine, w workload, concurrency, n int) ([]measured, *proc, error) {
	rows := []measured{r.run(ctx, "engine directly", completion(r.client, e.URL(), w), concurrency, n, nil)}
	ng, err := startNginx(1, e.URL())
	if err != nil {
		return nil, nil, err
	}
	if ng != nil {
		rows = append(rows, r.run(ctx, "nginx", completion(r.client, ng.URL, w), concurrency, n, ng))
		ng.stop()
	}
	b, err := startBaton(r.o.Binary, 1, "--worker-urls", e.URL())
	if err != nil {
		return nil, nil, err
	}
	rows = append(rows, r.run(ctx, "Baton", completion(r.client, b.URL, w), concurrency, n, b))
	return rows, b, nil
}

// throughput: scenario 2, saturation throughput and CPU per 1,000 requests; plus an open-loop
// run below saturation.
func (r *runner) throughput(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 2. Throughput at saturation and CPU cost")
	fmt.Fprintln(r.out)
	n := r.n(20000, 150)
	w := workload{promptBytes: 512, maxTokens: 16}
	fmt.Fprintf(r.out, "Closed loop, 64 concurrent clients, %d non-streamed requests per row (512-byte prompt, 16 tokens). CPU is the proxy process's user+system time from /proc, per 1,000 requests.\n\n", n)
	e, err := engine(sim.Config{Engine: sim.EngineVLLM})
	if err != nil {
		return err
	}
	defer e.Close()
	rows, b, err := r.threeWay(ctx, e, w, 64, n)
	if err != nil {
		return err
	}
	defer b.stop()
	fmt.Fprintln(r.out, "| target | req/s | vs engine | p50 µs | p99 µs | proxy CPU s / 1k req |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|")
	for _, m := range rows {
		cpu := "–"
		if m.name != rows[0].name { // the engine itself: no proxy
			cpu = r.cpuCell(m, "%.3f", m.cpu/float64(m.s.N)*1000)
		}
		fmt.Fprintf(r.out, "| %s | %.0f | %.2f | %s | %s | %s |\n", m.name, m.s.Throughput(), m.s.Throughput()/rows[0].s.Throughput(), us(m.s.Latency.P50), us(m.s.Latency.P99), cpu)
	}
	fmt.Fprintln(r.out)
	r.cpuNote()
	rate := float64(r.n(1000, 200))
	on := r.n(10000, 40)
	fmt.Fprintf(r.out, "Open loop at %.0f requests/s (%d requests), below saturation:\n\n", rate, on)
	direct := OpenLoop(ctx, completion(r.client, e.URL(), w), rate, on)
	r.verify("open loop direct", direct)
	viaBaton := OpenLoop(ctx, completion(r.client, b.URL, w), rate, on)
	r.verify("open loop Baton", viaBaton)
	r.latencyTable([]measured{{name: "engine directly", s: direct}, {name: "Baton", s: viaBaton}}, measured{name: "engine directly", s: direct})
	return nil
}

// streaming: scenario 3, added TTFT and inter-event gap, and that events are not re-buffered.
func (r *runner) streaming(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 3. Streaming")
	fmt.Fprintln(r.out)
	n := r.n(600, 40)
	w := workload{promptBytes: 512, maxTokens: 32, stream: true}
	fmt.Fprintf(r.out, "16 concurrent clients, %d streamed completions per row, 32 tokens at 2 ms per token (the simulator's latency model). Every event is timed at the client. If a proxy re-buffered the stream, events would arrive in bursts: many gaps near 0 and a late first event.\n\n", n)
	e, err := engine(sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 2 * time.Millisecond})
	if err != nil {
		return err
	}
	defer e.Close()
	rows, b, err := r.threeWay(ctx, e, w, 16, n)
	if err != nil {
		return err
	}
	defer b.stop()
	fmt.Fprintln(r.out, "| target | TTFT p50 µs | TTFT p99 µs | added TTFT p50 µs | gap p50 µs | gap p99 µs | added gap p50 µs | gaps < 200 µs |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|---:|---:|")
	for _, m := range rows {
		fmt.Fprintf(r.out, "| %s | %s | %s | %s | %s | %s | %s | %.1f %% |\n", m.name, us(m.s.TTFT.P50), us(m.s.TTFT.P99),
			us(m.s.TTFT.P50-rows[0].s.TTFT.P50), us(m.s.Gap.P50), us(m.s.Gap.P99), us(m.s.Gap.P50-rows[0].s.Gap.P50), m.s.BurstGaps*100)
	}
	fmt.Fprintln(r.out)
	return nil
}

// memory: scenario 4, memory per open stream and after the load ends.
func (r *runner) memory(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 4. Memory per open stream")
	fmt.Fprintln(r.out)
	streams := r.n(1500, 50)
	tokens, per := 100, 30*time.Millisecond
	settle := 2 * time.Second // after a round, before memory is read again
	if r.o.Quick {
		tokens, settle = 20, 300*time.Millisecond
	}
	if r.o.Streams > 0 {
		streams = r.o.Streams
	}
	if streams > 2000 { // longer streams, so that all are open at once after the connection burst
		tokens, per = 200, 50*time.Millisecond
		if r.o.Quick {
			tokens = 20
		}
	}
	fmt.Fprintf(r.out, "%d concurrent streams held open through Baton (each %d tokens at %s per token, so about %s long). Resident memory of the Baton process from /proc.\n\n", streams, tokens, per, time.Duration(tokens)*per)
	engineURL, stopEngine, err := r.streamEngine(streams, per)
	if err != nil {
		return err
	}
	defer stopEngine()
	b, err := startBaton(r.o.Binary, 1, "--worker-urls", engineURL)
	if err != nil {
		return err
	}
	defer b.stop()
	w := workload{promptBytes: 256, maxTokens: tokens, stream: true}
	warm := ClosedLoop(ctx, completion(r.client, b.URL, workload{promptBytes: 256, maxTokens: 4}), 8, r.n(200, 16))
	r.verify("memory warm-up", warm)
	time.Sleep(time.Duration(r.n(500, 100)) * time.Millisecond)
	idleHeap := b.liveHeapBytes()
	idle, idleG := b.rssBytes(), b.metric("go_goroutines")
	idleHeapInuse, idleStack := b.metric("go_memstats_heap_inuse_bytes"), b.metric("go_memstats_stack_inuse_bytes")
	var peak int64
	var peakG, peakHeapInuse, peakStack float64
	var mu sync.Mutex
	stop := make(chan struct{})
	sampler := make(chan struct{})
	go func() {
		defer close(sampler)
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				if v := b.rssBytes(); v > 0 {
					g, h, st := b.metric("go_goroutines"), b.metric("go_memstats_heap_inuse_bytes"), b.metric("go_memstats_stack_inuse_bytes")
					mu.Lock()
					peak, peakG = max(peak, v), max(peakG, g)
					peakHeapInuse, peakStack = max(peakHeapInuse, h), max(peakStack, st)
					mu.Unlock()
				}
			}
		}
	}()
	// Once every stream is open, what Baton holds for them after a collection.
	idleHeld, idleStacks := b.heldBytes()
	held := make(chan [2]float64, 1)
	go func() {
		deadline := time.Now().Add(time.Duration(tokens) * per / 2)
		for b.metric("go_goroutines") < idleG+float64(streams) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		h, st := b.heldBytes()
		held <- [2]float64{h, st}
	}()
	rounds := r.n(2, 1) // the same load twice: memory after the second must not grow
	afterRSS, afterG, afterHeap := make([]int64, rounds), make([]float64, rounds), make([]float64, rounds)
	for round := range rounds {
		s := ClosedLoop(ctx, completion(r.client, b.URL, w), streams, streams)
		r.verify("memory streams", s)
		r.client.CloseIdleConnections()
		time.Sleep(settle)
		afterRSS[round], afterG[round], afterHeap[round] = b.rssBytes(), b.metric("go_goroutines"), b.liveHeapBytes()
	}
	close(stop)
	<-sampler
	fmt.Fprintln(r.out, "| | RSS MiB | goroutines | live Go heap MiB (after a forced GC) |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|")
	fmt.Fprintf(r.out, "| idle, before the load | %.1f | %.0f | %.1f |\n", mib(idle), idleG, idleHeap/(1<<20))
	fmt.Fprintf(r.out, "| peak, %d streams open | %.1f | %.0f | |\n", streams, mib(peak), peakG)
	for i := range afterRSS {
		fmt.Fprintf(r.out, "| %s after load round %d | %.1f | %.0f | %.1f |\n", settle, i+1, mib(afterRSS[i]), afterG[i], afterHeap[i]/(1<<20))
	}
	h := <-held
	heldHeap, heldStacks := (h[0]-idleHeld)/float64(streams)/1024, (h[1]-idleStacks)/float64(streams)/1024
	fmt.Fprintf(r.out, "\nPer open stream: **%.1f KiB** of RSS and %.1f goroutines (peak minus idle, over %d streams); of which Go heap in use %.1f KiB and goroutine stacks %.1f KiB (peaks).\n",
		float64(peak-idle)/float64(streams)/1024, (peakG-idleG)/float64(streams), streams,
		(peakHeapInuse-idleHeapInuse)/float64(streams)/1024, (peakStack-idleStack)/float64(streams)/1024)
	fmt.Fprintf(r.out, "Held per open stream once all were open, after a collection: **%.1f KiB** (live heap %.1f KiB + stack %.1f KiB%s); the peak adds the garbage of the connection burst, which the collector paces at GOGC.\n\n",
		heldHeap+heldStacks, heldHeap, heldStacks, b.heldNote())
	r.memoryIdle(ctx, b, streams)
	r.memoryWaiting(ctx, b, streams, tokens, per)
	if streams > 2000 {
		fmt.Fprintln(r.out, "PD row: measured up to 2,000 streams (its engines run in this process).")
		fmt.Fprintln(r.out)
		return nil
	}
	return r.memoryPD(ctx, streams, tokens, per)
}

// memoryWaiting is the memory scenario's row of non-streamed requests: n at once, each waiting
// for an answer that its engine gives whole only when the last token is made, as a non-streamed
// request waits for as long as its engine takes.
func (r *runner) memoryWaiting(ctx context.Context, b *proc, n, tokens int, per time.Duration) {
	r.client.CloseIdleConnections()
	time.Sleep(time.Duration(r.n(500, 100)) * time.Millisecond)
	idleG := b.metric("go_goroutines")
	heap0, stacks0 := b.heldBytes()
	tokens *= 2 // twice the streams' length: every request is waiting before the first ends
	held := make(chan [2]float64, 1)
	go func() {
		deadline := time.Now().Add(time.Duration(tokens) * per / 2)
		for b.metric("go_goroutines") < idleG+float64(n) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		h, st := b.heldBytes()
		held <- [2]float64{h, st}
	}()
	s := ClosedLoop(ctx, completion(r.client, b.URL, workload{promptBytes: 256, maxTokens: tokens}), n, n)
	r.verify("memory non-streamed requests", s)
	r.client.CloseIdleConnections()
	h := <-held
	fmt.Fprintf(r.out, "Non-streamed requests, %d waiting at once for answers of %d tokens: held per request after a collection **%.1f KiB** (live heap %.1f KiB + stack %.1f KiB)%s.\n\n",
		n, tokens, (h[0]-heap0+h[1]-stacks0)/float64(n)/1024, (h[0]-heap0)/float64(n)/1024, (h[1]-stacks0)/float64(n)/1024, b.heldNote())
}

// memoryIdle is the memory scenario's row of kept-alive connections: n clients that each sent
// one request and keep their connection open, sending nothing, as HTTP clients' pools do.
func (r *runner) memoryIdle(ctx context.Context, b *proc, n int) {
	var dialer net.Dialer
	var conns atomic.Int64 // what the clients opened: the divisor, whatever reuse happened
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: n, MaxConnsPerHost: n,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			conns.Add(1)
			return dialer.DialContext(ctx, network, addr)
		}}}
	defer client.CloseIdleConnections()
	r.client.CloseIdleConnections()
	time.Sleep(time.Duration(r.n(500, 100)) * time.Millisecond)
	heap0, stacks0 := b.heldBytes()
	rss0 := b.rssBytes()
	s := ClosedLoop(ctx, completion(client, b.URL, workload{promptBytes: 256, maxTokens: 4}), n, n)
	r.verify("memory kept-alive connections", s)
	time.Sleep(time.Duration(r.n(500, 100)) * time.Millisecond)
	heap1, stacks1 := b.heldBytes()
	rss1 := b.rssBytes()
	n = int(max(conns.Load(), 1))
	fmt.Fprintf(r.out, "Kept-alive connections, %d each idle after a request: held per connection after a collection **%.1f KiB** (live heap %.1f KiB + stack %.1f KiB), RSS %.1f KiB%s.\n\n",
		n, (heap1-heap0+stacks1-stacks0)/float64(n)/1024, (heap1-heap0)/float64(n)/1024, (stacks1-stacks0)/float64(n)/1024, float64(rss1-rss0)/float64(n)/1024, b.heldNote())
}

// memoryPD is the memory scenario's PD row: the same streams through a vLLM NIXL pair, each a
// prefill leg and then a streamed decode leg relayed with its usage rewritten.
func (r *runner) memoryPD(ctx context.Context, streams, tokens int, per time.Duration) error {
	p, err := engine(sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	if err != nil {
		return err
	}
	defer p.Close()
	d, err := engine(sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl, DecodePerToken: per})
	if err != nil {
		return err
	}
	defer d.Close()
	b, err := startBaton(r.o.Binary, 1, "--pd-disaggregation", "--kv-connector", "NixlConnector", "--prefill", p.URL(), "--decode", d.URL())
	if err != nil {
		return err
	}
	defer b.stop()
	warm := ClosedLoop(ctx, completion(r.client, b.URL, workload{promptBytes: 256, maxTokens: 4}), 8, r.n(200, 16))
	r.verify("memory PD warm-up", warm)
	time.Sleep(time.Duration(r.n(500, 100)) * time.Millisecond)
	idleHeld, idleStacks := b.heldBytes()
	idle, idleG := b.rssBytes(), b.metric("go_goroutines")
	var peak int64
	var peakG float64
	held := make(chan [2]float64, 1)
	open := func() int64 { // decode legs streaming now
		st := d.Stats()
		return st.RequestsReceived - st.RequestsOK - st.RequestsFailed - st.RequestsCancelled - st.RequestsRejected
	}
	tokens *= 3 // three times the regular streams' length: every decode leg is open (its prefill came first) before the first ends
	var openAtSample int64
	go func() {
		// Until every stream's decode leg is open, at most two thirds of a stream; then what is
		// held once the burst's last requests settled.
		deadline := time.Now().Add(time.Duration(tokens) * per * 2 / 3)
		for open() < int64(streams) && time.Now().Before(deadline) {
			peak, peakG = max(peak, b.rssBytes()), max(peakG, b.metric("go_goroutines"))
			time.Sleep(20 * time.Millisecond)
		}
		peak, peakG = max(peak, b.rssBytes()), max(peakG, b.metric("go_goroutines"))
		time.Sleep(time.Duration(tokens) * per / 30)
		h, st := b.heldBytes()
		openAtSample = open()
		held <- [2]float64{h, st}
	}()
	s := ClosedLoop(ctx, completion(r.client, b.URL, workload{promptBytes: 256, maxTokens: tokens, stream: true}), streams, streams)
	r.verify("memory PD streams", s)
	r.client.CloseIdleConnections()
	h := <-held
	heldHeap, heldStacks := (h[0]-idleHeld)/float64(streams)/1024, (h[1]-idleStacks)/float64(streams)/1024
	fmt.Fprintf(r.out, "PD (vLLM NIXL pair), %d streams of %d tokens: **%.1f KiB** of RSS and %.1f goroutines per open stream (peak minus idle, sampled while they opened); held after a collection **%.1f KiB** (live heap %.1f KiB + stack %.1f KiB; %d decode legs open then)%s.\n\n",
		streams, tokens, float64(peak-idle)/float64(streams)/1024, (peakG-idleG)/float64(streams), heldHeap+heldStacks, heldHeap, heldStacks, openAtSample, b.heldNote())
	return nil
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

// streamEngine starts the simulated engine of the memory scenario: in this process for up to
// 2,000 streams, else as a process of its own (this one then holds only the clients' ends, so
// that its file descriptors suffice).
//
// A quick run always takes the separate process, so that the smoke test covers that path.
func (r *runner) streamEngine(streams int, per time.Duration) (string, func(), error) {
	if streams <= 2000 && !r.o.Quick {
		e, err := engine(sim.Config{Engine: sim.EngineVLLM, DecodePerToken: per})
		if err != nil {
			return "", nil, err
		}
		return e.URL(), e.Close, nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", nil, err
	}
	n := strconv.Itoa(streams)
	p, err := startSim(self, 0, "--port", "0", "--model", benchModel, "--decode-per-token", per.String(), "--max-concurrency", n, "--queue-size", n)
	if err != nil {
		return "", nil, err
	}
	return p.URL, p.stop, nil
}

// bodySize: scenario 5, cost per request as the prompt grows.
func (r *runner) bodySize(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 5. Body size scaling")
	fmt.Fprintln(r.out)
	fmt.Fprintln(r.out, "One client, non-streamed completions with 16 tokens, prompts of 1 KB to 1 MB. Added latency is Baton's p50 minus the engine's; CPU is Baton's per request.")
	fmt.Fprintln(r.out)
	e, err := engine(sim.Config{Engine: sim.EngineVLLM})
	if err != nil {
		return err
	}
	defer e.Close()
	b, err := startBaton(r.o.Binary, 1, "--worker-urls", e.URL())
	if err != nil {
		return err
	}
	defer b.stop()
	fmt.Fprintln(r.out, "| prompt | engine p50 µs | Baton p50 µs | added p50 µs | Baton CPU µs / req | CPU µs per KB |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|")
	for _, c := range []struct {
		size        int
		full, quick int
	}{{1 << 10, 1000, 30}, {10 << 10, 1000, 30}, {100 << 10, 400, 10}, {1 << 20, 60, 4}} {
		w := workload{promptBytes: c.size, maxTokens: 16}
		n := r.n(c.full, c.quick)
		direct := r.run(ctx, fmt.Sprintf("direct %d", c.size), completion(r.client, e.URL(), w), 1, n, nil)
		via := r.run(ctx, fmt.Sprintf("Baton %d", c.size), completion(r.client, b.URL, w), 1, n, b)
		cpu := via.cpu / float64(n) * 1e6
		fmt.Fprintf(r.out, "| %d KB | %s | %s | %s | %s | %s |\n", c.size>>10, us(direct.s.Latency.P50), us(via.s.Latency.P50),
			us(via.s.Latency.P50-direct.s.Latency.P50), r.cpuCell(via, "%.0f", cpu), r.cpuCell(via, "%.2f", cpu/float64(c.size>>10)))
	}
	fmt.Fprintln(r.out)
	r.cpuNote()
	return nil
}

// workers: scenario 6, 1 to 256 workers behind one Baton.
func (r *runner) workers(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 6. Worker count scaling")
	fmt.Fprintln(r.out)
	n := r.n(6000, 200)
	counts := []int{1, 16, 64, 256}
	if r.o.Quick {
		counts = []int{1, 16}
	}
	fmt.Fprintf(r.out, "32 concurrent clients, %d non-streamed requests per row (512-byte prompt, 16 tokens), round robin over N simulated engines. Baseline: the clients spread over the same engines directly.\n\n", n)
	fmt.Fprintln(r.out, "| workers | direct req/s | Baton req/s | Baton vs direct | Baton p50 µs | Baton p99 µs | Baton CPU s / 1k req |")
	fmt.Fprintln(r.out, "|---:|---:|---:|---:|---:|---:|---:|")
	w := workload{promptBytes: 512, maxTokens: 16}
	for _, count := range counts {
		var es []*sim.Engine
		var args []string
		for i := 0; i < count; i++ {
			e, err := engine(sim.Config{Engine: sim.EngineVLLM})
			if err != nil {
				return err
			}
			es = append(es, e)
			args = append(args, e.URL())
		}
		spread := func(ctx context.Context, i int) Result { return completion(r.client, es[i%len(es)].URL(), w)(ctx, i) }
		direct := r.run(ctx, fmt.Sprintf("direct x%d", count), spread, 32, n, nil)
		b, err := startBaton(r.o.Binary, 1, append([]string{"--worker-urls"}, args...)...)
		if err != nil {
			return err
		}
		via := r.run(ctx, fmt.Sprintf("Baton x%d", count), completion(r.client, b.URL, w), 32, n, b)
		b.stop()
		for _, e := range es {
			e.Close()
		}
		r.client.CloseIdleConnections()
		fmt.Fprintf(r.out, "| %d | %.0f | %.0f | %.2f | %s | %s | %s |\n", count, direct.s.Throughput(), via.s.Throughput(),
			via.s.Throughput()/direct.s.Throughput(), us(via.s.Latency.P50), us(via.s.Latency.P99), r.cpuCell(via, "%.3f", via.cpu/float64(n)*1000))
	}
	fmt.Fprintln(r.out)
	r.cpuNote()
	return nil
}
