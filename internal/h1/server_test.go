package h1

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"
	"weak"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/poll"
)

// envelope renders a refusal as Baton does (app's renderer): the OpenAI error envelope, with a
// code per kind, also in X-Baton-Error-Code; its headers try to add a line, which the server
// must not let them.
func envelope(r *Refusal) (http.Header, []byte) {
	e := &openai.Error{Status: r.Status, Code: fmt.Sprint("kind_", int(r.Kind)), Message: r.Message}
	return http.Header{"Content-Type": {"application/json"}, "X-Baton-Error-Code": {e.Code}, "X-Evil": {"a\r\nInjected: yes"}}, e.Marshal()
}

// serve starts a Server for h on a loopback listener and returns its address.
func serve(t *testing.T, h http.Handler, tune ...func(*Server)) (*Server, string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{Handler: h}
	for _, f := range tune {
		f(s)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve(ln) }()
	t.Cleanup(func() {
		s.Close()
		if err := <-done; !errors.Is(err, ErrServerClosed) {
			t.Errorf("Serve returned %v, want ErrServerClosed", err)
		}
	})
	return s, ln.Addr().String()
}

// dial connects to addr; the connection closes with the test.
func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// exchange writes raw to a new connection and returns everything the server sends until it
// closes the connection or goes quiet for the wait.
func exchange(t *testing.T, addr, raw string, wait time.Duration) string {
	t.Helper()
	c := dial(t, addr)
	defer c.Close()
	if _, err := io.WriteString(c, raw); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(wait))
	b, _ := io.ReadAll(c)
	return string(b)
}

// readResponse reads one answer from br, as a client would.
func readResponse(t *testing.T, br *bufio.Reader, method string) (*http.Response, string) {
	t.Helper()
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the body: %v", err)
	}
	return resp, string(b)
}

func TestFraming(t *testing.T) {
	big := strings.Repeat("0123456789abcdef", 1024) // 16 KiB: more than the buffer
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/small":
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"ok":true}`)
		case "/big":
			io.WriteString(w, big)
		case "/declared":
			w.Header().Set("Content-Length", "5")
			io.WriteString(w, "hello")
		case "/flushed":
			io.WriteString(w, "data: 1\n\n")
			w.(http.Flusher).Flush()
			io.WriteString(w, "data: 2\n\n")
		case "/nocontent":
			w.WriteHeader(http.StatusNoContent)
			if _, err := io.WriteString(w, "x"); !errors.Is(err, http.ErrBodyNotAllowed) {
				panic(fmt.Sprintf("write after 204: %v", err))
			}
		case "/status":
			w.WriteHeader(http.StatusTeapot)
		case "/sniff":
			io.WriteString(w, "<html><body>hi</body></html>")
		}
	}))
	c := dial(t, addr)
	defer c.Close()
	br := bufio.NewReader(c)
	for _, tc := range []struct {
		path, method   string
		status         int
		body           string
		chunked        bool
		contentLength  int64
		contentTypeHas string
	}{
		{"/small", "GET", 200, `{"ok":true}`, false, 11, "application/json"},
		{"/big", "GET", 200, big, true, -1, "text/plain"},
		{"/declared", "GET", 200, "hello", false, 5, "text/plain"},
		{"/flushed", "GET", 200, "data: 1\n\ndata: 2\n\n", true, -1, "text/plain"},
		{"/nocontent", "GET", 204, "", false, 0, ""},
		{"/status", "GET", 418, "", false, 0, ""},
		{"/sniff", "GET", 200, "<html><body>hi</body></html>", false, 28, "text/html"},
		{"/small", "HEAD", 200, "", false, 11, "application/json"},
	} {
		fmt.Fprintf(c, "%s %s HTTP/1.1\r\nHost: x\r\n\r\n", tc.method, tc.path)
		resp, body := readResponse(t, br, tc.method)
		chunked := len(resp.TransferEncoding) > 0
		if resp.StatusCode != tc.status || body != tc.body || chunked != tc.chunked || resp.ContentLength != tc.contentLength {
			t.Errorf("%s %s: got %d, chunked %v, length %d, body %.40q; want %d, chunked %v, length %d, body %.40q", tc.method, tc.path,
				resp.StatusCode, chunked, resp.ContentLength, body, tc.status, tc.chunked, tc.contentLength, tc.body)
		}
		if ct := resp.Header.Get("Content-Type"); !strings.Contains(ct, tc.contentTypeHas) {
			t.Errorf("%s: Content-Type %q, want it to contain %q", tc.path, ct, tc.contentTypeHas)
		}
		if resp.Header.Get("Date") == "" {
			t.Errorf("%s: no Date header", tc.path)
		}
		if resp.Close {
			t.Errorf("%s: the server asked to close a keep-alive connection", tc.path)
		}
	}
}

// A flushed event reaches the client while the handler is still running.
func TestFlushReachesClientAtOnce(t *testing.T) {
	release := make(chan struct{})
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: first\n\n")
		w.(http.Flusher).Flush()
		<-release
		io.WriteString(w, "data: second\n\n")
	}))
	resp, err := http.Get("http://" + addr + "/")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || line != "data: first\n" {
		t.Fatalf("first line %q, %v", line, err)
	}
	close(release)
	rest, err := io.ReadAll(br)
	if err != nil || string(rest) != "\ndata: second\n\n" {
		t.Fatalf("rest %q, %v", rest, err)
	}
}

func TestKeepAliveWithNetHTTPClient(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%s %s %d %s", r.Method, r.URL.Path, r.ContentLength, b)
	}))
	var reused atomic.Int32
	client := &http.Client{}
	for i := range 5 {
		ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
			if info.Reused {
				reused.Add(1)
			}
		}})
		req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+addr+"/p", strings.NewReader(fmt.Sprint("body", i)))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if want := fmt.Sprintf("POST /p 5 body%d", i); string(b) != want {
			t.Errorf("got %q, want %q", b, want)
		}
	}
	if reused.Load() != 4 {
		t.Errorf("%d of 4 later requests reused the connection", reused.Load())
	}
}

func TestRequestBodies(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%d|%v|%q|%v", r.ContentLength, r.TransferEncoding, b, err)
	}))
	for _, tc := range []struct{ name, raw, want string }{
		{"length", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", `5|[]|"hello"|<nil>`},
		{"chunked with trailers and extensions", "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nhel\r\n2\r\nlo\r\n0\r\nX-Trailer: t\r\n\r\n", `-1|[chunked]|"hello"|<nil>`},
		{"empty", "POST / HTTP/1.1\r\nHost: x\r\n\r\n", `0|[]|""|<nil>`},
	} {
		c := dial(t, addr)
		br := bufio.NewReader(c)
		// Twice on one connection: the body's end is exactly where the next request begins.
		io.WriteString(c, tc.raw+tc.raw)
		for i := range 2 {
			_, body := readResponse(t, br, "POST")
			if body != tc.want {
				t.Errorf("%s #%d: got %s, want %s", tc.name, i, body, tc.want)
			}
		}
		c.Close()
	}
}

func TestExpectContinue(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/ignore" {
			io.WriteString(w, "not read")
			return
		}
		b, _ := io.ReadAll(r.Body)
		w.Write(b)
	}))
	c := dial(t, addr)
	defer c.Close()
	br := bufio.NewReader(c)
	io.WriteString(c, "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	line, err := br.ReadString('\n')
	if err != nil || line != "HTTP/1.1 100 Continue\r\n" {
		t.Fatalf("before the body: %q, %v", line, err)
	}
	if l, _ := br.ReadString('\n'); l != "\r\n" {
		t.Fatalf("100 Continue ends with %q", l)
	}
	io.WriteString(c, "ping")
	if _, body := readResponse(t, br, "POST"); body != "ping" {
		t.Errorf("echo %q", body)
	}
	// A handler that never reads: no 100 Continue, and the connection closes since the body
	// may still be on its way.
	io.WriteString(c, "POST /ignore HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
	resp, body := readResponse(t, br, "POST")
	if resp.StatusCode != 200 || body != "not read" || !resp.Close {
		t.Errorf("got %d %q close=%v, want 200 \"not read\" and a close", resp.StatusCode, body, resp.Close)
	}
	if got, err := net.Conn(c).Read(make([]byte, 1)); err == nil {
		t.Errorf("the connection stayed open (%d bytes)", got)
	}
}

func TestRefusedRequests(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Errorf("the handler saw %s %s", r.Method, r.URL)
	}), func(s *Server) { s.MaxHeaderBytes, s.Refuse = 2048, envelope })
	for _, tc := range []struct {
		name, raw string
		status    int
	}{
		{"no host", "GET / HTTP/1.1\r\n\r\n", 400},
		{"two hosts", "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},
		{"bad host", "GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", 400},
		{"bad length", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n", 400},
		{"negative length", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400},
		{"two lengths", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400},
		{"length and chunked", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
		{"gzip coding", "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501},
		{"chunked twice", "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 501},
		{"HTTP/2", "GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505},
		{"prior knowledge h2", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505},
		{"odd expectation", "POST / HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\nContent-Length: 1\r\n\r\nx", 417},
		{"headers too large", "GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + strings.Repeat("a", 4096) + "\r\n\r\n", 431},
		{"line too large", "GET /" + strings.Repeat("a", 4096) + " HTTP/1.1\r\nHost: x\r\n\r\n", 431},
		{"folded header", "GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  2\r\n\r\n", 400},
		{"space before colon", "GET / HTTP/1.1\r\nHost: x\r\nX-A : 1\r\n\r\n", 400},
		{"control byte in value", "GET / HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400},
		{"no colon", "GET / HTTP/1.1\r\nHost: x\r\nX-A\r\n\r\n", 400},
		{"bad method", "G(T / HTTP/1.1\r\nHost: x\r\n\r\n", 400},
		{"bad target", "GET foo HTTP/1.1\r\nHost: x\r\n\r\n", 400},
		{"garbage", "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400},
	} {
		out := exchange(t, addr, tc.raw, 5*time.Second)
		resp, err := http.ReadResponse(bufio.NewReader(strings.NewReader(out)), nil)
		if err != nil {
			t.Errorf("%s: unreadable answer %q: %v", tc.name, out, err)
			continue
		}
		var env struct {
			Error struct{ Message, Type, Code string }
		}
		err = json.NewDecoder(resp.Body).Decode(&env)
		if resp.StatusCode != tc.status || err != nil || env.Error.Message == "" || env.Error.Code == "" || !resp.Close ||
			resp.Header.Get("X-Baton-Error-Code") != env.Error.Code || resp.Header.Get("Injected") != "" {
			t.Errorf("%s: got %d close=%v %+v (%v), want %d in an OpenAI error envelope and a close", tc.name,
				resp.StatusCode, resp.Close, env, err, tc.status)
		}
	}
}

func TestPipelinedRequestsAnswerInOrder(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			time.Sleep(50 * time.Millisecond)
		}
		io.WriteString(w, r.URL.Path)
	}))
	c := dial(t, addr)
	defer c.Close()
	io.WriteString(c, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
	br := bufio.NewReader(c)
	for _, want := range []string{"/slow", "/a", "/b"} {
		if _, body := readResponse(t, br, "GET"); body != want {
			t.Errorf("got %q, want %q", body, want)
		}
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("after Connection: close: %d bytes, %v; want EOF", n, err)
	}
}

// Header values cannot add header lines to an answer, and invalid names are dropped.
func TestHeaderValuesCannotSplitTheHead(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["X-Value"] = []string{"a\r\nX-Injected: 1"}
		w.Header()["Bad Name"] = []string{"v"}
		w.Header()["Transfer-Encoding"] = []string{"identity"}
	}))
	out := exchange(t, addr, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 5*time.Second)
	resp, err := http.ReadResponse(bufio.NewReader(strings.NewReader(out)), nil)
	if err != nil {
		t.Fatalf("%q: %v", out, err)
	}
	if resp.Header.Get("X-Injected") != "" || resp.Header.Get("X-Value") != "a  X-Injected: 1" || strings.Contains(out, "Bad Name") ||
		strings.Contains(out, "identity") {
		t.Errorf("head %q", out)
	}
}

// A client that closes its connection ends its request's context, and the cause says why.
func TestClientLeavingCancelsTheRequest(t *testing.T) {
	if !Supported() {
		t.Skip("SKIP: no epoll on this platform; Baton serves with net/http here")
	}
	started, ended := make(chan struct{}), make(chan error, 1)
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		if r.URL.Path == "/stream" {
			io.WriteString(w, "data: 1\n\n")
			w.(http.Flusher).Flush()
		}
		started <- struct{}{}
		select {
		case <-r.Context().Done():
			ended <- context.Cause(r.Context())
		case <-time.After(10 * time.Second):
			ended <- errors.New("never cancelled")
		}
	}))
	for _, path := range []string{"/wait", "/stream"} {
		c := dial(t, addr)
		fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi", path)
		<-started
		c.Close()
		if err := <-ended; !errors.Is(err, errPeerGone) {
			t.Errorf("%s: the request ended with %v, want %v", path, err, errPeerGone)
		}
	}
	// A request whose client already left when it was read starts cancelled.
	c := dial(t, addr)
	io.WriteString(c, "GET /gone HTTP/1.1\r\nHost: x\r\n\r\n")
	c.(*net.TCPConn).CloseWrite()
	<-started
	if err := <-ended; !errors.Is(err, errPeerGone) {
		t.Errorf("half-closed client: %v", err)
	}
	c.Close()
}

func TestTimeouts(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }),
		func(s *Server) { s.ReadHeaderTimeout, s.IdleTimeout = 200*time.Millisecond, 300*time.Millisecond })
	for _, tc := range []struct{ name, raw string }{
		{"silent", ""},
		{"slow head", "GET / HTTP/1.1\r\nHost: x\r\n"},
	} {
		c := dial(t, addr)
		io.WriteString(c, tc.raw)
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		start := time.Now()
		n, err := c.Read(make([]byte, 1))
		if err != io.EOF || n != 0 {
			t.Errorf("%s: %d bytes, %v; want the server to close", tc.name, n, err)
		}
		if d := time.Since(start); d > 4*time.Second {
			t.Errorf("%s: closed after %v", tc.name, d)
		}
		c.Close()
	}
	// An idle keep-alive connection is closed after the idle timeout, not the header one.
	c := dial(t, addr)
	defer c.Close()
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	br := bufio.NewReader(c)
	readResponse(t, br, "GET")
	time.Sleep(250 * time.Millisecond) // past the header timeout, within the idle one
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if _, body := readResponse(t, br, "GET"); body != "ok" {
		t.Errorf("second request: %q", body)
	}
}

func TestShutdownFinishesRequestsInFlight(t *testing.T) {
	started, release := make(chan struct{}), make(chan struct{})
	s, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			close(started)
			<-release
		}
		io.WriteString(w, "done")
	}))
	idle := dial(t, addr)
	defer idle.Close()
	io.WriteString(idle, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	readResponse(t, bufio.NewReader(idle), "GET")
	busy := dial(t, addr)
	defer busy.Close()
	io.WriteString(busy, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
	<-started
	shut := make(chan error, 1)
	go func() { shut <- s.Shutdown(context.Background()) }()
	_ = idle.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := idle.Read(make([]byte, 1)); err == nil {
		t.Errorf("the idle connection got %d bytes; want it closed", n)
	}
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned %v with a request in flight", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	resp, body := readResponse(t, bufio.NewReader(busy), "GET")
	if body != "done" || !resp.Close {
		t.Errorf("in flight: %q close=%v; want done and a close", body, resp.Close)
	}
	if err := <-shut; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
	if _, err := net.Dial("tcp", addr); err == nil {
		t.Error("still accepting after Shutdown")
	}
}

func TestPanicsCloseOnlyTheirConnection(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/panic":
			panic("boom")
		case "/abort":
			io.WriteString(w, "partial")
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		}
		io.WriteString(w, "fine")
	}))
	if out := exchange(t, addr, "GET /panic HTTP/1.1\r\nHost: x\r\n\r\n", 5*time.Second); out != "" {
		t.Errorf("a panic before the first byte answered %q; want the connection closed", out)
	}
	resp, err := http.Get("http://" + addr + "/abort")
	if err == nil {
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("an abort after the first byte: %v; want the client to see a cut (unexpected EOF)", err)
	}
	resp, err = http.Get("http://" + addr + "/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "fine" {
		t.Errorf("after the panics: %q", b)
	}
}

func TestResponseControllerDeadlines(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		if r.URL.Path == "/read" {
			if err := rc.SetReadDeadline(time.Now().Add(100 * time.Millisecond)); err != nil {
				panic(err)
			}
			_, err := io.ReadAll(r.Body)
			var ne net.Error
			fmt.Fprintf(w, "timeout=%v", errors.As(err, &ne) && ne.Timeout())
			return
		}
		if err := rc.SetWriteDeadline(time.Now().Add(time.Minute)); err != nil {
			panic(err)
		}
		io.WriteString(w, "x")
		if err := rc.Flush(); err != nil {
			panic(err)
		}
	}))
	c := dial(t, addr)
	defer c.Close()
	br := bufio.NewReader(c)
	io.WriteString(c, "GET /write HTTP/1.1\r\nHost: x\r\n\r\n")
	if _, body := readResponse(t, br, "GET"); body != "x" {
		t.Errorf("write: %q", body)
	}
	io.WriteString(c, "POST /read HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
	if _, body := readResponse(t, br, "POST"); body != "timeout=true" {
		t.Errorf("read: %q", body)
	}
}

func TestHTTP10(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "one")
		w.(http.Flusher).Flush()
		io.WriteString(w, "two")
	}))
	out := exchange(t, addr, "GET / HTTP/1.0\r\n\r\n", 5*time.Second)
	if !strings.HasPrefix(out, "HTTP/1.0 200 OK\r\n") || !strings.HasSuffix(out, "\r\n\r\nonetwo") || strings.Contains(out, "chunked") {
		t.Errorf("HTTP/1.0 answer %q; want a close-delimited body", out)
	}
}

// An HTTP/1.0 client that asks to keep its connection (ab -k) keeps it for answers of a known
// length, told so by Connection: keep-alive; a stream's answer, delimited by the close, closes it
// whatever was asked, and so does a client that did not ask.
func TestHTTP10KeepAlive(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "one")
		if r.URL.Path == "/stream" {
			w.(http.Flusher).Flush()
			io.WriteString(w, "two")
		}
	}))
	c := dial(t, addr)
	defer c.Close()
	br := bufio.NewReader(c)
	for i := range 3 {
		io.WriteString(c, "POST /whole HTTP/1.0\r\nConnection: Keep-Alive\r\nContent-Length: 2\r\n\r\nhi")
		resp, body := readResponse(t, br, "POST")
		if resp.ProtoMinor != 0 || body != "one" || resp.Header.Get("Connection") != "keep-alive" || resp.ContentLength != 3 || resp.Close {
			t.Fatalf("answer %d: %s %v %q; want HTTP/1.0, kept alive, length 3", i, resp.Proto, resp.Header, body)
		}
	}
	io.WriteString(c, "GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	rest, _ := io.ReadAll(br)
	if out := string(rest); !strings.HasSuffix(out, "\r\n\r\nonetwo") || strings.Contains(out, "keep-alive") {
		t.Errorf("a stream to an HTTP/1.0 client %q; want its body delimited by the close", out)
	}
	out := exchange(t, addr, "GET /whole HTTP/1.0\r\n\r\n", 5*time.Second)
	if !strings.HasSuffix(out, "\r\n\r\none") || strings.Contains(out, "keep-alive") {
		t.Errorf("HTTP/1.0 without keep-alive %q; want the connection closed after the answer", out)
	}
}

// A body the handler left unread is read off a kept connection when small, and closes the
// connection when large.
func TestUnreadBodies(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	c := dial(t, addr)
	defer c.Close()
	br := bufio.NewReader(c)
	fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	for i := range 2 {
		if resp, body := readResponse(t, br, "GET"); body != "ok" || resp.Close {
			t.Errorf("#%d: %q close=%v", i, body, resp.Close)
		}
	}
	fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", 10<<20)
	if resp, _ := readResponse(t, br, "POST"); !resp.Close {
		t.Error("a 10 MB body left unread kept the connection")
	}
}

// Close ends the requests in flight: their contexts say why, and Close does not wait for them.
func TestCloseEndsRequestsInFlight(t *testing.T) {
	started, ended := make(chan struct{}), make(chan error, 1)
	s, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-r.Context().Done()
		ended <- context.Cause(r.Context())
	}))
	c := dial(t, addr)
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	<-started
	s.Close()
	select {
	case err := <-ended:
		if !errors.Is(err, errServerClosed) {
			t.Errorf("the request ended with %v, want %v", err, errServerClosed)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close left the request running")
	}
}

// Shutdown does not wait for a connection that never sent a request.
func TestShutdownClosesSilentConnections(t *testing.T) {
	s, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}),
		func(s *Server) { s.ReadHeaderTimeout = time.Minute })
	c := dial(t, addr)
	time.Sleep(50 * time.Millisecond) // accepted
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("the silent connection: %d bytes, %v; want it closed", n, err)
	}
}

// Many clients at once, each mixing whole answers, streams it leaves halfway, refused requests
// and pipelined pairs, then a shutdown: every answer read is whole and right, and the race
// detector sees the watcher, the handlers and Shutdown together.
func TestConcurrentClients(t *testing.T) {
	if !Supported() {
		t.Skip("SKIP: no epoll on this platform, so streams cannot notice clients leaving; Baton serves with net/http here")
	}
	var left atomic.Int64
	s, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/stream" {
			for i := 0; i < 50; i++ {
				fmt.Fprintf(w, "data: %d\n\n", i)
				w.(http.Flusher).Flush()
				select {
				case <-r.Context().Done():
					left.Add(1)
					return
				case <-time.After(time.Millisecond):
				}
			}
			return
		}
		w.Write(b)
	}))
	const clients, rounds = 32, 20
	errs := make(chan error, clients)
	for i := range clients {
		go func() {
			errs <- func() error {
				for j := range rounds {
					c, err := net.Dial("tcp", addr)
					if err != nil {
						return err
					}
					br := bufio.NewReader(c)
					switch j % 4 {
					case 0, 1: // two requests in one write, answered in order
						a, b := fmt.Sprintf("c%d-r%d-a", i, j), fmt.Sprintf("c%d-r%d-b", i, j)
						fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%sPOST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n", len(a), a, len(b), b)
						for _, want := range []string{a, b} {
							resp, err := http.ReadResponse(br, nil)
							if err != nil {
								c.Close()
								return err
							}
							got, err := io.ReadAll(resp.Body)
							if err != nil || string(got) != want {
								c.Close()
								return fmt.Errorf("got %q (%v), want %q", got, err, want)
							}
						}
					case 2: // a stream left after its first event
						io.WriteString(c, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
						resp, err := http.ReadResponse(br, nil)
						if err != nil {
							c.Close()
							return err
						}
						line, err := bufio.NewReader(resp.Body).ReadString('\n')
						if err != nil || line != "data: 0\n" {
							c.Close()
							return fmt.Errorf("first event %q, %v", line, err)
						}
					case 3: // refused
						io.WriteString(c, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n")
						resp, err := http.ReadResponse(br, nil)
						if err != nil || resp.StatusCode != 400 {
							c.Close()
							return fmt.Errorf("refusal: %v %v", resp, err)
						}
					}
					c.Close()
				}
				return nil
			}()
		}()
	}
	for range clients {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Errorf("Shutdown: %v", err)
	}
	// Each stream lasts 50 ms unless its client's leaving ends it; it leaves after one event.
	if streams := int64(clients * rounds / 4); left.Load() < streams*9/10 {
		t.Errorf("%d of %d streams noticed their client leaving", left.Load(), streams)
	}
}

// An open stream costs the server one goroutine, its handler's: no reader per request.
func TestOneGoroutinePerOpenStream(t *testing.T) {
	if !Supported() {
		t.Skip("SKIP: no epoll on this platform; Baton serves with net/http here")
	}
	release := make(chan struct{})
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		<-release
	}))
	defer close(release)
	warm := dial(t, addr) // the watcher and the accept loop are running before the count
	io.WriteString(warm, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
	before := runtime.NumGoroutine()
	const streams = 100
	for range streams {
		c := dial(t, addr)
		io.WriteString(c, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
		if _, err := http.ReadResponse(bufio.NewReader(c), nil); err != nil {
			t.Fatal(err)
		}
	}
	if per := float64(runtime.NumGoroutine()-before) / streams; per > 1.05 {
		t.Errorf("%.2f goroutines per open stream, want 1", per)
	}
}

// After a 101 it writes, the server closes the connection: the bytes that follow are another
// protocol's, never another request's head (a second, pipelined request gets no answer).
func TestCloseAfterSwitchingProtocols(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusSwitchingProtocols)
	}))
	got := exchange(t, addr, "GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n", 2*time.Second)
	if n := strings.Count(got, "HTTP/1.1 101"); n != 1 || strings.Count(got, "HTTP/1.1") != 1 {
		t.Errorf("after a 101 the connection answered more: %q", got)
	}
}

// Medium 8: a 1 MiB head of short header lines cost about 13 MB per connection, and nothing
// bounded the connections: a hundred sockets took 1.39 GB. A head is bounded to 64 KiB and 128
// fields (431), and connections past the cap are closed at arrival.
func TestHeadAndConnectionBounds(t *testing.T) {
	s, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}), func(s *Server) { s.MaxConns = 4 })
	many := "GET / HTTP/1.1\r\nHost: x\r\n" + strings.Repeat("A: b\r\n", DefaultMaxHeaders) + "\r\n"
	if got := exchange(t, addr, many, time.Second); !strings.HasPrefix(got, "HTTP/1.1 431") {
		t.Errorf("%d header fields: %.40q", DefaultMaxHeaders+1, got)
	}
	big := "GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + strings.Repeat("b", 70<<10) + "\r\n\r\n"
	if got := exchange(t, addr, big, time.Second); !strings.HasPrefix(got, "HTTP/1.1 431") {
		t.Errorf("a 70 KiB head: %.40q", got)
	}
	if got := exchange(t, addr, "GET / HTTP/1.1\r\nHost: x\r\n"+strings.Repeat("A: b\r\n", 20)+"\r\n", time.Second); !strings.HasPrefix(got, "HTTP/1.1 200") {
		t.Errorf("an ordinary head: %.40q", got)
	}
	// The exchanges' connections, closed by the client, are gone from the server's count before
	// the cap is filled (on a loaded machine the server sees the last close later).
	poll.Until(t, "the earlier connections closed", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.conns) == 0
	})
	var open []net.Conn
	for i := 0; i < 4; i++ {
		c := dial(t, addr)
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		br := bufio.NewReader(c)
		if line, _ := br.ReadString('\n'); !strings.HasPrefix(line, "HTTP/1.1 200") {
			t.Fatalf("connection %d: %q", i, line)
		}
		open = append(open, c)
	}
	extra := dial(t, addr)
	extra.SetReadDeadline(time.Now().Add(2 * time.Second))
	io.WriteString(extra, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if n, err := extra.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Errorf("a connection past the cap was served: %d %v", n, err)
	}
	if s.Refused.Load() != 1 {
		t.Errorf("refused %d", s.Refused.Load())
	}
	_ = open
}

// An answer given before the request body was read (a 413 for a body too large) reaches a
// client that goes on sending its body to the end before it reads: the server closes its side
// and discards what still arrives for a while, instead of resetting the connection — a reset
// destroys the answer in the client's receive buffer.
func TestAnswerBeforeTheBodySurvivesTheClose(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "close")
		w.WriteHeader(http.StatusRequestEntityTooLarge)
	}))
	c := dial(t, addr)
	defer c.Close()
	body := bytes.Repeat([]byte("x"), 4<<20)
	fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", len(body))
	if _, err := c.Write(body); err != nil {
		t.Fatalf("the server reset the connection while the client sent its body: %v", err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("the answer did not survive: %v", err)
	}
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("status %d", resp.StatusCode)
	}
}

// A connection holds a read buffer only while it reads: not while its client, kept alive,
// sends nothing, nor before its first request, nor while its handler streams an answer.
func TestIdleConnectionsHoldNoBuffer(t *testing.T) {
	if !Supported() {
		t.Skip("SKIP: no epoll on this platform; Baton serves with net/http here")
	}
	release := make(chan struct{})
	defer close(release)
	s, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "data: 1\n\n")
		if r.URL.Path == "/stream" {
			w.(http.Flusher).Flush()
			<-release
		}
	}))
	for i := range 30 {
		c := dial(t, addr)
		switch i % 3 {
		case 0: // kept alive after its answer
			io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
		case 1: // streaming
			io.WriteString(c, "POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
		case 2: // connected, nothing sent yet
			continue
		}
		if _, err := http.ReadResponse(bufio.NewReader(c), nil); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.buffers.Load() != 0 || s.writeBuffers.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d read buffers and %d answer buffers held by 30 connections that read nothing and have nothing to send", s.buffers.Load(), s.writeBuffers.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	// And each still serves its next request.
	c := dial(t, addr)
	for range 2 {
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if b, _ := io.ReadAll(resp.Body); string(b) != "data: 1\n\n" {
			t.Fatalf("answer %q", b)
		}
	}
}

// A stream's head, once sent, is not held while the stream stays open: the handler's header
// map (and every value in it) is garbage until the answer ends.
func TestAnOpenStreamHoldsNotItsHead(t *testing.T) {
	release, sent := make(chan struct{}), make(chan weak.Pointer[byte], 1)
	defer close(release)
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		v := strings.Repeat("v", 4096)
		w.Header().Set("X-Large", v)
		sent <- weak.Make(unsafe.StringData(v))
		io.WriteString(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		<-release
		w.Header().Set("X-After", "has no effect, and no panic")
	}))
	c := dial(t, addr)
	io.WriteString(c, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Header.Get("X-Large")) != 4096 {
		t.Fatalf("the head lacks its header: %v", resp.Header)
	}
	held := <-sent
	for range 3 {
		runtime.GC()
	}
	if held.Value() != nil {
		t.Error("an open stream holds the header map of its head, sent already")
	}
}

// A client that half-closes after its request is taken as gone (its request ends, as nginx
// ends one with 499): a handler that then returns without an answer gets none made up for it —
// no empty 200 that would pass for a success — and the connection closes.
func TestAClientGoneGetsNoMadeUpAnswer(t *testing.T) {
	if !Supported() {
		t.Skip("SKIP: no epoll on this platform; Baton serves with net/http here")
	}
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
			io.WriteString(w, "the client's leaving was not noticed")
		}
	}))
	c := dial(t, addr)
	io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatal(err)
	}
	if len(got) > 0 {
		t.Errorf("a client gone was answered %q", got)
	}
}

// A handler that answers first and reads its body afterwards, on another goroutine while it
// writes: no 100 Continue is sent once the answer has begun (it would land inside it), and the
// two goroutines never write to the connection at once (the race detector watches the writer).
func TestNoContinueInsideAnAnswer(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		read := make(chan string)
		go func() { b, _ := io.ReadAll(r.Body); read <- string(b) }()
		for i := range 20 {
			fmt.Fprintf(w, "part %d;", i)
			w.(http.Flusher).Flush()
		}
		fmt.Fprintf(w, "body %q", <-read)
	}))
	c := dial(t, addr)
	defer c.Close()
	br := bufio.NewReader(c)
	io.WriteString(c, "POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if line, err := br.ReadString('\n'); err != nil || line != "HTTP/1.1 200 OK\r\n" {
		t.Fatalf("the answer begins with %q, %v", line, err)
	}
	io.WriteString(c, "ping") // the client's wait for a 100 ended with the answer
	var want strings.Builder
	for i := range 20 {
		fmt.Fprintf(&want, "part %d;", i)
	}
	want.WriteString(`body "ping"`)
	resp, err := http.ReadResponse(bufio.NewReader(io.MultiReader(strings.NewReader("HTTP/1.1 200 OK\r\n"), br)), nil)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(resp.Body); err != nil || string(b) != want.String() {
		t.Errorf("answer %q, %v; want %q", b, err, want.String())
	}
}

// Every request on a kept-alive connection that asks for a 100 Continue gets it when its body is
// read, the ones after an answered request too.
func TestEachRequestGetsItsContinue(t *testing.T) {
	_, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Write(b)
	}))
	c := dial(t, addr)
	defer c.Close()
	br := bufio.NewReader(c)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	for i := range 3 {
		io.WriteString(c, "POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
		if line, err := br.ReadString('\n'); err != nil || line != "HTTP/1.1 100 Continue\r\n" {
			t.Fatalf("request %d, before its body: %q, %v", i, line, err)
		}
		if l, _ := br.ReadString('\n'); l != "\r\n" {
			t.Fatalf("request %d: 100 Continue ends with %q", i, l)
		}
		fmt.Fprintf(c, "pin%d", i)
		if _, body := readResponse(t, br, "POST"); body != fmt.Sprintf("pin%d", i) {
			t.Errorf("request %d: echo %q", i, body)
		}
	}
}
