package app

import (
	"context"
	"encoding/json"
	"errors"
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
	"github.com/baton-llm/baton/internal/sim"
)

// fakeEngine is an httptest upstream that answers registration probes like an OpenAI server
// serving models, and sends everything else to handle.
func fakeEngine(t *testing.T, ownedBy string, models []string, handle http.HandlerFunc) *httptest.Server {
	t.Helper()
	return fakeEngineWith(t, ownedBy, models, handle, false)
}

// fakeEngineWith is fakeEngine; with serveMetrics false it answers the gateway's load poll (GET
// /metrics) itself with nothing, so that handle sees only the requests a test sends: a handler
// that records every request would otherwise record a poll that raced the test's first request.
func fakeEngineWith(t *testing.T, ownedBy string, models []string, handle http.HandlerFunc, serveMetrics bool) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && r.URL.Path == "/v1/models" {
			var data []map[string]any
			for _, m := range models {
				data = append(data, map[string]any{"id": m, "object": "model", "owned_by": ownedBy})
			}
			_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": data})
			return
		}
		if !serveMetrics && r.Method == http.MethodGet && r.URL.Path == "/metrics" {
			return
		}
		handle(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// startGateway wires a gateway over cfg, waits until every worker registered, and serves its
// API on an httptest server. tune changes the configuration first (shorter durations).
func startGateway(t *testing.T, cfg config.Config, tune ...func(*config.Config)) (*Gateway, *httptest.Server) {
	t.Helper()
	for _, f := range tune {
		f(&cfg)
	}
	g := runGateway(t, cfg)
	deadline := time.Now().Add(10 * time.Second)
	for _, w := range g.Registry.Snapshot().Workers {
		for !w.Registered() || !w.Ready() {
			if time.Now().After(deadline) {
				t.Fatalf("worker %s never registered", w.URL)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return g, serveAPI(t, cfg, g.Server.Handler())
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

// runGateway wires a gateway over cfg and starts it, stopped when the test ends; it does not
// wait for the workers.
func runGateway(t *testing.T, cfg config.Config) *Gateway {
	t.Helper()
	g, err := build(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); g.Wait() })
	if err := g.Start(ctx); err != nil {
		t.Fatal(err)
	}
	return g
}

// serveAPI serves h as Serve does, on the HTTP server cfg names — Baton's own by default, or
// else the one BATON_TEST_HTTP_SERVER names (baton or net: CI runs this package's whole suite on
// each). The httptest.Server carries the URL and the listener.
func serveAPI(t *testing.T, cfg config.Config, h http.Handler) *httptest.Server {
	t.Helper()
	if v := testHTTPServer(); v != "" && cfg.HTTPServer == config.Default().HTTPServer {
		cfg.HTTPServer = v // a test that names net/http's server keeps it
	}
	srv := httptest.NewUnstartedServer(h)
	api, ln, _ := apiServer(cfg, srv.Listener, h, slog.New(slog.NewTextHandler(io.Discard, nil)))
	srv.URL = "http://" + srv.Listener.Addr().String()
	done := make(chan error, 1)
	go func() { done <- api.Serve(ln) }()
	t.Cleanup(func() {
		api.Close()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("API server: %v", err)
		}
	})
	return srv
}

// testHTTPServer is the API server the suite runs on when BATON_TEST_HTTP_SERVER names one.
func testHTTPServer() string {
	switch v := os.Getenv("BATON_TEST_HTTP_SERVER"); v {
	case "", "baton", "net":
		return v
	default:
		panic("BATON_TEST_HTTP_SERVER must be baton or net, not " + strconv.Quote(v))
	}
}

func testConfig(urls ...string) config.Config {
	cfg := config.Default()
	cfg.WorkerURLs = urls
	return cfg
}

func post(t *testing.T, url, body string, hdr ...string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

func readAll(t *testing.T, r io.Reader) string {
	t.Helper()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// envelope decodes a gateway-minted OpenAI error.
type envelope struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Code    string  `json:"code"`
		Param   *string `json:"param"`
	} `json:"error"`
}

func wantEnvelope(t *testing.T, resp *http.Response, status int, code string) envelope {
	t.Helper()
	body := readAll(t, resp.Body)
	if resp.StatusCode != status {
		t.Fatalf("status = %d, want %d (body %s)", resp.StatusCode, status, body)
	}
	var e envelope
	if err := json.Unmarshal([]byte(body), &e); err != nil {
		t.Fatalf("body %q is not an error envelope: %v", body, err)
	}
	if e.Error.Code != code || e.Error.Message == "" || e.Error.Type == "" {
		t.Fatalf("envelope = %+v, want code %q with message and type", e, code)
	}
	return e
}

// Sub-second durations for tests that wait for a deadline.
func requestTimeout(d time.Duration) func(*config.Config) {
	return func(c *config.Config) { c.RequestTimeout = d }
}
func stalledTimeout(d time.Duration) func(*config.Config) {
	return func(c *config.Config) { c.StalledClientTimeout = d }
}

const pdModel = "m"

func simEngine(t *testing.T, c sim.Config) *sim.Engine {
	t.Helper()
	c.Model = pdModel
	if c.BootstrapTimeout == 0 {
		c.BootstrapTimeout = 30 * time.Second // long: a test passes only if Baton cancels, not the engine's timeout
	}
	return startSim(t, c)
}

// sglangPD starts an SGLang prefill and decode pair and a PD gateway over them.
func sglangPD(t *testing.T, pc, dc sim.Config, tweak ...func(*config.Config)) (p, d *sim.Engine, g *Gateway, url string) {
	t.Helper()
	cfg, p, d := sglangPair(t, pc, dc)
	cfg.Retry.Disable = true // these tests look at one attempt; retries are tested on their own
	g, srv := startGateway(t, cfg, tweak...)
	return p, d, g, srv.URL
}

// sglangPair starts an SGLang prefill and decode pair and returns a PD configuration over them.
func sglangPair(t *testing.T, pc, dc sim.Config) (cfg config.Config, p, d *sim.Engine) {
	t.Helper()
	pc.Engine, pc.Role = sim.EngineSGLang, sim.RolePrefill
	dc.Engine, dc.Role = sim.EngineSGLang, sim.RoleDecode
	p, d = simEngine(t, pc), simEngine(t, dc)
	cfg = config.Default()
	cfg.PDDisaggregation = true
	port := p.BootstrapPort()
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, BootstrapPort: &port}, {URL: d.URL(), Role: config.RoleDecode}}
	return cfg, p, d
}
