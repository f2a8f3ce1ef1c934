//go:build unix

package gwtest

import (
	"fmt"
	"syscall"
	"testing"
)

// RefusingURL is the base URL of a loopback port on which every connection is refused, held for
// the whole test: a socket bound to it that never listens. A closed server's port is not that —
// a test running in parallel can be given it again and answer in the dead worker's place.
func RefusingURL(t testing.TB) string {
	t.Helper()
	syscall.ForkLock.RLock() // not inherited by a process started meanwhile (SOCK_CLOEXEC is not everywhere)
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err == nil {
		syscall.CloseOnExec(fd)
	}
	syscall.ForkLock.RUnlock()
	if err != nil {
		t.Fatalf("a socket to refuse connections: %v", err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatalf("binding a loopback port to refuse connections: %v", err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatalf("the refusing port: %v", err)
	}
	return fmt.Sprintf("http://127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
}
