package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
)

// wireTransport is the hotpath scenario's load generator's transport: each request is written
// on a kept-alive connection by net/http's Request.Write and its answer read by
// http.ReadResponse — net/http's own wire code, without the Transport's connection pool, its
// reader and writer goroutines per connection and the hand-offs between them. The load
// generator shares a core with the simulated engines, and at the PD path's rates that core, not
// the proxy under test, bounded the rows; this one sends the same bytes for less of it.
//
// A connection goes back to the pool only after its answer was read to the end without error
// and neither side asked to close; anything else closes it. A request that finds a kept-alive
// connection closed before any answer byte came is sent once more on a new one, as net/http's
// Transport does for a connection the server closed while idle.
type wireTransport struct {
	mu   sync.Mutex
	idle map[string][]*wireConn // by host:port
}

type wireConn struct {
	c  net.Conn
	br *bufio.Reader
	bw *bufio.Writer
}

func newWireTransport() *wireTransport {
	return &wireTransport{idle: map[string][]*wireConn{}}
}

// RoundTrip sends req on an idle connection to its host, or a new one.
func (t *wireTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme != "http" {
		return nil, fmt.Errorf("wire transport: scheme %q: only http", req.URL.Scheme)
	}
	if req.Body != nil && req.GetBody == nil {
		return nil, errors.New("wire transport: a body that cannot be sent again")
	}
	host := req.URL.Host
	if req.URL.Port() == "" {
		host = net.JoinHostPort(req.URL.Hostname(), "80")
	}
	if c := t.take(host); c != nil {
		resp, err := t.exchange(req, host, c)
		if err == nil || !errors.Is(err, errClosedBeforeAnswer) {
			return resp, err
		}
		if req.Body != nil { // the kept-alive connection had been closed: send it again
			body, err := req.GetBody()
			if err != nil {
				return nil, err
			}
			req = req.Clone(req.Context())
			req.Body = body
		}
	}
	c, err := (&net.Dialer{}).DialContext(req.Context(), "tcp", host)
	if err != nil {
		return nil, err
	}
	return t.exchange(req, host, &wireConn{c: c, br: bufio.NewReaderSize(c, 16<<10), bw: bufio.NewWriterSize(c, 4<<10)})
}

// errClosedBeforeAnswer is a kept-alive connection that ended before its answer's first byte.
var errClosedBeforeAnswer = errors.New("connection closed before the answer")

func (t *wireTransport) exchange(req *http.Request, host string, c *wireConn) (*http.Response, error) {
	stop := context.AfterFunc(req.Context(), func() { c.c.Close() })
	fail := func(err error) (*http.Response, error) {
		stop()
		c.c.Close()
		if ctxErr := req.Context().Err(); ctxErr != nil {
			return nil, ctxErr
		}
		return nil, err
	}
	if err := req.Write(c.bw); err != nil {
		return fail(err)
	}
	if err := c.bw.Flush(); err != nil {
		return fail(err)
	}
	if _, err := c.br.Peek(1); err != nil {
		return fail(fmt.Errorf("%w: %w", errClosedBeforeAnswer, err))
	}
	resp, err := http.ReadResponse(c.br, req)
	if err != nil {
		return fail(err)
	}
	keep := !resp.Close && !req.Close
	resp.Body = &wireBody{ReadCloser: resp.Body, ctx: req.Context(), done: func(clean bool) {
		if !stop() || !clean || !keep {
			c.c.Close()
			return
		}
		t.put(host, c)
	}}
	return resp, nil
}

func (t *wireTransport) take(host string) *wireConn {
	t.mu.Lock()
	defer t.mu.Unlock()
	cs := t.idle[host]
	if len(cs) == 0 {
		return nil
	}
	c := cs[len(cs)-1]
	t.idle[host] = cs[:len(cs)-1]
	return c
}

func (t *wireTransport) put(host string, c *wireConn) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.idle[host] = append(t.idle[host], c)
}

// CloseIdleConnections closes every kept-alive connection.
func (t *wireTransport) CloseIdleConnections() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for host, cs := range t.idle {
		for _, c := range cs {
			c.c.Close()
		}
		delete(t.idle, host)
	}
}

// wireBody is an answer's body: when it is closed, its connection is given back if the body was
// read to its end without error (Close reads what is left), else closed.
type wireBody struct {
	io.ReadCloser
	ctx     context.Context // the request's: a read it ended says so
	done    func(clean bool)
	failed  bool // a read failed
	settled bool // done was called
}

func (b *wireBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil && err != io.EOF {
		b.failed = true
		if ctxErr := b.ctx.Err(); ctxErr != nil {
			err = ctxErr
		}
	}
	return n, err
}

func (b *wireBody) Close() error {
	err := b.ReadCloser.Close() // net/http's body: reads what is left of it before it returns
	if !b.settled {
		b.settled = true
		b.done(err == nil && !b.failed)
	}
	return err
}
