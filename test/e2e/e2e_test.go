// Package e2e builds the baton binary and drives it as a process against engines on 127.0.0.1.
package e2e

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/sim"
)

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "baton-e2e")
	if err != nil {
		panic(err)
	}
	binary = filepath.Join(dir, "baton")
	out, err := exec.Command("go", "build", "-o", binary, "../../cmd/baton").CombinedOutput()
	if err != nil {
		os.Stderr.Write(out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

var addrLine = regexp.MustCompile(`baton serving on (http://\S+) (?:\(metrics on (http://\S+)/metrics\))?`)

// startBaton runs the binary with args and returns its API URL; the process gets SIGTERM at
// cleanup and must exit 0.
func startBaton(t *testing.T, args ...string) string {
	t.Helper()
	api, _ := startBatonMetrics(t, args...)
	return api
}

// startBatonMetrics is startBaton, also returning the metrics port's base URL ("" when none).
func startBatonMetrics(t *testing.T, args ...string) (string, string) {
	t.Helper()
	base := []string{"--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"}
	// BATON_TEST_HTTP_SERVER (baton or net) runs the suite on that API server: CI runs it on both.
	if v := os.Getenv("BATON_TEST_HTTP_SERVER"); v != "" {
		base = append(base, "--http-server", v)
	}
	cmd := exec.Command(binary, append(base, args...)...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var logs strings.Builder
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan []string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := addrLine.FindStringSubmatch(sc.Text()); m != nil {
				lines <- m
			}
		}
	}()
	var api, metricsURL string
	select {
	case m := <-lines:
		api, metricsURL = m[1], m[2]
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		t.Fatalf("baton did not start; logs:\n%s", logs.String())
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("baton exited with %v after SIGTERM; logs:\n%s", err, logs.String())
			}
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			t.Errorf("baton did not exit after SIGTERM")
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get(api + "/readiness")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return api, metricsURL
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("baton never became ready; logs:\n%s", logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// openAIEngine is a small OpenAI-style engine: it answers chat and completions, streamed or not.
func openAIEngine(t *testing.T) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/models":
			io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm"}]}`)
		case "/v1/chat/completions", "/v1/completions":
			var req struct {
				Stream bool `json:"stream"`
			}
			json.NewDecoder(r.Body).Decode(&req)
			if req.Stream {
				w.Header().Set("Content-Type", "text/event-stream")
				for _, tok := range []string{"hel", "lo"} {
					io.WriteString(w, `data: {"choices":[{"delta":{"content":"`+tok+`"}}]}`+"\n\n")
					w.(http.Flusher).Flush()
				}
				io.WriteString(w, "data: [DONE]\n\n")
				return
			}
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"path":"`+r.URL.Path+`","choices":[{"text":"hello"}]}`)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestBinaryServesChatStreamAndCompletion(t *testing.T) {
	eng := openAIEngine(t)
	api := startBaton(t, "--worker-urls", eng.URL)

	for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
		resp, err := http.Post(api+path, "application/json", strings.NewReader(`{"model":"m","messages":[]}`))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(body) != `{"path":"`+path+`","choices":[{"text":"hello"}]}` {
			t.Errorf("%s: %d %s", path, resp.StatusCode, body)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, api+"/v1/chat/completions", strings.NewReader(`{"model":"m","stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	want := "data: {\"choices\":[{\"delta\":{\"content\":\"hel\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\ndata: [DONE]\n\n"
	if err != nil || string(body) != want || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Errorf("stream: %v %q", err, body)
	}
}

func TestBinaryStartupErrorExitsNonZero(t *testing.T) {
	out, err := exec.Command(binary, "--policy", "nope", "--port", "70000").CombinedOutput()
	var ee *exec.ExitError
	if err == nil || !errors.As(err, &ee) || ee.ExitCode() == 0 {
		t.Fatalf("exit: %v, want non-zero", err)
	}
	if lines := strings.Count(strings.TrimSpace(string(out)), "\n"); lines != 0 || !strings.Contains(string(out), "policy") || !strings.Contains(string(out), "port 70000") {
		t.Errorf("want one line naming both problems, got %q", out)
	}
}

// A short run of the benchmark harness: every scenario runs end to end and every answer is
// checked against the simulator's model (the harness exits non-zero on a wrong answer); the
// quick memory scenario runs its engine as a process of its own, as past 2,000 streams. It
// checks that the harness works; it asserts no timing. Two groups of scenarios run at once,
// the waiting ones beside the busy ones.
func TestBenchSmoke(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	groups := []string{"memory,hardening,tenants,fairness,epp", "latency,throughput,streaming,bodysize,workers,routing,replicas,hotpath"}
	outs := make([][]byte, len(groups))
	errs := make([]error, len(groups))
	prof := filepath.Join(t.TempDir(), "harness.prof")
	var wg sync.WaitGroup
	for i, g := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			args := []string{"bench", "--quick", "--scenarios", g}
			if i == 1 { // the busy group: its harness's own profile
				args = append(args, "--cpu-profile", prof)
			}
			outs[i], errs[i] = exec.CommandContext(ctx, binary, args...).CombinedOutput()
		}()
	}
	wg.Wait()
	for i := range groups {
		if errs[i] != nil {
			t.Fatalf("baton bench --quick --scenarios %s: %v\n%s", groups[i], errs[i], outs[i])
		}
	}
	out := string(bytes.Join(outs, nil))
	for _, h := range []string{"## 1. Added latency", "## 2. Throughput", "## 3. Streaming", "## 4. Memory", "## 5. Body size", "## 6. Worker count",
		"## 7. Attacks", "## 8. Routing", "## 9. Replicas", "## 10. Hot path", "## 11. Tenants", "admitted / allowed", "beside a, far over its limit", "## 12. Fairness", "**6. Waiting room.**", "## 14. Endpoint Picker", "choice p99 µs (Baton)", "harness CPU µs / request", "PD SGLang: Baton", "PD vLLM NIXL: Baton", "Held per open stream", "PD (vLLM NIXL pair)"} {
		if !strings.Contains(out, h) {
			t.Errorf("report lacks %q:\n%s", h, out)
		}
	}
	if strings.Contains(out, " †") && !strings.Contains(out, "† below the measuring resolution") {
		t.Errorf("a CPU figure is marked below resolution without the note:\n%s", out)
	}
	// --cpu-profile: a gzipped pprof profile of the harness itself, whose functions (the load
	// generator's) are named in its string table.
	f, err := os.Open(prof)
	if err != nil {
		t.Fatalf("--cpu-profile wrote no profile: %v", err)
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		t.Fatalf("--cpu-profile: not a gzipped profile: %v", err)
	}
	raw, err := io.ReadAll(z)
	if err != nil || !bytes.Contains(raw, []byte("internal/bench.ClosedLoop")) {
		t.Fatalf("--cpu-profile: the profile (%d bytes, %v) does not name the harness's load generator", len(raw), err)
	}
}

// metricValue reads one unlabelled sample from a Prometheus text page.
func metricValue(t *testing.T, metricsURL, name string) float64 {
	t.Helper()
	resp, err := http.Get(metricsURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("no %s on the metrics page", name)
	return 0
}

// An open stream parks its goroutine under frames that use less than a quarter of a 16 KiB
// stack, so that the collector halves it: 8 KiB of stack per open stream, regular and PD, on
// Baton's own HTTP server (--http-server net has two goroutines per stream of its own). Frames
// that grew past the quarter once doubled every open stream's stack unnoticed; this holds them.
func TestAnOpenStreamHoldsHalfAStack(t *testing.T) {
	const streams = 200
	cfg := func(role string) sim.Config {
		return sim.Config{Model: "m", Engine: sim.EngineVLLM, Role: role, KVConnector: sim.ConnectorNixl, DecodePerToken: 50 * time.Millisecond,
			MaxConcurrency: 1000, QueueSize: 1000}
	}
	regular, err := sim.Start(sim.Config{Model: "m", Engine: sim.EngineVLLM, DecodePerToken: 50 * time.Millisecond, MaxConcurrency: 1000, QueueSize: 1000})
	if err != nil {
		t.Fatal(err)
	}
	defer regular.Close()
	prefill, err := sim.Start(cfg(sim.RolePrefill))
	if err != nil {
		t.Fatal(err)
	}
	defer prefill.Close()
	decode, err := sim.Start(cfg(sim.RoleDecode))
	if err != nil {
		t.Fatal(err)
	}
	defer decode.Close()
	for name, args := range map[string][]string{
		"regular": {"--worker-urls", regular.URL()},
		"PD":      {"--pd-disaggregation", "--kv-connector", "NixlConnector", "--prefill", prefill.URL(), "--decode", decode.URL()},
	} {
		t.Run(name, func(t *testing.T) {
			api, metricsURL := startBatonMetrics(t, append([]string{"--http-server", "baton", "--enable-pprof", "--log-level", "error"}, args...)...)
			held := func() float64 {
				for range 2 { // the second collection frees what the first let sync pools keep
					if resp, err := http.Get(metricsURL + "/debug/pprof/heap?gc=1"); err == nil {
						io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
				}
				return metricValue(t, metricsURL, "go_memstats_stack_inuse_bytes")
			}
			idleStacks := held()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			body := `{"model":"m","prompt":"hello there","max_tokens":400,"ignore_eos":true,"stream":true}`
			var wg sync.WaitGroup
			var started atomic.Int64 // streams whose first event reached the client
			for range streams {
				wg.Go(func() {
					req, _ := http.NewRequestWithContext(ctx, http.MethodPost, api+"/v1/completions", strings.NewReader(body))
					req.Header.Set("Content-Type", "application/json")
					if resp, err := http.DefaultClient.Do(req); err == nil {
						if _, err := resp.Body.Read(make([]byte, 1)); err == nil {
							started.Add(1)
						}
						io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
				})
			}
			defer wg.Wait()
			defer cancel()
			// Every stream past its first event (a PD stream past its prefill leg, whose frames are
			// deeper), then waiting for the next: a count of Baton's goroutines is reached while slow
			// prefills are still under way on a loaded machine.
			deadline := time.Now().Add(30 * time.Second)
			for started.Load() < streams {
				if time.Now().After(deadline) {
					t.Fatalf("%d of %d streams started: the streams did not all open", started.Load(), streams)
				}
				time.Sleep(20 * time.Millisecond)
			}
			time.Sleep(200 * time.Millisecond)
			stacks := held()
			t.Logf("%.1f KiB of stack per open stream", (stacks-idleStacks)/streams/1024)
			if per := (stacks - idleStacks) / streams; per > 12<<10 {
				t.Errorf("%.1f KiB of stack per open stream (16 KiB: its frames use more than a quarter of it)", per/1024)
			}
		})
	}
}

// A PD stream whose decode engine goes silent after its first events is given up on after
// --stream-stall-timeout, in both PD styles: the client's connection is aborted (no [DONE]) within
// seconds, not at the request deadline, and baton_upstream_errors_total{kind="stalled"} names
// the decode worker.
func TestAStalledDecodeStreamIsGivenUp(t *testing.T) {
	for _, style := range []string{"vLLM NIXL", "SGLang"} {
		t.Run(style, func(t *testing.T) {
			engine, connector := sim.EngineVLLM, sim.ConnectorNixl
			if style == "SGLang" {
				engine, connector = sim.EngineSGLang, ""
			}
			prefill, err := sim.Start(sim.Config{Model: "m", Engine: engine, Role: sim.RolePrefill, KVConnector: connector})
			if err != nil {
				t.Fatal(err)
			}
			defer prefill.Close()
			decode, err := sim.Start(sim.Config{Model: "m", Engine: engine, Role: sim.RoleDecode, KVConnector: connector, Faults: sim.Faults{HangAfter: 2}})
			if err != nil {
				t.Fatal(err)
			}
			defer decode.Close()
			args := []string{"--pd-disaggregation", "--kv-connector", "NixlConnector", "--prefill", prefill.URL(), "--decode", decode.URL()}
			if style == "SGLang" {
				args = []string{"--pd-disaggregation", "--prefill", prefill.URL(), strconv.Itoa(prefill.BootstrapPort()), "--decode", decode.URL()}
			}
			api, metricsURL := startBatonMetrics(t, append(args, "--stream-stall-timeout", "500ms", "--request-timeout", "60s")...)
			b, err := gwtest.ReadStream(t, api+"/v1/completions", `{"model":"m","prompt":"hello there","max_tokens":50,"ignore_eos":true,"stream":true}`, 15*time.Second)
			if err == nil || strings.Contains(b, "[DONE]") {
				t.Errorf("want the stream aborted: %q, %v", b, err)
			}
			if got := metricValue(t, metricsURL, `baton_upstream_errors_total{kind="stalled",worker="`+decode.URL()+`"}`); got != 1 {
				t.Errorf("baton_upstream_errors_total{kind=\"stalled\"} of the decode worker: %v", got)
			}
		})
	}
}

// A collector that refuses every export is seen where an operator looks: the export failures
// and the spans lost are counted, the status page says it (the WARN: TestAFailingCollectorIsSeen) — with the
// collector's host, never its credentials.
func TestAFailingTraceCollectorIsSeen(t *testing.T) {
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		http.Error(w, "refused", http.StatusBadRequest)
	}))
	defer collector.Close()
	engine := openAIEngine(t)
	endpoint := strings.Replace(collector.URL, "http://", "http://tracer:hunter2@", 1)
	api, metricsURL := startBatonMetrics(t, "--worker-urls", engine.URL, "--otlp-traces-endpoint", endpoint)
	for range 3 {
		resp, err := http.Post(api+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x"}`))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	deadline := time.Now().Add(10 * time.Second) // the batch goes out within a second
	for metricValue(t, metricsURL, "baton_trace_export_failures_total") == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no failed export counted")
		}
		time.Sleep(50 * time.Millisecond)
	}
	resp, err := http.Get(metricsURL + "/status.json")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	host := strings.TrimPrefix(collector.URL, "http://")
	if !strings.Contains(string(body), "Trace export to "+host+" failing") || strings.Contains(string(body), "hunter2") {
		t.Errorf("status page: %s", body)
	}
	page, _ := http.Get(metricsURL + "/metrics")
	b, _ := io.ReadAll(page.Body)
	page.Body.Close()
	if !strings.Contains(string(b), `baton_trace_spans_lost_total{cause="export_failed"}`) {
		t.Error("no spans counted lost")
	}
}

// The soak's quick form: three minutes of a mixed workload (tenants over a real Redis, priority
// classes, an adapter, cache-aware routing on KV events, streams and hang-ups) through a regular,
// a PD vLLM, a PD SGLang and (with the Kubernetes binaries) a discovering Baton while engines are
// killed, answer 500s and hang mid-stream, the API server, Redis and the OTLP collector stop, the
// configuration is reloaded every 10 s and a burst goes far over capacity. The harness exits non-zero on any answer with another request's content,
// any request unanswered past its deadline, any connection closed without an answer, any status
// no fault explains, a refusal without Retry-After, tenants charged more than 1 % off the
// engines' own counters, or goroutines that do not come back after the load. On the API server
// the suite runs on (BATON_TEST_HTTP_SERVER).
func TestSoakQuick(t *testing.T) {
	args := []string{"bench", "--quick", "--scenarios", "soak"}
	if v := os.Getenv("BATON_TEST_HTTP_SERVER"); v != "" {
		args = append(args, "--baton-flags", "--http-server "+v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, binary, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("baton %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	wants := []string{"## 15. Soak", "| regular engine killed |", "| regular engine hangs mid-stream |", "| OTLP collector stopped |",
		"| burst far over capacity |", "**Every fault seen**", "**Tokens charged to tenants**", "Memory's slope", "Once the load ended"}
	if os.Getenv("BATON_REQUIRE_REDIS") != "" {
		wants = append(wants, "| Redis stopped |")
	}
	if os.Getenv("BATON_REQUIRE_K8S") != "" {
		wants = append(wants, "| Kubernetes API server restarted |")
	}
	for _, want := range wants {
		if !strings.Contains(string(out), want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

// The heap floor (--gc-heap-floor, 16 MiB by default) spares the collector: the next
// collection is due at the floor (go_memstats_next_gc_bytes), not at twice a live heap of a few
// MiB, and the same 3,000 requests run fewer collections; with 0 the percent stays the
// operator's.
func TestTheHeapFloorSparesCollections(t *testing.T) {
	eng := openAIEngine(t)
	run := func(args ...string) (cycles, percent, goal float64) {
		api, metrics := startBatonMetrics(t, append([]string{"--worker-urls", eng.URL, "--access-log=false"}, args...)...)
		c0 := metricValue(t, metrics, "go_gc_duration_seconds_count")
		body := `{"model":"m","prompt":"` + strings.Repeat("a few words ", 40) + `"}`
		for range 3000 {
			resp, err := http.Post(api+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
		}
		return metricValue(t, metrics, "go_gc_duration_seconds_count") - c0, metricValue(t, metrics, "go_gc_gogc_percent"), metricValue(t, metrics, "go_memstats_next_gc_bytes")
	}
	paced, pacedPercent, pacedGoal := run()
	plain, plainPercent, plainGoal := run("--gc-heap-floor", "0")
	t.Logf("3,000 requests: %.0f collections with the default floor (GOGC paced at %.0f, next at %.1f MiB), %.0f at GOGC alone (%.0f, next at %.1f MiB)",
		paced, pacedPercent, pacedGoal/(1<<20), plain, plainPercent, plainGoal/(1<<20))
	if plainPercent != 100 || plainGoal > 12<<20 {
		t.Fatalf("at GOGC alone: percent %.0f, next collection at %.0f bytes — the test cannot tell a floor from none", plainPercent, plainGoal)
	}
	if pacedPercent <= 100 || pacedGoal < 15<<20 || pacedGoal > 18<<20 {
		t.Errorf("with the default floor: percent %.0f, next collection at %.0f bytes, want about 16 MiB", pacedPercent, pacedGoal)
	}
	if paced >= plain {
		t.Errorf("with the default floor %.0f collections, at GOGC alone %.0f", paced, plain)
	}
}

// What Baton says at startup about the heap floor is what it does: paced, lowered under a
// memory limit (and whether the lowered floor is still above the runtime's own minimum), or not
// used when GOGC is the operator's or already reaches past it.
func TestTheHeapFloorIsSaidAsItIs(t *testing.T) {
	for _, c := range []struct{ env, want string }{
		{"", `msg="collector paced with a heap floor (--gc-heap-floor)" floor_bytes=16777216 gogc=100`},
		{"GOGC=off", `msg="gc-heap-floor not used: GOGC=off is the operator's"`},
		{"GOGC=0", `msg="gc-heap-floor not used: GOGC=0 is the operator's"`},
		{"GOGC=1000", `msg="gc-heap-floor not used: GOGC alone paces the collector past it" floor_bytes=16777216 gogc=1000`},
		{"GOMEMLIMIT=32MiB", `floor_bytes=8388608 limit_bytes=33554432 limit_from=GOMEMLIMIT used=true`},
		{"GOMEMLIMIT=8MiB", `floor_bytes=2097152 limit_bytes=8388608 limit_from=GOMEMLIMIT used=false`},
	} {
		t.Run(c.env, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, binary, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--worker-urls", "http://127.0.0.1:1")
			cmd.Env = append(os.Environ(), "GOGC=", "GOMEMLIMIT=")
			if c.env != "" {
				cmd.Env = append(cmd.Env, c.env)
			}
			out, _ := cmd.CombinedOutput() // ended by the context
			if !strings.Contains(string(out), c.want) {
				t.Errorf("startup with %q said:\n%s\nwant a line with %s", c.env, out, c.want)
			}
		})
	}
}
