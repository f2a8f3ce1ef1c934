package kvevents

import (
	"context"
	"encoding/binary"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Listener is the other way round from Subscriber: one ZMQ SUB socket bound on Addr, which
// engines configured with a connecting endpoint (vLLM and SGLang connect when the endpoint has
// no "*") dial. Every engine's messages arrive on the one socket, so the topic names the source
// — the convention is kv@<ip>:<port>@<model> — and Route maps it (with the batch's DP rank) to
// the Subscriber that keeps that source's sequence and counters.
type Listener struct {
	Addr string // tcp://host:port
	// Route returns the subscriber for a topic and DP rank, or nil when the topic names no
	// known worker (the message is counted in Unrouted and dropped).
	Route func(topic string, rank int) *Subscriber
	Log   *slog.Logger

	Received, Malformed, Unrouted atomic.Uint64
	lastWarn                      atomic.Int64
	bound                         atomic.Pointer[string]
}

// BoundAddr is the address the listener bound (useful with port 0), "" before it has.
func (l *Listener) BoundAddr() string {
	if p := l.bound.Load(); p != nil {
		return *p
	}
	return ""
}

// Run listens until ctx ends; the error is a failure to bind.
func (l *Listener) Run(ctx context.Context, ready chan<- error) {
	// The library's own complaints (a peer that failed its handshake or broke a bound) go to
	// the log at debug level, not to stderr.
	sock := zmq4.NewSub(ctx, zmq4.WithLogger(slog.NewLogLogger(l.Log.Handler(), slog.LevelDebug)))
	defer sock.Close()
	if err := sock.Listen(dialAddr(l.Addr)); err != nil {
		if ready != nil {
			ready <- err
		}
		return
	}
	addr := "tcp://" + sock.Addr().String()
	l.bound.Store(&addr)
	if ready != nil {
		ready <- nil
	}
	receive(ctx, sock, l.handle)
}

// handle routes one message [topic, seq, payload] to its source's subscriber.
func (l *Listener) handle(frames [][]byte) {
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
	s := l.Route(string(frames[0]), rank)
	if s == nil {
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
