package openai

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"sync"
)

// MaxEventSize bounds one SSE event an EventReader holds: a stream that sends more without a
// blank line is broken (ErrEventTooLarge), not a reason to grow without end.
const MaxEventSize = 16 << 20

// ErrEventTooLarge is returned by EventReader.Next for an event longer than MaxEventSize.
var ErrEventTooLarge = errors.New("SSE event exceeds 16 MiB without a terminating blank line")

// EventReader splits an SSE stream into events. Each event is returned with its terminating
// blank line, exactly as read, so an event that is not changed is relayed byte for byte.
//
// Over a reader that lends views of its own buffer (Baton's upstream client: Next), events that
// lie whole in a view are returned from it without a copy, and only an event cut across views
// is gathered in a buffer of its own, taken from a pool and given back once it is emptied: a
// stream waiting for its next event holds no buffer. Over any other reader it reads into an
// 8 KiB buffer that grows up to MaxEventSize.
type EventReader struct {
	r   io.Reader
	buf []byte
	off int // start of unread bytes in buf
	err error

	v    viewer
	view []byte // the unread rest of the last view

	scan eventScan // how far the next event's bytes were looked at

	progress func() // called after every read that brought bytes (OnProgress)
}

// OnProgress has f called after every read of the source that brought bytes, however far from
// a whole event they are (a stall watch times the source, not the events).
func (e *EventReader) OnProgress(f func()) { e.progress = f }

// viewer lends views of its own read buffer, each valid until the next call.
type viewer interface {
	Next() ([]byte, error)
}

var eventBufs = sync.Pool{New: func() any { b := make([]byte, 0, 8<<10); return &b }}

// NewEventReader returns an EventReader over r.
func NewEventReader(r io.Reader) *EventReader {
	if v, ok := r.(viewer); ok {
		return &EventReader{r: r, v: v}
	}
	return &EventReader{r: r, buf: make([]byte, 0, 8<<10)}
}

// Next returns the next event. At the end of the stream it returns any unterminated remainder
// and then io.EOF; other read errors are returned as they happen. The returned slice is valid
// until the next call.
func (e *EventReader) Next() ([]byte, error) {
	if e.v != nil {
		return e.nextView()
	}
	for {
		if end := e.scan.end(e.buf[e.off:]); end > 0 {
			ev := e.buf[e.off : e.off+end]
			e.off += end
			e.ended()
			return ev, nil
		}
		if e.err != nil {
			if e.off < len(e.buf) {
				ev := e.buf[e.off:]
				e.off = len(e.buf)
				e.scan = eventScan{}
				return ev, nil
			}
			return nil, e.err
		}
		e.compact()
		if len(e.buf) >= MaxEventSize {
			e.err = ErrEventTooLarge
			e.off = len(e.buf) // the partial event is dropped, never relayed as if whole
			e.scan = eventScan{}
			return nil, e.err
		}
		if len(e.buf) == cap(e.buf) {
			e.buf = append(e.buf, make([]byte, min(len(e.buf), MaxEventSize-len(e.buf)))...)[:len(e.buf)]
		}
		n, err := e.r.Read(e.buf[len(e.buf):cap(e.buf)])
		if n > 0 && e.progress != nil {
			e.progress()
		}
		e.buf = e.buf[:len(e.buf)+n]
		if err != nil {
			e.err = err
		}
	}
}

// ended starts the scan of the next event, once one ended: a LF it begins with is the rest of
// the CRLF the last one ended with, where that ended with a CR.
func (e *EventReader) ended() { e.scan = eventScan{cr: e.scan.cr} }

// compact moves the unread bytes to the front of buf.
func (e *EventReader) compact() {
	if e.off > 0 {
		n := copy(e.buf, e.buf[e.off:])
		e.buf, e.off = e.buf[:n], 0
	}
}

// nextView is Next over a viewer: whole events straight from the view, an event cut across
// views gathered in a pooled buffer, given back once it is emptied.
func (e *EventReader) nextView() ([]byte, error) {
	for {
		if e.buf == nil || e.off == len(e.buf) { // nothing gathered
			e.release()
			if end := e.scan.end(e.view); end > 0 {
				ev := e.view[:end]
				e.view = e.view[end:]
				e.ended()
				return ev, nil
			}
			if len(e.view) > 0 { // the start of an event the next view continues
				e.gather(e.view)
				e.view = nil
				continue
			}
		} else if end := e.scan.end(e.buf[e.off:]); end > 0 {
			ev := e.buf[e.off : e.off+end]
			e.off += end
			e.ended()
			return ev, nil
		}
		if e.err != nil {
			if e.buf != nil && e.off < len(e.buf) {
				ev := e.buf[e.off:]
				e.off = len(e.buf)
				e.scan = eventScan{}
				return ev, nil
			}
			return nil, e.err
		}
		if e.buf != nil && len(e.buf)-e.off >= MaxEventSize {
			e.err = ErrEventTooLarge
			e.off = len(e.buf) // the partial event is dropped, never relayed as if whole
			e.scan = eventScan{}
			return nil, e.err
		}
		v, err := e.v.Next()
		if len(v) > 0 && e.progress != nil {
			e.progress()
		}
		if err != nil {
			e.err = err
		}
		if e.buf != nil && e.off < len(e.buf) {
			e.gather(v) // the cut event goes on
		} else {
			e.view = v
		}
	}
}

// gather appends b to the buffer of a cut event, taking one from the pool when there is none.
func (e *EventReader) gather(b []byte) {
	if e.buf == nil {
		e.buf = (*eventBufs.Get().(*[]byte))[:0]
		e.off = 0
	}
	e.compact()
	e.buf = append(e.buf, b...)
}

// release gives an emptied buffer back to the pool.
func (e *EventReader) release() {
	if e.buf != nil && cap(e.buf) <= 64<<10 {
		b := e.buf[:0]
		eventBufs.Put(&b)
	}
	e.buf, e.off = nil, 0
}

// Pending reports whether another complete event is already buffered, so that Next will return
// it without reading. A relay flushes only when nothing is pending: events that arrived together
// leave together, and no event ever waits for a later one.
func (e *EventReader) Pending() bool {
	s := e.scan // looked at again by Next
	if e.buf != nil && e.off < len(e.buf) {
		return s.end(e.buf[e.off:]) > 0
	}
	return s.end(e.view) > 0
}

// eventScan finds where an SSE event ends as its bytes arrive, looking at each byte once: after
// its blank line, a line end that follows a line end (SSE ends a line at CRLF, LF or CR; a blank
// line that begins an event is taken with it). Positions are from the event's first byte.
type eventScan struct {
	n     int  // the event's bytes looked at
	ended bool // they end with a line's end, so a line end next ends a blank line
	cr    bool // they end with a CR, so a LF next is the rest of its CRLF
}

// end returns the length of the event whose bytes so far are b (b[:s.n] the ones looked at
// before), through its blank line; 0 while it has not ended.
func (s *eventScan) end(b []byte) int {
	i, lf := s.n, -1
	for i < len(b) {
		if s.cr {
			s.cr = false
			if b[i] == '\n' { // a CRLF cut after its CR
				i++
				continue
			}
		}
		j, next, cr := LineEnd(b, i, &lf)
		if j == len(b) { // no line end yet: the line goes on
			s.ended = false
			i = len(b)
			break
		}
		blank := s.ended && j == i
		s.ended, s.cr = true, cr
		if blank {
			return next
		}
		i = next
	}
	s.n = i
	return 0
}

// LineEnd finds the end of the line of b that starts at i, as SSE ends lines (CRLF, LF or CR):
// end is the index of its line end (len(b) where the line goes on past b), next the index after
// that line end, and cutCR reports a CR that ends b, whose CRLF a LF that comes first after b
// completes. lf carries b's next LF from one call to the next on the same b (start it at -1),
// so that a run of lines ended by lone CRs is read in one pass, not one pass per line.
func LineEnd(b []byte, i int, lf *int) (end, next int, cutCR bool) {
	if *lf < i {
		if *lf = bytes.IndexByte(b[i:], '\n'); *lf >= 0 {
			*lf += i
		} else {
			*lf = len(b)
		}
	}
	end = *lf
	if k := bytes.IndexByte(b[i:*lf], '\r'); k >= 0 {
		end = i + k
	}
	if end == len(b) {
		return end, end, false
	}
	next = end + 1
	if b[end] == '\r' {
		if next < len(b) && b[next] == '\n' {
			next++
		} else if next == len(b) {
			cutCR = true
		}
	}
	return end, next, cutCR
}

// EventData returns the payload of an event's "data:" line (the first, when there are several),
// without the prefix space; ok is false when the event has none.
func EventData(ev []byte) (data []byte, ok bool) {
	for len(ev) > 0 {
		var line []byte
		line, _, ev = nextLine(ev)
		if d, found := DataValue(line); found {
			return d, true
		}
	}
	return nil, false
}

// DataValue returns the value of a "data" field line, as SSE reads a field: the line up to its
// first colon names it (the whole line, without one), and one space after the colon is not
// part of the value.
func DataValue(line []byte) ([]byte, bool) {
	if string(line) == "data" {
		return line[len(line):], true
	}
	d, found := bytes.CutPrefix(line, []byte("data:"))
	return bytes.TrimPrefix(d, []byte(" ")), found
}

// EventDataWhole returns an event's payload as a client reads it: its "data:" lines' payloads
// joined by newlines (the SSE rule, where CR, LF and CRLF each end a line), the one line's bytes
// themselves where there is one; ok is false when the event has none.
func EventDataWhole(ev []byte) (data []byte, ok bool) {
	var joined []byte
	lines := 0
	for len(ev) > 0 {
		var line []byte
		line, _, ev = nextLine(ev)
		d, found := DataValue(line)
		if !found {
			continue
		}
		switch lines++; lines {
		case 1:
			data = d
		case 2:
			joined = append(append(append(joined, data...), '\n'), d...)
		default:
			joined = append(append(joined, '\n'), d...)
		}
	}
	if lines > 1 {
		return joined, true
	}
	return data, lines == 1
}

// nextLine splits b's first line off as SSE reads lines: the line, its end (CRLF, CR, LF, or
// none at b's end) and the rest.
func nextLine(b []byte) (line, end, rest []byte) {
	i := bytes.IndexAny(b, "\r\n")
	switch {
	case i < 0:
		return b, nil, nil
	case b[i] == '\r' && i+1 < len(b) && b[i+1] == '\n':
		return b[:i], b[i : i+2], b[i+2:]
	}
	return b[:i], b[i : i+1], b[i+1:]
}

// ReplaceEventDataWhole returns ev with its payload replaced by the JSON data, on one "data:"
// line where its first was (a line break in data, whitespace between JSON tokens, becomes a
// space); its other lines (event names, ids) are kept, its further "data:" lines dropped.
func ReplaceEventDataWhole(ev, data []byte) []byte {
	if bytes.ContainsAny(data, "\r\n") {
		one := make([]byte, len(data))
		for i, c := range data {
			if c == '\r' || c == '\n' {
				c = ' '
			}
			one[i] = c
		}
		data = one
	}
	return replaceData(ev, data, true)
}

// ReplaceEventData returns ev with the payload of its first "data:" line replaced by data; its
// other lines (event names, ids) are kept.
func ReplaceEventData(ev, data []byte) []byte { return replaceData(ev, data, false) }

// replaceData writes data on ev's first "data:" line, in its payload's place; its further
// "data:" lines are dropped where dropRest, else kept, and its other lines are kept.
func replaceData(ev, data []byte, dropRest bool) []byte {
	out := make([]byte, 0, len(ev)+len(data))
	replaced := false
	for rest := ev; len(rest) > 0; {
		var line, end []byte
		line, end, rest = nextLine(rest)
		if _, isData := DataValue(line); isData && (!replaced || dropRest) {
			if !replaced {
				replaced = true
				out = append(append(out, "data: "...), data...)
				if len(end) == 0 {
					end = []byte("\n")
				}
				out = append(out, end...)
			}
			continue
		}
		out = append(append(out, line...), end...)
	}
	return out
}

// IsEventStream reports whether a Content-Type names an SSE stream: text/event-stream, in any
// letter case (media types are case-insensitive, and clients read a stream so named), with or
// without parameters.
func IsEventStream(contentType string) bool {
	const t = "text/event-stream"
	if len(contentType) < len(t) || !strings.EqualFold(contentType[:len(t)], t) {
		return false
	}
	rest := contentType[len(t):]
	return rest == "" || rest[0] == ';' || rest[0] == ' ' || rest[0] == '\t'
}
