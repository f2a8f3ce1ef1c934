package proxy

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"unicode/utf8"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
)

// Engines that answered a stream with 200 report a later failure inside it: vLLM writes
// data: {"error": {"message", "type", "param", "code"}} and then [DONE] (older releases, and
// SGLang's OpenAI routes, the flat {"object": "error", …, "code"} inside "error" or alone);
// SGLang's /generate ends with a chunk whose meta_info.finish_reason is {"type": "abort",
// "status_code", "message"}; responses streams send {"type": "error"} or "response.failed", and
// messages streams {"type": "error", "error": {…}}. Baton relays these bytes as they are — the
// client's SDK reads them — and counts the request as failed.

// InBandError is an engine's error event inside a stream it had answered 200 (outcome's).
type InBandError = outcome.InBandError

// maxErrorLine bounds the data of an event the watch looks at: error events are short, and one
// whose data (its data lines joined) is longer is passed over, however the reads cut it. The
// watch keeps at most maxLine of an unfinished line and maxErrorLine of an event's data: about
// 8 KiB, and only while an event is cut across reads.
const maxErrorLine = 4 << 10

// maxLine bounds an unfinished line the watch keeps: a data line of maxErrorLine bytes of data
// with its field name, colon and space.
const maxLine = maxErrorLine + len("data: ")

// watch spots an engine's error event in a stream relayed as it is, read as an SSE client reads
// it across reads: lines end at LF, CR or CRLF (a CRLF cut between reads too), an event's data
// lines are joined by LF, and the event is looked at when its blank line comes, as a client
// dispatches it.
type watch struct {
	partial []byte // the start of an unfinished line (≤ maxLine), allocated when first needed
	skip    bool   // the unfinished line is too long for an error event: pass over it
	data    []byte // the current event's data lines, joined (≤ maxErrorLine)
	lines   int    // the current event's data lines
	long    bool   // the current event is too long for an error event
	seen    bool   // the current event was looked at in place (line's last)
	cr      bool   // the last read ended with a CR: a LF next is the rest of its CRLF
	done    bool   // [DONE] was read: a client reads nothing after it
	events  int    // the events with data looked at, [DONE] not counted
	err     *InBandError
}

// see reads one chunk of the stream. The chunk's next LF is looked for once, not once per line,
// so a chunk of lone CRs is read in one pass.
func (w *watch) see(b []byte) {
	if len(b) == 0 {
		return // nothing read: a CR that ended the last read still waits for its LF
	}
	pos := 0
	if w.cr && len(b) > 0 && b[0] == '\n' {
		pos = 1
	}
	w.cr = false
	lf := -1
	for pos < len(b) && w.err == nil && !w.done {
		end, next, cr := openai.LineEnd(b, pos, &lf)
		line, ended := b[pos:end], end < len(b)
		pos, w.cr = next, cr
		if w.skip {
			w.skip = !ended
			continue
		}
		if len(w.partial) > 0 {
			if len(w.partial)+len(line) > maxLine {
				w.tooLong(w.partial, line, !ended)
				continue
			}
			w.partial = append(w.partial, line...)
			line = w.partial
		}
		if !ended {
			if len(line) > maxLine {
				w.tooLong(line, nil, true)
			} else if len(w.partial) == 0 {
				w.partial = append(w.partial, line...)
			}
			continue
		}
		// the event's one data line, its blank line next in this read: looked at where it lies
		blank := pos < len(b) && (b[pos] == '\n' || b[pos] == '\r')
		w.line(line, blank && len(w.partial) == 0)
		w.partial = nil // a line cut across reads is kept only until it ends
	}
}

// tooLong passes over a line longer than an error event's data line can be, whose first bytes
// are start followed by more; skip says its end is still to come. A data line makes its event too
// long to be one; another field, or a comment, leaves the event as it was, as a client ignores
// it. The field's name is read across start and more: the read that began the line may have
// held no more of it than "d".
func (w *watch) tooLong(start, more []byte, skip bool) {
	var name [len("data:")]byte
	n := copy(name[:], start)
	n += copy(name[n:], more)
	if string(name[:n]) == "data:" {
		w.long = true
	}
	w.partial, w.skip = nil, skip
}

// line takes one complete line of the stream: a data line's value joins the event's data, a
// blank line ends the event, which is looked at when it had data. last says the event's blank
// line comes next, in the read that holds line: an event of one data line, the common case, is
// looked at in place, and nothing of it is kept. The data of an event read in pieces is kept
// until its end, and let go then: a stream waiting for its next event holds none.
func (w *watch) line(line []byte, last bool) {
	if len(line) == 0 {
		if w.lines > 0 && !w.long && !w.seen {
			w.dispatch(w.data)
		}
		if cap(w.data) > 0 {
			w.data = nil
		}
		w.lines, w.long, w.seen = 0, false, false
		return
	}
	v, ok := openai.DataValue(line)
	if !ok || w.long {
		return // another field, a comment, or an event already too long
	}
	if sep := min(w.lines, 1); len(w.data)+sep+len(v) > maxErrorLine { // joined by LF
		w.data, w.long = nil, true
		return
	}
	if w.lines++; w.lines == 1 && last {
		w.dispatch(v)
		w.seen = true
		return
	}
	if w.lines > 1 {
		w.data = append(w.data, '\n')
	}
	w.data = append(w.data, v...)
}

// dispatch looks at one event's data as a client reads it: [DONE] ends what a client reads of
// the stream (openai-python stops there), so nothing after it is an error of this request.
func (w *watch) dispatch(data []byte) {
	if bytes.HasPrefix(data, []byte("[DONE]")) {
		w.done = true
		return
	}
	w.events++
	w.err = errorEvent(data)
}

// errorMarks are in the data of every engine's error event, whatever member comes first: a
// member or value "error" (vLLM, SGLang's OpenAI routes, responses and messages streams),
// "response.failed", or SGLang's "abort" finish reason. A mark only lets the event be parsed
// (text that ends with one, such as "an error", passes too); parseErrorEvent decides. They begin
// without the opening quote, which JSON has everywhere and searching for it is slow. A \u escape
// lets the event be parsed too: a name spelled with one ("\u0065rror") is the same name to a
// client.
var errorMarks = [][]byte{[]byte(`error"`), []byte(`abort"`), []byte(`.failed"`), []byte(`\u`)}

// errorEvent returns the error an event's data reports, or nil.
func errorEvent(data []byte) *InBandError {
	data = bytes.TrimLeft(data, " \t\r\n") // what JSON parsers skip
	if len(data) == 0 || data[0] != '{' {
		return nil
	}
	for _, m := range errorMarks {
		if bytes.Contains(data, m) {
			return parseErrorEvent(data)
		}
	}
	return nil
}

// parseErrorEvent reads the status and message of an error event's data; nil when it turns out
// to be none. The data is read as Python's json reads it (pyMembers): an "error" member that
// Python finds true is an error, as openai-python raises on it (its message the error's
// "message" when that is a string); short of one, the other engines' shapes: the flat object or
// type "error", "response.failed", and SGLang's abort finish reason. Data a client cannot decode
// (not UTF-8, not one JSON object) is no error event.
func parseErrorEvent(data []byte) *InBandError {
	if !utf8.Valid(data) {
		return nil
	}
	top, ok := pyMembers(data, "error", "object", "type", "code", "message", "meta_info")
	if !ok {
		return nil
	}
	if e := top[0]; pyTruthy(e) {
		code, msg := top[3], []byte(nil) // an error that is no object: the event's own code
		switch e[0] {
		case '{':
			in, _ := pyMembers(e, "code", "message")
			code, msg = in[0], in[1]
		case '"':
			msg = e
		}
		return inBand(code, pyStr(msg))
	}
	if obj, typ := pyStr(top[1]), pyStr(top[2]); obj == "error" || typ == "error" || typ == "response.failed" {
		return inBand(top[3], pyStr(top[4]))
	}
	if mi := top[5]; len(mi) > 0 && mi[0] == '{' {
		fr, _ := pyMembers(mi, "finish_reason")
		if f := fr[0]; len(f) > 0 && f[0] == '{' {
			v, _ := pyMembers(f, "type", "status_code", "message")
			if pyStr(v[0]) == "abort" {
				return inBand(v[1], pyStr(v[2]))
			}
		}
	}
	return nil
}

// inBand builds the error of an event naming code (an HTTP status, or anything else) and msg.
func inBand(code json.RawMessage, msg string) *InBandError {
	status, unnamed := http.StatusInternalServerError, true
	var n int
	if json.Unmarshal(code, &n) == nil && n >= 400 && n <= 599 {
		status, unnamed = n, false
	}
	if len(msg) > 256 {
		cut := 256
		for cut > 0 && !utf8.RuneStart(msg[cut]) {
			cut-- // never inside a character
		}
		msg = msg[:cut] + "…"
	}
	return &InBandError{Status: status, Message: msg, Unnamed: unnamed}
}

// maxRefusalHead bounds what is read of a stream, before any of it is relayed, to find its first
// event: an error event's data is at most maxErrorLine, and comments or other fields may come
// before it (vLLM's keep-alive comments).
const maxRefusalHead = 2 * maxErrorLine

// refusalStatus is the status a refusal in a stream's first event is held as when the event
// names none: SGLang's /generate writes {"error": {"message"}} for what it answers 400 when not
// streamed (http_server.py, generate_request: a ValueError is _create_error_response's 400).
const refusalStatus = http.StatusBadRequest

// holdRefusal reads a stream's first event before a byte of the stream reaches the client, where
// the call holds statuses (hold): an engine that refuses a streamed request after its 200 says so
// in the stream's first event — SGLang raises inside the generator its stream runs
// (tokenizer_manager.py, generate_request: an adapter not loaded, lora_registry.py's acquire) and
// sends the error as the stream's one event, then [DONE]. That event, when it names a held
// status (one naming none as refusalStatus), is held as an answer of that status would be: the
// leg ends with it and the returned *outcome.Failure carries the event's data as the worker's
// answer, for the caller to retry or write. Anything else is relayed as it came: what was read is
// put back in front of resp's body, and holdRefusal returns nil. A failure to read is the
// read's failure (nothing was relayed: the caller may retry).
func (p *Proxy) holdRefusal(r *http.Request, leg *Leg, resp *http.Response, hold []int) error {
	var w watch
	head := make([]byte, 0, 1<<10)
	var rerr error
	for w.err == nil && w.events == 0 && !w.done && len(head) < maxRefusalHead && rerr == nil {
		if len(head) == cap(head) {
			head = slices.Grow(head, len(head))
		}
		var n int
		n, rerr = resp.Body.Read(head[len(head):cap(head)])
		w.see(head[len(head) : len(head)+n])
		head = head[:len(head)+n]
	}
	if rerr != nil && rerr != io.EOF && w.err == nil {
		return p.Failure(r, leg, rerr)
	}
	if ib := w.err; ib != nil && w.events == 1 {
		status := ib.Status
		if ib.Unnamed {
			status = refusalStatus
		}
		if slices.Contains(hold, status) {
			data, _ := openai.EventDataWhole(firstDataEvent(head))
			leg.Done(status, nil)
			return &outcome.Failure{Worker: leg.W.URL, Status: status, Header: http.Header{"Content-Type": {"application/json"}}, Body: slices.Clone(data)}
		}
	}
	replay := &replayed{head: head, err: rerr, ReadCloser: resp.Body}
	if v, ok := resp.Body.(viewer); ok {
		resp.Body = &replayedViewer{replayed: replay, v: v}
	} else {
		resp.Body = replay
	}
	return nil
}

// firstDataEvent is the first event of stream b that has a data line (nil when none ended in b).
func firstDataEvent(b []byte) []byte {
	er := openai.NewEventReader(&replayed{head: b, err: io.EOF})
	for {
		ev, err := er.Next()
		if _, ok := openai.EventData(ev); ok || err != nil {
			return ev
		}
	}
}

// replayed is a body whose first bytes were read already (head), and which ended with err when
// not nil: those bytes are read again first.
type replayed struct {
	io.ReadCloser
	head []byte
	err  error
}

func (b *replayed) Read(p []byte) (int, error) {
	if len(b.head) > 0 {
		n := copy(p, b.head)
		b.head = b.head[n:]
		return n, nil
	}
	if b.err != nil {
		return 0, b.err
	}
	return b.ReadCloser.Read(p)
}

// replayedViewer is a replayed body that lends views of its own buffer: head first.
type replayedViewer struct {
	*replayed
	v viewer
}

func (b *replayedViewer) Next() ([]byte, error) {
	if h := b.head; len(h) > 0 {
		b.head = nil
		return h, nil
	}
	if b.err != nil {
		return nil, b.err
	}
	return b.v.Next()
}
