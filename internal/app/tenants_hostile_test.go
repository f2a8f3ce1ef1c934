package app

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// A tenant at 3,000 tokens per minute, for the hostile tenant's tests.
func hostileTenant(cfg *config.Config) {
	cfg.Tenants = []config.Tenant{{Name: "hostile", Keys: []string{config.HashKey("sk-hostile")},
		Limits: &config.Limits{TokensPerMinute: intp(3000)}}}
}

// cutAfter posts body as the hostile tenant and hangs up after d; it reports the status when an
// answer head came first (0 when none did).
func cutAfter(t *testing.T, url, body string, d time.Duration) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer sk-hostile")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

// settled waits until the gateway charged the tenant more than before (a request's lease is
// settled once its handler returned), and returns what it charged since.
func settled(t *testing.T, g *Gateway, before int64) int64 {
	t.Helper()
	for i := 0; i < 300; i++ {
		if got := charged(t, g, "hostile"); got > before {
			return got - before
		}
		time.Sleep(10 * time.Millisecond)
	}
	return charged(t, g, "hostile") - before
}

// words is a prompt of n words: n tokens to the simulators.
func words(n int) string { return strings.TrimSpace(strings.Repeat("w ", n)) }

// Leaving before the first byte costs what the engine computed: a storm of streams cut during
// prefill, and of non-streamed requests cut while the engine generates, are each charged (the
// prompt; and for an answer that shows no progress, the completion it asked for), so that the
// tenant's bucket empties and the storm is refused — instead of every cut request being
// charged nothing and the engine computing without end.
func TestTenantLeavingBeforeTheFirstByteIsCharged(t *testing.T) {
	prompt := words(1000) // 1,000 tokens, about 500 estimated from its bytes
	for _, c := range []struct {
		name string
		sim  sim.Config
		body string
		cut  time.Duration
		// per is the least each admitted request must be charged.
		per int64
	}{
		{"stream cut during prefill", sim.Config{Engine: sim.EngineVLLM, PrefillPerToken: 3 * time.Millisecond},
			`{"model":"m","prompt":"` + prompt + `","max_tokens":100,"stream":true}`, 150 * time.Millisecond, 400},
		{"answer cut while generating", sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 20 * time.Millisecond},
			`{"model":"m","prompt":"` + prompt + `","max_tokens":100,"ignore_eos":true}`, 300 * time.Millisecond, 500},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := simEngine(t, c.sim)
			cfg := testConfig(e.URL())
			hostileTenant(&cfg)
			g, gw := startGateway(t, cfg)
			// One request: charged, not nothing.
			if status := cutAfter(t, gw.URL+"/v1/completions", c.body, c.cut); status != 0 {
				t.Fatalf("the answer's head came before the cut (%d): the test cuts too late", status)
			}
			if got := settled(t, g, 0); got < c.per {
				t.Fatalf("a request cut before its first byte was charged %d tokens, want at least %d", got, c.per)
			}
			// The storm: the bucket empties, and the rest are refused before they reach the engine.
			before := e.Stats().RequestsReceived
			for i := 0; i < 20; i++ {
				cutAfter(t, gw.URL+"/v1/completions", c.body, c.cut)
			}
			if got := e.Stats().RequestsReceived - before; got > 6 {
				t.Errorf("%d of 20 cut requests reached the engine at 3,000 tokens per minute: leaving early escapes the limit", got)
			}
		})
	}
}

// The prefill leg of a PD request whose decode never started is charged its prompt: the client
// leaves while the prefill computes.
func TestTenantPrefillLegAloneIsChargedItsPrompt(t *testing.T) {
	cfg, _, d := vllmPair(t, "NixlConnector", sim.Config{PrefillPerToken: 3 * time.Millisecond}, sim.Config{})
	hostileTenant(&cfg)
	g, gw := startGateway(t, cfg)
	body := `{"model":"m","prompt":"` + words(1000) + `","max_tokens":100}`
	if status := cutAfter(t, gw.URL+"/v1/completions", body, 150*time.Millisecond); status != 0 {
		t.Fatalf("answered %d before the cut", status)
	}
	got := settled(t, g, 0)
	if got < 1000 || got >= 1000+100 {
		t.Errorf("a PD request cut during its prefill was charged %d tokens, want its prompt (1,000 tokens, as the prefill engine counts it) and no completion", got)
	}
	if n := d.Stats().RequestsReceived; n != 0 {
		t.Errorf("the decode saw %d requests; the test means one whose decode never started", n)
	}
}

// The completion cannot exceed the reservation: a cap above the tenant's whole bucket is 429
// tenant_request_too_large at once (naming the field, not to be retried) on every route and
// both PD styles, and nothing reaches an engine.
func TestTenantBudgetAboveTheBucketIsRefused(t *testing.T) {
	fleets := map[string]func(t *testing.T) config.Config{
		"regular": func(t *testing.T) config.Config {
			return testConfig(simEngine(t, sim.Config{Engine: sim.EngineSGLang}).URL())
		},
		"pd vllm nixl": nixlPDFleet,
		"pd sglang":    sglangPDFleet,
	}
	routes := []struct{ path, body, field string }{
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":100000}`, "max_tokens"},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":10,"max_completion_tokens":120000}`, "max_completion_tokens"},
		{"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":50000,"stream":true}`, "max_tokens"},
		{"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":2000,"n":2}`, "max_tokens"},
		{"/v1/responses", `{"model":"m","input":"hi","max_output_tokens":50000}`, "max_output_tokens"},
		{"/v1/messages", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":100000}`, "max_tokens"},
		{"/generate", `{"text":"hi","sampling_params":{"max_new_tokens":100000}}`, "sampling_params.max_new_tokens"},
	}
	for name, fleet := range fleets {
		t.Run(name, func(t *testing.T) {
			cfg := fleet(t)
			hostileTenant(&cfg)
			g, gw := startGateway(t, cfg)
			for _, rt := range routes {
				resp, body := tenantReq(t, gw.URL+rt.path, "sk-hostile", rt.body)
				env := wantEnvelope(t, &http.Response{StatusCode: resp.StatusCode, Body: io.NopCloser(strings.NewReader(body)), Header: resp.Header}, 429, "tenant_request_too_large")
				if env.Error.Param == nil || *env.Error.Param != rt.field || !strings.Contains(env.Error.Message, rt.field) {
					t.Errorf("%s %s: the refusal does not name %s: %s", rt.path, rt.body, rt.field, body)
				}
				if resp.Header.Get("X-Should-Retry") != "false" || resp.Header.Get("Retry-After") != "" {
					t.Errorf("%s: a request that can never fit says it may be retried: %v", rt.path, resp.Header)
				}
			}
			for _, w := range g.Registry.Snapshot().Workers {
				if w.InFlight() != 0 {
					t.Errorf("worker %s has requests in flight", w.URL)
				}
			}
			if got := charged(t, g, "hostile"); got != 0 {
				t.Errorf("refused requests were charged %d tokens", got)
			}
		})
	}
}

// Under a token limit the reservation is the request's own cap, not one capped at the default
// estimate: two requests asking 1,600 tokens each cannot both run against 3,000 tokens per
// minute (capped at 1,024 each, both were admitted and the engine generated 3,200 inside a
// second).
func TestTenantReservesTheRequestsOwnCap(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 5 * time.Millisecond})
	cfg := testConfig(e.URL())
	hostileTenant(&cfg)
	_, gw := startGateway(t, cfg)
	body := `{"model":"m","prompt":"hi","max_tokens":1600,"ignore_eos":true}`
	statuses := make([]int, 2)
	var wg sync.WaitGroup
	for i := range statuses {
		wg.Go(func() {
			resp, _ := tenantReq(t, gw.URL+"/v1/completions", "sk-hostile", body)
			statuses[i] = resp.StatusCode
		})
	}
	wg.Wait()
	ok := 0
	for _, s := range statuses {
		if s == 200 {
			ok++
		}
	}
	if ok != 1 {
		t.Errorf("two requests of 1,600 tokens against 3,000 per minute: statuses %v, want one 200 and one 429", statuses)
	}
}

// A request of a limited tenant that names no cap gets the default written into the body the
// engine receives — and only that: every other byte as the client sent it.
func TestTenantDefaultCapIsWritten(t *testing.T) {
	var mu sync.Mutex
	var bodies []string
	engine := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, r.URL.Path+" "+string(b))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	})
	cfg := testConfig(engine.URL)
	hostileTenant(&cfg)
	cfg.TenantMaxTokens = 64
	_, gw := startGateway(t, cfg)
	for _, c := range []struct{ path, body, want string }{
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"h\u00e9"}],"seed":12345678901234567890}`, `,"max_tokens":64}`},
		{"/v1/completions", `{"model":"m","prompt":"hi"}`, `,"max_tokens":16}`},
		{"/v1/responses", `{"model":"m","input":"hi"}`, `,"max_output_tokens":64}`},
	} {
		mu.Lock()
		bodies = nil
		mu.Unlock()
		if resp, b := tenantReq(t, gw.URL+c.path, "sk-hostile", c.body); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", c.path, resp.StatusCode, b)
		}
		mu.Lock()
		got := bodies
		mu.Unlock()
		want := c.path + " " + strings.TrimSuffix(c.body, "}") + c.want
		if len(got) != 1 || got[0] != want {
			t.Errorf("the engine got %q, want %q", got, want)
		}
	}
	// Anthropic's messages protocol requires max_tokens: refused, not sent uncapped.
	resp, b := tenantReq(t, gw.URL+"/v1/messages", "sk-hostile", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 400 || !strings.Contains(b, `"param":"max_tokens"`) {
		t.Errorf("/v1/messages without max_tokens: %d %s", resp.StatusCode, b)
	}
	// A bucket smaller than the default: the default written is what the bucket holds beside
	// the prompt, not a refusal of every request that names no cap.
	small := testConfig(engine.URL)
	small.Tenants = []config.Tenant{{Name: "hostile", Keys: []string{config.HashKey("sk-hostile")}, Limits: &config.Limits{TokensPerMinute: intp(1000)}}}
	_, gw2 := startGateway(t, small)
	mu.Lock()
	bodies = nil
	mu.Unlock()
	body := `{"model":"m","messages":[{"role":"user","content":"` + words(100) + `"}]}`
	if resp, b := tenantReq(t, gw2.URL+"/v1/chat/completions", "sk-hostile", body); resp.StatusCode != 200 {
		t.Fatalf("a 1,000-token bucket, no cap named: %d %s", resp.StatusCode, b)
	}
	mu.Lock()
	got := bodies
	mu.Unlock()
	if len(got) != 1 || !strings.Contains(got[0], `,"max_tokens":`) || strings.Contains(got[0], `"max_tokens":1024`) {
		t.Errorf("the engine got %q: want a cap the bucket holds", got)
	}
}

// A client's own "priority" never reaches an engine, on any path: vLLM not scheduling by
// priority refuses a non-zero one (so the request would fail), and one that does would run the
// client's -1000 before every class. Marked forward_priority, the engine gets Baton's value.
func TestClientPriorityNeverReachesAnEngine(t *testing.T) {
	for _, c := range []struct {
		name  string
		fleet func(t *testing.T) (config.Config, []*sim.Engine)
		want  int64 // the priority a marked engine gets (0: none marked)
	}{
		{"regular", func(t *testing.T) (config.Config, []*sim.Engine) {
			e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
			return testConfig(e.URL()), []*sim.Engine{e}
		}, 0},
		{"regular marked", func(t *testing.T) (config.Config, []*sim.Engine) {
			e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, SchedulingPolicy: sim.SchedulingPriority})
			cfg := config.Default()
			cfg.Workers = []config.Worker{{URL: e.URL(), ForwardPriority: true}}
			return cfg, []*sim.Engine{e}
		}, 1},
		{"pd vllm nixl", func(t *testing.T) (config.Config, []*sim.Engine) {
			cfg, p, d := vllmPair(t, "NixlConnector", sim.Config{}, sim.Config{})
			return cfg, []*sim.Engine{p, d}
		}, 0},
		{"pd sglang", func(t *testing.T) (config.Config, []*sim.Engine) {
			cfg, p, d := sglangPair(t, sim.Config{}, sim.Config{})
			return cfg, []*sim.Engine{p, d}
		}, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, engines := c.fleet(t)
			_, gw := startGateway(t, cfg)
			for _, prio := range []string{"-1000", "1000"} {
				for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
					body := `{"model":"m","prompt":"hi","max_tokens":3,"priority":` + prio + `}`
					if path == "/v1/chat/completions" {
						body = `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"priority":` + prio + `,"stream":true}`
					}
					req, _ := http.NewRequest(http.MethodPost, gw.URL+path, strings.NewReader(body))
					req.Header.Set("X-Baton-Priority", "batch")
					if status, b := do(t, req); status != 200 {
						t.Errorf("%s priority %s: %d %s", path, prio, status, b)
					}
				}
			}
			for _, e := range engines {
				s := e.Stats()
				switch {
				case c.want == 0 && s.RequestsWithPriority != 0:
					t.Errorf("an engine got %d requests with a priority (the last %d)", s.RequestsWithPriority, s.LastPriority)
				case c.want != 0 && (s.RequestsWithPriority != 4 || s.LastPriority != c.want):
					t.Errorf("the marked engine got %d requests with a priority, the last %d; want 4, each %d (batch)", s.RequestsWithPriority, s.LastPriority, c.want)
				}
			}
		})
	}
}

// A tenant sees only its own part of the fleet: with another tenant's key, every read-only
// route of the API port either refuses or answers without the fleet (no engine URL, no model of
// the other tenant), and a model of the other tenant is the 404 of a model nobody serves.
func TestTenantKeyOnEveryReadOnlyRoute(t *testing.T) {
	a := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	cfg := testConfig(a.URL())
	cfg.AdminAPIKey = "sk-admin"
	cfg.Tenants = []config.Tenant{
		{Name: "a", Keys: []string{config.HashKey("sk-a")}, Models: []string{"m"}},
		{Name: "b", Keys: []string{config.HashKey("sk-b")}, Models: []string{"other"}},
	}
	_, gw := startGateway(t, cfg)
	get := func(path, key string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, gw.URL+path, nil)
		req.Header.Set("Authorization", "Bearer "+key)
		return do(t, req)
	}
	for _, c := range []struct {
		path string
		want int
	}{
		{"/workers", 403}, {"/tenants", 401}, {"/status", 404}, {"/status.json", 404}, {"/metrics", 404},
		{"/workers/x", 401}, {"/v1/models", 200}, {"/readiness", 200},
	} {
		status, body := get(c.path, "sk-b")
		if status != c.want {
			t.Errorf("GET %s with tenant b's key: %d, want %d: %s", c.path, status, c.want, body)
		}
		if strings.Contains(body, a.URL()) || strings.Contains(body, strings.TrimPrefix(a.URL(), "http://")) || strings.Contains(body, `"a"`) {
			t.Errorf("GET %s with tenant b's key shows the fleet or tenant a: %s", c.path, body)
		}
	}
	if status, body := get("/workers", "sk-admin"); status != 200 || !strings.Contains(body, a.URL()) {
		t.Errorf("GET /workers with the admin key: %d %s", status, body)
	}
	// The open probe names no model of the private fleet; the admin key sees them.
	if status, body := get("/readiness", ""); status != 200 || strings.Contains(body, `"m"`) || !strings.Contains(body, `"models":1`) {
		t.Errorf("GET /readiness without a key: %d %s", status, body)
	}
	if status, body := get("/readiness", "sk-admin"); status != 200 || !strings.Contains(body, `"models":["m"]`) {
		t.Errorf("GET /readiness with the admin key: %d %s", status, body)
	}
	_, unknown := tenantReq(t, gw.URL+"/v1/completions", "sk-b", `{"model":"nope","prompt":"hi","max_tokens":1}`)
	resp, other := tenantReq(t, gw.URL+"/v1/completions", "sk-b", `{"model":"m","prompt":"hi","max_tokens":1}`)
	if resp.StatusCode != 404 || strings.ReplaceAll(other, `\"m\"`, `\"nope\"`) != unknown {
		t.Errorf("tenant a's model asked with b's key: %d %s; a model nobody serves: %s", resp.StatusCode, other, unknown)
	}
}

// Waiting does not lift a request above its tenant's max_priority: with every unreserved slot
// taken and one kept for critical work, a batch tenant's request waits out its queue timeout
// (504) however many promotion periods pass, while a tenant allowed critical is promoted into
// the kept slot.
func TestPromotionThroughTheGatewayStopsAtTheCeiling(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 10 * time.Millisecond})
	cfg := testConfig(e.URL())
	cfg.Admission.MaxConcurrentRequests, cfg.Admission.QueueSize = 2, 10
	cfg.Admission.ReservedSlots = map[string]int{"critical": 1}
	cfg.Admission.PromoteAfter = 50 * time.Millisecond
	cfg.Admission.QueueTimeout = 800 * time.Millisecond
	cfg.Tenants = []config.Tenant{
		{Name: "app", Keys: []string{config.HashKey("sk-app")}, MaxPriority: "critical"},
		{Name: "etl", Keys: []string{config.HashKey("sk-etl")}, MaxPriority: "batch"},
	}
	_, gw := startGateway(t, cfg)
	send := func(key, body string) (*http.Response, string) {
		req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("X-Baton-Priority", "batch")
		return tenantDo(t, req)
	}
	// 3 s: holds the unreserved slot. The request ends when the gateway closes at the test's
	// end; its answer is not read.
	long := `{"model":"m","prompt":"p","max_tokens":300,"ignore_eos":true}`
	go func() {
		req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(long))
		req.Header.Set("Authorization", "Bearer sk-app")
		req.Header.Set("X-Baton-Priority", "batch")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	for deadline := time.Now().Add(5 * time.Second); e.Stats().RequestsReceived == 0; {
		if time.Now().After(deadline) {
			t.Fatal("the long request never reached the engine")
		}
		time.Sleep(5 * time.Millisecond)
	}
	resp, b := send("sk-etl", `{"model":"m","prompt":"p","max_tokens":1}`)
	if resp.StatusCode != 504 || !strings.Contains(b, "queue_timeout") {
		t.Errorf("a batch tenant's request after 16 promotion periods: %d %s (X-Baton-Priority %q), want 504 queue_timeout: it must not reach the slot kept for critical",
			resp.StatusCode, b, resp.Header.Get("X-Baton-Priority"))
	}
	resp, b = send("sk-app", `{"model":"m","prompt":"p","max_tokens":1}`)
	if resp.StatusCode != 200 {
		t.Errorf("a tenant allowed critical, promoted while it waited: %d %s", resp.StatusCode, b)
	}
}

// tenantDo sends req and reads its whole answer.
func tenantDo(t *testing.T, req *http.Request) (*http.Response, string) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(b)
}

// The Endpoint Picker removes a client's "priority" from the body it hands back (and writes
// Baton's for a worker marked forward_priority): the engine behind the data plane never sees the
// client's -1000.
func TestEPPRemovesTheClientsPriority(t *testing.T) {
	for _, c := range []struct {
		name   string
		marked bool
	}{{"unmarked", false}, {"marked", true}} {
		t.Run(c.name, func(t *testing.T) {
			sc := sim.Config{Engine: sim.EngineVLLM, Model: "m"}
			if c.marked {
				sc.SchedulingPolicy = sim.SchedulingPriority
			}
			e := startSim(t, sc)
			cfg := config.Default()
			cfg.Workers = []config.Worker{{URL: e.URL(), ForwardPriority: c.marked}}
			_, conn := startEPP(t, cfg)
			_, srv := dataPlane(t, conn)
			resp := post(t, srv.URL+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":2,"priority":-1000}`, "X-Baton-Priority", "batch")
			if b := readAll(t, resp.Body); resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			s := e.Stats()
			if c.marked && (s.RequestsWithPriority != 1 || s.LastPriority != 1) || !c.marked && s.RequestsWithPriority != 0 {
				t.Errorf("the engine got %d requests with a priority, the last %d", s.RequestsWithPriority, s.LastPriority)
			}
		})
	}
}

// A cap Baton cannot read as a non-negative integer is refused for a tenant under a token
// limit: an engine may read it anyway (pydantic takes "100000" and 1e5 as integers) while a
// smaller cap beside it would be all Baton reserved.
func TestTenantCapsMustBeIntegers(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineSGLang})
	cfg := testConfig(e.URL())
	hostileTenant(&cfg)
	_, gw := startGateway(t, cfg)
	for _, c := range []struct{ path, body, field string }{
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":10,"max_tokens":"100000"}`, "max_tokens"},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1e5}`, "max_tokens"},
		{"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":10.5}`, "max_tokens"},
		{"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":-1}`, "max_tokens"},
		{"/generate", `{"text":"hi","sampling_params":{"max_new_tokens":"9999"}}`, "sampling_params.max_new_tokens"},
	} {
		resp, b := tenantReq(t, gw.URL+c.path, "sk-hostile", c.body)
		if resp.StatusCode != 400 || !strings.Contains(b, `"param":"`+c.field+`"`) {
			t.Errorf("%s %s: %d %s", c.path, c.body, resp.StatusCode, b)
		}
	}
	if n := e.Stats().RequestsReceived; n != 0 {
		t.Errorf("%d refused requests reached the engine", n)
	}
}

// Caps and counts hidden from Baton in ways an engine still reads are refused for a tenant
// under a token limit: a member named twice inside sampling_params or stream_options (Baton
// and the engine would read different ones), a cap in another letter case (an engine decoding
// without regard to case reads it), best_of as a string. Nothing reaches the engine.
func TestTenantCannotHideACapFromBaton(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineSGLang})
	cfg := testConfig(e.URL())
	hostileTenant(&cfg)
	_, gw := startGateway(t, cfg)
	for _, c := range []struct{ path, body, code string }{
		{"/generate", `{"text":"hello world","sampling_params":{"max_new_tokens":5,"ignore_eos":true,"max_new_tokens":1000}}`, "duplicate_key"},
		{"/generate", `{"text":"hello world","sampling_params":{"max_new_tokens":5,"max_new_t\u006fkens":400}}`, "duplicate_key"},
		{"/generate", `{"text":"hello world","sampling_params":{"max_new_tokens":5,"MAX_NEW_TOKENS":800}}`, "duplicate_key"},
		{"/generate", `{"text":"hello world","sampling_params":{"MAX_NEW_TOKENS":800}}`, "invalid_request"},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true,"include_usage":false},"max_tokens":10}`, "duplicate_key"},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"MAX_TOKENS":1200}`, "duplicate_key"},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"MAX_TOKENS":1200}`, "invalid_request"},
		{"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":5,"N":3}`, "invalid_request"},
		{"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":500,"best_of":"10"}`, "invalid_request"},
	} {
		resp, b := tenantReq(t, gw.URL+c.path, "sk-hostile", c.body)
		if resp.StatusCode != 400 || !strings.Contains(b, c.code) {
			t.Errorf("%s %s: %d %s, want 400 %s", c.path, c.body, resp.StatusCode, b, c.code)
		}
	}
	if n := e.Stats().RequestsReceived; n != 0 {
		t.Errorf("%d refused requests reached the engine", n)
	}
}

// A request cut before any usage came is charged the prompt as the engine counts it (its
// /tokenize), not the body's bytes / 4: a prompt of one-letter words is about twice the tokens
// its bytes suggest.
func TestTenantCutRequestIsChargedTheEnginesPromptCount(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, PrefillPerToken: 2 * time.Millisecond})
	cfg := testConfig(e.URL())
	cfg.Tenants = []config.Tenant{{Name: "hostile", Keys: []string{config.HashKey("sk-hostile")},
		Limits: &config.Limits{TokensPerMinute: intp(100_000)}}}
	g, gw := startGateway(t, cfg)
	body := `{"model":"m","prompt":"` + words(2000) + `","max_tokens":10,"stream":true}` // 2,000 tokens in about 4 KB
	if status := cutAfter(t, gw.URL+"/v1/completions", body, 300*time.Millisecond); status != 0 {
		t.Fatalf("answered %d before the cut", status)
	}
	var got int64
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if got = charged(t, g, "hostile"); got >= 2000 {
			break
		}
	}
	if got < 2000 {
		t.Errorf("a stream cut during the prefill of a 2,000-token prompt was charged %d tokens", got)
	}
}

// The fields Baton owns never reach an engine in another letter case or spelling either: an
// engine decoding JSON without regard to case would read "PRIORITY" as priority.
func TestOwnedFieldsInAnySpellingNeverReachAnEngine(t *testing.T) {
	var mu sync.Mutex
	var got string
	engine := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = string(b)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	})
	_, gw := startGateway(t, testConfig(engine.URL))
	body := `{"model":"m","prompt":"hi","PRIORITY":-1000,"Kv_Transfer_Params":{"do_remote_prefill":true},"bootstr\u0061p_room":7,"x":1}`
	if resp, b := tenantReq(t, gw.URL+"/v1/completions", "", body); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	mu.Lock()
	defer mu.Unlock()
	if got != `{"model":"m","prompt":"hi","x":1}` {
		t.Errorf("the engine got %s", got)
	}
}

// The rules of the charge table for a request that ends without usage, each by its cause: the
// deadline passing before the answer (non-streamed: the prompt and the completion asked for),
// an engine failing after it accepted the request (the connection closed mid-answer, the stream
// cut by the engine: the prompt and the tokens relayed), and an engine refusing it (nothing).
func TestTenantChargeRules(t *testing.T) {
	prompt := words(400)
	for _, c := range []struct {
		name     string
		engine   func(t *testing.T) string
		tune     func(*config.Config)
		body     string
		min, max int64 // what the request is charged, inclusive
	}{
		{"deadline passed before the answer", func(t *testing.T) string {
			return simEngine(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 50 * time.Millisecond}).URL()
		}, requestTimeout(300 * time.Millisecond), `{"model":"m","prompt":"` + prompt + `","max_tokens":100,"ignore_eos":true}`, 400 + 100, 400 + 100},
		{"engine closed the connection after accepting", func(t *testing.T) string {
			return hangUp(t, 300*time.Millisecond).URL
		}, nil, `{"model":"m","prompt":"` + prompt + `","max_tokens":100}`, 200, 400 + 100},
		{"engine cut its stream", func(t *testing.T) string {
			return simEngine(t, sim.Config{Engine: sim.EngineVLLM, Faults: sim.Faults{DropAfter: 5}}).URL()
		}, nil, `{"model":"m","prompt":"` + prompt + `","max_tokens":100,"ignore_eos":true,"stream":true}`, 400 + 3, 400 + 6},
		{"engine refused it", func(t *testing.T) string {
			return simEngine(t, sim.Config{Engine: sim.EngineVLLM, Faults: sim.Faults{Status: 400}}).URL()
		}, nil, `{"model":"m","prompt":"` + prompt + `","max_tokens":100}`, 0, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := testConfig(c.engine(t))
			cfg.Retry.Disable = true
			cfg.Tenants = []config.Tenant{{Name: "hostile", Keys: []string{config.HashKey("sk-hostile")},
				Limits: &config.Limits{TokensPerMinute: intp(100_000)}}}
			if c.tune != nil {
				c.tune(&cfg)
			}
			g, gw := startGateway(t, cfg)
			cutAfter(t, gw.URL+"/v1/completions", c.body, 5*time.Second)
			var got int64
			for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				if got = charged(t, g, "hostile"); got >= c.min && got > 0 {
					break
				}
			}
			time.Sleep(50 * time.Millisecond) // a settlement that was to come has come
			if got = charged(t, g, "hostile"); got < c.min || got > c.max {
				t.Errorf("charged %d, want %d to %d", got, c.min, c.max)
			}
		})
	}
}

// hangUp is an engine that lists model m, accepts every request, and closes the connection
// after d without answering.
func hangUp(t *testing.T, d time.Duration) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm"}]}`)
			return
		}
		_, _ = io.ReadAll(r.Body)
		time.Sleep(d)
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close()
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

// smg's --trust-tenant-header: behind a proxy that sets it, the header names the tenant (its
// limits apply), whatever key the request carries; a name no tenant has is 401; without the flag
// the header names nobody and the key decides.
func TestTrustedTenantHeader(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	mk := func(trust, keys bool) string {
		cfg := testConfig(e.URL())
		cfg.Tenants = []config.Tenant{{Name: "a"}, {Name: "b", Limits: &config.Limits{RequestsPerMinute: intp(1)}}}
		if keys {
			cfg.Tenants[0].Keys, cfg.Tenants[1].Keys = []string{config.HashKey("sk-a")}, []string{config.HashKey("sk-b")}
		}
		cfg.TrustTenantHeader, cfg.TenantHeaderName = trust, "x-smg-tenant-id"
		_, gw := startGateway(t, cfg)
		return gw.URL
	}
	send := func(gw, key, tenant string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, gw+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"p","max_tokens":1}`))
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		if tenant != "" {
			req.Header.Set("X-Smg-Tenant-Id", tenant)
		}
		resp, b := tenantDo(t, req)
		return resp.StatusCode, b
	}
	// No tenant has a key: the trusted proxy's header names the tenant.
	gw := mk(true, false)
	if status, b := send(gw, "", "b"); status != 200 {
		t.Fatalf("the header names b: %d %s", status, b)
	}
	if status, b := send(gw, "", "b"); status != 429 || !strings.Contains(b, "tenant b") {
		t.Errorf("b's second request of the minute: %d %s, want b's 429", status, b)
	}
	if status, _ := send(gw, "", "nobody"); status != 401 {
		t.Errorf("a name no tenant has: %d", status)
	}
	if status, _ := send(gw, "", ""); status != 200 {
		t.Errorf("no header: tenant default: %d", status)
	}
	// Tenants have keys: the key names the tenant, as in smg; the header neither replaces a key
	// nor moves a request to another tenant's limits.
	gw = mk(true, true)
	if status, _ := send(gw, "", "b"); status != 401 {
		t.Errorf("no key, the header naming b: %d, want 401", status)
	}
	if status, _ := send(gw, "sk-wrong", "a"); status != 401 {
		t.Errorf("a wrong key, the header naming a: %d, want 401", status)
	}
	if status, _ := send(gw, "sk-b", "a"); status != 200 {
		t.Errorf("b's key naming a: %d", status)
	}
	if status, b := send(gw, "sk-b", "a"); status != 429 || !strings.Contains(b, "tenant b") {
		t.Errorf("b's key naming a, again: %d %s, want b's own 429", status, b)
	}
	gw = mk(false, true)
	if status, _ := send(gw, "", "b"); status != 401 {
		t.Errorf("untrusted header without a key: %d, want 401", status)
	}
	// Keyless tenants beside keyed ones could never be named: refused at startup.
	cfg := testConfig(e.URL())
	cfg.TrustTenantHeader = true
	cfg.Tenants = []config.Tenant{{Name: "a", Keys: []string{config.HashKey("sk-a")}}, {Name: "c"}}
	if _, err := cfg.ResolvedTenants(func(string) string { return "" }); err == nil || !strings.Contains(err.Error(), `tenant "c" has no key`) {
		t.Errorf("a keyless tenant beside keyed ones: %v", err)
	}
}

// A model's rule and the tenant's own limits both hold (as smg counts them): a model's rule
// never lifts the tenant's limit, and a request refused by one rule takes nothing from another.
func TestModelRuleAndTenantLimitBothHold(t *testing.T) {
	engine := fakeEngine(t, "vllm", []string{"llama", "qwen"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	})
	cfg := testConfig(engine.URL)
	cfg.Tenants = []config.Tenant{{Name: "red", Keys: []string{config.HashKey("sk-red")}, Limits: &config.Limits{RequestsPerMinute: intp(3)},
		ModelLimits: []config.Limits{{Model: "llama", RequestsPerMinute: intp(2)}}}}
	_, gw := startGateway(t, cfg)
	send := func(model string) (int, string) {
		resp, b := tenantReq(t, gw.URL+"/v1/completions", "sk-red", `{"model":"`+model+`","prompt":"p","max_tokens":1}`)
		return resp.StatusCode, b
	}
	var got []string
	for _, m := range []string{"llama", "llama", "llama", "qwen", "qwen"} {
		status, b := send(m)
		got = append(got, fmt.Sprintf("%s %d", m, status))
		if status == 429 && m == "llama" && !strings.Contains(b, "its limit for llama") {
			t.Errorf("llama's refusal does not name its rule: %s", b)
		}
	}
	// llama: 2 by its rule; the third refused by the rule took nothing from the tenant's 3, so
	// one qwen is admitted, the next refused by the tenant's own limit.
	if want := "llama 200, llama 200, llama 429, qwen 200, qwen 429"; strings.Join(got, ", ") != want {
		t.Errorf("got %s, want %s", strings.Join(got, ", "), want)
	}
}

// With a trusted tenant header and no keys, startup does not say every request is tenant
// default: the header names the tenants.
func TestStartupWordsOfTheTrustedHeader(t *testing.T) {
	cfg := testConfig("http://127.0.0.1:1")
	cfg.TrustTenantHeader = true
	cfg.Tenants = []config.Tenant{{Name: "a", Limits: &config.Limits{RequestsPerMinute: intp(2)}}}
	var buf strings.Builder
	log := slog.New(slog.NewTextHandler(&buf, nil))
	tn, err := newTenancy(cfg, metrics.New(worker.NewRegistry()), log)
	if err != nil {
		t.Fatal(err)
	}
	logTenants(log, cfg, tn)
	if strings.Contains(buf.String(), "every request is tenant default") {
		t.Errorf("a contradicting WARN: %s", buf.String())
	}
}

// SGLang's list-form sampling_params (one per prompt) is counted as SGLang runs it: the most
// samples and the largest max_new_tokens any entry asks, times the prompts — so it cannot
// under-reserve a tenant's tokens — and an entry naming no cap is refused (Baton writes none into a
// list).
func TestTenantListFormSamplingParams(t *testing.T) {
	engine := fakeEngine(t, "sglang", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `[{"text":"ok","meta_info":{"prompt_tokens":1,"completion_tokens":1}},{"text":"ok","meta_info":{"prompt_tokens":1,"completion_tokens":1}}]`)
	})
	cfg := testConfig(engine.URL)
	cfg.Tenants = []config.Tenant{{Name: "hostile", Keys: []string{config.HashKey("sk-hostile")}, Limits: &config.Limits{TokensPerMinute: intp(3000)}}}
	_, gw := startGateway(t, cfg)
	// 2 prompts × 4 samples × 400 tokens = 3,200: past the whole bucket of 3,000.
	resp, b := tenantReq(t, gw.URL+"/generate", "sk-hostile", `{"text":["a","b"],"sampling_params":[{"n":1,"max_new_tokens":10},{"n":4,"max_new_tokens":400}]}`)
	if resp.StatusCode != 429 || !strings.Contains(b, "tenant_request_too_large") {
		t.Errorf("a list asking 3,200 tokens of a 3,000 bucket: %d %s", resp.StatusCode, b)
	}
	resp, b = tenantReq(t, gw.URL+"/generate", "sk-hostile", `{"text":["a","b"],"sampling_params":[{"max_new_tokens":10},{"n":2}]}`)
	if resp.StatusCode != 400 || !strings.Contains(b, `sampling_params[1].max_new_tokens`) {
		t.Errorf("an entry without a cap: %d %s", resp.StatusCode, b)
	}
	resp, b = tenantReq(t, gw.URL+"/generate", "sk-hostile", `{"text":["a","b"],"sampling_params":[{"max_new_tokens":10},{"max_new_tokens":20}]}`)
	if resp.StatusCode != 200 {
		t.Errorf("a list within the bucket: %d %s", resp.StatusCode, b)
	}
}
