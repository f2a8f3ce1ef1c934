package app

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/sim"
)

// statusFleet is a PD gateway over a vLLM NIXL pair, a regular worker and a failing one, with
// some traffic behind it, and its status page served.
func statusFleet(t *testing.T, adminKey string) (status *httptest.Server, workers []string) {
	t.Helper()
	p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl, EngineID: "engine-p"})
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl, DecodePerToken: time.Millisecond})
	r := simEngine(t, sim.Config{Engine: sim.EngineSGLang})
	cfg := config.Default()
	cfg.PDDisaggregation, cfg.AdminAPIKey, cfg.ForwardSimFaults = true, adminKey, true
	cfg.Retry.Disable = true
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector"}, {URL: d.URL(), Role: config.RoleDecode},
		{URL: r.URL(), Models: []string{"other"}}}
	g, gw := startGateway(t, cfg)
	for i := 0; i < 6; i++ {
		resp, body := gwtest.PostTimeout(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"status page %d","max_tokens":4,"stream":true}`, pdModel, i))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	// One that fails: the prefill answers 503.
	req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":"fail","max_tokens":2}`, pdModel)))
	req.Header.Set("X-Sim-Fault", "status=503")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 {
		t.Fatalf("the failing request answered %d", resp.StatusCode)
	}
	status = httptest.NewServer(g.Server.StatusHandler())
	t.Cleanup(status.Close)
	return status, []string{p.URL(), d.URL(), r.URL()}
}

// GET /status.json: workers with role, runtime, connector, health, breaker; the PD pair's
// handoffs; rates and TTFT over the last minute; the recent error. Behind the admin key when one
// is set (bearer or Basic password).
func TestStatusJSON(t *testing.T) {
	t.Parallel()
	status, workers := statusFleet(t, "sk-admin")
	get := func(auth func(*http.Request)) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, status.URL+"/status.json", nil)
		auth(req)
		return do(t, req)
	}
	if code, _ := get(func(*http.Request) {}); code != 401 {
		t.Errorf("no key: %d", code)
	}
	if code, _ := get(func(r *http.Request) { r.SetBasicAuth("ops", "wrong") }); code != 401 {
		t.Errorf("wrong password: %d", code)
	}
	code, body := get(func(r *http.Request) { r.SetBasicAuth("ops", "sk-admin") })
	if code != 200 {
		t.Fatalf("status.json: %d %s", code, body)
	}
	var s struct {
		Workers []struct {
			URL, Role, Runtime, Health, Breaker, Correlation string
			Connector                                        string `json:"kv_connector"`
		}
		Pairs []struct {
			Prefill, Decode string
			Handoffs        map[string]int
			Total           int
		}
		LastMinute struct {
			RPS       float64 `json:"rps"`
			ErrorRate float64 `json:"error_rate"`
			P50       float64 `json:"ttft_p50_ms"`
		} `json:"last_minute"`
		RecentErrors []struct {
			Status       int
			Code, Worker string
		} `json:"recent_errors"`
	}
	if err := json.Unmarshal([]byte(body), &s); err != nil {
		t.Fatal(err)
	}
	if len(s.Workers) != 3 || s.Workers[0].Connector != "nixl" || s.Workers[0].Runtime != "vllm" || s.Workers[0].Health != "ready" || s.Workers[0].Breaker != "closed" ||
		s.Workers[1].Correlation != "answer-id" {
		t.Errorf("workers: %+v", s.Workers)
	}
	if len(s.Pairs) != 1 || s.Pairs[0].Prefill != workers[0] || s.Pairs[0].Decode != workers[1] || s.Pairs[0].Handoffs["nixl"] != 6 {
		t.Errorf("pairs: %+v", s.Pairs)
	}
	if s.LastMinute.RPS <= 0 || s.LastMinute.ErrorRate <= 0 || s.LastMinute.P50 <= 0 {
		t.Errorf("last minute: %+v", s.LastMinute)
	}
	// The prefill failed (it is asked first, and the fault is its): the error names it, not the
	// decode the pair would have used.
	if len(s.RecentErrors) != 1 || s.RecentErrors[0].Status != 503 || s.RecentErrors[0].Code != "prefill_upstream_error" || s.RecentErrors[0].Worker != workers[0] {
		t.Errorf("recent errors: %+v, want the prefill %s", s.RecentErrors, workers[0])
	}
	if strings.Contains(body, "sk-admin") {
		t.Error("the key shows in the status")
	}
}

// chromium returns the browser, or skips loudly (fails where BATON_REQUIRE_BROWSER is set, as
// in CI, which installs it).
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	msg := "SKIPPED: no chromium to load the status page in; install Debian's chromium (CI does)"
	if os.Getenv("BATON_REQUIRE_BROWSER") != "" {
		t.Fatal("BATON_REQUIRE_BROWSER is set but " + msg)
	}
	t.Skip(msg)
	return ""
}

// browse runs headless chromium on url with extra flags and returns what it printed.
func browse(t *testing.T, browser, url string, flags ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	args := append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
		"--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--user-data-dir=" + t.TempDir(), "--virtual-time-budget=4000"}, flags...)
	out, err := exec.CommandContext(ctx, browser, append(args, url)...).Output()
	if err != nil {
		t.Fatalf("chromium: %v", err)
	}
	return out
}

// The status page in a real browser: its script fetches status.json and renders the workers,
// the pair and the error. BATON_STATUS_SCREENSHOT=FILE also saves a screenshot (the one docs/REFERENCE.md shows).
func TestStatusPageInBrowser(t *testing.T) {
	t.Parallel()
	browser := chromium(t)
	status, workers := statusFleet(t, "")
	dom := browse(t, browser, status.URL+"/", "--dump-dom")
	for _, want := range append(workers, "nixl 6", ">ready<", ">nixl<") {
		if !bytes.Contains(dom, []byte(want)) {
			t.Errorf("the rendered page lacks %q", want)
		}
	}
	// The simulated vLLM pair names its answers after Baton's request ids: proven by id.
	for _, want := range []string{`class="pill bad">503<`, `class="pill ok">closed<`, `id="rps">`, `class="pill ok">by answer-id<`} {
		if !bytes.Contains(dom, []byte(want)) {
			t.Errorf("the rendered page lacks %s", want)
		}
	}
	if !bytes.Contains(dom, []byte(`id="meta">version `)) || !bytes.Contains(dom, []byte(`id="conn"></span>`)) {
		t.Errorf("the page did not render its data: %s", dom)
	}
	shot := os.Getenv("BATON_STATUS_SCREENSHOT")
	if shot == "" {
		shot = filepath.Join(t.TempDir(), "status.png")
	}
	abs, _ := filepath.Abs(shot)
	browse(t, browser, status.URL+"/", "--screenshot="+abs, "--window-size=1400,900", "--hide-scrollbars")
	png, err := os.ReadFile(abs)
	if err != nil || !bytes.HasPrefix(png, []byte("\x89PNG")) || len(png) < 10_000 {
		t.Fatalf("screenshot: %v (%d bytes)", err, len(png))
	}
}
