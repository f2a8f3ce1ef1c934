package server

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/openai"
)

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
