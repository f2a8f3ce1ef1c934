package app

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// fleet starts simulated vLLM engines and a regular-mode gateway over them.
func simFleet(t *testing.T, engines []sim.Config, tweak ...func(*config.Config)) ([]*sim.Engine, *Gateway, string) {
	t.Helper()
	var es []*sim.Engine
	cfg := config.Default()
	for _, ec := range engines {
		if ec.Engine == "" {
			ec.Engine = sim.EngineVLLM
		}
		e := simEngine(t, ec)
		es = append(es, e)
		cfg.WorkerURLs = append(cfg.WorkerURLs, e.URL())
	}
	g, srv := startGateway(t, cfg, tweak...)
	return es, g, srv.URL
}

// expectedCompletion is the simulator's answer to a completion of prompt.
func expectedCompletion(prompt string, maxTokens int) string {
	toks, _ := sim.Generate(sim.Digest(sim.Tokenize(prompt)), sim.Sampling{MaxTokens: maxTokens, IgnoreEOS: true})
	return sim.Detokenize(toks)
}

func TestWorkerKilledMidStream(t *testing.T) {
	t.Parallel()
	es, g, gw := simFleet(t, []sim.Config{{DecodePerToken: 20 * time.Millisecond}, {}}, func(c *config.Config) {
		c.CircuitBreaker.FailureThreshold = 1
		c.HealthCheck.Interval, c.HealthCheck.FailureThreshold = time.Second, 1
	})
	victim := es[0]
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	var resp *http.Response
	for { // round robin: find the request that lands on the victim
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"long","max_tokens":200,"ignore_eos":true,"stream":true}`))
		r, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if r.Header.Get("X-Baton-Worker") == victim.URL() {
			resp = r
			break
		}
		io.Copy(io.Discard, r.Body)
		r.Body.Close()
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	victim.Close() // the engine dies with the stream open
	rest, err := io.ReadAll(br)
	if err == nil {
		t.Fatalf("stream ended cleanly after the engine died: %q", rest)
	}
	if strings.Contains(string(rest), "[DONE]") {
		t.Fatal("a broken stream carried [DONE]")
	}
	ws := g.Registry.Snapshot().Workers
	poll.Until(t, "the condition", func() bool { return ws[0].InFlight() == 0 })
	if ws[0].Available() {
		t.Error("victim still available after a mid-stream failure (breaker threshold 1)")
	}
	poll.Until(t, "the condition", func() bool { return !ws[0].Ready() }) // the health check sees it too
	var scrape strings.Builder
	mfs, _ := g.Metrics.Registry.Gather()
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetValue() == victim.URL() {
					fmt.Fprintf(&scrape, "%s %v %v\n", mf.GetName(), m.GetGauge().GetValue(), m.GetCounter().GetValue())
				}
			}
		}
	}
	for _, want := range []string{"baton_worker_circuit_state 1 0", "baton_worker_ready 0 0"} {
		if !strings.Contains(scrape.String(), want) {
			t.Errorf("metrics for the victim lack %q:\n%s", want, scrape.String())
		}
	}
	for i := 0; i < 6; i++ {
		r, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"after","max_tokens":2}`)
		if r.StatusCode != 200 || r.Header.Get("X-Baton-Worker") != es[1].URL() {
			t.Fatalf("request after the kill: %d via %q: %s", r.StatusCode, r.Header.Get("X-Baton-Worker"), body)
		}
	}
}

func TestWorkerRestartRejoins(t *testing.T) {
	t.Parallel()
	es, g, gw := simFleet(t, []sim.Config{{}, {}}, func(c *config.Config) {
		c.HealthCheck.Interval, c.HealthCheck.FailureThreshold, c.HealthCheck.SuccessThreshold = time.Second, 1, 1
		c.CircuitBreaker.TimeoutDuration = time.Second
	})
	addr := es[0].Addr()
	es[0].Close()
	ws := g.Registry.Snapshot().Workers
	poll.Until(t, "the condition", func() bool { return !ws[0].Ready() })
	var port int
	fmt.Sscanf(addr[strings.LastIndexByte(addr, ':')+1:], "%d", &port)
	back, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Model: pdModel, Port: port})
	if err != nil {
		t.Fatalf("restarting on %s: %v", addr, err)
	}
	t.Cleanup(back.Close)
	poll.Until(t, "the condition", func() bool { return ws[0].Ready() })
	poll.Until(t, "the condition", func() bool {
		r, _ := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"welcome back","max_tokens":2}`)
		return r.Header.Get("X-Baton-Worker") == back.URL()
	})
}

func TestHangingWorkerTimesOut(t *testing.T) {
	noLeaks(t)
	_, g, gw := simFleet(t, []sim.Config{{Faults: sim.Faults{Hang: true}}}, requestTimeout(200*time.Millisecond))
	resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"hello?","max_tokens":2}`)
	var e envelope
	json.Unmarshal([]byte(body), &e)
	if resp.StatusCode != 504 || !strings.Contains(e.Error.Code, "timeout") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	poll.Until(t, "the condition", func() bool { return g.Registry.Snapshot().Workers[0].InFlight() == 0 })
}

func TestPDPrefillFailingLeavesDecodeBreakerAlone(t *testing.T) {
	t.Parallel()
	for _, engine := range []string{sim.EngineSGLang, sim.EngineVLLM} {
		var p, d *sim.Engine
		var g *Gateway
		var gw string
		tweak := func(c *config.Config) { c.Retry.Disable = false; c.CircuitBreaker.FailureThreshold = 2 }
		if engine == sim.EngineSGLang {
			p, d, g, gw = sglangPD(t, sim.Config{Faults: sim.Faults{Status: 500}}, sim.Config{}, tweak)
		} else {
			p, d, g, gw = vllmPD(t, "NixlConnector", sim.Config{Faults: sim.Faults{Status: 500}}, sim.Config{}, tweak)
		}
		for i := 0; i < 3; i++ {
			resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":2}`)
			if resp.StatusCode != 500 && resp.StatusCode != 503 {
				t.Fatalf("%s: %d %s", engine, resp.StatusCode, body)
			}
		}
		ws := g.Registry.Snapshot().Workers
		if ws[0].BreakerState() == 0 {
			t.Errorf("%s: prefill breaker still closed", engine)
		}
		if _, f := ws[1].Outcomes(); f != 0 || ws[1].BreakerState() != 0 {
			t.Errorf("%s: decode penalised: %d failures, breaker %d", engine, f, ws[1].BreakerState())
		}
		_, _ = p, d
	}
}

func TestPairQuarantine(t *testing.T) {
	t.Parallel()
	p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	bad := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, Faults: sim.Faults{Status: 500}})
	good := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode})
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Retry.Disable = true
	cfg.CircuitBreaker.Disable = true // the pair's health alone must steer traffic
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: "prefill", KVConnector: "NixlConnector"}, {URL: bad.URL(), Role: "decode"}, {URL: good.URL(), Role: "decode"}}
	_, srv := startGateway(t, cfg)
	fails := 0
	for i := 0; i < 12; i++ {
		resp, _ := gwtest.PostTimeout(t, srv.URL+"/v1/completions", `{"model":"m","prompt":"pairs","max_tokens":2}`)
		if resp.StatusCode != 200 {
			fails++
		}
	}
	if fails != 3 { // round robin alternates until (p, bad) fails 3 times, then only good is used
		t.Errorf("%d failures of 12, want 3", fails)
	}
	if got := bad.Stats().RequestsReceived; got != 3 {
		t.Errorf("bad decode got %d requests, want 3", got)
	}
}

// A load run against a fleet with injected faults: every request completes with the exact text
// the simulator gives or fails with a proper error status; none is lost or silently truncated;
// in-flight counts return to zero and no goroutine is left behind.
func TestLoadWithFaults(t *testing.T) {
	noLeaks(t)
	_, g, gw := simFleet(t, []sim.Config{
		{},
		{Faults: sim.Faults{Status: 503, Rate: 0.3}},
		{Faults: sim.Faults{DropAfter: 3, Rate: 0.2}},
	})
	const total, concurrency = 2000, 32
	var ok, failed, aborted atomic.Int64
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: concurrency}}
	defer client.CloseIdleConnections()
	jobs := make(chan int)
	var wg sync.WaitGroup
	for w := 0; w < concurrency; w++ {
		wg.Go(func() {
			for i := range jobs {
				stream := i%2 == 0
				prompt := fmt.Sprintf("load %d", i)
				body := fmt.Sprintf(`{"model":"m","prompt":"%s","max_tokens":6,"ignore_eos":true,"stream":%v}`, prompt, stream)
				resp, err := client.Post(gw+"/v1/completions", "application/json", strings.NewReader(body))
				if err != nil {
					t.Errorf("request %d: %v", i, err)
					continue
				}
				b, rerr := io.ReadAll(resp.Body)
				resp.Body.Close()
				switch {
				case rerr != nil: // the connection broke: visible to the client, never a short success
					if stream && strings.Contains(string(b), "[DONE]") {
						t.Errorf("request %d: broken stream carried [DONE]", i)
					}
					aborted.Add(1)
				case resp.StatusCode == 200:
					if stream && !strings.HasSuffix(string(b), "data: [DONE]\n\n") {
						t.Errorf("request %d: stream truncated without an error: %q", i, b)
					}
					if got, want := gwtest.AnswerText(t, string(b)), expectedCompletion(prompt, 6); got != want {
						t.Errorf("request %d: text %q, want %q", i, got, want)
					}
					ok.Add(1)
				case resp.StatusCode >= 500 && json.Valid(b):
					failed.Add(1)
				default:
					t.Errorf("request %d: status %d body %q", i, resp.StatusCode, b)
				}
			}
		})
	}
	for i := 0; i < total; i++ {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	if n := ok.Load() + failed.Load() + aborted.Load(); n != total {
		t.Errorf("accounted for %d of %d requests", n, total)
	}
	if ok.Load() < total*8/10 {
		t.Errorf("only %d of %d succeeded (failed %d, aborted %d)", ok.Load(), total, failed.Load(), aborted.Load())
	}
	t.Logf("ok %d, failed %d, aborted mid-stream %d, retries %v", ok.Load(), failed.Load(), aborted.Load(),
		testutil.ToFloat64(g.Metrics.Retries.WithLabelValues("POST /v1/completions", "status_503")))
	for _, w := range g.Registry.Snapshot().Workers {
		poll.Until(t, "the condition", func() bool { return w.InFlight() == 0 })
	}
}

// noLeaks fails the test if goroutines it started outlive it: the ones alive when it begins
// are known, and its own cleanups (registered after this one) run before the check. What lives
// for the process is ignored: idle client connections of the shared transport, the API
// server's epoll watcher.
func noLeaks(t *testing.T) {
	t.Helper()
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		http.DefaultClient.CloseIdleConnections()
		goleak.VerifyNone(t, before, goleak.IgnoreAnyFunction("github.com/baton-llm/baton/internal/h1.(*watcher).run"))
	})
}
