package httpwire

import (
	"bufio"
	"errors"
	"net"
	"os"
	"syscall"
)

// Source is what a connection's pooled read buffer reads from: the connection, or — inside
// FillWaiting's wait, where the connection's own Read would wait for the poller that is already
// waiting — its descriptor, read at once. An end or error FillWaiting met is the next read's.
//
// Take gives the connection's read buffer (reading this Source), taking one from its pool when
// it holds none; Give gives it back. Both are set once, with Conn, when the connection is made:
// a wait allocates nothing.
type Source struct {
	Conn net.Conn
	Take func() *bufio.Reader
	Give func()
	// Sent, when set, runs once WriteAwaiting wrote its request whole, before the wait; false
	// ends WriteAwaiting there, nothing read.
	Sent func() bool

	look   func(fd uintptr) bool // FillWaiting's look at the descriptor, made once
	send   func(fd uintptr) bool // WriteAwaiting's write, then its looks, made once
	out    [2][]byte             // what WriteAwaiting writes: a head and a body (nil when none)
	w      Writer                // WriteAwaiting's writer, made once
	check  bool                  // WriteAwaiting's look for stray bytes before the write
	wrote  bool
	werr   error
	fd     uintptr
	direct bool
	err    error
}

func (s *Source) Read(p []byte) (int, error) {
	switch {
	case s.direct:
		return readNow(s.fd, p)
	case s.err != nil:
		err := s.err
		s.err = nil
		return 0, err
	}
	return s.Conn.Read(p)
}

// asRead is err, read off the descriptor itself, as the connection's Read reports it: a
// *net.OpError naming the connection and the system call (callers tell an engine's transport
// failures by it), io.EOF as it is.
func (s *Source) asRead(err error) error { return connError(s.Conn, "read", err) }

// connError is err, a system call op failing on conn's descriptor, as the connection reports
// its own: a *net.OpError naming the connection, op and the call; err as it is when it is not
// the call's errno.
func connError(conn net.Conn, op string, err error) error {
	errno, ok := err.(syscall.Errno)
	if !ok {
		return err
	}
	return &net.OpError{Op: op, Net: conn.LocalAddr().Network(), Source: conn.LocalAddr(), Addr: conn.RemoteAddr(), Err: os.NewSyscallError(op, errno)}
}

// WriteParts writes head, then body (nil for none) beside it, uncopied, to c.
func WriteParts(c net.Conn, head, body []byte) error {
	if body == nil {
		return writeConn(c, head)
	}
	return writeConn(c, head, body)
}

// writeConn writes parts to c whole and in order, waiting for room as its writes do: one Write
// for one part, else net.Buffers (one writev where the platform has it) over a copy of parts,
// which is left as it was.
func writeConn(c net.Conn, parts ...[]byte) error {
	if len(parts) == 1 {
		_, err := c.Write(parts[0])
		return err
	}
	bufs := make(net.Buffers, len(parts))
	copy(bufs, parts)
	_, err := bufs.WriteTo(c)
	return err
}

// ErrStrayBytes and ErrStrayEnd are WriteAwaiting's check finding, before the request was
// written, bytes the peer sent unasked, or its close (or a reset); never returned where
// WriteAwaiting does not check (Awaits false).
var (
	ErrStrayBytes = errors.New("httpwire: the peer sent bytes before the request")
	ErrStrayEnd   = errors.New("httpwire: the peer closed before the request")
)
