package server

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/gwtest"
)

// An engine's answer whose framing breaks before its first byte reaches the client — a chunk
// size that is no number, a trailer section past its bound — is the worker's failure, answered
// 502 in the error envelope (retried elsewhere first), never an empty 200 or a dropped
// connection; under both upstream clients.
func TestABrokenAnswerBeforeItsFirstByteIs502(t *testing.T) {
	t.Parallel()
	for name, answer := range map[string]string{
		"bad chunk size": "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
		"huge trailer": "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" +
			"X-Pad: " + strings.Repeat("a", 1<<20) + "\r\n\r\n",
		"bad chunk end": "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n",
		// Cut by the engine's close: a chunked body without its last chunk, a body short of its
		// Content-Length — known broken within the first buffer, never relayed as whole.
		"no last chunk": "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
			"2e\r\n{\"object\":\"list\",\"data\":[{\"embedding\":[0.1,0.2\r\n",
		"short of its length": "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"id\":\"x\"",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			eachUpstream(t, func(t *testing.T, client string) {
				engine := gwtest.SocketEngine(t, func(c net.Conn, _ *http.Request) bool {
					io.WriteString(c, answer)
					return false
				})
				_, gw, _ := gateway(t, []string{engine}, upstreamClient(t, client))
				resp, err := http.Post(gw+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"p"}`))
				if err != nil {
					t.Fatalf("the client got no answer: %v", err)
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(b), `"error"`) {
					t.Errorf("%d %q %v; want a 502 in the error envelope", resp.StatusCode, b, err)
				}
			})
		})
	}
}
