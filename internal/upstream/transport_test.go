package upstream

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func newT() *Transport { return New(http.DefaultTransport, 64<<10) }

func send(t *testing.T, tr *Transport, ctx context.Context, url, body string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	return tr.RoundTrip(req)
}

// Answers with a length, in chunks and until close all arrive whole; the request arrives as
// sent; connections are reused when an answer was read to its end.
// Both ways of reading a body (Read, and Next's views of the connection's buffer) see every
// framing whole, and leave a kept connection reusable.
func TestTransportFraming(t *testing.T) {
	for name, readAll := range map[string]func(io.Reader) []byte{"Read": func(r io.Reader) []byte { b, _ := io.ReadAll(r); return b }, "Next": readViews} {
		t.Run(name, func(t *testing.T) { testFraming(t, readAll) })
	}
}

// readViews reads a body through Next, copying each view before asking for the next.
func readViews(r io.Reader) []byte {
	var out []byte
	for {
		v, err := r.(interface{ Next() ([]byte, error) }).Next()
		out = append(out, v...)
		if err != nil {
			return out
		}
	}
}

func testFraming(t *testing.T, readAll func(io.Reader) []byte) {
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		switch r.URL.Path {
		case "/length":
			w.Header().Set("X-Echo", r.Header.Get("Content-Type"))
			fmt.Fprintf(w, "got %s", b)
		case "/chunked":
			for i := 0; i < 5; i++ {
				fmt.Fprintf(w, "data: %d\n\n", i)
				w.(http.Flusher).Flush()
			}
		case "/close":
			c, rw, _ := w.(http.Hijacker).Hijack()
			rw.WriteString("HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")
			rw.Flush()
			c.Close()
		}
	}))
	startCounting(t, srv, &conns)
	tr := newT()
	for i := 0; i < 3; i++ {
		resp, err := send(t, tr, context.Background(), srv.URL+"/length", `{"n":1}`)
		if err != nil {
			t.Fatal(err)
		}
		b := readAll(resp.Body)
		resp.Body.Close()
		if string(b) != `got {"n":1}` || resp.StatusCode != 200 || resp.Header.Get("X-Echo") != "application/json" || resp.ContentLength != int64(len(b)) {
			t.Fatalf("length: %d %q %v", resp.StatusCode, b, resp.Header)
		}
	}
	if conns.Load() != 1 {
		t.Errorf("%d connections for 3 sequential requests, want 1", conns.Load())
	}
	resp, err := send(t, tr, context.Background(), srv.URL+"/chunked", "")
	if err != nil {
		t.Fatal(err)
	}
	b := readAll(resp.Body)
	if string(b) != "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n" || resp.ContentLength != -1 || resp.Header.Get("Transfer-Encoding") != "" {
		t.Fatalf("chunked: %q", b)
	}
	resp, err = send(t, tr, context.Background(), srv.URL+"/close", "")
	if err != nil {
		t.Fatal(err)
	}
	b = readAll(resp.Body)
	if string(b) != "until the end" {
		t.Fatalf("close-delimited: %q", b)
	}
}

// startCounting starts srv, counting the connections it accepts in conns; it closes with the test.
func startCounting(t *testing.T, srv *httptest.Server, conns *atomic.Int64) {
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
}

// rawServer answers every connection with handle.
func rawServer(t *testing.T, handle func(c net.Conn, br *bufio.Reader)) string {
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
			go func() { defer c.Close(); handle(c, bufio.NewReader(c)) }()
		}
	}()
	return "http://" + ln.Addr().String()
}

func readRequest(br *bufio.Reader) bool {
	req, err := http.ReadRequest(br)
	if err != nil {
		return false
	}
	io.Copy(io.Discard, req.Body)
	return true
}

// A stream arrives as it is sent: the first event before the engine finished.
func TestTransportStreamsAsItArrives(t *testing.T) {
	release := make(chan struct{})
	url := rawServer(t, func(c net.Conn, br *bufio.Reader) {
		readRequest(br)
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n7\r\ndata: 1\r\n")
		<-release
		io.WriteString(c, "7\r\ndata: 2\r\n0\r\n\r\n")
	})
	resp, err := send(t, newT(), context.Background(), url, "{}")
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, err := resp.Body.Read(buf)
	if err != nil || string(buf[:n]) != "data: 1" {
		t.Fatalf("first event: %q %v", buf[:n], err)
	}
	close(release)
	rest, err := io.ReadAll(resp.Body)
	if err != nil || string(rest) != "data: 2" {
		t.Fatalf("rest: %q %v", rest, err)
	}
}

// Hostile or broken answers fail cleanly: headers past the bound, a bad status line, a bad
// chunk size, a body cut short; 1xx answers are skipped; header values cannot split a header.
func TestTransportBadAnswers(t *testing.T) {
	for _, c := range []struct {
		name, answer, want string
	}{
		{"huge headers", "HTTP/1.1 200 OK\r\nX-Big: " + strings.Repeat("a", 70<<10) + "\r\n\r\n", "too large"},
		{"bad status", "HTTP/9 OK\r\n\r\n", "malformed status"},
		{"bad header", "HTTP/1.1 200 OK\r\nno colon\r\n\r\n", "malformed header"},
		{"space before colon", "HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nok", "malformed header"},
		{"obs-fold", "HTTP/1.1 200 OK\r\nX-A: b\r\n  folded\r\nContent-Length: 2\r\n\r\nok", "obs-fold"},
		{"bad chunk", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"},
		{"short body", "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "unexpected EOF"},
		{"two lengths", "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", "bad Content-Length"},
		{"continue", "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			url := rawServer(t, func(conn net.Conn, br *bufio.Reader) {
				readRequest(br)
				io.WriteString(conn, c.answer)
			})
			resp, err := send(t, newT(), context.Background(), url, "{}")
			if err == nil {
				var b []byte
				b, err = io.ReadAll(resp.Body)
				if c.want == "" && (err != nil || string(b) != "ok") {
					t.Fatalf("%q %v", b, err)
				}
			}
			if c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
				t.Fatalf("err %v, want %q", err, c.want)
			}
		})
	}
	got := make(chan string, 1)
	url := rawServer(t, func(conn net.Conn, br *bufio.Reader) {
		req, err := http.ReadRequest(br)
		if err == nil {
			got <- fmt.Sprint(len(req.Header["Injected"]), req.Header.Get("X-Id"))
		}
		io.WriteString(conn, "HTTP/1.1 204 No Content\r\n\r\n")
	})
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader("{}"))
	req.Header["X-Id"] = []string{"a\r\nInjected: yes"}
	resp, err := newT().RoundTrip(req)
	if err != nil || resp.StatusCode != 204 {
		t.Fatalf("%v", err)
	}
	if g := <-got; g != "0a  Injected: yes" {
		t.Errorf("the engine saw %q", g)
	}
}

// An idle connection the engine closed is not an error: the request goes on a fresh one.
func TestTransportStaleConnection(t *testing.T) {
	var n atomic.Int64
	url := rawServer(t, func(conn net.Conn, br *bufio.Reader) {
		if !readRequest(br) {
			return
		}
		n.Add(1)
		io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		// and close: the client still holds the connection as idle
	})
	tr := newT()
	for i := 0; i < 3; i++ {
		resp, err := send(t, tr, context.Background(), url, "{}")
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		b, _ := io.ReadAll(resp.Body)
		if string(b) != "ok" {
			t.Fatalf("%q", b)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n.Load() != 3 {
		t.Errorf("the engine answered %d requests", n.Load())
	}
}

// An idle connection its engine wrote to unasked is dropped and told (OnUnsolicited); one its
// engine closed is dropped silently.
func TestTransportTellsUnsolicitedBytes(t *testing.T) {
	for stray, want := range map[string]int64{"": 0, `{"duplicate":1}`: 2} {
		url := rawServer(t, func(conn net.Conn, br *bufio.Reader) {
			if !readRequest(br) {
				return
			}
			io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			if stray != "" {
				time.Sleep(5 * time.Millisecond) // after the answer was read whole
				io.WriteString(conn, stray)
			}
			// and close: the client still holds the connection as idle
		})
		tr := newT()
		var told atomic.Int64
		tr.OnUnsolicited = func() { told.Add(1) }
		for i := range 3 {
			resp, err := send(t, tr, context.Background(), url, "{}")
			if err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
			if b, _ := io.ReadAll(resp.Body); string(b) != "ok" {
				t.Fatalf("%q", b)
			}
			time.Sleep(20 * time.Millisecond)
		}
		if told.Load() != want {
			t.Errorf("stray %q: told %d times, want %d", stray, told.Load(), want)
		}
	}
}

// Cancelling the request's context ends a read blocked on a silent engine at once, and so does
// closing the body from another goroutine; neither connection is reused. The same for a body
// read through Next, which waits for the engine holding no buffer.
func TestTransportCancel(t *testing.T) {
	for name, readAll := range map[string]func(io.Reader) ([]byte, error){"Read": io.ReadAll, "Next": readViewsErr} {
		t.Run(name, func(t *testing.T) { testCancel(t, readAll) })
	}
}

// readViewsErr is readViews with the error that ended it (nil at the body's end).
func readViewsErr(r io.Reader) ([]byte, error) {
	var out []byte
	for {
		v, err := r.(interface{ Next() ([]byte, error) }).Next()
		out = append(out, v...)
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return out, err
		}
	}
}

func testCancel(t *testing.T, readAll func(io.Reader) ([]byte, error)) {
	url := rawServer(t, func(conn net.Conn, br *bufio.Reader) {
		readRequest(br)
		io.WriteString(conn, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
		time.Sleep(10 * time.Second)
	})
	tr := newT()
	ctx, cancel := context.WithCancel(context.Background())
	resp, err := send(t, tr, ctx, url, "{}")
	if err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(50*time.Millisecond, cancel)
	start := time.Now()
	got, err := readAll(resp.Body)
	if string(got) != "hi" || !errors.Is(err, context.Canceled) || time.Since(start) > 5*time.Second {
		t.Fatalf("after cancel: %v after %s", err, time.Since(start))
	}
	resp, err = send(t, tr, context.Background(), url, "{}")
	if err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(50*time.Millisecond, func() { resp.Body.Close() })
	if _, err = readAll(resp.Body); err == nil {
		t.Fatal("a closed body read to its end")
	}
	left := rawServer(t, func(conn net.Conn, br *bufio.Reader) {
		readRequest(br)
		io.WriteString(conn, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
		time.Sleep(50 * time.Millisecond)
	})
	resp, err = send(t, tr, context.Background(), left, "{}")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := readAll(resp.Body); string(got) != "hi" || !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("an engine that left mid-answer: %q, %v; want hi and an unexpected EOF", got, err)
	}
	tr.mu.Lock()
	idle := len(tr.idle)
	for _, l := range tr.idle {
		idle += len(l) - 1
	}
	tr.mu.Unlock()
	if idle != 0 {
		t.Errorf("%d broken connections kept for reuse", idle)
	}
}

// fakeConn answers with fixed bytes.
type fakeConn struct {
	net.Conn
	r io.Reader
}

func (f *fakeConn) Read(p []byte) (int, error)         { return f.r.Read(p) }
func (f *fakeConn) Write(p []byte) (int, error)        { return len(p), nil }
func (f *fakeConn) Close() error                       { return nil }
func (f *fakeConn) SetDeadline(time.Time) error        { return nil }
func (f *fakeConn) LocalAddr() net.Addr                { return &net.TCPAddr{} }
func (f *fakeConn) RemoteAddr() net.Addr               { return &net.TCPAddr{} }
func (f *fakeConn) SetReadDeadline(t time.Time) error  { return nil }
func (f *fakeConn) SetWriteDeadline(t time.Time) error { return nil }

// FuzzAnswer feeds arbitrary bytes as an engine's answer: no panic, and what is read never
// exceeds what was sent.
func FuzzAnswer(f *testing.F) {
	f.Add([]byte("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
	f.Add([]byte("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"))
	f.Add([]byte("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\n\r\nbody"))
	f.Fuzz(func(t *testing.T, answer []byte) {
		tr := newT()
		c := &conn{c: &fakeConn{r: bytes.NewReader(answer)}, host: "x:80"}
		c.br = bufio.NewReaderSize(c.c, readBufSize)
		req, _ := http.NewRequest(http.MethodPost, "http://x/", nil)
		resp, err := tr.exchange(context.Background(), c, req, []byte("{}"), false)
		if err != nil {
			return
		}
		b, rerr := io.ReadAll(io.LimitReader(resp.Body, int64(len(answer))+1))
		if len(b) > len(answer) {
			t.Fatalf("read %d bytes of a %d-byte answer", len(b), len(answer))
		}
		resp.Body.Close()
		// The same answer read through Next's views: the same bytes, the same verdict.
		c = &conn{c: &fakeConn{r: bytes.NewReader(answer)}, host: "x:80"}
		c.br = bufio.NewReaderSize(c.c, readBufSize)
		resp, err = tr.exchange(context.Background(), c, req, []byte("{}"), false)
		if err != nil {
			t.Fatalf("the second exchange failed: %v", err)
		}
		if v, ok := resp.Body.(interface{ Next() ([]byte, error) }); ok {
			var views []byte
			var verr error
			for verr == nil {
				var p []byte
				p, verr = v.Next()
				views = append(views, p...)
			}
			if !bytes.Equal(views, b) || (verr == io.EOF) != (rerr == nil) {
				t.Fatalf("Next read %q (%v), Read %q (%v)", views, verr, b, rerr)
			}
		}
		resp.Body.Close()
	})
}

// A connection idle for longer than IdleTimeout is closed rather than reused.
func TestTransportIdleTimeout(t *testing.T) {
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	startCounting(t, srv, &conns)
	tr := newT()
	tr.IdleTimeout = 50 * time.Millisecond
	for i := 0; i < 2; i++ {
		resp, err := send(t, tr, context.Background(), srv.URL, "{}")
		if err != nil {
			t.Fatal(err)
		}
		io.ReadAll(resp.Body)
		time.Sleep(100 * time.Millisecond)
	}
	if conns.Load() != 2 {
		t.Errorf("%d connections: an expired idle connection was reused", conns.Load())
	}
}

// FuzzAnswerAgainstReadResponse reads arbitrary bytes as an engine's answer to a POST with
// Baton's client and with net/http's own parser (http.ReadResponse, passing over 1xx answers
// but 101 as net/http's Transport does): whatever Baton's client accepts whole, net/http accepts too, with
// the same status, headers and body bytes. Baton's client may be stricter (it refuses folded
// lines, a 101 and framing net/http tolerates), never laxer or different.
func FuzzAnswerAgainstReadResponse(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;ext=1\r\nok\r\n0\r\nTrailer: x\r\n\r\n",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\n\r\nbody",
		"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
		"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
		"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello",
		"HTTP/1.1 200 OK\nX-A:  v \n\nrest",
		"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, answer []byte) {
		req, _ := http.NewRequest(http.MethodPost, "http://x/", nil)
		c := &conn{c: &fakeConn{r: bytes.NewReader(answer)}, host: "x:80"}
		c.br = bufio.NewReaderSize(c.c, readBufSize)
		resp, err := newT().exchange(context.Background(), c, req, []byte("{}"), false)
		if err != nil {
			return
		}
		if resp.StatusCode < 200 { // a 101: the proxy refuses it (502), whatever follows
			resp.Body.Close()
			return
		}
		body, err := io.ReadAll(io.LimitReader(resp.Body, int64(len(answer))+1))
		resp.Body.Close()
		if err != nil {
			return // refused part way: the client sees a broken answer, never a different one
		}
		br := bufio.NewReader(bytes.NewReader(answer))
		var std *http.Response
		for {
			std, err = http.ReadResponse(br, req)
			if err != nil {
				t.Fatalf("Baton's client accepted an answer net/http refuses (%v): %q", err, answer)
			}
			if std.StatusCode >= 200 || std.StatusCode == http.StatusSwitchingProtocols {
				break // net/http's Transport passes over the other 1xx answers
			}
		}
		stdBody, err := io.ReadAll(std.Body)
		if err != nil {
			t.Fatalf("Baton's client read a body net/http refuses (%v): %q", err, answer)
		}
		if resp.StatusCode != std.StatusCode || !bytes.Equal(body, stdBody) {
			t.Fatalf("status %d body %q; net/http: %d %q; answer %q", resp.StatusCode, body, std.StatusCode, stdBody, answer)
		}
		for k, v := range std.Header {
			if k == "Content-Length" || k == "Transfer-Encoding" {
				continue // framing: net/http moves them into fields
			}
			if !slices.Equal(resp.Header[k], v) {
				t.Fatalf("header %s: %q; net/http: %q; answer %q", k, resp.Header[k], v, answer)
			}
		}
		for k := range resp.Header {
			if _, ok := std.Header[k]; !ok && k != "Content-Length" && k != "Transfer-Encoding" {
				t.Fatalf("header %s only in Baton's reading of %q", k, answer)
			}
		}
	})
}

// A request cancelled while its body waits for room (an engine that stopped reading and does not
// answer) ends with the cancellation, not after the look for an answer that came before the
// write failed: that look is for a write the engine cut, not one the caller gave up on.
func TestACancelledWriteIsNotFollowedByALookForAnAnswer(t *testing.T) {
	defer func(w time.Duration) { earlyAnswerWait = w }(earlyAnswerWait)
	earlyAnswerWait = time.Minute // a look would outlast the test's wait
	ctx, cancel := context.WithCancel(context.Background())
	url := rawServer(t, func(conn net.Conn, br *bufio.Reader) {
		br.ReadString('\n') // the request line, then nothing more is read, and no answer
		time.AfterFunc(200*time.Millisecond, cancel)
		time.Sleep(20 * time.Second)
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewBuffer(bytes.Repeat([]byte("x"), 64<<20)))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := newT().RoundTrip(req)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("a cancelled request ended with %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a cancelled request is still waiting 10 s later")
	}
}
