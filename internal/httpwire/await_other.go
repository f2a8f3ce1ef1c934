//go:build !linux

package httpwire

import (
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

// writevNow is never called here (Writer writes to the connection).
func writevNow(fd uintptr, parts [][]byte) ([][]byte, error) { return parts, syscall.EINVAL }

// Pending cannot ask the kernel here: ok false.
func Pending(raw syscall.RawConn) (pending, ok bool) { return false, false }

// WriteAwaiting writes head, then body (nil for none), to src.Conn; the caller's read waits for
// the answer, with its buffer, and check is the caller's to make before (Awaits is false here).
// written is false when the request was not written whole.
func WriteAwaiting(raw syscall.RawConn, src *Source, head, body []byte, check bool) (written bool, err error) {
	err = WriteParts(src.Conn, head, body)
	if err == nil && src.Sent != nil {
		src.Sent()
	}
	return err == nil, err
}
