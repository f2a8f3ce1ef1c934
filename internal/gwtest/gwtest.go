// Package gwtest holds what the gateway's tests share when they talk HTTP to it: a POST with a
// client deadline, the generated text of any route's answer, answers compared without their
// ids, the status line read off a raw connection, an engine that writes raw bytes on its socket.
package gwtest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// PostTimeout posts with a client deadline, so a leg left waiting for a partner fails the test
// instead of hanging it.
func PostTimeout(t *testing.T, url, body string) (*http.Response, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading %s: %v", url, err)
	}
	return resp, string(b)
}

// AnswerText extracts the generated text of any route's answer, streamed or not.
func AnswerText(t *testing.T, body string) string {
	t.Helper()
	if strings.HasPrefix(body, "data: ") || strings.HasPrefix(body, "event: ") {
		var sb strings.Builder
		for _, ev := range strings.Split(body, "\n\n") {
			for _, line := range strings.Split(ev, "\n") {
				d, ok := strings.CutPrefix(line, "data: ")
				if !ok || d == "[DONE]" {
					continue
				}
				var v map[string]any
				json.Unmarshal([]byte(d), &v)
				if ch, _ := v["choices"].([]any); len(ch) > 0 {
					c := ch[0].(map[string]any)
					if delta, ok := c["delta"].(map[string]any); ok {
						s, _ := delta["content"].(string)
						sb.WriteString(s)
					} else if s, ok := c["text"].(string); ok {
						sb.WriteString(s)
					}
				} else if s, ok := v["delta"].(string); ok {
					sb.WriteString(s)
				} else if d, ok := v["delta"].(map[string]any); ok { // messages: content_block_delta
					s, _ := d["text"].(string)
					sb.WriteString(s)
				} else if s, ok := v["text"].(string); ok { // /generate: cumulative
					sb.Reset()
					sb.WriteString(s)
				}
			}
		}
		return sb.String()
	}
	var v map[string]any
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatalf("answer %q: %v", body, err)
	}
	if ch, _ := v["choices"].([]any); len(ch) > 0 {
		c := ch[0].(map[string]any)
		if m, ok := c["message"].(map[string]any); ok {
			return m["content"].(string)
		}
		return c["text"].(string)
	}
	if out, ok := v["output"].([]any); ok {
		return out[0].(map[string]any)["content"].([]any)[0].(map[string]any)["text"].(string)
	}
	if blocks, ok := v["content"].([]any); ok && len(blocks) > 0 { // messages
		return blocks[0].(map[string]any)["text"].(string)
	}
	return v["text"].(string)
}

var idField = regexp.MustCompile(`"id":"[^"]*"`)

// StripIDs removes response ids (made from each request's id) so answers can be compared.
func StripIDs(s string) string { return idField.ReplaceAllString(s, `"id":""`) }

// ReadStatus reads the status line of the answer on c.
func ReadStatus(t *testing.T, c net.Conn) string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(15 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	return strings.TrimSpace(line)
}

// SocketEngine is a raw-socket engine serving model "m": its model list and other GETs get
// plain answers (registration probes pass), and each POST goes to post, its body unread, which
// writes whatever it likes on the connection and says whether the connection goes on. It
// returns the engine's URL.
func SocketEngine(t testing.TB, post func(c net.Conn, req *http.Request) bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					if req.Method == http.MethodPost {
						if !post(c, req) {
							return
						}
						io.Copy(io.Discard, req.Body) // what post left unread
						continue
					}
					io.Copy(io.Discard, req.Body)
					if req.URL.Path == "/v1/models" {
						body := `{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm"}]}`
						io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "+strconv.Itoa(len(body))+"\r\n\r\n"+body)
						continue
					}
					io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
				}
			}()
		}
	}()
	return "http://" + ln.Addr().String()
}

// SyncBuffer is a goroutine-safe bytes.Buffer, for the log or output of something running.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// ReadStream posts body (a streamed completion) to url and reads the answer to its end within
// d: what came and the read's end (nil: a whole body). It fails t when d passed first — the
// stream was held open.
func ReadStream(t *testing.T, url, body string, d time.Duration) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if ctx.Err() != nil {
		t.Fatalf("the stream was held open past %s: %q", d, b)
	}
	return string(b), err
}

// Trickle writes s on c a byte at a time with a pause after each: every byte a wake-up of the
// reader's wait, heads, bodies and chunk framing split everywhere.
func Trickle(c net.Conn, s string, pause time.Duration) {
	for i := 0; i < len(s); i++ {
		c.Write([]byte{s[i]})
		time.Sleep(pause)
	}
}
