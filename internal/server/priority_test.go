package server

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// heldEngine is an engine that records the prompts it is sent, in the order they reach it, and
// holds a request whose prompt is "holder" until release is called (or the test ends).
type heldEngine struct {
	URL     string
	prompts bodies
	release func()
}

func newHeldEngine(t *testing.T) *heldEngine {
	t.Helper()
	held := make(chan struct{})
	var once sync.Once
	e := &heldEngine{release: func() { once.Do(func() { close(held) }) }}
	e.URL = engine(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var req struct{ Prompt string }
		_ = json.Unmarshal(b, &req)
		e.prompts.add(req.Prompt)
		if req.Prompt == "holder" {
			select {
			case <-held:
			case <-r.Context().Done():
				return
			}
		}
		completion(w, r)
	})
	t.Cleanup(e.release) // before the engine's server closes: it waits for its handlers
	return e
}

// Through the gateway: the priority header chooses the class, clamped to the tenant's
// max_priority and echoed; an unknown class is 400; with the one slot taken, an interactive
// request that arrived after a batch one is served first.
func TestPriorityClassesThroughTheGateway(t *testing.T) {
	e := newHeldEngine(t)
	s, gw, _ := gateway(t, []string{e.URL}, func(o *Options) {
		o.Director.Admission = config.Default().Admission
		o.Director.Admission.MaxConcurrentRequests, o.Director.Admission.QueueSize = 1, 10
		o.Director.Tenancy = tenancyOf(t,
			config.Tenant{Name: "app", Keys: []string{config.HashKey("sk-app")}, MaxPriority: "critical"},
			config.Tenant{Name: "etl", Keys: []string{config.HashKey("sk-etl")}, MaxPriority: "batch"})
	})
	t.Cleanup(e.release) // before the gateway closes: it waits for a held request's handler
	send := func(key, priority, prompt string, maxTokens int) (*http.Response, string) {
		req, _ := http.NewRequest(http.MethodPost, gw+"/v1/completions", strings.NewReader(
			`{"model":"m","prompt":"`+prompt+`","max_tokens":`+strconv.Itoa(maxTokens)+`,"ignore_eos":true}`))
		req.Header.Set("Authorization", "Bearer "+key)
		if priority != "" {
			req.Header.Set(openai.HeaderPriority, priority)
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
	if resp, _ := send("sk-etl", "critical", "p", 1); resp.Header.Get(openai.HeaderPriority) != "batch" {
		t.Errorf("a batch tenant asking critical was served as %q", resp.Header.Get(openai.HeaderPriority))
	}
	if resp, _ := send("sk-app", "", "p", 1); resp.Header.Get(openai.HeaderPriority) != "default" {
		t.Errorf("no header: %q", resp.Header.Get(openai.HeaderPriority))
	}
	if resp, b := send("sk-app", "urgent", "p", 1); resp.StatusCode != 400 || errorCode(t, b) != openai.CodeInvalidPriority {
		t.Errorf("an unknown class: %d %s", resp.StatusCode, b)
	}
	// smg's header reads an unknown value as default, as smg does (admission never fails on it).
	if resp, b := post(t, gw+"/v1/completions", `{"model":"m","prompt":"p","max_tokens":1}`, "Authorization", "Bearer sk-app", openai.HeaderSmgPriority, "urgent"); resp.StatusCode != 200 || resp.Header.Get(openai.HeaderPriority) != "default" {
		t.Errorf("X-Smg-Priority urgent: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	// The slot is taken by a request the engine holds; a batch request queues, then an
	// interactive one. The engine sees them in the order they were served.
	before := len(e.prompts.all())
	var wg sync.WaitGroup
	statuses := make(chan string, 3)
	run := func(name, key, priority string, tokens int) {
		wg.Go(func() {
			if resp, _ := send(key, priority, name, tokens); resp != nil {
				statuses <- name + " " + strconv.Itoa(resp.StatusCode)
			}
		})
	}
	run("holder", "sk-app", "critical", 15)
	poll.Until(t, "the holder runs", func() bool { return s.InFlight() == 1 && len(e.prompts.all()) == before+1 })
	run("batch", "sk-etl", "", 1)
	poll.Until(t, "batch queued", func() bool { return strings.Contains(scrape(t, s), `baton_queue_depth{class="batch"} 1`) })
	run("interactive", "sk-app", "interactive", 1)
	poll.Until(t, "interactive queued", func() bool { return strings.Contains(scrape(t, s), `baton_queue_depth{class="interactive"} 1`) })
	e.release()
	wg.Wait()
	close(statuses)
	for st := range statuses {
		if !strings.HasSuffix(st, " 200") {
			t.Errorf("answered %s", st)
		}
	}
	if got := strings.Join(e.prompts.all()[before:], " "); got != "holder interactive batch" {
		t.Errorf("served %s", got)
	}
	// The status page's data shows the slots, the queues and each tenant's service (the last
	// slot is given back as its handler returns, just after its answer's last byte).
	status := func() string {
		rec := httptest.NewRecorder()
		s.StatusHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/status.json", nil))
		return rec.Body.String()
	}
	poll.Until(t, "every slot given back", func() bool { return strings.Contains(status(), `"in_use":0`) })
	if b := status(); !strings.Contains(b, `"queues":{"in_use":0,"served":{"app":`) || !strings.Contains(b, `"etl":`) || !strings.Contains(b, `"slots":1`) {
		t.Errorf("status.json queues: %s", b)
	}
}

// The class reaches an engine's "priority" field only where the worker is marked
// forward_priority, with the engine's sign (vLLM: lower first; SGLang: higher first), replacing
// the client's; an unmarked worker gets no "priority" at all (a client's is Baton's to drop).
func TestPriorityForwardedOnlyToMarkedWorkers(t *testing.T) {
	recording := func(b *bodies) string {
		return engine(t, func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			if r.URL.Path == "/v1/completions" {
				b.add(string(body))
			}
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
		})
	}
	var v, sg, plain bodies
	_, gw, _ := gateway(t, nil, func(o *Options) {
		serving(t, o, config.Worker{URL: recording(&v), Runtime: config.RuntimeVLLM, ForwardPriority: true, Models: []string{"m-vllm"}})
		serving(t, o, config.Worker{URL: recording(&sg), Runtime: config.RuntimeSGLang, ForwardPriority: true, Models: []string{"m-sglang"}})
		serving(t, o, config.Worker{URL: recording(&plain), Runtime: config.RuntimeVLLM, Models: []string{"m-plain"}})
	})
	for _, model := range []string{"m-vllm", "m-sglang", "m-plain"} {
		for _, class := range []string{"interactive", "batch"} {
			if _, b := post(t, gw+"/v1/completions", `{"model":"`+model+`","prompt":"p","priority":7}`, openai.HeaderPriority, class); !strings.Contains(b, "ok") {
				t.Fatalf("%s: %s", model, b)
			}
		}
	}
	for name, c := range map[string]struct {
		b    *bodies
		want []string
	}{
		"vllm":   {&v, []string{`"priority":-1`, `"priority":1`}},
		"sglang": {&sg, []string{`"priority":1`, `"priority":-1`}},
		"plain":  {&plain, []string{``, ``}}, // the client's own priority never reaches an engine
	} {
		seen := c.b.all()
		if len(seen) != 2 {
			t.Fatalf("%s saw %d requests", name, len(seen))
		}
		for i, want := range c.want {
			if n := strings.Count(seen[i], `"priority"`); !strings.Contains(seen[i], want) || want != "" && n != 1 || want == "" && n != 0 {
				t.Errorf("%s request %d: %s, want %s", name, i, seen[i], want)
			}
		}
	}
}

// The waiting room: a model whose only worker becomes ready later (its engine answers
// registration) loses no request with no_worker_wait; baton_model_waiting_requests counts those
// held; without it, the same request is refused at once.
func TestWaitingRoomForAColdModel(t *testing.T) {
	e := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	cold := func() *worker.Worker { // configured, not registered yet: its engine has not answered
		return worker.New(config.Worker{URL: e.URL(), Models: []string{"m"}, Runtime: config.RuntimeVLLM})
	}
	w := cold()
	var reg *worker.Registry
	s, gw, _ := gateway(t, nil, func(o *Options) {
		reg = o.Director.Registry
		if err := reg.Add(w); err != nil {
			t.Fatal(err)
		}
		o.Director.Admission = config.Default().Admission
		o.Director.Admission.NoWorkerWait = 10 * time.Second
	})
	var wg sync.WaitGroup
	codes := make(chan string, 5)
	for range 5 {
		wg.Go(func() {
			resp, err := http.Post(gw+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"cold start","max_tokens":2}`))
			if err != nil {
				codes <- err.Error()
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			codes <- strconv.Itoa(resp.StatusCode) + " " + string(b)
		})
	}
	poll.Until(t, "five requests held", func() bool { return strings.Contains(scrape(t, s), `baton_model_waiting_requests{model="m"} 5`) })
	// Without the waiting room the same request is refused at once.
	_, gw2, _ := gateway(t, nil, func(o *Options) {
		if err := o.Director.Registry.Add(cold()); err != nil {
			t.Fatal(err)
		}
		o.Director.Admission = config.Default().Admission
		o.Director.Admission.NoWorkerWait = 0
	})
	if resp, b := post(t, gw2+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":2}`); resp.StatusCode != 503 || errorCode(t, b) != openai.CodeNoAvailableWorkers {
		t.Errorf("without no_worker_wait: %d %s", resp.StatusCode, b)
	}
	// The engine answers registration: the worker is registered and ready, as the registrar
	// leaves it.
	w.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM, Models: []worker.Model{{ID: "m"}}})
	w.SetReady(true)
	reg.Rebuild()
	wg.Wait()
	close(codes)
	for c := range codes {
		if !strings.HasPrefix(c, "200 ") {
			t.Errorf("a request held for the cold model answered %s", c)
		}
	}
	if !strings.Contains(scrape(t, s), `baton_model_waiting_requests{model="m"} 0`) {
		t.Error("requests still counted as waiting")
	}
	if n := e.Stats().RequestsReceived; n != 5 {
		t.Errorf("the engine got %d requests, want the 5 held", n)
	}
}

// Drain (SIGTERM): a request waiting for a slot is answered 503 server_draining at once, not
// when the slot frees.
func TestDrainAnswersTheQueuedAtOnce(t *testing.T) {
	e := newHeldEngine(t)
	s, gw, _ := gateway(t, []string{e.URL}, func(o *Options) {
		o.Director.Admission = config.Default().Admission
		o.Director.Admission.MaxConcurrentRequests, o.Director.Admission.QueueSize = 1, 10
	})
	t.Cleanup(e.release) // before the gateway closes: it waits for the holder's handler
	holder := make(chan string, 1)
	go func() {
		resp, err := http.Post(gw+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"holder","max_tokens":30,"ignore_eos":true}`))
		if err != nil {
			holder <- err.Error()
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		holder <- resp.Status
	}()
	poll.Until(t, "the holder runs", func() bool { return s.InFlight() == 1 && len(e.prompts.all()) == 1 })
	type answer struct {
		status int
		body   string
	}
	done := make(chan answer, 1)
	go func() {
		resp, err := http.Post(gw+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"queued","max_tokens":1}`))
		if err != nil {
			done <- answer{body: err.Error()}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- answer{resp.StatusCode, string(b)}
	}()
	poll.Until(t, "one queued", func() bool { return strings.Contains(scrape(t, s), `baton_queue_depth{class="default"} 1`) })
	s.SetDraining()
	var a answer
	select {
	case a = <-done: // the engine still holds the holder: its slot has not freed
	case <-time.After(poll.Timeout):
		t.Fatal("the queued request was not answered on drain while the holder kept its slot")
	}
	if a.status != 503 || errorCode(t, a.body) != openai.CodeDraining {
		t.Errorf("the queued request on drain: %d %s", a.status, a.body)
	}
	if s.InFlight() < 1 {
		t.Error("the queued request was answered only after the holder's slot freed")
	}
	if got := e.prompts.all(); len(got) != 1 {
		t.Errorf("the engine got %q: the queued request was sent", got)
	}
	e.release()
	if h := <-holder; h != "200 OK" {
		t.Errorf("the request in flight did not finish: %s", h)
	}
}
