package kvevents

import (
	"context"
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// An engine that connects out to a listening gateway is routed by its topic: its batches reach
// the subscriber Route names, in sequence; a topic Route does not know is counted unrouted.
func TestListenerRoutesByTopic(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	idx := NewIndex(1000)
	known := &Subscriber{Worker: "w1", Model: "m", Index: idx, Log: slog.New(slog.DiscardHandler)}
	l := &Listener{Addr: "tcp://127.0.0.1:0", Log: slog.New(slog.DiscardHandler), Route: func(topic string, rank int, _ netip.Addr) (*Subscriber, error) {
		if topic == "kv@w1@m" && rank == 0 {
			return known, nil
		}
		return nil, ErrUnknownTopic
	}}
	ready := make(chan error, 1)
	done := make(chan struct{})
	go func() { l.Run(ctx, ready); close(done) }()
	if err := <-ready; err != nil {
		t.Fatal(err)
	}
	pub := zmq4.NewPub(ctx)
	defer pub.Close()
	if err := pub.Dial(l.BoundAddr()); err != nil {
		t.Fatal(err)
	}
	send := func(topic string, seq uint64, payload []byte) {
		var s [8]byte
		binary.BigEndian.PutUint64(s[:], seq)
		if err := pub.SendMulti(zmq4.NewMsgFrom([]byte(topic), s[:], payload)); err != nil {
			t.Fatal(err)
		}
	}
	batch := pack(t, []any{1.0, []any{[]any{"BlockStored", []any{7}, nil, []any{1, 2, 3, 4}, 4}}})
	// The subscription joins asynchronously: send until the first batch lands.
	deadline := time.Now().Add(5 * time.Second)
	for known.Stats().Received == 0 {
		if time.Now().After(deadline) {
			t.Fatal("nothing arrived")
		}
		send("kv@w1@m", 0, batch)
		time.Sleep(20 * time.Millisecond)
	}
	send("kv@stranger@m", 0, batch)
	for l.Unrouted.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if l.Unrouted.Load() == 0 {
		t.Fatal("a topic naming no worker was not counted")
	}
	if got := idx.Match(Keys("m", "", []uint32{1, 2, 3, 4}, 4))["w1"]; got != 1 {
		t.Fatalf("w1 holds %d blocks, want 1", got)
	}
	cancel()
	<-done
}

// The listening side bounds what an engine may claim, as the dialling side does: a frame header
// announcing 1 TiB closes the connection before anything is allocated.
func TestListenerRefusesHugeFrames(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l := startListener(t, ctx, nobody)
	conn, err := net.Dial("tcp", strings.TrimPrefix(l.BoundAddr(), "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// A ZMTP 3.0 greeting (NULL mechanism, as server=0), then a long frame claiming 2^40 bytes.
	greeting := make([]byte, 64)
	greeting[0], greeting[9], greeting[10], greeting[11] = 0xff, 0x7f, 3, 0
	copy(greeting[12:], "NULL")
	if _, err := conn.Write(greeting); err != nil {
		t.Fatal(err)
	}
	_, _ = conn.Write([]byte{0x02, 0, 0, 1, 0, 0, 0, 0, 0})
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.Copy(io.Discard, conn); err != nil {
		t.Fatalf("the connection was not closed: %v", err)
	}
}

// zmtpPeer connects to addr and says what a ZMQ PUB says before its first message (a ZMTP 3.0
// NULL greeting and a READY command), then the bytes of rest.
func zmtpPeer(t *testing.T, addr string, rest []byte) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(addr, "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := c.Write(append(PubHello(), rest...)); err != nil {
		t.Fatal(err)
	}
	return c
}

// High 4: the ZMQ library allocates the size a frame header claims before a byte of it arrives:
// a 9-byte claim cost 64 MiB per peer, sixteen peers a gigabyte. Claims are bounded per message
// (MaxMessage) and over every connection at once (MaxInFlight).
func TestListenerBoundsClaimedMemory(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	l := startListener(t, ctx, nobody)
	claim := func(n uint64) []byte {
		h := make([]byte, 9)
		h[0] = 0x02 // a long frame, no body sent
		binary.BigEndian.PutUint64(h[1:], n)
		return h
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	zmtpPeer(t, l.BoundAddr(), claim(64<<20)) // the old bound: refused outright
	for i := 0; i < 48; i++ {
		zmtpPeer(t, l.BoundAddr(), claim(MaxMessage))
	}
	time.Sleep(500 * time.Millisecond) // let the library read every claim it will
	runtime.ReadMemStats(&after)
	if got := after.TotalAlloc - before.TotalAlloc; got > MaxInFlight+32<<20 {
		t.Errorf("48 peers claiming %d MiB each made Baton allocate %d MiB (bound %d MiB in flight)", MaxMessage>>20, got>>20, MaxInFlight>>20)
	}
}

// Medium 6: the library's handshake runs inline in its accept loop, with no deadline: one peer
// that connected and said nothing kept every other engine out. It is bounded.
func TestListenerSilentPeerDoesNotStallOthers(t *testing.T) {
	handshakeTimeout.Store(int64(200 * time.Millisecond))
	defer handshakeTimeout.Store(int64(HandshakeTimeout))
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	idx := NewIndex(1000)
	known := &Subscriber{Worker: "w1", Model: "m", Index: idx, Log: slog.New(slog.DiscardHandler)}
	l := startListener(t, ctx, always(known))
	silent, err := net.Dial("tcp", strings.TrimPrefix(l.BoundAddr(), "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	time.Sleep(50 * time.Millisecond) // it is accepted first
	pub := zmq4.NewPub(ctx)
	defer pub.Close()
	if err := pub.Dial(l.BoundAddr()); err != nil {
		t.Fatal(err)
	}
	batch := pack(t, []any{1.0, []any{[]any{"BlockStored", []any{7}, nil, []any{1, 2, 3, 4}, 4}}})
	deadline := time.Now().Add(10 * time.Second)
	for seq := uint64(0); known.Stats().Received == 0; seq++ {
		if time.Now().After(deadline) {
			t.Fatal("a silent peer kept an engine's events out")
		}
		var s [8]byte
		binary.BigEndian.PutUint64(s[:], seq)
		_ = pub.SendMulti(zmq4.NewMsgFrom([]byte("kv@w1@m"), s[:], batch))
		time.Sleep(20 * time.Millisecond)
	}
}

// startListener runs a listener on a free loopback port with route until ctx ends.
func startListener(t *testing.T, ctx context.Context, route func(string, int, netip.Addr) (*Subscriber, error)) *Listener {
	t.Helper()
	l := &Listener{Addr: "tcp://127.0.0.1:0", Log: slog.New(slog.DiscardHandler), Route: route}
	ready := make(chan error, 1)
	go l.Run(ctx, ready)
	if err := <-ready; err != nil {
		t.Fatal(err)
	}
	return l
}

// nobody routes no topic; always(s) every topic to s.
func nobody(string, int, netip.Addr) (*Subscriber, error) { return nil, ErrUnknownTopic }

func always(s *Subscriber) func(string, int, netip.Addr) (*Subscriber, error) {
	return func(string, int, netip.Addr) (*Subscriber, error) { return s, nil }
}

// fromTransport dials TCP from a chosen loopback source address, so that a test engine can
// publish from an address other than 127.0.0.1.
type fromTransport struct{ local string }

func (f fromTransport) Dial(ctx context.Context, _ transport.Dialer, addr string) (net.Conn, error) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(f.local)}}
	return d.DialContext(ctx, "tcp", addr)
}

func (f fromTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	return net.Listen("tcp", addr)
}

func (f fromTransport) Addr(ep string) (string, error) { return ep, nil }

func init() {
	if err := zmq4.RegisterTransport("tcp-from-127-0-0-2", fromTransport{"127.0.0.2"}); err != nil {
		panic(err)
	}
}

// Medium 7: the listener hands Route the address each message's connection came from, so that
// a topic naming a worker is believed only from that worker; a refusal is counted, not applied.
func TestListenerTellsRouteThePeer(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	idx := NewIndex(1000)
	known := &Subscriber{Worker: "w1", Model: "m", Index: idx, Log: slog.New(slog.DiscardHandler)}
	var peers sync.Map
	l := startListener(t, ctx, func(topic string, _ int, peer netip.Addr) (*Subscriber, error) {
		peers.Store(peer, true)
		if peer != netip.MustParseAddr("127.0.0.1") {
			return nil, ErrForeignPeer
		}
		return known, nil
	})
	batch := pack(t, []any{1.0, []any{[]any{"BlockStored", []any{7}, nil, []any{1, 2, 3, 4}, 4}}})
	publish := func(ep string, until func() bool) {
		pub := zmq4.NewPub(ctx)
		defer pub.Close()
		if err := pub.Dial(ep); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for seq := uint64(0); !until(); seq++ {
			if time.Now().After(deadline) {
				t.Fatalf("nothing from %s arrived", ep)
			}
			var s [8]byte
			binary.BigEndian.PutUint64(s[:], seq)
			_ = pub.SendMulti(zmq4.NewMsgFrom([]byte("kv@w1@m"), s[:], batch))
			time.Sleep(20 * time.Millisecond)
		}
	}
	publish(strings.Replace(l.BoundAddr(), "tcp://", "tcp-from-127-0-0-2://", 1), func() bool { return l.Refused.Load() > 0 })
	if known.Stats().Received != 0 || idx.Match(Keys("m", "", []uint32{1, 2, 3, 4}, 4))["w1"] != 0 {
		t.Fatal("a message from a foreign peer reached the index")
	}
	publish(l.BoundAddr(), func() bool { return known.Stats().Received > 0 })
	if _, ok := peers.Load(netip.MustParseAddr("127.0.0.2")); !ok {
		t.Fatal("Route never saw the foreign peer's address")
	}
	if got := idx.Match(Keys("m", "", []uint32{1, 2, 3, 4}, 4))["w1"]; got != 1 {
		t.Fatalf("w1 holds %d blocks from its own address, want 1", got)
	}
}
