package upstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/baton-llm/baton/internal/httpwire"
)

// body is an answer's body, read from its connection: Content-Length, chunked, or until the
// engine closes. Read to its end, the connection goes back to the pool; closed early, it is
// closed.
type body struct {
	t    *Transport
	c    *conn
	ctx  context.Context
	stop func() bool // unregisters the cancellation callback; false when it already ran

	mode     int   // bodyLength, bodyChunked, bodyClose, bodyNone
	left     int64 // bytes left of the body (length) or of the current chunk (chunked)
	reusable bool
	eof      bool
	crlfOwed bool        // Next returned a chunk's last bytes; its CRLF is still to read
	err      error       // owned by the reader
	end      sync.Once   // the connection's fate: back to the pool, or closed
	closed   atomic.Bool // Close was called
}

const (
	bodyNone = iota
	bodyLength
	bodyChunked
	bodyClose
)

// maxTrailers bounds a chunked answer's trailer section (read and dropped).
const maxTrailers = 64 << 10

func newBody(t *Transport, c *conn, resp *http.Response, stop func() bool, ctx context.Context) io.ReadCloser {
	b := &body{t: t, c: c, ctx: ctx, stop: stop, reusable: true}
	h := resp.Header
	if resp.ProtoMinor == 0 && !strings.EqualFold(h.Get("Connection"), "keep-alive") || httpwire.HasToken(h["Connection"], "close") || resp.Request.Close {
		b.reusable = false
	}
	resp.ContentLength = -1
	cl, clErr := contentLength(h["Content-Length"])
	te := h["Transfer-Encoding"]
	switch {
	case clErr != nil:
		b.mode, b.reusable, b.err = bodyNone, false, clErr
	case len(te) > 0 && (len(te) != 1 || !strings.EqualFold(te[0], "chunked") || resp.ProtoMinor == 0 || cl >= 0):
		// chunked alone, as net/http requires: any other coding (gzip, chunked included) is
		// framing Baton cannot follow. An HTTP/1.0 answer has no Transfer-Encoding: one there is
		// faulty framing (RFC 9112 6.1). Beside a Content-Length, it is a smuggling attempt or
		// broken (RFC 9112 6.3 allows treating it as an error; Baton does).
		b.mode, b.reusable, b.err = bodyNone, false, unsupportedCoding(te)
	case resp.Request.Method == http.MethodHead || resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified:
		b.mode = bodyNone
		resp.ContentLength = 0
	case len(te) > 0:
		b.mode = bodyChunked
		resp.TransferEncoding = []string{"chunked"}
		h.Del("Transfer-Encoding")
	case cl >= 0:
		b.mode, b.left = bodyLength, cl
		resp.ContentLength = cl
	default:
		b.mode, b.reusable = bodyClose, false
	}
	if b.mode == bodyNone && b.err == nil {
		b.finish()
		return http.NoBody
	}
	if b.mode == bodyLength && b.left == 0 {
		b.finish()
		return http.NoBody
	}
	return b
}

// contentLength reads an answer's Content-Length: -1 when absent; one value of decimal digits
// only (no sign, no space, no list — each a framing ambiguity), else an error.
func contentLength(vs []string) (int64, error) {
	if len(vs) == 0 {
		return -1, nil
	}
	n, ok := httpwire.ParseLength(vs[0])
	if !ok || len(vs) > 1 {
		return 0, fmt.Errorf("upstream: bad Content-Length (%d values, %d bytes; %s)", len(vs), fieldBytes(vs), notQuoted)
	}
	return n, nil
}

// informationalFraming is the error of an informational (1xx) head with a framing field no head
// may have: a bad Content-Length, a Transfer-Encoding other than chunked alone.
func informationalFraming(h http.Header) error {
	if _, err := contentLength(h["Content-Length"]); err != nil {
		return err
	}
	if te := h["Transfer-Encoding"]; len(te) > 0 && (len(te) != 1 || !strings.EqualFold(te[0], "chunked")) {
		return unsupportedCoding(te)
	}
	return nil
}

// notQuoted says why an error names a field of an answer's head by its size alone: on a
// connection out of step, the head may be another request's answer, and none of its bytes go to
// a log, a trace or a client.
const notQuoted = "what the worker sent is not quoted: it may be another request's answer"

// unsupportedCoding is the error of an answer whose Transfer-Encoding te Baton cannot follow,
// named by its size.
func unsupportedCoding(te []string) error {
	return fmt.Errorf("upstream: unsupported Transfer-Encoding (%d values, %d bytes; %s)", len(te), fieldBytes(te), notQuoted)
}

// fieldBytes is the size of a field's values.
func fieldBytes(vs []string) int {
	n := 0
	for _, v := range vs {
		n += len(v)
	}
	return n
}

// Read reads the body; one reader at a time (Close may come from any goroutine).
func (b *body) Read(p []byte) (int, error) {
	if err := b.readable(); err != nil {
		return 0, err
	}
	n, err := b.read(p)
	return n, b.settle(err)
}

// readable reports why the body cannot be read further, or nil.
func (b *body) readable() error {
	switch {
	case b.closed.Load():
		return errBodyClosed
	case b.err != nil:
		return b.err
	case b.eof:
		return io.EOF
	}
	return nil
}

// settle takes a read's error: at the end the connection is settled, on a failure it is
// closed and the error recorded.
func (b *body) settle(err error) error {
	switch {
	case err == io.EOF:
		b.eof = true
		b.finish()
	case err != nil:
		err = b.fail(err)
	}
	return err
}

var errBodyClosed = errors.New("upstream: read on a closed body")

// Next returns the body's next bytes without copying them: a view of the connection's read
// buffer, valid until the next call to Next or Read. The body ends with io.EOF and no bytes. A
// relay that writes each view before asking for the next holds no buffer of its own.
func (b *body) Next() ([]byte, error) {
	if err := b.readable(); err != nil {
		return nil, err
	}
	v, err := b.next()
	if err != nil {
		return nil, b.settle(err)
	}
	return v, nil
}

// next finds the next bytes of the body in the read buffer. The connection is settled (finish)
// only on the call after the last bytes, when the caller no longer holds a view of its buffer.
func (b *body) next() ([]byte, error) {
	if b.mode == bodyLength && b.left == 0 {
		return nil, io.EOF
	}
	if b.crlfOwed { // the end of the chunk whose last bytes went out
		if err := httpwire.ReadChunkEnd(b.c.br); err != nil {
			return nil, err
		}
		b.crlfOwed = false
	}
	if b.c.br.Buffered() == 0 {
		b.c.awaitData() // more is due: wait for it holding no buffer
	}
	br := b.c.br
	switch b.mode {
	case bodyLength:
		v, err := b.view(b.left, io.ErrUnexpectedEOF)
		b.left -= int64(len(v))
		return v, err
	case bodyChunked:
		if b.left == 0 {
			size, err := httpwire.ReadChunkSize(br)
			if err != nil {
				return nil, err
			}
			if size == 0 {
				if err := httpwire.SkipTrailers(br, maxTrailers); err != nil {
					return nil, err
				}
				return nil, io.EOF
			}
			b.left = size
		}
		v, err := b.view(b.left, io.ErrUnexpectedEOF)
		b.left -= int64(len(v))
		b.crlfOwed = b.left == 0
		return v, err
	default:
		return b.view(1<<62, io.EOF)
	}
}

// view returns up to limit buffered bytes, reading when none are buffered; atEOF is the error
// when the engine closed first.
func (b *body) view(limit int64, atEOF error) ([]byte, error) {
	br := b.c.br
	if br.Buffered() == 0 {
		if _, err := br.Peek(1); err != nil {
			if err == io.EOF {
				err = atEOF
			}
			return nil, err
		}
	}
	n := int(min(int64(br.Buffered()), limit))
	v, _ := br.Peek(n)
	_, _ = br.Discard(n)
	return v, nil
}

// fail records a read error (the request's cancellation or a Close, when those caused it) and
// closes the connection.
func (b *body) fail(err error) error {
	switch {
	case b.ctx.Err() != nil:
		err = b.ctx.Err()
	case b.closed.Load():
		err = errBodyClosed
	}
	b.err = err
	b.abandon()
	return err
}

func (b *body) read(p []byte) (int, error) {
	br := b.c.br
	switch b.mode {
	case bodyLength:
		if b.left == 0 {
			return 0, io.EOF
		}
		if int64(len(p)) > b.left {
			p = p[:b.left]
		}
		n, err := br.Read(p)
		b.left -= int64(n)
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		if err == nil && b.left == 0 {
			err = io.EOF
		}
		return n, err
	case bodyChunked:
		if b.crlfOwed {
			if err := httpwire.ReadChunkEnd(br); err != nil {
				return 0, err
			}
			b.crlfOwed = false
		}
		if b.left == 0 {
			size, err := httpwire.ReadChunkSize(br)
			if err != nil {
				return 0, err
			}
			if size == 0 {
				if err := httpwire.SkipTrailers(br, maxTrailers); err != nil {
					return 0, err
				}
				return 0, io.EOF
			}
			b.left = size
		}
		if int64(len(p)) > b.left {
			p = p[:b.left]
		}
		n, err := br.Read(p)
		b.left -= int64(n)
		if err == io.EOF {
			return n, io.ErrUnexpectedEOF
		}
		if err == nil && b.left == 0 {
			err = httpwire.ReadChunkEnd(br)
		}
		return n, err
	default: // until the engine closes
		return br.Read(p)
	}
}

// NoReuse has the body's connection closed once the body is read, never handed to another
// request: for an answer that cannot be proven its request's, so that nothing an engine sent
// after it reaches another request.
func (b *body) NoReuse() { b.reusable = false }

// finish ends a body read to its end: the connection goes back to the pool when the
// cancellation callback never ran and the engine sent nothing more.
func (b *body) finish() {
	b.end.Do(func() {
		if b.stop() && b.reusable && b.c.br.Buffered() == 0 && !b.closed.Load() {
			b.t.put(b.c)
			return
		}
		b.c.c.Close()
	})
}

// abandon closes the connection of a body not read to its end.
func (b *body) abandon() {
	b.end.Do(func() {
		b.stop()
		b.c.c.Close()
	})
}

// Close ends the body; before its end, the connection is closed (which also ends a Read
// blocked on it in another goroutine).
func (b *body) Close() error {
	if !b.closed.Swap(true) {
		b.abandon() // nothing when the body was read to its end: its connection is settled
	}
	return nil
}
