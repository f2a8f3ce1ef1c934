package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
)

// pipeConn serves bytes as a connection's reads.
type pipeConn struct {
	net.Conn
	r io.Reader
}

func (p pipeConn) Read(b []byte) (int, error) { return p.r.Read(b) }
func (p pipeConn) Close() error               { return nil }

func frame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		h := make([]byte, 9)
		h[0] = flags | 0x02
		binary.BigEndian.PutUint64(h[1:], uint64(len(body)))
		return append(h, body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

func readAll(t *testing.T, stream []byte, max int64) ([]byte, error) {
	t.Helper()
	f := &frameCap{Conn: pipeConn{r: bytes.NewReader(stream)}, max: max}
	var out bytes.Buffer
	buf := make([]byte, 7) // small reads: headers split across them
	for {
		n, err := f.Read(buf)
		out.Write(buf[:n])
		if err == io.EOF {
			return out.Bytes(), nil
		}
		if err != nil {
			return out.Bytes(), err
		}
	}
}

func TestFrameCap(t *testing.T) {
	greeting := bytes.Repeat([]byte{0xff}, 64)
	ok := append(append(append([]byte{}, greeting...), frame(0x04, []byte("\x05READY"))...), frame(0x01, []byte("topic"))...)
	ok = append(ok, frame(0x01, make([]byte, 8))...)
	ok = append(ok, frame(0, bytes.Repeat([]byte("p"), 1000))...)
	got, err := readAll(t, ok, 4096)
	if err != nil || !bytes.Equal(got, ok) {
		t.Fatalf("a well-formed stream was altered or refused: %v", err)
	}
	// A frame claiming 2^40 bytes is refused before any of it is delivered.
	huge := append(append([]byte{}, greeting...), 0x02, 0, 0, 1, 0, 0, 0, 0, 0)
	if _, err := readAll(t, huge, 4096); !errors.Is(err, errTooLarge) {
		t.Fatalf("huge frame: %v", err)
	}
	// So is a message of many frames that together exceed the bound.
	many := append([]byte{}, greeting...)
	for i := 0; i < 40; i++ {
		many = append(many, frame(0x01, make([]byte, 200))...)
	}
	if _, err := readAll(t, many, 4096); !errors.Is(err, errTooLarge) {
		t.Fatalf("many frames: %v", err)
	}
}
