// Package httpwire is the HTTP/1.1 codec Baton's own server (internal/h1) and its own upstream
// client (internal/upstream) share: lines, tokens, header fields, chunk sizes, trailers and
// list-valued headers, with one strictness — a message either side accepts, net/http's parser
// accepts too (both are fuzzed against it). It imports nothing of Baton's.
package httpwire

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"strconv"
	"strings"
)

// Errors of the codec; each side turns them into its own answer (a 400 or 431 to a client, a
// 502 for an engine's answer).
var (
	ErrTooLong    = errors.New("a line exceeds the bound of its section")
	ErrBareLF     = errors.New("a chunked framing line ends in a bare LF")
	ErrFolded     = errors.New("folded header lines (obs-fold) are not accepted")
	ErrFieldName  = errors.New("malformed header line")
	ErrFieldValue = errors.New("invalid byte in a header value")
	ErrChunkSize  = errors.New("malformed chunk size")
	ErrChunkEnd   = errors.New("malformed chunk end")
	ErrTrailer    = errors.New("malformed chunked trailer")
)

// ReadLine returns the next line without its line end, charging its bytes to *budget. CRLF ends
// a line; LF alone does too unless crlf is set (chunked framing, where a bare LF is a desync
// vector); any other CR stays in the line, for the field checks to refuse. The slice is valid
// until the next read. A stream that ends before the line's first byte returns io.EOF, inside
// it io.ErrUnexpectedEOF; past *budget, ErrTooLong.
func ReadLine(br *bufio.Reader, budget *int, crlf bool) ([]byte, error) {
	line, err := br.ReadSlice('\n')
	if err == bufio.ErrBufferFull { // longer than the buffer: gather it, within the budget
		long := append([]byte(nil), line...)
		for err == bufio.ErrBufferFull {
			if len(long) > *budget {
				return nil, ErrTooLong
			}
			line, err = br.ReadSlice('\n')
			long = append(long, line...)
		}
		line = long
	}
	if len(line) > *budget {
		return nil, ErrTooLong
	}
	if err != nil {
		if err == io.EOF && len(line) > 0 {
			return nil, io.ErrUnexpectedEOF
		}
		return nil, err
	}
	*budget -= len(line)
	line = line[:len(line)-1]
	if n := len(line); n > 0 && line[n-1] == '\r' {
		return line[:n-1], nil
	}
	if crlf {
		return nil, ErrBareLF
	}
	return line, nil
}

// IsToken reports whether b is an RFC 9110 token (a method, a header name, a transfer coding).
func IsToken[T string | []byte](b T) bool {
	if len(b) == 0 {
		return false
	}
	for i := 0; i < len(b); i++ {
		if c := b[i]; c >= 0x80 || !tokenChars[c] {
			return false
		}
	}
	return true
}

var tokenChars = func() (t [128]bool) {
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for c := 'a'; c <= 'z'; c++ {
		t[c], t[c-'a'+'A'] = true, true
	}
	for _, c := range "!#$%&'*+-.^_`|~" {
		t[c] = true
	}
	return t
}()

// ValidValue reports whether v may be a header field's value: no control character but HTAB
// (RFC 9110 field-vchar, obs-text allowed). A bare CR or a NUL relayed on would be a
// response-splitting vector.
func ValidValue[T string | []byte](v T) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < ' ' && c != '\t' || c == 0x7f {
			return false
		}
	}
	return true
}

// SplitField checks a header line ("Name: value") and returns its name and its value without
// the whitespace around it: a folded line, whitespace before the colon, a name that is no
// token and a value with a control character are refused.
func SplitField(line []byte) (name, value []byte, err error) {
	if len(line) > 0 && (line[0] == ' ' || line[0] == '\t') {
		return nil, nil, ErrFolded
	}
	i := bytes.IndexByte(line, ':')
	if i <= 0 || !IsToken(line[:i]) {
		return nil, nil, ErrFieldName
	}
	v := bytes.Trim(line[i+1:], " \t")
	if !ValidValue(v) {
		return nil, nil, ErrFieldValue
	}
	return line[:i], v, nil
}

// maxChunkLine bounds a chunk-size line, extensions included.
const maxChunkLine = 4 << 10

// ReadChunkSize reads a chunk-size line: 1 to 15 hex digits, optional whitespace and
// extensions, CRLF.
func ReadChunkSize(br *bufio.Reader) (int64, error) {
	budget := maxChunkLine
	line, err := ReadLine(br, &budget, true)
	if err != nil {
		return 0, eofIsCut(err)
	}
	if !ValidValue(line) { // a CR or another control byte in an extension
		return 0, ErrChunkSize
	}
	size, _, _ := bytes.Cut(bytes.TrimRight(line, " \t"), []byte(";"))
	if len(size) == 0 || len(size) > 15 {
		return 0, ErrChunkSize
	}
	for _, c := range size {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return 0, ErrChunkSize
		}
	}
	n, err := strconv.ParseInt(string(size), 16, 64)
	if err != nil {
		return 0, ErrChunkSize
	}
	return n, nil
}

// ReadChunkEnd reads the CRLF that ends a chunk's data.
func ReadChunkEnd(br *bufio.Reader) error {
	budget := 2
	line, err := ReadLine(br, &budget, true)
	switch {
	case err == nil && len(line) == 0:
		return nil
	case err == nil, err == io.EOF, err == io.ErrUnexpectedEOF, err == ErrTooLong:
		return ErrChunkEnd
	}
	return err
}

// SkipTrailers reads and drops a chunked body's trailer section up to its empty line, within
// budget bytes: each line ends in CRLF and is a well-formed header field.
func SkipTrailers(br *bufio.Reader, budget int) error {
	for {
		line, err := ReadLine(br, &budget, true)
		if err != nil {
			if err == ErrTooLong || err == ErrBareLF || err == io.EOF || err == io.ErrUnexpectedEOF {
				return ErrTrailer
			}
			return err
		}
		if len(line) == 0 {
			return nil
		}
		if _, _, err := SplitField(line); err != nil {
			return ErrTrailer
		}
	}
}

// ParseLength parses a Content-Length value: 1 to 18 decimal digits, nothing else (no sign,
// no whitespace, no list).
func ParseLength(s string) (int64, bool) {
	if s == "" || len(s) > 18 {
		return 0, false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, false
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, err == nil
}

// HasToken reports whether a comma-separated header's values name tok, case-insensitively
// (Connection: close, Transfer-Encoding: chunked).
func HasToken(values []string, tok string) bool {
	for _, v := range values {
		for part := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(part), tok) {
				return true
			}
		}
	}
	return false
}

func eofIsCut(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}
