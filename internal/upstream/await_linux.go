//go:build linux

package upstream

import (
	"syscall"
	"unsafe"
)

// awaitData waits until the engine has sent something or closed, holding no read buffer
// meanwhile: an open stream between two events costs no 4 KiB. It asks the kernel with a
// one-byte MSG_PEEK (nothing is consumed; the read that follows takes the bytes), which also
// makes the runtime's poller safe to park on: a peek is tried before every wait. Read
// deadlines (the request's cancellation) and Close end the wait as they end a Read; the read
// that follows reports them.
func (c *conn) awaitData() {
	if c.raw == nil || c.br.Buffered() > 0 {
		return
	}
	c.dropReader()
	_ = c.raw.Read(peek)
	c.takeReader()
}

// peek reports whether fd has a byte to read, or an end or error to report (true), or nothing
// yet (false: the poller waits for it).
func peek(fd uintptr) bool {
	var b [1]byte
	_, _, errno := syscall.Syscall6(syscall.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&b[0])), 1, syscall.MSG_PEEK|syscall.MSG_DONTWAIT, 0, 0)
	return errno != syscall.EAGAIN && errno != syscall.EINTR
}

// pending asks the kernel, without waiting, whether c has a byte to read or an end or error to
// report; ok false when it could not ask.
func (c *conn) pending() (pending, ok bool) {
	err := c.raw.Read(func(fd uintptr) bool {
		pending = peek(fd)
		return true // one look, never a wait
	})
	return pending, err == nil
}
