package app

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/poll"
)

var addrLine = regexp.MustCompile(`baton serving on (https?://\S+) \(metrics on (http://\S+)/metrics\)`)

// runBaton runs Run in the background and returns the API and metrics base URLs, a stop
// function (as SIGTERM would) and a channel with Run's result.
func runBaton(t *testing.T, args ...string) (api, metricsURL string, stop func(), result <-chan error) {
	t.Helper()
	r := startRun(t, args...)
	return r.api, r.metrics, r.stop, r.result
}

// running is a Baton started by startRun, with its output.
type running struct {
	api, metrics string
	out, logs    *gwtest.SyncBuffer
	stop         func()
	result       <-chan error
}

func startRun(t *testing.T, args ...string) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out, logs := &gwtest.SyncBuffer{}, &gwtest.SyncBuffer{}
	res := make(chan error, 1)
	go func() {
		res <- Run(ctx, append([]string{"serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"}, args...), out, logs)
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if m := addrLine.FindStringSubmatch(out.String()); m != nil {
			t.Cleanup(func() {
				cancel()
				if t.Failed() {
					t.Logf("baton logs:\n%s", logs.String())
				}
			})
			return &running{api: m[1], metrics: m[2], out: out, logs: logs, stop: cancel, result: res}
		}
		select {
		case err := <-res:
			cancel()
			t.Fatalf("Run ended early: %v\nlogs: %s", err, logs.String())
		default:
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("baton did not start; stdout %q", out.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func getStatus(t *testing.T, url string) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// getStatusKey is getStatus with a bearer key ("" for none).
func getStatusKey(t *testing.T, url, key string) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// Both API servers (Baton's own and net/http's) drain an open stream to its end.
func TestGracefulDrainOfOpenStream(t *testing.T) {
	t.Parallel()
	for _, server := range []string{"baton", "net"} {
		t.Run(server, func(t *testing.T) {
			release := make(chan struct{})
			up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
				io.ReadAll(r.Body)
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, "data: {\"n\":1}\n\n")
				w.(http.Flusher).Flush()
				<-release
				io.WriteString(w, "data: {\"n\":2}\n\ndata: [DONE]\n\n")
			})
			r := startRun(t, "--worker-urls", up.URL, "--http-server", server)
			api, stop, result := r.api, r.stop, r.result
			poll.Until(t, "the condition", func() bool { return getStatus(t, api+"/readiness") == 200 })
			// The listener serves before the startup line is written: wait for it.
			poll.Until(t, "the condition", func() bool { return strings.Contains(r.logs.String(), "baton started") })
			if !strings.Contains(r.logs.String(), "http_server="+server) {
				t.Errorf("the startup line does not name the %s server:\n%s", server, r.logs.String())
			}

			resp := post(t, api+"/v1/chat/completions", `{"model":"m","stream":true}`)
			br := bufio.NewReader(resp.Body)
			if line, _ := br.ReadString('\n'); line != "data: {\"n\":1}\n" {
				t.Fatalf("first event %q", line)
			}
			stop() // SIGTERM
			poll.Until(t, "the condition", func() bool { return getStatus(t, api+"/readiness") == 503 })
			select {
			case err := <-result:
				t.Fatalf("Run returned (%v) while a stream was open", err)
			case <-time.After(50 * time.Millisecond):
			}
			close(release)
			rest, err := io.ReadAll(br)
			if err != nil {
				t.Fatalf("stream broken during drain: %v", err)
			}
			if string(rest) != "\ndata: {\"n\":2}\n\ndata: [DONE]\n\n" {
				t.Errorf("rest of stream %q", rest)
			}
			select {
			case err := <-result:
				if err != nil {
					t.Fatalf("Run = %v, want nil after drain", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("Run did not return after the stream ended")
			}
		})
	}
}

func TestReadinessWaitsForAWorkerAndMetricsServe(t *testing.T) {
	t.Parallel()
	var up bool
	var mu sync.Mutex
	eng := fakeEngine(t, "sglang", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		io.WriteString(w, `{"ok":true}`)
	})
	// A front that drops connections until the engine is "loaded".
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		ok := up
		mu.Unlock()
		if !ok {
			c, _, _ := w.(http.Hijacker).Hijack()
			c.Close()
			return
		}
		req, _ := http.NewRequest(r.Method, eng.URL+r.URL.Path, r.Body)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			w.WriteHeader(502)
			return
		}
		defer resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
		io.Copy(w, resp.Body)
	}))
	defer front.Close()
	api, metricsURL, _, _ := runBaton(t, "--worker-urls", front.URL, "--detect-interval-secs", "1")
	if s := getStatus(t, api+"/readiness"); s != 503 {
		t.Fatalf("readiness %d before any worker registered, want 503", s)
	}
	if s := getStatus(t, api+"/liveness"); s != 200 {
		t.Fatalf("liveness %d, want 200", s)
	}
	resp := post(t, api+"/v1/chat/completions", `{"model":"m"}`)
	wantEnvelope(t, resp, 503, "no_available_workers")
	mu.Lock()
	up = true
	mu.Unlock()
	poll.Until(t, "the condition", func() bool { return getStatus(t, api+"/readiness") == 200 })
	if resp := post(t, api+"/v1/chat/completions", `{"model":"m"}`); resp.StatusCode != 200 {
		t.Fatalf("status %d after registration", resp.StatusCode)
	}
	mresp, err := http.Get(metricsURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(t, mresp.Body)
	for _, want := range []string{
		`baton_requests_total{model="m",route="POST /v1/chat/completions",status="200"} 1`,
		// Before registration no worker listed "m": a name no worker serves is no label.
		`baton_requests_total{model="unknown",route="POST /v1/chat/completions",status="503"} 1`,
		`baton_worker_requests_active{role="regular",worker="` + front.URL + `"} 0`,
		`baton_worker_ready{role="regular",worker="` + front.URL + `"} 1`,
		`baton_request_duration_seconds_count{model="m",route="POST /v1/chat/completions"} 1`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

func TestStartupErrors(t *testing.T) {
	t.Parallel()
	var out, errOut bytes.Buffer
	err := Run(context.Background(), []string{"--port", "99999", "--policy", "bogus"}, &out, &errOut)
	if err == nil || !strings.Contains(err.Error(), "port 99999") || !strings.Contains(err.Error(), `policy "bogus"`) {
		t.Fatalf("Run = %v, want both problems reported", err)
	}
	if err := Run(context.Background(), []string{"frobnicate"}, &out, &errOut); err == nil {
		t.Fatal("unknown command: want error")
	}
	if err := Run(context.Background(), []string{"--help"}, &out, &errOut); !errors.Is(err, config.ErrHelp) || !strings.Contains(out.String(), "--worker-urls") {
		t.Fatalf("--help = %v, usage %q", err, out.String())
	}
}

func TestConfigFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "baton.yaml")
	os.WriteFile(path, []byte(`
port: 31000
policy: random
workers:
  - url: http://10.0.0.1:8000
    role: regular
    runtime: vllm
    models: [llama]
    labels: {zone: a}
    api_key: k
`), 0o600)
	cfg, err := config.Parse([]string{"--config", path, "--port", "32000"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Port != 32000 || cfg.Policy != "random" || len(cfg.Workers) != 1 || cfg.Workers[0].Labels["zone"] != "a" || cfg.MetricsPort != 29000 {
		t.Fatalf("config = %+v", cfg)
	}
	os.WriteFile(path, []byte("port: 1\nprot: 2\nworkers:\n  - url: http://x\n    rolee: prefill\n"), 0o600)
	if _, err := config.Parse([]string{"--config", path}, io.Discard); err == nil || !strings.Contains(err.Error(), "prot") {
		t.Fatalf("unknown key: err = %v", err)
	}
}

// A client that never finishes its headers is disconnected after the read-header timeout; an
// idle timeout shorter than a stream does not cut the stream.
func TestSlowClientTimeoutsSpareStreams(t *testing.T) {
	t.Parallel()
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < 6; i++ {
			io.WriteString(w, "data: {}\n\n")
			w.(http.Flusher).Flush()
			time.Sleep(400 * time.Millisecond) // 2.4 s in all, longer than both timeouts
		}
		io.WriteString(w, "data: [DONE]\n\n")
	})
	api, _, _, _ := runBaton(t, "--worker-urls", up.URL, "--read-header-timeout-secs", "1", "--idle-timeout-secs", "1")
	poll.Until(t, "the condition", func() bool { return getStatus(t, api+"/readiness") == 200 })

	conn, err := net.Dial("tcp", strings.TrimPrefix(api, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	io.WriteString(conn, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n") // and then nothing
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadAll(conn); err != nil {
		t.Fatalf("slow client was not disconnected: %v", err)
	}

	resp := post(t, api+"/v1/completions", `{"model":"m","stream":true}`)
	body, err := io.ReadAll(resp.Body)
	if err != nil || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
		t.Fatalf("stream cut: %v %q", err, body)
	}
}

var adminLine = regexp.MustCompile(`baton admin API on (http://\S+)`)

// What Serve puts on its listeners: the admin API on its own (--admin-port), the status page on
// the metrics port; and the access log line of a request, which names the route, status and
// worker and never the prompt or a key.
func TestServeListenersAndAccessLog(t *testing.T) {
	t.Parallel()
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"text":"hi"}],"usage":{"prompt_tokens":5,"completion_tokens":2}}`)
	})
	r := startRun(t, "--worker-urls", up.URL, "--client-api-key", "sk-inference-secret", "--admin-port", "0", "--admin-host", "127.0.0.1")
	m := adminLine.FindStringSubmatch(r.out.String())
	if m == nil {
		t.Fatalf("no admin listener announced: %q", r.out.String())
	}
	if status, body := admin(t, http.MethodPost, m[1]+"/workers", "", `{"url":"http://127.0.0.1:9"}`); status != 202 {
		t.Errorf("admin API on its own loopback listener: %d %s", status, body)
	}
	if status, _ := admin(t, http.MethodPost, r.api+"/workers", "sk-inference-secret", `{"url":"http://127.0.0.1:8"}`); status != http.StatusNotFound && status != http.StatusMethodNotAllowed {
		t.Errorf("admin route on the API port with its own listener: %d", status)
	}
	resp, err := http.Get(r.metrics + "/")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") || !strings.Contains(string(page), "status.json") {
		t.Errorf("status page on the metrics port: %d %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if code := getStatus(t, r.metrics+"/status.json"); code != 200 {
		t.Errorf("status.json: %d", code)
	}
	poll.Until(t, "the condition", func() bool {
		w := findWorker(listWorkers(t, r.api, "sk-inference-secret"), up.URL)
		return w != nil && w.Ready
	})
	resp = post(t, r.api+"/v1/completions", `{"model":"m","prompt":"a very private prompt"}`, "Authorization", "Bearer sk-inference-secret")
	io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	var line string
	poll.Until(t, "the condition", func() bool {
		for _, l := range strings.Split(r.logs.String(), "\n") {
			if strings.Contains(l, "msg=request") && strings.Contains(l, "/v1/completions") {
				line = l
			}
		}
		return line != ""
	})
	for _, want := range []string{"method=POST route=/v1/completions ", "status=200", "worker=" + up.URL, "prompt_tokens=5", "completion_tokens=2", "attempts=1", "request_id=",
		"client=127.0.0.1:"} {
		if !strings.Contains(line, want) {
			t.Errorf("access log line lacks %s: %s", want, line)
		}
	}
	if strings.Count(line, "POST") != 1 {
		t.Errorf("the method repeated: %s", line)
	}
	if strings.Contains(r.logs.String(), "private prompt") || strings.Contains(r.logs.String(), "sk-inference-secret") {
		t.Error("the log holds the prompt or the key")
	}
}
