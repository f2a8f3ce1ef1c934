package h1

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// readAhead is a listener's connection that reads ahead of the server on a goroutine of its own
// (a PROXY-protocol sniffer, a metering wrapper): the socket's bytes reach the server through it.
type readAhead struct {
	*net.TCPConn
	pr *io.PipeReader
}

func (r *readAhead) Read(p []byte) (int, error) { return r.pr.Read(p) }

type readAheadListener struct{ net.Listener }

func (l readAheadListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	pr, pw := io.Pipe()
	go func() { _, err := io.Copy(pw, c); pw.CloseWithError(err) }()
	return &readAhead{TCPConn: c.(*net.TCPConn), pr: pr}, nil
}

// A connection the listener wraps, though it is a TCP socket underneath (syscall.Conn through its
// embedded *net.TCPConn), waits for its next request through its own Read: a wait that read the
// socket itself would race the wrapper for the next request's bytes, and lose it — the request
// went unanswered until the idle timeout.
func TestAWrappedConnectionWaitsThroughItsOwnRead(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, r.URL.Path) })}
	go s.Serve(readAheadListener{ln})
	t.Cleanup(func() { s.Close() })
	c := dial(t, ln.Addr().String())
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	br := bufio.NewReader(c)
	for _, want := range []string{"/one", "/two"} {
		io.WriteString(c, "GET "+want+" HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("waiting for the answer to %s: %v", want, err)
		}
		b, _ := io.ReadAll(resp.Body)
		if string(b) != want {
			t.Errorf("answer %q, want %q", b, want)
		}
	}
}
