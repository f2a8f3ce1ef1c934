package httpwire

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net/http/httputil"
	"strings"
	"testing"
)

func reader(s string) *bufio.Reader { return bufio.NewReaderSize(strings.NewReader(s), 16) }

func TestReadLine(t *testing.T) {
	for _, c := range []struct {
		in     string
		crlf   bool
		budget int
		line   string
		err    error
	}{
		{"GET / HTTP/1.1\r\n", false, 100, "GET / HTTP/1.1", nil},
		{"a: b\n", false, 100, "a: b", nil},
		{"a: b\n", true, 100, "", ErrBareLF},
		{"a\rb\r\n", true, 100, "a\rb", nil}, // a CR inside stays, for the field checks
		{"", false, 100, "", io.EOF},
		{"cut", false, 100, "", io.ErrUnexpectedEOF},
		{strings.Repeat("x", 40) + "\r\n", false, 41, "", ErrTooLong}, // longer than the buffer, past the budget
		{strings.Repeat("x", 40) + "\r\n", false, 42, strings.Repeat("x", 40), nil},
	} {
		budget := c.budget
		line, err := ReadLine(reader(c.in), &budget, c.crlf)
		if string(line) != c.line || !errors.Is(err, c.err) {
			t.Errorf("%q crlf=%v: %q %v, want %q %v", c.in, c.crlf, line, err, c.line, c.err)
		}
		if err == nil && budget != c.budget-len(c.in) {
			t.Errorf("%q: budget %d left of %d", c.in, budget, c.budget)
		}
	}
}

func TestSplitField(t *testing.T) {
	for _, c := range []struct {
		line, name, value string
		err               error
	}{
		{"Content-Type: application/json", "Content-Type", "application/json", nil},
		{"X:  \tpadded\t ", "X", "padded", nil},
		{"X:", "X", "", nil},
		{" folded", "", "", ErrFolded},
		{"Bad Name: x", "", "", ErrFieldName},
		{"X : x", "", "", ErrFieldName},
		{": x", "", "", ErrFieldName},
		{"X: a\rb", "", "", ErrFieldValue},
		{"X: a\x00b", "", "", ErrFieldValue},
		{"X: caf\xc3\xa9", "X", "caf\xc3\xa9", nil}, // obs-text passes
	} {
		name, value, err := SplitField([]byte(c.line))
		if string(name) != c.name || string(value) != c.value || err != c.err {
			t.Errorf("%q: %q %q %v", c.line, name, value, err)
		}
	}
}

// decodeChunked decodes a chunked body with the codec, as upstream does.
func decodeChunked(in []byte) ([]byte, error) {
	br := bufio.NewReader(bytes.NewReader(in))
	var out []byte
	for {
		n, err := ReadChunkSize(br)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			if err := SkipTrailers(br, 64<<10); err != nil {
				return nil, err
			}
			return out, nil
		}
		if n > 1<<20 {
			return nil, errors.New("too large for the test")
		}
		chunk := make([]byte, n)
		if _, err := io.ReadFull(br, chunk); err != nil {
			return nil, err
		}
		out = append(out, chunk...)
		if err := ReadChunkEnd(br); err != nil {
			return nil, err
		}
	}
}

func TestChunked(t *testing.T) {
	for _, c := range []struct {
		in, out string
		ok      bool
	}{
		{"3\r\nabc\r\n0\r\n\r\n", "abc", true},
		{"3;ext=1\r\nabc\r\n0\r\nX-T: 1\r\n\r\n", "abc", true},
		{"3\nabc\r\n0\r\n\r\n", "", false},      // bare LF in framing
		{"+3\r\nabc\r\n0\r\n\r\n", "", false},   // a sign
		{" 3\r\nabc\r\n0\r\n\r\n", "", false},   // leading space
		{"3\r\nabcX\r\n0\r\n\r\n", "", false},   // data past the size
		{"0\r\nBad Name: 1\r\n\r\n", "", false}, // a malformed trailer
		{"10000000000000000\r\n", "", false},    // sixteen digits
		{"3\r\nabc\r\n0\r\n", "", false},        // the trailer section never ends
	} {
		out, err := decodeChunked([]byte(c.in))
		if (err == nil) != c.ok || string(out) != c.out {
			t.Errorf("%q: %q %v", c.in, out, err)
		}
	}
}

// Whatever chunked body the codec decodes whole, net/http's chunked reader decodes to the same
// bytes: the codec is never laxer than the standard library.
func FuzzChunkedAgainstNetHTTP(f *testing.F) {
	for _, s := range []string{"3\r\nabc\r\n0\r\n\r\n", "3;x\r\nabc\r\n0\r\nA: b\r\n\r\n", "a\r\n0123456789\r\n0\r\n\r\n", "3\nabc\n0\n\n", "0 \r\n\r\n"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		ours, err := decodeChunked(in)
		if err != nil {
			return
		}
		std, serr := io.ReadAll(httputil.NewChunkedReader(bytes.NewReader(in)))
		if serr != nil || !bytes.Equal(ours, std) {
			t.Fatalf("%q: the codec decoded %q, net/http %q (%v)", in, ours, std, serr)
		}
	})
}
