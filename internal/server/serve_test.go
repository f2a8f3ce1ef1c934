package server

import (
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/h1"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// gateway is a Server over workers at urls (ready, serving model "m" on vLLM), its API served
// by an httptest server; tune changes the options first.
func gateway(t *testing.T, urls []string, tune ...func(*Options)) (*Server, string, []*worker.Worker) {
	t.Helper()
	var ws []*worker.Worker
	for _, u := range urls {
		w := worker.New(config.Worker{URL: u, Runtime: config.RuntimeVLLM, Models: []string{"m"}})
		w.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM, Models: []worker.Model{{ID: "m"}}})
		w.SetReady(true)
		ws = append(ws, w)
	}
	reg := worker.NewRegistry(ws...)
	m := metrics.New(reg)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	rr, err := policy.New(config.PolicyRoundRobin, config.Default())
	if err != nil {
		t.Fatal(err)
	}
	tr := proxy.NewTransport("net")
	t.Cleanup(func() { proxy.CloseIdle(tr, "") })
	o := Options{RequestTimeout: time.Minute, StalledClientTimeout: time.Minute, MaxPayloadSize: 1 << 20,
		Director: director.Options{MaxBatchSize: 8, Registry: reg, Metrics: m, Log: log,
			Retry:    config.Retry{MaxRetries: 3, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond, BackoffMultiplier: 1},
			Selector: &policy.Selector{Registry: reg, Policies: map[string]policy.Policy{config.RoleRegular: rr}, Observe: m.ObserveRoute}},
		Proxy: &proxy.Proxy{Transport: tr, Timeout: time.Minute, Metrics: m, Log: log}, AccessLog: true}
	for _, f := range tune {
		f(&o)
	}
	s := New(o)
	return s, listen(t, s.Handler()), ws
}

// listen serves h on a loopback port for the test and returns its URL: on Baton's own HTTP/1.1
// server, as the gateway serves its API, or on net/http's when BATON_TEST_HTTP_SERVER=net (the
// README's test command runs the package both ways).
func listen(t *testing.T, h http.Handler) string {
	t.Helper()
	if os.Getenv("BATON_TEST_HTTP_SERVER") == "net" || !h1.Supported() {
		srv := httptest.NewServer(h)
		t.Cleanup(srv.Close)
		return srv.URL
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &h1.Server{Handler: h, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute, Log: slog.New(slog.DiscardHandler)}
	done := make(chan error, 1)
	go func() { done <- hs.Serve(ln) }()
	t.Cleanup(func() {
		hs.Close()
		if err := <-done; err != nil && !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("the API server: %v", err)
		}
	})
	return "http://" + ln.Addr().String()
}

// engine is a fake OpenAI-compatible engine answering with h.
func engine(t *testing.T, h http.HandlerFunc) string {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}

// completion answers a completion whole, with its usage.
func completion(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	io.WriteString(w, `{"id":"c","object":"text_completion","choices":[{"text":"ok","index":0,"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}`)
}

func post(t *testing.T, url, body string, header ...string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(b)
}

func errorCode(t *testing.T, body string) string {
	t.Helper()
	var e struct {
		Error struct{ Code, Message, Type string } `json:"error"`
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
		t.Fatalf("not an OpenAI error envelope: %q", body)
	}
	return e.Error.Code
}

// A request is answered by a worker with Baton's headers rendered from its record — the worker,
// the request id (the client's, or Baton's) — and counted with its tokens.
func TestServeRegular(t *testing.T) {
	e := engine(t, completion)
	s, gw, _ := gateway(t, []string{e})
	resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"hello"}`, openai.HeaderRequestID, "rid-7")
	if resp.StatusCode != 200 || !strings.Contains(body, `"text":"ok"`) || resp.Header.Get(openai.HeaderWorker) != e || resp.Header.Get(openai.HeaderRequestID) != "rid-7" {
		t.Fatalf("%d %v %s", resp.StatusCode, resp.Header, body)
	}
	if n := testutil.ToFloat64(s.metrics.Tokens.WithLabelValues("m", "prompt")); n != 5 {
		t.Errorf("prompt tokens counted %v, want 5", n)
	}
	resp, _ = post(t, gw+"/v1/completions", `{"model":"m","prompt":"hello"}`)
	if rid := resp.Header.Get(openai.HeaderRequestID); len(rid) < 16 {
		t.Errorf("no request id minted: %q", rid)
	}
}

// Bad requests are refused before any worker sees them, each with its status and code in the
// OpenAI envelope.
func TestServeRefusesBadRequests(t *testing.T) {
	var seen sync.Map
	e := engine(t, func(w http.ResponseWriter, r *http.Request) { seen.Store(r.URL.Path, true); completion(w, r) })
	_, gw, _ := gateway(t, []string{e}, func(o *Options) { o.Director.APIKey = "sk-baton" })
	auth := []string{"Authorization", "Bearer sk-baton"}
	for _, c := range []struct {
		name, path, body string
		header           []string
		status           int
		code             string
	}{
		{"no key", "/v1/completions", `{"model":"m","prompt":"x"}`, nil, 401, openai.CodeInvalidAPIKey},
		{"two keys", "/v1/completions", `{"model":"m","prompt":"x"}`, append(auth, auth...), 400, openai.CodeDuplicateHeader},
		{"invalid JSON", "/v1/completions", `{"model":`, auth, 400, openai.CodeInvalidJSON},
		{"duplicate key", "/v1/completions", `{"model":"m","prompt":"x","prompt":["a","b"]}`, auth, 400, openai.CodeDuplicateKey},
		{"too many prompts", "/v1/completions", `{"model":"m","prompt":["1","2","3","4","5","6","7","8","9"]}`, auth, 400, openai.CodeBatchTooLarge},
		{"too large", "/v1/completions", `{"model":"m","prompt":"` + strings.Repeat("x", 1<<20) + `"}`, auth, 413, openai.CodePayloadTooLarge},
		{"unknown model", "/v1/completions", `{"model":"nope","prompt":"x"}`, auth, 404, openai.CodeModelNotFound},
		{"no route", "/v2/x", `{}`, auth, 404, openai.CodeNotFound},
	} {
		resp, body := post(t, gw+c.path, c.body, c.header...)
		if resp.StatusCode != c.status || errorCode(t, body) != c.code {
			t.Errorf("%s: %d %s, want %d %s", c.name, resp.StatusCode, body, c.status, c.code)
		}
		if resp.Header.Get(openai.HeaderWorker) != "" {
			t.Errorf("%s: a worker is named on a refusal", c.name)
		}
	}
	if _, ok := seen.Load("/v1/completions"); ok {
		t.Error("a refused request reached the worker")
	}
}

// A retryable failure is retried on another worker (the failed one avoided) and the answer's
// headers name the worker that answered, not the one that failed; when every try fails the
// client gets the last worker's own answer, and a worker that cannot be reached is a 502 in
// Baton's envelope.
func TestServeRetries(t *testing.T) {
	busy := engine(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.WriteHeader(503)
		io.WriteString(w, `{"error":{"message":"busy"}}`)
	})
	ok := engine(t, completion)
	s, gw, _ := gateway(t, []string{busy, ok})
	for range 4 { // round robin starts on either: every request ends on the healthy one
		resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"x"}`)
		if resp.StatusCode != 200 || resp.Header.Get(openai.HeaderWorker) != ok {
			t.Fatalf("%d from %q: %s", resp.StatusCode, resp.Header.Get(openai.HeaderWorker), body)
		}
	}
	if n := testutil.ToFloat64(s.metrics.Retries.WithLabelValues("POST /v1/completions", "status_503")); n < 1 {
		t.Errorf("retries counted %v", n)
	}

	_, gw, _ = gateway(t, []string{busy})
	resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if resp.StatusCode != 503 || !strings.Contains(body, "busy") || resp.Header.Get(openai.HeaderWorker) != busy {
		t.Errorf("exhausted: %d %q %s", resp.StatusCode, resp.Header.Get(openai.HeaderWorker), body)
	}

	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	ln.Close()
	s, gw, _ = gateway(t, []string{"http://" + ln.Addr().String()})
	resp, body = post(t, gw+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if resp.StatusCode != 502 || errorCode(t, body) != openai.CodeUpstreamUnreachable {
		t.Errorf("unreachable: %d %s", resp.StatusCode, body)
	}
	// The answer's code reached the request's record: the status page lists the failure by it.
	rec := httptest.NewRecorder()
	s.StatusHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/status.json", nil))
	if !strings.Contains(rec.Body.String(), `"code":"`+openai.CodeUpstreamUnreachable+`"`) {
		t.Errorf("the status page's recent errors: %s", rec.Body.String())
	}
}

// Past the request deadline the client gets 504; past the admission queue, 503 overloaded with
// Retry-After; draining, readiness says so.
func TestServeDeadlinesAdmissionAndReadiness(t *testing.T) {
	release := make(chan struct{})
	slow := engine(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		completion(w, r)
	})
	_, gw, _ := gateway(t, []string{slow}, func(o *Options) { o.RequestTimeout = 100 * time.Millisecond })
	resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if resp.StatusCode != 504 || errorCode(t, body) != openai.CodeUpstreamTimeout {
		t.Errorf("deadline: %d %s", resp.StatusCode, body)
	}

	s, gw, _ := gateway(t, []string{slow}, func(o *Options) {
		o.Director.Admission = config.Admission{MaxConcurrentRequests: 1, QueueSize: 0, QueueTimeout: time.Second}
	})
	go func() {
		if resp, err := http.Post(gw+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x"}`)); err == nil {
			resp.Body.Close()
		}
	}()
	poll.Until(t, "the first request in flight", func() bool { return s.InFlight() == 1 })
	resp, body = post(t, gw+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if resp.StatusCode != 503 || errorCode(t, body) != openai.CodeQueueFull || resp.Header.Get("Retry-After") == "" {
		t.Errorf("admission: %d %v %s", resp.StatusCode, resp.Header, body)
	}

	for path, want := range map[string]int{"/liveness": 200, "/readiness": 200, "/health": 200} {
		if resp, err := http.Get(gw + path); err != nil || resp.StatusCode != want {
			t.Errorf("%s: %v %v", path, err, resp)
		}
	}
	s.SetDraining()
	if resp, err := http.Get(gw + "/readiness"); err != nil || resp.StatusCode != 503 {
		t.Errorf("readiness while draining: %v %v", err, resp)
	}
	close(release) // the request holding the one slot ends
}

// A PD route goes through a pair: the answer's headers, rendered from the record as its head
// went out, name the pair, the decode as the worker, and the handoff that happened.
func TestServePD(t *testing.T) {
	start := func(role string) *sim.Engine {
		e, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Role: role, KVConnector: sim.ConnectorNixl, Model: "m", EngineID: role})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Close)
		return e
	}
	p, d := start(sim.RolePrefill), start(sim.RoleDecode)
	s, gw, _ := gateway(t, nil, func(o *Options) {
		pw := worker.New(config.Worker{URL: p.URL(), Role: config.RolePrefill, Runtime: config.RuntimeVLLM, KVConnector: "NixlConnector", Models: []string{"m"}})
		dw := worker.New(config.Worker{URL: d.URL(), Role: config.RoleDecode, Runtime: config.RuntimeVLLM, KVConnector: "nixl", Models: []string{"m"}})
		for _, w := range []*worker.Worker{pw, dw} {
			w.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM, Models: []worker.Model{{ID: "m"}}})
			w.SetReady(true)
			if err := o.Director.Registry.Add(w); err != nil {
				t.Fatal(err)
			}
		}
		rr, _ := policy.New(config.PolicyRoundRobin, config.Default())
		o.Director.Selector.Policies = map[string]policy.Policy{config.RolePrefill: rr, config.RoleDecode: rr}
		par := &pd.Parallel{Proxy: o.Proxy, Metrics: o.Director.Metrics, Log: o.Director.Log}
		o.Director.PD, o.Dispatcher = true, &pd.Dispatcher{Parallel: par, Sequential: &pd.Sequential{Proxy: o.Proxy, Metrics: o.Director.Metrics, Log: o.Director.Log, Concurrent: par}}
	})
	for _, body := range []string{`{"model":"m","prompt":"hand it off","max_tokens":3}`,
		`{"model":"m","prompt":"hand it off","max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`} {
		resp, out := post(t, gw+"/v1/completions", body)
		h := resp.Header
		if resp.StatusCode != 200 || h.Get(openai.HeaderPrefillWorker) != p.URL() || h.Get(openai.HeaderDecodeWorker) != d.URL() ||
			h.Get(openai.HeaderWorker) != d.URL() || h.Get(openai.HeaderKVHandoff) != pd.HandoffNixl {
			t.Errorf("%d %v %s", resp.StatusCode, h, out)
		}
	}
	if n := testutil.ToFloat64(s.metrics.PairHandoffs.WithLabelValues(p.URL(), d.URL(), pd.HandoffNixl)); n != 2 {
		t.Errorf("pair handoffs counted %v", n)
	}
	// GET /workers shows both workers' connectors, the decode's too.
	if resp, err := http.Get(gw + "/workers"); err != nil {
		t.Fatal(err)
	} else {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if n := strings.Count(string(b), `"kv_connector":"nixl"`); n != 2 {
			t.Errorf("connectors shown %d times, want 2: %s", n, b)
		}
	}
	// n>1 cannot be handed off by design: counted apart from recomputes, on the page and in
	// the metric's class.
	if resp, out := post(t, gw+"/v1/completions", `{"model":"m","prompt":"two","max_tokens":2,"n":2}`); resp.StatusCode != 200 || resp.Header.Get(openai.HeaderKVHandoff) != pd.HandoffNoneN {
		t.Fatalf("n=2: %d %q %s", resp.StatusCode, resp.Header.Get(openai.HeaderKVHandoff), out)
	}
	rec := httptest.NewRecorder()
	s.StatusHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/status.json", nil))
	if body := rec.Body.String(); !strings.Contains(body, `"recomputed":0,"by_design":1,"failed":0`) {
		t.Errorf("the page's pair row: %s", body)
	}
	if n := testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues(pd.HandoffNoneN, pd.ClassByDesign, pd.ModeNixl)); n != 1 {
		t.Errorf("n>1 counted %v in class by_design", n)
	}
}

// Readiness means "can serve": ready while any model the workers name can be served — a ready
// worker, or in PD a ready prefill and decode that can hand KV to each other — naming, per model
// it cannot serve, what is missing; a 503 when none can. (One model losing its only engine used
// to take the whole gateway out of its Service: every model down.)
func TestReadinessPerModel(t *testing.T) {
	get := func(gw string) (int, string) {
		resp, err := http.Get(gw + "/readiness")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	add := func(o *Options, url, role, runtime string, models []string, ready bool) *worker.Worker {
		w := worker.New(config.Worker{URL: url, Role: role, Runtime: runtime, Models: models})
		var ms []worker.Model
		for _, m := range models {
			ms = append(ms, worker.Model{ID: m})
		}
		w.SetInfo(&worker.Info{Runtime: runtime, Models: ms})
		w.SetReady(ready)
		if err := o.Director.Registry.Add(w); err != nil {
			t.Fatal(err)
		}
		return w
	}
	// Regular: model "m" is served, model "n"'s only worker is down: ready, naming n.
	var a *worker.Worker
	_, gw, ws := gateway(t, []string{"http://a:1"}, func(o *Options) {
		add(o, "http://b:1", config.RoleRegular, config.RuntimeVLLM, []string{"n"}, false)
	})
	a = ws[0]
	if code, body := get(gw); code != 200 || !strings.Contains(body, `"unservable":["model \"n\": no ready worker`) || strings.Contains(body, `model \"m\"`) {
		t.Errorf("a model without a ready worker, another served: %d %s", code, body)
	}
	a.SetReady(false) // and now none: 503, naming both
	if code, body := get(gw); code != 503 || !strings.Contains(body, `model \"n\": no ready worker`) || !strings.Contains(body, `model \"m\"`) {
		t.Errorf("no model served: %d %s", code, body)
	}

	pdFleet := func(decodeRuntime string) string {
		_, gw, _ := gateway(t, nil, func(o *Options) {
			o.Director.PD = true
			o.Director.Selector.Compatible = func(p, d *worker.Worker) bool { return pd.Compatible(p, d, "") }
			add(o, "http://p:1", config.RolePrefill, config.RuntimeVLLM, []string{"m"}, true)
			add(o, "http://d:1", config.RoleDecode, decodeRuntime, []string{"m"}, true)
		})
		return gw
	}
	// A vLLM prefill facing an SGLang decode: every request would be 503, so is readiness.
	if code, body := get(pdFleet(config.RuntimeSGLang)); code != 503 || !strings.Contains(body, "can hand KV to each other") {
		t.Errorf("an incompatible pair: %d %s", code, body)
	}
	if code, body := get(pdFleet(config.RuntimeVLLM)); code != 200 || !strings.Contains(body, `"models":["m"]`) {
		t.Errorf("a compatible pair: %d %s", code, body)
	}
	// No decode at all.
	_, gw, _ = gateway(t, nil, func(o *Options) {
		o.Director.PD = true
		add(o, "http://p:1", config.RolePrefill, config.RuntimeVLLM, []string{"m"}, true)
	})
	if code, body := get(gw); code != 503 || !strings.Contains(body, "no ready decode worker") {
		t.Errorf("no decode: %d %s", code, body)
	}
}
