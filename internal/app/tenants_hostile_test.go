package app

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"strings"
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
