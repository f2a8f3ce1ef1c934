//go:build linux && race

package httpwire

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Under the race detector the descriptor is read and written through the syscall package's
// calls, which tell the detector that what a socket's write sent happens before what a read of
// its peer received (a test's client and Baton's server share memory through that order): the
// raw calls do not. The steps around them are the same; the raw calls themselves run in the
// tests without the detector (the README's test command) and in every end-to-end test's binary.
// These calls tell the runtime they may wait, so a descriptor in blocking mode holds a thread,
// not the process.

func sysRead(fd uintptr, p []byte) (int, unix.Errno) {
	n, err := syscall.Read(int(fd), p) // the syscall package's: the net package's writes use its order
	if err != nil {
		return 0, err.(unix.Errno)
	}
	return n, 0
}

// sysWritev writes iov's first part (its callers write the rest in turn).
func sysWritev(fd uintptr, iov []unix.Iovec) (int, unix.Errno) {
	n, err := syscall.Write(int(fd), unsafe.Slice(iov[0].Base, iov[0].Len))
	if err != nil {
		return 0, err.(unix.Errno)
	}
	return n, 0
}
