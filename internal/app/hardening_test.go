package app

// Each test here performs an attack a single hostile client (or a broken worker) can make, and
// checks that Baton stays up, bounded and honest.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// anyModelEngine is an engine whose /v1/models lists nothing: it serves whatever model it is
// asked. Its /get_model_info names a model path (an engine's info route: it is one); other
// registration probes get 404; the runtime comes from the config.
func anyModelEngine(t *testing.T, handle http.HandlerFunc) string {
	return fakeEngine(t, "", nil, func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && r.URL.Path == "/get_model_info" {
			io.WriteString(w, `{"model_path":"/models/any"}`) // an engine, though its /v1/models lists nothing
			return
		}
		if r.Method == http.MethodGet && !strings.HasPrefix(r.URL.Path, "/health") {
			http.NotFound(w, r)
			return
		}
		handle(w, r)
	}).URL
}

// allocated returns the bytes allocated while f ran (all goroutines of the process).
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

func scrape(t *testing.T, g *Gateway) string {
	t.Helper()
	var b bytes.Buffer
	rec := &bodyRecorder{header: http.Header{}, buf: &b}
	req, _ := http.NewRequest(http.MethodGet, "/metrics", nil)
	g.Metrics.Handler().ServeHTTP(rec, req)
	return b.String()
}

type bodyRecorder struct {
	header http.Header
	buf    *bytes.Buffer
}

func (r *bodyRecorder) Header() http.Header         { return r.header }
func (r *bodyRecorder) Write(p []byte) (int, error) { return r.buf.Write(p) }
func (r *bodyRecorder) WriteHeader(int)             {}

// Item 1: an invalid UTF-8 model name reached a Prometheus label and panicked: in PD mode on the
// prefill leg's goroutine (the process died), in regular mode in the metrics defer.
func TestInvalidUTF8ModelCannotCrash(t *testing.T) {
	t.Parallel()
	ok := func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"x"}]}`)
	}
	regular := config.Default()
	regular.Workers = []config.Worker{{URL: anyModelEngine(t, ok), Runtime: config.RuntimeVLLM}}
	pd := config.Default()
	pd.PDDisaggregation = true
	pd.Retry.Disable = true
	pd.Workers = []config.Worker{
		{URL: anyModelEngine(t, ok), Role: config.RolePrefill, Runtime: config.RuntimeSGLang},
		{URL: anyModelEngine(t, ok), Role: config.RoleDecode, Runtime: config.RuntimeSGLang},
	}
	for name, cfg := range map[string]config.Config{"regular": regular, "pd": pd} {
		t.Run(name, func(t *testing.T) {
			g, gw := startGateway(t, cfg)
			for i := 0; i < 3; i++ {
				resp := post(t, gw.URL+"/v1/completions", "{\"model\":\"m\xff\",\"prompt\":\"hi\"}")
				if resp.StatusCode != 200 {
					t.Fatalf("status %d: %s", resp.StatusCode, readAll(t, resp.Body))
				}
			}
			m := scrape(t, g)
			if strings.Contains(m, "m\xff") || !strings.Contains(m, `model="unknown"`) {
				t.Errorf("the client's model name reached a label, or no request was counted as unknown")
			}
			if n := testutil.ToFloat64(g.Metrics.Panics.WithLabelValues("handler")); n != 0 {
				t.Errorf("%v panics", n)
			}
		})
	}
}

// Item 5: client model names are labels only when a worker lists them, so huge or many bogus
// names cannot grow /metrics nor push a real model into "other".
func TestModelLabelsAreBounded(t *testing.T) {
	t.Parallel()
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
	cfg := testConfig(up.URL)
	g, gw := startGateway(t, cfg)
	huge := strings.Repeat("x", 1<<20)
	for i := 0; i < 3; i++ {
		resp := post(t, gw.URL+"/v1/chat/completions", fmt.Sprintf(`{"model":"%s%d"}`, huge, i))
		resp.Body.Close()
	}
	for i := 0; i < 1100; i++ { // more than MaxModels
		resp := post(t, gw.URL+"/v1/chat/completions", fmt.Sprintf(`{"model":"bogus-%d"}`, i))
		resp.Body.Close()
	}
	resp := post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`)
	resp.Body.Close()
	m := scrape(t, g)
	if len(m) > 256<<10 {
		t.Errorf("/metrics is %d bytes after bogus model names", len(m))
	}
	if strings.Contains(m, "bogus-") || strings.Contains(m, "xxxx") {
		t.Error("a model no worker serves became a label")
	}
	want := `baton_requests_total{model="m",route="POST /v1/chat/completions",status="200"} 1`
	if !strings.Contains(m, want) {
		t.Errorf("metrics lack %s", want)
	}
	if !strings.Contains(m, `baton_requests_total{model="unknown",route="POST /v1/chat/completions",status="404"} 1100`) ||
		!strings.Contains(m, `baton_requests_total{model="none",route="POST /v1/chat/completions",status="400"} 3`) {
		t.Errorf("bogus names were not counted as unknown (names past 1,024 bytes are refused 400 invalid_model):\n%s", grepLines(m, "baton_requests_total"))
	}
}

// Item 2: "n" and prompt lists multiplied memory on the SGLang PD path (n=10,000,000 in 71 bytes
// built bootstrap arrays of gigabytes). Both are bounded, and refused past the bound.
func TestBatchSizeIsBounded(t *testing.T) {
	_, _, _, gw := sglangPD(t, sim.Config{}, sim.Config{})
	var resp *http.Response
	a := allocated(func() {
		resp = post(t, gw+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"n":10000000}`)
	})
	e := wantEnvelope(t, resp, 400, "batch_too_large")
	if e.Error.Param == nil || *e.Error.Param != "n" {
		t.Errorf("param %v, want n", e.Error.Param)
	}
	if a > 4<<20 {
		t.Errorf("refusing n=10000000 allocated %d bytes", a)
	}
	prompts := `"a"` + strings.Repeat(`,"a"`, 200000)
	a = allocated(func() {
		resp = post(t, gw+"/generate", `{"model":"m","text":[`+prompts+`]}`)
	})
	wantEnvelope(t, resp, 400, "batch_too_large")
	if body := int64(len(prompts)); int64(a) > 8*body+(4<<20) {
		t.Errorf("refusing a %d-byte prompt list allocated %d bytes", body, a)
	}
	// Within the bound the batch is served, with memory proportional to the request.
	ok := `"a"` + strings.Repeat(`,"a"`, 1023)
	resp, body := postTimeout(t, gw+"/generate", `{"model":"m","text":[`+ok+`],"sampling_params":{"max_new_tokens":1}}`)
	if resp.StatusCode != 200 {
		t.Fatalf("a batch of 1024 prompts: %d %s", resp.StatusCode, body[:min(len(body), 300)])
	}
	// Regular mode bounds n too: it is work the engines would do.
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
	_, rg := startGateway(t, testConfig(up.URL))
	wantEnvelope(t, post(t, rg.URL+"/v1/chat/completions", `{"model":"m","n":1025}`), 400, "batch_too_large")
}

// rawRequest opens a connection to the gateway and sends head (and body), leaving it open.
func rawRequest(t *testing.T, addr, head string, body []byte) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, head); err != nil {
		t.Fatal(err)
	}
	if len(body) > 0 {
		c.Write(body)
	}
	return c
}

// readStatus reads the status line of the answer on c.
func readStatus(t *testing.T, c net.Conn) string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(15 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	return strings.TrimSpace(line)
}

// Item 3: a Content-Length claim allocated its whole size before a byte arrived (16 sockets
// claiming 512 MB each reached 3.4 GB), and those requests held the drain forever.
func TestContentLengthIsNotAnAllocation(t *testing.T) {
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
	cfg := testConfig(up.URL)
	cfg.MaxPayloadSize, cfg.MaxBufferedBodyBytes = 512<<20, 8<<30 // the claims are within the limit
	g, gw := startGateway(t, cfg, stalledTimeout(300*time.Millisecond))
	addr := strings.TrimPrefix(gw.URL, "http://")
	var conns []net.Conn
	a := allocated(func() {
		for i := 0; i < 16; i++ {
			conns = append(conns, rawRequest(t, addr, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 536870000\r\n\r\n", []byte(`{"m`)))
		}
		poll.Until(t, "the condition", func() bool { return g.Server.InFlight() == 16 })
	})
	if a > 64<<20 {
		t.Errorf("16 requests claiming 512 MB each allocated %d MB before sending it", a>>20)
	}
	// They stall: each is dropped with 408 after the stalled-client timeout.
	for _, c := range conns {
		if got := readStatus(t, c); !strings.Contains(got, "408") {
			t.Errorf("stalled upload answered %q, want 408", got)
		}
	}
	poll.Until(t, "the condition", func() bool { return g.Server.InFlight() == 0 })
}

// Item 3: a SIGTERM drain waited on requests whose bodies never came. Bodies still arriving
// when the drain starts are cut with 503, and the drain ends with the work that was admitted.
func TestDrainCutsUnfinishedUploads(t *testing.T) {
	t.Parallel()
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
	api, _, stop, result := runBaton(t, "--worker-urls", up.URL, "--shutdown-grace-period-secs", "600", "--stalled-client-timeout-secs", "600",
		"--max-payload-size", "536870912", "--max-buffered-body-bytes", "8589934592")
	addr := strings.TrimPrefix(api, "http://")
	var conns []net.Conn
	for i := 0; i < 4; i++ {
		conns = append(conns, rawRequest(t, addr, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 536870000\r\n\r\n", []byte(`{"m`)))
	}
	time.Sleep(100 * time.Millisecond) // let the server start reading them
	stop()
	for _, c := range conns {
		if got := readStatus(t, c); !strings.Contains(got, "503") {
			t.Errorf("an upload cut by the drain answered %q, want 503", got)
		}
	}
	select {
	case err := <-result:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the drain is still waiting for bodies that will never come")
	}
}

// endless is an engine handler that streams SSE events until the client leaves.
func endless(w http.ResponseWriter, r *http.Request) {
	io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "text/event-stream")
	chunk := []byte("data: " + strings.Repeat("x", 32<<10) + "\n\n")
	for r.Context().Err() == nil {
		if _, err := w.Write(chunk); err != nil {
			return
		}
		w.(http.Flusher).Flush()
	}
}

// Item 4: clients that never read their stream pinned admission slots (and handlers blocked in
// Write) long after the request timeout; clients trickling a body held slots before sending it.
func TestStalledClientsReleaseTheirSlots(t *testing.T) {
	t.Parallel()
	var upstreamGone atomic.Int64
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "completions") && r.ContentLength > 20 {
			endless(w, r)
			upstreamGone.Add(1)
			return
		}
		io.ReadAll(r.Body)
		io.WriteString(w, "{}")
	})
	for _, tc := range []struct {
		name           string
		stall, timeout time.Duration
	}{
		// Long enough that the third request surely finds the slots taken on a loaded machine
		// (at 2 s, the README's whole test command on 2 cores let a deadline pass first).
		{"stalled-client timeout", 4 * time.Second, time.Hour},
		{"request deadline", time.Hour, 4 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(up.URL)
			cfg.Admission.MaxConcurrentRequests, cfg.Admission.QueueSize = 2, 0
			g, gw := startGateway(t, cfg, stalledTimeout(tc.stall), requestTimeout(tc.timeout))
			addr := strings.TrimPrefix(gw.URL, "http://")
			body := `{"model":"m","stream":true,"padding":"xxxxxxxx"}`
			for i := 0; i < 2; i++ { // they send a request and never read a byte of the answer
				rawRequest(t, addr, fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(body), body), nil)
			}
			// Both hold their slot once their request reached the engine (the server's count
			// includes requests still being read, before admission: a third could overtake them).
			poll.Until(t, "both stalled requests reached the engine", func() bool { return g.Registry.Snapshot().Workers[0].InFlight() == 2 })
			resp := post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`)
			wantEnvelope(t, resp, 503, "queue_full") // the slots are taken, for now
			poll.Until(t, "the condition", func() bool { return g.Server.InFlight() == 0 && g.Registry.Snapshot().Workers[0].InFlight() == 0 })
			// A fresh connection each time: the check is about the slots. It is asked until it
			// is admitted: with a request deadline of 1 s, a CI machine stalled for a second under
			// the race detector times the check request itself out (504, or under net/http's
			// server an EOF when the deadline cut a response whose head was still buffered).
			// Slots that were never given back keep answering 503 queue_full, and fail here.
			fresh := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
			poll.Until(t, "a request admitted after the stalled clients were dropped", func() bool {
				resp, err := fresh.Post(gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m"}`))
				if err != nil {
					return false
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				return resp.StatusCode == 200
			})
		})
	}
	t.Run("trickled body", func(t *testing.T) {
		cfg := testConfig(up.URL)
		cfg.Admission.MaxConcurrentRequests, cfg.Admission.QueueSize = 2, 0
		g, gw := startGateway(t, cfg)
		addr := strings.TrimPrefix(gw.URL, "http://")
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for i := 0; i < 2; i++ {
			c := rawRequest(t, addr, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n", []byte("{"))
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					case <-time.After(200 * time.Millisecond):
						c.Write([]byte(" "))
					}
				}
			})
		}
		poll.Until(t, "the condition", func() bool { return g.Server.InFlight() == 2 })
		resp := post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`)
		close(stop)
		wg.Wait()
		if resp.StatusCode != 200 {
			t.Fatalf("while two clients trickle their bodies: %d, want 200 (no slot is held before the body is read)", resp.StatusCode)
		}
	})
}

// Item 6: a decode that sends an endless body on a rewrite path (usage fix, SSE event without a
// terminator) grew Baton without bound. Past the bound the request fails as for any upstream
// failure.
func TestRewriteBuffersAreBounded(t *testing.T) {
	t.Parallel()
	prefill := anyModelEngine(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"x"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[1]}}`)
	})
	huge := func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		stream := strings.Contains(r.Header.Get("X-Test"), "stream")
		if stream {
			w.Header().Set("Content-Type", "text/event-stream")
			io.WriteString(w, "data: ")
		} else {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"usage":{"prompt_tokens":3},"pad":"`)
		}
		chunk := bytes.Repeat([]byte("x"), 1<<20)
		for i := 0; i < 80 && r.Context().Err() == nil; i++ { // 80 MiB: past both bounds
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
		if !stream {
			io.WriteString(w, `"}`)
		}
	}
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Retry.Disable = true
	cfg.Workers = []config.Worker{
		{URL: prefill, Role: config.RolePrefill, Runtime: config.RuntimeVLLM, KVConnector: "NixlConnector"},
		{URL: anyModelEngine(t, huge), Role: config.RoleDecode, Runtime: config.RuntimeVLLM},
	}
	_, gw := startGateway(t, cfg)
	for _, kind := range []string{"body", "stream"} {
		t.Run(kind, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"hi"}`))
			req.Header.Set("X-Test", kind)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			e := wantEnvelope(t, resp, 502, "decode_upstream_unreachable")
			if !strings.Contains(e.Error.Message, "MiB") {
				t.Errorf("message %q does not say the bound", e.Error.Message)
			}
		})
	}
}

// Item 7: credentials in a worker URL showed in headers, GET /workers, metrics and logs. They
// are refused at startup, with where they go instead, and the message does not repeat them.
func TestCredentialsInWorkerURLAreRefused(t *testing.T) {
	t.Parallel()
	var out, errOut bytes.Buffer
	err := Run(t.Context(), []string{"--worker-urls", "http://admin:hunter2@127.0.0.1:1"}, &out, &errOut)
	if err == nil {
		t.Fatal("a worker URL with credentials was accepted")
	}
	for _, text := range []string{err.Error(), out.String(), errOut.String()} {
		if strings.Contains(text, "hunter2") {
			t.Errorf("the password leaked: %s", text)
		}
	}
	if !strings.Contains(err.Error(), "api_key") {
		t.Errorf("error %q does not say where credentials go", err)
	}
}

// Item 8: requests that time out only because they are long opened a streaming worker's
// circuit. A worker producing bytes has not failed.
func TestLongRequestsDoNotOpenTheBreaker(t *testing.T) {
	t.Parallel()
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for r.Context().Err() == nil {
			io.WriteString(w, "data: {\"t\":\"x\"}\n\n")
			w.(http.Flusher).Flush()
			time.Sleep(50 * time.Millisecond)
		}
	})
	cfg := testConfig(up.URL)
	cfg.CircuitBreaker.FailureThreshold = 2
	g, gw := startGateway(t, cfg, requestTimeout(300*time.Millisecond))
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Go(func() {
			resp, err := http.Post(gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","stream":true,"max_tokens":100000}`))
			if err == nil {
				io.Copy(io.Discard, resp.Body) // ends broken at the deadline
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	w := g.Registry.Snapshot().Workers[0]
	if w.BreakerState() != worker.BreakerClosed || !w.Available() {
		t.Fatalf("breaker %d after long requests hit the deadline: a streaming worker has not failed", w.BreakerState())
	}
	if _, failed := w.Outcomes(); failed != 0 {
		t.Errorf("%d failures counted against a worker that kept streaming", failed)
	}
}

// Item 9: a hanging upstream was reported as 502 upstream_unreachable ("request deadline
// exceeded") with retries off, and counted as a transport error with retries on. It is a 504
// upstream_timeout on every path, PD legs included.
func TestTimeoutsAre504Everywhere(t *testing.T) {
	t.Parallel()
	shortDeadline := requestTimeout(300 * time.Millisecond)
	noRetries := func(c *config.Config) { c.Retry.Disable = true }
	t.Run("regular, retries off", func(t *testing.T) {
		t.Parallel()
		_, g, gw := simFleet(t, []sim.Config{{Faults: sim.Faults{Hang: true}}}, shortDeadline, noRetries)
		resp, body := postTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"hello?"}`)
		if resp.StatusCode != 504 || !strings.Contains(body, `"upstream_timeout"`) {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		if n := testutil.ToFloat64(g.Metrics.UpstreamErrors.WithLabelValues(g.Registry.Snapshot().Workers[0].URL, "timeout")); n != 1 {
			t.Errorf("timeout errors counted %v, want 1", n)
		}
	})
	t.Run("regular, retries on", func(t *testing.T) {
		t.Parallel()
		_, g, gw := simFleet(t, []sim.Config{{Faults: sim.Faults{Hang: true}}}, shortDeadline)
		resp, body := postTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"hello?"}`)
		if resp.StatusCode != 504 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		u := g.Registry.Snapshot().Workers[0].URL
		if n := testutil.ToFloat64(g.Metrics.UpstreamErrors.WithLabelValues(u, "transport")); n != 0 {
			t.Errorf("a timeout was counted as %v transport errors", n)
		}
	})
	for _, leg := range []string{"prefill", "decode"} {
		hang := sim.Config{Faults: sim.Faults{Hang: true}}
		pc, dc := hang, sim.Config{}
		if leg == "decode" {
			pc, dc = sim.Config{}, hang
		}
		t.Run("sglang "+leg, func(t *testing.T) {
			t.Parallel()
			_, _, _, gw := sglangPD(t, pc, dc, shortDeadline)
			resp, body := postTimeout(t, gw+"/generate", `{"model":"m","text":"hello?"}`)
			if resp.StatusCode != 504 || !strings.Contains(body, "upstream_timeout") {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
		})
		t.Run("vllm "+leg, func(t *testing.T) {
			t.Parallel()
			_, _, _, gw := vllmPD(t, "NixlConnector", pc, dc, shortDeadline)
			resp, body := postTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"hello?"}`)
			if resp.StatusCode != 504 || !strings.Contains(body, leg+"_upstream_timeout") {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
		})
	}
}

// Item 10: /health_generate costs engine work: it is behind the API key and admission, and the
// caller's Authorization does not reach the engines.
func TestHealthGenerateIsGuarded(t *testing.T) {
	t.Parallel()
	var sawAuth atomic.Value
	sawAuth.Store("")
	var release = make(chan struct{})
	h := func(w http.ResponseWriter, r *http.Request) {
		if a := r.Header.Get("Authorization"); a != "" {
			sawAuth.Store(a)
		}
		if r.URL.Path == "/generate" {
			io.ReadAll(r.Body)
			<-release
		}
		io.WriteString(w, "{}")
	}
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.ClientAPIKey = "gateway-key"
	cfg.Admission.MaxConcurrentRequests, cfg.Admission.QueueSize = 1, 0
	cfg.Workers = []config.Worker{
		{URL: anyModelEngine(t, h), Role: config.RolePrefill, Runtime: config.RuntimeSGLang},
		{URL: anyModelEngine(t, h), Role: config.RoleDecode, Runtime: config.RuntimeSGLang},
	}
	_, gw := startGateway(t, cfg)
	get := func(auth string) *http.Response {
		req, _ := http.NewRequest(http.MethodGet, gw.URL+"/health_generate", nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		return resp
	}
	wantEnvelope(t, get(""), 401, "invalid_api_key")
	if resp := get("Bearer gateway-key"); resp.StatusCode != 200 {
		t.Fatalf("with the key: %d", resp.StatusCode)
	}
	if a := sawAuth.Load(); a != "" {
		t.Errorf("an engine saw Authorization %q", a)
	}
	// A generation holds the only slot: /health_generate waits its turn like any inference.
	go func() {
		req, _ := http.NewRequest(http.MethodPost, gw.URL+"/generate", strings.NewReader(`{"text":"hold"}`))
		req.Header.Set("Authorization", "Bearer gateway-key")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	time.Sleep(100 * time.Millisecond)
	defer close(release)
	wantEnvelope(t, get("Bearer gateway-key"), 503, "queue_full")
}

// Items 11 and 12: what a client sends is bounded and Baton's own headers are Baton's.
func TestClientHeadersAreBounded(t *testing.T) {
	t.Parallel()
	type seen struct {
		auth, rid []string
		query     string
	}
	got := make(chan seen, 10)
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		got <- seen{r.Header.Values("Authorization"), r.Header.Values("X-Request-Id"), r.URL.RawQuery}
		io.WriteString(w, "{}")
	})
	_, gw := startGateway(t, testConfig(up.URL))
	send := func(path string, hdr http.Header) *http.Response {
		req, _ := http.NewRequest(http.MethodPost, gw.URL+path, strings.NewReader(`{"model":"m"}`))
		for k, vs := range hdr {
			req.Header[k] = vs
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		return resp
	}
	wantEnvelope(t, send("/v1/chat/completions", http.Header{"Authorization": {"Bearer a", "Bearer b"}}), 400, "duplicate_header")

	long := strings.Repeat("r", 4096)
	resp := send("/v1/chat/completions?debug=1", http.Header{"X-Request-Id": {long}})
	s := <-got
	if rid := resp.Header.Get("X-Request-Id"); rid == long || len(rid) > 128 || len(s.rid) != 1 || s.rid[0] != rid {
		t.Errorf("oversize request id: answered %q, worker saw %q", rid, s.rid)
	}
	if s.query != "" {
		t.Errorf("the query string reached the worker: %q", s.query)
	}
	resp = send("/v1/chat/completions", http.Header{"X-Request-Id": {"one", "two"}})
	s = <-got
	if rid := resp.Header.Get("X-Request-Id"); rid == "one" || len(s.rid) != 1 || s.rid[0] != rid {
		t.Errorf("duplicate request ids: answered %q, worker saw %q", rid, s.rid)
	}
	resp = send("/v1/chat/completions", http.Header{"X-Request-Id": {"mine-1"}})
	if s = <-got; resp.Header.Get("X-Request-Id") != "mine-1" || len(s.rid) != 1 || s.rid[0] != "mine-1" {
		t.Errorf("a valid request id was not kept: %q", s.rid)
	}
}

// Item 12: a retryable error body over the hold limit was relayed cut short as if complete;
// megabytes of upstream headers were relayed.
func TestUpstreamErrorAndHeaderBounds(t *testing.T) {
	t.Parallel()
	big := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.WriteHeader(503)
		w.Write(bytes.Repeat([]byte("e"), 2<<20))
	})
	cfg := testConfig(big.URL)
	cfg.Retry.Disable = true
	_, gw := startGateway(t, cfg)
	wantEnvelope(t, post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`), 503, "upstream_error_too_large")

	headers := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		for i := 0; i < 64; i++ {
			w.Header().Set(fmt.Sprintf("X-Pad-%d", i), strings.Repeat("h", 4096))
		}
		io.WriteString(w, "{}")
	})
	cfg = testConfig(headers.URL)
	cfg.Retry.Disable = true
	_, gw = startGateway(t, cfg)
	e := wantEnvelope(t, post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`), 502, "upstream_unreachable")
	if !strings.Contains(e.Error.Message, "header") {
		t.Errorf("message %q does not say what was wrong", e.Error.Message)
	}
}

// Item 12: routed_dp_rank and disagg_prefill_dp_rank (and the deprecated data_parallel_rank)
// are Baton's on PD legs; a client's values never reach the engines.
func TestClientDPRankFieldsDoNotReachLegs(t *testing.T) {
	t.Parallel()
	bodies := make(chan string, 4)
	h := func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.Method == http.MethodPost {
			bodies <- string(b)
		}
		io.WriteString(w, `{"text":"x"}`)
	}
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Workers = []config.Worker{
		{URL: anyModelEngine(t, h), Role: config.RolePrefill, Runtime: config.RuntimeSGLang},
		{URL: anyModelEngine(t, h), Role: config.RoleDecode, Runtime: config.RuntimeSGLang},
	}
	_, gw := startGateway(t, cfg)
	resp := post(t, gw.URL+"/generate", `{"text":"hi","routed_dp_rank":7,"disagg_prefill_dp_rank":5,"data_parallel_rank":3}`)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	for i := 0; i < 2; i++ {
		b := <-bodies
		for _, k := range []string{"routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank"} {
			if strings.Contains(b, k) {
				t.Errorf("a leg got the client's %s: %s", k, b)
			}
		}
	}
}

// Item 13: a fleet that can serve nothing is said at startup. (The commands' help, version and
// bench scenarios are tested in package cli.)
func TestStartupWarnings(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  func(*config.Config)
		want string
	}{
		{func(c *config.Config) {}, "no workers are configured"},
		{func(c *config.Config) {
			c.PDDisaggregation = true
			c.Workers = []config.Worker{{URL: "http://127.0.0.1:1", Role: config.RoleDecode}}
		}, "no prefill worker"},
		{func(c *config.Config) {
			c.PDDisaggregation = true
			c.Workers = []config.Worker{{URL: "http://127.0.0.1:1", Role: config.RolePrefill}}
		}, "no decode worker"},
	} {
		cfg := config.Default()
		tc.cfg(&cfg)
		if w := strings.Join(cfg.Warnings(), "\n"); !strings.Contains(w, tc.want) {
			t.Errorf("warnings %q lack %q", w, tc.want)
		}
	}
	logs := &syncBuffer{}
	ctx, cancel := context.WithCancel(t.Context())
	res := make(chan error, 1)
	go func() {
		res <- Run(ctx, []string{"--port", "0", "--metrics-port", "-1", "--host", "127.0.0.1"}, io.Discard, logs)
	}()
	poll.Until(t, "the condition", func() bool { return strings.Contains(logs.String(), "baton started") })
	cancel()
	if err := <-res; err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "no workers are configured") {
		t.Errorf("a gateway with no workers started without a warning:\n%s", logs.String())
	}
}
