package app

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
)

// fuzzRoutes are the routes the fuzzer sends to, by index.
var fuzzRoutes = []string{"/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses", "/v1/messages", "/v1/embeddings", "/health_generate"}

// FuzzRequestPath sends random bodies and headers through the whole request path of a regular
// gateway and two PD gateways (an SGLang bootstrap pair and a vLLM NIXL pair, simulated) and checks that
// nothing panics (an abort after the first byte is the one allowed panic), every answer has a
// status, and every error Baton mints is an OpenAI envelope.
//
//	go test ./internal/app -run XXX -fuzz FuzzRequestPath -fuzztime 5m
func FuzzRequestPath(f *testing.F) {
	f.Add(uint8(0), uint8(0), []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3}`), "", "", "")
	f.Add(uint8(1), uint8(2), []byte(`{"model":"m","prompt":["a","b"],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}`), "Bearer x", "rid", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	f.Add(uint8(2), uint8(1), []byte(`{"text":["a","b"],"sampling_params":{"max_new_tokens":2},"return_logprob":true,"routed_dp_rank":3}`), "", "", "")
	f.Add(uint8(3), uint8(2), []byte(`{"model":"m","input":"who","max_output_tokens":2,"stream":true}`), "", "", "")
	f.Add(uint8(1), uint8(1), []byte(`{"model":"m\xff","prompt":[[1,2],[3]],"n":2}`), "", strings.Repeat("r", 200), "")
	f.Add(uint8(0), uint8(1), []byte(`{"model":"m","messages":[],"n":100000000,"kv_transfer_params":{"do_remote_decode":true}}`), "a\x00b", "", "")
	f.Add(uint8(4), uint8(0), []byte(`[1,2,3]`), "", "", "")
	f.Add(uint8(6), uint8(1), []byte{}, "", "", "")

	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	gateway := func(cfg config.Config) http.Handler {
		cfg.RequestTimeout = 5 * time.Second
		cfg.Retry.Disable = true
		g, err := New(cfg, quiet)
		if err != nil {
			f.Fatal(err)
		}
		f.Cleanup(g.Wait)
		ctx := f.Context()
		g.Start(ctx)
		for _, w := range g.Registry.Snapshot().Workers {
			for !w.Registered() {
				if ctx.Err() != nil {
					f.Fatal("workers never registered")
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
		return g.Server.Handler()
	}
	start := func(c sim.Config) *sim.Engine {
		c.Model = "m"
		e, err := sim.Start(c)
		if err != nil {
			f.Fatal(err)
		}
		f.Cleanup(e.Close)
		return e
	}
	regular := config.Default()
	regular.WorkerURLs = []string{start(sim.Config{Engine: sim.EngineVLLM}).URL()}
	pdPair := func(p, d *sim.Engine, prefill config.Worker) config.Config {
		c := config.Default()
		c.PDDisaggregation = true
		prefill.URL, prefill.Role = p.URL(), config.RolePrefill
		if bp := p.BootstrapPort(); bp != 0 {
			prefill.BootstrapPort = &bp
		}
		c.Workers = []config.Worker{prefill, {URL: d.URL(), Role: config.RoleDecode}}
		return c
	}
	sglang := pdPair(start(sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill, BootstrapTimeout: time.Second}),
		start(sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode, BootstrapTimeout: time.Second}), config.Worker{})
	vllm := pdPair(start(sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl}),
		start(sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl}), config.Worker{KVConnector: "NixlConnector"})
	handlers := []http.Handler{gateway(regular), gateway(sglang), gateway(vllm)}

	f.Fuzz(func(t *testing.T, route, mode uint8, body []byte, auth, rid, traceparent string) {
		h := handlers[int(mode)%len(handlers)]
		path := fuzzRoutes[int(route)%len(fuzzRoutes)]
		method := http.MethodPost
		if path == "/health_generate" {
			method = http.MethodGet
		}
		req := httptest.NewRequest(method, path, strings.NewReader(string(body)))
		for k, v := range map[string]string{"Authorization": auth, "X-Request-Id": rid, "Traceparent": traceparent} {
			if v != "" {
				req.Header[k] = []string{v}
			}
		}
		rec := httptest.NewRecorder()
		func() {
			defer func() {
				if v := recover(); v != nil && v != http.ErrAbortHandler {
					t.Fatalf("panic: %v", v)
				}
			}()
			h.ServeHTTP(rec, req)
		}()
		if rec.Code < 100 || rec.Code > 599 {
			t.Fatalf("status %d", rec.Code)
		}
		if code := rec.Header().Get("X-Baton-Error-Code"); code != "" {
			var env struct {
				Error struct {
					Message, Type, Code string
				} `json:"error"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &env); err != nil || env.Error.Code != code || env.Error.Message == "" {
				t.Fatalf("minted error %q is not an envelope: %q", code, rec.Body.String())
			}
		}
	})
}
