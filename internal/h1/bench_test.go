package h1

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
)

// BenchmarkServe compares this server with net/http's on one keep-alive connection: a small
// POST answered with a small JSON body, the client a raw connection (the same for both), so
// the difference is the servers'. Allocations include the client's reads.
func BenchmarkServe(b *testing.B) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"cmpl-1","object":"text_completion","choices":[{"text":"ok"}]}`)
	})
	for _, tc := range []struct {
		name  string
		serve func(net.Listener) (stop func())
	}{
		{"h1", func(ln net.Listener) func() {
			s := &Server{Handler: h}
			go s.Serve(ln)
			return func() { s.Close() }
		}},
		{"net-http", func(ln net.Listener) func() {
			s := &http.Server{Handler: h}
			go s.Serve(ln)
			return func() { s.Close() }
		}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			defer tc.serve(ln)()
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			body := `{"model":"m","prompt":"hello","max_tokens":16}`
			req := []byte(fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body))
			br := bufio.NewReader(c)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := c.Write(req); err != nil {
					b.Fatal(err)
				}
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					b.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
}
