package h1

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"

	"github.com/baton-llm/baton/internal/httpwire"
)

// fakeConn reads a fixed input and collects what is written (a 100 Continue).
type fakeConn struct {
	net.Conn
	r io.Reader
	w bytes.Buffer
}

func (f *fakeConn) Read(p []byte) (int, error)  { return f.r.Read(p) }
func (f *fakeConn) Write(p []byte) (int, error) { return f.w.Write(p) }

// FuzzRequest parses arbitrary bytes as a connection's requests. The parser must never panic or
// read past its input, refusals must carry a client-error status, and a request it accepts
// must be one net/http's own parser accepts with the same method, target, host, length and body
// (a body may be refused where net/http is more lenient, never the other way).
func FuzzRequest(f *testing.F) {
	for _, seed := range []string{
		"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
		"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
		"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3;e=1\r\nabc\r\n0\r\nT: 1\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi",
		"GET http://h:1/p?q=1 HTTP/1.0\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: x\r\nX-A: b\tc\r\n\r\nGET /2 HTTP/1.1\r\nHost: y\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nz",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		fc := &fakeConn{r: bytes.NewReader(data)}
		c := &conn{s: &Server{MaxHeaderBytes: 4096}, rwc: fc, remoteAddr: "192.0.2.1:1", src: httpwire.Source{Conn: fc}}
		c.out.Init(fc, nil)
		c.br = bufio.NewReaderSize(fc, readBufSize)
		ref := bufio.NewReader(bytes.NewReader(data))
		for range 4 {
			req, b, err := c.readRequest()
			if err != nil {
				var he *Refusal
				if errors.As(err, &he) {
					if he.Status < 400 || he.Status > 505 || he.Message == "" {
						t.Fatalf("refusal %+v", he)
					}
				} else if !errors.Is(err, errClosed) {
					t.Fatalf("error %v is neither a refusal nor a closed connection", err)
				}
				return
			}
			body, berr := io.ReadAll(req.Body)
			if len(body) > len(data) {
				t.Fatalf("read %d body bytes from %d input bytes", len(body), len(data))
			}
			if !httpwire.IsToken(req.Method) || req.URL == nil {
				t.Fatalf("accepted a malformed request: %q %v host %q", req.Method, req.URL, req.Host)
			}
			want, rerr := http.ReadRequest(ref)
			if rerr != nil {
				t.Fatalf("accepted what net/http refuses (%v): %q", rerr, data)
			}
			wantBody, werr := io.ReadAll(want.Body)
			if want.Method != req.Method || want.RequestURI != req.RequestURI || want.Host != req.Host ||
				want.ContentLength != req.ContentLength || (berr == nil && werr != nil) || (berr == nil && !bytes.Equal(body, wantBody)) {
				t.Fatalf("got %s %s host %q length %d body %q (%v); net/http: %s %s host %q length %d body %q (%v)",
					req.Method, req.RequestURI, req.Host, req.ContentLength, body, berr,
					want.Method, want.RequestURI, want.Host, want.ContentLength, wantBody, werr)
			}
			if berr != nil || b.expect {
				return
			}
			b.done.Store(true)
		}
	})
}
