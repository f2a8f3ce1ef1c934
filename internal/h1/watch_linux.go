//go:build linux

package h1

import (
	"errors"
	"sync"
	"syscall"
)

const watchSupported = true

// epollET is EPOLLET as the event mask's type (the syscall package declares it negative).
const epollET = 1 << 31

// watcher notices clients that close their side, for every connection of the process, with
// one epoll set and one goroutine that live as long as the process (started with the first
// connection): each connection is added once (edge-triggered EPOLLRDHUP, no EPOLLIN, so
// request bytes wake nothing) and removed before it closes.
type watcher struct {
	epfd int
	err  error

	mu    sync.Mutex
	conns map[uint64]*conn
	next  uint64
}

var (
	theWatcher  *watcher
	watcherOnce sync.Once
)

func (s *Server) watcher() *watcher {
	watcherOnce.Do(func() {
		theWatcher = &watcher{conns: map[uint64]*conn{}}
		fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
		if err != nil {
			theWatcher.err = err
			return
		}
		theWatcher.epfd = fd
		go theWatcher.run()
	})
	if theWatcher.err != nil {
		s.warnUnwatched(theWatcher.err)
	}
	return theWatcher
}

func (w *watcher) run() {
	events := make([]syscall.EpollEvent, 128)
	for {
		n, err := syscall.EpollWait(w.epfd, events, -1)
		if err != nil {
			if errors.Is(err, syscall.EINTR) {
				continue
			}
			w.mu.Lock()
			w.err = err
			w.mu.Unlock()
			return
		}
		for _, ev := range events[:n] {
			id := uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32
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
	sc, ok := c.rwc.(syscall.Conn)
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
		ev := syscall.EpollEvent{Events: syscall.EPOLLRDHUP | epollET, Fd: int32(uint32(id)), Pad: int32(uint32(id >> 32))}
		cerr = syscall.EpollCtl(w.epfd, syscall.EPOLL_CTL_ADD, int(fd), &ev)
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
		_ = syscall.EpollCtl(w.epfd, syscall.EPOLL_CTL_DEL, int(fd), nil)
	})
	w.mu.Lock()
	delete(w.conns, c.watchID)
	w.mu.Unlock()
	c.watchID = 0
}

// descriptorLimit is the process's soft limit on open descriptors (0 when it cannot be read).
func descriptorLimit() int {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil || l.Cur > 1<<30 {
		return 0
	}
	return int(l.Cur)
}
