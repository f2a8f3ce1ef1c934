package upstream

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"
)

// recallHead reads raw as the next answer head on c, whose Recall holds what its last heads left.
func recallHead(c *conn, raw string) (*http.Response, error) {
	c.br = bufio.NewReaderSize(strings.NewReader(raw), readBufSize)
	req, _ := http.NewRequest(http.MethodPost, "http://x/", nil)
	return newT().readHead(c, req)
}

// stdHead is net/http's reading of raw, 1xx answers (not 101) passed over as its Transport does.
func stdHead(raw string) (*http.Response, error) {
	br := bufio.NewReader(strings.NewReader(raw))
	req, _ := http.NewRequest(http.MethodPost, "http://x/", nil)
	for {
		r, err := http.ReadResponse(br, req)
		if err != nil || r.StatusCode >= 200 || r.StatusCode == 101 {
			return r, err
		}
	}
}

// randCase is s with each letter's case flipped at random.
func randCase(r *rand.Rand, s string) string {
	b := []byte(s)
	for i, c := range b {
		if r.IntN(2) == 0 {
			if 'a' <= c && c <= 'z' {
				b[i] = c - 32
			} else if 'A' <= c && c <= 'Z' {
				b[i] = c + 32
			}
		}
	}
	return string(b)
}

// An engine that varies its heads on one kept-alive connection (names in any case and order,
// more fields than a Recall keeps, names and values just under and over its 64-byte bound,
// informational heads before the answer's) never gets a name or value of one head into the
// next: every head reads exactly as net/http reads it.
func TestAnEnginesHeadsOnOneConnectionReadAsNetHTTPReadsThem(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	names := []string{"x-engine-id", "X-Kv-Source", "x-request-id", "date", "server", "content-type", "x_under",
		"x-a", "x-b", "x-c", "a", "b", "link", "set-cookie", "x-" + strings.Repeat("n", 62), "x-" + strings.Repeat("n", 63),
		"x-" + strings.Repeat("n", 70), "content-length"}
	values := []string{"", "1", "vllm-1", "vllm-2", "VLLM-1", "application/json", "uvicorn", "a b", "a\tb", strings.Repeat("v", 64),
		strings.Repeat("v", 65), strings.Repeat("w", 64), strings.Repeat("v", 4000), "é", "chunked"}
	c := &conn{}
	for iter := 0; iter < 20000; iter++ {
		var sb strings.Builder
		if r.IntN(4) == 0 {
			sb.WriteString("HTTP/1.1 103 Early Hints\r\n")
			for range r.IntN(4) {
				n := names[r.IntN(len(names))]
				fmt.Fprintf(&sb, "%s: %s\r\n", randCase(r, n), values[r.IntN(len(values))])
			}
			sb.WriteString("\r\n")
		}
		sb.WriteString("HTTP/1.1 200 OK\r\n")
		hasCL := false
		for range r.IntN(14) {
			n := names[r.IntN(len(names))]
			v := values[r.IntN(len(values))]
			if n == "content-length" {
				if hasCL {
					continue
				}
				hasCL, v = true, "0"
			}
			fmt.Fprintf(&sb, "%s: %s\r\n", randCase(r, n), v)
		}
		if !hasCL {
			sb.WriteString("Content-Length: 0\r\n")
		}
		sb.WriteString("\r\n")
		raw := sb.String()
		got, err := recallHead(c, raw)
		want, werr := stdHead(raw)
		if (err == nil) != (werr == nil) {
			t.Fatalf("head %d %q: Baton %v, net/http %v", iter, raw, err, werr)
		}
		if err != nil {
			continue
		}
		if len(got.Header) != len(want.Header) {
			t.Fatalf("head %d %q:\n Baton %q\n net/http %q", iter, raw, got.Header, want.Header)
		}
		for k, v := range want.Header {
			if !slices.Equal(got.Header[k], v) {
				t.Fatalf("head %d %q: %s: Baton %q, net/http %q", iter, raw, k, got.Header[k], v)
			}
		}
	}
}

// A request cancelled at any moment (before its head, while its body is read, as the body ends)
// never leaves its connection in the pool with a deadline that breaks the next request on it.
func TestACancelRacingAnAnswersEndNeverBreaksTheNext(t *testing.T) {
	for _, mode := range []string{"length", "chunked", "empty", "slow"} {
		t.Run(mode, func(t *testing.T) {
			url := rawServer(t, func(c net.Conn, br *bufio.Reader) {
				for {
					if !readRequest(br) {
						return
					}
					switch mode {
					case "length":
						io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
					case "chunked":
						io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n")
					case "slow":
						io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\no\r\n")
						time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
						io.WriteString(c, "1\r\nk\r\n")
						time.Sleep(time.Duration(rand.IntN(100)) * time.Microsecond)
						io.WriteString(c, "0\r\n\r\n")
					case "empty":
						io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
					}
				}
			})
			tr := newT()
			defer tr.CloseIdleConnections()
			r := rand.New(rand.NewPCG(7, 8))
			bad, cancelledHead := 0, 0
			defer func() { t.Logf("%d of 500 cancelled before their head", cancelledHead) }()
			for i := range 500 {
				ctx, cancel := context.WithCancel(context.Background())
				delay := time.Duration(r.IntN(300)) * time.Microsecond
				timer := time.AfterFunc(delay, cancel)
				resp, err := send(t, tr, ctx, url, "{}")
				if err != nil {
					cancelledHead++
				} else {
					if _, ok := resp.Body.(interface{ Next() ([]byte, error) }); ok && i%2 == 0 {
						readViews(resp.Body)
					} else {
						io.ReadAll(resp.Body)
					}
					resp.Body.Close()
				}
				timer.Stop()
				cancel()
				// The next request, never cancelled.
				resp, err = send(t, tr, context.Background(), url, "{}")
				if err != nil {
					bad++
					t.Errorf("iteration %d: a request after a cancelled one failed: %v", i, err)
					if bad > 5 {
						return
					}
					continue
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || (mode != "empty" && string(b) != "ok") {
					t.Errorf("iteration %d: %q %v", i, b, err)
				}
			}
		})
	}
}

// A status line that is not one is named by its size: not even the 16 bytes of a version or the 8
// of a status code are quoted, for they may begin another request's answer.
func TestABadStatusLineIsNeverQuoted(t *testing.T) {
	for _, line := range []string{`HTTP/1.1 {"id":"cmpl-SECRET"}`, `HTTP/{"tok":"SECRET"} 200 OK`, `HTTP/SECRET 200 OK`, `HTTP/1.1 SEC 200`} {
		err := parseStatus(line, new(http.Response))
		if err == nil || strings.Contains(err.Error(), "SEC") || strings.Contains(err.Error(), `{"`) || strings.Contains(err.Error(), `{\"`) {
			t.Errorf("%q: %v", line, err)
		}
	}
}
