package h1

import (
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/httpwire"
)

// writeBufSize is the answer buffer: an answer that fits and is not flushed goes out in one
// write with a Content-Length; a longer one, or a flushed one, is chunked. A stream gives the
// buffer back after every flush.
const writeBufSize = 4 << 10

var writeBufs = sync.Pool{New: func() any { b := make([]byte, 0, writeBufSize); return &b }}

// getBuf takes an answer buffer from the pool.
func (s *Server) getBuf() *[]byte {
	s.writeBuffers.Add(1)
	return writeBufs.Get().(*[]byte)
}

// putBuf gives an answer buffer back (one grown past 64 KiB is let go).
func (s *Server) putBuf(b *[]byte) {
	s.writeBuffers.Add(-1)
	if cap(*b) > 64<<10 {
		return
	}
	*b = (*b)[:0]
	writeBufs.Put(b)
}

// response is the http.ResponseWriter of one request. It also offers FlushError,
// SetReadDeadline and SetWriteDeadline, so http.ResponseController works on it.
type response struct {
	c      *conn
	req    *http.Request
	body   *body
	header http.Header

	status      int
	wroteHeader bool  // the status is decided
	headSent    bool  // the head is in out or on the wire
	chunked     bool  // the body is sent in chunks
	declared    int64 // the Content-Length the handler set; -1: none
	written     int64 // body bytes the handler wrote
	out         *[]byte
	closeAfter  bool // the connection closes after this answer
	aborted     bool // the handler panicked: the answer is cut
}

var (
	_ http.ResponseWriter = (*response)(nil)
	_ http.Flusher        = (*response)(nil)
)

func newResponse(c *conn, req *http.Request, b *body) *response {
	return &response{c: c, req: req, body: b, header: make(http.Header, 8), declared: -1,
		closeAfter: req.Close || c.s.shutdown.Load()}
}

func (w *response) Header() http.Header {
	if w.header == nil { // let go once a stream's head was sent: what is set now has no effect
		w.header = make(http.Header)
	}
	return w.header
}

func (w *response) WriteHeader(code int) {
	if w.wroteHeader {
		return
	}
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
	if code < 200 && code != http.StatusSwitchingProtocols { // informational: sent at once
		if code == http.StatusContinue || w.req.ProtoMinor == 0 {
			return
		}
		hb := w.c.s.getBuf()
		*hb = appendStatus(*hb, w.req, code)
		*hb = appendHeaders(*hb, w.header)
		*hb = append(*hb, "\r\n"...)
		_ = w.c.write(*hb)
		w.c.s.putBuf(hb)
		return
	}
	w.wroteHeader, w.status = true, code
	if cl := w.header["Content-Length"]; len(cl) > 0 {
		if n, ok := httpwire.ParseLength(cl[0]); ok && bodyAllowed(code) {
			w.declared = n
		} else {
			delete(w.header, "Content-Length")
		}
	}
	if httpwire.HasToken(w.header["Connection"], "close") || code == http.StatusSwitchingProtocols {
		// After a 101 the bytes on the connection are another protocol's: never another
		// request's head.
		w.closeAfter = true
	}
}

func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

func (w *response) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if len(p) == 0 {
		return 0, nil
	}
	if !bodyAllowed(w.status) {
		return 0, http.ErrBodyNotAllowed
	}
	var over bool
	if w.declared >= 0 && w.written+int64(len(p)) > w.declared {
		p, over = p[:w.declared-w.written], true
	}
	w.written += int64(len(p))
	if w.req.Method == http.MethodHead {
		return len(p), nil
	}
	if w.c.werr != nil {
		return 0, w.c.werr
	}
	if !w.headSent {
		pending := 0
		if w.out != nil {
			pending = len(*w.out)
		}
		if w.declared < 0 && pending+len(p) <= writeBufSize {
			if w.out == nil {
				w.out = w.c.s.getBuf()
			}
			*w.out = append(*w.out, p...)
			return len(p), nil
		}
		w.sendHead(w.declared < 0, p)
	}
	w.appendBody(p)
	if w.c.werr != nil {
		return 0, w.c.werr
	}
	if over {
		return len(p), http.ErrContentLength
	}
	return len(p), nil
}

// appendBody adds body bytes after the head: to the buffer when they fit, else straight to the
// connection (a large write is not copied).
func (w *response) appendBody(p []byte) {
	if w.out == nil {
		w.out = w.c.s.getBuf()
	}
	const overhead = 20 // a chunk's size line and its closing CRLF
	if len(*w.out)+len(p)+overhead > cap(*w.out) {
		w.flushOut()
		if len(p)+overhead > cap(*w.out)/2 {
			if w.chunked {
				var hdr [18]byte
				_ = w.c.writev(appendChunkSize(hdr[:0], len(p)), p, crlf)
			} else {
				_ = w.c.write(p)
			}
			return
		}
	}
	if w.chunked {
		*w.out = appendChunkSize(*w.out, len(p))
		*w.out = append(*w.out, p...)
		*w.out = append(*w.out, crlf...)
	} else {
		*w.out = append(*w.out, p...)
	}
}

var crlf = []byte("\r\n")

func appendChunkSize(dst []byte, n int) []byte {
	dst = strconv.AppendInt(dst, int64(n), 16)
	return append(dst, crlf...)
}

// flushOut writes what the buffer holds.
func (w *response) flushOut() {
	if w.out != nil && len(*w.out) > 0 {
		_ = w.c.write(*w.out)
		*w.out = (*w.out)[:0]
	}
}

// release gives the buffer back.
func (w *response) release() {
	if w.out != nil {
		w.c.s.putBuf(w.out)
		w.out = nil
	}
}

func (w *response) Flush() { _ = w.FlushError() }

// FlushError sends the head and everything written so far, and gives the buffer back until
// the next write.
func (w *response) FlushError() error {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if !w.headSent {
		w.sendHead(w.declared < 0 && bodyAllowed(w.status) && w.req.Method != http.MethodHead, nil)
	}
	w.flushOut()
	w.release()
	return w.c.werr
}

// SetReadDeadline moves the connection's read deadline (for http.ResponseController).
func (w *response) SetReadDeadline(t time.Time) error {
	w.c.rdlSet.Store(true)
	return w.c.rwc.SetReadDeadline(t)
}

// SetWriteDeadline moves the connection's write deadline (for http.ResponseController); it is
// cleared after the answer.
func (w *response) SetWriteDeadline(t time.Time) error {
	w.c.wdlSet.Store(true)
	return w.c.rwc.SetWriteDeadline(t)
}

// sendHead composes the head into the buffer, ahead of the body bytes held so far. chunked
// asks for chunked framing; without it and without a declared length the body is delimited by
// the connection's close (HTTP/1.0 clients). next is the body's first bytes when none are held
// (for sniffing a missing Content-Type).
func (w *response) sendHead(chunked bool, next []byte) {
	w.headSent = true
	pend := w.out
	hb := w.c.s.getBuf()
	if w.req.ProtoMinor == 0 {
		chunked = false
		if w.declared < 0 && bodyAllowed(w.status) && w.req.Method != http.MethodHead {
			w.closeAfter = true
		}
	}
	w.chunked = chunked
	if w.c.s.shutdown.Load() {
		w.closeAfter = true
	}
	if b := w.body; !b.eof && (b.expect || b.chunked != nil || b.remaining > maxDiscard) {
		w.closeAfter = true // the rest of the body is not worth reading off the connection
	}
	h := w.header
	*hb = appendStatus(*hb, w.req, w.status)
	*hb = appendHeaders(*hb, h)
	if _, ok := h["Date"]; !ok {
		*hb = append(*hb, "Date: "...)
		*hb = appendDate(*hb)
		*hb = append(*hb, crlf...)
	}
	if pend != nil && len(*pend) > 0 {
		next = *pend
	}
	if _, ok := h["Content-Type"]; !ok && len(next) > 0 && bodyAllowed(w.status) {
		*hb = append(*hb, "Content-Type: "...)
		*hb = append(*hb, http.DetectContentType(next)...)
		*hb = append(*hb, crlf...)
	}
	if chunked {
		*hb = append(*hb, "Transfer-Encoding: chunked\r\n"...)
	}
	switch {
	case w.closeAfter && w.req.ProtoMinor == 1:
		*hb = append(*hb, "Connection: close\r\n"...)
	case !w.closeAfter && w.req.ProtoMinor == 0:
		*hb = append(*hb, "Connection: keep-alive\r\n"...)
	}
	*hb = append(*hb, crlf...)
	w.out = hb
	if chunked {
		// The head is rendered and nothing sends trailers: an open stream holds no header map.
		w.header = nil
	}
	if pend != nil {
		if len(*pend) > 0 {
			w.appendBody(*pend)
		}
		w.c.s.putBuf(pend)
	}
}

// finish completes the answer after the handler returned.
func (w *response) finish() {
	defer w.release()
	if w.aborted {
		if w.headSent { // what was buffered leaves, the cut shows as a missing end
			w.flushOut()
		}
		return
	}
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if !w.headSent {
		// The whole answer is known: it leaves with its length, in one write.
		if w.declared < 0 && bodyAllowed(w.status) && (w.req.Method != http.MethodHead || w.written > 0) {
			w.header["Content-Length"] = []string{strconv.FormatInt(w.written, 10)}
			w.declared = w.written
		}
		w.sendHead(false, nil)
	} else if w.chunked {
		if w.out == nil {
			w.out = w.c.s.getBuf()
		}
		*w.out = append(*w.out, "0\r\n\r\n"...)
	}
	if w.declared >= 0 && w.written < w.declared && w.req.Method != http.MethodHead {
		w.closeAfter = true // the client is owed bytes it will never get
	}
	w.flushOut()
}

func appendStatus(dst []byte, req *http.Request, code int) []byte {
	if req.ProtoMinor == 0 {
		dst = append(dst, "HTTP/1.0 "...)
	} else {
		dst = append(dst, "HTTP/1.1 "...)
	}
	dst = strconv.AppendInt(dst, int64(code), 10)
	dst = append(dst, ' ')
	if text := http.StatusText(code); text != "" {
		dst = append(dst, text...)
	} else {
		dst = append(dst, "status code "...)
		dst = strconv.AppendInt(dst, int64(code), 10)
	}
	return append(dst, crlf...)
}

// appendHeaders writes the handler's headers sorted by name, skipping the ones the server owns
// and names that are not tokens; CR and LF in values become spaces, so no value can add a line.
func appendHeaders(dst []byte, h http.Header) []byte {
	var arr [24]string
	keys := arr[:0]
	for k := range h {
		switch k {
		case "Transfer-Encoding", "Connection", "Keep-Alive":
			continue
		}
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if !httpwire.IsToken(k) {
			continue
		}
		for _, v := range h[k] {
			dst = append(dst, k...)
			dst = append(dst, ": "...)
			if strings.IndexByte(v, '\r') < 0 && strings.IndexByte(v, '\n') < 0 {
				dst = append(dst, v...)
			} else {
				for i := 0; i < len(v); i++ {
					if b := v[i]; b == '\r' || b == '\n' {
						dst = append(dst, ' ')
					} else {
						dst = append(dst, b)
					}
				}
			}
			dst = append(dst, crlf...)
		}
	}
	return dst
}

type dateEntry struct {
	sec int64
	b   []byte
}

var dateCache atomic.Pointer[dateEntry]

// appendDate appends the current time in the HTTP date format, formatted once a second.
func appendDate(dst []byte) []byte {
	now := time.Now()
	e := dateCache.Load()
	if e == nil || e.sec != now.Unix() {
		e = &dateEntry{sec: now.Unix(), b: now.UTC().AppendFormat(nil, http.TimeFormat)}
		dateCache.Store(e)
	}
	return append(dst, e.b...)
}

// refuse answers a request the server would not pass to its handler, as Server.Refuse renders
// it (text/plain when it is nil), and the connection closes.
func (c *conn) refuse(err error) {
	r, ok := err.(*Refusal)
	if !ok {
		return // the client left before a whole request
	}
	h, body := http.Header{"Content-Type": {"text/plain; charset=utf-8"}}, []byte(r.Message+"\n")
	if c.s.Refuse != nil {
		h, body = c.s.Refuse(r)
	}
	h.Del("Content-Length")
	b := fmt.Appendf(nil, "HTTP/1.1 %d %s\r\n", r.Status, http.StatusText(r.Status))
	b = appendHeaders(b, h)
	b = fmt.Appendf(b, "Content-Length: %d\r\nConnection: close\r\n\r\n%s", len(body), body)
	_ = c.rwc.SetWriteDeadline(time.Now().Add(time.Second))
	_ = c.write(b)
}
