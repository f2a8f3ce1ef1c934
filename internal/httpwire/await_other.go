//go:build !linux

package httpwire

import (
	"errors"
	"net"
	"syscall"
)

// Awaits says whether FillWaiting waits holding no buffer here: it does not.
const Awaits = false

// FillWaiting is not used where the descriptor cannot be read from inside the poller's wait:
// the caller's read waits, with its buffer.
func FillWaiting(raw syscall.RawConn, src *Source) error {
	_, err := src.Take().Peek(1)
	return err
}

// readNow is never called here (FillWaiting does not read the descriptor itself).
func readNow(fd uintptr, p []byte) (int, error) { return 0, syscall.EINVAL }

// Pending cannot ask the kernel here: ok false.
func Pending(raw syscall.RawConn) (pending, ok bool) { return false, false }

// WriteAwaiting writes head, then body (nil for none), to src.Conn; the caller's read waits for
// the answer, with its buffer, and check is the caller's to make before (Awaits is false here).
// written is false when the request was not written whole.
func WriteAwaiting(raw syscall.RawConn, src *Source, head, body []byte, check bool) (written bool, err error) {
	if body == nil {
		_, err = src.Conn.Write(head)
	} else {
		bufs := net.Buffers{head, body}
		_, err = bufs.WriteTo(src.Conn)
	}
	if err == nil && src.Sent != nil {
		src.Sent()
	}
	return err == nil, err
}

// ErrStrayBytes and ErrStrayEnd are never returned here: WriteAwaiting does not check.
var (
	ErrStrayBytes = errors.New("httpwire: the peer sent bytes before the request")
	ErrStrayEnd   = errors.New("httpwire: the peer closed before the request")
)
