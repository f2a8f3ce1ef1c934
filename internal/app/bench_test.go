package app

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/tracing"
)

// benchAnswer is the benchmark engine's answer.
const benchAnswer = `{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}`

// benchEngine is an in-process engine that answers every chat completion with benchAnswer.
func benchEngine() *httptest.Server {
	return fakeEngine(&testing.T{}, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, benchAnswer)
	})
}

// BenchmarkProxy measures the regular-mode hot path (request in, response out) against an
// in-process upstream, next to the same request sent straight to the upstream in the same run.
// Compare ns/op and allocs of baton/<size> with direct/<size>.
func BenchmarkProxy(b *testing.B) {
	up := benchEngine()
	defer up.Close()
	_, gw := startGateway(&testing.T{}, testConfig(up.URL))
	defer gw.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}}
	for _, size := range []int{1 << 10, 100 << 10, 1 << 20} {
		body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("a", size-60) + `"}]}`)
		for _, target := range []struct{ name, url string }{{"direct", up.URL}, {"baton", gw.URL}} {
			b.Run(fmt.Sprintf("%s/%dKB", target.name, size>>10), func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(body)))
				for b.Loop() {
					resp, err := client.Post(target.url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
					if err != nil {
						b.Fatal(err)
					}
					n, _ := io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != 200 || n != int64(len(benchAnswer)) {
						b.Fatalf("status %d, %d bytes", resp.StatusCode, n)
					}
				}
			})
		}
	}
}

// BenchmarkTracing measures the regular hot path (1 KB request) with tracing off — the
// default, where every hook is one atomic load — and on (every request sampled, spans batched to
// an OTLP/HTTP receiver in the same process), next to the upstream alone, in one run.
func BenchmarkTracing(b *testing.B) {
	up := benchEngine()
	defer up.Close()
	cfg := testConfig(up.URL)
	cfg.AccessLog = false
	_, gw := startGateway(&testing.T{}, cfg)
	defer gw.Close()
	receiver := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) }))
	defer receiver.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}}
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("a", 1000) + `"}]}`)
	run := func(b *testing.B, url string) {
		b.ReportAllocs()
		for b.Loop() {
			benchSend(b, client, url+"/v1/chat/completions", body, "")
		}
	}
	b.Run("direct", func(b *testing.B) { run(b, up.URL) })
	b.Run("off", func(b *testing.B) { run(b, gw.URL) })
	b.Run("on", func(b *testing.B) {
		stop, err := tracing.Setup(context.Background(), tracing.Config{Endpoint: receiver.URL, Ratio: 1})
		if err != nil {
			b.Fatal(err)
		}
		defer stop(context.Background())
		run(b, gw.URL)
	})
	b.Run("off-again", func(b *testing.B) { run(b, gw.URL) })
}

// BenchmarkTenants measures the regular hot path (1 KB request) without tenants and with a
// limited tenant (requests and tokens per minute far above the load: every request is reserved
// and settled in memory), next to the upstream alone, in one run. The gap is what a tenant's
// key, reservation, settlement, rate-limit headers and tenant metrics cost a request.
func BenchmarkTenants(b *testing.B) {
	up := benchEngine()
	defer up.Close()
	cfg := testConfig(up.URL)
	cfg.AccessLog = false
	_, plain := startGateway(&testing.T{}, cfg)
	defer plain.Close()
	cfg.Tenants = []config.Tenant{{Name: "team", Keys: []string{config.HashKey("sk-team")},
		Limits: &config.Limits{RequestsPerMinute: intp(1 << 30), TokensPerMinute: intp(1 << 30)}}}
	_, limited := startGateway(&testing.T{}, cfg)
	defer limited.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}}
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("a", 1000) + `"}]}`)
	run := func(b *testing.B, url, key string) {
		b.ReportAllocs()
		for b.Loop() {
			benchSend(b, client, url+"/v1/chat/completions", body, key)
		}
	}
	b.Run("direct", func(b *testing.B) { run(b, up.URL, "") })
	b.Run("no-tenants", func(b *testing.B) { run(b, plain.URL, "") })
	b.Run("tenant-limited", func(b *testing.B) { run(b, limited.URL, "sk-team") })
	b.Run("no-tenants-again", func(b *testing.B) { run(b, plain.URL, "") })
}

// benchSend posts body to url, with a tenant's bearer key when given, and reads a 200 answer
// to its end.
func benchSend(b *testing.B, client *http.Client, url string, body []byte, key string) {
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := client.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		b.Fatalf("status %d", resp.StatusCode)
	}
}
