// Package upstream is Baton's HTTP/1.1 client for the engines: an http.RoundTripper built for
// one job — small requests with bodies in memory, answers relayed as they arrive — without
// net/http's per-connection reader and writer goroutines. The request is written from the
// caller's goroutine in one buffered write, the answer read by whoever reads its body; a
// cancelled context breaks the connection's blocking I/O through its deadline (a callback,
// no goroutine waiting). Connections are kept per host and reused when an answer was read to its
// end. HTTPS workers, and requests whose body length is unknown, go to the standard transport.
package upstream

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/baton-llm/baton/internal/httpwire"
)

// Transport is the engines' client. The zero value is not ready: use New.
type Transport struct {
	// Fallback serves what this transport does not (https, unknown body length).
	Fallback http.RoundTripper
	// MaxIdlePerHost bounds the idle connections kept per host; IdleTimeout closes them.
	MaxIdlePerHost int
	IdleTimeout    time.Duration
	// MaxResponseHeaderBytes bounds an answer's status line and headers.
	MaxResponseHeaderBytes int
	Dialer                 *net.Dialer
	// OnUnsolicited, when set, is called for every idle connection dropped because its engine
	// (or a proxy before it) wrote to it unasked — not for one it closed.
	OnUnsolicited func()

	mu   sync.Mutex
	idle map[string][]*conn // by host:port, most recently used last
}

// DefaultIdleTimeout is how long an idle connection is kept: less than the 5 s after which
// uvicorn (vLLM's and SGLang's HTTP server) closes an idle keep-alive connection, so that a
// request is not sent on a connection the engine is closing (it would be retried, at the cost of
// a round trip). Busy connections are reused within milliseconds.
const DefaultIdleTimeout = 4 * time.Second

// New returns a transport with fallback for what it does not serve.
func New(fallback http.RoundTripper, maxHeaderBytes int) *Transport {
	return &Transport{Fallback: fallback, MaxIdlePerHost: 512, IdleTimeout: DefaultIdleTimeout, MaxResponseHeaderBytes: maxHeaderBytes,
		Dialer: &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}, idle: map[string][]*conn{}}
}

// readBufSize is each connection's read buffer: an answer's headers, then its body as it comes.
const readBufSize = 4 << 10

type conn struct {
	c      net.Conn
	raw    syscall.RawConn // c's descriptor, for waiting without a buffer; nil where there is none
	br     *bufio.Reader
	src    httpwire.Source // what br reads: c, or the descriptor while waiting without a buffer
	host   string
	idleAt time.Time
	wbuf   *[]byte // the request being written, until it was (wrote)
	// lastID is the X-Request-Id of the last request written on the connection: a late
	// duplicate of its answer would be named like the answer of a request with the same id,
	// which must therefore take another connection (get).
	lastID string
	recall *httpwire.Recall // the last answer's first fields, shared by the next answer where the same; made on the first name httpwire.Names lacks
	expire func()           // expireNow, for the exchanges' context.AfterFunc
}

// expireNow ends the connection's reads and writes at once (a request's context ended).
func (c *conn) expireNow() { _ = c.c.SetDeadline(time.Unix(1, 0)) }

// wrote gives the request's write buffer back once the request left (or failed to), so that the
// wait for the answer holds none; true: the wait goes on (httpwire.Source.Sent).
func (c *conn) wrote() bool {
	if bp := c.wbuf; bp != nil {
		c.wbuf = nil
		buffersOut.Add(-1)
		if cap(*bp) <= 64<<10 {
			*bp = (*bp)[:0]
			wbufPool.Put(bp)
		}
	}
	return true
}

var wbufPool = sync.Pool{New: func() any { b := make([]byte, 0, 4<<10); return &b }}

// buffersOut counts the read and write buffers connections hold: taken from their pools and not
// given back (one a connection held when it was closed is never given back, and stays counted).
var buffersOut atomic.Int64

// ErrHeaderTooLarge is an answer whose status line and headers exceed the bound.
var ErrHeaderTooLarge = errors.New("upstream: response headers too large")

// RoundTrip sends req and returns the answer once its headers arrived; its body reads from the
// connection as the engine sends.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme != "http" || (req.Body != nil && req.Body != http.NoBody && req.ContentLength < 0) || req.Method == http.MethodConnect {
		return t.Fallback.RoundTrip(req)
	}
	var body []byte
	if p, ok := req.Body.(interface{ Bytes() []byte }); ok && int64(len(p.Bytes())) == req.ContentLength {
		body = p.Bytes() // lent whole: not copied again
	} else if req.Body != nil && req.Body != http.NoBody {
		b, err := io.ReadAll(io.LimitReader(req.Body, req.ContentLength+1))
		req.Body.Close()
		if err != nil {
			return nil, err
		}
		if int64(len(b)) != req.ContentLength {
			return nil, fmt.Errorf("upstream: body of %d bytes, ContentLength %d", len(b), req.ContentLength)
		}
		body = b
	}
	host := req.URL.Host
	if req.URL.Port() == "" {
		host = net.JoinHostPort(req.URL.Hostname(), "80")
	}
	ctx := req.Context()
	// A request is sent once: an engine that read it may have acted on it, so a failure after
	// the write is Baton's retry policy's to judge, never resent here. A connection the engine
	// closed or wrote to while idle is found before the request is written (stray), and the next
	// one is tried.
	var id string
	if v := req.Header["X-Request-Id"]; len(v) == 1 {
		id = v[0]
	}
	for {
		c, reused, err := t.get(ctx, host, id, req.Close)
		if err != nil {
			return nil, err
		}
		c.lastID = id
		resp, err := t.exchange(ctx, c, req, body, reused)
		if err == errStray {
			continue
		}
		return resp, err
	}
}

// errStray is an idle connection found stray as the request was about to be written on it: it
// was closed, nothing written, and another is taken.
var errStray = errors.New("upstream: idle connection found stray")

var errStale = errors.New("upstream: connection closed before an answer")

// exchange writes req on c and reads the answer's head; reused says c was idle, to be checked
// for stray bytes or its close before the write where get did not (errStray: c was).
func (t *Transport) exchange(ctx context.Context, c *conn, req *http.Request, body []byte, reused bool) (*http.Response, error) {
	if c.expire == nil {
		c.expire = c.expireNow // once per connection, not per exchange
	}
	stop := context.AfterFunc(ctx, c.expire)
	bp := wbufPool.Get().(*[]byte)
	buffersOut.Add(1)
	buf := appendRequest((*bp)[:0], req, len(body))
	var tail []byte
	if len(body) < 64<<10 { // one write; a large body goes beside the head, uncopied
		buf = append(buf, body...)
	} else {
		tail = body
	}
	*bp, c.wbuf = buf, bp
	err := c.send(buf, tail, reused)
	c.wrote()
	if err == httpwire.ErrStrayBytes || err == httpwire.ErrStrayEnd {
		stop()
		if err == httpwire.ErrStrayBytes && t.OnUnsolicited != nil {
			t.OnUnsolicited()
		}
		c.dropReader()
		c.c.Close()
		return nil, errStray
	}
	if err != nil {
		// The engine may have answered before it stopped reading (a 413 for a body too large):
		// that answer, already arrived, is the request's — relayed, not lost behind a write error.
		if resp, herr := t.earlyAnswer(ctx, c, req); herr == nil && ctx.Err() == nil {
			resp.Header.Set("Connection", "close") // the request was cut: the connection is done
			resp.Body = newBody(t, c, resp, stop, ctx)
			if err := framingError(resp.Body); err != nil {
				resp.Body.Close()
				return nil, err
			}
			return resp, nil
		}
		stop()
		c.c.Close()
		return nil, ctxErr(ctx, fmt.Errorf("%w: %v", errStale, err))
	}
	resp, err := t.readHead(c, req)
	if err != nil {
		stop()
		c.c.Close()
		return nil, ctxErr(ctx, err)
	}
	resp.Body = newBody(t, c, resp, stop, ctx)
	if err := framingError(resp.Body); err != nil { // framing Baton cannot follow: a 502, before any byte is relayed
		resp.Body.Close()
		return nil, err
	}
	return resp, nil
}

// framingError is the error of an answer whose body cannot be framed (a bad Content-Length, a
// Transfer-Encoding other than chunked), nil for any other.
func framingError(rc io.ReadCloser) error {
	if b, ok := rc.(*body); ok {
		return b.err
	}
	return nil
}

// ctxErr reports the context's error when it ended the exchange.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// appendRequest writes req's request line and headers.
func appendRequest(b []byte, req *http.Request, n int) []byte {
	b = append(b, req.Method...)
	b = append(b, ' ')
	b = append(b, req.URL.RequestURI()...)
	b = append(b, " HTTP/1.1\r\nHost: "...)
	if req.Host != "" {
		b = append(b, req.Host...)
	} else {
		b = append(b, req.URL.Host...)
	}
	b = append(b, "\r\n"...)
	for k, vs := range req.Header {
		if k == "Host" || k == "Content-Length" || k == "Connection" || k == "Transfer-Encoding" {
			continue
		}
		for _, v := range vs {
			b = append(b, k...)
			b = append(b, ": "...)
			b = appendClean(b, v)
			b = append(b, "\r\n"...)
		}
	}
	if n > 0 || (req.Method != http.MethodGet && req.Method != http.MethodHead) {
		b = append(b, "Content-Length: "...)
		b = strconv.AppendInt(b, int64(n), 10)
		b = append(b, "\r\n"...)
	}
	if req.Close {
		b = append(b, "Connection: close\r\n"...)
	}
	return append(b, "\r\n"...)
}

// appendClean appends a header value with CR and LF replaced: a value never splits a header.
func appendClean(b []byte, v string) []byte {
	if !strings.ContainsAny(v, "\r\n") {
		return append(b, v...)
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c == '\r' || c == '\n' {
			c = ' '
		}
		b = append(b, c)
	}
	return b
}

// readHead reads the status line and headers (skipping 1xx answers).
func (t *Transport) readHead(c *conn, req *http.Request) (*http.Response, error) {
	budget := t.MaxResponseHeaderBytes
	for {
		line, err := httpwire.ReadLine(c.br, &budget, false)
		if err != nil {
			if err == io.EOF { // closed before a single byte of an answer: the request had no effect
				return nil, fmt.Errorf("%w: %v", errStale, err)
			}
			return nil, headErr(err)
		}
		fields := httpwire.NewFields(8)
		resp := &http.Response{Request: req, Header: fields.H}
		if err := parseStatus(string(line), resp); err != nil {
			return nil, err
		}
		for i := 0; ; i++ {
			line, err := httpwire.ReadLine(c.br, &budget, false)
			if err != nil {
				if err == io.EOF {
					err = io.ErrUnexpectedEOF
				}
				return nil, headErr(err)
			}
			if len(line) == 0 {
				break
			}
			name, v, err := httpwire.SplitField(line)
			if err != nil {
				return nil, fmt.Errorf("upstream: %w", err) // a folded line, whitespace before the colon, a control byte
			}
			fields.Add(httpwire.RecallField(names, &c.recall, i, name, v))
		}
		if resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
			// 100 Continue and friends: the answer follows. An informational head has no body,
			// but framing fields it cannot have are refused there as on the answer's own head.
			if err := informationalFraming(fields.H); err != nil {
				return nil, err
			}
			continue
		}
		return resp, nil
	}
}

// names are the header names and values engines answer with on almost every answer (uvicorn's,
// vLLM's and SGLang's server): matched without allocating.
var names = httpwire.NewNames([]string{"Content-Type", "Content-Length", "Date", "Server", "X-Request-Id", "Transfer-Encoding",
	"Connection", "Cache-Control", "Keep-Alive"},
	[]string{"application/json", "text/event-stream", "text/event-stream; charset=utf-8", "application/json; charset=utf-8",
		"uvicorn", "chunked", "keep-alive", "close", "no-cache"}, []string{"Date"})

// headErr names a head past its bound as ErrHeaderTooLarge.
func headErr(err error) error {
	if err == httpwire.ErrTooLong {
		return ErrHeaderTooLarge
	}
	return err
}

// earlyAnswerWait bounds the look for an answer that arrived before a write failed.
var earlyAnswerWait = time.Second

// earlyAnswer reads an answer's head that arrived before the request could be written whole,
// unless the request's context ended (the write failed for that): then there is no look, and no
// wait of earlyAnswerWait for a caller that has gone.
func (t *Transport) earlyAnswer(ctx context.Context, c *conn, req *http.Request) (*http.Response, error) {
	_ = c.c.SetReadDeadline(time.Now().Add(earlyAnswerWait))
	// Checked after the deadline is set: a cancellation from now on expires it again.
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	resp, err := t.readHead(c, req)
	_ = c.c.SetReadDeadline(time.Time{})
	return resp, err
}

// parseStatus reads a status line. Its errors name what is wrong by its size and quote nothing:
// bytes where a status line should be may be another request's answer, on a connection out of
// step, and go no further, not even to the log.
func parseStatus(line string, resp *http.Response) error {
	proto, rest, ok := strings.Cut(line, " ")
	if !ok || (proto != "HTTP/1.1" && proto != "HTTP/1.0") {
		if !strings.HasPrefix(proto, "HTTP/") {
			return fmt.Errorf("upstream: malformed status line: %d bytes that do not begin with HTTP/ (not quoted: they may be another request's answer)", len(line))
		}
		return fmt.Errorf("upstream: malformed status line: a version of %d bytes (%s)", len(proto), notQuoted)
	}
	code, reason, _ := strings.Cut(rest, " ")
	n, err := strconv.Atoi(code)
	if err != nil || len(code) != 3 || n < 100 {
		return fmt.Errorf("upstream: malformed status code: %d bytes (%s)", len(code), notQuoted)
	}
	resp.Proto, resp.ProtoMajor, resp.ProtoMinor = proto, 1, int(proto[7]-'0')
	resp.StatusCode, resp.Status = n, code+" "+reason
	return nil
}

// get returns an idle connection to host, or dials one — always, when fresh (a request that
// closes its connection is sent on a connection of its own).
func (t *Transport) get(ctx context.Context, host, id string, fresh bool) (*conn, bool, error) {
	t.mu.Lock()
	list := t.idle[host]
	for i := len(list) - 1; i >= 0 && !fresh; i-- {
		c := list[i]
		if time.Since(c.idleAt) >= t.IdleTimeout {
			list = slices.Delete(list, i, i+1)
			c.c.Close()
			continue
		}
		if id != "" && c.lastID == id {
			// Its last request carried this request's id (a client that sends one id with
			// several requests): an answer of that one arriving late could not be told from
			// this one's. Another connection is taken, this one left for other requests.
			continue
		}
		list = slices.Delete(list, i, i+1)
		t.idle[host] = list
		t.mu.Unlock()
		c.takeReader()
		if c.checkedAtWrite() || !c.stray() {
			return c, true, nil
		}
		if t.OnUnsolicited != nil && c.unsolicited() {
			t.OnUnsolicited()
		}
		c.dropReader()
		c.c.Close()
		t.mu.Lock()
		list = t.idle[host]
		i = len(list) // the list may have changed meanwhile: from its end again
	}
	t.idle[host] = list
	t.mu.Unlock()
	nc, err := t.Dialer.DialContext(ctx, "tcp", host)
	if err != nil {
		return nil, false, err
	}
	c := &conn{c: nc, host: host}
	c.src = httpwire.Source{Conn: nc, Take: c.reader, Give: c.dropReader}
	c.src.Sent = c.wrote
	if sc, ok := nc.(syscall.Conn); ok {
		c.raw, _ = sc.SyscallConn()
	}
	c.takeReader()
	return c, false, nil
}

// stray reports whether an idle connection has something to read: bytes its engine sent after
// the last answer (a duplicate answer, a body after a 204, bytes past a Content-Length), or its
// close. Either way it must not carry another request: the stray bytes would be read as that
// request's answer. A read that must return at once tells, without waiting.
func (c *conn) stray() bool {
	if c.br.Buffered() > 0 {
		return true
	}
	if c.raw != nil {
		if pending, ok := c.pending(); ok {
			return pending
		}
	}
	// A deadline a moment ahead makes the read try once (a deadline already past would not).
	_ = c.c.SetReadDeadline(time.Now().Add(50 * time.Microsecond))
	_, err := c.br.Peek(1)
	_ = c.c.SetReadDeadline(time.Time{})
	var ne net.Error
	return !errors.As(err, &ne) || !ne.Timeout()
}

// unsolicited reports whether a stray connection holds bytes, rather than its close.
func (c *conn) unsolicited() bool {
	_ = c.c.SetReadDeadline(time.Now().Add(50 * time.Microsecond))
	b, _ := c.br.Peek(1)
	return len(b) > 0
}

// readers are the connections' read buffers: an idle connection (nothing buffered) holds none.
var readers = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, readBufSize) }}

// takeReader gives c a read buffer from the pool.
func (c *conn) takeReader() {
	c.br = readers.Get().(*bufio.Reader)
	buffersOut.Add(1)
	c.br.Reset(&c.src)
}

// dropReader gives c's read buffer back; c must have nothing buffered.
func (c *conn) dropReader() {
	c.br.Reset(nil)
	readers.Put(c.br)
	buffersOut.Add(-1)
	c.br = nil
}

// put keeps c for reuse, or closes it past the bound.
//
// No deadline is left to clear: a body is put back only when its exchange's cancellation never
// ran (expireNow's past deadline), and the reads that set one of their own clear it, or close
// the connection.
func (t *Transport) put(c *conn) {
	c.idleAt = time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.idle[c.host]) >= t.MaxIdlePerHost {
		c.c.Close()
		return
	}
	c.dropReader()
	t.idle[c.host] = append(t.idle[c.host], c)
}

// CloseIdleTo closes the connections kept for reuse to the host of rawURL (a worker that left).
func (t *Transport) CloseIdleTo(rawURL string) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "80")
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, c := range t.idle[host] {
		c.c.Close()
	}
	delete(t.idle, host)
}

// CloseIdleConnections closes the connections kept for reuse.
func (t *Transport) CloseIdleConnections() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for h, list := range t.idle {
		for _, c := range list {
			c.c.Close()
		}
		delete(t.idle, h)
	}
	if ci, ok := t.Fallback.(interface{ CloseIdleConnections() }); ok {
		ci.CloseIdleConnections()
	}
}
