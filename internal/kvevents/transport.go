package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// MaxMessage bounds one ZMQ message from an engine (all its frames): the ZMQ library allocates
// whatever size a frame header claims, so Baton checks the claims on the wire before the library
// reads them. Engines send KiB-sized batches: a BlockStored carries its blocks' token ids (about
// 3 bytes each in msgpack) and hashes, so even a 100,000-token prompt stored at once is well under
// 1 MB; 4 MiB leaves room and no more.
const MaxMessage = 4 << 20

// MaxInFlight bounds the bytes claimed by frames still arriving, over every engine connection
// at once: the library allocates a frame's claimed size when its header arrives, so sixteen
// peers each claiming a maximal message would otherwise cost sixteen buffers before sending a
// byte. A claim past it closes the connection.
const MaxInFlight = 64 << 20

// HandshakeTimeout bounds a connecting engine's ZMTP greeting and handshake (the library runs
// it inline in its accept loop: a silent peer would stall every other); FrameTimeout bounds how
// long a frame's body may take to arrive once its header did.
const (
	HandshakeTimeout = 5 * time.Second
	FrameTimeout     = 30 * time.Second
)

// handshakeTimeout is HandshakeTimeout in nanoseconds (tests shorten it; listeners of earlier
// tests may still be reading it).
var handshakeTimeout atomic.Int64

func init() { handshakeTimeout.Store(int64(HandshakeTimeout)) }

// inflight is the budget of MaxInFlight, shared by every connection.
var inflight = &claims{limit: MaxInFlight}

// claims counts bytes claimed by frame headers whose bodies have not all arrived.
type claims struct {
	limit int64
	used  atomic.Int64
}

func (c *claims) take(n int64) bool {
	if c.used.Add(n) > c.limit {
		c.used.Add(-n)
		return false
	}
	return true
}

func (c *claims) give(n int64) { c.used.Add(-n) }

// cappedScheme is the ZMQ transport Baton dials engines with (and listens on for engines that
// connect out): TCP, with every frame header checked against MaxMessage.
const cappedScheme = "baton-tcp"

func init() {
	if err := zmq4.RegisterTransport(cappedScheme, capped{transport.New("tcp")}); err != nil {
		panic(err)
	}
}

// dialAddr turns a tcp:// endpoint into one on the capped transport.
func dialAddr(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return cappedScheme + "://" + rest
	}
	return ep
}

type capped struct{ tcp transport.Transport }

func (c capped) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	conn, err := c.tcp.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return &frameCap{Conn: conn, max: MaxMessage, budget: inflight, deadlines: true}, nil
}

// MaxConns bounds the engine connections a listening gateway holds at once; more are closed
// as they arrive.
const MaxConns = 4096

func (c capped) Listen(ctx context.Context, addr string) (net.Listener, error) {
	ln, err := c.tcp.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return &cappedListener{Listener: ln, slots: make(chan struct{}, MaxConns)}, nil
}

// cappedListener hands out connections whose frames are checked, at most MaxConns at once.
type cappedListener struct {
	net.Listener
	slots chan struct{}
}

func (l *cappedListener) Accept() (net.Conn, error) {
	for {
		conn, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		select {
		case l.slots <- struct{}{}:
			// The library's handshake runs inline in its accept loop: bounded, so that a peer
			// that connects and says nothing cannot keep other engines out.
			_ = conn.SetDeadline(time.Now().Add(time.Duration(handshakeTimeout.Load())))
			return &frameCap{Conn: conn, max: MaxMessage, release: func() { <-l.slots }, budget: inflight, deadlines: true, handshaking: true}, nil
		default:
			_ = conn.Close()
		}
	}
}

func (c capped) Addr(ep string) (string, error) { return c.tcp.Addr(ep) }

// errTooLarge ends a connection whose peer announced a message above the bound; errBusy one
// whose claim would pass the budget of claims in flight.
var (
	errTooLarge = errors.New("kv events: a ZMQ frame or message above the size bound")
	errBusy     = errors.New("kv events: frames claimed over every connection would pass their bound")
)

// frameCap follows the ZMTP 3 stream as it is read (a 64-byte greeting, then frames: a flags
// byte, a 1- or 8-byte size, the body) and fails the read that would deliver a frame header
// claiming more than max bytes for its message.
type frameCap struct {
	net.Conn
	max int64

	greeting int    // greeting bytes still to pass
	hdr      []byte // the frame header read so far
	body     int64  // body bytes of the current frame still to pass
	message  int64  // bytes of the current message so far
	more     bool   // the current frame is followed by another of the same message
	started  bool
	release  func() // frees the listener's slot; nil for dialled connections
	closed   sync.Once

	budget *claims // the claims of frames in flight (nil: none)
	// claimMu guards claimed and gone: Close may run in another goroutine than Read.
	claimMu     sync.Mutex
	claimed     int64 // this connection's part of the budget
	gone        bool  // Close gave the claims back: no more may be taken
	deadlines   bool  // manage the connection's deadlines (handshake, frame bodies)
	handshaking bool  // until the peer's first command (READY) has arrived
	command     bool  // the current frame is a command
}

func (f *frameCap) Close() error {
	err := f.Conn.Close()
	f.closed.Do(func() {
		if f.release != nil {
			f.release()
		}
		f.claimMu.Lock()
		defer f.claimMu.Unlock()
		if f.budget != nil {
			f.budget.give(f.claimed)
		}
		f.claimed, f.gone = 0, true
	})
	return err
}

func (f *frameCap) Read(p []byte) (int, error) {
	if !f.started {
		f.started, f.greeting = true, 64
	}
	n, err := f.Conn.Read(p)
	if cerr := f.scan(p[:n]); cerr != nil {
		_ = f.Close()
		return 0, cerr
	}
	return n, err
}

func (f *frameCap) scan(b []byte) error {
	for len(b) > 0 {
		switch {
		case f.greeting > 0:
			k := min(f.greeting, len(b))
			f.greeting -= k
			b = b[k:]
		case f.body > 0:
			k := int(min(f.body, int64(len(b))))
			f.body -= int64(k)
			b = b[k:]
			if f.body == 0 {
				f.frameDone()
			}
		default:
			f.hdr = append(f.hdr, b[0])
			b = b[1:]
			need := 2
			if f.hdr[0]&0x02 != 0 { // long frame: 8-byte size
				need = 9
			}
			if len(f.hdr) < need {
				continue
			}
			size := int64(f.hdr[1])
			if need == 9 {
				u := binary.BigEndian.Uint64(f.hdr[1:9])
				if u > uint64(f.max) {
					return errTooLarge
				}
				size = int64(u)
			}
			if !f.more {
				f.message = 0
			}
			f.message += size
			if f.message > f.max {
				return errTooLarge
			}
			f.more, f.command = f.hdr[0]&0x01 != 0, f.hdr[0]&0x04 != 0
			f.body, f.hdr = size, f.hdr[:0]
			if err := f.frameStart(size); err != nil {
				return err
			}
		}
	}
	return nil
}

// frameStart claims a frame's size from the budget and gives its body FrameTimeout to arrive.
func (f *frameCap) frameStart(size int64) error {
	if f.budget != nil {
		f.claimMu.Lock()
		ok := !f.gone && f.budget.take(size)
		if ok {
			f.claimed += size
		}
		f.claimMu.Unlock()
		if !ok {
			return errBusy
		}
	}
	if size == 0 {
		f.frameDone()
	} else if f.deadlines && !f.handshaking {
		_ = f.Conn.SetReadDeadline(time.Now().Add(FrameTimeout))
	}
	return nil
}

// frameDone gives a frame's claim back once its body has passed; the peer's first command
// (READY) ends the handshake and its deadline.
func (f *frameCap) frameDone() {
	if f.budget != nil {
		f.claimMu.Lock()
		f.budget.give(f.claimed)
		f.claimed = 0
		f.claimMu.Unlock()
	}
	if !f.deadlines {
		return
	}
	if f.handshaking && f.command {
		f.handshaking = false
		_ = f.Conn.SetDeadline(time.Time{})
		return
	}
	if !f.handshaking {
		_ = f.Conn.SetReadDeadline(time.Time{}) // an engine may be quiet for long between batches
	}
}

// PubHello is what a ZMQ PUB says before its first message: a ZMTP 3.0 greeting with the NULL
// mechanism (as-server 0), then its READY command naming the socket type. The listener's tests
// and the hardening benchmark speak it to play an engine byte by byte.
func PubHello() []byte {
	greeting := make([]byte, 64)
	greeting[0], greeting[9], greeting[10] = 0xff, 0x7f, 3
	copy(greeting[12:], "NULL")
	ready := append([]byte("\x05READY\x0bSocket-Type"), 0, 0, 0, 3)
	ready = append(ready, "PUB"...)
	return append(append(greeting, 0x04, byte(len(ready))), ready...)
}
