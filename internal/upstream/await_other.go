//go:build !linux

package upstream

// awaitData does nothing where the one-byte peek is not available: the connection keeps its
// read buffer while a stream waits.
func (c *conn) awaitData() {}

// pending cannot ask the kernel here: ok false.
func (c *conn) pending() (pending, ok bool) { return false, false }
