package app

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

// BenchmarkProxy measures the regular-mode hot path (request in, response out) against an
// in-process upstream, next to the same request sent straight to the upstream in the same run.
// Compare ns/op and allocs of baton/<size> with direct/<size>.
func BenchmarkProxy(b *testing.B) {
	const answer = `{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}`
	up := fakeEngine(&testing.T{}, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, answer)
	})
	defer up.Close()
	_, gw := startGateway(&testing.T{}, testConfig(up.URL))
	defer gw.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}}
	for _, size := range []int{1 << 10, 100 << 10, 1 << 20} {
		body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("a", size-60) + `"}]}`)
		for _, target := range []struct{ name, url string }{{"direct", up.URL}, {"baton", gw.URL}} {
			b.Run(fmt.Sprintf("%s/%dKB", target.name, size>>10), func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(body)))
				for b.Loop() {
					resp, err := client.Post(target.url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
					if err != nil {
						b.Fatal(err)
					}
					n, _ := io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != 200 || n != int64(len(answer)) {
						b.Fatalf("status %d, %d bytes", resp.StatusCode, n)
					}
				}
			})
		}
	}
}
