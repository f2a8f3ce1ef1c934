//go:build !linux

package h1

const watchSupported = false

// watcher does nothing where there is no epoll: a client leaving is noticed when a write to
// it fails. Supported reports false, so Baton serves with net/http's server there.
type watcher struct{}

func (s *Server) watcher() *watcher { return &watcher{} }
func (s *Server) stopWatching()     {}
func (w *watcher) add(c *conn)      {}
func (w *watcher) remove(c *conn)   {}

// descriptorLimit is unknown here: no bound is derived from it.
func descriptorLimit() int { return 0 }
