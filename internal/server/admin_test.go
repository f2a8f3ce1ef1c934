package server

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/baton-llm/baton/internal/admin"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/worker"
)

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

// The admin API on its own listener: the admin key is required (the inference key is not it),
// changes reach the fleet with their source, bad input is a 4xx in the envelope, and a
// worker's key never comes back out.
func TestAdminAPI(t *testing.T) {
	f := &fakeFleet{}
	s, _, _ := gateway(t, nil, func(o *Options) {
		f.reg = o.Director.Registry
		o.Director.APIKey = "sk-inference"
		o.Admin = admin.Options{Keys: []string{"sk-admin"}, Separate: true, Fleet: f}
	})
	srv := httptest.NewServer(s.AdminHandler())
	t.Cleanup(srv.Close)
	admin := srv.URL

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
		{http.MethodGet, "/elsewhere", ``, 404, openai.CodeNotFound},
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

// The models list comes from the ready workers; the status page and its data need the admin
// key, as a bearer token or a browser's Basic password.
func TestModelsAndStatus(t *testing.T) {
	e := engine(t, completion)
	s, gw, ws := gateway(t, []string{e, e + "/"}, func(o *Options) { o.Admin.Keys = []string{"sk-admin"} })
	ws[1].SetReady(false)
	resp, err := http.Get(gw + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || strings.Count(string(b), `"id":"m"`) != 1 {
		t.Errorf("models: %d %s", resp.StatusCode, b)
	}
	post(t, gw+"/v1/completions", `{"model":"m","prompt":"x"}`)

	status := httptest.NewServer(s.StatusHandler())
	t.Cleanup(status.Close)
	if code, body := send(t, http.MethodGet, status.URL+"/status.json", "", ""); code != 401 || errorCode(t, body) != openai.CodeInvalidAPIKey {
		t.Errorf("status without the key: %d %s", code, body)
	}
	code, body := send(t, http.MethodGet, status.URL+"/status.json", "sk-admin", "")
	if code != 200 || !strings.Contains(body, e) {
		t.Errorf("status.json: %d %s", code, body)
	}
	req, _ := http.NewRequest(http.MethodGet, status.URL+"/status", nil)
	req.SetBasicAuth("anyone", "sk-admin")
	resp, err = http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
		t.Errorf("status page with Basic auth: %v %v", err, resp)
	}
}
