package app

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// admin sends an admin API request and returns its status and body.
func admin(t *testing.T, method, url, key, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	return do(t, req)
}

// do sends req and returns its status and body.
func do(t *testing.T, req *http.Request) (int, string) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// workerState is one worker of GET /workers.
type workerState struct {
	ID, URL, Source string
	Draining, Ready bool
	InFlight        int64 `json:"in_flight"`
	Labels          map[string]string
}

func listWorkers(t *testing.T, url, key string) []workerState {
	t.Helper()
	status, body := admin(t, http.MethodGet, url+"/workers", key, "")
	if status != 200 {
		t.Fatalf("GET /workers: %d %s", status, body)
	}
	var v struct{ Workers []workerState }
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatal(err)
	}
	return v.Workers
}

// countEvents reads an SSE stream to its end: the number of data events, and the last one.
func countEvents(resp *http.Response) string {
	defer resp.Body.Close()
	events, last := 0, ""
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			events, last = events+1, d
		}
	}
	return fmt.Sprintf("%d events, last %s, err %v", events, last, sc.Err())
}

func findWorker(ws []workerState, url string) *workerState {
	for i := range ws {
		if ws[i].URL == url {
			return &ws[i]
		}
	}
	return nil
}

// The admin API adds a worker (it registers and takes traffic), refuses a duplicate and bad
// input, patches one (new settings, no key shown), and removes one by draining it: a stream open
// on it runs to its end, no new request reaches it, then it leaves.
func TestAdminAPIAddPatchDrain(t *testing.T) {
	t.Parallel()
	a := simEngine(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 20 * time.Millisecond})
	b := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	cfg := testConfig(a.URL())
	cfg.APIKey, cfg.AdminAPIKey = "sk-inference", "sk-admin"
	g, gw := startGateway(t, cfg)

	// Auth: no key, the inference key, a wrong key.
	for _, key := range []string{"", "sk-inference", "sk-nope"} {
		if status, body := admin(t, http.MethodPost, gw.URL+"/workers", key, fmt.Sprintf(`{"url":%q}`, b.URL())); status != 401 || !strings.Contains(body, "admin API key") {
			t.Errorf("key %q: %d %s", key, status, body)
		}
	}
	// GET /workers answers to either key: --api-key alone is the fleet's one client.
	listWorkers(t, gw.URL, "sk-inference")

	status, body := admin(t, http.MethodPost, gw.URL+"/workers", "sk-admin", fmt.Sprintf(`{"url":%q,"worker_type":"regular","labels":{"zone":"a"}}`, b.URL()))
	if status != 202 || !strings.Contains(body, `"worker_id":"`+worker.ID(b.URL())+`"`) {
		t.Fatalf("add: %d %s", status, body)
	}
	poll.Until(t, "the condition", func() bool { w := findWorker(listWorkers(t, gw.URL, "sk-admin"), b.URL()); return w != nil && w.Ready })
	if w := findWorker(listWorkers(t, gw.URL, "sk-admin"), b.URL()); w.Source != "admin" || w.Labels["zone"] != "a" {
		t.Errorf("added worker: %+v", w)
	}
	if status, body := admin(t, http.MethodPost, gw.URL+"/workers", "sk-admin", fmt.Sprintf(`{"url":%q}`, b.URL())); status != 409 || !strings.Contains(body, "worker_already_exists") {
		t.Errorf("duplicate: %d %s", status, body)
	}

	// Bad input: each a 4xx in the OpenAI envelope, nothing added.
	for _, c := range []struct {
		body   string
		status int
		want   string
	}{
		{`{"url":`, 400, "invalid_json"},
		{`{"url":"http://x:1","priority":5}`, 400, "unknown field"},
		{`{"url":"ftp://x:1"}`, 400, "bad_request"},
		{`{"url":"http://x:1","role":"prefill"}`, 400, "pd_disaggregation"},
		{`{"url":"http://user:hunter2@x:1"}`, 400, "api_key"},
		{`{"url":"http://x:1","dp_size":100000}`, 400, "dp_size"},
		{`{"url":"http://x:1","role":"decode","worker_type":"prefill"}`, 400, "disagree"},
		{`{}`, 400, "url is required"},
		{`{"url":"http://x:1"} {"url":"http://y:1"}`, 400, "more than one"},
		{`{"url":"http://x:1","labels":{"a":"` + strings.Repeat("b", 2<<20) + `"}}`, 413, "payload_too_large"},
	} {
		status, body := admin(t, http.MethodPost, gw.URL+"/workers", "sk-admin", c.body)
		if status != c.status || !strings.Contains(body, c.want) || !strings.Contains(body, `"error":{`) || strings.Contains(body, "hunter2") {
			t.Errorf("%.60s: %d %.300s", c.body, status, body)
		}
	}
	if n := len(listWorkers(t, gw.URL, "sk-admin")); n != 2 {
		t.Errorf("%d workers after bad input, want 2", n)
	}
	if status, body := admin(t, http.MethodGet, gw.URL+"/workers/nope", "sk-admin", ""); status != 404 || !strings.Contains(body, "worker_not_found") {
		t.Errorf("unknown id: %d %s", status, body)
	}
	if status, _ := admin(t, http.MethodPatch, gw.URL+"/workers/nope", "sk-admin", `{"labels":{}}`); status != 404 {
		t.Errorf("patch unknown: %d", status)
	}

	// Patch: labels and the worker's key change; the key is never shown.
	status, body = admin(t, http.MethodPatch, gw.URL+"/workers/"+worker.ID(b.URL()), "sk-admin", `{"labels":{"zone":"b"},"api_key":"sk-engine-secret"}`)
	if status != 202 || strings.Contains(body, "sk-engine-secret") {
		t.Fatalf("patch: %d %s", status, body)
	}
	if w := g.Registry.Snapshot().Get(worker.ID(b.URL())); w.APIKey != "sk-engine-secret" || w.Labels["zone"] != "b" || !w.Ready() {
		t.Errorf("patched worker: key %q labels %v ready %v", w.APIKey, w.Labels, w.Ready())
	}
	if _, body := admin(t, http.MethodGet, gw.URL+"/workers/"+worker.ID(b.URL()), "sk-admin", ""); strings.Contains(body, "sk-engine-secret") || !strings.Contains(body, `"zone":"b"`) {
		t.Errorf("GET after patch: %s", body)
	}

	// Drain a: open a slow stream on it, delete it, check it finishes and a leaves afterwards.
	streamDone := make(chan string, 1)
	go func() {
		for {
			req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":"drain me","max_tokens":40,"stream":true}`, pdModel)))
			req.Header.Set("Authorization", "Bearer sk-inference")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				streamDone <- err.Error()
				return
			}
			if resp.Header.Get("X-Baton-Worker") != a.URL() {
				resp.Body.Close()
				continue // round robin: try again until the stream is on a
			}
			streamDone <- countEvents(resp)
			return
		}
	}()
	poll.Until(t, "the condition", func() bool { return g.Registry.Snapshot().Get(a.URL()).InFlight() > 0 })
	status, body = admin(t, http.MethodDelete, gw.URL+"/workers/"+worker.ID(a.URL()), "sk-admin", "")
	if status != 202 || !strings.Contains(body, `"in_flight":1`) {
		t.Fatalf("delete: %d %s", status, body)
	}
	if w := findWorker(listWorkers(t, gw.URL, "sk-admin"), a.URL()); w == nil || !w.Draining || w.Ready {
		t.Errorf("deleted worker while its stream runs: %+v", w)
	}
	for i := 0; i < 4; i++ { // new requests go to b only
		resp := post(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":1}`, pdModel), "Authorization", "Bearer sk-inference")
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Worker") != b.URL() {
			t.Errorf("request during the drain: %d on %s", resp.StatusCode, resp.Header.Get("X-Baton-Worker"))
		}
	}
	// The same request straight to the engine: the stream through the drain is whole.
	req, _ := http.NewRequest(http.MethodPost, a.URL()+"/v1/completions", strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":"drain me","max_tokens":40,"stream":true}`, pdModel)))
	direct, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	want := countEvents(direct)
	if got := <-streamDone; got != want || !strings.Contains(got, "[DONE]") {
		t.Errorf("the stream on the drained worker: %s, want %s", got, want)
	}
	poll.Until(t, "the condition", func() bool { return findWorker(listWorkers(t, gw.URL, "sk-admin"), a.URL()) == nil })
	m := scrape(t, g)
	for _, want := range []string{`baton_fleet_changes_total{op="add",source="admin"} 1`, `baton_fleet_changes_total{op="update",source="admin"} 1`, `baton_fleet_changes_total{op="remove",source="admin"} 1`} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	if status, _ := admin(t, http.MethodDelete, gw.URL+"/workers/"+worker.ID(a.URL()), "sk-admin", ""); status != 404 {
		t.Errorf("second delete: %d", status)
	}
}

// Without an admin key the admin API answers only on a loopback listener: 403 elsewhere, while
// GET /workers keeps answering; on its own listener the API port has no admin routes.
func TestAdminAPIWhereAllowed(t *testing.T) {
	t.Parallel()
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	add := fmt.Sprintf(`{"url":%q}`, "http://127.0.0.1:1")

	cfg := testConfig(e.URL()) // host 0.0.0.0, no admin key
	_, gw := startGateway(t, cfg)
	if status, body := admin(t, http.MethodPost, gw.URL+"/workers", "", add); status != 403 || !strings.Contains(body, "admin_disabled") {
		t.Errorf("off loopback without a key: %d %s", status, body)
	}
	listWorkers(t, gw.URL, "")

	// The API listener on loopback is no admin listener: a proxy on the same host would make
	// every client look local.
	cfg.Host = "127.0.0.1"
	_, gw = startGateway(t, cfg)
	if status, body := admin(t, http.MethodPost, gw.URL+"/workers", "", add); status != 403 {
		t.Errorf("API listener on loopback without a key: %d %s", status, body)
	}

	cfg.Host, cfg.AdminPort, cfg.AdminHost = "0.0.0.0", 0, "127.0.0.1"
	g, gw := startGateway(t, cfg)
	if status, _ := admin(t, http.MethodPost, gw.URL+"/workers", "", add); status != 404 {
		t.Errorf("admin route on the API port with its own listener: %d", status)
	}
	own := httptest.NewServer(g.Server.AdminHandler())
	t.Cleanup(own.Close)
	if status, body := admin(t, http.MethodPost, own.URL+"/workers", "", add); status != 202 {
		t.Errorf("own loopback listener: %d %s", status, body)
	}
	if status, _ := admin(t, http.MethodGet, own.URL+"/v1/models", "", ""); status != 404 {
		t.Errorf("the admin listener serves inference routes: %d", status)
	}
}

// A reload (SIGHUP, a changed file) makes the configured workers what the file lists: new ones
// added, changed ones updated, missing ones drained; workers the admin API added stay; an
// invalid file changes nothing.
func TestReload(t *testing.T) {
	a := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	b := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	c := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	file := filepath.Join(t.TempDir(), "baton.yaml")
	write := func(s string) {
		t.Helper()
		// Replace the file, as a Kubernetes ConfigMap update does.
		tmp := file + ".new"
		if err := os.WriteFile(tmp, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, file); err != nil {
			t.Fatal(err)
		}
	}
	write(fmt.Sprintf("host: 127.0.0.1\nadmin_api_key: sk-admin\nwatch_config: true\nworkers:\n  - url: %s\n", a.URL()))
	cfg, err := config.Parse([]string{"--config", file}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	g, gw := startGateway(t, cfg)
	ctx := t.Context()
	go g.watchReload(ctx, 20*time.Millisecond)
	if status, body := admin(t, http.MethodPost, gw.URL+"/workers", "sk-admin", fmt.Sprintf(`{"url":%q}`, c.URL())); status != 202 {
		t.Fatalf("admin add: %d %s", status, body)
	}

	// The file changes: a gets a label, b joins. The watch picks it up.
	write(fmt.Sprintf("host: 127.0.0.1\nadmin_api_key: sk-admin\nwatch_config: true\nworkers:\n  - url: %s\n    labels: {zone: a}\n  - url: %s\n", a.URL(), b.URL()))
	poll.Until(t, "the condition", func() bool {
		ws := listWorkers(t, gw.URL, "")
		wa, wb := findWorker(ws, a.URL()), findWorker(ws, b.URL())
		return wa != nil && wa.Labels["zone"] == "a" && wb != nil && wb.Ready && wb.Source == "config"
	})
	// An invalid file: nothing changes.
	write("workers: [{url: ftp://nope}]\n")
	if err := g.Reload(); err == nil {
		t.Fatal("an invalid configuration reloaded")
	}
	if n := len(listWorkers(t, gw.URL, "")); n != 3 {
		t.Fatalf("%d workers after an invalid reload, want 3", n)
	}
	// SIGHUP after the file dropped a: a drains and leaves; c (admin) stays.
	if err := os.WriteFile(file, []byte(fmt.Sprintf("host: 127.0.0.1\nworkers:\n  - url: %s\n", b.URL())), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the condition", func() bool { return findWorker(listWorkers(t, gw.URL, ""), a.URL()) == nil })
	ws := listWorkers(t, gw.URL, "")
	if len(ws) != 2 || findWorker(ws, b.URL()) == nil || findWorker(ws, c.URL()) == nil || findWorker(ws, c.URL()).Source != "admin" {
		t.Errorf("after the reload: %+v", ws)
	}
	m := scrape(t, g)
	if !strings.Contains(m, `baton_config_reloads_total{result="invalid"}`) || !strings.Contains(m, `baton_config_reloads_total{result="ok"}`) {
		t.Errorf("reloads not counted")
	}
	// The last file also dropped admin_api_key and watch_config, which need a restart: the
	// reload applied the workers and counts as partial, naming them.
	// (The watch may see the same file change as the SIGHUP: one reload or two, each partial;
	// a reload counts itself once its workers were applied, after the fleet shows them.)
	partial := regexp.MustCompile(`baton_config_reloads_total\{result="partial"\} [12]\n`)
	poll.Until(t, "the reload counted as partial", func() bool { m = scrape(t, g); return partial.MatchString(m) })
	if live, restart := config.Changed(g.Config, cfgOf(t, file)); len(live) != 0 || strings.Join(restart, ",") != "admin_api_key,watch_config" {
		t.Errorf("changed settings: live %v, restart %v", live, restart)
	}
}

// A reload applies the routing policies and their parameters live: the next selection uses the
// new policy, the reload counts as ok (nothing needs a restart), the prefix index metrics follow
// the policy, and a second reload of the same file changes nothing more.
func TestReloadAppliesPoliciesLive(t *testing.T) {
	a := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	b := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	file := filepath.Join(t.TempDir(), "baton.yaml")
	base := fmt.Sprintf("host: 127.0.0.1\nroute_header: true\nworkers:\n  - url: %s\n  - url: %s\n", a.URL(), b.URL())
	if err := os.WriteFile(file, []byte(base), 0o600); err != nil {
		t.Fatal(err)
	}
	g, gw := startGateway(t, cfgOf(t, file))
	policyOf := func() string {
		t.Helper()
		resp := post(t, gw.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":2}`)
		_, _ = io.Copy(io.Discard, resp.Body)
		route := resp.Header.Get("X-Baton-Route")
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		_, p, _ := strings.Cut(route, "policy=")
		p, _, _ = strings.Cut(p, ";")
		return p
	}
	if p := policyOf(); p != "round_robin" {
		t.Fatalf("policy %q before the reload", p)
	}
	if strings.Contains(scrape(t, g), "baton_route_cache_index_blocks") {
		t.Error("a prefix index reported without cache_aware")
	}
	if err := os.WriteFile(file, []byte(base+"policy: cache_aware\ncache_threshold: 0.5\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := g.Reload(); err != nil {
		t.Fatal(err)
	}
	if p := policyOf(); p != "cache_aware" {
		t.Fatalf("policy %q after the reload, want cache_aware", p)
	}
	m := scrape(t, g)
	if !strings.Contains(m, `baton_config_reloads_total{result="ok"} 1`) || strings.Contains(m, `result="partial"`) {
		t.Errorf("a live reload not counted as ok:\n%s", m)
	}
	if !strings.Contains(m, `baton_route_cache_index_blocks{role="regular"}`) {
		t.Error("the new cache_aware policy's index is not reported")
	}
	p := g.Selector.Policy(config.RoleRegular)
	if err := g.Reload(); err != nil {
		t.Fatal(err)
	}
	if g.Selector.Policy(config.RoleRegular) != p {
		t.Error("a reload of an unchanged file rebuilt the policy (and dropped its prefix index)")
	}
}

func cfgOf(t *testing.T, file string) config.Config {
	t.Helper()
	c, err := config.Parse([]string{"--config", file}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
