//go:build !linux

package upstream

// awaitData does nothing where the one-byte peek is not available: the connection keeps its
// read buffer while a stream waits.
func (c *conn) awaitData() {}
