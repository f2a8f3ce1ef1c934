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

// send writes the request — head, then body (nil for none) — and, where the platform allows,
// waits for the answer's first bytes holding no read buffer (httpwire.WriteAwaiting): the wait
// is armed before the request leaves, so the read that follows finds the answer's first bytes
// buffered instead of looking at the descriptor once in vain. It returns the write's error; the
// wait's end (the request's cancellation, a close) is the next read's to report.
func (c *conn) send(head, body []byte, reused bool) error {
	if !c.checkedAtWrite() || c.br.Buffered() > 0 { // elsewhere the read waits, with its buffer
		return httpwire.WriteParts(c.c, head, body)
	}
	c.dropReader()
	written, err := httpwire.WriteAwaiting(c.raw, &c.src, head, body, reused)
	if c.br == nil {
		c.takeReader()
	}
	if !written {
		return err
	}
	return nil
}

// checkedAtWrite says whether an idle connection is checked for stray bytes as its next request
// is written (httpwire.WriteAwaiting, inside the armed wait: nothing the engine sent or did before
// or after the look is missed), rather than when it is taken (stray).
func (c *conn) checkedAtWrite() bool { return httpwire.Awaits && c.raw != nil }

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
