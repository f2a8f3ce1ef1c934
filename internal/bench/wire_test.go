package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/gwtest"
)

// countingServer is an httptest server that counts the connections its clients opened.
func countingServer(t *testing.T, h http.HandlerFunc) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var conns atomic.Int64
	s := httptest.NewUnstartedServer(h)
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			conns.Add(1)
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s, &conns
}

// The load generator's transport gets each request its own answer, keeps connections alive
// across requests, and closes one when the server asks.
func TestWireTransportKeepsConnectionsAndAnswers(t *testing.T) {
	var n atomic.Int64
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if n.Add(1)%5 == 0 {
			w.Header().Set("Connection", "close")
		}
		if strings.HasPrefix(string(body), "chunked") {
			w.Write([]byte("echo: "))
			w.(http.Flusher).Flush() // no length: the answer is chunked
		} else {
			w.Header().Set("Content-Length", fmt.Sprint(len("echo: ")+len(body)))
			w.Write([]byte("echo: "))
		}
		w.Write(body)
	})
	wt := newWireTransport()
	defer wt.CloseIdleConnections()
	client := &http.Client{Transport: wt}
	const clients, each = 4, 50
	var wg sync.WaitGroup
	errs := make(chan error, clients*each)
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				body := fmt.Sprintf("client %d request %d", c, i)
				if i%3 == 0 {
					body = "chunked " + body
				}
				status, got, r := post(context.Background(), client, s.URL+"/v1/completions", []byte(body), nil)
				if r.Err != nil || status != 200 || string(got) != "echo: "+body {
					errs <- fmt.Errorf("%q: status %d, %q, %v", body, status, got, r.Err)
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Every fifth answer closes its connection: about 40 of 200, plus the first four.
	if got := conns.Load(); got < clients*each/5 || got > clients*each/5+2*clients {
		t.Errorf("%d connections for %d requests, every fifth answer closing its own", got, clients*each)
	}
}

// A kept-alive connection the server closed while it was idle costs the request nothing: it is
// sent again on a new connection. A connection whose answer was cut short, or whose request was
// cancelled, is never used again.
func TestWireTransportSendsAgainOnlyWhatNoAnswerBegan(t *testing.T) {
	var mode atomic.Value // what the engine does with the next request
	mode.Store("close-after-answer")
	base := gwtest.SocketEngine(t, func(c net.Conn, req *http.Request) bool {
		io.Copy(io.Discard, req.Body)
		switch mode.Load() {
		case "close-after-answer": // keeps alive, then closes while idle
			fmt.Fprint(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			time.Sleep(20 * time.Millisecond)
		case "short":
			fmt.Fprint(c, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nok")
		case "slow":
			fmt.Fprint(c, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nok")
			time.Sleep(time.Second)
		}
		return false
	})
	wt := newWireTransport()
	defer wt.CloseIdleConnections()
	client := &http.Client{Transport: wt}
	url := base + "/v1/completions"
	for i := range 3 {
		status, got, r := post(context.Background(), client, url, []byte("{}"), nil)
		if r.Err != nil || status != 200 || string(got) != "ok" {
			t.Fatalf("request %d on a connection closed while idle: status %d, %q, %v", i, status, got, r.Err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	mode.Store("short")
	if _, _, r := post(context.Background(), client, url, []byte("{}"), nil); r.Err == nil {
		t.Fatal("an answer cut short read as whole")
	}
	if idle := wt.idleCount(); idle != 0 {
		t.Fatalf("%d connections kept after an answer cut short", idle)
	}
	mode.Store("slow")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, _, r := post(ctx, client, url, []byte("{}"), nil); !errors.Is(r.Err, context.DeadlineExceeded) {
		t.Fatalf("a request cancelled mid-answer: %v", r.Err)
	}
	if idle := wt.idleCount(); idle != 0 {
		t.Fatalf("%d connections kept after a cancelled request", idle)
	}
}

func (t *wireTransport) idleCount() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, cs := range t.idle {
		n += len(cs)
	}
	return n
}
