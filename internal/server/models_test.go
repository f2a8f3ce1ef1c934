package server

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/tenant"
	"github.com/baton-llm/baton/internal/worker"
)

// serving adds to o's fleet a worker as c configures it, registered (its engine reported c's
// runtime and models) and ready, as the registrar leaves a worker whose engine answered.
func serving(t *testing.T, o *Options, c config.Worker) *worker.Worker {
	t.Helper()
	w := worker.New(c)
	var ms []worker.Model
	for _, m := range c.Models {
		ms = append(ms, worker.Model{ID: m})
	}
	w.SetInfo(&worker.Info{Runtime: c.Runtime, Models: ms})
	w.SetReady(true)
	if err := o.Director.Registry.Add(w); err != nil {
		t.Fatal(err)
	}
	return w
}

// vllm is the configuration of a vLLM worker at url serving models.
func vllm(url string, models ...string) config.Worker {
	return config.Worker{URL: url, Runtime: config.RuntimeVLLM, Models: models}
}

// withModels gives the director the configuration's models and default model.
func withModels(models map[string]config.ModelConfig, def string) func() (map[string]config.ModelConfig, string) {
	return func() (map[string]config.ModelConfig, string) { return models, def }
}

// tenancyOf is the tenancy of tenants, as the gateway builds it from a configuration naming
// them (counted in memory).
func tenancyOf(t *testing.T, tenants ...config.Tenant) director.Tenancy {
	t.Helper()
	cfg := config.Default()
	cfg.Tenants = tenants
	set, err := tenant.Build(cfg, os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	return director.Tenancy{Set: func() *tenant.Set { return set }, Limiter: tenant.NewLimiter(nil), MaxTokens: cfg.TenantMaxTokens}
}

// startSim starts a simulated engine for c, closed when the test ends.
func startSim(t *testing.T, c sim.Config) *sim.Engine {
	t.Helper()
	e, err := sim.Start(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e
}

// scrape is the server's metrics in the Prometheus text format, as GET /metrics serves them.
func scrape(t *testing.T, s *Server) string {
	t.Helper()
	rec := httptest.NewRecorder()
	s.metrics.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	return rec.Body.String()
}

// bodies records the bodies an engine received, in order.
type bodies struct {
	mu   sync.Mutex
	seen []string
}

func (b *bodies) add(s string) { b.mu.Lock(); b.seen = append(b.seen, s); b.mu.Unlock() }

func (b *bodies) all() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.seen...)
}

// An alias reaches the workers as the name they serve — the body's "model" rewritten, every
// other byte as the client sent it — and the answer names the served model (X-Baton-Model);
// /v1/models lists the alias beside it; a tenant may use an alias by its own name; a request
// without a model takes default_model.
func TestModelAliases(t *testing.T) {
	var got bodies
	e := engine(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got.add(string(b))
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"model":"llama-3-8b-instruct","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}`)
	})
	_, gw, _ := gateway(t, nil, func(o *Options) {
		serving(t, o, vllm(e, "llama-3-8b-instruct"))
		o.Director.Models = withModels(map[string]config.ModelConfig{"llama": {Serve: "llama-3-8b-instruct"}}, "llama")
		o.Director.Tenancy = tenancyOf(t, config.Tenant{Name: "team", Keys: []string{config.HashKey("sk-team")}, Models: []string{"llama"}})
	})
	auth := []string{"Authorization", "Bearer sk-team"}
	sent := `{"prompt":"caf\u00e9 \ud83d\ude00","model":"llama","n":1,"big":123456789012345678901234567890,"x":{"model":"inner"}}`
	resp, b := post(t, gw+"/v1/completions", sent, auth...)
	if resp.StatusCode != 200 || resp.Header.Get(openai.HeaderModel) != "llama-3-8b-instruct" {
		t.Fatalf("%d %s %v", resp.StatusCode, b, resp.Header)
	}
	want := strings.Replace(sent, `"model":"llama"`, `"model":"llama-3-8b-instruct"`, 1)
	if seen := got.all(); len(seen) != 1 || seen[0] != want {
		t.Errorf("the engine got\n%q\nwant\n%s", seen, want)
	}
	// No model: the default (an alias too).
	if resp, b := post(t, gw+"/v1/completions", `{"prompt":"x"}`, auth...); resp.StatusCode != 200 || len(got.all()) != 2 || !strings.Contains(got.all()[1], `"model":"llama-3-8b-instruct"`) {
		t.Errorf("default_model: %d %s; engine got %q", resp.StatusCode, b, got.all())
	}
	// The served name itself is not the tenant's: only the alias is.
	if resp, _ := post(t, gw+"/v1/completions", `{"model":"llama-3-8b-instruct","prompt":"x"}`, auth...); resp.StatusCode != 404 {
		t.Errorf("a model outside the tenant's list by its served name: %d", resp.StatusCode)
	}
	req, _ := http.NewRequest(http.MethodGet, gw+"/v1/models", nil)
	req.Header.Set("Authorization", "Bearer sk-team")
	lresp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	list, _ := io.ReadAll(lresp.Body)
	lresp.Body.Close()
	var models struct{ Data []struct{ ID, Root string } }
	_ = json.Unmarshal(list, &models)
	if len(models.Data) != 1 || models.Data[0].ID != "llama" || models.Data[0].Root != "llama-3-8b-instruct" {
		t.Errorf("/v1/models for the tenant: %s", list)
	}
}

// Fallbacks: a model whose workers are all down is served by the next in its list, chosen at
// selection, before anything was sent; the answer and the metric say so; with its own worker
// up, the model itself serves.
func TestModelFallbacks(t *testing.T) {
	big, small := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "big"}), startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "small"})
	var bigWorker *worker.Worker
	s, gw, _ := gateway(t, nil, func(o *Options) {
		bigWorker = serving(t, o, vllm(big.URL(), "big"))
		serving(t, o, vllm(small.URL(), "small"))
		o.Director.Models = withModels(map[string]config.ModelConfig{"big": {Fallbacks: []string{"small"}}}, "")
	})
	resp, b := post(t, gw+"/v1/completions", `{"model":"big","prompt":"x","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get(openai.HeaderModel) != "" {
		t.Fatalf("big up: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	bigWorker.SetReady(false)
	resp, b = post(t, gw+"/v1/completions", `{"model":"big","prompt":"x","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get(openai.HeaderModel) != "small" || !strings.Contains(b, `"model":"small"`) {
		t.Errorf("big down: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	if !strings.Contains(scrape(t, s), `baton_model_fallbacks_total{from="big",to="small"} 1`) {
		t.Error("the fallback is not counted")
	}
}

// A model whose every worker answered a retryable error: the retry goes to its fallback. (The
// fixture's workers have no circuit breaker: the failure does not open one.)
func TestModelFallbackAfterRetryableFailures(t *testing.T) {
	big, small := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "big", Faults: sim.Faults{Status: 503}}), startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "small"})
	_, gw, _ := gateway(t, nil, func(o *Options) {
		serving(t, o, vllm(big.URL(), "big"))
		serving(t, o, vllm(small.URL(), "small"))
		o.Director.Models = withModels(map[string]config.ModelConfig{"big": {Fallbacks: []string{"small"}}}, "")
	})
	resp, b := post(t, gw+"/v1/completions", `{"model":"big","prompt":"x","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get(openai.HeaderModel) != "small" || big.Stats().RequestsReceived != 1 {
		t.Errorf("%d %v %s; big got %d", resp.StatusCode, resp.Header, b, big.Stats().RequestsReceived)
	}
}

// A prompt the engine refuses as longer than its model's context goes to the model's
// context_window_fallbacks; without them the refusal reaches the client as the engine sent it.
func TestContextWindowFallbacks(t *testing.T) {
	refusal := `{"object":"error","message":"This model's maximum context length is 8192 tokens. However, you requested 9000 tokens (8990 in the messages, 10 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}`
	short := engine(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, refusal)
	})
	long := engine(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"model":"long","saw":`+jsonQuote(string(b))+`}`)
	})
	s, gw, _ := gateway(t, nil, func(o *Options) {
		serving(t, o, vllm(short, "short"))
		serving(t, o, vllm(long, "long"))
		o.Director.Models = withModels(map[string]config.ModelConfig{"short": {ContextWindowFallbacks: []string{"long"}}}, "")
	})
	resp, b := post(t, gw+"/v1/completions", `{"model":"short","prompt":"a very long prompt"}`)
	if resp.StatusCode != 200 || resp.Header.Get(openai.HeaderModel) != "long" || !strings.Contains(b, `"saw":"{\"model\":\"long\"`) {
		t.Errorf("%d %v %s", resp.StatusCode, resp.Header, b)
	}
	if !strings.Contains(scrape(t, s), `baton_model_fallbacks_total{from="short",to="long"} 1`) {
		t.Error("the context-window fallback is not counted")
	}
	// Without a fallback the engine's refusal is the answer, byte for byte.
	_, gw2, _ := gateway(t, nil, func(o *Options) { serving(t, o, vllm(short, "short")) })
	resp, b = post(t, gw2+"/v1/completions", `{"model":"short","prompt":"a very long prompt"}`)
	if resp.StatusCode != 400 || b != refusal {
		t.Errorf("no fallback: %d %s", resp.StatusCode, b)
	}
}

func jsonQuote(s string) string { b, _ := json.Marshal(s); return string(b) }
