package app

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
)

// An alias reaches the workers as the name they serve — the body's "model" rewritten, every
// other byte as the client sent it — and the answer names the served model (X-Baton-Model);
// /v1/models lists the alias beside it; a tenant may use an alias by its own name; a request
// without a model takes default_model.
func TestModelAliases(t *testing.T) {
	var mu sync.Mutex
	var bodies []string
	e := fakeEngine(t, "vllm", []string{"llama-3-8b-instruct"}, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, string(b))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"model":"llama-3-8b-instruct","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}`)
	})
	cfg := testConfig(e.URL)
	cfg.Models = map[string]config.ModelConfig{"llama": {Serve: "llama-3-8b-instruct"}}
	cfg.DefaultModel = "llama"
	cfg.Tenants = []config.Tenant{{Name: "team", Keys: []string{config.HashKey("sk-team")}, Models: []string{"llama"}}}
	_, gw := startGateway(t, cfg)
	sent := `{"prompt":"caf\u00e9 \ud83d\ude00","model":"llama","n":1,"big":123456789012345678901234567890,"x":{"model":"inner"}}`
	resp, b := tenantReq(t, gw.URL+"/v1/completions", "sk-team", sent)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Model") != "llama-3-8b-instruct" {
		t.Fatalf("%d %s %v", resp.StatusCode, b, resp.Header)
	}
	want := strings.Replace(sent, `"model":"llama"`, `"model":"llama-3-8b-instruct"`, 1)
	if bodies[0] != want {
		t.Errorf("the engine got\n%s\nwant\n%s", bodies[0], want)
	}
	// No model: the default (an alias too).
	if resp, b := tenantReq(t, gw.URL+"/v1/completions", "sk-team", `{"prompt":"x"}`); resp.StatusCode != 200 || !strings.Contains(bodies[1], `"model":"llama-3-8b-instruct"`) {
		t.Errorf("default_model: %d %s; engine got %s", resp.StatusCode, b, bodies[1])
	}
	// The served name itself is not the tenant's: only the alias is.
	if resp, _ := tenantReq(t, gw.URL+"/v1/completions", "sk-team", `{"model":"llama-3-8b-instruct","prompt":"x"}`); resp.StatusCode != 404 {
		t.Errorf("a model outside the tenant's list by its served name: %d", resp.StatusCode)
	}
	req, _ := http.NewRequest(http.MethodGet, gw.URL+"/v1/models", nil)
	req.Header.Set("Authorization", "Bearer sk-team")
	_, list := do(t, req)
	var models struct{ Data []struct{ ID, Root string } }
	_ = json.Unmarshal([]byte(list), &models)
	if len(models.Data) != 1 || models.Data[0].ID != "llama" || models.Data[0].Root != "llama-3-8b-instruct" {
		t.Errorf("/v1/models for the tenant: %s", list)
	}
}

// An alias through both PD styles: served, the answer's handoff as without an alias.
func TestModelAliasThroughPD(t *testing.T) {
	for name, fleet := range map[string]func(t *testing.T) config.Config{"vllm nixl": nixlPDFleet, "sglang": sglangPDFleet} {
		t.Run(name, func(t *testing.T) {
			cfg := fleet(t)
			cfg.Models = map[string]config.ModelConfig{"alias": {Serve: pdModel}}
			_, gw := startGateway(t, cfg)
			for _, stream := range []string{"", `,"stream":true`} {
				resp, b := postTimeout(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":"alias","prompt":"alias through pd","max_tokens":4%s}`, stream))
				if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Model") != pdModel || !strings.Contains(b, `"model":"`+pdModel+`"`) {
					t.Errorf("%s: %d %v %s", stream, resp.StatusCode, resp.Header, b)
				}
				if h := resp.Header.Get("X-Baton-Kv-Handoff"); h == "" || strings.HasPrefix(h, "none") {
					t.Errorf("%s: handoff %q", stream, h)
				}
			}
		})
	}
}

// Fallbacks: a model whose workers are all down is served by the next in its list, chosen at
// selection, before anything was sent; the answer and the metric say so; with its own worker
// up, the model itself serves.
func TestModelFallbacks(t *testing.T) {
	big, small := modelEngine(t, "big", sim.Faults{}), modelEngine(t, "small", sim.Faults{})
	cfg := testConfig(big.URL(), small.URL())
	cfg.Models = map[string]config.ModelConfig{"big": {Fallbacks: []string{"small"}}}
	g, gw := startGateway(t, cfg)
	resp, b := postTimeout(t, gw.URL+"/v1/completions", `{"model":"big","prompt":"x","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Model") != "" {
		t.Fatalf("big up: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	for _, w := range g.Registry.Snapshot().Workers {
		if w.URL == big.URL() {
			w.SetReady(false)
		}
	}
	resp, b = postTimeout(t, gw.URL+"/v1/completions", `{"model":"big","prompt":"x","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Model") != "small" || !strings.Contains(b, `"model":"small"`) {
		t.Errorf("big down: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	if !strings.Contains(scrape(t, g), `baton_model_fallbacks_total{from="big",to="small"} 1`) {
		t.Error("the fallback is not counted")
	}
}

// A model's own policy routes its requests; the others keep the fleet's. A reload swaps
// aliases and policies live.
func TestModelPolicyAndReload(t *testing.T) {
	a, b := modelEngine(t, "small", sim.Faults{}), modelEngine(t, "big", sim.Faults{})
	file := filepath.Join(t.TempDir(), "baton.yaml")
	write := func(y string) {
		if err := os.WriteFile(file, []byte(y), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	base := fmt.Sprintf("host: 127.0.0.1\nroute_header: true\nworker_urls: [%s, %s]\n", a.URL(), b.URL())
	write(base + "models:\n  big: {policy: least_load}\n  fast: {serve: small}\n")
	g, gw := startGateway(t, cfgOf(t, file))
	policyOf := func(model string) (string, string) {
		resp, _ := postTimeout(t, gw.URL+"/v1/completions", `{"model":"`+model+`","prompt":"x","max_tokens":1}`)
		_, p, _ := strings.Cut(resp.Header.Get("X-Baton-Route"), "policy=")
		p, _, _ = strings.Cut(p, ";")
		return p, resp.Header.Get("X-Baton-Model")
	}
	if p, _ := policyOf("big"); p != "least_load" {
		t.Errorf("big routed by %q", p)
	}
	if p, served := policyOf("fast"); p != "round_robin" || served != "small" {
		t.Errorf("fast routed by %q to %q", p, served)
	}
	write(base + "models:\n  big: {policy: random}\n  fast: {serve: big}\n")
	if err := g.Reload(); err != nil {
		t.Fatal(err)
	}
	if p, _ := policyOf("big"); p != "random" {
		t.Errorf("after the reload big routed by %q", p)
	}
	if _, served := policyOf("fast"); served != "big" {
		t.Errorf("after the reload fast served by %q", served)
	}
}

// A model whose every worker answered a retryable error: the retry goes to its fallback.
func TestModelFallbackAfterRetryableFailures(t *testing.T) {
	big, small := modelEngine(t, "big", sim.Faults{Status: 503}), modelEngine(t, "small", sim.Faults{})
	cfg := testConfig(big.URL(), small.URL())
	cfg.Models = map[string]config.ModelConfig{"big": {Fallbacks: []string{"small"}}}
	cfg.CircuitBreaker.Disable = true
	_, gw := startGateway(t, cfg)
	resp, b := postTimeout(t, gw.URL+"/v1/completions", `{"model":"big","prompt":"x","max_tokens":2}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Model") != "small" || big.Stats().RequestsReceived != 1 {
		t.Errorf("%d %v %s; big got %d", resp.StatusCode, resp.Header, b, big.Stats().RequestsReceived)
	}
}

// A prompt the engine refuses as longer than its model's context goes to the model's
// context_window_fallbacks; without them the refusal reaches the client as the engine sent it.
func TestContextWindowFallbacks(t *testing.T) {
	refusal := `{"object":"error","message":"This model's maximum context length is 8192 tokens. However, you requested 9000 tokens (8990 in the messages, 10 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}`
	short := fakeEngine(t, "vllm", []string{"short"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, refusal)
	})
	long := fakeEngine(t, "vllm", []string{"long"}, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"model":"long","saw":`+strconvQuote(string(b))+`}`)
	})
	cfg := testConfig(short.URL, long.URL)
	cfg.Models = map[string]config.ModelConfig{"short": {ContextWindowFallbacks: []string{"long"}}}
	g, gw := startGateway(t, cfg)
	resp, b := postTimeout(t, gw.URL+"/v1/completions", `{"model":"short","prompt":"a very long prompt"}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Model") != "long" || !strings.Contains(b, `"saw":"{\"model\":\"long\"`) {
		t.Errorf("%d %v %s", resp.StatusCode, resp.Header, b)
	}
	if !strings.Contains(scrape(t, g), `baton_model_fallbacks_total{from="short",to="long"} 1`) {
		t.Error("the context-window fallback is not counted")
	}
	// Without a fallback the engine's refusal is the answer, byte for byte.
	cfg2 := testConfig(short.URL)
	_, gw2 := startGateway(t, cfg2)
	resp, b = postTimeout(t, gw2.URL+"/v1/completions", `{"model":"short","prompt":"a very long prompt"}`)
	if resp.StatusCode != 400 || b != refusal {
		t.Errorf("no fallback: %d %s", resp.StatusCode, b)
	}
}

func strconvQuote(s string) string { b, _ := json.Marshal(s); return string(b) }

// modelEngine is a simulated vLLM engine serving model, with faults.
func modelEngine(t *testing.T, model string, f sim.Faults) *sim.Engine {
	t.Helper()
	return startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: model, Faults: f})
}
