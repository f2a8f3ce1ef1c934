package app

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"
)

// runUntil runs Run with args in the background until the output matches re, and returns the
// first submatch; the command is stopped at cleanup and must return nil.
func runUntil(t *testing.T, re *regexp.Regexp, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{}
	res := make(chan error, 1)
	go func() { res <- Run(ctx, args, out, io.Discard) }()
	t.Cleanup(func() {
		cancel()
		if err := <-res; err != nil {
			t.Errorf("Run(%v) = %v after stop", args, err)
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		if m := re.FindStringSubmatch(out.String()); m != nil {
			return m[1]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no match for %s in %q", re, out.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestSimCommand(t *testing.T) {
	t.Parallel()
	url := runUntil(t, regexp.MustCompile(`serving on (http://\S+)`), "sim", "--engine", "sglang", "--role", "prefill", "--port", "0", "--model", "x")
	resp, err := http.Get(url + "/get_server_info")
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(t, resp.Body)
	if !strings.Contains(body, `"disaggregation_mode":"prefill"`) {
		t.Errorf("server info %s", body)
	}
	if err := Run(context.Background(), []string{"sim", "--engine", "tgi"}, io.Discard, io.Discard); err == nil {
		t.Error("sim --engine tgi: want error")
	}
}

func TestDemoCommand(t *testing.T) {
	t.Parallel()
	api := runUntil(t, regexp.MustCompile(`baton serving on (http://\S+)`), "demo", "--port", "0", "--metrics-port", "0")
	waitFor(t, func() bool { return getStatus(t, api+"/readiness") == 200 })
	for _, model := range []string{"demo-nixl", "demo-mooncake", "demo-sglang"} {
		waitFor(t, func() bool { return getStatus(t, api+"/readiness") == 200 })
		var resp *http.Response
		waitFor(t, func() bool { // each pair registers on its own
			resp = post(t, api+"/v1/chat/completions", `{"model":"`+model+`","messages":[{"role":"user","content":"hello baton"}],"max_tokens":4}`)
			return resp.StatusCode != 503
		})
		if body := readAll(t, resp.Body); resp.StatusCode != 200 || !strings.Contains(body, `"completion_tokens":4`) || resp.Header.Get("X-Sim-KV-Source") != "remote" {
			t.Errorf("demo chat on %s: %d %s (kv source %q, handoff %q)", model, resp.StatusCode, body, resp.Header.Get("X-Sim-KV-Source"), resp.Header.Get("X-Baton-Kv-Handoff"))
		}
	}
}
