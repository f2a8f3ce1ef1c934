//go:build linux && !race

package httpwire

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// The descriptor's raw calls. Each asks for no wait by its own flag (MSG_DONTWAIT), whatever
// the descriptor's mode: a raw call that waited would hold the runtime's processor, and the
// next stop of every goroutine (a collection's) would wait for it. Go's sockets are
// non-blocking, but a dup of one made blocking (os.File's Fd) makes it blocking too.

// sysRead reads fd into p with a raw system call: the runtime is not told of it (Writer says
// why).
func sysRead(fd uintptr, p []byte) (int, unix.Errno) {
	var buf unsafe.Pointer
	if len(p) > 0 {
		buf = unsafe.Pointer(&p[0])
	}
	n, _, errno := unix.RawSyscall6(unix.SYS_RECVFROM, fd, uintptr(buf), uintptr(len(p)), unix.MSG_DONTWAIT, 0, 0)
	return int(n), errno
}

// sysWritev writes iov to fd with a raw system call, as sysRead reads; a peer gone is EPIPE,
// never a signal (MSG_NOSIGNAL).
func sysWritev(fd uintptr, iov []unix.Iovec) (int, unix.Errno) {
	var msg unix.Msghdr
	msg.Iov = &iov[0]
	msg.SetIovlen(len(iov))
	n, _, errno := unix.RawSyscall(unix.SYS_SENDMSG, fd, uintptr(unsafe.Pointer(&msg)), unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
	return int(n), errno
}
