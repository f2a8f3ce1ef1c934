package app

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/poll"
)

func TestPassthroughIsByteExact(t *testing.T) {
	t.Parallel()
	body := `{"zeta":1,"model":"m","seed":9007199254740993,"messages":[{"role":"user","content":"caf\u00e9 \ud83d\ude00 ünïcode"}],"unknown_key":{"nested":[1.50,2e10,null]},"alpha":true}`
	got := make(chan string, 1)
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- string(b)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","big":18446744073709551615,"s":"\u00e9"}`)
	})
	_, gw := startGateway(t, testConfig(up.URL))
	resp := post(t, gw.URL+"/v1/chat/completions", body)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if out := readAll(t, resp.Body); out != `{"id":"x","big":18446744073709551615,"s":"\u00e9"}` {
		t.Errorf("response body altered: %s", out)
	}
	if g := <-got; g != body {
		t.Errorf("upstream got\n%s\nwant\n%s", g, body)
	}
}

func TestStreamReachesClientBeforeUpstreamEnds(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"n\":1}\n\n")
		w.(http.Flusher).Flush()
		<-release
		io.WriteString(w, "data: {\"n\":2}\n\ndata: [DONE]\n\n")
	})
	_, gw := startGateway(t, testConfig(up.URL))
	defer close(release)
	resp := post(t, gw.URL+"/v1/chat/completions", `{"model":"m","stream":true}`)
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Errorf("content-type %q", ct)
	}
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || line != "data: {\"n\":1}\n" {
		t.Fatalf("first event: %q, %v", line, err)
	}
}

func TestClientDisconnectCancelsUpstream(t *testing.T) {
	t.Parallel()
	canceled := make(chan struct{})
	started := make(chan struct{})
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body) // an engine reads the request; the server then watches the connection
		close(started)
		<-r.Context().Done()
		close(canceled)
	})
	g, gw := startGateway(t, testConfig(up.URL))
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(`{"model":"m"}`))
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
	}()
	<-started
	cancel()
	select {
	case <-canceled:
	case <-time.After(10 * time.Second):
		t.Fatal("upstream request was not cancelled after the client left")
	}
	<-done
	poll.Until(t, "the condition", func() bool { return g.Registry.Snapshot().Workers[0].InFlight() == 0 })
}

func TestUpstreamErrorsPassThrough(t *testing.T) {
	t.Parallel()
	for _, status := range []int{400, 429, 500, 503} {
		up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("X-Request-Id", "engine-made")
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Retry-After", "7")
			w.WriteHeader(status)
			io.WriteString(w, `{"error":{"message":"engine says no","code":"x"}}`)
		})
		_, gw := startGateway(t, testConfig(up.URL))
		resp := post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`, "X-Request-Id", "client-id")
		body := readAll(t, resp.Body)
		if resp.Header.Get("X-Request-Id") != "client-id" {
			t.Errorf("upstream %d: X-Request-Id %q, want the client's", status, resp.Header.Get("X-Request-Id"))
		}
		if resp.StatusCode != status || body != `{"error":{"message":"engine says no","code":"x"}}` || resp.Header.Get("Retry-After") != "7" {
			t.Errorf("upstream %d: got %d %q retry-after=%q", status, resp.StatusCode, body, resp.Header.Get("Retry-After"))
		}
	}
}

func TestMintedErrors(t *testing.T) {
	t.Parallel()
	ok := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
	t.Run("bad json 400", func(t *testing.T) {
		_, gw := startGateway(t, testConfig(ok.URL))
		wantEnvelope(t, post(t, gw.URL+"/v1/chat/completions", `{"model":`), 400, "invalid_json")
		wantEnvelope(t, post(t, gw.URL+"/v1/chat/completions", `[1]`), 400, "invalid_json")
	})
	t.Run("too large 413", func(t *testing.T) {
		cfg := testConfig(ok.URL)
		cfg.MaxPayloadSize = 64
		_, gw := startGateway(t, cfg)
		wantEnvelope(t, post(t, gw.URL+"/v1/chat/completions", `{"model":"m","pad":"`+strings.Repeat("x", 100)+`"}`), 413, "payload_too_large")
		// Without a Content-Length the limit applies while reading.
		req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/chat/completions", io.MultiReader(strings.NewReader(`{"model":"m","pad":"`+strings.Repeat("x", 100)+`"}`)))
		req.ContentLength = -1
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		wantEnvelope(t, resp, 413, "payload_too_large")
	})
	t.Run("unknown model 404", func(t *testing.T) {
		_, gw := startGateway(t, testConfig(ok.URL))
		e := wantEnvelope(t, post(t, gw.URL+"/v1/chat/completions", `{"model":"other"}`), 404, "model_not_found")
		if e.Error.Param == nil || *e.Error.Param != "model" {
			t.Errorf("param = %v, want model", e.Error.Param)
		}
	})
	t.Run("no ready worker 503", func(t *testing.T) {
		g, gw := startGateway(t, testConfig(ok.URL))
		g.Registry.Snapshot().Workers[0].SetReady(false)
		wantEnvelope(t, post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`), 503, "no_available_workers")
	})
	t.Run("transport 502", func(t *testing.T) {
		dead := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
			// Hijack and close: the connection dies before any response.
			c, _, _ := w.(http.Hijacker).Hijack()
			c.Close()
		})
		_, gw := startGateway(t, testConfig(dead.URL))
		wantEnvelope(t, post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`), 502, "upstream_unreachable")
	})
	t.Run("timeout 504", func(t *testing.T) {
		slow := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
			io.ReadAll(r.Body)
			<-r.Context().Done()
		})
		_, gw := startGateway(t, testConfig(slow.URL), requestTimeout(200*time.Millisecond))
		wantEnvelope(t, post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`), 504, "upstream_timeout")
	})
	t.Run("unknown route 404", func(t *testing.T) {
		_, gw := startGateway(t, testConfig(ok.URL))
		wantEnvelope(t, post(t, gw.URL+"/v1/nope", `{}`), 404, "not_found")
	})
}

func TestMidStreamFailureAbortsClient(t *testing.T) {
	t.Parallel()
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"n\":1}\n\n")
		w.(http.Flusher).Flush()
		c, _, _ := w.(http.Hijacker).Hijack()
		c.Close()
	})
	_, gw := startGateway(t, testConfig(up.URL))
	resp := post(t, gw.URL+"/v1/chat/completions", `{"model":"m","stream":true}`)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	b, err := io.ReadAll(resp.Body)
	if err == nil {
		t.Fatalf("client read the stream to a clean end (%q); want a broken connection", b)
	}
	if !strings.HasPrefix(string(b), "data: {\"n\":1}\n\n") {
		t.Errorf("client did not get the first event before the abort: %q", b)
	}
}

func TestAuth(t *testing.T) {
	t.Parallel()
	var sawAuth atomic.Value
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		sawAuth.Store(r.Header.Get("Authorization"))
		io.WriteString(w, "{}")
	})
	t.Run("off", func(t *testing.T) {
		_, gw := startGateway(t, testConfig(up.URL))
		if resp := post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`); resp.StatusCode != 200 {
			t.Fatalf("status %d, want 200 without a key", resp.StatusCode)
		}
	})
	t.Run("on", func(t *testing.T) {
		cfg := testConfig(up.URL)
		cfg.ClientAPIKey = "sekret"
		_, gw := startGateway(t, cfg)
		wantEnvelope(t, post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`), 401, "invalid_api_key")
		wantEnvelope(t, post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`, "Authorization", "Bearer wrong"), 401, "invalid_api_key")
		if resp := post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`, "Authorization", "Bearer sekret"); resp.StatusCode != 200 {
			t.Fatalf("status %d with the key", resp.StatusCode)
		}
		if got := sawAuth.Load(); got != "" {
			t.Errorf("worker saw authorization %q: Baton's own key must never reach a worker", got)
		}
		for _, p := range []string{"/health", "/liveness", "/readiness"} {
			resp, err := http.Get(gw.URL + p)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Errorf("GET %s = %d without a key, want 200", p, resp.StatusCode)
			}
		}
		resp, _ := http.Get(gw.URL + "/v1/models")
		resp.Body.Close()
		if resp.StatusCode != 401 {
			t.Errorf("GET /v1/models without a key = %d, want 401", resp.StatusCode)
		}
	})
}

func TestHeadersToWorker(t *testing.T) {
	t.Parallel()
	got := make(chan http.Header, 2)
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Clone()
		w.Header().Set("X-Request-Id", "engine-made")
		io.WriteString(w, "{}")
	})
	cfg := config.Default()
	cfg.Workers = []config.Worker{{URL: up.URL, APIKey: "worker-key"}}
	_, gw := startGateway(t, cfg)
	resp := post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`,
		"Authorization", "Bearer client", "X-Request-Id", "rid-1", "Traceparent", "00-abc-def-01",
		"Tracestate", "k=v", "Cookie", "c=1", "X-Secret", "s", "Accept-Encoding", "gzip")
	h := <-got
	for k, want := range map[string]string{"Authorization": "Bearer worker-key", "X-Request-Id": "rid-1",
		"Traceparent": "00-abc-def-01", "Tracestate": "k=v", "Cookie": "", "X-Secret": "", "Accept-Encoding": ""} {
		if h.Get(k) != want {
			t.Errorf("worker got %s=%q, want %q", k, h.Get(k), want)
		}
	}
	if resp.Header.Get("X-Request-Id") != "rid-1" {
		t.Errorf("response X-Request-Id = %q, want the client's rid-1", resp.Header.Get("X-Request-Id"))
	}
	if resp.Header.Get("X-Baton-Worker") != up.URL {
		t.Errorf("X-Baton-Worker = %q", resp.Header.Get("X-Baton-Worker"))
	}
	// Absent id: one is generated, sent to the worker and echoed.
	resp = post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`)
	h = <-got
	if rid := resp.Header.Get("X-Request-Id"); len(rid) != 32 || h.Get("X-Request-Id") != rid {
		t.Errorf("generated id %q, worker saw %q", rid, h.Get("X-Request-Id"))
	}
}

func TestModelAwareRouting(t *testing.T) {
	t.Parallel()
	hits := map[string]*atomic.Int64{"a": {}, "b": {}}
	engine := func(name string, models ...string) string {
		return fakeEngine(t, "vllm", models, func(w http.ResponseWriter, r *http.Request) {
			hits[name].Add(1)
			io.WriteString(w, `{"from":"`+name+`"}`)
		}).URL
	}
	_, gw := startGateway(t, testConfig(engine("a", "llama"), engine("b", "qwen", "shared")))
	for i := 0; i < 4; i++ {
		if body := readAll(t, post(t, gw.URL+"/v1/completions", `{"model":"qwen"}`).Body); body != `{"from":"b"}` {
			t.Fatalf("qwen went to %s", body)
		}
		if body := readAll(t, post(t, gw.URL+"/v1/completions", `{"model":"llama"}`).Body); body != `{"from":"a"}` {
			t.Fatalf("llama went to %s", body)
		}
	}
	// No model (and no default_model): 400 naming the field, never a random worker.
	for i := 0; i < 4; i++ {
		wantEnvelope(t, post(t, gw.URL+"/v1/completions", `{"prompt":"hi"}`), 400, "model_required")
	}
	if hits["a"].Load() != 4 || hits["b"].Load() != 4 {
		t.Errorf("hits a=%d b=%d, want 4 and 4", hits["a"].Load(), hits["b"].Load())
	}
	resp, err := http.Get(gw.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(t, resp.Body)
	for _, m := range []string{`"id":"llama"`, `"id":"qwen"`, `"id":"shared"`} {
		if !strings.Contains(body, m) {
			t.Errorf("/v1/models %s lacks %s", body, m)
		}
	}
}

// The fleet's engine key (--worker-api-key) reaches every engine without a key of its own, the
// admin API's additions included; the clients' key (--api-key) never reaches one.
func TestFleetEngineKey(t *testing.T) {
	t.Parallel()
	got := make(chan string, 4)
	handle := func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Get("Authorization")
		io.WriteString(w, "{}")
	}
	a := fakeEngine(t, "vllm", []string{"m"}, handle)
	b := fakeEngine(t, "vllm", []string{"n"}, handle)
	cfg := config.Default()
	cfg.WorkerURLs, cfg.APIKey, cfg.WorkerAPIKey, cfg.AdminAPIKey = []string{a.URL}, "sk-client", "sk-engine", "sk-admin"
	_, gw := startGateway(t, cfg)
	post(t, gw.URL+"/v1/chat/completions", `{"model":"m"}`, "Authorization", "Bearer sk-client")
	if k := <-got; k != "Bearer sk-engine" {
		t.Errorf("the configured engine got %q", k)
	}
	if status, body := admin(t, http.MethodPost, gw.URL+"/workers", "sk-admin", fmt.Sprintf(`{"url":%q}`, b.URL)); status != 202 || strings.Contains(body, "sk-engine") {
		t.Fatalf("admin add: %d %s", status, body)
	}
	poll.Until(t, "the added worker serves n", func() bool {
		resp := post(t, gw.URL+"/v1/chat/completions", `{"model":"n"}`, "Authorization", "Bearer sk-client")
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	for len(got) > 0 {
		if k := <-got; k != "Bearer sk-engine" {
			t.Errorf("an engine got %q", k)
		}
	}
}
