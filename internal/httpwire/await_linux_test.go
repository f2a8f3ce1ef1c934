package httpwire

import (
	"bufio"
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
)

// tcpPair is a connected loopback pair: the side FillWaiting reads, and its peer.
func tcpPair(t *testing.T) (*net.TCPConn, *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	peer, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); peer.Close() })
	return c.(*net.TCPConn), peer.(*net.TCPConn)
}

// waiter is one connection's pooled buffer as its owners keep it: taken for a look at the
// descriptor, given back when nothing had come.
type waiter struct {
	src          Source
	br           *bufio.Reader
	takes, gives int
}

func newWaiter(c net.Conn) *waiter {
	w := &waiter{}
	w.src = Source{Conn: c, Take: w.take, Give: w.give}
	return w
}

func (w *waiter) take() *bufio.Reader {
	if w.br == nil {
		w.takes++
		w.br = bufio.NewReaderSize(&w.src, 4096)
	}
	return w.br
}

func (w *waiter) give() { w.gives++; w.br = nil }

func (w *waiter) fill(t *testing.T, c *net.TCPConn) error {
	t.Helper()
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	return FillWaiting(raw, &w.src)
}

// What comes while FillWaiting waits is read into the buffer, every byte once, and no buffer is
// held while nothing has come: it was given back after the look that found nothing.
func TestFillWaitingReadsWhatCameHoldingNothingMeanwhile(t *testing.T) {
	c, peer := tcpPair(t)
	w := newWaiter(c)
	go func() {
		time.Sleep(50 * time.Millisecond)
		peer.Write([]byte("first bytes"))
	}()
	if err := w.fill(t, c); err != nil {
		t.Fatal(err)
	}
	if w.gives == 0 || w.br == nil {
		t.Errorf("the buffer was taken %d and given back %d times; want it given back while nothing had come, and held once bytes came", w.takes, w.gives)
	}
	if got := w.br.Buffered(); got != len("first bytes") {
		t.Errorf("%d bytes buffered, want %d", got, len("first bytes"))
	}
	peer.Write([]byte(", then more"))
	peer.CloseWrite()
	all, err := io.ReadAll(w.br)
	if string(all) != "first bytes, then more" || err != nil {
		t.Errorf("read %q, %v", all, err)
	}
}

// An end or an error met inside the wait is the buffer's next read's, as a read of the connection
// would have reported it: a close is io.EOF, a reset is ECONNRESET (not an EOF that would pass
// for a close).
func TestFillWaitingKeepsTheEndForTheNextRead(t *testing.T) {
	for _, end := range []string{"close", "reset"} {
		t.Run(end, func(t *testing.T) {
			c, peer := tcpPair(t)
			w := newWaiter(c)
			go func() {
				time.Sleep(20 * time.Millisecond)
				if end == "reset" {
					peer.SetLinger(0)
				}
				peer.Close()
			}()
			if err := w.fill(t, c); err != nil {
				t.Fatal(err)
			}
			_, err := w.br.Peek(1)
			switch {
			case end == "close" && err != io.EOF:
				t.Errorf("after the peer's close: %v, want io.EOF", err)
			case end == "reset" && !errors.Is(err, syscall.ECONNRESET):
				t.Errorf("after the peer's reset: %v, want ECONNRESET", err)
			}
		})
	}
}

// A read deadline ends the wait with its error, holding no buffer.
func TestFillWaitingEndsAtTheDeadline(t *testing.T) {
	c, _ := tcpPair(t)
	w := newWaiter(c)
	c.SetReadDeadline(time.Now().Add(30 * time.Millisecond))
	if err := w.fill(t, c); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("FillWaiting past the deadline: %v", err)
	}
	if w.br != nil {
		t.Error("a buffer is held after a wait in which nothing came")
	}
}
