package upstream

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/httpwire"
)

// Bodies of every framing arrive byte-exact through Next when the engine writes them a byte at a
// time, and a connection read to its end is reused for the next request with nothing stray.
func TestBodiesByteExactWhenWrittenByteByByte(t *testing.T) {
	payload := "data: {\"x\":\"héllo\"}\n\n" + strings.Repeat("0123456789", 30)
	var conns atomic.Int64
	url := rawServer(t, func(c net.Conn, br *bufio.Reader) {
		conns.Add(1)
		for {
			req, err := readReq(br)
			if err != nil {
				return
			}
			switch req {
			case "/length":
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n", len(payload))
				gwtest.Trickle(c, payload, 200*time.Microsecond)
			case "/chunked":
				var b strings.Builder
				b.WriteString("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
				for i := 0; i < len(payload); i += 37 {
					part := payload[i:min(i+37, len(payload))]
					fmt.Fprintf(&b, "%x;ext=1\r\n%s\r\n", len(part), part)
				}
				b.WriteString("0\r\nX-Trailer: t\r\n\r\n")
				gwtest.Trickle(c, b.String(), 200*time.Microsecond)
			case "/close":
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
				gwtest.Trickle(c, payload, 200*time.Microsecond)
				return
			}
		}
	})
	tr := newT()
	for _, path := range []string{"/length", "/chunked", "/length", "/chunked", "/close", "/length"} {
		resp, err := send(t, tr, context.Background(), url+path, "{}")
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		got, err := readViewsErr(resp.Body)
		resp.Body.Close()
		if err != nil || string(got) != payload {
			t.Fatalf("%s: %v, %d bytes; want %d exact", path, err, len(got), len(payload))
		}
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("%d connections for two runs of kept answers split by one closed: want 2", n)
	}
}

// readReq reads one request off br and returns its path.
func readReq(br *bufio.Reader) (string, error) {
	line, err := br.ReadString('\n')
	if err != nil {
		return "", err
	}
	path := strings.Fields(line)[1]
	n := 0
	for {
		l, err := br.ReadString('\n')
		if err != nil {
			return "", err
		}
		if l == "\r\n" {
			break
		}
		if k, v, ok := strings.Cut(l, ":"); ok && strings.EqualFold(k, "Content-Length") {
			fmt.Sscan(strings.TrimSpace(v), &n)
		}
	}
	_, err = io.CopyN(io.Discard, br, int64(n))
	return path, err
}

// An engine that resets its connection mid-stream, in a wait between two events, is an error of
// the relay — never the clean end of a body delimited by the close, nor an unexpected EOF.
func TestResetMidStreamIsAnError(t *testing.T) {
	for _, framing := range []string{"close", "chunked", "length"} {
		t.Run(framing, func(t *testing.T) {
			url := rawServer(t, func(c net.Conn, br *bufio.Reader) {
				readReq(br)
				switch framing {
				case "close":
					io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\n")
				case "chunked":
					io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
				case "length":
					io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ndata: 1\n\n")
				}
				time.Sleep(50 * time.Millisecond)
				c.(*net.TCPConn).SetLinger(0)
				c.Close()
			})
			resp, err := send(t, newT(), context.Background(), url, "{}")
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			got, err := readViewsErr(resp.Body)
			if string(got) != "data: 1\n\n" || !errors.Is(err, syscall.ECONNRESET) {
				t.Errorf("%q, %v; want the first event and ECONNRESET", got, err)
			}
		})
	}
}

// Bytes an engine sends after an answer read to its end — arriving in a later wait, after the
// relay finished — keep the connection from the next request: the next answer is the engine's
// answer to it, not the stray bytes.
func TestStrayBytesAfterAnAnswerAreNeverTheNextAnswer(t *testing.T) {
	var n atomic.Int64
	url := rawServer(t, func(c net.Conn, br *bufio.Reader) {
		for {
			if _, err := readReq(br); err != nil {
				return
			}
			i := n.Add(1)
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nans%d", i)
			time.Sleep(20 * time.Millisecond)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray")
		}
	})
	tr := newT()
	for i := 1; i <= 3; i++ {
		resp, err := send(t, tr, context.Background(), url, "{}")
		if err != nil {
			t.Fatal(err)
		}
		got, err := readViewsErr(resp.Body)
		resp.Body.Close()
		if err != nil || !strings.HasPrefix(string(got), "ans") {
			t.Fatalf("answer %d: %q %v", i, got, err)
		}
		time.Sleep(40 * time.Millisecond)
	}
}

// Requests waiting for their answers hold no buffer: the request's write buffer went back once it
// was written, and the wait for the answer's head takes a read buffer only when bytes came — a
// non-streamed answer can take an engine minutes, and hundreds wait at once.
func TestWaitingForAnAnswerHoldsNoBuffer(t *testing.T) {
	if !httpwire.Awaits {
		t.Skip("SKIPPED: on this platform a read waits with its buffer (httpwire.Awaits is false); Linux, where CI runs, waits without")
	}
	const waiting = 200
	got, release := make(chan struct{}, waiting), make(chan struct{})
	url := rawServer(t, func(c net.Conn, br *bufio.Reader) {
		for {
			path, err := readReq(br)
			if err != nil {
				return
			}
			if path != "/warm" {
				got <- struct{}{}
				<-release
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	tr := newT()
	for range 4 { // the pools' first buffers, made before counting
		if resp, err := send(t, tr, context.Background(), url+"/warm", "{}"); err == nil {
			io.ReadAll(resp.Body)
			resp.Body.Close()
		}
	}
	errs := make(chan error, waiting)
	out := buffersOut.Load()
	for range waiting { // one at a time: each is written and waiting before the next starts
		go func() {
			resp, err := send(t, tr, context.Background(), url+"/wait", `{"prompt":"x"}`)
			if err == nil {
				var b []byte
				b, err = io.ReadAll(resp.Body)
				resp.Body.Close()
				if err == nil && string(b) != "ok" {
					err = fmt.Errorf("answer %q", b)
				}
			}
			errs <- err
		}()
		<-got
	}
	held := buffersOut.Load() - out
	for deadline := time.Now().Add(2 * time.Second); held != 0 && time.Now().Before(deadline); held = buffersOut.Load() - out {
		time.Sleep(time.Millisecond) // the last request, read by the engine, may not be waiting yet
	}
	close(release)
	for range waiting {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if held != 0 {
		t.Errorf("%d buffers held while %d requests waited for their answers; want none", held, waiting)
	}
}

// An engine that closes only its sending side of an idle connection, and still reads, has the
// connection found stray before the next request is written on it: that request goes on a fresh
// connection instead of waiting for an answer the half-closed one can never bring.
func TestAnIdleConnectionHalfClosedIsNotUsed(t *testing.T) {
	var conns atomic.Int64
	url := rawServer(t, func(c net.Conn, br *bufio.Reader) {
		n := conns.Add(1)
		for {
			if _, err := readReq(br); err != nil {
				return
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			if n == 1 {
				c.(*net.TCPConn).CloseWrite()
				io.Copy(io.Discard, br) // still reading: a request written here is never answered
				return
			}
		}
	})
	tr := newT()
	for i := range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		resp, err := send(t, tr, ctx, url, "{}")
		if err != nil {
			cancel()
			t.Fatalf("request %d: %v", i, err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		cancel()
		if string(b) != "ok" || err != nil {
			t.Fatalf("request %d: %q, %v", i, b, err)
		}
		time.Sleep(20 * time.Millisecond) // the engine's end has arrived, its wake-up spent
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("%d connections; want the half-closed one left for a second", n)
	}
}

// A request never takes a connection whose last request carried the same X-Request-Id (a client
// that sends one id with several requests): a late duplicate of that answer would be named like
// this one's. Such a connection stays for requests with other ids; without ids, reuse is as ever.
func TestARequestIDIsNeverSentTwiceInARowOnAConnection(t *testing.T) {
	var mu sync.Mutex
	var seen []string // "<connection>:<id>" for every request, in order
	var conns atomic.Int64
	url := rawServer(t, func(c net.Conn, br *bufio.Reader) {
		n := conns.Add(1)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			io.Copy(io.Discard, req.Body)
			mu.Lock()
			seen = append(seen, fmt.Sprintf("%d:%s", n, req.Header.Get("X-Request-Id")))
			mu.Unlock()
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	tr := newT()
	defer tr.CloseIdleConnections()
	for _, id := range []string{"same", "same", "other", "same", "", ""} {
		req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader("{}"))
		if id != "" {
			req.Header.Set("X-Request-Id", id)
		}
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	mu.Lock()
	defer mu.Unlock()
	// The second "same" takes a new connection; "other" reuses the last one; the third "same"
	// goes where "other" went; requests without an id reuse it too.
	if want := []string{"1:same", "2:same", "2:other", "2:same", "2:", "2:"}; !slices.Equal(seen, want) {
		t.Errorf("requests by connection %v, want %v", seen, want)
	}
}
