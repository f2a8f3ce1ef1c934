package server

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/worker"
)

func testServer(t *testing.T) *Server {
	t.Helper()
	reg := worker.NewRegistry()
	m := metrics.New(reg)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	px := &proxy.Proxy{Transport: http.DefaultTransport, Metrics: m, Log: log}
	return New(Options{RequestTimeout: time.Minute, StalledClientTimeout: time.Minute, Proxy: px, Director: director.Options{Registry: reg, Metrics: m, Log: log}})
}

// A panic in a handler fails that request with 500 in the OpenAI envelope, or breaks the
// response when part of it went out; either way it is counted and the server lives on.
func TestPanicInHandlerFailsOneRequest(t *testing.T) {
	s := testServer(t)
	srv := httptest.NewServer(s.observe(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/late" {
			w.Header().Set("Content-Length", "100")
			io.WriteString(w, "partial")
			http.NewResponseController(w).Flush()
		}
		panic("a bug")
	})))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/early")
	if err != nil {
		t.Fatal(err)
	}
	var env struct {
		Error struct{ Code string } `json:"error"`
	}
	json.NewDecoder(resp.Body).Decode(&env)
	resp.Body.Close()
	if resp.StatusCode != 500 || env.Error.Code != "internal_error" {
		t.Errorf("early panic: %d %q, want 500 internal_error", resp.StatusCode, env.Error.Code)
	}
	resp, err = http.Get(srv.URL + "/late")
	if err == nil {
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	if err == nil {
		t.Error("a panic after the first byte left the response looking complete")
	}
	if n := testutil.ToFloat64(s.metrics.Panics.WithLabelValues("handler")); n != 2 {
		t.Errorf("panics counted %v, want 2", n)
	}
	if s.InFlight() != 0 {
		t.Errorf("in flight %d after the panics", s.InFlight())
	}
}

func TestRequestIDIsBounded(t *testing.T) {
	for _, tc := range []struct {
		in   []string
		keep bool
	}{
		{[]string{"abc-123"}, true},
		{nil, false},
		{[]string{""}, false},
		{[]string{"a", "b"}, false},
		{[]string{string(make([]byte, 129))}, false},
		{[]string{"has space"}, false},
		{[]string{"caf\xc3\xa9"}, false},
	} {
		h := http.Header{}
		if tc.in != nil {
			h["X-Request-Id"] = tc.in
		}
		got := openai.RequestID(h)
		if tc.keep != (len(tc.in) == 1 && got == tc.in[0]) || len(h["X-Request-Id"]) != 1 || h.Get("X-Request-Id") != got {
			t.Errorf("requestID(%q) = %q, header %q", tc.in, got, h["X-Request-Id"])
		}
	}
}

// A path or method of tens of kilobytes (what the client's headers allow) is quoted back, in the
// no-route answer, by a few hundred bytes at most.
func TestNoRouteQuotesLittle(t *testing.T) {
	s := testServer(t)
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	for _, c := range []struct{ method, path string }{
		{http.MethodPost, "/" + strings.Repeat("p", 60000)},
		{strings.Repeat("M", 60000), "/x"},
	} {
		req, _ := http.NewRequest(c.method, srv.URL+c.path, strings.NewReader("{}"))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound && resp.StatusCode != http.StatusMethodNotAllowed && resp.StatusCode != http.StatusBadRequest || len(b) > 1024 {
			t.Errorf("%.20s %.20s: %d, %d bytes", c.method, c.path, resp.StatusCode, len(b))
		}
	}
}
