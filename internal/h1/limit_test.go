package h1

import (
	"io"
	"net"
	"testing"
	"time"
)

// Past Max, a connection is closed as it arrives and counted; one that closes gives its place
// back.
func TestLimitListener(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := &LimitListener{Listener: inner, Max: 2}
	defer l.Close()
	accepted := make(chan net.Conn, 8)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", inner.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	dial()
	dial()
	first, second := <-accepted, <-accepted
	third := dial()
	_ = third.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := third.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("a third connection past Max 2 was not closed: %d bytes, %v", n, err)
	}
	if l.Refused.Load() != 1 {
		t.Fatalf("refused %d, want 1", l.Refused.Load())
	}
	first.Close()
	first.Close() // a second close gives nothing back twice
	dial()
	select {
	case c := <-accepted:
		c.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("a connection was not accepted after one closed")
	}
	second.Close()
	if l.open.Load() != 0 {
		t.Fatalf("open %d after every accepted connection closed", l.open.Load())
	}
}
