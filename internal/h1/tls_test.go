package h1

import (
	"bufio"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// heldWrites is a client connection whose writes, while held, gather and leave in one write.
type heldWrites struct {
	net.Conn
	hold bool
	buf  []byte
}

func (c *heldWrites) Write(p []byte) (int, error) {
	if c.hold {
		c.buf = append(c.buf, p...)
		return len(p), nil
	}
	return c.Conn.Write(p)
}

func (c *heldWrites) release() error {
	c.hold = false
	_, err := c.Conn.Write(c.buf)
	return err
}

// testCert is the standard library's test certificate (httptest's), for a TLS listener.
func testCert(t *testing.T) tls.Certificate {
	srv := httptest.NewTLSServer(http.NotFoundHandler())
	defer srv.Close()
	return srv.TLS.Certificates[0]
}

// Two pipelined requests over TLS, each in its own TLS record, arriving in one TCP segment: the
// TLS layer reads both records off the socket while the first request is read, so the wait for
// the next request must look at what the TLS connection holds, not at the socket beneath it
// (which has nothing more to say): both are answered, in order.
func TestPipelinedRequestsOverTLS(t *testing.T) {
	if !Supported() {
		t.Skip("SKIP: no epoll on this platform; Baton serves with net/http here")
	}
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := tls.NewListener(inner, &tls.Config{Certificates: []tls.Certificate{testCert(t)}})
	s := &Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, r.URL.Path)
	}), IdleTimeout: 3 * time.Second}
	done := make(chan error, 1)
	go func() { done <- s.Serve(ln) }()
	defer func() {
		s.Close()
		if err := <-done; !errors.Is(err, ErrServerClosed) {
			t.Errorf("Serve: %v", err)
		}
	}()
	raw, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	hw := &heldWrites{Conn: raw}
	c := tls.Client(hw, &tls.Config{InsecureSkipVerify: true})
	if err := c.Handshake(); err != nil {
		t.Fatal(err)
	}
	hw.hold = true
	io.WriteString(c, "GET /one HTTP/1.1\r\nHost: x\r\n\r\n") // one record
	io.WriteString(c, "GET /two HTTP/1.1\r\nHost: x\r\n\r\n") // another
	if err := hw.release(); err != nil {                      // both in one TCP write
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	br := bufio.NewReader(c)
	for _, want := range []string{"/one", "/two"} {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("answer to %s: %v", want, err)
		}
		b, _ := io.ReadAll(resp.Body)
		if string(b) != want {
			t.Fatalf("answer %q, want %q", b, want)
		}
	}
}
