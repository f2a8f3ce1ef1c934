package app

// Each test here performs an attack a single hostile client (or a broken worker) can make, and
// checks that Baton stays up, bounded and honest.

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/poll"
)

// anyModelEngine is an engine whose /v1/models lists nothing: it serves whatever model it is
// asked. Its /get_model_info names a model path (an engine's info route: it is one); other
// registration probes get 404; the runtime comes from the config.
func anyModelEngine(t *testing.T, handle http.HandlerFunc) string {
	return fakeEngine(t, "", nil, func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && r.URL.Path == "/get_model_info" {
			io.WriteString(w, `{"model_path":"/models/any"}`) // an engine, though its /v1/models lists nothing
			return
		}
		if r.Method == http.MethodGet && !strings.HasPrefix(r.URL.Path, "/health") {
			http.NotFound(w, r)
			return
		}
		handle(w, r)
	}).URL
}

func scrape(t *testing.T, g *Gateway) string {
	t.Helper()
	var b bytes.Buffer
	rec := &bodyRecorder{header: http.Header{}, buf: &b}
	req, _ := http.NewRequest(http.MethodGet, "/metrics", nil)
	g.Metrics.Handler().ServeHTTP(rec, req)
	return b.String()
}

type bodyRecorder struct {
	header http.Header
	buf    *bytes.Buffer
}

func (r *bodyRecorder) Header() http.Header         { return r.header }
func (r *bodyRecorder) Write(p []byte) (int, error) { return r.buf.Write(p) }
func (r *bodyRecorder) WriteHeader(int)             {}

// rawRequest opens a connection to the gateway and sends head (and body), leaving it open.
func rawRequest(t *testing.T, addr, head string, body []byte) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, head); err != nil {
		t.Fatal(err)
	}
	if len(body) > 0 {
		c.Write(body)
	}
	return c
}

// Item 7: credentials in a worker URL showed in headers, GET /workers, metrics and logs. They
// are refused at startup, with where they go instead, and the message does not repeat them.
func TestCredentialsInWorkerURLAreRefused(t *testing.T) {
	t.Parallel()
	var out, errOut bytes.Buffer
	err := Run(t.Context(), []string{"--worker-urls", "http://admin:hunter2@127.0.0.1:1"}, &out, &errOut)
	if err == nil {
		t.Fatal("a worker URL with credentials was accepted")
	}
	for _, text := range []string{err.Error(), out.String(), errOut.String()} {
		if strings.Contains(text, "hunter2") {
			t.Errorf("the password leaked: %s", text)
		}
	}
	if !strings.Contains(err.Error(), "api_key") {
		t.Errorf("error %q does not say where credentials go", err)
	}
}

// Item 13: a fleet that can serve nothing is said at startup. (The commands' help, version and
// bench scenarios are tested in package cli.)
func TestStartupWarnings(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  func(*config.Config)
		want string
	}{
		{func(c *config.Config) {}, "no workers are configured"},
		{func(c *config.Config) {
			c.PDDisaggregation = true
			c.Workers = []config.Worker{{URL: "http://127.0.0.1:1", Role: config.RoleDecode}}
		}, "no prefill worker"},
		{func(c *config.Config) {
			c.PDDisaggregation = true
			c.Workers = []config.Worker{{URL: "http://127.0.0.1:1", Role: config.RolePrefill}}
		}, "no decode worker"},
	} {
		cfg := config.Default()
		tc.cfg(&cfg)
		if w := strings.Join(cfg.Warnings(), "\n"); !strings.Contains(w, tc.want) {
			t.Errorf("warnings %q lack %q", w, tc.want)
		}
	}
	logs := &gwtest.SyncBuffer{}
	ctx, cancel := context.WithCancel(t.Context())
	res := make(chan error, 1)
	go func() {
		res <- Run(ctx, []string{"--port", "0", "--metrics-port", "-1", "--host", "127.0.0.1"}, io.Discard, logs)
	}()
	poll.Until(t, "the condition", func() bool { return strings.Contains(logs.String(), "baton started") })
	cancel()
	if err := <-res; err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "no workers are configured") {
		t.Errorf("a gateway with no workers started without a warning:\n%s", logs.String())
	}
}
