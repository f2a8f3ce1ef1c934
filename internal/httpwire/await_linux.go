//go:build linux

package httpwire

import (
	"io"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Awaits says whether FillWaiting waits holding no buffer here (the descriptor can be read
// from inside the runtime poller's wait).
const Awaits = true

// FillWaiting waits until the read buffer src.Take gives has bytes from raw's descriptor, or an
// end or error to report, without holding one while nothing has come (an open stream between
// two events, a kept-alive connection between two requests): before every wait of the runtime's
// poller, a buffer is taken whose read reads the descriptor at once, without waiting; when
// nothing was there, it is given back (src.Give). What it read stays in the buffer: one system
// call per wake-up, where a peek would be followed by the read. An end or error is kept in src
// for the buffer's next read, as the connection's Read would report it. Read deadlines and Close
// end the wait, and it returns their error.
func FillWaiting(raw syscall.RawConn, src *Source) error {
	if src.look == nil {
		src.look = src.lookAt
	}
	return raw.Read(src.look)
}

// WriteAwaiting writes head, then body (nil for none), to src.Conn and then waits as FillWaiting
// does for what the peer sends back. The write runs inside the poller's read wait, after the wait
// was armed, so an answer that comes as soon as the request left still ends it, and the look at
// the descriptor a read makes before it waits — which finds nothing this soon after a request —
// is not made: one system call fewer per exchange. It is for a request's answer only: what the
// peer sent before the wait was armed would raise no wake-up. So with check (a connection that
// was idle, where the peer may have sent something or closed meanwhile) the descriptor is looked
// at first, inside the armed wait, and the request is not written when anything is there
// (ErrStrayBytes, ErrStrayEnd). The caller must hold no read buffer with bytes in it. src.Sent,
// when set, runs between the write and the wait. written is false when the request was not
// written whole, err then saying why; once it was, err is the wait's end (a deadline, a close),
// which the buffer's next read reports again.
func WriteAwaiting(raw syscall.RawConn, src *Source, head, body []byte, check bool) (written bool, err error) {
	if src.send == nil {
		src.send = src.sendThenLook
		src.w.Init(src.Conn, raw)
	}
	src.out, src.check, src.wrote, src.werr = [2][]byte{head, body}, check, false, nil
	err = raw.Read(src.send)
	written, werr := src.wrote, src.werr
	src.out, src.werr = [2][]byte{}, nil // a write that failed left them
	switch {
	case werr != nil:
		return false, werr
	case !written && err == nil:
		return false, io.ErrShortWrite
	}
	return written, err
}

// sendThenLook writes the request on its first call (after the check, if asked), then looks at
// the descriptor as lookAt does.
func (s *Source) sendThenLook(fd uintptr) bool {
	if s.wrote {
		return s.lookAt(fd)
	}
	if s.check {
		s.check = false
		switch peekKind(fd) {
		case peekBytes:
			s.werr = ErrStrayBytes
			return true
		case peekEnd:
			s.werr = ErrStrayEnd
			return true
		}
	}
	s.wrote = true
	s.werr = s.w.Write(s.out[0], s.out[1]) // the write deadline holds; a full socket waits for room
	s.out = [2][]byte{}                    // the wait keeps nothing of the request: Sent may give its buffer back
	if s.werr != nil {
		s.wrote = false
		return true
	}
	if s.Sent != nil && !s.Sent() {
		return true
	}
	return false // written: the answer cannot have come yet, so wait for it before looking
}

// lookAt is one look at the descriptor: true when the buffer holds what came, or an end or error
// was kept; false, the buffer given back, when nothing was there.
func (s *Source) lookAt(fd uintptr) bool {
	s.fd, s.direct = fd, true
	_, err := s.Take().Peek(1)
	s.direct = false
	if err == syscall.EAGAIN {
		s.Give()
		return false
	}
	if err != nil {
		s.err = s.asRead(err)
	}
	return true
}

// readNow reads fd once, without waiting (Go's descriptors are non-blocking): EAGAIN when
// nothing is there.
func readNow(fd uintptr, p []byte) (int, error) {
	for {
		n, errno := sysRead(fd, p)
		switch {
		case errno == syscall.EINTR:
			continue
		case errno != 0:
			return 0, errno
		case n == 0 && len(p) > 0:
			return 0, io.EOF
		}
		return n, nil
	}
}

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
// yet (false).
func peek(fd uintptr) bool { return peekKind(fd) != peekNothing }

const (
	peekNothing = iota // nothing yet
	peekBytes          // a byte to read
	peekEnd            // an end, or an error, to report
)

// peekKind looks at fd without reading or waiting.
func peekKind(fd uintptr) int {
	var b [1]byte
	for {
		n, _, errno := syscall.RawSyscall6(syscall.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&b[0])), 1, syscall.MSG_PEEK|syscall.MSG_DONTWAIT, 0, 0)
		switch {
		case errno == syscall.EINTR:
			continue
		case errno == syscall.EAGAIN:
			return peekNothing
		case errno == 0 && n > 0:
			return peekBytes
		}
		return peekEnd
	}
}

// writevNow writes parts to fd in order, without waiting, in as few raw system calls as the
// socket takes them; it returns the parts left (a suffix of parts, its first one trimmed of
// what was written of it), with EAGAIN when the socket took no more, or the call's error.
func writevNow(fd uintptr, parts [][]byte) ([][]byte, error) {
	var iov [4]unix.Iovec
	for {
		for len(parts) > 0 && len(parts[0]) == 0 {
			parts = parts[1:]
		}
		if len(parts) == 0 {
			return nil, nil
		}
		k := 0
		for _, p := range parts {
			if k == len(iov) {
				break
			}
			if len(p) > 0 {
				iov[k].Base = &p[0]
				iov[k].SetLen(len(p))
				k++
			}
		}
		r, errno := sysWritev(fd, iov[:k])
		switch {
		case errno == syscall.EINTR:
			continue
		case errno != 0:
			return parts, errno
		case r == 0:
			return parts, io.ErrShortWrite // a socket that takes nothing without saying EAGAIN
		}
		for n := r; n > 0; {
			if n < len(parts[0]) {
				parts[0] = parts[0][n:]
				break
			}
			n -= len(parts[0])
			parts = parts[1:]
		}
	}
}
