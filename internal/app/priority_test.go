package app

import (
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// Through the gateway: the priority header chooses the class, clamped to the tenant's
// max_priority and echoed; an unknown class is 400; with the one slot taken, an interactive
// request that arrived after a batch one is served first.
func TestPriorityClassesThroughTheGateway(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 20 * time.Millisecond})
	cfg := testConfig(e.URL())
	cfg.Admission.MaxConcurrentRequests, cfg.Admission.QueueSize = 1, 10
	cfg.Tenants = []config.Tenant{
		{Name: "app", Keys: []string{config.HashKey("sk-app")}, MaxPriority: "critical"},
		{Name: "etl", Keys: []string{config.HashKey("sk-etl")}, MaxPriority: "batch"},
	}
	g, gw := startGateway(t, cfg)
	send := func(key, priority string, maxTokens int) (*http.Response, string) {
		req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(
			`{"model":"m","prompt":"p","max_tokens":`+strconv.Itoa(maxTokens)+`,"ignore_eos":true}`))
		req.Header.Set("Authorization", "Bearer "+key)
		if priority != "" {
			req.Header.Set("X-Baton-Priority", priority)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Error(err)
			return nil, ""
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, string(b)
	}
	if resp, _ := send("sk-etl", "critical", 1); resp.Header.Get("X-Baton-Priority") != "batch" {
		t.Errorf("a batch tenant asking critical was served as %q", resp.Header.Get("X-Baton-Priority"))
	}
	if resp, _ := send("sk-app", "", 1); resp.Header.Get("X-Baton-Priority") != "default" {
		t.Errorf("no header: %q", resp.Header.Get("X-Baton-Priority"))
	}
	if resp, b := send("sk-app", "urgent", 1); resp.StatusCode != 400 || !strings.Contains(b, "invalid_priority") {
		t.Errorf("an unknown class: %d %s", resp.StatusCode, b)
	}
	// smg's header reads an unknown value as default, as smg does (admission never fails on it).
	req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"p","max_tokens":1}`))
	req.Header.Set("Authorization", "Bearer sk-app")
	req.Header.Set("X-Smg-Priority", "urgent")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 200 || resp.Header.Get("X-Baton-Priority") != "default" {
		t.Errorf("X-Smg-Priority urgent: %v %v", resp, err)
	} else {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	// The slot is taken by a long request; a batch request queues, then an interactive one.
	var wg sync.WaitGroup
	var mu sync.Mutex
	var order []string
	run := func(name, key, priority string, tokens int) {
		wg.Go(func() {
			resp, _ := send(key, priority, tokens)
			if resp != nil && resp.StatusCode == 200 {
				mu.Lock()
				order = append(order, name)
				mu.Unlock()
			}
		})
	}
	run("holder", "sk-app", "critical", 15)
	poll.Until(t, "the holder runs", func() bool { return g.Server.InFlight() == 1 })
	run("batch", "sk-etl", "", 1)
	poll.Until(t, "batch queued", func() bool { return strings.Contains(scrape(t, g), `baton_queue_depth{class="batch"} 1`) })
	run("interactive", "sk-app", "interactive", 1)
	poll.Until(t, "interactive queued", func() bool { return strings.Contains(scrape(t, g), `baton_queue_depth{class="interactive"} 1`) })
	wg.Wait()
	if got := strings.Join(order, " "); got != "holder interactive batch" {
		t.Errorf("served %s", got)
	}
	// The status page's data shows the slots, the queues and each tenant's service.
	rec := httptest.NewRecorder()
	g.Server.StatusHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/status.json", nil))
	if b := rec.Body.String(); !strings.Contains(b, `"queues":{"in_use":0,"served":{"app":`) || !strings.Contains(b, `"etl":`) || !strings.Contains(b, `"slots":1`) {
		t.Errorf("status.json queues: %s", b)
	}
}

// The class reaches an engine's "priority" field only where the worker is marked
// forward_priority, with the engine's sign (vLLM: lower first; SGLang: higher first), replacing
// the client's; an unmarked worker gets no "priority" at all (a client's is Baton's to drop).
func TestPriorityForwardedOnlyToMarkedWorkers(t *testing.T) {
	type seen struct {
		mu     sync.Mutex
		bodies []string
	}
	engine := func(runtime string, s *seen) string {
		return fakeEngine(t, runtime, []string{"m-" + runtime}, func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			if r.URL.Path == "/v1/completions" {
				s.mu.Lock()
				s.bodies = append(s.bodies, string(b))
				s.mu.Unlock()
			}
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
		}).URL
	}
	var v, sg, plain seen
	cfg := config.Default()
	cfg.Workers = []config.Worker{
		{URL: engine("vllm", &v), Runtime: config.RuntimeVLLM, ForwardPriority: true},
		{URL: engine("sglang", &sg), Runtime: config.RuntimeSGLang, ForwardPriority: true},
		{URL: engine("plain", &plain), Runtime: config.RuntimeVLLM, Models: []string{"m-plain"}},
	}
	_, gw := startGateway(t, cfg)
	for _, model := range []string{"m-vllm", "m-sglang", "m-plain"} {
		for _, class := range []string{"interactive", "batch"} {
			req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(`{"model":"`+model+`","prompt":"p","priority":7}`))
			req.Header.Set("X-Baton-Priority", class)
			if _, b := do(t, req); !strings.Contains(b, "ok") {
				t.Fatalf("%s: %s", model, b)
			}
		}
	}
	for name, c := range map[string]struct {
		s    *seen
		want []string
	}{
		"vllm":   {&v, []string{`"priority":-1`, `"priority":1`}},
		"sglang": {&sg, []string{`"priority":1`, `"priority":-1`}},
		"plain":  {&plain, []string{``, ``}}, // the client's own priority never reaches an engine
	} {
		c.s.mu.Lock()
		if len(c.s.bodies) != 2 {
			t.Fatalf("%s saw %d requests", name, len(c.s.bodies))
		}
		for i, want := range c.want {
			if n := strings.Count(c.s.bodies[i], `"priority"`); !strings.Contains(c.s.bodies[i], want) || want != "" && n != 1 || want == "" && n != 0 {
				t.Errorf("%s request %d: %s, want %s", name, i, c.s.bodies[i], want)
			}
		}
		c.s.mu.Unlock()
	}
}

// The waiting room: a model whose only worker becomes ready after a second loses no request
// with no_worker_wait; baton_model_waiting_requests counts those held; without it, the same
// request is refused at once.
func TestWaitingRoomForAColdModel(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	cfg := config.Default()
	cfg.Workers = []config.Worker{{URL: url, Models: []string{"m"}, Runtime: config.RuntimeVLLM}}
	cfg.DetectInterval = 100 * time.Millisecond
	cfg.Admission.NoWorkerWait = 10 * time.Second
	g := runGateway(t, cfg)
	gw := serveAPI(t, cfg, g.Server.Handler())
	var wg sync.WaitGroup
	codes := make(chan int, 5)
	for i := 0; i < 5; i++ {
		wg.Go(func() {
			resp, _ := postTimeout(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"cold start","max_tokens":2}`)
			codes <- resp.StatusCode
		})
	}
	poll.Until(t, "five requests held", func() bool { return strings.Contains(scrape(t, g), `baton_model_waiting_requests{model="m"} 5`) })
	// Without the waiting room the same request is refused at once.
	cold := cfg
	cold.Admission.NoWorkerWait = 0
	g2, err := build(cold, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if resp, b := postTimeout(t, serveAPI(t, cold, g2.Server.Handler()).URL+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":2}`); resp.StatusCode != 503 || !strings.Contains(b, "no_available_workers") {
		t.Errorf("without no_worker_wait: %d %s", resp.StatusCode, b)
	}
	time.Sleep(time.Second)
	e, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Model: "m", Host: "127.0.0.1", Port: port})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	wg.Wait()
	close(codes)
	for c := range codes {
		if c != 200 {
			t.Errorf("a request held for the cold model answered %d", c)
		}
	}
	if !strings.Contains(scrape(t, g), `baton_model_waiting_requests{model="m"} 0`) {
		t.Error("requests still counted as waiting")
	}
}

// Drain (SIGTERM): a request waiting for a slot is answered 503 server_draining at once, not
// when the slot frees.
func TestDrainAnswersTheQueuedAtOnce(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 100 * time.Millisecond})
	cfg := testConfig(e.URL())
	cfg.Admission.MaxConcurrentRequests, cfg.Admission.QueueSize = 1, 10
	g, gw := startGateway(t, cfg)
	holder := make(chan string, 1)
	go func() {
		resp, err := http.Post(gw.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"holder","max_tokens":30,"ignore_eos":true}`))
		if err != nil {
			holder <- err.Error()
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		holder <- resp.Status
	}()
	poll.Until(t, "the holder runs", func() bool { return g.Server.InFlight() == 1 })
	type answer struct {
		status int
		body   string
		at     time.Time
	}
	done := make(chan answer, 1)
	go func() {
		resp, err := http.Post(gw.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"queued","max_tokens":1}`))
		if err != nil {
			done <- answer{body: err.Error()}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- answer{resp.StatusCode, string(b), time.Now()}
	}()
	poll.Until(t, "one queued", func() bool { return strings.Contains(scrape(t, g), `baton_queue_depth{class="default"} 1`) })
	g.Server.SetDraining()
	a := <-done
	if a.status != 503 || !strings.Contains(a.body, "server_draining") {
		t.Errorf("the queued request on drain: %d %s", a.status, a.body)
	}
	if g.Server.InFlight() < 1 {
		t.Error("the queued request was answered only after the holder's slot freed")
	}
	if h := <-holder; h != "200 OK" {
		t.Errorf("the request in flight did not finish: %s", h)
	}
}
