//go:build linux

package httpwire

import (
	"syscall"
	"unsafe"
)

// Awaits says whether AwaitData waits here (the one-byte peek is available).
const Awaits = true

// AwaitData waits until raw's descriptor has a byte to read, or an end or error to report,
// without reading it: the caller holds no read buffer while it waits (an open stream between
// two events, a kept-alive connection between two requests). It asks the kernel with a
// one-byte MSG_PEEK (nothing is consumed; the read that follows takes the bytes), which also
// makes the runtime's poller safe to park on: a peek is tried before every wait. Read deadlines
// and Close end the wait as they end a Read, and it returns their error.
func AwaitData(raw syscall.RawConn) error { return raw.Read(peek) }

// Pending asks the kernel, without waiting, whether raw's descriptor has a byte to read or an
// end or error to report; ok false when it could not ask.
func Pending(raw syscall.RawConn) (pending, ok bool) {
	err := raw.Read(func(fd uintptr) bool {
		pending = peek(fd)
		return true // one look, never a wait
	})
	return pending, err == nil
}

// peek reports whether fd has a byte to read, or an end or error to report (true), or nothing
// yet (false: the poller waits for it).
func peek(fd uintptr) bool {
	var b [1]byte
	_, _, errno := syscall.Syscall6(syscall.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&b[0])), 1, syscall.MSG_PEEK|syscall.MSG_DONTWAIT, 0, 0)
	return errno != syscall.EAGAIN && errno != syscall.EINTR
}
