package httpwire

import (
	"net"
	"syscall"
)

// Writer writes a connection's outgoing bytes. Where it can (Linux, a bare socket: Awaits), it
// writes to the descriptor with a raw system call inside the connection's RawConn.Write, so that
// the runtime is not told a system call began and ended: on a writer whose process runs on one
// core, each told one lets the runtime's monitor thread wake every 20 µs while the process is
// busy, to take the processor from a call that lasts (loopback writes do the receiver's TCP
// work), and each taken one hands the processor to another thread. The call never waits
// (MSG_DONTWAIT, whatever the descriptor's mode); when the socket takes no more, RawConn.Write
// waits for room as the connection's Write would, deadlines and Close included. Elsewhere it
// writes to the connection. Its errors are the connection's: *net.OpError for a "write".
//
// A Writer is made once per connection (Init) and is one goroutine's at a time, as a
// bufio.Writer is; a Write allocates nothing.
type Writer struct {
	conn  net.Conn
	raw   syscall.RawConn // nil: write to conn
	fn    func(fd uintptr) bool
	parts [4][]byte
	rest  [][]byte // what is left to write of parts
	err   error    // the system call's failure, inside fn
}

// Init sets the connection w writes to; raw is its descriptor's, nil where conn is no bare
// socket (TLS above it, a wrapper that buffers): then w writes to conn.
func (w *Writer) Init(conn net.Conn, raw syscall.RawConn) {
	w.conn = conn
	if Awaits && raw != nil {
		w.raw, w.fn = raw, w.writeSome
	}
}

// Write writes parts whole, in order, in as few system calls as the socket takes them.
func (w *Writer) Write(parts ...[]byte) error {
	if w.raw == nil {
		return writeConn(w.conn, parts...)
	}
	op := "writev" // as the connection names its writes: net.Buffers', or one Write's
	if len(parts) == 1 {
		op = "write"
	}
	for len(parts) > 0 {
		k := copy(w.parts[:], parts)
		parts = parts[k:]
		w.rest, w.err = w.parts[:k], nil
		err := w.raw.Write(w.fn)
		w.rest = nil
		clear(w.parts[:]) // keep nothing of what was written
		if w.err != nil {
			return connError(w.conn, op, w.err)
		}
		if err != nil { // the wait's: a deadline passed, the connection closed
			if e, ok := err.(*net.OpError); ok && e.Op == "raw-write" {
				e.Op = op
			}
			return err
		}
	}
	return nil
}

// writeSome writes what the socket takes of w's parts now: true when all were written or the
// call failed (w.err), false to wait for room.
func (w *Writer) writeSome(fd uintptr) bool {
	var err error
	w.rest, err = writevNow(fd, w.rest)
	if err == syscall.EAGAIN {
		return false
	}
	w.err = err
	return true
}
