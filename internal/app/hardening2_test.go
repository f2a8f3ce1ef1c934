package app

// Hardening, second pass: each test here is an attack that succeeded against the gateway
// before it.

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/bench"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// eachClient runs f as a parallel subtest for each upstream client, net/http's and Baton's.
func eachClient(t *testing.T, f func(t *testing.T, client string)) {
	for _, client := range []string{"net", "baton"} {
		t.Run(client, func(t *testing.T) {
			t.Parallel()
			f(t, client)
		})
	}
}

// strayEngine is a raw engine that sends bytes nobody asked for after each completion's
// answer, the way a broken engine or a sidecar in front of one can: stray "dup" is a whole
// second answer, "204" an answer without body followed by one, "past" bytes past the
// Content-Length. Each answer names the request's X-Request-Id.
func strayEngine(t *testing.T, stray string) string {
	return gwtest.SocketEngine(t, func(c net.Conn, req *http.Request) bool {
		rid := req.Header.Get("X-Request-Id")
		body := fmt.Sprintf(`{"answer_for":%q}`, rid)
		leak := fmt.Sprintf(`{"answer_for":"LEAK of %s"}`, rid)
		answer := fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		var later string
		switch stray {
		case "dup":
			later = fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(leak), leak)
		case "204":
			answer, later = "HTTP/1.1 204 No Content\r\n\r\n", leak
		case "past":
			later = leak
		}
		// The stray bytes follow a moment later, once the answer was read and its connection
		// is idle: a check of what is already buffered does not see them.
		if _, err := io.WriteString(c, answer); err != nil {
			return false
		}
		time.Sleep(5 * time.Millisecond)
		_, err := io.WriteString(c, later)
		return err == nil
	})
}

// High 1: bytes an engine sent after an answer became the next request's answer on the reused
// connection — one client received another's. Whichever upstream client runs, every client
// gets its own answer or a clean error, and no stray byte reaches a client in any form.
func TestNoClientGetsAnothersAnswer(t *testing.T) {
	t.Parallel()
	for _, client := range []string{"net", "baton"} {
		for _, stray := range []string{"dup", "204", "past"} {
			t.Run(client+"/"+stray, func(t *testing.T) {
				t.Parallel()
				cfg := testConfig(strayEngine(t, stray))
				cfg.UpstreamClient = client
				cfg.Retry.Disable = true
				cfg.CircuitBreaker.Disable = true
				cfg.LoadPollInterval = 10 * time.Millisecond // the load poller shares the connections
				_, gw := startGateway(t, cfg)
				for i := 0; i < 20; i++ {
					// The stray bytes of the last answer (sent 5 ms after it) arrive meanwhile; the
					// margin is wide for a loaded CI machine. Stray bytes later than a reuse of the
					// connection cannot be told from its answer by any client (see docs/REFERENCE.md's
					// Security section on --upstream-client).
					time.Sleep(100 * time.Millisecond)
					rid := fmt.Sprintf("client-%d", i)
					resp := post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"mine"}`, "X-Request-Id", rid)
					body := readAll(t, resp.Body)
					if strings.Contains(body, "LEAK") || strings.Contains(body, "HTTP/1.1") {
						t.Fatalf("request %d (%d) got stray bytes: %s", i, resp.StatusCode, body)
					}
					if resp.StatusCode == 200 && stray != "204" && body != fmt.Sprintf(`{"answer_for":%q}`, rid) {
						t.Fatalf("request %d got another's answer: %s", i, body)
					}
				}
			})
		}
	}
}

func TestStdLogBridgeDropsUnsolicitedBytes(t *testing.T) {
	var out gwtest.SyncBuffer
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
	b := stdLogBridge{log: slog.New(slog.NewTextHandler(&out, nil)), unsolicited: c}
	fmt.Fprintf(b, "Unsolicited response received on idle HTTP channel starting with %q; err=<nil>\n", "HTTP/1.1 200 OK\r\n\r\nSECRET")
	if strings.Contains(out.String(), "SECRET") || testutil.ToFloat64(c) != 1 {
		t.Errorf("logged %q, counted %v", out.String(), testutil.ToFloat64(c))
	}
}

// High 2: keyless admin access was decided by the listener being loopback, so behind nginx on
// the same host (what docs/REFERENCE.md advises) anyone could add an engine that then receives users'
// prompts; and a web page could POST text/plain with a foreign Origin. Keyless admin is only on
// a loopback listener of its own, never through a proxy or from a page, and takes JSON only.
func TestAdminNeverOpenByAccident(t *testing.T) {
	t.Parallel()
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	add := fmt.Sprintf(`{"url":%q}`, "http://127.0.0.1:1")

	// The API listener on loopback, a same-host nginx in front, no admin key.
	cfg := testConfig(e.URL())
	cfg.Host, cfg.ClientAPIKey = "127.0.0.1", "sk-inference"
	_, gw := startGateway(t, cfg)
	ng, err := bench.StartNginx(gw.URL)
	switch {
	case err != nil:
		t.Fatal(err)
	case ng == nil && os.Getenv("BATON_REQUIRE_TOOLS") != "":
		t.Fatal("BATON_REQUIRE_TOOLS is set but nginx is not installed (Debian's nginx package; CI installs it)")
	case ng == nil:
		t.Log("SKIPPED the nginx part: nginx is not installed (Debian's nginx package; CI installs it)")
	default:
		t.Cleanup(ng.Stop)
		if status, body := admin(t, http.MethodPost, ng.URL+"/workers", "", add); status != 403 {
			t.Errorf("POST /workers through a same-host nginx without a key: %d %s", status, body)
		}
	}

	// A loopback admin listener of its own: keyless for the local operator, but not for a web
	// page (Origin), a proxied request, a foreign Host, or a body that is not JSON.
	cfg.AdminPort, cfg.AdminHost = 0, "127.0.0.1"
	g, _ := startGateway(t, cfg)
	own := httptest.NewServer(g.Server.AdminHandler())
	t.Cleanup(own.Close)
	for _, tc := range []struct {
		name   string
		header http.Header
		host   string
		want   int
	}{
		{"from a web page", http.Header{"Origin": {"http://evil.example"}, "Content-Type": {"application/json"}}, "", 403},
		{"through a proxy", http.Header{"X-Forwarded-For": {"203.0.113.9"}, "Content-Type": {"application/json"}}, "", 403},
		{"forwarded", http.Header{"Forwarded": {"for=203.0.113.9"}, "Content-Type": {"application/json"}}, "", 403},
		{"via", http.Header{"Via": {"1.1 proxy"}, "Content-Type": {"application/json"}}, "", 403},
		{"a rebound host name", http.Header{"Content-Type": {"application/json"}}, "evil.example", 403},
		{"text/plain", http.Header{"Content-Type": {"text/plain"}}, "", 415},
		{"the local operator", http.Header{"Content-Type": {"application/json"}}, "", 202},
	} {
		req, _ := http.NewRequest(http.MethodPost, own.URL+"/workers", strings.NewReader(add))
		req.Header = tc.header
		if tc.host != "" {
			req.Host = tc.host
		}
		if status, body := do(t, req); status != tc.want {
			t.Errorf("%s: %d, want %d: %s", tc.name, status, tc.want, body)
		}
	}
}

// A trickle, each byte inside the stalled-client timeout, is cut at the body timeout, on both
// API servers. On net/http's, the 408 never came: the server reads what is left of a small body
// before answering, with no deadline, so the trickle held the connection and its handler.
func TestTrickledBodyIsCutAtTheBodyTimeout(t *testing.T) {
	t.Parallel()
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
	for _, server := range []string{"baton", "net"} {
		t.Run(server, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig(up.URL)
			cfg.HTTPServer = server
			_, gw := startGateway(t, cfg, stalledTimeout(time.Second), func(c *config.Config) { c.BodyTimeout = 300 * time.Millisecond })
			head := "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
			c := rawRequest(t, strings.TrimPrefix(gw.URL, "http://"), head, []byte("{"))
			go func() {
				for i := 0; i < 40; i++ {
					time.Sleep(50 * time.Millisecond)
					if _, err := c.Write([]byte(" ")); err != nil {
						return
					}
				}
			}()
			if got := gwtest.ReadStatus(t, c); !strings.Contains(got, "408") {
				t.Errorf("a trickled body answered %q, want 408 at the body timeout", got)
			}
		})
	}
}

// Also: with an admin key set, the metrics listener's pprof needed none (its heap profiles show
// memory contents); it takes the admin key like the status page.
func TestPprofNeedsTheAdminKey(t *testing.T) {
	t.Parallel()
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	_, m, stop, _ := runBaton(t, "--worker-urls", e.URL(), "--enable-pprof", "--admin-api-key", "sk-admin-pprof")
	defer stop()
	if status, _ := admin(t, http.MethodGet, m+"/debug/pprof/", "", ""); status != 401 {
		t.Errorf("pprof without the admin key: %d", status)
	}
	if status, _ := admin(t, http.MethodGet, m+"/debug/pprof/", "sk-admin-pprof", ""); status != 200 {
		t.Errorf("pprof with the admin key: %d", status)
	}
}

// Also: a removed worker's idle upstream connections stayed open, so pods that left stranded
// descriptors. They are closed once its drain ends.
func TestRemovedWorkerConnectionsAreClosed(t *testing.T) {
	t.Parallel()
	eachClient(t, func(t *testing.T, client string) {
		var open atomic.Int32
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/models" {
				io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm"}]}`)
				return
			}
			io.Copy(io.Discard, r.Body)
			io.WriteString(w, "{}")
		}))
		srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
			switch s {
			case http.StateNew:
				open.Add(1)
			case http.StateClosed, http.StateHijacked:
				open.Add(-1)
			}
		}
		srv.Start()
		t.Cleanup(srv.Close)
		cfg := testConfig(srv.URL)
		cfg.UpstreamClient, cfg.AdminAPIKey = client, "sk-admin"
		g, gw := startGateway(t, cfg)
		for i := 0; i < 4; i++ {
			if resp := post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 {
				t.Fatalf("%d", resp.StatusCode)
			}
		}
		if open.Load() == 0 {
			t.Fatal("no connection to the worker is kept")
		}
		id := g.Registry.Snapshot().Workers[0].ID
		if status, body := admin(t, http.MethodDelete, gw.URL+"/workers/"+id, "sk-admin", ""); status != 202 {
			t.Fatalf("DELETE: %d %s", status, body)
		}
		poll.Until(t, "the condition", func() bool { return open.Load() == 0 })
	})
}

// Low 14: a worker added with a trailing slash was "already there" to POST, yet 404 to GET and
// DELETE by its URL: lookups normalise the URL as adding does.
func TestAdminURLsAreNormalised(t *testing.T) {
	t.Parallel()
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	cfg := testConfig(e.URL())
	cfg.AdminAPIKey = "sk-admin"
	_, gw := startGateway(t, cfg)
	if status, body := admin(t, http.MethodPost, gw.URL+"/workers", "sk-admin", `{"url":"http://127.0.0.1:9/"}`); status != 202 {
		t.Fatalf("POST: %d %s", status, body)
	}
	if status, body := admin(t, http.MethodPost, gw.URL+"/workers", "sk-admin", `{"url":"http://127.0.0.1:9"}`); status != 409 {
		t.Errorf("POST again without the slash: %d %s", status, body)
	}
	id := url.PathEscape("http://127.0.0.1:9/")
	if status, body := admin(t, http.MethodGet, gw.URL+"/workers/"+id, "sk-admin", ""); status != 200 {
		t.Errorf("GET by the URL as added: %d %s", status, body)
	}
	if status, body := admin(t, http.MethodDelete, gw.URL+"/workers/"+id, "sk-admin", ""); status != 202 {
		t.Errorf("DELETE by the URL as added: %d %s", status, body)
	}
	if status, body := admin(t, http.MethodPost, gw.URL+"/workers", "sk-admin", `{"url":"http://127.0.0.1:70000"}`); status != 400 {
		t.Errorf("a port out of range: %d %s", status, body)
	}
}

// --upstream-reuse off reaches the upstream client: every request goes on a connection of its own
// (with reuse on, they share one).
func TestUpstreamReuseOffIsWired(t *testing.T) {
	t.Parallel()
	for reuse, want := range map[string]int{"on": 1, "off": 4} {
		var mu sync.Mutex
		conns := map[net.Conn]bool{}
		url := gwtest.SocketEngine(t, func(c net.Conn, _ *http.Request) bool {
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			_, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
			return err == nil
		})
		cfg := testConfig(url)
		cfg.UpstreamReuse, cfg.LoadPollInterval = reuse, time.Hour
		_, gw := startGateway(t, cfg)
		for range 4 {
			if resp := post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 {
				t.Fatalf("reuse %s: %d", reuse, resp.StatusCode)
			}
		}
		mu.Lock()
		if len(conns) != want {
			t.Errorf("reuse %s: 4 requests on %d connections, want %d", reuse, len(conns), want)
		}
		mu.Unlock()
	}
}

// A worker proven by its X-Request-Id echo whose engine comes back without the echo (restarted
// with other settings behind the same URL) is refused while its answers cannot be told from
// another request's — then seen anew once its circuit opens: its idle connections closed, its
// next answer on a new connection relayed, its correlation none. Without that it stayed refused
// until Baton restarted.
func TestAWorkerThatStopsEchoingIsSeenAnew(t *testing.T) {
	t.Parallel()
	var echo atomic.Bool
	echo.Store(true)
	url := gwtest.SocketEngine(t, func(c net.Conn, req *http.Request) bool {
		head := "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
		on := echo.Load()
		if on {
			head += "X-Request-Id: " + req.Header.Get("X-Request-Id") + "\r\n"
		}
		_, err := io.WriteString(c, head+"\r\n{}")
		return err == nil && on // restarted: every connection is new
	})
	cfg := testConfig(url)
	cfg.LoadPollInterval = time.Hour
	cfg.CircuitBreaker.FailureThreshold, cfg.CircuitBreaker.TimeoutDuration = 2, 100*time.Millisecond
	g, gw := startGateway(t, cfg)
	w := g.Registry.Snapshot().Workers[0]
	if resp := post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 || w.Correlation() != "x-request-id" {
		t.Fatalf("%d, correlation %s", resp.StatusCode, w.Correlation())
	}
	echo.Store(false)
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp := post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
		if resp.StatusCode == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("still %d after 10 s; correlation %s", resp.StatusCode, w.Correlation())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if w.Correlation() != "none" {
		t.Errorf("correlation %s after the engine stopped echoing", w.Correlation())
	}
	if n := testutil.ToFloat64(g.Metrics.UpstreamErrors.WithLabelValues(w.URL, metrics.KindMismatch)); n == 0 {
		t.Error("the answers without the echo before the circuit opened were not counted")
	}
}

// An idle upstream connection dropped because its engine wrote to it unasked is counted in
// baton_upstream_unsolicited_total under Baton's own client, as it is under net/http's (whose
// log line the process's log bridge counts: TestStdLogBridgeDropsUnsolicitedBytes).
func TestUnsolicitedBytesAreCountedUnderBatonsClient(t *testing.T) {
	t.Parallel()
	{
		client := "baton"
		url := gwtest.SocketEngine(t, func(c net.Conn, _ *http.Request) bool {
			_, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
			time.Sleep(10 * time.Millisecond) // once the answer was read whole
			io.WriteString(c, `{"duplicate":true}`)
			return err == nil
		})
		cfg := testConfig(url)
		cfg.UpstreamClient, cfg.LoadPollInterval = client, time.Hour
		cfg.HealthCheck.Disable = true
		g, gw := startGateway(t, cfg)
		for range 3 {
			if resp := post(t, gw.URL+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 {
				t.Fatalf("%s: %d", client, resp.StatusCode)
			}
			time.Sleep(30 * time.Millisecond)
		}
		if n := testutil.ToFloat64(g.Metrics.UpstreamUnsolicited); n == 0 {
			t.Errorf("%s: no unsolicited bytes counted", client)
		}
	}
}
