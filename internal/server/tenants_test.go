package server

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/kvfleet"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/tenant"
	"github.com/baton-llm/baton/internal/worker"
)

// intp is a pointer to n (a limit in the configuration).
func intp(n int) *int { return &n }

// tenancyFrom is the tenancy of cfg's tenants as the gateway builds it: counted in memory,
// cfg's tenant_max_tokens_estimate, the trusted tenant header when cfg trusts it.
func tenancyFrom(t *testing.T, cfg config.Config) director.Tenancy {
	t.Helper()
	set, err := tenant.Build(cfg, os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	ten := director.Tenancy{Set: func() *tenant.Set { return set }, Limiter: tenant.NewLimiter(nil), MaxTokens: cfg.TenantMaxTokens}
	if cfg.TrustTenantHeader {
		ten.TrustHeader = cfg.TenantHeaderName
	}
	return ten
}

// withTenants gives o the tenancy of tenants (the rest of the configuration its default),
// prompts counted by the engines' /tokenize as the gateway counts them.
func withTenants(t *testing.T, o *Options, tenants ...config.Tenant) {
	t.Helper()
	cfg := config.Default()
	cfg.Tenants = tenants
	o.Director.Tenancy = tenancyFrom(t, cfg)
	countingPrompts(o)
}

// countingPrompts wires the tenancy's prompt counts to the workers' /tokenize, as the gateway
// does (kvfleet: a cached answer for a reservation, an ask for a default cap and when a request
// is settled).
func countingPrompts(o *Options) {
	kv := kvfleet.New(config.Default(), nil, o.Director.Registry, slog.New(slog.DiscardHandler))
	kv.SetTokenizeClient(&http.Client{})
	o.Director.Tenancy.PromptTokens, o.Director.Tenancy.CountPrompt = kv.PromptTokens, kv.CountPromptTokens
	o.Director.Tenancy.AskPrompt = kv.AskPromptTokens
}

// hostile is a tenant of key sk-hostile at tpm tokens per minute.
func hostile(tpm int) config.Tenant {
	return config.Tenant{Name: "hostile", Keys: []string{config.HashKey("sk-hostile")}, Limits: &config.Limits{TokensPerMinute: intp(tpm)}}
}

// asTenant posts body to url with key as its bearer key ("" for none) and reads the answer.
func asTenant(t *testing.T, url, key, body string, header ...string) (*http.Response, string) {
	t.Helper()
	if key != "" {
		header = append(header, "Authorization", "Bearer "+key)
	}
	return post(t, url, body, header...)
}

// chargedTo is what the server charged tenant's first rule so far (GET /tenants'
// tokens_charged).
func chargedTo(t *testing.T, s *Server, name string) int64 {
	t.Helper()
	views, _ := s.Director().TenantViews(t.Context())
	for _, v := range views {
		if v.Name == name && len(v.Rules) > 0 {
			return v.Rules[0].TokensCharged
		}
	}
	t.Fatalf("no tenant %s with a rule", name)
	return 0
}

// settledCharge is what tenant was charged once every request ended: no handler runs (a
// request's lease is settled as its handler returns) and no settlement waits on a worker's count
// of a prompt.
func settledCharge(t *testing.T, s *Server, name string) int64 {
	t.Helper()
	poll.Until(t, "every request ended", func() bool { return s.InFlight() == 0 })
	s.Director().Wait()
	return chargedTo(t, s, name)
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

// words is a prompt of n words: n tokens to the simulators.
func words(n int) string { return strings.TrimSpace(strings.Repeat("w ", n)) }

// simOf starts a simulated engine of model m.
func simOf(t *testing.T, c sim.Config) *sim.Engine {
	t.Helper()
	c.Model = "m"
	return startSim(t, c)
}

// sglangServing adds an SGLang worker at url serving m.
func sglangServing(t *testing.T, url string) func(*Options) {
	return func(o *Options) {
		serving(t, o, config.Worker{URL: url, Runtime: config.RuntimeSGLang, Models: []string{"m"}})
	}
}

// answering is an engine recording each request's path and body, answering a completion.
func answering(t *testing.T, seen *bodies) string {
	return engine(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		seen.add(r.URL.Path + " " + string(b))
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	})
}

// A stream whose client leaves is settled with what it relayed: less than reserved, more than
// nothing; its slot is freed.
func TestTenantStreamLeftMidwayIsSettled(t *testing.T) {
	e := simOf(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 20 * time.Millisecond})
	s, gw, _ := gateway(t, []string{e.URL()}, func(o *Options) {
		withTenants(t, o, config.Tenant{Name: "team", Keys: []string{config.HashKey("sk-team")},
			Limits: &config.Limits{TokensPerMinute: intp(100_000_000), MaxConcurrent: intp(1)}})
	})
	leaveAfter(t, gw+"/v1/chat/completions", "sk-team", `{"model":"m","messages":[{"role":"user","content":"a long story"}],"max_tokens":500,"stream":true}`, 5)
	if got := settledCharge(t, s, "team"); got < 5 || got >= 500 {
		t.Errorf("charged %d for a stream left after 5 events of 500 tokens", got)
	}
	if resp, b := asTenant(t, gw+"/v1/completions", "sk-team", `{"model":"m","prompt":"x","max_tokens":1}`); resp.StatusCode != 200 {
		t.Errorf("the slot was not freed: %d %s", resp.StatusCode, b)
	}
}

// Without keys or limits nothing is named or counted per tenant: one tenant, unbounded, costs
// the hot path nothing; with limits and no keys, everyone is tenant default, limited.
func TestNoTenantsCountNothing(t *testing.T) {
	e := simOf(t, sim.Config{Engine: sim.EngineVLLM})
	s, gw, _ := gateway(t, []string{e.URL()})
	if resp, b := asTenant(t, gw+"/v1/completions", "", `{"model":"m","prompt":"x","max_tokens":1}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if m := scrape(t, s); strings.Contains(m, "baton_tenant_requests_total{") {
		t.Error("tenant series without tenants")
	}
	s2, gw2, _ := gateway(t, []string{e.URL()}, func(o *Options) {
		withTenants(t, o, config.Tenant{Name: "default", Limits: &config.Limits{RequestsPerMinute: intp(1)}})
	})
	asTenant(t, gw2+"/v1/completions", "", `{"model":"m","prompt":"x","max_tokens":1}`)
	if resp, b := asTenant(t, gw2+"/v1/completions", "", `{"model":"m","prompt":"x","max_tokens":1}`); resp.StatusCode != 429 {
		t.Errorf("limits without keys do not hold for everyone: %d %s", resp.StatusCode, b)
	}
	if m := scrape(t, s2); !strings.Contains(m, `baton_tenant_requests_total{code="200",model="m",tenant="default"} 1`) {
		t.Error("the default tenant's request is not counted")
	}
}

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
			e := simOf(t, c.sim)
			s, gw, _ := gateway(t, []string{e.URL()}, func(o *Options) { withTenants(t, o, hostile(3000)) })
			// One request: charged, not nothing.
			if status := cutAfter(t, gw+"/v1/completions", c.body, c.cut); status != 0 {
				t.Fatalf("the answer's head came before the cut (%d): the test cuts too late", status)
			}
			if got := settledCharge(t, s, "hostile"); got < c.per {
				t.Fatalf("a request cut before its first byte was charged %d tokens, want at least %d", got, c.per)
			}
			// The storm: the bucket empties, and the rest are refused before they reach the engine.
			before := e.Stats().RequestsReceived
			for range 20 {
				cutAfter(t, gw+"/v1/completions", c.body, c.cut)
			}
			if got := e.Stats().RequestsReceived - before; got > 6 {
				t.Errorf("%d of 20 cut requests reached the engine at 3,000 tokens per minute: leaving early escapes the limit", got)
			}
		})
	}
}

// Under a token limit the reservation is the request's own cap, not one capped at the default
// estimate: two requests asking 1,600 tokens each cannot both run against 3,000 tokens per
// minute (capped at 1,024 each, both were admitted and the engine generated 3,200 inside a
// second).
func TestTenantReservesTheRequestsOwnCap(t *testing.T) {
	e := newHeldEngine(t) // holds each request until released: both would run at once
	_, gw, _ := gateway(t, []string{e.URL}, func(o *Options) { withTenants(t, o, hostile(3000)) })
	t.Cleanup(e.release) // before the gateway closes: it waits for a held request's handler
	body := `{"model":"m","prompt":"holder","max_tokens":1600,"ignore_eos":true}`
	statuses := make(chan int, 2)
	for range 2 {
		go func() {
			req, _ := http.NewRequest(http.MethodPost, gw+"/v1/completions", strings.NewReader(body))
			req.Header.Set("Authorization", "Bearer sk-hostile")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				statuses <- 0
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses <- resp.StatusCode
		}()
	}
	var got []int
	select {
	case s := <-statuses: // the one refused, while the other is held
		got = append(got, s)
	case <-time.After(poll.Timeout): // both held: both were admitted
	}
	e.release()
	for len(got) < 2 {
		got = append(got, <-statuses)
	}
	ok := 0
	for _, s := range got {
		if s == 200 {
			ok++
		}
	}
	if ok != 1 {
		t.Errorf("two requests of 1,600 tokens against 3,000 per minute: statuses %v, want one 200 and one 429", got)
	}
}

// A request of a limited tenant that names no cap gets the default written into the body the
// engine receives — and only that: every other byte as the client sent it.
func TestTenantDefaultCapIsWritten(t *testing.T) {
	var seen bodies
	url := answering(t, &seen)
	_, gw, _ := gateway(t, []string{url}, func(o *Options) {
		cfg := config.Default()
		cfg.Tenants, cfg.TenantMaxTokens = []config.Tenant{hostile(3000)}, 64
		o.Director.Tenancy = tenancyFrom(t, cfg)
		countingPrompts(o)
	})
	for _, c := range []struct{ path, body, want string }{
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"h\u00e9"}],"seed":12345678901234567890}`, `,"max_tokens":64}`},
		{"/v1/completions", `{"model":"m","prompt":"hi"}`, `,"max_tokens":16}`},
		{"/v1/responses", `{"model":"m","input":"hi"}`, `,"max_output_tokens":64}`},
	} {
		before := len(seen.all())
		if resp, b := asTenant(t, gw+c.path, "sk-hostile", c.body); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", c.path, resp.StatusCode, b)
		}
		got := seen.all()[before:]
		want := c.path + " " + strings.TrimSuffix(c.body, "}") + c.want
		if len(got) != 1 || got[0] != want {
			t.Errorf("the engine got %q, want %q", got, want)
		}
	}
	// Anthropic's messages protocol requires max_tokens: refused, not sent uncapped.
	resp, b := asTenant(t, gw+"/v1/messages", "sk-hostile", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 400 || !strings.Contains(b, `"param":"max_tokens"`) {
		t.Errorf("/v1/messages without max_tokens: %d %s", resp.StatusCode, b)
	}
	// A bucket smaller than the default: the default written is what the bucket holds beside
	// the prompt, not a refusal of every request that names no cap.
	_, gw2, _ := gateway(t, []string{url}, func(o *Options) { withTenants(t, o, hostile(1000)) })
	before := len(seen.all())
	body := `{"model":"m","messages":[{"role":"user","content":"` + words(100) + `"}]}`
	if resp, b := asTenant(t, gw2+"/v1/chat/completions", "sk-hostile", body); resp.StatusCode != 200 {
		t.Fatalf("a 1,000-token bucket, no cap named: %d %s", resp.StatusCode, b)
	}
	if got := seen.all()[before:]; len(got) != 1 || !strings.Contains(got[0], `,"max_tokens":`) || strings.Contains(got[0], `"max_tokens":1024`) {
		t.Errorf("the engine got %q: want a cap the bucket holds", got)
	}
}

// fixedFleet is an admin fleet that changes nothing: with it the admin API mounts its worker
// routes.
type fixedFleet struct{}

func (fixedFleet) Add(config.Worker, string) (*worker.Worker, error) { return nil, errFixed }
func (fixedFleet) Update(string, config.WorkerPatch, string) (*worker.Worker, error) {
	return nil, errFixed
}
func (fixedFleet) Remove(string, string) (*worker.Worker, error) { return nil, errFixed }

var errFixed = errors.New("the fleet is fixed")

// A tenant sees only its own part of the fleet: with another tenant's key, every read-only
// route of the API port either refuses or answers without the fleet (no engine URL, no model of
// the other tenant), and a model of the other tenant is the 404 of a model nobody serves.
func TestTenantKeyOnEveryReadOnlyRoute(t *testing.T) {
	a := simOf(t, sim.Config{Engine: sim.EngineVLLM})
	_, gw, _ := gateway(t, []string{a.URL()}, func(o *Options) {
		o.Admin.Keys, o.Admin.Fleet = []string{"sk-admin"}, fixedFleet{} // the worker routes mounted, as the gateway mounts them
		withTenants(t, o,
			config.Tenant{Name: "a", Keys: []string{config.HashKey("sk-a")}, Models: []string{"m"}},
			config.Tenant{Name: "b", Keys: []string{config.HashKey("sk-b")}, Models: []string{"other"}})
	})
	get := func(path, key string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, gw+path, nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode, string(b)
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
	_, unknown := asTenant(t, gw+"/v1/completions", "sk-b", `{"model":"nope","prompt":"hi","max_tokens":1}`)
	resp, other := asTenant(t, gw+"/v1/completions", "sk-b", `{"model":"m","prompt":"hi","max_tokens":1}`)
	if resp.StatusCode != 404 || strings.ReplaceAll(other, `\"m\"`, `\"nope\"`) != unknown {
		t.Errorf("tenant a's model asked with b's key: %d %s; a model nobody serves: %s", resp.StatusCode, other, unknown)
	}
}

// Waiting does not lift a request above its tenant's max_priority: with every unreserved slot
// taken and one kept for critical work, a batch tenant's request waits out its queue timeout
// (504) however many promotion periods pass, while a tenant allowed critical is promoted into
// the kept slot.
func TestPromotionThroughTheGatewayStopsAtTheCeiling(t *testing.T) {
	e := newHeldEngine(t)
	s, gw, _ := gateway(t, []string{e.URL}, func(o *Options) {
		o.Director.Admission = config.Default().Admission
		o.Director.Admission.MaxConcurrentRequests, o.Director.Admission.QueueSize = 2, 10
		o.Director.Admission.ReservedSlots = map[string]int{"critical": 1}
		o.Director.Admission.PromoteAfter = 50 * time.Millisecond
		o.Director.Admission.QueueTimeout = 800 * time.Millisecond
		withTenants(t, o,
			config.Tenant{Name: "app", Keys: []string{config.HashKey("sk-app")}, MaxPriority: "critical"},
			config.Tenant{Name: "etl", Keys: []string{config.HashKey("sk-etl")}, MaxPriority: "batch"})
	})
	ctx, cancel := context.WithCancel(context.Background())
	s.Start(ctx) // the queue's promotions
	t.Cleanup(func() { cancel(); s.Wait() })
	// The holder keeps the unreserved slot until released.
	t.Cleanup(e.release) // before the gateway closes: it waits for the holder's handler
	holder := make(chan int, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, gw+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"holder","max_tokens":300,"ignore_eos":true}`))
		req.Header.Set("Authorization", "Bearer sk-app")
		req.Header.Set(openai.HeaderPriority, "batch")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			holder <- 0
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		holder <- resp.StatusCode
	}()
	poll.Until(t, "the holder reached the engine", func() bool { return len(e.prompts.all()) == 1 })
	resp, b := asTenant(t, gw+"/v1/completions", "sk-etl", `{"model":"m","prompt":"p","max_tokens":1}`, openai.HeaderPriority, "batch")
	if resp.StatusCode != 504 || !strings.Contains(b, "queue_timeout") {
		t.Errorf("a batch tenant's request after 16 promotion periods: %d %s (X-Baton-Priority %q), want 504 queue_timeout: it must not reach the slot kept for critical",
			resp.StatusCode, b, resp.Header.Get(openai.HeaderPriority))
	}
	resp, b = asTenant(t, gw+"/v1/completions", "sk-app", `{"model":"m","prompt":"p","max_tokens":1}`, openai.HeaderPriority, "batch")
	if resp.StatusCode != 200 {
		t.Errorf("a tenant allowed critical, promoted while it waited: %d %s", resp.StatusCode, b)
	}
	e.release()
	if st := <-holder; st != 200 {
		t.Errorf("the holder: %d", st)
	}
}

// A cap Baton cannot read as a non-negative integer is refused for a tenant under a token
// limit: an engine may read it anyway (pydantic takes "100000" and 1e5 as integers) while a
// smaller cap beside it would be all Baton reserved.
func TestTenantCapsMustBeIntegers(t *testing.T) {
	e := simOf(t, sim.Config{Engine: sim.EngineSGLang})
	_, gw, _ := gateway(t, nil, sglangServing(t, e.URL()), func(o *Options) { withTenants(t, o, hostile(3000)) })
	for _, c := range []struct{ path, body, field string }{
		{"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":10.5}`, "max_tokens"},
		{"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":"1e2"}`, "max_tokens"},
		{"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":" 100"}`, "max_tokens"},
		{"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":-1}`, "max_tokens"},
		{"/generate", `{"text":"hi","sampling_params":{"max_new_tokens":"9999"}}`, "sampling_params.max_new_tokens"},
	} {
		resp, b := asTenant(t, gw+c.path, "sk-hostile", c.body)
		if resp.StatusCode != 400 || !strings.Contains(b, `"param":"`+c.field+`"`) {
			t.Errorf("%s %s: %d %s", c.path, c.body, resp.StatusCode, b)
		}
	}
	if n := e.Stats().RequestsReceived; n != 0 {
		t.Errorf("%d refused requests reached the engine", n)
	}
	// A cap spelled as the engines' request models still read it — a number with no fraction, a
	// string of digits — is that cap: reserved and sent as the client wrote it.
	for _, cap := range []string{`100.0`, `"100"`, `1e2`} {
		body := `{"model":"m","prompt":"hi","max_tokens":` + cap + `}`
		resp, b := asTenant(t, gw+"/v1/completions", "sk-hostile", body)
		if resp.StatusCode != 200 || resp.Header.Get("X-Ratelimit-Remaining-Tokens") == "" {
			t.Errorf("max_tokens %s: %d %s", cap, resp.StatusCode, b)
		}
	}
	// Read so, a cap past the tenant's whole bucket is refused as one written plainly.
	for _, cap := range []string{`"100000"`, `1e5`} {
		resp, b := asTenant(t, gw+"/v1/chat/completions", "sk-hostile", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":10,"max_tokens":`+cap+`}`)
		if resp.StatusCode != 429 || !strings.Contains(b, `"param":"max_tokens"`) {
			t.Errorf("max_tokens %s: %d %s", cap, resp.StatusCode, b)
		}
	}
}

// Caps and counts hidden from Baton in ways an engine still reads are refused for a tenant
// under a token limit: a member named twice inside sampling_params or stream_options (Baton
// and the engine would read different ones), a cap in another letter case (an engine decoding
// without regard to case reads it), best_of as a string. Nothing reaches the engine.
func TestTenantCannotHideACapFromBaton(t *testing.T) {
	e := simOf(t, sim.Config{Engine: sim.EngineSGLang})
	_, gw, _ := gateway(t, nil, sglangServing(t, e.URL()), func(o *Options) { withTenants(t, o, hostile(3000)) })
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
		resp, b := asTenant(t, gw+c.path, "sk-hostile", c.body)
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
	e := simOf(t, sim.Config{Engine: sim.EngineVLLM, PrefillPerToken: 2 * time.Millisecond})
	s, gw, _ := gateway(t, []string{e.URL()}, func(o *Options) { withTenants(t, o, hostile(100_000)) })
	body := `{"model":"m","prompt":"` + words(2000) + `","max_tokens":10,"stream":true}` // 2,000 tokens in about 4 KB
	if status := cutAfter(t, gw+"/v1/completions", body, 300*time.Millisecond); status != 0 {
		t.Fatalf("answered %d before the cut", status)
	}
	if got := settledCharge(t, s, "hostile"); got < 2000 {
		t.Errorf("a stream cut during the prefill of a 2,000-token prompt was charged %d tokens", got)
	}
}

// The fields Baton owns never reach an engine in another letter case or spelling either: an
// engine decoding JSON without regard to case would read "PRIORITY" as priority.
func TestOwnedFieldsInAnySpellingNeverReachAnEngine(t *testing.T) {
	var seen bodies
	_, gw, _ := gateway(t, []string{answering(t, &seen)})
	body := `{"model":"m","prompt":"hi","PRIORITY":-1000,"Kv_Transfer_Params":{"do_remote_prefill":true},"bootstr\u0061p_room":7,"x":1}`
	if resp, b := asTenant(t, gw+"/v1/completions", "", body); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if got := seen.all(); len(got) != 1 || got[0] != `/v1/completions {"model":"m","prompt":"hi","x":1}` {
		t.Errorf("the engine got %q", got)
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
		timeout  time.Duration // the request deadline (0: the fixture's)
		body     string
		min, max int64 // what the request is charged, inclusive
	}{
		{"deadline passed before the answer", func(t *testing.T) string {
			return simOf(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 50 * time.Millisecond}).URL()
		}, 300 * time.Millisecond, `{"model":"m","prompt":"` + prompt + `","max_tokens":100,"ignore_eos":true}`, 400 + 100, 400 + 100},
		{"engine closed the connection after accepting", func(t *testing.T) string {
			return hangUp(t, 300*time.Millisecond)
		}, 0, `{"model":"m","prompt":"` + prompt + `","max_tokens":100}`, 400, 2*400 + 100}, // an engine that cannot count: the prompt's bytes
		{"engine cut its stream", func(t *testing.T) string {
			return simOf(t, sim.Config{Engine: sim.EngineVLLM, Faults: sim.Faults{DropAfter: 5}}).URL()
		}, 0, `{"model":"m","prompt":"` + prompt + `","max_tokens":100,"ignore_eos":true,"stream":true}`, 400 + 3, 400 + 6},
		{"engine refused it", func(t *testing.T) string {
			return simOf(t, sim.Config{Engine: sim.EngineVLLM, Faults: sim.Faults{Status: 400}}).URL()
		}, 0, `{"model":"m","prompt":"` + prompt + `","max_tokens":100}`, 0, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, gw, _ := gateway(t, []string{c.engine(t)}, func(o *Options) {
				o.Director.Retry.Disable = true
				if c.timeout > 0 {
					o.RequestTimeout = c.timeout
				}
				withTenants(t, o, hostile(100_000))
			})
			cutAfter(t, gw+"/v1/completions", c.body, 5*time.Second)
			if got := settledCharge(t, s, "hostile"); got < c.min || got > c.max {
				t.Errorf("charged %d, want %d to %d", got, c.min, c.max)
			}
		})
	}
}

// hangUp is an engine that accepts every request and closes the connection after d without
// answering.
func hangUp(t *testing.T, d time.Duration) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		select {
		case <-time.After(d): // the engine computes, then fails
		case <-r.Context().Done():
		}
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close()
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// smg's --trust-tenant-header: behind a proxy that sets it, the header names the tenant (its
// limits apply), whatever key the request carries; a name no tenant has is 401; without the flag
// the header names nobody and the key decides.
func TestTrustedTenantHeader(t *testing.T) {
	e := simOf(t, sim.Config{Engine: sim.EngineVLLM})
	mk := func(trust, keys bool) string {
		cfg := config.Default()
		cfg.Tenants = []config.Tenant{{Name: "a"}, {Name: "b", Limits: &config.Limits{RequestsPerMinute: intp(1)}}}
		if keys {
			cfg.Tenants[0].Keys, cfg.Tenants[1].Keys = []string{config.HashKey("sk-a")}, []string{config.HashKey("sk-b")}
		}
		cfg.TrustTenantHeader, cfg.TenantHeaderName = trust, "x-smg-tenant-id"
		_, gw, _ := gateway(t, []string{e.URL()}, func(o *Options) { o.Director.Tenancy = tenancyFrom(t, cfg) })
		return gw
	}
	send := func(gw, key, tenant string) (int, string) {
		var h []string
		if tenant != "" {
			h = []string{"X-Smg-Tenant-Id", tenant}
		}
		resp, b := asTenant(t, gw+"/v1/completions", key, `{"model":"m","prompt":"p","max_tokens":1}`, h...)
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
	cfg := config.Default()
	cfg.TrustTenantHeader = true
	cfg.Tenants = []config.Tenant{{Name: "a", Keys: []string{config.HashKey("sk-a")}}, {Name: "c"}}
	if _, err := cfg.ResolvedTenants(func(string) string { return "" }); err == nil || !strings.Contains(err.Error(), `tenant "c" has no key`) {
		t.Errorf("a keyless tenant beside keyed ones: %v", err)
	}
}

// A model's rule and the tenant's own limits both hold (as smg counts them): a model's rule
// never lifts the tenant's limit, and a request refused by one rule takes nothing from another.
func TestModelRuleAndTenantLimitBothHold(t *testing.T) {
	var seen bodies
	url := answering(t, &seen)
	_, gw, _ := gateway(t, nil, func(o *Options) {
		serving(t, o, vllm(url, "llama", "qwen"))
		withTenants(t, o, config.Tenant{Name: "red", Keys: []string{config.HashKey("sk-red")}, Limits: &config.Limits{RequestsPerMinute: intp(3)},
			ModelLimits: []config.Limits{{Model: "llama", RequestsPerMinute: intp(2)}}})
	})
	var got []string
	for _, m := range []string{"llama", "llama", "llama", "qwen", "qwen"} {
		resp, b := asTenant(t, gw+"/v1/completions", "sk-red", `{"model":"`+m+`","prompt":"p","max_tokens":1}`)
		got = append(got, fmt.Sprintf("%s %d", m, resp.StatusCode))
		if resp.StatusCode == 429 && m == "llama" && !strings.Contains(b, "its limit for llama") {
			t.Errorf("llama's refusal does not name its rule: %s", b)
		}
	}
	// llama: 2 by its rule; the third refused by the rule took nothing from the tenant's 3, so
	// one qwen is admitted, the next refused by the tenant's own limit.
	if want := "llama 200, llama 200, llama 429, qwen 200, qwen 429"; strings.Join(got, ", ") != want {
		t.Errorf("got %s, want %s", strings.Join(got, ", "), want)
	}
}

// A tenant's token counters add up to what its limits were charged: an answer that ended whole
// (its usage), a stream its client left and an answer cut while generating (what the engine did
// for them) — not only the answers that carried usage, which left a tenant's hang-ups out of
// baton_tenant_tokens_total while its limits were charged them.
func TestTenantTokensCountWhatWasCharged(t *testing.T) {
	e := simOf(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 20 * time.Millisecond})
	s, gw, _ := gateway(t, []string{e.URL()}, func(o *Options) {
		withTenants(t, o, config.Tenant{Name: "team", Keys: []string{config.HashKey("sk-team")},
			Limits: &config.Limits{TokensPerMinute: intp(100_000_000)}})
	})
	if resp, b := asTenant(t, gw+"/v1/completions", "sk-team", `{"model":"m","prompt":"`+words(30)+`","max_tokens":3}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	leaveAfter(t, gw+"/v1/completions", "sk-team", `{"model":"m","prompt":"`+words(40)+`","max_tokens":500,"ignore_eos":true,"stream":true}`, 5)
	cut, cancelCut := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancelCut()
	req, _ := http.NewRequestWithContext(cut, http.MethodPost, gw+"/v1/completions",
		strings.NewReader(`{"model":"m","prompt":"`+words(50)+`","max_tokens":100,"ignore_eos":true}`))
	req.Header.Set("Authorization", "Bearer sk-team")
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatal("the answer cut while generating came whole")
	}
	charged := settledCharge(t, s, "team")
	var counted float64
	for _, line := range strings.Split(scrape(t, s), "\n") {
		if strings.HasPrefix(line, "baton_tenant_tokens_total{") && strings.Contains(line, `tenant="team"`) && !strings.Contains(line, `kind="cached"`) {
			v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
			if err != nil {
				t.Fatal(line)
			}
			counted += v
		}
	}
	// Charged: 33 for the whole answer, at least 45 for the stream, 150 for the cut answer.
	if charged < 33+45+150 || int64(counted) != charged {
		t.Errorf("baton_tenant_tokens_total counts %.0f tokens for tenant team, its limits were charged %d", counted, charged)
	}
}

// readEvents reads n data events of the stream resp.
func readEvents(t *testing.T, resp *http.Response, n int) {
	t.Helper()
	r := bufio.NewReader(resp.Body)
	for events := 0; events < n; {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatal(resp.Status, line, err)
		}
		if strings.HasPrefix(line, "data: ") {
			events++
		}
	}
}

// An unlimited tenant's streams are counted in its token counters too: Baton asks the engine for
// the usage the client did not, and keeps that event from the client (a hostile review found an
// unlimited tenant's streamed traffic, most of it, missing from baton_tenant_tokens_total).
func TestAnUnlimitedTenantsStreamsAreCounted(t *testing.T) {
	e := simOf(t, sim.Config{Engine: sim.EngineVLLM})
	s, gw, _ := gateway(t, []string{e.URL()}, func(o *Options) {
		withTenants(t, o, config.Tenant{Name: "free", Keys: []string{config.HashKey("sk-free")}},
			config.Tenant{Name: "team", Keys: []string{config.HashKey("sk-team")}, Limits: &config.Limits{TokensPerMinute: intp(1_000_000)}})
	})
	resp, b := asTenant(t, gw+"/v1/completions", "sk-free", `{"model":"m","prompt":"`+words(8)+`","max_tokens":10,"ignore_eos":true,"stream":true}`)
	if resp.StatusCode != 200 || !strings.Contains(b, "data: [DONE]") || strings.Contains(b, `"usage"`) {
		t.Fatalf("the client did not ask for usage and must see none: %d %q", resp.StatusCode, b)
	}
	poll.Until(t, "the stream counted", func() bool { return s.InFlight() == 0 })
	m := scrape(t, s)
	for _, want := range []string{`baton_tenant_tokens_total{kind="prompt",model="m",tenant="free"} 8`, `baton_tenant_tokens_total{kind="completion",model="m",tenant="free"} 10`} {
		if !strings.Contains(m, want) {
			t.Errorf("no %s in:\n%s", want, grepLines(m, "baton_tenant_tokens_total"))
		}
	}
}

// grepLines is the lines of text containing s.
func grepLines(text, s string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// leaveAfter posts body as the tenant of key, reads n events of its stream and hangs up.
func leaveAfter(t *testing.T, url, key, body string, n int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	readEvents(t, resp, n)
}

// A tenant's stream cut short was charged one token per event that matched three compact
// spellings: reasoning, tool-call arguments and spaced JSON counted nothing, and an event of k
// tokens (--stream-interval, speculative decoding) counted one. Under a token limit the engine
// is asked for its count on every event (continuous_usage_stats) and the stream is charged the
// last it reported; the client, which asked none of it, sees its events as the engine would have
// written them (vLLM: no usage; SGLang: a null one), whole and with its final usage when it
// asked for that.
func TestTenantCutStreamIsChargedWhatTheEngineReported(t *testing.T) {
	for _, engine := range []string{sim.EngineVLLM, sim.EngineSGLang} {
		for _, opts := range []string{"", `,"stream_options":{"include_usage":true}`} {
			t.Run(engine+opts, func(t *testing.T) {
				t.Parallel()
				e := simOf(t, sim.Config{Engine: engine, StreamInterval: 4, DecodePerToken: 10 * time.Millisecond})
				rt := config.RuntimeVLLM
				if engine == sim.EngineSGLang {
					rt = config.RuntimeSGLang
				}
				s, gw, _ := gateway(t, nil, func(o *Options) {
					serving(t, o, config.Worker{URL: e.URL(), Runtime: rt, Models: []string{"m"}})
					withTenants(t, o, hostile(100_000_000))
				})
				body := `{"model":"m","messages":[{"role":"user","content":"` + words(20) + `"}],"max_tokens":400,"ignore_eos":true,"stream":true` + opts + `}`
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw+"/v1/chat/completions", strings.NewReader(body))
				req.Header.Set("Authorization", "Bearer sk-hostile")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				r := bufio.NewReader(resp.Body)
				const events = 11 // the role's event, then ten of four tokens each
				for n := 0; n < events; {
					line, err := r.ReadString('\n')
					if err != nil {
						t.Fatal(resp.Status, line, err)
					}
					if !strings.HasPrefix(line, "data: ") {
						continue
					}
					n++
					switch {
					case engine == sim.EngineVLLM && strings.Contains(line, `"usage"`):
						t.Errorf("an event carries a usage vLLM would not have written: %s", line)
					case engine == sim.EngineSGLang && !strings.Contains(line, `"usage":null`):
						t.Errorf("an event lost the null usage SGLang writes: %s", line)
					}
				}
				cancel()
				resp.Body.Close()
				got := settledCharge(t, s, "hostile")
				st := e.Stats()
				prompt := st.PromptTokensRecompute + st.PromptTokensLocalCache + st.PromptTokensRemote
				if got < prompt+40 || got > prompt+400 {
					t.Errorf("charged %d for a stream cut after 40 of its tokens reached the client (prompt %d)", got, prompt)
				}
			})
		}
	}
	// A stream read to its end: the client that asked for its usage gets it, once, last.
	e := simOf(t, sim.Config{Engine: sim.EngineVLLM, StreamInterval: 3})
	_, gw, _ := gateway(t, []string{e.URL()}, func(o *Options) { withTenants(t, o, hostile(100_000_000)) })
	resp, b := asTenant(t, gw+"/v1/completions", "sk-hostile", `{"model":"m","prompt":"x","max_tokens":10,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`)
	last := strings.LastIndex(b, "data: {")
	if resp.StatusCode != 200 || strings.Count(b, `"usage"`) != 1 || last < 0 || !strings.Contains(b[last:], `"completion_tokens":10`) {
		t.Errorf("the client asked for the final usage alone: %d %s", resp.StatusCode, b)
	}
}

// SGLang's /generate answers a batch (a list of prompts, or n samples) with one object per
// sample, each with its own meta_info: only the last was read, so 12,500 tokens received were
// charged 1,255. Every sample's completion is charged, and each prompt once.
func TestTenantGenerateBatchIsChargedEverySample(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprint("stream=", stream), func(t *testing.T) {
			t.Parallel()
			e := simOf(t, sim.Config{Engine: sim.EngineSGLang})
			s, gw, _ := gateway(t, nil, sglangServing(t, e.URL()), func(o *Options) { withTenants(t, o, hostile(100_000_000)) })
			body := fmt.Sprintf(`{"text":["%s","%s","%s"],"sampling_params":{"n":2,"max_new_tokens":10,"ignore_eos":true},"stream":%v}`, words(30), words(50), words(70), stream)
			resp, b := asTenant(t, gw+"/generate", "sk-hostile", body)
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			st := e.Stats()
			prompt := st.PromptTokensRecompute + st.PromptTokensLocalCache
			if got, want := settledCharge(t, s, "hostile"), prompt+3*2*10; got != want {
				t.Errorf("charged %d for three prompts of %d tokens in all, each sampled twice for 10 tokens: want %d", got, prompt, want)
			}
		})
	}
}

// contextEngine is a vLLM engine of model m whose context is 4,096 tokens, counting every chat
// prompt 120 tokens (/tokenize, template applied) and recording the bodies of the requests it
// serves.
func contextEngine(t *testing.T, seen *bodies) string {
	return engine(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		if r.URL.Path == "/tokenize" {
			if !strings.Contains(string(b), `"messages"`) {
				w.WriteHeader(400)
				return
			}
			io.WriteString(w, `{"count":120,"max_model_len":4096,"tokens":[`+strings.TrimSuffix(strings.Repeat("7,", 120), ",")+`]}`)
			return
		}
		seen.add(r.URL.Path + " " + string(b))
		io.WriteString(w, `{"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":120,"completion_tokens":1,"total_tokens":121}}`)
	})
}

// withContext makes the gateway's workers report model m's card with max_model_len n, as vLLM's
// and SGLang's /v1/models do.
func withContext(n int) func(*Options) {
	return func(o *Options) {
		for _, w := range o.Director.Registry.Snapshot().Workers {
			card := []byte(`{"id":"m","object":"model","max_model_len":` + strconv.Itoa(n) + `}`)
			w.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM, Models: []worker.Model{{ID: "m", Card: card}}})
		}
	}
}

// Without a cap vLLM, SGLang and OpenAI generate to the end of the model's context: the default
// Baton writes for a limited tenant is that context less the prompt (the engine's count of it),
// not 1,024 that cut a reasoning model's answers short. A bucket that cannot hold it is a 400
// naming max_tokens, nothing sent: the client must send a cap that fits.
func TestTenantDefaultCapIsTheContextLeft(t *testing.T) {
	var seen bodies
	url := contextEngine(t, &seen)
	_, gw, _ := gateway(t, []string{url}, withContext(4096), func(o *Options) { withTenants(t, o, hostile(100_000)) })
	for _, c := range []struct{ path, body, want string }{
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"think hard"}]}`, `,"max_tokens":3976}`},
		{"/v1/responses", `{"model":"m","input":"think hard"}`, `,"max_output_tokens":3976}`},
	} {
		before := len(seen.all())
		if resp, b := asTenant(t, gw+c.path, "sk-hostile", c.body); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", c.path, resp.StatusCode, b)
		}
		want := c.path + " " + strings.TrimSuffix(c.body, "}") + c.want
		if got := seen.all()[before:]; len(got) != 1 || got[0] != want {
			t.Errorf("the engine got %q, want %q (4,096 less a prompt of 120)", got, want)
		}
	}
	// 3,976 tokens beside the prompt do not fit a bucket of 3,000: refused, naming the cap.
	_, gw2, _ := gateway(t, []string{url}, withContext(4096), func(o *Options) { withTenants(t, o, hostile(3000)) })
	before := len(seen.all())
	resp, b := asTenant(t, gw2+"/v1/chat/completions", "sk-hostile", `{"model":"m","messages":[{"role":"user","content":"think hard"}]}`)
	if resp.StatusCode != 400 || errorCode(t, b) != openai.CodeInvalidRequest || !strings.Contains(b, `"param":"max_tokens"`) ||
		!strings.Contains(b, "send max_tokens of at most 2880") {
		t.Errorf("no cap, a context larger than the bucket: %d %s, want 400 naming max_tokens", resp.StatusCode, b)
	}
	if got := seen.all()[before:]; len(got) != 0 {
		t.Errorf("the refused request reached the engine: %q", got)
	}
	// The cap it asks for is served as sent.
	if resp, b := asTenant(t, gw2+"/v1/chat/completions", "sk-hostile", `{"model":"m","messages":[{"role":"user","content":"think hard"}],"max_tokens":2880}`); resp.StatusCode != 200 {
		t.Errorf("the cap the refusal asked for: %d %s", resp.StatusCode, b)
	}
}

// A prompt Baton cannot send to /tokenize whole is still charged what the engine computed, cut
// before its first byte: a list of prompts is counted item by item, /v1/responses and
// /v1/messages as the chat messages they are (4,800 tokens in 9.6 KB were charged 2,419, their
// bytes / 4).
func TestTenantCutUncountableShapesAreChargedTheEnginesCount(t *testing.T) {
	item := `"` + words(1200) + `"`
	text := words(4800)
	chat := `{"model":"m","messages":[{"role":"user","content":"` + text + `"}],"max_tokens":10,"stream":true}`
	for _, c := range []struct {
		name, engine, path, body string
	}{
		{"a list of prompts", sim.EngineVLLM, "/v1/completions", `{"model":"m","prompt":[` + strings.Repeat(item+",", 3) + item + `],"max_tokens":10,"stream":true}`},
		{"responses", sim.EngineVLLM, "/v1/responses", `{"model":"m","input":"` + text + `","max_output_tokens":10,"stream":true}`},
		{"messages", sim.EngineVLLM, "/v1/messages", chat},
		// SGLang's /tokenize takes no messages: the text is its count, the rest its bytes.
		{"a chat on SGLang", sim.EngineSGLang, "/v1/chat/completions", chat},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := simOf(t, sim.Config{Engine: c.engine, PrefillPerToken: time.Millisecond})
			urls, on := []string{e.URL()}, func(*Options) {}
			if c.engine == sim.EngineSGLang {
				urls, on = nil, sglangServing(t, e.URL())
			}
			s, gw, _ := gateway(t, urls, on, func(o *Options) { withTenants(t, o, hostile(100_000)) })
			if status := cutAfter(t, gw+c.path, c.body, 300*time.Millisecond); status != 0 {
				t.Fatalf("answered %d before the cut", status)
			}
			got := settledCharge(t, s, "hostile")
			if got < 4800 || got > 4800+200 {
				t.Errorf("cut during the prefill of 4,800 tokens: charged %d, want 4,800 (and the template's few)", got)
			}
			t.Logf("charged %d for 4,800 tokens in %d bytes", got, len(c.body))
		})
	}
}

// A list of prompts whose stream is cut after its first prompt's events was charged that
// prompt alone: a long prompt put second was computed and never charged. Every prompt of the
// list is charged once, whenever the stream is cut.
func TestTenantCutStreamOfAListChargesEveryPrompt(t *testing.T) {
	for _, c := range []struct{ engine, path, body string }{
		{sim.EngineVLLM, "/v1/completions", `{"model":"m","prompt":["short one","` + words(3000) + `"],"max_tokens":7,"ignore_eos":true,"stream":true}`},
		{sim.EngineSGLang, "/generate", `{"text":["short one","` + words(3000) + `"],"sampling_params":{"max_new_tokens":7,"ignore_eos":true},"stream":true}`},
	} {
		t.Run(c.engine, func(t *testing.T) {
			e := simOf(t, sim.Config{Engine: c.engine, DecodePerToken: 20 * time.Millisecond})
			rt := map[string]string{sim.EngineVLLM: config.RuntimeVLLM, sim.EngineSGLang: config.RuntimeSGLang}[c.engine]
			s, gw, _ := gateway(t, nil, func(o *Options) {
				serving(t, o, config.Worker{URL: e.URL(), Runtime: rt, Models: []string{"m"}})
				withTenants(t, o, hostile(100_000_000))
			})
			leaveAfter(t, gw+c.path, "sk-hostile", c.body, 3)
			if got := settledCharge(t, s, "hostile"); got < 3000 {
				t.Errorf("charged %d for a stream of a 3,000-word prompt and a short one, cut after 3 events", got)
			}
		})
	}
}

// "stream": 1 or "true" streams on the engines (pydantic reads them as true): Baton took the
// request for a whole answer, asked no usage of its stream, and charged its whole reservation.
func TestTenantStreamSpelledLaxlyIsChargedItsUsage(t *testing.T) {
	e := simOf(t, sim.Config{Engine: sim.EngineVLLM})
	s, gw, _ := gateway(t, []string{e.URL()}, func(o *Options) { withTenants(t, o, hostile(100_000_000)) })
	var before int64
	for _, spelling := range []string{`1`, `"true"`, `"Yes"`} {
		resp, b := asTenant(t, gw+"/v1/chat/completions", "sk-hostile", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3000,"stream":`+spelling+`}`)
		if resp.StatusCode != 200 || !strings.Contains(b, "data: [DONE]") || strings.Contains(b, `"usage"`) {
			t.Fatalf("stream %s: %d %s", spelling, resp.StatusCode, b)
		}
		got := settledCharge(t, s, "hostile")
		if got-before > 100 {
			t.Errorf("stream %s: charged %d for a short answer (its reservation: 3000)", spelling, got-before)
		}
		before = got
	}
}
