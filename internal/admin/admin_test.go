package admin

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/tenant"
	"github.com/baton-llm/baton/internal/worker"
)

// tenantsOf is a tenancy of one tenant per key given ("t0", "t1", … each with its key); none:
// the open fleet.
func tenantsOf(t *testing.T, keys ...string) director.Tenancy {
	t.Helper()
	cfg := config.Default()
	for i, k := range keys {
		cfg.Tenants = append(cfg.Tenants, config.Tenant{Name: "t" + string(rune('0'+i)), Keys: []string{config.HashKey(k)}})
	}
	set, err := tenant.Build(cfg, os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	return director.Tenancy{Set: func() *tenant.Set { return set }, Limiter: tenant.NewLimiter(nil)}
}

// serve mounts o's admin routes over reg (own: the admin listener's; else the API listener's,
// where GET /workers takes a tenant's key too) on a test server, and returns its URL.
func serve(t *testing.T, o Options, reg *worker.Registry, ten director.Tenancy, own bool) string {
	t.Helper()
	d := director.New(director.Options{Registry: reg, Metrics: metrics.New(reg), Tenancy: ten})
	api := New(o, d)
	mux := http.NewServeMux()
	// The API listener's key check, as the server's: a tenant's key (or none in an open fleet).
	authed := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if _, _, e := d.Identify(r.Header["Authorization"], nil); e != nil {
				openai.WriteError(w, e)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
	api.Routes(mux, own, authed)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
}

func send(t *testing.T, method, url, key, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func errorCode(t *testing.T, body string) string {
	t.Helper()
	var e struct {
		Error struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil {
		t.Fatalf("not an error envelope: %q", body)
	}
	return e.Error.Code
}

// fakeFleet is the admin API's fleet, keeping what it was asked in a registry of its own.
type fakeFleet struct {
	mu  sync.Mutex
	reg *worker.Registry
	log []string
}

func (f *fakeFleet) Add(c config.Worker, source string) (*worker.Worker, error) {
	if err := config.CheckWorkerURL(c.URL); err != nil {
		return nil, errors.Join(config.ErrInvalidWorker, err)
	}
	w := worker.New(c)
	if err := f.reg.Add(w); err != nil {
		return nil, err
	}
	f.note("add " + c.URL + " " + source)
	return w, nil
}

func (f *fakeFleet) Update(id string, p config.WorkerPatch, source string) (*worker.Worker, error) {
	old := f.reg.Snapshot().Get(id)
	if old == nil {
		return nil, worker.ErrNotFound
	}
	w := worker.New(p.Apply(old.Configured()))
	f.reg.Replace(old, w)
	f.note("update " + id + " " + source)
	return w, nil
}

func (f *fakeFleet) Remove(id, source string) (*worker.Worker, error) {
	w := f.reg.Snapshot().Get(id)
	if w == nil {
		return nil, worker.ErrNotFound
	}
	f.reg.Remove(w)
	f.note("remove " + id + " " + source)
	return w, nil
}

func (f *fakeFleet) note(s string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.log = append(f.log, s)
}

// The admin API on its own listener: the admin key is required (the inference key is not it),
// changes reach the fleet with their source, bad input is a 4xx in the envelope, and a
// worker's key never comes back out.
func TestAdminAPI(t *testing.T) {
	f := &fakeFleet{reg: worker.NewRegistry()}
	admin := serve(t, Options{Keys: []string{"sk-admin"}, Separate: true, Fleet: f}, f.reg, tenantsOf(t, "sk-inference"), true)

	for _, key := range []string{"", "sk-inference", "wrong"} {
		if status, body := send(t, http.MethodGet, admin+"/workers", key, ""); status != 401 && status != 403 {
			t.Errorf("key %q: %d %s", key, status, body)
		}
	}
	status, body := send(t, http.MethodPost, admin+"/workers", "sk-admin", `{"url":"http://10.0.0.1:8000","api_key":"sk-engine-secret","labels":{"zone":"a"}}`)
	if status != 202 || strings.Contains(body, "sk-engine-secret") || !strings.Contains(body, "10.0.0.1") {
		t.Fatalf("add: %d %s", status, body)
	}
	id := worker.ID("http://10.0.0.1:8000")
	if status, body := send(t, http.MethodPost, admin+"/workers", "sk-admin", `{"url":"http://10.0.0.1:8000"}`); status != 409 || errorCode(t, body) != openai.CodeWorkerExists {
		t.Errorf("add twice: %d %s", status, body)
	}
	if status, body := send(t, http.MethodPatch, admin+"/workers/"+id, "sk-admin", `{"labels":{"zone":"b"}}`); status != 202 || !strings.Contains(body, `"zone":"b"`) {
		t.Errorf("patch: %d %s", status, body)
	}
	if status, body := send(t, http.MethodGet, admin+"/workers/"+id, "sk-admin", ""); status != 200 || strings.Contains(body, "sk-engine-secret") {
		t.Errorf("get: %d %s", status, body)
	}
	if status, body := send(t, http.MethodGet, admin+"/workers", "sk-admin", ""); status != 200 || !strings.Contains(body, "10.0.0.1") || strings.Contains(body, "sk-engine-secret") {
		t.Errorf("list: %d %s", status, body)
	}
	for _, c := range []struct {
		method, path, body string
		status             int
		code               string
	}{
		{http.MethodPost, "/workers", `{"url":`, 400, openai.CodeInvalidJSON},
		{http.MethodPost, "/workers", `{"url":"http://x:1","bogus":1}`, 400, openai.CodeInvalidJSON},
		{http.MethodPost, "/workers", `{"url":"ftp://x:1"}`, 400, openai.CodeBadRequest},
		{http.MethodPost, "/workers", `{}`, 400, openai.CodeBadRequest},
		{http.MethodPost, "/workers", `{"url":"http://x:1"} {"url":"http://y:1"}`, 400, openai.CodeInvalidJSON},
		{http.MethodPost, "/workers", `{"url":"http://x:1","labels":{"a":"` + strings.Repeat("b", 2<<20) + `"}}`, 413, openai.CodePayloadTooLarge},
		{http.MethodPatch, "/workers/nope", `{}`, 404, openai.CodeWorkerNotFound},
		{http.MethodDelete, "/workers/nope", ``, 404, openai.CodeWorkerNotFound},
	} {
		if status, body := send(t, c.method, admin+c.path, "sk-admin", c.body); status != c.status || errorCode(t, body) != c.code {
			t.Errorf("%s %s %.40s: %d %.200s, want %d %s", c.method, c.path, c.body, status, body, c.status, c.code)
		}
	}
	if status, body := send(t, http.MethodDelete, admin+"/workers/"+id, "sk-admin", ""); status != 202 && status != 200 {
		t.Errorf("delete: %d %s", status, body)
	}
	if want := "add http://10.0.0.1:8000 admin|update " + id + " admin|remove " + id + " admin"; strings.Join(f.log, "|") != want {
		t.Errorf("the fleet was asked %q, want %q", strings.Join(f.log, "|"), want)
	}
}

// Who may reach the admin routes: with keys set, only a request with one of them (one
// Authorization header); without keys, nobody on a listener that is not loopback's own, and
// there only a request straight from this host — not through a proxy or from a web page, not
// naming another host; a write must declare JSON.
func TestAdminGuard(t *testing.T) {
	reg := worker.NewRegistry()
	keyed := serve(t, Options{Keys: []string{"sk-a", "sk-b"}, Separate: true}, reg, tenantsOf(t), true)
	open := serve(t, Options{Open: true, Separate: true}, reg, tenantsOf(t), true)
	closed := serve(t, Options{Separate: true}, reg, tenantsOf(t), true)
	request := func(base, key string, h map[string]string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, base+"/workers", nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		for k, v := range h {
			if k == "Host" {
				req.Host = v
				continue
			}
			req.Header.Add(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		code := ""
		if resp.StatusCode != 200 {
			code = errorCode(t, string(b))
		}
		return resp.StatusCode, code
	}
	for _, c := range []struct {
		name, base, key string
		h               map[string]string
		status          int
		code            string
	}{
		{"a key", keyed, "sk-a", nil, 200, ""},
		{"the other key", keyed, "sk-b", nil, 200, ""},
		{"no key", keyed, "", nil, 401, openai.CodeInvalidAPIKey},
		{"a wrong key", keyed, "sk-c", nil, 401, openai.CodeInvalidAPIKey},
		{"a key's prefix", keyed, "sk-", nil, 401, openai.CodeInvalidAPIKey},
		{"two Authorization headers", keyed, "sk-a", map[string]string{"Authorization": "Bearer sk-b"}, 400, openai.CodeDuplicateHeader},
		{"open, from this host", open, "", nil, 200, ""},
		{"open, through a proxy", open, "", map[string]string{"X-Forwarded-For": "203.0.113.9"}, 403, openai.CodeAdminDisabled},
		{"open, from a web page", open, "", map[string]string{"Origin": "https://evil.example"}, 403, openai.CodeAdminDisabled},
		{"open, behind Via", open, "", map[string]string{"Via": "1.1 proxy"}, 403, openai.CodeAdminDisabled},
		{"open, behind nginx's X-Real-IP", open, "", map[string]string{"X-Real-IP": "203.0.113.9"}, 403, openai.CodeAdminDisabled},
		{"open, behind True-Client-IP", open, "", map[string]string{"True-Client-IP": "203.0.113.9"}, 403, openai.CodeAdminDisabled},
		{"open, behind CF-Connecting-IP", open, "", map[string]string{"CF-Connecting-IP": "203.0.113.9"}, 403, openai.CodeAdminDisabled},
		{"open, behind X-Client-IP", open, "", map[string]string{"X-Client-IP": "203.0.113.9"}, 403, openai.CodeAdminDisabled},
		{"open, from a page (Sec-Fetch-Site)", open, "", map[string]string{"Sec-Fetch-Site": "cross-site"}, 403, openai.CodeAdminDisabled},
		{"open, from a page (Sec-Fetch-Mode)", open, "", map[string]string{"Sec-Fetch-Mode": "no-cors"}, 403, openai.CodeAdminDisabled},
		{"open, from a page (Referer)", open, "", map[string]string{"Referer": "https://evil.example/"}, 403, openai.CodeAdminDisabled},
		{"open, behind X-Forwarded", open, "", map[string]string{"X-Forwarded": "for=203.0.113.9"}, 403, openai.CodeAdminDisabled},
		{"open, behind Forwarded-For", open, "", map[string]string{"Forwarded-For": "203.0.113.9"}, 403, openai.CodeAdminDisabled},
		{"open, behind X-Appengine-User-IP", open, "", map[string]string{"X-Appengine-User-IP": "203.0.113.9"}, 403, openai.CodeAdminDisabled},
		{"open, behind X_Forwarded_For", open, "", map[string]string{"X_Forwarded_For": "203.0.113.9"}, 403, openai.CodeAdminDisabled},
		{"open, behind X_Real_IP", open, "", map[string]string{"X_Real_IP": "203.0.113.9"}, 403, openai.CodeAdminDisabled},
		{"open, with an unrelated header", open, "", map[string]string{"X-Trace": "1"}, 200, ""},
		{"open, naming another host (DNS rebinding)", open, "", map[string]string{"Host": "evil.example:80"}, 403, openai.CodeAdminDisabled},
		{"open, naming localhost", open, "", map[string]string{"Host": "localhost:1"}, 200, ""},
		{"neither key nor loopback listener", closed, "", nil, 403, openai.CodeAdminDisabled},
	} {
		if status, code := request(c.base, c.key, c.h); status != c.status || code != c.code {
			t.Errorf("%s: %d %q, want %d %q", c.name, status, code, c.status, c.code)
		}
	}
	// A write must declare JSON: a form post from a web page cannot.
	f := &fakeFleet{reg: worker.NewRegistry()}
	writes := serve(t, Options{Keys: []string{"sk-a"}, Separate: true, Fleet: f}, f.reg, tenantsOf(t), true)
	req, _ := http.NewRequest(http.MethodPost, writes+"/workers", strings.NewReader(`{"url":"http://10.0.0.1:8000"}`))
	req.Header.Set("Authorization", "Bearer sk-a")
	req.Header.Set("Content-Type", "text/plain")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 415 || errorCode(t, string(b)) != openai.CodeUnsupportedMedia || len(f.log) != 0 {
		t.Errorf("a write not declared JSON: %d %s, fleet asked %v", resp.StatusCode, b, f.log)
	}
}

// GET /workers on the API listener shows the whole fleet: to the admin key; to the one client
// of a fleet without tenants (or with one unrestricted); never to a tenant among several, who
// sees only its own models elsewhere (403 admin_key_required).
func TestWorkersOnTheAPIListener(t *testing.T) {
	reg := worker.NewRegistry(worker.New(config.Worker{URL: "http://10.0.0.7:8000", APIKey: "sk-engine-secret"}))
	for _, c := range []struct {
		name   string
		ten    director.Tenancy
		key    string
		status int
	}{
		{"an open fleet, no key", tenantsOf(t), "", 200},
		{"one tenant's key", tenantsOf(t, "sk-one"), "sk-one", 200},
		{"the admin key", tenantsOf(t, "sk-one", "sk-two"), "sk-admin", 200},
		{"a tenant among several", tenantsOf(t, "sk-one", "sk-two"), "sk-one", 403},
		{"no key where tenants have keys", tenantsOf(t, "sk-one", "sk-two"), "", 401},
	} {
		base := serve(t, Options{Keys: []string{"sk-admin"}}, reg, c.ten, false)
		status, body := send(t, http.MethodGet, base+"/workers", c.key, "")
		if status != c.status || strings.Contains(body, "sk-engine-secret") {
			t.Errorf("%s: %d %.200s, want %d", c.name, status, body, c.status)
			continue
		}
		if status == 200 && !strings.Contains(body, "10.0.0.7") {
			t.Errorf("%s: the fleet not listed: %s", c.name, body)
		}
		if status == 403 && errorCode(t, body) != openai.CodeAdminKeyRequired {
			t.Errorf("%s: %s", c.name, body)
		}
	}
}

// GET /workers says whose answers are proven their requests' before they are relayed: none
// until the worker's engine was seen echoing Baton's X-Request-Id.
func TestWorkersSayWhoseAnswersAreProven(t *testing.T) {
	f := &fakeFleet{reg: worker.NewRegistry()}
	admin := serve(t, Options{Keys: []string{"sk-admin"}, Separate: true, Fleet: f}, f.reg, tenantsOf(t), true)
	w := worker.New(config.Worker{URL: "http://10.0.0.1:8000"})
	if err := f.reg.Add(w); err != nil {
		t.Fatal(err)
	}
	if _, body := send(t, http.MethodGet, admin+"/workers", "sk-admin", ""); !strings.Contains(body, `"correlation":"none"`) {
		t.Errorf("before any echo: %s", body)
	}
	w.NoteIDEcho()
	if _, body := send(t, http.MethodGet, admin+"/workers", "sk-admin", ""); !strings.Contains(body, `"correlation":"answer-id"`) {
		t.Errorf("after an answer named after Baton's id: %s", body)
	}
	w.NoteEcho()
	if _, body := send(t, http.MethodGet, admin+"/workers", "sk-admin", ""); !strings.Contains(body, `"correlation":"x-request-id"`) {
		t.Errorf("after an echo: %s", body)
	}
}

// GET /workers says ready only of a worker that can be sent requests: a healthy worker whose
// circuit is open is not ready (health circuit_open), its breaker still shown; ready again once
// the circuit's timeout passed (the next request would be its half-open probe).
func TestWorkersNotReadyWhileTheirCircuitIsOpen(t *testing.T) {
	f := &fakeFleet{reg: worker.NewRegistry()}
	admin := serve(t, Options{Keys: []string{"sk-admin"}, Separate: true, Fleet: f}, f.reg, tenantsOf(t), true)
	var now atomic.Int64 // the breaker's clock, in seconds
	now.Store(1000)
	w := worker.New(config.Worker{URL: "http://10.0.0.1:8000"})
	w.UseBreaker(&worker.BreakerConfig{FailureThreshold: 1, SuccessThreshold: 1, Timeout: time.Minute, Now: func() time.Time { return time.Unix(now.Load(), 0) }})
	w.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM})
	w.SetReady(true)
	if err := f.reg.Add(w); err != nil {
		t.Fatal(err)
	}
	view := func() (ready bool, health, breaker string) {
		t.Helper()
		_, body := send(t, http.MethodGet, admin+"/workers", "sk-admin", "")
		var got struct {
			Workers []struct {
				Ready           bool
				Health, Breaker string
			}
		}
		if err := json.Unmarshal([]byte(body), &got); err != nil || len(got.Workers) != 1 {
			t.Fatalf("GET /workers: %v %s", err, body)
		}
		v := got.Workers[0]
		return v.Ready, v.Health, v.Breaker
	}
	if ready, health, breaker := view(); !ready || health != "ready" || breaker != "closed" {
		t.Errorf("closed: got ready %v, health %s, breaker %s; want true, ready, closed", ready, health, breaker)
	}
	w.Record(http.StatusServiceUnavailable, nil)
	if ready, health, breaker := view(); ready || health != "circuit_open" || breaker != "open" {
		t.Errorf("open: got ready %v, health %s, breaker %s; want false, circuit_open, open", ready, health, breaker)
	}
	now.Add(60)
	if ready, health, _ := view(); !ready || health != "ready" {
		t.Errorf("open past its timeout: got ready %v, health %s; want true, ready", ready, health)
	}
	if w.BreakerState() != worker.BreakerOpen {
		t.Errorf("reading /workers changed the circuit to %s", w.BreakerState())
	}
}

// GET /workers says what a worker's failed health probes got: the probes failed in a row and
// the last failure's cause, status and the start of the engine's answer.
func TestWorkersSayWhatTheirHealthProbesGot(t *testing.T) {
	engine := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		rw.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(rw, "loading weights")
	}))
	defer engine.Close()
	f := &fakeFleet{reg: worker.NewRegistry()}
	admin := serve(t, Options{Keys: []string{"sk-admin"}, Separate: true, Fleet: f}, f.reg, tenantsOf(t), true)
	w := worker.New(config.Worker{URL: engine.URL})
	w.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM})
	w.SetReady(true)
	if err := f.reg.Add(w); err != nil {
		t.Fatal(err)
	}
	if _, body := send(t, http.MethodGet, admin+"/workers", "sk-admin", ""); strings.Contains(body, "health_check") {
		t.Errorf("before any failed probe: %s", body)
	}
	h := &worker.HealthChecker{Registry: f.reg, Client: engine.Client(), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Interval: time.Hour, Timeout: time.Second, FailureThreshold: 1, SuccessThreshold: 1, Endpoint: "/health"}
	h.CheckAll(context.Background())
	_, body := send(t, http.MethodGet, admin+"/workers", "sk-admin", "")
	if want := `"health_check":{"failing":1,"last_failure":{"cause":"status_5xx","status":503,"detail":"loading weights","at":`; !strings.Contains(body, want) {
		t.Errorf("got %s, want it to hold %s", body, want)
	}
	if !strings.Contains(body, `"health":"unhealthy"`) {
		t.Errorf("after the failed probe: %s", body)
	}
}

// GET /workers flags an SGLang prefill whose engine reports another bootstrap port than the one
// configured.
func TestWorkersFlagAWrongSGLangBootstrapPort(t *testing.T) {
	f := &fakeFleet{reg: worker.NewRegistry()}
	admin := serve(t, Options{Keys: []string{"sk-admin"}, Separate: true, Fleet: f}, f.reg, tenantsOf(t), true)
	port := 9000
	w := worker.New(config.Worker{URL: "http://10.0.0.1:8000", Role: config.RolePrefill, BootstrapPort: &port})
	w.SetInfo(&worker.Info{Runtime: config.RuntimeSGLang, BootstrapPort: 8998})
	if err := f.reg.Add(w); err != nil {
		t.Fatal(err)
	}
	_, body := send(t, http.MethodGet, admin+"/workers", "sk-admin", "")
	if want := `"bootstrap_port_mismatch":"its bootstrap port is configured as 9000, but its engine reports 8998`; !strings.Contains(body, want) {
		t.Errorf("got %s, want it to hold %s", body, want)
	}
}

// The POST in REFERENCE.md's admin example is sent as curl sends it, its headers and body read
// from the document, and adds its worker: an example an operator copies works as written (it
// once sent no Content-Type and was refused 415).
func TestTheReferencesAdminExampleWorks(t *testing.T) {
	doc, err := os.ReadFile("../../docs/REFERENCE.md")
	if err != nil {
		t.Fatal(err)
	}
	i := strings.Index(string(doc), "curl -X POST localhost:30000/workers")
	if i < 0 {
		t.Fatal("REFERENCE.md has no admin POST example")
	}
	cmd := string(doc[i:])
	cmd = cmd[:strings.Index(cmd, "\ncurl ")]
	cmd = strings.ReplaceAll(cmd, "\\\n", " ")
	header := http.Header{}
	for _, m := range regexp.MustCompile(`-H "([^"]+)"`).FindAllStringSubmatch(cmd, -1) {
		k, v, _ := strings.Cut(m[1], ": ")
		header.Add(k, strings.ReplaceAll(v, "$ADMIN_KEY", "sk-a"))
	}
	body := regexp.MustCompile(`-d '([^']+)'`).FindStringSubmatch(cmd)
	if body == nil {
		t.Fatalf("no body in %q", cmd)
	}
	if header.Get("Content-Type") == "" && body != nil {
		header.Set("Content-Type", "application/x-www-form-urlencoded") // what curl -d sends without one
	}
	f := &fakeFleet{reg: worker.NewRegistry()}
	url := serve(t, Options{Keys: []string{"sk-a"}, Separate: true, Fleet: f}, f.reg, tenantsOf(t), true)
	req, _ := http.NewRequest(http.MethodPost, url+"/workers", strings.NewReader(body[1]))
	req.Header = header
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted || len(f.log) != 1 {
		t.Errorf("the example %q: %d %s", cmd, resp.StatusCode, b)
	}
}
