package sim

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
)

func start(t testing.TB, c Config) *Engine {
	t.Helper()
	e, err := Start(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e
}

type reply struct {
	status int
	header http.Header
	raw    string
	json   map[string]any
}

func do(t testing.TB, method, url, body string, hdr ...string) reply {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading body: %v", method, url, err)
	}
	r := reply{status: resp.StatusCode, header: resp.Header, raw: string(b)}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	_ = dec.Decode(&r.json)
	return r
}

func post(t testing.TB, url, body string, hdr ...string) reply {
	t.Helper()
	return do(t, http.MethodPost, url, body, hdr...)
}

func get(t testing.TB, url string) reply { t.Helper(); return do(t, http.MethodGet, url, "") }

// path walks a decoded JSON value: keys for objects, ints for arrays.
func path(v any, keys ...any) any {
	for _, k := range keys {
		switch k := k.(type) {
		case string:
			m, _ := v.(map[string]any)
			v = m[k]
		case int:
			a, _ := v.([]any)
			if k >= len(a) {
				return nil
			}
			v = a[k]
		}
	}
	return v
}

func num(v any) int {
	n, _ := v.(json.Number).Int64()
	return int(n)
}

func chatText(r reply) string {
	s, _ := path(r.json, "choices", 0, "message", "content").(string)
	return s
}

// sseData returns the data payloads of an SSE body, in order.
func sseData(t testing.TB, body string) []string {
	t.Helper()
	if !strings.HasSuffix(body, "\n\n") {
		t.Fatalf("SSE body does not end with a blank line: %q", body)
	}
	var out []string
	for _, ev := range strings.Split(strings.TrimSuffix(body, "\n\n"), "\n\n") {
		for _, line := range strings.Split(ev, "\n") {
			if d, ok := strings.CutPrefix(line, "data: "); ok {
				out = append(out, d)
			}
		}
	}
	return out
}

// expected is the fake model's answer to a chat with one user message.
func expected(content string, s Sampling) (string, string) {
	msgs := []message{{Role: "user", Content: json.RawMessage(mustJSON(content))}}
	toks, finish := Generate(Digest(chatPrompt(msgs)), s)
	return Detokenize(toks), finish
}

func mustJSON(v any) string { b, _ := json.Marshal(v); return string(b) }
