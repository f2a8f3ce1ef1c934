package app

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
)

func intp(v int) *int { return &v }

// tenantReq posts body as the tenant of key.
func tenantReq(t *testing.T, url, key, body string) (*http.Response, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	return tenantDo(t, req)
}

// charged is what the gateway charged a tenant's rule so far (GET /tenants' tokens_charged).
func charged(t *testing.T, g *Gateway, tenant string) int64 {
	t.Helper()
	views, _ := g.Server.Director().TenantViews(t.Context())
	for _, v := range views {
		if v.Name == tenant && len(v.Rules) > 0 {
			return v.Rules[0].TokensCharged
		}
	}
	t.Fatalf("no tenant %s with a rule", tenant)
	return 0
}

// Keys name tenants (hashed in the file, from a key file, from the environment, smg's flag);
// an unknown key and a missing one get the same 401; a model outside a tenant's list is the
// 404 of a model nobody serves, and /v1/models lists only its models; past a limit, 429 with
// Retry-After and OpenAI's rate-limit headers, nothing dispatched; GET /tenants shows limits
// and use, never a key.
func TestTenantsKeysModelsAndLimits(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	dir := t.TempDir()
	keyFile := filepath.Join(dir, "keys")
	if err := os.WriteFile(keyFile, []byte("# team b\nsk-team-b\n\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("TEAM_C_KEY", "sk-team-c")
	yaml := fmt.Sprintf(`host: 127.0.0.1
admin_api_key: sk-admin
worker_urls: [%s]
tenants:
  - name: team-a
    keys: [%s]
    models: ["m"]
    limits: {requests_per_minute: 2}
  - name: team-b
    key_file: %s
    models: ["other-*"]
  - name: team-c
    key_env: TEAM_C_KEY
    limits: {max_concurrent: 1}
forward_sim_faults: true
`, e.URL(), config.HashKey("sk-team-a"), keyFile)
	file := filepath.Join(dir, "baton.yaml")
	if err := os.WriteFile(file, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Parse([]string{"--config", file, "--tenant-api-key", "team-d:sk-team-d"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	g, gw := startGateway(t, cfg)
	body := `{"model":"m","prompt":"hello","max_tokens":2}`
	_, missing := tenantReq(t, gw.URL+"/v1/completions", "", body)
	resp, wrong := tenantReq(t, gw.URL+"/v1/completions", "sk-nobody", body)
	if resp.StatusCode != 401 || wrong != missing || !strings.Contains(wrong, "invalid_api_key") {
		t.Errorf("wrong key %d %s; missing key %s", resp.StatusCode, wrong, missing)
	}
	for _, key := range []string{"sk-team-a", "sk-team-c", "sk-team-d"} {
		if resp, b := tenantReq(t, gw.URL+"/v1/completions", key, body); resp.StatusCode != 200 {
			t.Errorf("%s: %d %s", key, resp.StatusCode, b)
		}
	}
	// team-b may use other-* only: m is answered as a model nobody serves.
	resp, b := tenantReq(t, gw.URL+"/v1/completions", "sk-team-b", body)
	_, unknown := tenantReq(t, gw.URL+"/v1/completions", "sk-team-d", `{"model":"nope","prompt":"hello","max_tokens":2}`)
	if resp.StatusCode != 404 || strings.ReplaceAll(b, `\"m\"`, `\"nope\"`) != unknown {
		t.Errorf("a model outside the tenant's: %d %s; a model nobody serves: %s", resp.StatusCode, b, unknown)
	}
	for key, want := range map[string]int{"sk-team-a": 1, "sk-team-b": 0} {
		req, _ := http.NewRequest(http.MethodGet, gw.URL+"/v1/models", nil)
		req.Header.Set("Authorization", "Bearer "+key)
		_, models := do(t, req)
		var list struct{ Data []struct{ ID string } }
		_ = json.Unmarshal([]byte(models), &list)
		if len(list.Data) != want {
			t.Errorf("%s lists %s", key, models)
		}
	}
	// team-a: two requests per minute; the first went above.
	served := e.Stats().RequestsReceived
	resp, b = tenantReq(t, gw.URL+"/v1/completions", "sk-team-a", body)
	if resp.StatusCode != 200 || resp.Header.Get("X-Ratelimit-Limit-Requests") != "2" || resp.Header.Get("X-Ratelimit-Remaining-Requests") != "0" {
		t.Errorf("the second request: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	resp, b = tenantReq(t, gw.URL+"/v1/completions", "sk-team-a", body)
	if resp.StatusCode != 429 || !strings.Contains(b, "tenant_rate_limit_exceeded") || resp.Header.Get("Retry-After") == "" ||
		resp.Header.Get("X-Ratelimit-Remaining-Requests") != "0" || resp.Header.Get("X-Ratelimit-Reset-Requests") == "" {
		t.Errorf("past the limit: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	if got := e.Stats().RequestsReceived; got != served+1 {
		t.Errorf("the engine saw %d requests, want %d: a refused request was dispatched", got, served+1)
	}
	// team-c: one at once.
	slow := `{"model":"m","prompt":"slow","max_tokens":2}`
	started := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(slow))
		req.Header.Set("Authorization", "Bearer sk-team-c")
		req.Header.Set("X-Sim-Fault", "latency=1s")
		close(started)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	<-started
	var concurrent int
	for i := 0; i < 50 && concurrent != 429; i++ {
		time.Sleep(10 * time.Millisecond)
		resp, b = tenantReq(t, gw.URL+"/v1/completions", "sk-team-c", body)
		concurrent = resp.StatusCode
	}
	if concurrent != 429 || !strings.Contains(b, "tenant_concurrency_exceeded") {
		t.Errorf("a second request at once: %d %s", concurrent, b)
	}
	<-done
	status, list := admin(t, http.MethodGet, gw.URL+"/tenants", "sk-admin", "")
	if status != 200 || !strings.Contains(list, `"team-a"`) || !strings.Contains(list, `"requests_per_minute":2`) {
		t.Errorf("GET /tenants: %d %s", status, list)
	}
	for _, secret := range []string{"sk-team", config.HashKey("sk-team-a")[7:20]} {
		if strings.Contains(list, secret) {
			t.Errorf("GET /tenants shows a key: %s", list)
		}
	}
	// The status page's data has the tenants table.
	st := httptest.NewServer(g.Server.StatusHandler())
	defer st.Close()
	sreq, _ := http.NewRequest(http.MethodGet, st.URL+"/status.json", nil)
	sreq.SetBasicAuth("ops", "sk-admin")
	if code, sj := do(t, sreq); code != 200 || !strings.Contains(sj, `"tenants":[{"name":"team-a"`) || strings.Contains(sj, "sk-team") {
		t.Errorf("status.json: %d %s", code, sj)
	}
	m := scrape(t, g)
	for _, want := range []string{`baton_tenant_requests_total{code="200",model="m",tenant="team-a"} 2`,
		`baton_tenant_rejections_total{reason="requests",tenant="team-a"} 1`, `baton_tenant_rejections_total{reason="concurrency",tenant="team-c"}`} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	if strings.Contains(m, `tenant=""`) {
		t.Error("a tenant label that is no tenant's name")
	}
}

// nixlPDFleet is a PD configuration over a simulated vLLM NIXL pair.
func nixlPDFleet(t *testing.T) config.Config {
	cfg, _, _ := vllmPair(t, "NixlConnector", sim.Config{}, sim.Config{})
	return cfg
}

// sglangPDFleet is a PD configuration over a simulated SGLang pair.
func sglangPDFleet(t *testing.T) config.Config {
	cfg, _, _ := sglangPair(t, sim.Config{}, sim.Config{})
	return cfg
}

// clientUsage reads the usage a client received: the answer's, or a stream's last usage.
func clientUsage(t *testing.T, body string) (int, bool) {
	t.Helper()
	idx := strings.LastIndex(body, `"usage":{`)
	key := `"prompt_tokens":`
	if idx < 0 {
		idx = strings.LastIndex(body, `"meta_info":{`)
	}
	if idx < 0 {
		return 0, false
	}
	var total int
	for _, k := range []string{key, `"completion_tokens":`, `"input_tokens":`, `"output_tokens":`} {
		if i := strings.Index(body[idx:], k); i >= 0 {
			var n int
			fmt.Sscanf(body[idx+i+len(k):], "%d", &n)
			total += n
		}
	}
	return total, true
}

// The tokens charged to a tenant are the usage the engine reported — every route, streamed and
// not, regular and both PD styles — including a stream whose client did not ask for usage:
// Baton asks the engine for it and keeps the usage event from the client.
func TestTenantTokensChargedAreTheEnginesUsage(t *testing.T) {
	fleets := map[string]func(t *testing.T) config.Config{
		"regular": func(t *testing.T) config.Config {
			return testConfig(simEngine(t, sim.Config{Engine: sim.EngineSGLang}).URL())
		},
		// Every other attempt first meets a worker answering 503 and is retried on the other:
		// still one reservation, settled once.
		"regular retried": func(t *testing.T) config.Config {
			bad := simEngine(t, sim.Config{Engine: sim.EngineSGLang, Faults: sim.Faults{Status: 503}})
			return testConfig(bad.URL(), simEngine(t, sim.Config{Engine: sim.EngineSGLang}).URL())
		},
		"pd vllm nixl": nixlPDFleet,
		"pd sglang":    sglangPDFleet,
	}
	routes := []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"count the tokens"}],"max_tokens":7%s}`},
		{"/v1/completions", `{"model":"m","prompt":"count the tokens","max_tokens":7%s}`},
		{"/v1/responses", `{"model":"m","input":"count the tokens","max_output_tokens":7%s}`},
		{"/v1/messages", `{"model":"m","messages":[{"role":"user","content":"count the tokens"}],"max_tokens":7%s}`},
		{"/generate", `{"text":"count the tokens","sampling_params":{"max_new_tokens":7}%s}`},
	}
	for name, fleet := range fleets {
		t.Run(name, func(t *testing.T) {
			cfg := fleet(t)
			cfg.Tenants = []config.Tenant{{Name: "team", Keys: []string{config.HashKey("sk-team")}, Limits: &config.Limits{TokensPerMinute: intp(100_000_000)}}}
			g, gw := startGateway(t, cfg)
			for _, rt := range routes {
				for _, stream := range []string{"", `,"stream":true`, `,"stream":true,"stream_options":{"include_usage":true}`} {
					if stream != "" && strings.Contains(stream, "stream_options") && rt.path != "/v1/chat/completions" && rt.path != "/v1/completions" {
						continue
					}
					g.Server.Director().Settled() // a settlement after its answer counts before this request
					before := charged(t, g, "team")
					resp, body := tenantReq(t, gw.URL+rt.path, "sk-team", fmt.Sprintf(rt.body, stream))
					if resp.StatusCode == 404 || resp.StatusCode == 501 {
						continue // a route this fleet does not serve (vLLM and /generate)
					}
					if resp.StatusCode != 200 {
						t.Errorf("%s %s: %d %s", rt.path, stream, resp.StatusCode, body)
						continue
					}
					g.Server.Director().Settled()
					got := charged(t, g, "team") - before
					want, ok := clientUsage(t, body)
					if !ok {
						// The client did not ask for usage: the same request asking for it says
						// what the engine counts (the simulators are deterministic).
						if strings.Contains(body, `"choices":[]`) {
							t.Errorf("%s %s: the usage event Baton asked for reached the client:\n%s", rt.path, stream, body)
						}
						_, withUsage := tenantReq(t, gw.URL+rt.path, "sk-team", fmt.Sprintf(rt.body, `,"stream":true,"stream_options":{"include_usage":true}`))
						if want, ok = clientUsage(t, withUsage); !ok {
							t.Errorf("%s: no usage even when asked:\n%s", rt.path, withUsage)
							continue
						}
					}
					if got != int64(want) || want == 0 {
						t.Errorf("%s %s: charged %d, the engine's usage %d", rt.path, stream, got, want)
					}
				}
			}
			if name == "regular retried" && !strings.Contains(scrape(t, g), "baton_retries_total{") {
				t.Error("no request was retried")
			}
		})
	}
}

// Hostile keys: 10,000 distinct wrong keys are each a 401 and add no metric series; a key of
// 1 MiB is refused by the server's header bound; two Authorization headers are a 400.
func TestTenantHostileKeys(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	cfg := testConfig(e.URL())
	cfg.Tenants = []config.Tenant{{Name: "team", Keys: []string{config.HashKey("sk-team")}, Limits: &config.Limits{RequestsPerMinute: intp(1000)}}}
	g, gw := startGateway(t, cfg)
	body := `{"model":"m","prompt":"x","max_tokens":1}`
	tenantReq(t, gw.URL+"/v1/completions", "sk-wrong", body)
	series := func() map[string]bool {
		out := map[string]bool{}
		for _, l := range strings.Split(scrape(t, g), "\n") {
			// The series a request's labels can reach (the engine load poller's come with time).
			if name, _, ok := strings.Cut(l, " "); ok && !strings.HasPrefix(l, "#") && (strings.Contains(name, "tenant") || strings.Contains(name, "model=")) {
				out[name] = true
			}
		}
		return out
	}
	before := series()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
	var wg sync.WaitGroup
	var not401 atomic.Int64
	for w := 0; w < 8; w++ {
		wg.Go(func() {
			for i := w; i < 10_000; i += 8 {
				req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(body))
				req.Header.Set("Authorization", fmt.Sprintf("Bearer sk-guess-%d", i))
				resp, err := client.Do(req)
				if err != nil {
					not401.Add(1)
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 401 {
					not401.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if n := not401.Load(); n != 0 {
		t.Errorf("%d of 10,000 wrong keys not answered 401", n)
	}
	for name := range series() {
		if !before[name] {
			t.Errorf("10,000 wrong keys added the series %s", name)
		}
	}
	req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+strings.Repeat("k", 1<<20))
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		if resp.StatusCode != 431 && resp.StatusCode != 400 {
			t.Errorf("a 1 MiB key: %d", resp.StatusCode)
		}
	}
	req, _ = http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(body))
	req.Header.Add("Authorization", "Bearer sk-team")
	req.Header.Add("Authorization", "Bearer sk-other")
	_, b := do(t, req)
	if !strings.Contains(b, "duplicate_header") {
		t.Errorf("two Authorization headers: %s", b)
	}
}

// A reload storm while serving: the key rotates back and forth a hundred times under load;
// no request fails for any other reason than the key it carried, and the last file wins.
func TestTenantReloadStorm(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	dir := t.TempDir()
	file := filepath.Join(dir, "baton.yaml")
	write := func(key string) {
		t.Helper()
		y := fmt.Sprintf("host: 127.0.0.1\nworker_urls: [%s]\ntenants:\n  - name: team\n    keys: [%s]\n    limits: {requests_per_minute: 100000}\n", e.URL(), config.HashKey(key))
		if err := os.WriteFile(file+".new", []byte(y), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(file+".new", file); err != nil {
			t.Fatal(err)
		}
	}
	write("sk-old")
	cfg, err := config.Parse([]string{"--config", file}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	g, gw := startGateway(t, cfg)
	stop := make(chan struct{})
	var bad atomic.Int64
	var wg sync.WaitGroup
	for c := 0; c < 4; c++ {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				resp, b := tenantReq(t, gw.URL+"/v1/completions", "sk-old", `{"model":"m","prompt":"x","max_tokens":1}`)
				if resp.StatusCode != 200 && resp.StatusCode != 401 {
					bad.Add(1)
					t.Errorf("%d %s", resp.StatusCode, b)
				}
			}
		})
	}
	for i := 0; i < 100; i++ {
		if i%2 == 0 {
			write("sk-new")
		} else {
			write("sk-old")
		}
		if err := g.Reload(); err != nil {
			t.Fatal(err)
		}
	}
	write("sk-new")
	if err := g.Reload(); err != nil {
		t.Fatal(err)
	}
	close(stop)
	wg.Wait()
	if r, _ := tenantReq(t, gw.URL+"/v1/completions", "sk-new", `{"model":"m","prompt":"x","max_tokens":1}`); r.StatusCode != 200 {
		t.Errorf("the rotated key: %d", r.StatusCode)
	}
	if r, _ := tenantReq(t, gw.URL+"/v1/completions", "sk-old", `{"model":"m","prompt":"x","max_tokens":1}`); r.StatusCode != 401 {
		t.Errorf("the removed key: %d", r.StatusCode)
	}
}

// A PD request whose prefill refused it gets the prefill's error, and its tenant is charged
// nothing: the decode, sent at once (SGLang) and waiting for the KV the prefill was to send,
// computed nothing before Baton cancelled it. It was charged its prompt estimate and max_tokens,
// settled after the answer, as if the decode had generated them.
func TestTenantNotChargedForAFailedPrefill(t *testing.T) {
	cfg, _, _ := sglangPair(t, sim.Config{Faults: sim.Faults{Status: 400, Latency: 50 * time.Millisecond}}, sim.Config{})
	cfg.Tenants = []config.Tenant{{Name: "team", Keys: []string{config.HashKey("sk-team")}, Limits: &config.Limits{TokensPerMinute: intp(100_000_000)}}}
	g, gw := startGateway(t, cfg)
	for _, stream := range []string{"", `,"stream":true`} {
		resp, body := tenantReq(t, gw.URL+"/v1/chat/completions", "sk-team",
			`{"model":"m","messages":[{"role":"user","content":"count the tokens"}],"max_tokens":7`+stream+`}`)
		if resp.StatusCode != 400 || !strings.Contains(body, "injected fault") {
			t.Fatalf("stream %q: %d %s, want the prefill's 400", stream, resp.StatusCode, body)
		}
		g.Server.Director().Settled()
		if got := charged(t, g, "team"); got != 0 {
			t.Errorf("stream %q: a request its prefill refused charged %d tokens", stream, got)
		}
	}
	for _, l := range strings.Split(grepLines(scrape(t, g), "baton_tenant_tokens_total{"), "\n") {
		if l != "" && !strings.HasSuffix(l, " 0") {
			t.Errorf("a refused request was counted in the tenant's tokens: %s", l)
		}
	}
}

// A PD request whose decode refused it after its prefill computed the prompt (Mooncake's legs,
// sent at once) is charged that prompt, as its prefill counted it, and no completion; it was
// charged nothing, though the prefill engine had done the work.
func TestTenantChargedThePromptWhenTheDecodeRefused(t *testing.T) {
	cfg, p, _ := vllmPair(t, "MooncakeConnector", sim.Config{}, sim.Config{Faults: sim.Faults{Status: 400, Latency: 100 * time.Millisecond}})
	cfg.Tenants = []config.Tenant{{Name: "team", Keys: []string{config.HashKey("sk-team")}, Limits: &config.Limits{TokensPerMinute: intp(100_000_000)}}}
	g, gw := startGateway(t, cfg)
	resp, body := tenantReq(t, gw.URL+"/v1/completions", "sk-team", `{"model":"m","prompt":"count the tokens","max_tokens":7}`)
	if resp.StatusCode != 400 || !strings.Contains(body, "decode_upstream_error") {
		t.Fatalf("%d %s, want the decode's 400", resp.StatusCode, body)
	}
	g.Server.Director().Settled()
	st := p.Stats()
	prompt := int64(st.PromptTokensRecompute + st.PromptTokensLocalCache)
	if st.RequestsOK != 1 || prompt == 0 {
		t.Fatalf("the prefill engine computed %d prompt tokens in %d answers; the test means one that computed the prompt", prompt, st.RequestsOK)
	}
	if got := charged(t, g, "team"); got != prompt {
		t.Errorf("charged %d tokens, want the prompt the prefill computed (%d)", got, prompt)
	}
}
