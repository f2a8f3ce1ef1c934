package h1

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/baton-llm/baton/internal/httpwire"
)

// Connection states, for Shutdown: only an idle connection (waiting for its next request) is
// closed under a client's feet.
const (
	stateActive int32 = iota
	stateIdle
	stateClosed
)

// readBufSize is the request reader's buffer: a request line or header longer than it is still
// read (gathered), up to MaxHeaderBytes.
const readBufSize = 4 << 10

var readers = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, readBufSize) }}

// errPeerGone is the cause a request's context ends with when its client went away.
var errPeerGone = errors.New("client closed the connection")

// conn is one client connection.
type conn struct {
	s          *Server
	rwc        net.Conn
	remoteAddr string
	br         *bufio.Reader   // nil while the connection holds no unread bytes and reads nothing
	src        httpwire.Source // what br reads: rwc, or the descriptor while waiting without a buffer
	state      atomic.Int32
	watchID    uint64          // the epoll watcher's name for this connection; 0: not watched
	raw        syscall.RawConn // the watched descriptor
	out        httpwire.Writer // writes to rwc, or to raw's descriptor where rwc is that bare socket

	mu     sync.Mutex
	cancel context.CancelCauseFunc // the current request's; nil between requests
	ended  error                   // why the connection ended under its requests (errPeerGone, errServerClosed); nil: it did not

	wmu      sync.Mutex // out's: a handler may read its body (and so owe a 100 Continue) on another goroutine than the one writing its answer
	answered bool       // under wmu: the answer's first bytes were written; no 100 Continue may follow them

	werr      error       // the first write error: the connection is done
	wdlSet    atomic.Bool // a write deadline was set during the request
	rdlSet    atomic.Bool // a read deadline was set during the request
	firstDone bool        // a request was served: the next wait is an idle one
}

func newConn(s *Server, rw net.Conn) *conn {
	c := &conn{s: s, rwc: rw, remoteAddr: rw.RemoteAddr().String()}
	c.src = httpwire.Source{Conn: rw, Take: c.reader, Give: c.dropReader}
	c.out.Init(rw, nil)
	c.state.Store(stateIdle) // waiting for its first request: Shutdown may close it
	return c
}

// errServerClosed is the cause a request's context ends with when Close cut its connection.
var errServerClosed = errors.New("the server closed the connection")

// abort closes the connection from another goroutine: a read or write in progress fails, and
// the request being served, if any, sees its context end.
func (c *conn) abort() {
	c.rwc.Close()
	c.end(errServerClosed)
}

// gone is the watcher telling the connection its client closed its side: the request being
// served, if any, ends.
func (c *conn) gone() { c.end(errPeerGone) }

// end records why the connection ended (the first cause stays) and ends the request being
// served with it; a request read later starts ended.
func (c *conn) end(cause error) {
	c.mu.Lock()
	if c.ended == nil {
		c.ended = cause
	}
	cause, cancel := c.ended, c.cancel
	c.mu.Unlock()
	if cancel != nil {
		cancel(cause)
	}
}

func (c *conn) serve() {
	defer c.s.forget(c)
	defer func() {
		c.s.watcher().remove(c)
		c.rwc.Close()
		c.dropReader()
	}()
	c.s.watcher().add(c)
	if c.raw != nil && bareSocket(c.rwc) {
		c.out.Init(c.rwc, c.raw)
	}
	for {
		if !c.waitRequest() {
			return
		}
		if !c.serveOne() {
			return
		}
	}
}

// waitRequest waits for the first byte of the next request: idle, so that Shutdown may close
// the connection, bounded by the idle (or, first, the header) timeout, and without a read
// buffer where the descriptor can be watched.
func (c *conn) waitRequest() bool {
	wait := c.s.ReadHeaderTimeout
	if c.firstDone {
		wait = c.s.idleTimeout()
		if !c.state.CompareAndSwap(stateActive, stateIdle) {
			return false
		}
	}
	if c.s.shutdown.Load() && c.firstDone {
		return false
	}
	if wait > 0 {
		_ = c.rwc.SetReadDeadline(time.Now().Add(wait))
	} else if c.rdlSet.Swap(false) {
		_ = c.rwc.SetReadDeadline(time.Time{})
	}
	// Nothing buffered: the wait holds no read buffer, so a kept-alive connection between two
	// requests costs none — where the connection is the watched socket itself (over TLS it may
	// hold decrypted bytes the socket no longer has: it waits with its buffer).
	c.releaseReader()
	if httpwire.Awaits && c.br == nil && c.raw != nil && bareSocket(c.rwc) {
		if httpwire.FillWaiting(c.raw, &c.src) != nil {
			return false
		}
	}
	if br := c.reader(); br.Buffered() == 0 {
		if _, err := br.Peek(1); err != nil {
			return false
		}
	}
	if !c.state.CompareAndSwap(stateIdle, stateActive) {
		return false // Shutdown closed it
	}
	if c.s.ReadHeaderTimeout > 0 && c.firstDone {
		_ = c.rwc.SetReadDeadline(time.Now().Add(c.s.ReadHeaderTimeout))
	}
	return true
}

// bareSocket reports whether rwc is the socket itself, with nothing buffered above it that a
// read of its descriptor would overtake (a TLS connection's decrypted records, a listener's own
// wrapper that reads ahead).
func bareSocket(rwc net.Conn) bool {
	switch rwc.(type) {
	case *net.TCPConn, *net.UnixConn:
		return true
	}
	return false
}

// serveOne reads one request, runs the handler on it, and finishes its answer; false means
// the connection is done.
func (c *conn) serveOne() bool {
	c.firstDone = true
	req, b, herr := c.readRequest()
	if herr != nil {
		c.refuse(herr)
		return false
	}
	if c.s.ReadHeaderTimeout > 0 || c.s.IdleTimeout > 0 {
		_ = c.rwc.SetReadDeadline(time.Time{})
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	c.mu.Lock()
	ended := c.ended
	c.cancel = cancel
	c.mu.Unlock()
	if ended != nil {
		cancel(ended)
	}
	req = req.WithContext(ctx)
	c.wmu.Lock()
	c.answered = false
	c.wmu.Unlock()
	w := newResponse(c, req, b)
	if b.eof {
		c.releaseReader()
	}
	c.runHandler(w, req)
	if !w.wroteHeader && errors.Is(context.Cause(ctx), errPeerGone) {
		// The client left before any answer was decided: none is made up for it (an empty 200
		// would pass for a success); the connection closes.
		w.aborted, w.closeAfter = true, true
	}
	w.finish()
	c.mu.Lock()
	c.cancel = nil
	c.mu.Unlock()
	cancel(context.Canceled)
	b.done.Store(true)
	if c.wdlSet.Swap(false) {
		_ = c.rwc.SetWriteDeadline(time.Time{})
	}
	if w.closeAfter || c.werr != nil || !b.drain(c) {
		if !b.eof && b.err == nil && c.werr == nil && !w.aborted {
			c.linger()
		}
		return false
	}
	return true
}

// lingerTime and lingerBytes bound how long and how much of a request body left unread the
// server reads and discards before it closes the connection.
const (
	lingerTime  = 500 * time.Millisecond
	lingerBytes = 8 << 20
)

// linger closes the sending side and discards what the client still sends, for a bounded time:
// closing a socket with unread bytes resets it, and a reset can destroy the answer (a 413 for a
// body too large) before the client, still sending its body, has read it.
func (c *conn) linger() {
	cw, ok := c.rwc.(interface{ CloseWrite() error })
	if !ok || cw.CloseWrite() != nil {
		return
	}
	_ = c.rwc.SetReadDeadline(time.Now().Add(lingerTime))
	_, _ = io.CopyN(io.Discard, c.reader(), lingerBytes)
}

// runHandler runs the handler, turning a panic into a closed connection (and a log line,
// unless it is http.ErrAbortHandler: the handler's way to cut an answer short).
func (c *conn) runHandler(w *response, req *http.Request) {
	defer func() {
		if p := recover(); p != nil {
			w.closeAfter = true
			w.aborted = true
			if p != http.ErrAbortHandler {
				buf := make([]byte, 16<<10)
				buf = buf[:runtime.Stack(buf, false)]
				c.s.logf("panic serving request", "remote", c.remoteAddr, "panic", fmt.Sprint(p), "stack", string(buf))
			}
		}
	}()
	c.s.Handler.ServeHTTP(w, req)
}

// releaseReader gives the read buffer back while the connection has nothing buffered, so an
// open stream holds none.
func (c *conn) releaseReader() {
	if c.br != nil && c.br.Buffered() == 0 {
		c.dropReader()
	}
}

// dropReader gives the read buffer back, whatever it holds.
func (c *conn) dropReader() {
	if c.br != nil {
		c.br.Reset(nil)
		readers.Put(c.br)
		c.br = nil
		c.s.buffers.Add(-1)
	}
}

// reader returns the connection's read buffer, taking one from the pool when it gave its own
// back.
func (c *conn) reader() *bufio.Reader {
	if c.br == nil {
		c.br = readers.Get().(*bufio.Reader)
		c.br.Reset(&c.src)
		c.s.buffers.Add(1)
	}
	return c.br
}

// write sends p to the client; after a failure every write fails with the first error.
func (c *conn) write(p []byte) error { return c.writev(p) }

// writev sends several buffers in one system call where the platform allows, as write does.
func (c *conn) writev(bufs ...[]byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.answered = true
	if c.werr != nil {
		return c.werr
	}
	if err := c.out.Write(bufs...); err != nil {
		c.werr = err
		return err
	}
	return nil
}

var continue100 = []byte("HTTP/1.1 100 Continue\r\n\r\n")

// writeContinue sends the 100 Continue a request's first body read owes, unless its answer has
// begun (a handler that answers, then reads on another goroutine): an interim answer never
// comes inside or after the final one, and the client sends its body when it sees the answer
// or its wait for the 100 ends (net/http's server does the same). Its failure is the body's
// (the answer's next write finds the connection broken too).
func (c *conn) writeContinue() error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.answered || c.werr != nil {
		return nil
	}
	return c.out.Write(continue100)
}

// body is a request's body, read from the connection's buffer.
type body struct {
	c         *conn
	remaining int64 // Content-Length bodies: bytes still to come
	chunked   io.Reader
	eof       bool
	err       error       // sticky read error
	expect    bool        // 100 Continue is owed before the first read
	done      atomic.Bool // the handler returned: reads fail
}

var errBodyAfterHandler = errors.New("h1: read of a request body after its handler returned")

func (b *body) Read(p []byte) (int, error) {
	if b.done.Load() {
		return 0, errBodyAfterHandler
	}
	if b.eof {
		return 0, io.EOF
	}
	if b.err != nil {
		return 0, b.err
	}
	if len(p) == 0 {
		return 0, nil
	}
	if b.expect {
		b.expect = false
		if err := b.c.writeContinue(); err != nil {
			b.err = err
			return 0, err
		}
	}
	br := b.c.reader()
	var n int
	var err error
	if b.chunked != nil {
		n, err = b.chunked.Read(p)
		if err == io.EOF {
			err = httpwire.SkipTrailers(br, b.c.s.maxHeaderBytes())
			if err == nil {
				err = io.EOF
			}
		}
	} else {
		if int64(len(p)) > b.remaining {
			p = p[:b.remaining]
		}
		n, err = br.Read(p)
		b.remaining -= int64(n)
		if b.remaining == 0 {
			err = io.EOF
		} else if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
	}
	if err == io.EOF {
		b.eof = true
		b.c.releaseReader()
	} else if err != nil {
		b.err = err
	}
	return n, err
}

// Close is a no-op: what the handler did not read is discarded (or the connection closed)
// after it returns.
func (b *body) Close() error { return nil }

// maxDiscard is how much of a body its handler left unread is read and dropped to keep the
// connection; beyond it the connection closes (net/http's figure).
const maxDiscard = 256 << 10

// drain reads what the handler left of the body; false: the connection cannot be reused.
func (b *body) drain(c *conn) bool {
	if b.eof {
		return true
	}
	if b.err != nil || b.expect { // never asked to send it: the client may not
		return false
	}
	if b.chunked == nil && b.remaining > maxDiscard {
		return false
	}
	b.done.Store(false)
	n, err := io.Copy(io.Discard, io.LimitReader(b, maxDiscard+1))
	b.done.Store(true)
	return err == nil && n <= maxDiscard && b.eof
}
