package httpwire

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"math/rand"
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

// drainWaiting reads everything the peer sends the way the owners of a pooled buffer do: while the
// buffer is empty it is given back and FillWaiting waits for more; what came is taken from the
// buffer. It returns the bytes and the error that ended the stream.
func drainWaiting(t *testing.T, c *net.TCPConn, w *waiter) ([]byte, error) {
	t.Helper()
	var out []byte
	for {
		if w.br != nil && w.br.Buffered() == 0 {
			w.give()
		}
		if w.br == nil {
			if err := w.fill(t, c); err != nil {
				return out, err
			}
		}
		if _, err := w.br.Peek(1); err != nil {
			return out, err
		}
		n := w.br.Buffered()
		p, _ := w.br.Peek(n)
		out = append(out, p...)
		w.br.Discard(n)
	}
}

// Every byte arrives once and in order, whatever the write pattern: many tiny writes with pauses
// (each a separate wake-up), and a blob larger than the buffer (read past the wait by the plain
// reads that follow).
func TestFillWaitingByteExactUnderAnyWritePattern(t *testing.T) {
	c, peer := tcpPair(t)
	w := newWaiter(c)
	rng := rand.New(rand.NewSource(1))
	var want bytes.Buffer
	for i := 0; i < 600; i++ {
		n := 1 + rng.Intn(7)
		for j := 0; j < n; j++ {
			want.WriteByte(byte(rng.Intn(256)))
		}
	}
	big := make([]byte, 100<<10)
	rng.Read(big)
	go func() {
		all := want.Bytes()
		off := 0
		r := rand.New(rand.NewSource(2))
		for off < len(all) {
			n := min(1+r.Intn(7), len(all)-off)
			peer.Write(all[off : off+n])
			off += n
			if r.Intn(10) == 0 {
				time.Sleep(time.Millisecond)
			}
		}
		time.Sleep(5 * time.Millisecond)
		peer.Write(big)
		peer.CloseWrite()
	}()
	exp := append(append([]byte(nil), want.Bytes()...), big...)
	got, err := drainWaiting(t, c, w)
	if err != io.EOF {
		t.Errorf("the stream ended with %v, want io.EOF", err)
	}
	if !bytes.Equal(got, exp) {
		i := 0
		for i < len(got) && i < len(exp) && got[i] == exp[i] {
			i++
		}
		t.Fatalf("got %d bytes, want %d; first difference at %d", len(got), len(exp), i)
	}
	if w.gives == 0 {
		t.Error("the buffer was never given back while nothing had come")
	}
}

// Close from another goroutine, and a deadline moved into the past from another goroutine (as
// internal/upstream's cancellation does), end a wait at once, holding no buffer.
func TestFillWaitingEndsOnCloseAndOnADeadlineSetMeanwhile(t *testing.T) {
	for _, how := range []string{"close", "deadline"} {
		t.Run(how, func(t *testing.T) {
			c, _ := tcpPair(t)
			w := newWaiter(c)
			time.AfterFunc(50*time.Millisecond, func() {
				if how == "close" {
					c.Close()
				} else {
					c.SetDeadline(time.Unix(1, 0))
				}
			})
			done := make(chan error, 1)
			raw, err := c.SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			go func() { done <- FillWaiting(raw, &w.src) }()
			select {
			case err := <-done:
				if err == nil {
					t.Errorf("the wait ended with no error")
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the wait did not end")
			}
			if w.br != nil {
				t.Error("a buffer is held after the wait ended without data")
			}
		})
	}
}

// plainReadErr is the error a plain read of a connection whose peer reset it reports.
func plainReadErr(t *testing.T) error {
	c, peer := tcpPair(t)
	peer.SetLinger(0)
	peer.Close()
	time.Sleep(20 * time.Millisecond)
	_, err := c.Read(make([]byte, 16))
	return err
}

// The reset met inside the wait is reported as a plain read reports it. A plain read gives a
// *net.OpError ("read tcp a->b: connection reset by peer"); callers tell the engine's transport
// failures by that type (proxy.safeCause names "op: err" for a *net.OpError and otherwise says
// the answer "is not valid HTTP/1.1").
func TestFillWaitingResetIsReportedAsAPlainReadWould(t *testing.T) {
	plain := plainReadErr(t)
	if !errors.Is(plain, syscall.ECONNRESET) {
		t.Fatalf("a plain read after a reset gave %v, want ECONNRESET", plain)
	}
	c, peer := tcpPair(t)
	w := newWaiter(c)
	time.AfterFunc(20*time.Millisecond, func() { peer.SetLinger(0); peer.Close() })
	if err := w.fill(t, c); err != nil {
		t.Fatal(err)
	}
	_, err := w.br.Peek(1)
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("after the wait: %v, want ECONNRESET", err)
	}
	var opPlain, opWait *net.OpError
	if errors.As(plain, &opPlain) && !errors.As(err, &opWait) {
		t.Errorf("a plain read reports %T %q; the read after FillWaiting reports %T %q", plain, plain, err, err)
	}
}

// echoPeer answers every request it reads with answer, at once: the answer can come before the
// writer of the request would have armed a wait after its write.
func echoPeer(t *testing.T, peer *net.TCPConn, request, answer string) {
	t.Helper()
	go func() {
		buf := make([]byte, len(request))
		for {
			if _, err := io.ReadFull(peer, buf); err != nil {
				return
			}
			if string(buf) != request {
				peer.Close()
				return
			}
			peer.Write([]byte(answer))
		}
	}()
}

// WriteAwaiting writes the request and returns with the answer buffered, however soon it came,
// having taken the buffer once: no look at the descriptor before the wait (which would take the
// buffer, find nothing and give it back).
func TestWriteAwaitingWaitsForTheAnswerWithoutALookFirst(t *testing.T) {
	c, peer := tcpPair(t)
	echoPeer(t, peer, "request", "answer")
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	w := newWaiter(c)
	for i := range 200 {
		written, err := WriteAwaiting(raw, &w.src, []byte("req"), []byte("uest"), false)
		if !written || err != nil {
			t.Fatalf("exchange %d: written %v, %v", i, written, err)
		}
		if w.takes != i+1 || w.gives != 0 {
			t.Fatalf("exchange %d: the buffer was taken %d and given back %d times; want once and never", i, w.takes, w.gives)
		}
		got := make([]byte, len("answer"))
		if _, err := io.ReadFull(w.br, got); err != nil || string(got) != "answer" {
			t.Fatalf("exchange %d: read %q, %v", i, got, err)
		}
		w.give()
		w.gives--
	}
}

// A request the connection could not take is reported as not written, with the write's error; a
// deadline that ends the wait after the request left is the wait's error, the request written.
func TestWriteAwaitingTellsTheWriteFromTheWait(t *testing.T) {
	c, peer := tcpPair(t)
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	w := newWaiter(c)
	c.SetReadDeadline(time.Now().Add(30 * time.Millisecond))
	written, err := WriteAwaiting(raw, &w.src, []byte("unanswered"), nil, false)
	if !written || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("no answer before the read deadline: written %v, %v; want written, the deadline's error", written, err)
	}
	if w.br != nil {
		t.Error("a buffer is held after a wait in which nothing came")
	}
	got := make([]byte, len("unanswered"))
	if _, err := io.ReadFull(peer, got); err != nil || string(got) != "unanswered" {
		t.Errorf("the peer read %q, %v", got, err)
	}

	c.SetReadDeadline(time.Time{})
	c.SetWriteDeadline(time.Unix(1, 0))
	written, err = WriteAwaiting(raw, &w.src, []byte("late"), nil, false)
	if written || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("past the write deadline: written %v, %v; want not written, the deadline's error", written, err)
	}

	c.Close()
	written, err = WriteAwaiting(raw, &w.src, []byte("closed"), nil, false)
	if written || err == nil {
		t.Errorf("on a closed connection: written %v, %v; want not written, an error", written, err)
	}
}

// A body larger than the socket's buffers is written whole (the write waits for room inside the
// read wait), beside its head, and the answer to it is read.
func TestWriteAwaitingWritesALargeBodyWhole(t *testing.T) {
	c, peer := tcpPair(t)
	body := bytes.Repeat([]byte("0123456789abcdef"), 1<<18) // 4 MiB
	got := make(chan []byte, 1)
	go func() {
		all := make([]byte, len("head")+len(body))
		_, err := io.ReadFull(peer, all)
		if err == nil {
			peer.Write([]byte("ok"))
		}
		got <- all
	}()
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	w := newWaiter(c)
	if written, err := WriteAwaiting(raw, &w.src, []byte("head"), body, false); !written || err != nil {
		t.Fatalf("written %v, %v", written, err)
	}
	if all := <-got; string(all[:4]) != "head" || !bytes.Equal(all[4:], body) {
		t.Error("the peer did not read the head and the body whole, in order")
	}
	if b, err := w.br.Peek(2); string(b) != "ok" || err != nil {
		t.Errorf("answer %q, %v", b, err)
	}
}

// With check, what the peer sent or did before the request — bytes unasked, a close, a close of
// its sending side only — is found before a byte of the request is written, and the request is
// not written: the wait would otherwise never hear of it (readiness is reset when the wait is
// armed). With nothing there the request goes as without the check.
func TestWriteAwaitingChecksBeforeItWrites(t *testing.T) {
	for _, tc := range []struct {
		name   string
		before func(peer *net.TCPConn)
		want   error
	}{
		{"bytes", func(peer *net.TCPConn) { peer.Write([]byte("HTTP/1.1 200 OK\r\n")) }, ErrStrayBytes},
		{"close", func(peer *net.TCPConn) { peer.Close() }, ErrStrayEnd},
		{"half close", func(peer *net.TCPConn) { peer.CloseWrite() }, ErrStrayEnd},
		{"reset", func(peer *net.TCPConn) { peer.SetLinger(0); peer.Close() }, ErrStrayEnd},
		{"nothing", func(*net.TCPConn) {}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, peer := tcpPair(t)
			tc.before(peer)
			time.Sleep(20 * time.Millisecond) // arrived, and its wake-up spent before the wait is armed
			raw, err := c.SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			w := newWaiter(c)
			if tc.want == nil {
				echoPeer(t, peer, "request", "answer")
			}
			written, err := WriteAwaiting(raw, &w.src, []byte("request"), nil, true)
			if written != (tc.want == nil) || !errors.Is(err, tc.want) {
				t.Fatalf("written %v, %v; want written %v, %v", written, err, tc.want == nil, tc.want)
			}
			if tc.want != nil {
				peer.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
				if n, _ := peer.Read(make([]byte, 16)); n > 0 {
					t.Errorf("the peer read %d bytes of a request that should not have been written", n)
				}
				return
			}
			if b, err := w.br.Peek(len("answer")); string(b) != "answer" || err != nil {
				t.Errorf("answer %q, %v", b, err)
			}
		})
	}
}
