package h1

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/poll"
)

// Pipelined requests sent a byte at a time (every byte a wake-up of the wait without a buffer,
// bodies and heads split across waits) are all answered, in order, bodies whole.
func TestPipelinedRequestsTrickledAcrossTheWait(t *testing.T) {
	s, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%s:%s", r.URL.Path, b)
	}))
	c := dial(t, addr)
	raw := "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc" +
		"GET /b HTTP/1.1\r\nHost: x\r\n\r\n" +
		"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nde\r\n1\r\nf\r\n0\r\n\r\n" +
		"GET /d HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" +
		"GET /e HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
	go gwtest.Trickle(c, raw, 300*time.Microsecond)
	br := bufio.NewReader(c)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for _, want := range []string{"/a:abc", "/b:", "/c:def", "/d:", "/e:"} {
		if _, body := readResponse(t, br, "GET"); body != want {
			t.Fatalf("got %q, want %q", body, want)
		}
	}
	if n, err := br.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("after Connection: close: %d bytes, %v", n, err)
	}
	waitBuffers(t, s)
}

func waitBuffers(t *testing.T, s *Server) {
	t.Helper()
	poll.Until(t, "no read buffer held", func() bool { return s.buffers.Load() == 0 })
}

// keptAlive is a server with a long idle timeout and a client connection kept alive after one
// answer to request, waiting for its next request.
func keptAlive(t *testing.T, request string) (*Server, net.Conn, *bufio.Reader) {
	t.Helper()
	s, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }),
		func(s *Server) { s.IdleTimeout = time.Minute })
	c := dial(t, addr)
	io.WriteString(c, request)
	br := bufio.NewReader(c)
	readResponse(t, br, "GET")
	return s, c, br
}

// A kept-alive client that half-closes, or resets, while its connection waits for the next
// request is noticed: the server closes its side at once (not at the idle timeout), and holds no
// buffer for it.
func TestIdleClientThatLeavesIsNoticed(t *testing.T) {
	for _, how := range []string{"half-close", "reset"} {
		t.Run(how, func(t *testing.T) {
			s, c, br := keptAlive(t, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
			time.Sleep(30 * time.Millisecond) // the connection waits without a buffer
			if how == "reset" {
				c.(*net.TCPConn).SetLinger(0)
				c.Close()
			} else {
				c.(*net.TCPConn).CloseWrite()
				_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
				start := time.Now()
				if n, err := br.Read(make([]byte, 1)); err != io.EOF {
					t.Errorf("after the half-close: %d bytes, %v; want the server's close", n, err)
				} else if d := time.Since(start); d > 2*time.Second {
					t.Errorf("noticed after %v", d)
				}
			}
			poll.Until(t, "no connection served after the client left", func() bool {
				s.mu.Lock()
				defer s.mu.Unlock()
				return len(s.conns) == 0
			})
			waitBuffers(t, s)
		})
	}
}

// Shutdown closes a kept-alive connection waiting for its next request at once.
func TestShutdownClosesKeptAliveConnections(t *testing.T) {
	s, c, br := keptAlive(t, "GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
	time.Sleep(20 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v after %v", err, time.Since(start))
	}
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if n, err := br.Read(make([]byte, 1)); err != io.EOF && !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("after Shutdown: %d bytes, %v", n, err)
	}
}

// exchangeOutcome is what a client sees of one exchange: each answer's status, Connection header
// and body, and whether the connection was closed after them.
func exchangeOutcome(t *testing.T, addr, raw string, answers int) string {
	method := strings.Fields(raw)[0]
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, raw)
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	br := bufio.NewReader(c)
	var out []string
	for i := 0; i < answers; i++ {
		resp, err := http.ReadResponse(br, &http.Request{Method: method})
		if err != nil {
			out = append(out, "ERR "+err.Error())
			return strings.Join(out, " | ")
		}
		b, err := io.ReadAll(resp.Body)
		conn := strings.ToLower(resp.Header.Get("Connection"))
		if len(b) > 16 {
			b = append(b[:16:16], "..."...)
		}
		out = append(out, fmt.Sprintf("%d conn=%q cl=%d body=%q err=%v", resp.StatusCode, conn, resp.ContentLength, b, err))
	}
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := br.ReadByte(); err == io.EOF || errors.Is(err, syscall.ECONNRESET) {
		out = append(out, "closed")
	} else {
		out = append(out, "open")
	}
	return strings.Join(out, " | ")
}

// HTTP/1.0 keep-alive against net/http's server, the same handler, the same bytes: what the
// client sees (status, Connection, body, whether the connection stays) is the same.
func TestHTTP10KeepAliveLikeNetHTTP(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/stream":
			io.WriteString(w, "one")
			w.(http.Flusher).Flush()
			io.WriteString(w, "two")
		case "/big":
			io.WriteString(w, strings.Repeat("x", 10000))
		case "/declared":
			w.Header().Set("Content-Length", "3")
			io.WriteString(w, "abc")
		case "/unread":
			io.WriteString(w, "u")
		case "/204":
			w.WriteHeader(http.StatusNoContent)
		case "/closehdr":
			w.Header().Set("Connection", "close")
			io.WriteString(w, "c")
		default:
			b, _ := io.ReadAll(r.Body)
			fmt.Fprintf(w, "%s:%s", r.URL.Path, b)
		}
	})
	_, baton := serve(t, h)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ns := &http.Server{Handler: h}
	go ns.Serve(ln)
	t.Cleanup(func() { ns.Close() })
	ref := ln.Addr().String()

	const closedOne = `200 conn="" cl=3 body="/a:" err=<nil> | closed`
	for _, tc := range []struct {
		name, raw string
		answers   int
		want      string // Baton's outcome where it departs from net/http on purpose ("close" always closes)
	}{
		{"keep-alive", "GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 1, ""},
		{"keep-alive case and list", "GET /a HTTP/1.0\r\nConnection: Upgrade, KEEP-ALIVE\r\n\r\n", 1, ""},
		{"no keep-alive", "GET /a HTTP/1.0\r\n\r\n", 1, ""},
		{"keep-alive, close", "GET /a HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n", 1, closedOne},
		{"two Connection lines", "GET /a HTTP/1.0\r\nConnection: keep-alive\r\nConnection: close\r\n\r\n", 1, closedOne},
		{"pipelined pair", "GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 2, ""},
		{"body read", "POST /p HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 3\r\n\r\nxyzGET /b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 2, ""},
		{"body unread", "POST /unread HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 3\r\n\r\nxyzGET /b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 2, ""},
		{"smuggled in body", "POST /unread HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 30\r\n\r\nGET /smuggled HTTP/1.0\r\n\r\nxxxx", 1, ""},
		{"stream", "GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 1, ""},
		{"big", "GET /big HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 1, ""},
		{"declared", "GET /declared HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 1, ""},
		{"204", "GET /204 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 1, ""},
		{"handler close", "GET /closehdr HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 1, `200 conn="" cl=1 body="c" err=<nil> | closed`},
		{"HEAD", "HEAD /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 1, ""},
	} {
		b, r := exchangeOutcome(t, baton, tc.raw, tc.answers), exchangeOutcome(t, ref, tc.raw, tc.answers)
		if tc.want != "" {
			if b != tc.want {
				t.Errorf("%s:\n baton: %s\n want:  %s", tc.name, b, tc.want)
			}
			t.Logf("%s: baton %s; net/http %s", tc.name, b, r)
			continue
		}
		if b != r {
			t.Errorf("%s:\n baton:    %s\n net/http: %s", tc.name, b, r)
		} else {
			t.Logf("%s: %s", tc.name, b)
		}
	}
}

// smallSendListener gives its connections, still the sockets themselves, the smallest send
// buffer the kernel allows: a client that reads nothing blocks the server's writes early.
type smallSendListener struct{ net.Listener }

func (l smallSendListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		err = c.(*net.TCPConn).SetWriteBuffer(1)
	}
	return c, err
}

// An answer's last bytes — the whole answer when it fits the answer buffer, written when the
// handler returned — leave under the write deadline the request set: a client that sends
// requests and reads none of the answers gets the connection closed once a write blocks past
// that deadline, not held open by a write that waits for it for good. The requests come one at
// a time, as a client waiting for each answer sends them.
func TestTheLastBytesLeaveUnderTheRequestsWriteDeadline(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	body := strings.Repeat("x", 2000) // the answer, head and all, within one buffer: nothing leaves before the handler returns
	served := make(chan struct{}, 64)
	s := &Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
		io.WriteString(w, body)
		served <- struct{}{}
	})}
	go s.Serve(smallSendListener{ln})
	t.Cleanup(func() { s.Close() })
	c := dial(t, ln.Addr().String())
	if err := c.(*net.TCPConn).SetReadBuffer(1); err != nil {
		t.Fatal(err)
	}
	const sent = 48 // about 100 KB of answers: far more than both sockets' buffers hold
	answered := 0
	for range sent {
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			break
		}
		select {
		case <-served:
			answered++
		case <-time.After(time.Second):
		}
		time.Sleep(5 * time.Millisecond) // the server is waiting for the next request again
	}
	if answered == sent {
		t.Fatalf("all %d requests were served to a client that read nothing; want a write to block", sent)
	}
	time.Sleep(300 * time.Millisecond) // past the deadline of the blocked write
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	br := bufio.NewReader(c)
	got := 0
	for {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("after %d whole answers the connection is still open; want it closed by the write deadline", got)
			}
			break
		}
		b, err := io.ReadAll(resp.Body)
		if err != nil || string(b) != body {
			break // the answer the deadline cut
		}
		got++
	}
	if got >= answered {
		t.Errorf("%d whole answers of the %d served; want the one whose write blocked past its deadline cut", got, answered)
	}
}

// A request that reached the socket while the previous answer was being made — after the
// server's last read — is answered: the wait for it looks at the socket before it waits (the
// poller's readiness is reset when a wait is armed, so bytes already there would raise no new
// wake-up). Three ways for it to be there and not in the read buffer: sent while the handler
// ran, behind a body the handler read straight off the socket, behind a head that filled the
// buffer exactly.
func TestARequestAlreadyInTheSocketIsAnswered(t *testing.T) {
	head := "GET /full HTTP/1.1\r\nHost: x\r\nX-Pad: "
	fullHead := head + strings.Repeat("p", readBufSize-len(head)-len("\r\n\r\n")) + "\r\n\r\n"
	body := strings.Repeat("b", 20000)
	for _, tc := range []struct {
		name         string
		first, later string // later is sent 30 ms after first ("" with first)
		want         []string
	}{
		{"sent while the handler ran", "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n", "GET /second HTTP/1.1\r\nHost: x\r\n\r\n", []string{"/slow:0", "/second:0"}},
		{"behind a body read off the socket", "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 20000\r\n\r\n" + body + "GET /b HTTP/1.1\r\nHost: x\r\n\r\n", "", []string{"/a:20000", "/b:0"}},
		{"behind a head that filled the buffer", fullHead + "GET /b HTTP/1.1\r\nHost: x\r\n\r\n", "", []string{"/full:0", "/b:0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/slow" {
					time.Sleep(100 * time.Millisecond)
				}
				var n int64
				if r.ContentLength > 0 {
					buf := make([]byte, r.ContentLength) // one read as large as the body: straight off the socket
					m, _ := io.ReadFull(r.Body, buf)
					n = int64(m)
				}
				fmt.Fprintf(w, "%s:%d", r.URL.Path, n)
			}), func(s *Server) { s.IdleTimeout = time.Minute })
			c := dial(t, addr)
			io.WriteString(c, tc.first)
			if tc.later != "" {
				time.Sleep(30 * time.Millisecond)
				io.WriteString(c, tc.later)
			}
			c.SetReadDeadline(time.Now().Add(3 * time.Second))
			br := bufio.NewReader(c)
			for _, want := range tc.want {
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatalf("waiting for the answer %q: %v", want, err)
				}
				if b, _ := io.ReadAll(resp.Body); string(b) != want {
					t.Fatalf("answer %q, want %q", b, want)
				}
			}
		})
	}
}

// A client that sends its request and closes its sending side before the answer is made gets the
// answer and then the connection's close, and the server lets the connection go: its end was in
// the socket before the server waited for a next request.
func TestAHalfClosedClientGetsItsAnswerThenTheClose(t *testing.T) {
	s, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(100 * time.Millisecond) // the client's end arrives meanwhile
		io.WriteString(w, "ok")
	}))
	c := dial(t, addr)
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	c.(*net.TCPConn).CloseWrite()
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(resp.Body); string(b) != "ok" {
		t.Fatalf("answer %q", b)
	}
	if n, err := br.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("after the answer: %d bytes, %v; want the server's close (EOF)", n, err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		s.mu.Lock()
		open := len(s.conns)
		s.mu.Unlock()
		if open == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d server connections still open after the client closed", open)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
