package app

import (
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// readiness is /readiness's status and body.
func readiness(t *testing.T, gw string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, gw+"/readiness", nil)
	return do(t, req)
}

// Probes fail when serving fails: an engine answering 500 opens its circuit after the
// threshold, and from then /readiness is 503 naming the open circuit (it was 200 while every
// request was refused).
func TestReadinessFailsWhenTheCircuitIsOpen(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Faults: sim.Faults{Status: 500}})
	cfg := testConfig(e.URL())
	cfg.CircuitBreaker.FailureThreshold = 2
	cfg.Retry.Disable = true
	_, gw := startGateway(t, cfg)
	if status, body := readiness(t, gw.URL); status != 200 {
		t.Fatalf("before any request: %d %s", status, body)
	}
	for range 2 {
		post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"p","max_tokens":1}`).Body.Close()
	}
	status, body := readiness(t, gw.URL)
	if status != 503 || !strings.Contains(body, "circuit") || !strings.Contains(body, `model \"m\"`) {
		t.Errorf("every request refused, circuit open: readiness %d %s", status, body)
	}
}

// A PD pair whose decode's circuit is open can serve nothing: readiness says so.
func TestReadinessFailsWhenTheDecodesCircuitIsOpen(t *testing.T) {
	cfg, _, _ := vllmPair(t, "NixlConnector", sim.Config{}, sim.Config{Faults: sim.Faults{Status: 500}})
	cfg.CircuitBreaker.FailureThreshold = 2
	cfg.Retry.Disable = true
	_, gw := startGateway(t, cfg)
	for range 2 {
		post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"p","max_tokens":1}`).Body.Close()
	}
	if status, body := readiness(t, gw.URL); status != 503 || !strings.Contains(body, "decode") || !strings.Contains(body, "circuit") {
		t.Errorf("the decode's circuit open: readiness %d %s", status, body)
	}
}

// A model the configuration names that no engine serves — on a worker whose engine lists
// another, or as an alias's target (a misspelled model in a live-reloaded configuration) — is
// named by readiness, which stays ready for the models that are served, and is never sent to
// the worker: its requests are Baton's 404, not the engine's.
func TestReadinessNamesAModelNoEngineServes(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	for name, tune := range map[string]func(*config.Config){
		"worker models": func(c *config.Config) {
			c.Workers = []config.Worker{{URL: e.URL(), Models: []string{"m", "ghost"}}}
		},
		"alias": func(c *config.Config) {
			c.WorkerURLs = []string{e.URL()}
			c.Models = map[string]config.ModelConfig{"chat": {Serve: "ghost"}}
		},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := config.Default()
			tune(&cfg)
			_, gw := startGateway(t, cfg)
			status, body := readiness(t, gw.URL)
			if status != 200 || !strings.Contains(body, `"unservable":["model \"ghost\"`) || strings.Contains(body, `\"m\"`) {
				t.Errorf("readiness %d %s, want 200 naming ghost alone as unservable", status, body)
			}
			before := e.Stats().RequestsReceived
			model := "ghost"
			if name == "alias" {
				model = "chat"
			}
			resp := post(t, gw.URL+"/v1/completions", `{"model":"`+model+`","prompt":"p","max_tokens":1}`)
			wantEnvelope(t, resp, 404, "model_not_found")
			if e.Stats().RequestsReceived != before {
				t.Error("a request for a model the engine does not serve reached it")
			}
		})
	}
}

// A host that answers HTTP but not as an engine (404 to every path, or 200 with nothing) is no
// worker: it never registers, readiness stays 503, and `baton check` would name the cause.
func TestAHostThatIsNoEngineIsNoWorker(t *testing.T) {
	for name, h := range map[string]http.HandlerFunc{
		"404 everywhere": http.NotFound,
		"200 everywhere": func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(200) },
	} {
		t.Run(name, func(t *testing.T) {
			host := httptest.NewServer(h)
			t.Cleanup(host.Close)
			g := runGateway(t, testConfig(host.URL))
			gw := serveAPI(t, g.Config, g.Server.Handler())
			w := g.Registry.Snapshot().Workers[0]
			poll.Until(t, "the registration attempt", func() bool { return w.LastRegistrationError() != nil })
			if e := w.LastRegistrationError(); e.Cause != "not_an_engine" || w.Registered() {
				t.Errorf("registered %v, cause %+v", w.Registered(), e)
			}
			if status, body := readiness(t, gw.URL); status != 503 {
				t.Errorf("readiness %d %s", status, body)
			}
		})
	}
}

// A model nobody names is 404 model_not_found even while a worker is still registering (it was
// a 503 that OpenAI's SDKs retry); a model a registering worker's configuration names is 503.
func TestUnknownModelIs404WhileWorkersRegister(t *testing.T) {
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select { // an engine still loading: no answer until the prober gives up
		case <-r.Context().Done():
		case <-time.After(10 * time.Second):
		}
	}))
	t.Cleanup(hang.Close)
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	cfg := config.Default()
	cfg.Workers = []config.Worker{{URL: e.URL()}, {URL: hang.URL, Models: []string{"later"}}}
	g := runGateway(t, cfg)
	gw := serveAPI(t, g.Config, g.Server.Handler())
	poll.Until(t, "the sim registered", func() bool { return g.Registry.Snapshot().Workers[0].Ready() })
	wantEnvelope(t, post(t, gw.URL+"/v1/completions", `{"model":"typo","prompt":"p","max_tokens":1}`), 404, "model_not_found")
	wantEnvelope(t, post(t, gw.URL+"/v1/completions", `{"model":"later","prompt":"p","max_tokens":1}`), 503, "no_available_workers")
}

// A command line copied from smg keeps smg's meaning of --api-key: the key Baton sends the
// engines, never checked on clients; listening beyond loopback with no client key at all is one
// WARN at startup.
func TestSmgAPIKeyReachesTheEngines(t *testing.T) {
	var got atomic.Value
	eng := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		got.Store(r.Header.Get("Authorization"))
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	})
	r := startRun(t, "--host", "0.0.0.0", "--worker-urls", eng.URL, "--api-key", "worker-secret-key")
	api := "http://127.0.0.1:" + r.api[strings.LastIndex(r.api, ":")+1:]
	poll.Until(t, "the worker ready", func() bool { return getStatus(t, api+"/readiness") == 200 })
	// smg checks its --api-key on clients too: a client without it is refused, with it served,
	// and the engine gets the key as Baton's, never a client's header passed on.
	resp := post(t, api+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":1}`)
	if b := readAll(t, resp.Body); resp.StatusCode != 401 {
		t.Fatalf("a client without the key: %d %s", resp.StatusCode, b)
	}
	resp = post(t, api+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":1}`, "Authorization", "Bearer worker-secret-key")
	if b := readAll(t, resp.Body); resp.StatusCode != 200 {
		t.Fatalf("a client with the key: %d %s", resp.StatusCode, b)
	}
	if got.Load() != "Bearer worker-secret-key" {
		t.Errorf("the engine got Authorization %q", got.Load())
	}
	if strings.Contains(r.logs.String(), "no client authentication") {
		t.Errorf("a WARN about an open API that is not open:\n%s", r.logs.String())
	}
	// The admin API takes it too when no admin key is given (smg's admin routes do); with
	// --client-api-key the clients have a key of their own and --api-key is not theirs.
	if code := getStatusKey(t, api+"/workers", "worker-secret-key"); code != 200 {
		t.Errorf("GET /workers with --api-key: %d", code)
	}
	if code := getStatusKey(t, api+"/workers", ""); code != 401 {
		t.Errorf("GET /workers without a key: %d", code)
	}
	r2 := startRun(t, "--worker-urls", eng.URL, "--api-key", "worker-secret-key", "--client-api-key", "client-key")
	poll.Until(t, "the worker ready", func() bool { return getStatus(t, r2.api+"/readiness") == 200 })
	resp = post(t, r2.api+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":1}`, "Authorization", "Bearer worker-secret-key")
	if b := readAll(t, resp.Body); resp.StatusCode != 401 {
		t.Errorf("the engines' key as a client's beside --client-api-key: %d %s", resp.StatusCode, b)
	}
}

// smg's --control-plane-api-keys ID:NAME:admin:KEY is an admin API key; smg's user role has no
// equivalent and is refused at startup with Baton's way.
func TestSmgControlPlaneKeysAreAdminKeys(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	r := startRun(t, "--worker-urls", e.URL(), "--control-plane-api-keys", "admin1:PlatformAdmin:admin:super-secret-key",
		"--control-plane-api-keys", "admin2:Ops:ADMIN:other-secret")
	for key, want := range map[string]int{"super-secret-key": 202, "other-secret": 202, "": 401, "nope": 401} {
		status, body := admin(t, http.MethodPost, r.api+"/workers", key, `{"url":"http://127.0.0.1:9"}`)
		if status == 409 {
			status = 202 // added by the other key already
		}
		if status != want && !(want == 401 && status == 403) {
			t.Errorf("key %q: %d %s, want %d", key, status, body, want)
		}
	}
	if _, err := config.Parse([]string{"--control-plane-api-keys", "u1:Reader:user:k"}, io.Discard); err == nil || !strings.Contains(err.Error(), "one role, admin") {
		t.Errorf("smg's user role: %v", err)
	}
}

// smg's priority scheduler flags mean what they mean in smg: --priority-scheduler-default-max-class
// is the ceiling of requests of no configured ceiling (its system and bulk names too), and
// --priority-scheduler-enabled without --max-concurrent-requests sizes the requests served at
// once from the engines' capacity, as smg does (it was refused).
func TestSmgPrioritySchedulerFlags(t *testing.T) {
	c, err := config.Parse([]string{"--priority-scheduler-enabled", "--max-concurrent-requests", "4", "--priority-scheduler-default-max-class", "bulk"}, io.Discard)
	if err != nil || c.DefaultMaxPriority != config.PriorityBatch || c.Admission.SlotsFromEngines {
		t.Fatalf("%v, default max %q, from engines %v", err, c.DefaultMaxPriority, c.Admission.SlotsFromEngines)
	}
	if c, err := config.Parse([]string{"--priority-scheduler-enabled"}, io.Discard); err != nil || !c.Admission.SlotsFromEngines {
		t.Errorf("enabled with no bound: %v", err)
	}
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	cfg := testConfig(e.URL())
	cfg.DefaultMaxPriority = config.PriorityBatch
	cfg.Admission.MaxConcurrentRequests = 4
	_, gw := startGateway(t, cfg)
	resp := post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"p","max_tokens":1}`, "X-Smg-Priority", "system")
	readAll(t, resp.Body)
	if got := resp.Header.Get("X-Baton-Priority"); resp.StatusCode != 200 || got != "batch" {
		t.Errorf("a request asking system under a default ceiling of bulk: %d, served as %q", resp.StatusCode, got)
	}
}

// --queue-answers smg answers a full queue 429 and a wait past its timeout 408, as smg's
// priority scheduler does (codes and Retry-After as Baton's); the default stays 503 and 504.
func TestQueueAnswersAsSmg(t *testing.T) {
	for _, c := range []struct {
		answers    string
		full, wait int
	}{{"smg", 429, 408}, {"baton", 503, 504}} {
		t.Run(c.answers, func(t *testing.T) {
			e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 20 * time.Millisecond})
			cfg := testConfig(e.URL())
			cfg.Admission.MaxConcurrentRequests, cfg.Admission.QueueSize, cfg.Admission.QueueTimeout = 1, 1, 300*time.Millisecond
			cfg.Admission.QueueAnswers = c.answers
			g, gw := startGateway(t, cfg)
			go func() { // holds the one slot for about 2 s
				if resp, err := http.Post(gw.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"p","max_tokens":100,"ignore_eos":true}`)); err == nil {
					resp.Body.Close()
				}
			}()
			poll.Until(t, "the slot taken", func() bool { return e.Stats().RequestsReceived == 1 })
			waited := make(chan *http.Response, 1)
			go func() { waited <- post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"q","max_tokens":1}`) }()
			poll.Until(t, "the second request queued", func() bool {
				return testutil.ToFloat64(g.Metrics.QueueDepth.WithLabelValues("default")) == 1
			})
			full := post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"r","max_tokens":1}`)
			wantEnvelope(t, full, c.full, "queue_full")
			w := <-waited
			wantEnvelope(t, w, c.wait, "queue_timeout")
			if full.Header.Get("Retry-After") == "" || w.Header.Get("Retry-After") == "" {
				t.Error("no Retry-After")
			}
		})
	}
}

// A model the configuration names that no engine serves is said once at startup, in a WARN
// naming it (and the alias it serves), once the first registrations settle.
func TestUnservableModelsAreWarnedAtStartup(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	cfg := testConfig(e.URL())
	cfg.Models = map[string]config.ModelConfig{"chat": {Serve: "ghost"}}
	logs := startLogged(t, cfg)
	poll.Until(t, "the startup WARN", func() bool {
		l := logs.String()
		return strings.Contains(l, "level=WARN") && strings.Contains(l, "models that no request can be sent for") &&
			strings.Contains(l, `ghost\" (served for chat)`)
	})
}

// smg's policy files hold through the gateway as in smg: a tenant's model rule, and
// default_policy for a tenant the file does not list (its own bucket); a tenant_policies ceiling
// clamps the class a request asks.
func TestSmgPolicyFilesHoldThroughTheGateway(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	dir := t.TempDir()
	rl, ps := filepath.Join(dir, "rl.yaml"), filepath.Join(dir, "ps.yaml")
	os.WriteFile(rl, []byte(`default_policy: {tokens_per_minute: 100000, requests_per_minute: 1}
tenants:
  - tenant_key: "auth:web"
    tokens_per_minute: 100000
    requests_per_minute: 50
    model_rules:
      - {rule_id: m-cap, matcher: {type: exact, value: m}, tokens_per_minute: 100000, requests_per_minute: 2}
`), 0o600)
	os.WriteFile(ps, []byte(`tenant_policies:
  "auth:web": {max_class: bulk}
`), 0o600)
	r := startRun(t, "--worker-urls", e.URL(), "--tenant-api-key", "web:k-web", "--tenant-api-key", "other:k-other",
		"--tenant-rate-limit-enabled", "--tenant-rate-limit-config", rl,
		"--max-concurrent-requests", "4", "--priority-scheduler-enabled", "--priority-scheduler-config", ps)
	send := func(key string) *http.Response {
		resp := post(t, r.api+"/v1/completions", `{"model":"m","prompt":"p","max_tokens":1}`, "Authorization", "Bearer "+key, "X-Smg-Priority", "system")
		readAll(t, resp.Body)
		return resp
	}
	var statuses []int
	for range 3 {
		resp := send("k-web")
		statuses = append(statuses, resp.StatusCode)
		if resp.StatusCode == 200 && resp.Header.Get("X-Baton-Priority") != "batch" {
			t.Errorf("web asked system under max_class bulk: served as %q", resp.Header.Get("X-Baton-Priority"))
		}
	}
	if statuses[0] != 200 || statuses[1] != 200 || statuses[2] != 429 {
		t.Errorf("web under its model rule of 2 requests a minute: %v, want 200 200 429", statuses)
	}
	if first, second := send("k-other"), send("k-other"); first.StatusCode != 200 || second.StatusCode != 429 || second.Header.Get("Retry-After") == "" {
		t.Errorf("other under default_policy's 1 request a minute: %d then %d (Retry-After %q)", first.StatusCode, second.StatusCode, second.Header.Get("Retry-After"))
	}
}

// An engine that lists its models to anyone but refuses Baton's key on every generation is a
// failing worker, not a client error: the client is told the worker failed (never the engine's
// 401 as if the client's key were wrong), its circuit opens, and readiness fails. Where Baton
// sends no key of its own the client's Authorization went, and the engine's 401 is the client's.
func TestEngineRefusingBatonsKeyFailsReadiness(t *testing.T) {
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm"}]}`)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(401)
		io.WriteString(w, `{"error":{"message":"invalid api key","type":"invalid_request_error","code":"invalid_api_key"}}`)
	}))
	t.Cleanup(eng.Close)
	cfg := testConfig(eng.URL)
	cfg.CircuitBreaker.FailureThreshold = 2
	cfg.Retry.Disable = true
	cfg.WorkerAPIKey = "not-the-engines"
	_, gw := startGateway(t, cfg)
	poll.Until(t, "the worker registered", func() bool { c, _ := readiness(t, gw.URL); return c == 200 })
	for i := 0; i < 2; i++ {
		resp := post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":1}`)
		b := readAll(t, resp.Body)
		if resp.StatusCode != 502 || !strings.Contains(b, "upstream_key_refused") {
			t.Errorf("request %d: %d %s, want the worker's failure (not the client's 401)", i, resp.StatusCode, b)
		}
	}
	poll.Until(t, "readiness fails with the circuit open", func() bool { c, _ := readiness(t, gw.URL); return c == 503 })
	open := testConfig(eng.URL)
	open.CircuitBreaker.FailureThreshold = 2
	_, gw2 := startGateway(t, open)
	poll.Until(t, "the worker registered", func() bool { c, _ := readiness(t, gw2.URL); return c == 200 })
	for i := 0; i < 3; i++ {
		resp := post(t, gw2.URL+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":1}`, "Authorization", "Bearer clients-own")
		if b := readAll(t, resp.Body); resp.StatusCode != 401 {
			t.Errorf("the client's own key refused: %d %s", resp.StatusCode, b)
		}
	}
	if c, _ := readiness(t, gw2.URL); c != 200 {
		t.Errorf("clients' refused keys opened the circuit: readiness %d", c)
	}
}

// A configured worker that never registers (its engine refuses Baton's key) is said on
// /readiness with its cause, while the workers that serve keep it ready.
func TestReadinessNamesUnregisteredWorkers(t *testing.T) {
	good := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	keyed := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(401) }))
	t.Cleanup(keyed.Close)
	g := runGateway(t, testConfig(good.URL(), keyed.URL))
	gw := serveAPI(t, g.Config, g.Server.Handler())
	poll.Until(t, "the keyed worker's registration refused", func() bool {
		for _, w := range g.Registry.Snapshot().Workers {
			if e := w.LastRegistrationError(); e != nil && e.Cause == "wrong_key" {
				return true
			}
		}
		return false
	})
	poll.Until(t, "ready, naming the worker that is not", func() bool {
		status, body := readiness(t, gw.URL)
		return status == 200 && strings.Contains(body, `"cause":"wrong_key"`) && strings.Contains(body, keyed.URL)
	})
	// Where clients need a key, the open probe says the causes only; the admin key shows URLs.
	cfg := testConfig(good.URL(), keyed.URL)
	cfg.ClientAPIKey, cfg.AdminAPIKey = "client-key", "admin-key"
	g2 := runGateway(t, cfg)
	gw2 := serveAPI(t, g2.Config, g2.Server.Handler())
	poll.Until(t, "ready, with the cause only", func() bool {
		status, body := readiness(t, gw2.URL)
		return status == 200 && strings.Contains(body, `"wrong_key":1`) && !strings.Contains(body, keyed.URL)
	})
	req, _ := http.NewRequest(http.MethodGet, gw2.URL+"/readiness", nil)
	req.Header.Set("Authorization", "Bearer admin-key")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if b := readAll(t, resp.Body); !strings.Contains(b, keyed.URL) {
		t.Errorf("with the admin key: %s", b)
	}
}
