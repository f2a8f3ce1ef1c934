package bench

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/baton-llm/baton/internal/epp/dataplane"
	"github.com/baton-llm/baton/internal/sim"
)

var eppLine = regexp.MustCompile(`baton endpoint picker \(ext_proc, gRPC health\) on (\S+)`)

// startEPP starts `baton epp` with args on cpu and waits until its readiness service serves.
func startEPP(binary string, cpu int, args ...string) (*proc, *grpc.ClientConn, error) {
	argv := append([]string{binary, "epp", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grpc-port", "0", "--grpc-health-port", "-1", "--epp-secure-serving=false", "--log-level", "error", "--access-log=false"}, args...)
	p, ms, err := startUntilAll(pinned(cpu, argv...), "baton epp", servingLine, eppLine)
	if err != nil {
		return nil, nil, err
	}
	p.URL, p.MetricsURL, p.grpcAddr = ms[0][1], ms[0][2], ms[1][1]
	conn, err := grpc.NewClient(ms[1][1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		p.stop()
		return nil, nil, err
	}
	hc := healthpb.NewHealthClient(conn)
	for deadline := time.Now().Add(60 * time.Second); ; {
		r, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: "readiness"})
		if err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return p, conn, nil
		}
		if time.Now().After(deadline) {
			conn.Close()
			p.stop()
			return nil, nil, fmt.Errorf("baton epp never became ready: %s", p.logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// buckets reads a histogram's cumulative bucket counts from Baton's /metrics, by upper bound.
func (p *proc) buckets(name string) map[float64]float64 {
	out := map[float64]float64{}
	resp, err := http.Get(p.MetricsURL)
	if err != nil {
		return out
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	prefix := name + `_bucket{le="`
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), prefix)
		if !ok {
			continue
		}
		le, count, ok := strings.Cut(rest, `"} `)
		if !ok {
			continue
		}
		bound, err1 := strconv.ParseFloat(le, 64)
		n, err2 := strconv.ParseFloat(count, 64)
		if err1 == nil && err2 == nil {
			out[bound] = n
		}
	}
	return out
}

// quantile is the q quantile, in µs, of the observations between two readings of a histogram,
// interpolated linearly within its bucket.
func quantile(before, after map[float64]float64, q float64) string {
	bounds := make([]float64, 0, len(after))
	for b := range after {
		bounds = append(bounds, b)
	}
	slices.Sort(bounds)
	if len(bounds) == 0 {
		return "–"
	}
	total := after[bounds[len(bounds)-1]] - before[bounds[len(bounds)-1]]
	if total <= 0 {
		return "–"
	}
	want, lo, prev := q*total, 0.0, 0.0
	for _, b := range bounds {
		n := after[b] - before[b]
		if n >= want {
			if math.IsInf(b, 1) {
				return fmt.Sprintf("> %.0f", lo*1e6)
			}
			frac := (want - prev) / max(n-prev, 1e-9)
			return fmt.Sprintf("%.0f", (lo+frac*(b-lo))*1e6)
		}
		lo, prev = b, n
	}
	return "–"
}

// decision runs one whole ext_proc exchange without an engine behind it, as a data plane
// would for a request: headers and body, the pick (timed from the body's last byte to the
// headers' answer), then the response headers and an empty response body ending it.
func decision(client extprocv3.ExternalProcessorClient, body []byte) Request {
	headers := dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", http.Header{"Content-Type": {"application/json"}}, false)
	return func(ctx context.Context, i int) (r Result) {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		st, err := client.Process(ctx)
		if err != nil {
			r.Err = err
			return r
		}
		if err := st.Send(headers); err != nil {
			r.Err = err
			return r
		}
		start := time.Now()
		if err := st.Send(dataplane.RequestBody(body, true)); err != nil {
			r.Err = err
			return r
		}
		m, err := st.Recv()
		if err != nil {
			r.Err = err
			return r
		}
		if m.GetRequestHeaders() == nil {
			r.Err = fmt.Errorf("no pick: %v", m)
			return r
		}
		r.TTFT = time.Since(start)
		if _, err := st.Recv(); err != nil { // the body handed back
			r.Err = err
			return r
		}
		for _, msg := range []*extprocv3.ProcessingRequest{dataplane.ResponseHeaders(http.StatusOK, nil, "", false), dataplane.ResponseBody([]byte(`{}`), true)} {
			if err := st.Send(msg); err != nil {
				r.Err = err
				return r
			}
			if _, err := st.Recv(); err != nil {
				r.Err = err
				return r
			}
		}
		_ = st.CloseSend()
		r.Latency = time.Since(start)
		return r
	}
}

// epp: scenario 14, Baton as an Endpoint Picker behind a Gateway API data plane.
func (r *runner) epp(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 14. Endpoint Picker (`baton epp`)")
	fmt.Fprintln(r.out)
	var urls []string
	for i := 0; i < 4; i++ {
		e, err := engine(sim.Config{Engine: sim.EngineVLLM, PrefixCache: true})
		if err != nil {
			return err
		}
		defer e.Close()
		urls = append(urls, e.URL())
	}
	p, conn, err := startEPP(r.o.Binary, 1, append([]string{"--policy", "cache_aware", "--worker-urls"}, urls...)...)
	if err != nil {
		return err
	}
	defer p.stop()
	defer conn.Close()
	client := extprocv3.NewExternalProcessorClient(conn)
	w := workload{promptBytes: 1000, maxTokens: 8}

	// Decisions: whole exchanges, no engine behind them.
	n := r.n(40000, 2000)
	body := func(i int) []byte { return w.body(w.prompt(i)) }
	bodies := make([][]byte, n)
	for i := range bodies {
		bodies[i] = body(i)
	}
	one := func(ctx context.Context, i int) Result { return decision(client, bodies[i])(ctx, i) }
	fmt.Fprintf(r.out, "Four simulated vLLM engines, policy `cache_aware` (approximate index), `baton epp` on its own core. A decision is one whole ext_proc exchange as Envoy makes it — headers, a %d-byte body, the pick, the body handed back, response headers, an end of response — from a Go gRPC client (on the other core, with the simulators), with no engine behind it. Choice: Baton's own time from the body's last byte to its answer (its baton_epp_decision_seconds histogram, interpolated within buckets); pick: the client's, from sending the body's last byte to receiving the pick; exchange: the client's whole exchange.\n\n", len(bodies[0]))
	fmt.Fprintln(r.out, "| load | decisions/s | choice p50 µs (Baton) | choice p99 µs (Baton) | pick p50 µs (client) | pick p99 µs (client) | exchange p99 µs (client) | Baton CPU per decision µs |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|---:|---:|")
	for _, mode := range []struct {
		name string
		rate float64
	}{{"closed loop, 32 streams", 0}, {"open loop, 2,000/s", 2000}, {"open loop, 500/s", 500}} {
		before, hist := p.cpuSeconds(), p.buckets("baton_epp_decision_seconds")
		var s Stats
		if mode.rate == 0 {
			s = ClosedLoop(ctx, one, 32, n)
		} else {
			s = OpenLoop(ctx, one, mode.rate, min(n, int(mode.rate)*r.n(10, 1)))
		}
		cpu := p.cpuSeconds() - before
		r.verify("epp "+mode.name, s)
		after := p.buckets("baton_epp_decision_seconds")
		fmt.Fprintf(r.out, "| %s | %.0f | %s | %s | %s | %s | %s | %.0f |\n", mode.name, s.Throughput(), quantile(hist, after, 0.5), quantile(hist, after, 0.99),
			us(s.TTFT.P50), us(s.TTFT.P99), us(s.Latency.P99), cpu/float64(max(s.N-s.Errors, 1))*1e6)
	}
	fmt.Fprintln(r.out)

	// Added latency: straight to an engine, through the data plane and the picker, and through
	// Baton's own proxy, the same requests.
	dp := &dataplane.Proxy{Picker: client, Client: r.client}
	front := httptest.NewServer(dp)
	defer front.Close()
	b, err := startBaton(r.o.Binary, 1, append([]string{"--policy", "cache_aware", "--access-log=false", "--worker-urls"}, urls...)...)
	if err != nil {
		return err
	}
	m := r.n(3000, 200)
	short := workload{promptBytes: 200, maxTokens: 4}
	direct := r.run(ctx, "epp direct", completion(r.client, urls[0], short), 8, m, nil)
	through := r.run(ctx, "epp through the data plane", completion(r.client, front.URL, short), 8, m, p)
	proxied := r.run(ctx, "epp baton serve", completion(r.client, b.URL, short), 8, m, b)
	b.stop()
	fmt.Fprintf(r.out, "Added latency: %d non-streamed completions (200-byte prompt, 4 tokens), 8 clients, straight to one engine; through the test data plane (a Go reverse proxy that asks the picker over ext_proc, then forwards to the endpoint named); and through `baton serve` (Baton's own proxy) over the same engines.\n\n", m)
	r.latencyTable([]measured{direct, through, proxied}, direct)

	if err := r.eppFlood(ctx, urls); err != nil {
		return err
	}
	// The routing workload through the picker, against Baton's own proxy.
	return r.eppRouting(ctx)
}

// eppFlood opens idle ext_proc streams (request headers, then nothing) by the thousand against a
// picker with its default bounds, and reads its memory and goroutines while they are open and
// after they are gone.
func (r *runner) eppFlood(ctx context.Context, urls []string) error {
	p, conn, err := startEPP(r.o.Binary, 1, append([]string{"--worker-urls"}, urls...)...)
	if err != nil {
		return err
	}
	defer p.stop()
	conn.Close()
	settle := func() (int64, float64) {
		time.Sleep(2 * time.Second)
		return p.rssBytes(), p.metric("go_goroutines")
	}
	rss0, g0 := settle()
	streams, conns := r.n(20000, 2000), 100
	var clients []extprocv3.ExternalProcessorClient
	var cs []*grpc.ClientConn
	for i := 0; i < conns; i++ {
		c, err := grpc.NewClient(p.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer c.Close()
		cs = append(cs, c)
		clients = append(clients, extprocv3.NewExternalProcessorClient(c))
	}
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var refused, ended atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for i := 0; i < streams; i++ {
		st, err := clients[i%conns].Process(fctx)
		if err != nil {
			refused.Add(1)
			continue
		}
		_ = st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
		wg.Go(func() {
			if _, err := st.Recv(); status.Code(err) == codes.ResourceExhausted {
				refused.Add(1)
			} else if status.Code(err) != codes.Canceled {
				ended.Add(1)
			}
		})
	}
	opened := time.Since(start)
	var peak int64
	var peakG float64
	for i := 0; i < 10; i++ {
		time.Sleep(200 * time.Millisecond)
		peak, peakG = max(peak, p.rssBytes()), max(peakG, p.metric("go_goroutines"))
	}
	held := p.metric("baton_epp_streams")
	cancel()
	wg.Wait()
	for _, c := range cs {
		c.Close()
	}
	rss1, g1 := settle()
	time.Sleep(5 * time.Second)
	rss2, g2 := p.rssBytes(), p.metric("go_goroutines")
	fmt.Fprintf(r.out, "A hostile data plane: %d idle streams (request headers, then nothing) opened over %d connections in %.1f s against `baton epp` with its default bounds (epp_max_streams 1024, 256 per connection, body_timeout 2m; plaintext here).\n\n", streams, conns, opened.Seconds())
	fmt.Fprintln(r.out, "| moment | RSS MiB | growth MiB | goroutines | streams held | streams refused (RESOURCE_EXHAUSTED) |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|")
	fmt.Fprintf(r.out, "| before | %.1f | — | %.0f | 0 | — |\n", mib(rss0), g0)
	fmt.Fprintf(r.out, "| streams open (peak) | %.1f | %.1f | %.0f | %.0f | %d |\n", mib(peak), mib(peak-rss0), peakG, held, refused.Load())
	fmt.Fprintf(r.out, "| 2 s after they and their connections closed | %.1f | %.1f | %.0f | 0 | — |\n", mib(rss1), mib(rss1-rss0), g1)
	fmt.Fprintf(r.out, "| 7 s after they closed | %.1f | %.1f (%+.0f %%) | %.0f | 0 | — |\n", mib(rss2), mib(rss2-rss0), 100*float64(rss2-rss0)/float64(rss0), g2)
	fmt.Fprintln(r.out)
	if ended.Load() > 0 {
		r.failed = append(r.failed, fmt.Sprintf("epp flood: %d streams ended otherwise than refused or cancelled", ended.Load()))
	}
	return nil
}

// eppRouting runs scenario 8's workload with cache_aware through the picker and through Baton's
// proxy, each over a fresh fleet: the same brain should find the same share cached.
func (r *runner) eppRouting(ctx context.Context) error {
	n := r.n(1600, 64)
	prompts := routingPrompts(n)
	w := workload{maxTokens: 8, stream: true}
	fmt.Fprintf(r.out, "Routing: scenario 8's workload (%d streamed completions, 16 clients, 4 engines with %d-block prefix caches), `cache_aware`, through the picker (and the test data plane) and through Baton's own proxy.\n\n", n, routingCacheBlocks)
	fmt.Fprintln(r.out, "| path | hit share | TTFT p50 ms | TTFT p99 ms | TTFT mean ms | req/s |")
	fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|")
	for _, path := range []string{"baton epp", "baton serve"} {
		es, urls, err := routingFleet()
		if err != nil {
			return err
		}
		defer closeAll(es)
		args := append([]string{"--policy", "cache_aware", "--worker-urls"}, urls...)
		var base string
		var proc *proc
		var stop func()
		if path == "baton epp" {
			p, conn, err := startEPP(r.o.Binary, 1, args...)
			if err != nil {
				return err
			}
			front := httptest.NewServer(&dataplane.Proxy{Picker: extprocv3.NewExternalProcessorClient(conn), Client: r.client})
			base, proc, stop = front.URL, p, func() { front.Close(); conn.Close(); p.stop() }
		} else {
			b, err := startBaton(r.o.Binary, 1, args...)
			if err != nil {
				return err
			}
			base, proc, stop = b.URL, b, b.stop
		}
		req := func(ctx context.Context, i int) Result {
			status, body, res := post(ctx, r.client, base+"/v1/completions", w.body(prompts[i]), nil)
			return w.check(status, body, prompts[i], res)
		}
		m := r.run(ctx, "epp routing "+path, req, 16, n, proc)
		stop()
		var hits, queries int64
		for _, e := range es {
			s := e.Stats()
			hits, queries = hits+s.PrefixCacheHits, queries+s.PrefixCacheQueries
			e.Close()
		}
		ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/float64(time.Millisecond)) }
		fmt.Fprintf(r.out, "| %s | %.2f | %s | %s | %s | %.0f |\n", path, float64(hits)/float64(max(queries, 1)), ms(m.s.TTFT.P50), ms(m.s.TTFT.P99), ms(m.s.TTFT.Mean), m.s.Throughput())
	}
	fmt.Fprintln(r.out)
	return nil
}
