package h1

import (
	"bufio"
	"bytes"
	"errors"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"

	"github.com/baton-llm/baton/internal/httpwire"
)

// Refusal is a request the server refuses before any handler sees it: its status, what is
// wrong with it (Kind) and a message; Server.Refuse renders it for the client, and the
// connection closes.
type Refusal struct {
	Status  int
	Kind    RefusalKind
	Message string
}

func (r *Refusal) Error() string { return r.Message }

// RefusalKind says what is wrong with a refused request.
type RefusalKind int

// The kinds of refusal.
const (
	RefusedRequest          RefusalKind = iota // a malformed request line or header (400)
	RefusedHeadersTooLarge                     // the head past its bounds (431)
	RefusedVersion                             // HTTP other than 1.0 and 1.1 (505)
	RefusedTransferEncoding                    // a body coding other than chunked (501)
	RefusedExpectation                         // an Expect other than 100-continue (417)
)

func badRequest(msg string) *Refusal {
	return &Refusal{Status: http.StatusBadRequest, Kind: RefusedRequest, Message: msg}
}

var errHeadTooLarge = &Refusal{Status: http.StatusRequestHeaderFieldsTooLarge, Kind: RefusedHeadersTooLarge,
	Message: "the request line and headers exceed the server's bound"}

var errTooManyHeaders = &Refusal{Status: http.StatusRequestHeaderFieldsTooLarge, Kind: RefusedHeadersTooLarge,
	Message: "the request has more header fields than the server's bound"}

// errClosed is a connection that ended before a whole request head: nothing is answered.
var errClosed = errors.New("connection closed")

// readLine returns the next line of a request head without its CRLF (or LF), charging it to
// *budget; the slice is valid until the next read.
func readLine(br *bufio.Reader, budget *int) ([]byte, error) {
	line, err := httpwire.ReadLine(br, budget, false)
	switch {
	case err == nil:
		return line, nil
	case err == httpwire.ErrTooLong:
		return nil, errHeadTooLarge
	}
	return nil, errClosed
}

// readRequest parses the next request's head and sets up its body. An error that is not
// errClosed is answered to the client.
func (c *conn) readRequest() (*http.Request, *body, error) {
	br := c.reader()
	budget := c.s.maxHeaderBytes()
	line, err := readLine(br, &budget)
	if err != nil {
		return nil, nil, err
	}
	fields := httpwire.NewFields(8)
	req := &http.Request{Header: fields.H}
	if herr := parseRequestLine(req, line); herr != nil {
		return nil, nil, herr
	}
	for n := 0; ; n++ {
		line, err := readLine(br, &budget)
		if err != nil {
			return nil, nil, err
		}
		if len(line) == 0 {
			break
		}
		if n == c.s.maxHeaders() {
			return nil, nil, errTooManyHeaders
		}
		if herr := addHeader(&fields, line); herr != nil {
			return nil, nil, herr
		}
	}
	b, herr := c.prepare(req)
	if herr != nil {
		return nil, nil, herr
	}
	return req, b, nil
}

func parseRequestLine(req *http.Request, line []byte) *Refusal {
	sp1 := bytes.IndexByte(line, ' ')
	if sp1 <= 0 {
		return badRequest("malformed request line")
	}
	rest := line[sp1+1:]
	sp2 := bytes.IndexByte(rest, ' ')
	if sp2 <= 0 {
		return badRequest("malformed request line")
	}
	method, target, proto := line[:sp1], rest[:sp2], rest[sp2+1:]
	if !httpwire.IsToken(method) {
		return badRequest("malformed request method")
	}
	switch string(proto) {
	case "HTTP/1.1":
		req.Proto, req.ProtoMajor, req.ProtoMinor = "HTTP/1.1", 1, 1
	case "HTTP/1.0":
		req.Proto, req.ProtoMajor, req.ProtoMinor = "HTTP/1.0", 1, 0
	default:
		if bytes.HasPrefix(proto, []byte("HTTP/")) {
			return &Refusal{Status: http.StatusHTTPVersionNotSupported, Kind: RefusedVersion,
				Message: "only HTTP/1.1 and HTTP/1.0 are served here"}
		}
		return badRequest("malformed request line")
	}
	req.Method = internMethod(method)
	for _, b := range target {
		if b <= ' ' || b == 0x7f {
			return badRequest("malformed request target")
		}
	}
	req.RequestURI = string(target)
	u, err := url.ParseRequestURI(req.RequestURI)
	if err != nil {
		return badRequest("malformed request target")
	}
	req.URL = u
	return nil
}

// addHeader adds one "Name: value" line; folded lines and bad names or values are refused.
func addHeader(f *httpwire.Fields, line []byte) *Refusal {
	name, v, herr := splitHeader(line)
	if herr != nil {
		return herr
	}
	key := names.Key(name)
	f.Add(key, names.Value(key, v))
	return nil
}

// splitHeader checks a header line and returns its name and its value without surrounding
// whitespace (httpwire's rules), refusing a bad one with 400.
func splitHeader(line []byte) (name, value []byte, herr *Refusal) {
	name, value, err := httpwire.SplitField(line)
	if err != nil {
		return nil, nil, badRequest(err.Error())
	}
	return name, value, nil
}

// prepare reads the request's framing and connection headers into req and sets up its body.
func (c *conn) prepare(req *http.Request) (*body, *Refusal) {
	h := req.Header
	hosts := h["Host"]
	switch {
	case len(hosts) > 1:
		return nil, badRequest("more than one Host header")
	case len(hosts) == 1:
		if !validHost(hosts[0]) {
			return nil, badRequest("malformed Host header")
		}
		req.Host = hosts[0]
	case req.ProtoMinor == 1:
		return nil, badRequest("missing Host header")
	}
	if req.URL.Host != "" { // absolute form names the host
		req.Host = req.URL.Host
	}
	delete(h, "Host")
	req.RemoteAddr = c.remoteAddr
	// HTTP/1.0 closes after the answer unless the client asked to keep the connection (ab -k,
	// older proxies); the answer then says it was kept.
	req.Close = httpwire.HasToken(h["Connection"], "close") || req.ProtoMinor == 0 && !httpwire.HasToken(h["Connection"], "keep-alive")

	b := &body{c: c}
	te, cls := h["Transfer-Encoding"], h["Content-Length"]
	switch {
	case len(te) > 0:
		if req.ProtoMinor == 0 {
			return nil, badRequest("Transfer-Encoding in an HTTP/1.0 request")
		}
		if len(cls) > 0 {
			return nil, badRequest("both Transfer-Encoding and Content-Length")
		}
		if len(te) != 1 || !strings.EqualFold(te[0], "chunked") {
			return nil, &Refusal{Status: http.StatusNotImplemented, Kind: RefusedTransferEncoding,
				Message: "only the chunked transfer coding is accepted"}
		}
		req.TransferEncoding = []string{"chunked"}
		delete(h, "Transfer-Encoding")
		req.ContentLength = -1
		b.chunked = httputil.NewChunkedReader(c.reader())
	case len(cls) > 0:
		n, ok := httpwire.ParseLength(cls[0])
		for _, v := range cls[1:] {
			if v != cls[0] {
				ok = false
			}
		}
		if !ok {
			return nil, badRequest("malformed Content-Length")
		}
		req.ContentLength, b.remaining = n, n
	}
	if req.ContentLength == 0 {
		b.eof = true
		req.Body = http.NoBody
	} else {
		req.Body = b
	}
	if ex := h["Expect"]; len(ex) > 0 {
		if len(ex) != 1 || !strings.EqualFold(ex[0], "100-continue") {
			return nil, &Refusal{Status: http.StatusExpectationFailed, Kind: RefusedExpectation,
				Message: "only Expect: 100-continue is understood"}
		}
		b.expect = req.ProtoMinor == 1 && !b.eof
	}
	return b, nil
}

func validHost(h string) bool {
	for i := 0; i < len(h); i++ {
		switch b := h[i]; {
		case b <= ' ' || b == 0x7f || b == '/' || b == '\\' || b == '"' || b == '<' || b == '>' || b == '{' || b == '}' || b == '|' || b == '^' || b == '`':
			return false
		}
	}
	return true
}

// names are the header names and values clients send on almost every request: matched
// without allocating.
var names = httpwire.NewNames([]string{"Host", "Content-Type", "Content-Length", "User-Agent", "Accept", "Accept-Encoding",
	"Authorization", "Connection", "Transfer-Encoding", "Expect", "Traceparent", "Tracestate", "X-Request-Id",
	"Openai-Organization", "Openai-Project", "X-Stainless-Lang", "Api-Key", "X-Api-Key"},
	[]string{"application/json", "keep-alive", "close", "*/*", "chunked", "100-continue",
		"gzip, deflate", "gzip, deflate, br", "gzip, deflate, zstd", "text/event-stream"}, nil)

func internMethod(m []byte) string {
	switch string(m) {
	case "POST":
		return http.MethodPost
	case "GET":
		return http.MethodGet
	case "HEAD":
		return http.MethodHead
	case "DELETE":
		return http.MethodDelete
	case "PATCH":
		return http.MethodPatch
	case "PUT":
		return http.MethodPut
	case "OPTIONS":
		return http.MethodOptions
	}
	return string(m)
}
