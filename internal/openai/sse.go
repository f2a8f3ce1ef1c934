package openai

import (
	"bytes"
	"errors"
	"io"
)

// MaxEventSize bounds one SSE event an EventReader holds: a stream that sends more without a
// blank line is broken (ErrEventTooLarge), not a reason to grow without end.
const MaxEventSize = 16 << 20

// ErrEventTooLarge is returned by EventReader.Next for an event longer than MaxEventSize.
var ErrEventTooLarge = errors.New("SSE event exceeds 16 MiB without a terminating blank line")

// EventReader splits an SSE stream into events. Each event is returned with its terminating
// blank line, exactly as read, so an event that is not changed is relayed byte for byte.
type EventReader struct {
	r   io.Reader
	buf []byte
	off int // start of unread bytes in buf
	err error
}

// NewEventReader returns an EventReader over r.
func NewEventReader(r io.Reader) *EventReader { return &EventReader{r: r, buf: make([]byte, 0, 8<<10)} }

// Next returns the next event. At the end of the stream it returns any unterminated remainder
// and then io.EOF; other read errors are returned as they happen. The returned slice is valid
// until the next call.
func (e *EventReader) Next() ([]byte, error) {
	for {
		if end := eventEnd(e.buf[e.off:]); end > 0 {
			ev := e.buf[e.off : e.off+end]
			e.off += end
			return ev, nil
		}
		if e.err != nil {
			if e.off < len(e.buf) {
				ev := e.buf[e.off:]
				e.off = len(e.buf)
				return ev, nil
			}
			return nil, e.err
		}
		// Compact, grow, read.
		if e.off > 0 {
			n := copy(e.buf, e.buf[e.off:])
			e.buf, e.off = e.buf[:n], 0
		}
		if len(e.buf) >= MaxEventSize {
			e.err = ErrEventTooLarge
			e.off = len(e.buf) // the partial event is dropped, never relayed as if whole
			return nil, e.err
		}
		if len(e.buf) == cap(e.buf) {
			e.buf = append(e.buf, make([]byte, min(len(e.buf), MaxEventSize-len(e.buf)))...)[:len(e.buf)]
		}
		n, err := e.r.Read(e.buf[len(e.buf):cap(e.buf)])
		e.buf = e.buf[:len(e.buf)+n]
		if err != nil {
			e.err = err
		}
	}
}

// Pending reports whether another complete event is already buffered, so that Next will return
// it without reading. A relay flushes only when nothing is pending: events that arrived together
// leave together, and no event ever waits for a later one.
func (e *EventReader) Pending() bool { return eventEnd(e.buf[e.off:]) > 0 }

// eventEnd returns the length of the first complete event in b (through its blank line), or 0.
func eventEnd(b []byte) int {
	for i := 0; i < len(b); {
		j := bytes.IndexByte(b[i:], '\n')
		if j < 0 {
			return 0
		}
		i += j + 1
		if i < len(b) && b[i] == '\n' {
			return i + 1
		}
		if i+1 < len(b) && b[i] == '\r' && b[i+1] == '\n' {
			return i + 2
		}
	}
	return 0
}

// EventData returns the payload of an event's "data:" line (the first, when there are several),
// without the prefix space; ok is false when the event has none.
func EventData(ev []byte) (data []byte, ok bool) {
	for len(ev) > 0 {
		line := ev
		if i := bytes.IndexByte(ev, '\n'); i >= 0 {
			line, ev = ev[:i], ev[i+1:]
		} else {
			ev = nil
		}
		line = bytes.TrimSuffix(line, []byte("\r"))
		if d, found := bytes.CutPrefix(line, []byte("data:")); found {
			return bytes.TrimPrefix(d, []byte(" ")), true
		}
	}
	return nil, false
}

// ReplaceEventData returns ev with the payload of its first "data:" line replaced by data; its
// other lines (event names, ids) are kept.
func ReplaceEventData(ev, data []byte) []byte {
	out := make([]byte, 0, len(ev)+len(data))
	rest := ev
	replaced := false
	for len(rest) > 0 {
		line := rest
		if i := bytes.IndexByte(rest, '\n'); i >= 0 {
			line, rest = rest[:i+1], rest[i+1:]
		} else {
			rest = nil
		}
		if !replaced && bytes.HasPrefix(line, []byte("data:")) {
			replaced = true
			out = append(out, "data: "...)
			out = append(out, data...)
			if bytes.HasSuffix(line, []byte("\r\n")) {
				out = append(out, '\r', '\n')
			} else {
				out = append(out, '\n')
			}
			continue
		}
		out = append(out, line...)
	}
	return out
}
