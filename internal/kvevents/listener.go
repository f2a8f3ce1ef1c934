package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
	"github.com/go-zeromq/zmq4/transport"
)

// Listener is the other way round from Subscriber: one ZMQ SUB endpoint bound on Addr, which
// engines configured with a connecting endpoint (vLLM and SGLang connect when the endpoint has
// no "*") dial. Every engine's messages arrive at the one address, so the topic names the source
// — the convention is kv@<ip>:<port>@<model> — and Route maps it (with the batch's DP rank and
// the address the connection came from) to the Subscriber that keeps that source's sequence and
// counters.
//
// Baton accepts the connections itself and runs the ZMQ library's protocol on each (greeting,
// NULL handshake, frames): a ZMQ SUB socket merges every peer's messages and does not say which
// peer sent one, and a topic anyone can write is no proof of who publishes it.
type Listener struct {
	Addr string // tcp://host:port
	// Route returns the subscriber for a topic and DP rank published from peer, or an error:
	// ErrUnknownTopic (the message is counted in Unrouted) or ErrForeignPeer (counted in
	// Refused: the topic names a worker the peer is not). Either way the message is dropped.
	Route func(topic string, rank int, peer netip.Addr) (*Subscriber, error)
	Log   *slog.Logger

	Received, Malformed, Unrouted, Refused atomic.Uint64
	lastWarn                               atomic.Int64
	bound                                  atomic.Pointer[string]
}

// The reasons Route gives for dropping a message.
var (
	ErrUnknownTopic = errors.New("the topic names no known worker")
	ErrForeignPeer  = errors.New("the topic names a worker at another address than the publisher's")
)

// BoundAddr is the address the listener bound (useful with port 0), "" before it has.
func (l *Listener) BoundAddr() string {
	if p := l.bound.Load(); p != nil {
		return *p
	}
	return ""
}

// Run listens until ctx ends; the error is a failure to bind.
func (l *Listener) Run(ctx context.Context, ready chan<- error) {
	ln, err := capped{transport.New("tcp")}.Listen(ctx, strings.TrimPrefix(l.Addr, "tcp://"))
	if err != nil {
		if ready != nil {
			ready <- err
		}
		return
	}
	addr := "tcp://" + ln.Addr().String()
	l.bound.Store(&addr)
	if ready != nil {
		ready <- nil
	}
	stop := context.AfterFunc(ctx, func() { _ = ln.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			l.warn("kv events: accepting an engine connection failed", "err", err)
			time.Sleep(50 * time.Millisecond) // descriptors exhausted: let some come back
			continue
		}
		wg.Go(func() { l.serve(ctx, conn) })
	}
}

// serve runs one engine connection: the ZMTP handshake as a SUB (bounded by the listener's
// handshake deadline), a subscription to every topic, then its messages, each tagged with the
// connection's peer address.
func (l *Listener) serve(ctx context.Context, conn net.Conn) {
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	var peer netip.Addr
	if ap, err := netip.ParseAddrPort(conn.RemoteAddr().String()); err == nil {
		peer = ap.Addr().Unmap()
	}
	z, err := zmq4.Open(conn, null.Security(), zmq4.Sub, nil, true, nil)
	if err != nil {
		l.Log.Debug("kv events: an engine connection failed its handshake", "peer", peer, "err", err)
		return
	}
	// ZMTP 3.0 subscription: a message whose first byte is 1, then the topic prefix (all).
	if err := z.SendMsg(zmq4.NewMsg([]byte{1})); err != nil {
		return
	}
	for {
		msg, err := z.RecvMsg()
		if err != nil {
			return
		}
		if msg.Type == zmq4.CmdMsg {
			continue // PING (answered by the library) and commands a SUB need not act on
		}
		l.handle(msg.Frames, peer)
	}
}

// handle routes one message [topic, seq, payload] from peer to its source's subscriber.
func (l *Listener) handle(frames [][]byte, peer netip.Addr) {
	l.Received.Add(1)
	if len(frames) != 3 || len(frames[1]) != 8 {
		l.Malformed.Add(1)
		return
	}
	b, err := Decode(frames[2])
	if err != nil {
		l.Malformed.Add(1)
		l.warn("kv events: undecodable batch", "topic", printable(frames[0]), "err", err)
		return
	}
	rank := 0
	if b.HasDPRank {
		rank = b.DPRank
	}
	s, err := l.Route(string(frames[0]), rank, peer)
	switch {
	case errors.Is(err, ErrForeignPeer):
		l.Refused.Add(1)
		l.warn("kv events: refused a message whose topic names a worker at another address than the connection's (spoofed, or an engine behind NAT)", "topic", printable(frames[0]), "peer", peer)
		return
	case err != nil || s == nil:
		l.Unrouted.Add(1)
		l.warn("kv events: a message whose topic names no known worker (engines that connect out must publish on kv@<ip>:<port>@<model>)", "topic", printable(frames[0]))
		return
	}
	s.Received.Add(1)
	s.deliver(int64(binary.BigEndian.Uint64(frames[1])), b)
}

// warn logs at most once every 10 s: a misconfigured engine sends many messages.
func (l *Listener) warn(msg string, args ...any) {
	now := time.Now().UnixNano()
	last := l.lastWarn.Load()
	if now-last < int64(10*time.Second) || !l.lastWarn.CompareAndSwap(last, now) {
		return
	}
	l.Log.Warn(msg, args...)
}

// printable shortens a topic for a log line and keeps it printable.
func printable(b []byte) string {
	if len(b) > 128 {
		b = b[:128]
	}
	out := make([]rune, 0, len(b))
	for _, r := range string(b) {
		if r < 0x20 || r == 0x7f || r == 0xfffd {
			r = '?'
		}
		out = append(out, r)
	}
	return string(out)
}
