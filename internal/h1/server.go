// Package h1 is Baton's client-facing HTTP/1.1 server: the listener the OpenAI API is served on.
//
// It runs ordinary http.Handlers, one goroutine per connection like net/http, but spends less
// on each request and each open stream: the request head is parsed from a pooled 4 KiB buffer
// that goes back to the pool once the body has been read, answers are written from a pooled
// buffer that a stream gives back after every flush, and a client that goes away is noticed by
// one epoll watcher for the whole process (EPOLLRDHUP) instead of a reading goroutine per
// request. An open stream costs its handler's goroutine and little else.
//
// What it serves: HTTP/1.1 and HTTP/1.0 over the listener it is given (TCP, or TLS through
// tls.NewListener); Content-Length and chunked request bodies (trailers read and dropped);
// Expect: 100-continue; keep-alive (HTTP/1.0's when the client asks for it); pipelined requests
// answered one after another, in order; header bytes bounded (431), malformed requests refused
// (400, 501, 505, 417) with an OpenAI error body. Not served: HTTP/2, Upgrade, Hijack — use
// net/http's server for those.
package h1

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultMaxHeaderBytes bounds a request's line and headers when Server.MaxHeaderBytes is zero
// (net/http's default).
const DefaultMaxHeaderBytes = 64 << 10

// DefaultMaxHeaders bounds a request's header fields when Server.MaxHeaders is zero: clients
// send a few dozen; a head of thousands of short lines costs memory per field, not per byte.
const DefaultMaxHeaders = 128

// Server serves HTTP/1.1 on listeners. The zero value of each field is its documented default;
// a Server must not be copied after first use.
type Server struct {
	// Handler answers every request.
	Handler http.Handler
	// ReadHeaderTimeout bounds the wait for a request's head once its first byte arrived, and
	// for the first byte of a new connection's first request; zero: no bound.
	ReadHeaderTimeout time.Duration
	// IdleTimeout closes a keep-alive connection that sends no next request for this long;
	// zero: ReadHeaderTimeout; both zero: no bound.
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds the request line and headers (431 beyond); zero: DefaultMaxHeaderBytes.
	MaxHeaderBytes int
	// MaxHeaders bounds a request's header fields (431 beyond); zero: DefaultMaxHeaders.
	MaxHeaders int
	// MaxConns bounds the client connections open at once: one more is closed as it arrives.
	// Zero: half the process's descriptor limit, so that the other half stays for upstream
	// connections (none where the limit cannot be read); negative: no bound.
	MaxConns int
	// Refused counts connections closed at arrival because MaxConns were open.
	Refused atomic.Uint64
	// Refuse renders a request refused before any handler: the answer's headers (framing
	// aside) and body. nil: the message as text/plain.
	Refuse func(*Refusal) (http.Header, []byte)
	// Log receives what cannot be answered to a client (a handler's panic, a failed accept);
	// nil: discarded.
	Log *slog.Logger

	mu           sync.Mutex
	listeners    map[net.Listener]struct{}
	conns        map[*conn]struct{}
	shutdown     atomic.Bool
	warnOnce     sync.Once
	watchOnce    sync.Once
	watch        *watcher     // notices clients that leave; nil until the first connection
	buffers      atomic.Int64 // read buffers its connections hold now
	writeBuffers atomic.Int64 // answer buffers its connections hold now
}

// ErrServerClosed is what Serve returns after Shutdown or Close (net/http's value, so callers
// need not tell the servers apart).
var ErrServerClosed = http.ErrServerClosed

// Supported reports whether this platform has what the server needs to notice clients that
// go away (epoll). Where it does not, use net/http's server.
func Supported() bool { return watchSupported }

// Serve accepts connections on ln until Shutdown or Close, and serves each on its own
// goroutine. It always returns a non-nil error; ErrServerClosed after Shutdown or Close.
func (s *Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.shutdown.Load() {
		s.mu.Unlock()
		return ErrServerClosed
	}
	if s.listeners == nil {
		s.listeners = map[net.Listener]struct{}{}
		s.conns = map[*conn]struct{}{}
	}
	s.listeners[ln] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
	}()
	var backoff time.Duration
	for {
		rw, err := ln.Accept()
		if err != nil {
			if s.shutdown.Load() {
				return ErrServerClosed
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || isTemporary(err) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.logf("accept failed; retrying", "err", err, "in", backoff)
				time.Sleep(backoff)
				continue
			}
			return err
		}
		backoff = 0
		c := newConn(s, rw)
		s.mu.Lock()
		if s.shutdown.Load() {
			s.mu.Unlock()
			rw.Close()
			return ErrServerClosed
		}
		if max := s.maxConns(); max > 0 && len(s.conns) >= max {
			s.mu.Unlock()
			s.Refused.Add(1) // counted before the close that a watcher may see first
			rw.Close()       // past the bound: descriptors stay for the engines
			continue
		}
		s.conns[c] = struct{}{}
		s.mu.Unlock()
		go c.serve()
	}
}

// isTemporary reports an accept error worth retrying (out of file descriptors and the like).
func isTemporary(err error) bool {
	var t interface{ Temporary() bool }
	return errors.As(err, &t) && t.Temporary()
}

// Shutdown stops accepting, closes idle connections, and waits for the requests being served
// to finish (their connections then close) until ctx ends, when it returns ctx's error and
// leaves the rest to Close.
func (s *Server) Shutdown(ctx context.Context) error {
	s.closeListeners()
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		if s.closeIdle() == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Close stops accepting and closes every connection at once, requests in flight included:
// their handlers see their contexts end and their writes fail. Like net/http's, it does not
// wait for the handlers to return.
func (s *Server) Close() error {
	s.closeListeners()
	s.mu.Lock()
	for c := range s.conns {
		c.abort()
	}
	s.mu.Unlock()
	return nil
}

func (s *Server) closeListeners() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.shutdown.Store(true)
	for ln := range s.listeners {
		ln.Close()
	}
	if len(s.conns) == 0 {
		s.stopWatching()
	}
}

// closeIdle closes the connections waiting for a next request and returns how many remain.
func (s *Server) closeIdle() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.conns {
		if c.state.CompareAndSwap(stateIdle, stateClosed) {
			c.abort()
		}
	}
	return len(s.conns)
}

// forget drops a closed connection; the last one of a server that shut down ends its watcher.
func (s *Server) forget(c *conn) {
	s.mu.Lock()
	delete(s.conns, c)
	if s.shutdown.Load() && len(s.conns) == 0 {
		s.stopWatching()
	}
	s.mu.Unlock()
}

func (s *Server) logf(msg string, args ...any) {
	if s.Log != nil {
		s.Log.Debug("http server: "+msg, args...)
	}
}

func (s *Server) maxHeaders() int {
	if s.MaxHeaders > 0 {
		return s.MaxHeaders
	}
	return DefaultMaxHeaders
}

func (s *Server) maxConns() int {
	switch {
	case s.MaxConns > 0:
		return s.MaxConns
	case s.MaxConns < 0:
		return 0
	}
	return descriptorLimit() / 2
}

func (s *Server) maxHeaderBytes() int {
	if s.MaxHeaderBytes > 0 {
		return s.MaxHeaderBytes
	}
	return DefaultMaxHeaderBytes
}

func (s *Server) idleTimeout() time.Duration {
	if s.IdleTimeout > 0 {
		return s.IdleTimeout
	}
	return s.ReadHeaderTimeout
}

// warnUnwatched logs, once per server, that clients leaving will not be noticed.
func (s *Server) warnUnwatched(err error) {
	s.warnOnce.Do(func() {
		if s.Log != nil {
			s.Log.Warn("http server: clients that disconnect are noticed only when a write to them fails", "err", err)
		}
	})
}
