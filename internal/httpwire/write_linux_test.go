//go:build linux

package httpwire

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"testing"
	"time"
)

// writer is a Writer on c: on its descriptor when raw, else on the connection.
func writer(t testing.TB, c *net.TCPConn, raw bool) *Writer {
	t.Helper()
	w := new(Writer)
	if !raw {
		w.Init(c, nil)
		return w
	}
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	w.Init(c, rc)
	if w.raw == nil {
		t.Fatal("a bare TCP socket on Linux is not written to by its descriptor")
	}
	return w
}

// slowReader reads everything peer is sent until it ends, a little at a time with pauses, so that
// the writer's socket fills and its writes wait for room.
func slowReader(peer *net.TCPConn, pause time.Duration) <-chan []byte {
	got := make(chan []byte, 1)
	go func() {
		var all bytes.Buffer
		buf := make([]byte, 4096)
		for {
			n, err := peer.Read(buf)
			all.Write(buf[:n])
			if err != nil {
				got <- all.Bytes()
				return
			}
			if pause > 0 {
				time.Sleep(pause)
			}
		}
	}()
	return got
}

// Parts are written whole and in order when the socket takes only some of them at a time: more
// parts than one call carries, empty ones among them, a part larger than the socket's buffers,
// and a reader slower than the writer. Both ways of writing give the reader the same bytes.
func TestWriterWritesPartsWholeThroughAFullSocket(t *testing.T) {
	for _, raw := range []bool{true, false} {
		name := "connection"
		if raw {
			name = "descriptor"
		}
		t.Run(name, func(t *testing.T) {
			c, peer := tcpPair(t)
			c.SetWriteBuffer(16 << 10)
			w := writer(t, c, raw)
			got := slowReader(peer, 100*time.Microsecond)
			var want bytes.Buffer
			big := bytes.Repeat([]byte("0123456789abcdef"), 1<<13) // 128 KiB: more than the socket holds
			for i := range 12 {
				parts := [][]byte{[]byte("head"), nil, big[:i*997%len(big)], {}, []byte{byte(i)}, big[i:], []byte("\r\n")}
				for _, p := range parts {
					want.Write(p)
				}
				if err := w.Write(parts...); err != nil {
					t.Fatalf("write %d: %v", i, err)
				}
				if err := w.Write([]byte("one")); err != nil {
					t.Fatalf("single write %d: %v", i, err)
				}
				want.WriteString("one")
			}
			c.CloseWrite()
			if all := <-got; !bytes.Equal(all, want.Bytes()) {
				t.Errorf("the reader got %d bytes, not the %d written in order", len(all), want.Len())
			}
			if w.parts[0] != nil || w.parts[3] != nil || w.rest != nil {
				t.Error("the writer keeps a reference to what it wrote")
			}
		})
	}
}

// A write deadline holds on the descriptor as on the connection: one already past writes nothing,
// one that passes while the socket is full ends the write; both say os.ErrDeadlineExceeded.
// A close while the write waits for room ends it with net.ErrClosed.
func TestWriterHoldsDeadlinesAndClose(t *testing.T) {
	for _, raw := range []bool{true, false} {
		t.Run(map[bool]string{true: "descriptor", false: "connection"}[raw], func(t *testing.T) {
			c, peer := tcpPair(t)
			w := writer(t, c, raw)
			c.SetWriteDeadline(time.Unix(1, 0))
			var op *net.OpError
			if err := w.Write([]byte("late"), []byte("r")); !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &op) || op.Op != "writev" {
				t.Errorf("past the deadline: %v, want the deadline's error from writev, as net.Buffers names it", err)
			}
			peer.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
			if n, err := peer.Read(make([]byte, 8)); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Errorf("a write past its deadline reached the peer: %d bytes, %v", n, err)
			}

			big := make([]byte, 64<<20) // more than any socket's buffers: the peer reads nothing
			c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
			if err := w.Write([]byte("head"), big); !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Errorf("a deadline passing while the socket is full: %v, want the deadline's error", err)
			}

			c.SetWriteDeadline(time.Time{})
			time.AfterFunc(30*time.Millisecond, func() { c.Close() })
			if err := w.Write(big); !errors.Is(err, net.ErrClosed) {
				t.Errorf("a close while the socket is full: %v, want net.ErrClosed", err)
			}
		})
	}
}

// A peer that reset the connection is reported as the connection's own write reports it: a
// *net.OpError for a write, whose cause is the system call's errno.
func TestWriterReportsAResetAsTheConnectionWould(t *testing.T) {
	errOf := func(raw bool) error {
		c, peer := tcpPair(t)
		w := writer(t, c, raw)
		peer.SetLinger(0)
		peer.Close()
		time.Sleep(10 * time.Millisecond)
		for range 100 {
			if err := w.Write([]byte("a"), []byte("b")); err != nil {
				return err
			}
			time.Sleep(time.Millisecond)
		}
		t.Fatal("writes to a reset connection never failed")
		return nil
	}
	want, got := errOf(false), errOf(true)
	var wantOp, gotOp *net.OpError
	if !errors.As(want, &wantOp) || !errors.As(got, &gotOp) {
		t.Fatalf("errors %T %v and %T %v; want *net.OpError both", want, want, got, got)
	}
	if gotOp.Op != wantOp.Op || gotOp.Net != wantOp.Net || gotOp.Source.String() == "" || gotOp.Addr.String() == "" {
		t.Errorf("the descriptor's error %+v names less than the connection's %+v", gotOp, wantOp)
	}
	if !errors.Is(got, syscall.ECONNRESET) && !errors.Is(got, syscall.EPIPE) {
		t.Errorf("the descriptor's error %v is neither a reset nor a broken pipe", got)
	}
}

// A write to the descriptor allocates nothing.
func TestWriterAllocatesNothing(t *testing.T) {
	c, peer := tcpPair(t)
	w := writer(t, c, true)
	go io.Copy(io.Discard, peer)
	head, body := []byte("HTTP/1.1 200 OK\r\n\r\n"), bytes.Repeat([]byte("x"), 512)
	if n := testing.AllocsPerRun(200, func() {
		if err := w.Write(head, body, nil, head, body); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Errorf("%v allocations per write", n)
	}
}

// FuzzWriterAgainstNetBuffers: any bytes cut into any parts reach the reader as net.Buffers
// written to the connection would give them: the same bytes, in order.
func FuzzWriterAgainstNetBuffers(f *testing.F) {
	f.Add([]byte("HTTP/1.1 200 OK\r\n\r\nbody"), []byte{3, 0, 17, 0, 0, 2})
	f.Add(bytes.Repeat([]byte("ab"), 40000), []byte{255, 1, 0, 200})
	f.Add([]byte{}, []byte{})
	f.Fuzz(func(t *testing.T, data, cuts []byte) {
		var parts [][]byte
		rest := data
		for _, k := range cuts {
			n := int(k) * 37 % (len(rest) + 1)
			parts = append(parts, rest[:n])
			rest = rest[n:]
		}
		parts = append(parts, rest)
		read := func(raw bool) []byte {
			c, peer := tcpPair(t)
			c.SetWriteBuffer(4096)
			got := slowReader(peer, 0)
			var err error
			if raw {
				err = writer(t, c, true).Write(parts...)
			} else {
				bufs := net.Buffers(append([][]byte(nil), parts...))
				_, err = bufs.WriteTo(c)
			}
			if err != nil {
				t.Fatal(err)
			}
			c.CloseWrite()
			return <-got
		}
		want, got := read(false), read(true)
		if !bytes.Equal(got, want) || !bytes.Equal(want, data) {
			t.Errorf("the descriptor's write gave %d bytes, net.Buffers %d, of %d", len(got), len(want), len(data))
		}
	})
}

// A socket put in blocking mode after its Writer was made (os.File's Fd on a dup does that: the
// dup shares the mode), whose peer neither reads nor sends: a raw call that waited on it would
// hold the runtime's processor, and the next stop of every goroutine (runtime.GC here) would
// wait for it. Each call asks not to wait, so the write waits for room in the poller and the
// read wait in the poller: the collection ends. Each case runs in a child process, given 5 s.
func TestABlockingDescriptorStopsNoCollection(t *testing.T) {
	if mode := os.Getenv("HTTPWIRE_BLOCKING_CHILD"); mode != "" {
		c, _ := tcpPair(t)
		w := writer(t, c, mode == "write-raw")
		f, err := c.File()
		if err != nil {
			t.Fatal(err)
		}
		_ = f.Fd() // the shared description is now in blocking mode
		if mode == "wait" {
			raw, _ := c.SyscallConn()
			go FillWaiting(raw, &newWaiter(c).src) // an idle kept-alive connection's wait
		} else {
			go w.Write(make([]byte, 256<<20))
		}
		time.Sleep(300 * time.Millisecond) // the write is out of room, or the wait has begun
		start := time.Now()
		runtime.GC()
		fmt.Printf("collected in %v\n", time.Since(start))
		os.Exit(0)
	}
	for _, mode := range []string{"write-conn", "write-raw", "wait"} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestABlockingDescriptorStopsNoCollection$")
		cmd.Env = append(os.Environ(), "HTTPWIRE_BLOCKING_CHILD="+mode)
		out, err := cmd.CombinedOutput()
		cancel()
		if !bytes.Contains(out, []byte("collected in")) {
			t.Errorf("%s: the process stopped (runtime.GC did not end within 5 s): %q, %v", mode, out, err)
		}
	}
}
