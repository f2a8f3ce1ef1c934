package server

// Each test here performs an attack a single hostile client (or a broken worker) can make on the
// HTTP door, and checks that Baton stays up, bounded and honest. (Attacks that need the whole
// gateway's wiring — the configuration, Baton's own HTTP/1.1 server, both API servers compared,
// the upstream clients compared, the admin listener, pprof — stay in package app.)

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
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
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// running runs s's background work (the sweeper of stalled bodies, the director's) until the
// test ends.
func running(t *testing.T, s *Server) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s.Start(ctx)
	t.Cleanup(func() { cancel(); s.Wait() })
}

// pdFleet makes the gateway's fleet a prefill p and a decode d (registered and ready, as the
// registrar leaves workers whose engines answered), its PD requests dispatched as Baton
// dispatches them. Workers that name no models serve whatever model they are asked.
func pdFleet(t *testing.T, p, d config.Worker) func(*Options) {
	p.Role, d.Role = config.RolePrefill, config.RoleDecode
	return pdFleetOf(t, config.PolicyRoundRobin, config.PolicyRoundRobin, p, d)
}

// pdFleetOf makes the gateway's fleet the workers ws (each with its role), prefills chosen by
// prefillPolicy and decodes by decodePolicy, pairs within a connector and a runtime as Baton
// pairs them.
func pdFleetOf(t *testing.T, prefillPolicy, decodePolicy string, ws ...config.Worker) func(*Options) {
	return func(o *Options) {
		for _, w := range ws {
			serving(t, o, w)
		}
		o.Director.Selector.Policies = map[string]policy.Policy{config.RolePrefill: policyOf(t, prefillPolicy), config.RoleDecode: policyOf(t, decodePolicy)}
		o.Director.Selector.Compatible = func(p, d *worker.Worker) bool { return pd.Compatible(p, d, "") }
		par := &pd.Parallel{Proxy: o.Proxy, Metrics: o.Director.Metrics, Log: o.Director.Log}
		o.Director.PD, o.Dispatcher = true, &pd.Dispatcher{Parallel: par,
			Sequential: &pd.Sequential{Proxy: o.Proxy, Metrics: o.Director.Metrics, Log: o.Director.Log, Concurrent: par}}
	}
}

// policyOf is the routing policy name, with the configuration's defaults.
func policyOf(t *testing.T, name string) policy.Policy {
	t.Helper()
	p, err := policy.New(name, config.Default())
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// noRetries turns retries off: these cases look at one attempt.
func noRetries(o *Options) { o.Director.Retry.Disable = true }

// pdSim starts a simulated engine for c serving m whose SGLang legs wait long for a partner: a
// case passes only if Baton cancels them, not the engine's own timeout.
func pdSim(t *testing.T, c sim.Config) *sim.Engine {
	t.Helper()
	c.Model = "m"
	c.BootstrapTimeout = 30 * time.Second
	return startSim(t, c)
}

// sglangSimPair is a PD fleet over a simulated SGLang prefill (pc) and decode (dc).
func sglangSimPair(t *testing.T, pc, dc sim.Config) func(*Options) {
	pc.Engine, pc.Role = sim.EngineSGLang, sim.RolePrefill
	dc.Engine, dc.Role = sim.EngineSGLang, sim.RoleDecode
	p, d := pdSim(t, pc), pdSim(t, dc)
	port := p.BootstrapPort()
	return pdFleet(t, config.Worker{URL: p.URL(), Runtime: config.RuntimeSGLang, BootstrapPort: &port, Models: []string{"m"}},
		config.Worker{URL: d.URL(), Runtime: config.RuntimeSGLang, Models: []string{"m"}})
}

// vllmSimPair is a PD fleet over a simulated vLLM prefill (pc) and decode (dc) handing off
// through NIXL.
func vllmSimPair(t *testing.T, pc, dc sim.Config) func(*Options) {
	pc.Engine, pc.Role, pc.KVConnector, pc.EngineID = sim.EngineVLLM, sim.RolePrefill, sim.ConnectorNixl, "engine-p"
	dc.Engine, dc.Role, dc.KVConnector = sim.EngineVLLM, sim.RoleDecode, sim.ConnectorNixl
	p, d := pdSim(t, pc), pdSim(t, dc)
	pw := config.Worker{URL: p.URL(), Runtime: config.RuntimeVLLM, KVConnector: "NixlConnector", KVEngineID: pc.EngineID, Models: []string{"m"}}
	if bp := p.BootstrapPort(); bp != 0 {
		pw.BootstrapPort = &bp
	}
	return pdFleet(t, pw, config.Worker{URL: d.URL(), Runtime: config.RuntimeVLLM, Models: []string{"m"}})
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

// rawRequest opens a connection to the gateway at url and sends head (and body), leaving it
// open.
func rawRequest(t *testing.T, url, head string, body []byte) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
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

// refusal decodes a gateway-minted OpenAI error, failing the test unless it has status and code
// (and a message and type).
type refusal struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Code    string  `json:"code"`
		Param   *string `json:"param"`
	} `json:"error"`
}

func wantRefusal(t *testing.T, resp *http.Response, body string, status int, code string) refusal {
	t.Helper()
	if resp.StatusCode != status {
		t.Fatalf("status = %d, want %d (body %.300s)", resp.StatusCode, status, body)
	}
	var e refusal
	if err := json.Unmarshal([]byte(body), &e); err != nil {
		t.Fatalf("body %q is not an error envelope: %v", body, err)
	}
	if e.Error.Code != code || e.Error.Message == "" || e.Error.Type == "" {
		t.Fatalf("envelope = %+v, want code %q with message and type", e, code)
	}
	return e
}

// linesWith returns the lines of text that contain sub.
func linesWith(text, sub string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// An invalid UTF-8 model name reached a Prometheus label and panicked: in PD mode on the
// prefill leg's goroutine (the process died), in regular mode in the metrics defer.
func TestInvalidUTF8ModelCannotCrash(t *testing.T) {
	ok := func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"x"}]}`)
	}
	for name, fleet := range map[string]func(t *testing.T) []func(*Options){
		"regular": func(t *testing.T) []func(*Options) {
			// An engine listing no model: it serves whatever model it is asked.
			return []func(*Options){func(o *Options) { serving(t, o, config.Worker{URL: engine(t, ok), Runtime: config.RuntimeVLLM}) }}
		},
		"pd": func(t *testing.T) []func(*Options) {
			return []func(*Options){noRetries, pdFleet(t, config.Worker{URL: engine(t, ok), Runtime: config.RuntimeSGLang},
				config.Worker{URL: engine(t, ok), Runtime: config.RuntimeSGLang})}
		},
	} {
		t.Run(name, func(t *testing.T) {
			s, gw, _ := gateway(t, nil, fleet(t)...)
			for i := 0; i < 3; i++ {
				resp, body := post(t, gw+"/v1/completions", "{\"model\":\"m\xff\",\"prompt\":\"hi\"}")
				if resp.StatusCode != 200 {
					t.Fatalf("status %d: %s", resp.StatusCode, body)
				}
			}
			m := scrape(t, s)
			if strings.Contains(m, "m\xff") || !strings.Contains(m, `model="unknown"`) {
				t.Errorf("the client's model name reached a label, or no request was counted as unknown")
			}
			if n := testutil.ToFloat64(s.metrics.Panics.WithLabelValues("handler")); n != 0 {
				t.Errorf("%v panics", n)
			}
		})
	}
}

// Client model names are labels only when a worker lists them, so huge or many bogus names
// cannot grow /metrics nor push a real model into "other".
func TestModelLabelsAreBounded(t *testing.T) {
	up := engine(t, func(w http.ResponseWriter, r *http.Request) { io.ReadAll(r.Body); io.WriteString(w, "{}") })
	s, gw, _ := gateway(t, []string{up}, func(o *Options) { o.MaxPayloadSize = config.Default().MaxPayloadSize })
	huge := strings.Repeat("x", 1<<20)
	for i := 0; i < 3; i++ {
		post(t, gw+"/v1/chat/completions", fmt.Sprintf(`{"model":"%s%d"}`, huge, i))
	}
	for i := 0; i < 1100; i++ { // more than MaxModels
		post(t, gw+"/v1/chat/completions", fmt.Sprintf(`{"model":"bogus-%d"}`, i))
	}
	post(t, gw+"/v1/chat/completions", `{"model":"m"}`)
	m := scrape(t, s)
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
		t.Errorf("bogus names were not counted as unknown (names past 1,024 bytes are refused 400 invalid_model):\n%s", linesWith(m, "baton_requests_total"))
	}
}

// "n" and prompt lists multiplied memory on the SGLang PD path (n=10,000,000 in 71 bytes built
// bootstrap arrays of gigabytes). Both are bounded, and refused past the bound.
func TestBatchSizeIsBounded(t *testing.T) {
	// Not parallel: it measures the process's allocations.
	defaults := func(o *Options) {
		o.Director.MaxBatchSize, o.MaxPayloadSize = config.Default().MaxBatchSize, config.Default().MaxPayloadSize
	}
	_, gw, _ := gateway(t, nil, defaults, noRetries, sglangSimPair(t, sim.Config{}, sim.Config{}))
	var resp *http.Response
	var body string
	a := allocated(func() {
		resp, body = post(t, gw+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"n":10000000}`)
	})
	e := wantRefusal(t, resp, body, 400, "batch_too_large")
	if e.Error.Param == nil || *e.Error.Param != "n" {
		t.Errorf("param %v, want n", e.Error.Param)
	}
	if a > 4<<20 {
		t.Errorf("refusing n=10000000 allocated %d bytes", a)
	}
	prompts := `"a"` + strings.Repeat(`,"a"`, 200000)
	a = allocated(func() {
		resp, body = post(t, gw+"/generate", `{"model":"m","text":[`+prompts+`]}`)
	})
	wantRefusal(t, resp, body, 400, "batch_too_large")
	if size := int64(len(prompts)); int64(a) > 8*size+(4<<20) {
		t.Errorf("refusing a %d-byte prompt list allocated %d bytes", size, a)
	}
	// Within the bound the batch is served, with memory proportional to the request.
	ok := `"a"` + strings.Repeat(`,"a"`, 1023)
	resp, body = post(t, gw+"/generate", `{"model":"m","text":[`+ok+`],"sampling_params":{"max_new_tokens":1}}`)
	if resp.StatusCode != 200 {
		t.Fatalf("a batch of 1024 prompts: %d %s", resp.StatusCode, body[:min(len(body), 300)])
	}
	// Regular mode bounds n too: it is work the engines would do.
	up := engine(t, func(w http.ResponseWriter, r *http.Request) { io.ReadAll(r.Body); io.WriteString(w, "{}") })
	_, rg, _ := gateway(t, []string{up}, defaults)
	resp, body = post(t, rg+"/v1/chat/completions", `{"model":"m","n":1025}`)
	wantRefusal(t, resp, body, 400, "batch_too_large")
}

// A Content-Length claim allocated its whole size before a byte arrived (16 sockets claiming
// 512 MB each reached 3.4 GB), and those requests held the drain forever.
func TestContentLengthIsNotAnAllocation(t *testing.T) {
	up := engine(t, func(w http.ResponseWriter, r *http.Request) { io.ReadAll(r.Body); io.WriteString(w, "{}") })
	s, gw, _ := gateway(t, []string{up}, func(o *Options) {
		o.MaxPayloadSize, o.MaxBufferedBodyBytes = 512<<20, 8<<30 // the claims are within the limit
		o.StalledClientTimeout = 300 * time.Millisecond
	})
	running(t, s)
	var conns []net.Conn
	a := allocated(func() {
		for i := 0; i < 16; i++ {
			conns = append(conns, rawRequest(t, gw, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 536870000\r\n\r\n", []byte(`{"m`)))
		}
		poll.Until(t, "16 uploads in flight", func() bool { return s.InFlight() == 16 })
	})
	if a > 64<<20 {
		t.Errorf("16 requests claiming 512 MB each allocated %d MB before sending it", a>>20)
	}
	// They stall: each is dropped with 408 after the stalled-client timeout.
	for _, c := range conns {
		if got := gwtest.ReadStatus(t, c); !strings.Contains(got, "408") {
			t.Errorf("stalled upload answered %q, want 408", got)
		}
	}
	poll.Until(t, "no request in flight", func() bool { return s.InFlight() == 0 })
}

// A drain waited on requests whose bodies never came. Bodies still arriving when the drain
// starts are cut with 503, and the drain — which waits for the requests in flight — ends with
// the work that was admitted. (That a SIGTERM starts it and Run returns after it is app's.)
func TestDrainCutsUnfinishedUploads(t *testing.T) {
	up := engine(t, func(w http.ResponseWriter, r *http.Request) { io.ReadAll(r.Body); io.WriteString(w, "{}") })
	s, gw, _ := gateway(t, []string{up}, func(o *Options) {
		o.MaxPayloadSize, o.MaxBufferedBodyBytes = 512<<20, 8<<30
		o.StalledClientTimeout = 600 * time.Second
	})
	var conns []net.Conn
	for i := 0; i < 4; i++ {
		conns = append(conns, rawRequest(t, gw, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 536870000\r\n\r\n", []byte(`{"m`)))
	}
	poll.Until(t, "the server reading the four uploads", func() bool { return s.InFlight() == 4 })
	s.SetDraining()
	for _, c := range conns {
		if got := gwtest.ReadStatus(t, c); !strings.Contains(got, "503") {
			t.Errorf("an upload cut by the drain answered %q, want 503", got)
		}
	}
	poll.Until(t, "the drain's requests in flight to end (it waits for bodies that will never come)", func() bool { return s.InFlight() == 0 })
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

// Clients that never read their stream pinned admission slots (and handlers blocked in Write)
// long after the request timeout; clients trickling a body held slots before sending it.
func TestStalledClientsReleaseTheirSlots(t *testing.T) {
	up := engine(t, func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "completions") && r.ContentLength > 20 {
			endless(w, r)
			return
		}
		io.ReadAll(r.Body)
		io.WriteString(w, "{}")
	})
	twoSlots := func(o *Options) {
		o.Director.Admission = config.Default().Admission
		o.Director.Admission.MaxConcurrentRequests, o.Director.Admission.QueueSize = 2, 0
	}
	for _, tc := range []struct {
		name           string
		stall, timeout time.Duration
	}{
		// Long enough that the third request surely finds the slots taken on a loaded machine
		// (at 2 s, a whole test run on 2 cores let a deadline pass first).
		{"stalled-client timeout", 4 * time.Second, time.Hour},
		{"request deadline", time.Hour, 4 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s, gw, ws := gateway(t, []string{up}, twoSlots, func(o *Options) {
				o.StalledClientTimeout, o.RequestTimeout, o.Proxy.Timeout = tc.stall, tc.timeout, tc.timeout
			})
			running(t, s)
			body := `{"model":"m","stream":true,"padding":"xxxxxxxx"}`
			for i := 0; i < 2; i++ { // they send a request and never read a byte of the answer
				rawRequest(t, gw, fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(body), body), nil)
			}
			// Both hold their slot once their request reached the engine (the server's count
			// includes requests still being read, before admission: a third could overtake them).
			poll.Until(t, "both stalled requests reached the engine", func() bool { return ws[0].InFlight() == 2 })
			resp, b := post(t, gw+"/v1/chat/completions", `{"model":"m"}`)
			wantRefusal(t, resp, b, 503, "queue_full") // the slots are taken, for now
			poll.Until(t, "the stalled clients dropped", func() bool { return s.InFlight() == 0 && ws[0].InFlight() == 0 })
			// A fresh connection each time: the check is about the slots. It is asked until it
			// is admitted: a machine stalled under the race detector may time the check request
			// itself out. Slots that were never given back keep answering 503 queue_full, and
			// fail here.
			fresh := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
			poll.Until(t, "a request admitted after the stalled clients were dropped", func() bool {
				resp, err := fresh.Post(gw+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m"}`))
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
		t.Parallel()
		s, gw, _ := gateway(t, []string{up}, twoSlots)
		running(t, s)
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for i := 0; i < 2; i++ {
			c := rawRequest(t, gw, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n", []byte("{"))
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
		poll.Until(t, "two bodies being trickled", func() bool { return s.InFlight() == 2 })
		resp, _ := post(t, gw+"/v1/chat/completions", `{"model":"m"}`)
		close(stop)
		wg.Wait()
		if resp.StatusCode != 200 {
			t.Fatalf("while two clients trickle their bodies: %d, want 200 (no slot is held before the body is read)", resp.StatusCode)
		}
	})
}

// A decode that sends an endless body on a rewrite path (usage fix, SSE event without a
// terminator) grew Baton without bound. Past the bound the request fails as for any upstream
// failure.
func TestRewriteBuffersAreBounded(t *testing.T) {
	prefill := engine(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"x"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[1]}}`)
	})
	huge := engine(t, func(w http.ResponseWriter, r *http.Request) {
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
	})
	_, gw, _ := gateway(t, nil, noRetries, pdFleet(t,
		config.Worker{URL: prefill, Runtime: config.RuntimeVLLM, KVConnector: "NixlConnector"},
		config.Worker{URL: huge, Runtime: config.RuntimeVLLM}))
	for _, kind := range []string{"body", "stream"} {
		t.Run(kind, func(t *testing.T) {
			resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"hi"}`, "X-Test", kind)
			e := wantRefusal(t, resp, body, 502, "decode_upstream_unreachable")
			if !strings.Contains(e.Error.Message, "MiB") {
				t.Errorf("message %q does not say the bound", e.Error.Message)
			}
		})
	}
}

// Requests that time out only because they are long opened a streaming worker's circuit. A
// worker producing bytes has not failed.
func TestLongRequestsDoNotOpenTheBreaker(t *testing.T) {
	up := engine(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for r.Context().Err() == nil {
			io.WriteString(w, "data: {\"t\":\"x\"}\n\n")
			w.(http.Flusher).Flush()
			time.Sleep(50 * time.Millisecond) // the engine's pace, not a synchronisation
		}
	})
	_, gw, ws := gateway(t, []string{up}, func(o *Options) {
		o.RequestTimeout, o.Proxy.Timeout = 300*time.Millisecond, 300*time.Millisecond
		cb := config.Default().CircuitBreaker
		breaker := &worker.BreakerConfig{FailureThreshold: 2, SuccessThreshold: cb.SuccessThreshold, Timeout: cb.TimeoutDuration}
		for _, w := range o.Director.Registry.Snapshot().Workers {
			w.UseBreaker(breaker)
		}
	})
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Go(func() {
			resp, err := http.Post(gw+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","stream":true,"max_tokens":100000}`))
			if err == nil {
				io.Copy(io.Discard, resp.Body) // ends broken at the deadline
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	w := ws[0]
	if w.BreakerState() != worker.BreakerClosed || !w.Available() {
		t.Fatalf("breaker %d after long requests hit the deadline: a streaming worker has not failed", w.BreakerState())
	}
	if _, failed := w.Outcomes(); failed != 0 {
		t.Errorf("%d failures counted against a worker that kept streaming", failed)
	}
}

// A hanging upstream was reported as 502 upstream_unreachable ("request deadline exceeded")
// with retries off, and counted as a transport error with retries on. It is a 504
// upstream_timeout on every path, PD legs included, with Retry-After (a client can act on it:
// the worker that hung is avoided, its circuit opened by its timeouts).
func TestTimeoutsAre504Everywhere(t *testing.T) {
	shortDeadline := func(o *Options) { o.RequestTimeout, o.Proxy.Timeout = 300*time.Millisecond, 300*time.Millisecond }
	hanging := func(t *testing.T) string {
		return pdSim(t, sim.Config{Engine: sim.EngineVLLM, Faults: sim.Faults{Hang: true}}).URL()
	}
	t.Run("regular, retries off", func(t *testing.T) {
		t.Parallel()
		s, gw, ws := gateway(t, []string{hanging(t)}, shortDeadline, noRetries)
		resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"hello?"}`)
		if resp.StatusCode != 504 || !strings.Contains(body, `"upstream_timeout"`) || resp.Header.Get("Retry-After") != "1" {
			t.Fatalf("%d %v %s", resp.StatusCode, resp.Header, body)
		}
		if n := testutil.ToFloat64(s.metrics.UpstreamErrors.WithLabelValues(ws[0].URL, "timeout")); n != 1 {
			t.Errorf("timeout errors counted %v, want 1", n)
		}
	})
	t.Run("regular, retries on", func(t *testing.T) {
		t.Parallel()
		s, gw, ws := gateway(t, []string{hanging(t)}, shortDeadline)
		resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"hello?"}`)
		if resp.StatusCode != 504 || resp.Header.Get("Retry-After") != "1" {
			t.Fatalf("%d %v %s", resp.StatusCode, resp.Header, body)
		}
		if n := testutil.ToFloat64(s.metrics.UpstreamErrors.WithLabelValues(ws[0].URL, "transport")); n != 0 {
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
			_, gw, _ := gateway(t, nil, noRetries, shortDeadline, sglangSimPair(t, pc, dc))
			resp, body := post(t, gw+"/generate", `{"model":"m","text":"hello?"}`)
			if resp.StatusCode != 504 || !strings.Contains(body, "upstream_timeout") || resp.Header.Get("Retry-After") != "1" {
				t.Fatalf("%d %v %s", resp.StatusCode, resp.Header, body)
			}
		})
		t.Run("vllm "+leg, func(t *testing.T) {
			t.Parallel()
			_, gw, _ := gateway(t, nil, noRetries, shortDeadline, vllmSimPair(t, pc, dc))
			resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"hello?"}`)
			if resp.StatusCode != 504 || !strings.Contains(body, leg+"_upstream_timeout") || resp.Header.Get("Retry-After") != "1" {
				t.Fatalf("%d %v %s", resp.StatusCode, resp.Header, body)
			}
		})
	}
}

// /health_generate costs engine work: it is behind the API key and admission, and the caller's
// Authorization does not reach the engines.
func TestHealthGenerateIsGuarded(t *testing.T) {
	var sawAuth atomic.Value
	sawAuth.Store("")
	release, arrived := make(chan struct{}), make(chan struct{}, 1)
	h := func(w http.ResponseWriter, r *http.Request) {
		if a := r.Header.Get("Authorization"); a != "" {
			sawAuth.Store(a)
		}
		if r.URL.Path == "/generate" {
			io.ReadAll(r.Body)
			select {
			case arrived <- struct{}{}:
			default:
			}
			<-release
		}
		io.WriteString(w, "{}")
	}
	_, gw, _ := gateway(t, nil, func(o *Options) {
		o.Director.APIKey = "gateway-key"
		o.Director.Admission = config.Default().Admission
		o.Director.Admission.MaxConcurrentRequests, o.Director.Admission.QueueSize = 1, 0
	}, pdFleet(t, config.Worker{URL: engine(t, h), Runtime: config.RuntimeSGLang}, config.Worker{URL: engine(t, h), Runtime: config.RuntimeSGLang}))
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) }) // before the gateway closes: it waits for the held handler
	get := func(auth string) (*http.Response, string) {
		req, _ := http.NewRequest(http.MethodGet, gw+"/health_generate", nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, string(b)
	}
	resp, body := get("")
	wantRefusal(t, resp, body, 401, "invalid_api_key")
	if resp, _ := get("Bearer gateway-key"); resp.StatusCode != 200 {
		t.Fatalf("with the key: %d", resp.StatusCode)
	}
	if a := sawAuth.Load(); a != "" {
		t.Errorf("an engine saw Authorization %q", a)
	}
	// A generation holds the only slot: /health_generate waits its turn like any inference.
	go func() {
		req, _ := http.NewRequest(http.MethodPost, gw+"/generate", strings.NewReader(`{"text":"hold"}`))
		req.Header.Set("Authorization", "Bearer gateway-key")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	select { // the generation holds the slot
	case <-arrived:
	case <-time.After(15 * time.Second):
		t.Fatal("the generation never reached the engines")
	}
	resp, body = get("Bearer gateway-key")
	wantRefusal(t, resp, body, 503, "queue_full")
}

// What a client sends is bounded and Baton's own headers are Baton's.
func TestClientHeadersAreBounded(t *testing.T) {
	type seen struct {
		auth, rid []string
		query     string
	}
	got := make(chan seen, 10)
	up := engine(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		got <- seen{r.Header.Values("Authorization"), r.Header.Values("X-Request-Id"), r.URL.RawQuery}
		io.WriteString(w, "{}")
	})
	_, gw, _ := gateway(t, []string{up})
	resp, body := post(t, gw+"/v1/chat/completions", `{"model":"m"}`, "Authorization", "Bearer a", "Authorization", "Bearer b")
	wantRefusal(t, resp, body, 400, "duplicate_header")

	long := strings.Repeat("r", 4096)
	resp, _ = post(t, gw+"/v1/chat/completions?debug=1", `{"model":"m"}`, "X-Request-Id", long)
	s := <-got
	if rid := resp.Header.Get("X-Request-Id"); rid == long || len(rid) > 128 || len(s.rid) != 1 || s.rid[0] != rid {
		t.Errorf("oversize request id: answered %q, worker saw %q", rid, s.rid)
	}
	if s.query != "" {
		t.Errorf("the query string reached the worker: %q", s.query)
	}
	resp, _ = post(t, gw+"/v1/chat/completions", `{"model":"m"}`, "X-Request-Id", "one", "X-Request-Id", "two")
	s = <-got
	if rid := resp.Header.Get("X-Request-Id"); rid == "one" || len(s.rid) != 1 || s.rid[0] != rid {
		t.Errorf("duplicate request ids: answered %q, worker saw %q", rid, s.rid)
	}
	resp, _ = post(t, gw+"/v1/chat/completions", `{"model":"m"}`, "X-Request-Id", "mine-1")
	if s = <-got; resp.Header.Get("X-Request-Id") != "mine-1" || len(s.rid) != 1 || s.rid[0] != "mine-1" {
		t.Errorf("a valid request id was not kept: %q", s.rid)
	}
}

// A retryable error body over the hold limit was relayed cut short as if complete; megabytes of
// upstream headers were relayed.
func TestUpstreamErrorAndHeaderBounds(t *testing.T) {
	big := engine(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.WriteHeader(503)
		w.Write(bytes.Repeat([]byte("e"), 2<<20))
	})
	_, gw, _ := gateway(t, []string{big}, noRetries)
	resp, body := post(t, gw+"/v1/chat/completions", `{"model":"m"}`)
	wantRefusal(t, resp, body, 503, "upstream_error_too_large")

	headers := engine(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		for i := 0; i < 64; i++ {
			w.Header().Set(fmt.Sprintf("X-Pad-%d", i), strings.Repeat("h", 4096))
		}
		io.WriteString(w, "{}")
	})
	_, gw, _ = gateway(t, []string{headers}, noRetries)
	resp, body = post(t, gw+"/v1/chat/completions", `{"model":"m"}`)
	e := wantRefusal(t, resp, body, 502, "upstream_unreachable")
	if !strings.Contains(e.Error.Message, "header") {
		t.Errorf("message %q does not say what was wrong", e.Error.Message)
	}
}

// routed_dp_rank and disagg_prefill_dp_rank (and the deprecated data_parallel_rank) are
// Baton's on PD legs; a client's values never reach the engines.
func TestClientDPRankFieldsDoNotReachLegs(t *testing.T) {
	legs := make(chan string, 4)
	h := func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.Method == http.MethodPost {
			legs <- string(b)
		}
		io.WriteString(w, `{"text":"x"}`)
	}
	_, gw, _ := gateway(t, nil, pdFleet(t, config.Worker{URL: engine(t, h), Runtime: config.RuntimeSGLang}, config.Worker{URL: engine(t, h), Runtime: config.RuntimeSGLang}))
	resp, _ := post(t, gw+"/generate", `{"text":"hi","routed_dp_rank":7,"disagg_prefill_dp_rank":5,"data_parallel_rank":3}`)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	for i := 0; i < 2; i++ {
		b := <-legs
		for _, k := range []string{"routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank"} {
			if strings.Contains(b, k) {
				t.Errorf("a leg got the client's %s: %s", k, b)
			}
		}
	}
}

// Request bodies had no total bound — each could be max_payload_size (then 512 MiB), admission
// came after the body, and a trickle kept a buffer for the whole request deadline: six clients
// holding 200 MB bodies took 1.8 GB. Bodies held at once are bounded (503 before more is read),
// and a body must arrive whole within the body timeout.
func TestRequestBodiesAreBoundedInTotal(t *testing.T) {
	// Not parallel: it measures the process's allocations.
	up := engine(t, func(w http.ResponseWriter, r *http.Request) { io.ReadAll(r.Body); io.WriteString(w, "{}") })
	s, gw, _ := gateway(t, []string{up}, func(o *Options) {
		o.MaxPayloadSize, o.MaxBufferedBodyBytes = 8<<20, 20<<20
		o.StalledClientTimeout, o.BodyTimeout = 5*time.Second, 5*time.Second
	})
	running(t, s)
	head := "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 8388000\r\n\r\n"
	part := append([]byte(`{"model":"m","pad":"`), bytes.Repeat([]byte("x"), 7<<20)...) // the rest never comes
	var conns []net.Conn
	a := allocated(func() {
		for i := 0; i < 6; i++ {
			conns = append(conns, rawRequest(t, gw, head, part))
		}
		// Two bodies fit in 20 MiB; the others are refused once their buffers would pass it.
		poll.Until(t, "four bodies refused", func() bool { return testutil.ToFloat64(s.metrics.Rejections.WithLabelValues("body_budget")) == 4 })
	})
	// Two bodies grown by doubling allocate ≈ 16 MiB each (what they outgrew included); six
	// unbounded ones ≈ 96 MiB.
	if a > 64<<20 {
		t.Errorf("six 8 MB bodies under a 20 MiB budget allocated %d MiB", a>>20)
	}
	refused := 0
	for _, c := range conns[2:] {
		c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if line, _ := bufio.NewReader(c).ReadString('\n'); strings.Contains(line, "503") {
			refused++
		}
	}
	if refused < 3 {
		t.Errorf("%d of the bodies past the budget were answered 503", refused)
	}
	for _, c := range conns {
		c.Close()
	}
}

// --max-batch-size bounded prompt lists and samples on PD routes only; on regular routes a
// prompt list, best_of or /generate's sampling_params.n of any size reached the engine.
func TestBatchBoundOnRegularRoutes(t *testing.T) {
	e := simOf(t, sim.Config{Engine: sim.EngineSGLang})
	_, gw, _ := gateway(t, nil, sglangServing(t, e.URL()), func(o *Options) { o.Director.MaxBatchSize = 4 })
	for _, tc := range []struct{ route, body string }{
		{"/v1/completions", `{"model":"m","prompt":["a","b","c","d","e"],"max_tokens":1}`},
		{"/v1/completions", `{"model":"m","prompt":"a","best_of":9,"max_tokens":1}`},
		{"/generate", `{"text":"a","sampling_params":{"n":9,"max_new_tokens":1}}`},
		{"/generate", `{"text":["a","b","c","d","e"],"sampling_params":{"max_new_tokens":1}}`},
	} {
		resp, body := post(t, gw+tc.route, tc.body)
		wantRefusal(t, resp, body, 400, "batch_too_large")
	}
	if resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":["a","b"],"max_tokens":1}`); resp.StatusCode != 200 {
		t.Errorf("a list within the bound: %d %s", resp.StatusCode, body)
	}
}
