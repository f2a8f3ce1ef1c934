package upstream

import (
	"bufio"

	"github.com/baton-llm/baton/internal/httpwire"
)

// awaitData waits until the engine has sent something or closed, holding no read buffer
// meanwhile: an open stream between two events costs no 4 KiB (httpwire.FillWaiting); what
// came is in the buffer. Read deadlines (the request's cancellation) and Close end the wait as
// they end a Read; the read that follows reports them.
func (c *conn) awaitData() {
	if !httpwire.Awaits || c.raw == nil || c.br.Buffered() > 0 { // elsewhere the read waits, with its buffer
		return
	}
	c.dropReader()
	if httpwire.FillWaiting(c.raw, &c.src) != nil && c.br == nil {
		c.takeReader()
	}
}

// reader returns c's read buffer, taking one from the pool when it holds none.
func (c *conn) reader() *bufio.Reader {
	if c.br == nil {
		c.takeReader()
	}
	return c.br
}

// pending asks the kernel, without waiting, whether c has a byte to read or an end or error to
// report; ok false when it could not ask.
func (c *conn) pending() (pending, ok bool) { return httpwire.Pending(c.raw) }
