//go:build linux

package h1

import (
	"errors"
	"net"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

const watchSupported = true

// watcher notices clients that close their side, for every connection of one Server, with one
// epoll set and one goroutine (started with the server's first connection): each connection is
// added once (edge-triggered EPOLLRDHUP, no EPOLLIN, so request bytes wake nothing) and removed
// before it closes. It ends once the server shut down and its last connection went: an eventfd
// in the set (id 0) wakes it to close its descriptors.
type watcher struct {
	epfd, evfd int
	err        error
	stopOnce   sync.Once
	done       chan struct{} // closed when run returned

	mu    sync.Mutex
	conns map[uint64]*conn
	next  uint64
}

// watcher returns the server's watcher, started on first use.
func (s *Server) watcher() *watcher {
	s.watchOnce.Do(func() {
		w := &watcher{conns: map[uint64]*conn{}, done: make(chan struct{})}
		s.watch = w
		if w.epfd, w.err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); w.err != nil {
			close(w.done)
			return
		}
		if w.evfd, w.err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); w.err != nil {
			unix.Close(w.epfd)
			close(w.done)
			return
		}
		ev := unix.EpollEvent{Events: unix.EPOLLIN} // id 0: the wake-up
		if w.err = unix.EpollCtl(w.epfd, unix.EPOLL_CTL_ADD, w.evfd, &ev); w.err != nil {
			unix.Close(w.evfd)
			unix.Close(w.epfd)
			close(w.done)
			return
		}
		go w.run()
	})
	if s.watch == nil { // stopped before it started: nothing is watched any more
		return &watcher{err: ErrServerClosed}
	}
	if s.watch.err != nil && !errors.Is(s.watch.err, ErrServerClosed) {
		s.warnUnwatched(s.watch.err)
	}
	return s.watch
}

// stopWatching ends the server's watcher, if it was started.
func (s *Server) stopWatching() {
	s.watchOnce.Do(func() {}) // none started: none will be
	if w := s.watch; w != nil && w.err == nil {
		w.stopOnce.Do(func() {
			var one [8]byte
			one[0] = 1 // eventfd counters are host-endian; any non-zero value wakes
			_, _ = unix.Write(w.evfd, one[:])
		})
	}
}

func (w *watcher) run() {
	defer close(w.done)
	defer unix.Close(w.evfd)
	defer unix.Close(w.epfd)
	events := make([]unix.EpollEvent, 128)
	for {
		n, err := unix.EpollWait(w.epfd, events, -1)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			w.mu.Lock()
			w.err = err
			w.mu.Unlock()
			return
		}
		for _, ev := range events[:n] {
			id := uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32
			if id == 0 {
				return // the server is done
			}
			w.mu.Lock()
			c := w.conns[id]
			w.mu.Unlock()
			if c != nil {
				c.gone()
			}
		}
	}
}

// add watches c; a connection that cannot be watched is served all the same, without
// noticing its client leaving until a write fails.
func (w *watcher) add(c *conn) {
	if w.err != nil {
		return
	}
	under := c.rwc
	if tc, ok := under.(interface{ NetConn() net.Conn }); ok {
		under = tc.NetConn() // TLS: the peer closing shows on the socket beneath
	}
	sc, ok := under.(syscall.Conn)
	if !ok {
		c.s.warnUnwatched(errors.New("the listener's connections have no file descriptor"))
		return
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return
	}
	w.mu.Lock()
	w.next++
	id := w.next
	w.conns[id] = c
	w.mu.Unlock()
	var cerr error
	err = rc.Control(func(fd uintptr) {
		ev := unix.EpollEvent{Events: unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(uint32(id)), Pad: int32(uint32(id >> 32))}
		cerr = unix.EpollCtl(w.epfd, unix.EPOLL_CTL_ADD, int(fd), &ev)
	})
	if err != nil || cerr != nil {
		w.mu.Lock()
		delete(w.conns, id)
		w.mu.Unlock()
		return
	}
	c.watchID, c.raw = id, rc
}

// remove stops watching c; it runs before c's descriptor closes (a descriptor already closed
// left the epoll set with it).
func (w *watcher) remove(c *conn) {
	if c.watchID == 0 {
		return
	}
	_ = c.raw.Control(func(fd uintptr) {
		_ = unix.EpollCtl(w.epfd, unix.EPOLL_CTL_DEL, int(fd), nil)
	})
	w.mu.Lock()
	delete(w.conns, c.watchID)
	w.mu.Unlock()
	c.watchID = 0
}

// descriptorLimit is the process's soft limit on open descriptors (0 when it cannot be read).
func descriptorLimit() int {
	var l unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &l); err != nil || l.Cur > 1<<30 {
		return 0
	}
	return int(l.Cur)
}
