package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/baton-llm/baton/internal/ssetest"
)

func TestEventReader(t *testing.T) {
	in := "data: {\"a\":1}\n\nevent: x\r\ndata: two\r\n\r\n: comment\n\ndata: [DONE]\n\ntrailing"
	whole := []string{"data: {\"a\":1}\n\n", "event: x\r\ndata: two\r\n\r\n", ": comment\n\n", "data: [DONE]\n\n", "trailing"}
	// Read a byte at a time, the CR of the second event's blank line ends it (a client dispatches
	// it there) and the LF behind it, the rest of that CRLF, is relayed at the next one's front.
	oneByte := []string{"data: {\"a\":1}\n\n", "event: x\r\ndata: two\r\n\r", "\n: comment\n\n", "data: [DONE]\n\n", "trailing"}
	for r, want := range map[io.Reader][]string{strings.NewReader(in): whole, iotest.OneByteReader(strings.NewReader(in)): oneByte} {
		er := NewEventReader(r)
		var got []string
		for {
			ev, err := er.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, string(ev))
		}
		if strings.Join(got, "|") != strings.Join(want, "|") {
			t.Errorf("events %q, want %q", got, want)
		}
	}
	if d, ok := EventData([]byte("event: x\r\ndata: two\r\n\r\n")); !ok || string(d) != "two" {
		t.Errorf("EventData = %q %v", d, ok)
	}
	if _, ok := EventData([]byte(": comment\n\n")); ok {
		t.Error("comment has no data")
	}
}

// views lends b in pieces of the sizes cuts gives (cycled), as Baton's upstream client lends
// views of its buffer: each valid until the next call (overwritten here to make sure of it).
type views struct {
	b    []byte
	cuts []byte
	i    int
	buf  []byte
}

func (v *views) Next() ([]byte, error) {
	if len(v.b) == 0 {
		return nil, io.EOF
	}
	n := 1
	if len(v.cuts) > 0 {
		n = int(v.cuts[v.i%len(v.cuts)])%64 + 1
		v.i++
	}
	n = min(n, len(v.b))
	for i := range v.buf {
		v.buf[i] = 'X' // the last view is gone
	}
	v.buf = append(v.buf[:0], v.b[:n]...)
	v.b = v.b[n:]
	return v.buf, nil
}

func (v *views) Read(p []byte) (int, error) { panic("a viewer is read through Next") }

func events(r *EventReader) (out []string, err error) {
	for {
		ev, err := r.Next()
		if len(ev) > 0 {
			out = append(out, string(ev))
		}
		if err != nil {
			return out, err
		}
	}
}

// checkEventsAsAClientReadsThem fails unless events are stream's bytes, every one, and each is
// where a client's event ends: what a client dispatches from each event alone is what it
// dispatches from the stream, event for event, and it is what EventDataWhole reads.
func checkEventsAsAClientReadsThem(t *testing.T, stream []byte, events []string) {
	t.Helper()
	if got := strings.Join(events, ""); got != string(stream) {
		t.Fatalf("events %q are not the stream %q", events, stream)
	}
	var got []string
	for _, ev := range events {
		one := ssetest.Dispatched([]byte(ev))
		if len(one) > 1 {
			t.Fatalf("event %q of %q holds %d client events", ev, stream, len(one))
		}
		got = append(got, one...)
		d, ok := EventDataWhole([]byte(ev))
		if len(one) == 1 && (!ok || string(d) != one[0]) {
			t.Fatalf("EventDataWhole(%q) = %q %v; a client reads %q", ev, d, ok, one[0])
		}
	}
	if want := ssetest.Dispatched(stream); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("stream %q: the events %q dispatch %q, a client %q", stream, events, got, want)
	}
}

// chunks reads b in pieces of the sizes cuts gives (cycled).
type chunks struct {
	b    []byte
	cuts []byte
	i    int
}

func (c *chunks) Read(p []byte) (int, error) {
	if len(c.b) == 0 {
		return 0, io.EOF
	}
	n := 1
	if len(c.cuts) > 0 {
		n = int(c.cuts[c.i%len(c.cuts)])%64 + 1
		c.i++
	}
	n = copy(p, c.b[:min(n, len(c.b))])
	c.b = c.b[n:]
	return n, nil
}

// Over views or reads of any sizes, the event reader returns the stream's bytes in events that
// end where a client's do: with lines ended by CR, LF or CRLF, a CRLF cut between reads, a blank
// line the stream begins with. A stream whose events a relay split elsewhere could show a
// client an event (a usage, an error) that the checks between it and the engine never saw.
func FuzzEventReaderOverViews(f *testing.F) {
	f.Add([]byte("data: a\n\ndata: b\r\n\r\n: c\n\ndata: d"), []byte{0, 5, 1})
	f.Add([]byte("data: {\"x\":1}\n\n\n\ndata: [DONE]\n\n"), []byte{3})
	f.Add([]byte("data: a\r\rdata: b\r\r: c\rdata: d\r\r"), []byte{7, 0, 2})
	f.Add([]byte("data: a\n\rdata: b\r\n\rdata: c\r\r\ndata: d\n\r\n"), []byte{8, 1})
	f.Add([]byte("\r\n\rdata: {\"u\":1}\r\ndata: 2\r\r\n\n"), []byte{2, 0})
	f.Fuzz(func(t *testing.T, b, cuts []byte) {
		if len(b) > 4096 {
			return
		}
		var all [][]string
		for _, r := range []io.Reader{bytes.NewReader(b), &chunks{b: b, cuts: cuts}, &views{b: b, cuts: cuts}} {
			got, err := events(NewEventReader(r))
			if err != io.EOF {
				t.Fatalf("%q cut %v: %v", b, cuts, err)
			}
			checkEventsAsAClientReadsThem(t, b, got)
			all = append(all, got)
		}
		// read whole, the event boundaries are the same whichever way the reader is fed
		if fmt.Sprint(all[0]) != fmt.Sprint(all[2]) && !bytes.Contains(b, []byte("\r")) {
			t.Fatalf("%q cut %v: over views %q, over a reader %q", b, cuts, all[2], all[0])
		}
	})
}

// A stream whose lines end with lone CRs, as SSE allows, is relayed event by event, each as its
// blank line arrives: the reader never waits for a LF that the stream does not send, and so
// never holds a whole stream as one event until it ends or passes MaxEventSize. (The engine
// here ends its stream if the first event was not returned a few seconds after it was sent,
// so that a reader that waits fails rather than hangs.)
func TestEventsWhoseLinesEndWithCRLeaveAsTheyEnd(t *testing.T) {
	pr, pw := io.Pipe()
	defer pr.Close()
	er := NewEventReader(pr)
	first := make(chan struct{})
	go func() {
		_, _ = pw.Write([]byte("data: {\"choices\":[]}\r\r"))
		select {
		case <-first:
		case <-time.After(5 * time.Second):
		}
		_, _ = pw.Write([]byte("data: {\"usage\":{\"prompt_tokens\":9}}\r"))
		_, _ = pw.Write([]byte("\r"))
		pw.Close()
	}()
	ev, err := er.Next()
	close(first)
	if err != nil || string(ev) != "data: {\"choices\":[]}\r\r" {
		t.Fatalf("first event %q %v, want it at its blank line, before the stream goes on", ev, err)
	}
	if ev, err := er.Next(); err != nil || string(ev) != "data: {\"usage\":{\"prompt_tokens\":9}}\r\r" {
		t.Fatalf("second event %q %v", ev, err)
	}
	if er.Pending() {
		t.Fatal("an event is pending with no bytes after the last one")
	}
	if _, err := er.Next(); err != io.EOF {
		t.Fatalf("after the stream's end: %v", err)
	}
}

// A stream waiting between events over views holds no buffer of its own.
func TestEventReaderOverViewsHoldsNoBufferBetweenEvents(t *testing.T) {
	r := NewEventReader(&views{b: []byte("data: a\n\ndata: b\n\n"), cuts: []byte{4}}) // "data", ": a\n", "\ndat", ...
	if ev, err := r.Next(); string(ev) != "data: a\n\n" || err != nil {
		t.Fatalf("%q %v", ev, err)
	}
	if ev, err := r.Next(); string(ev) != "data: b\n\n" || err != nil {
		t.Fatalf("%q %v", ev, err)
	}
	if _, err := r.Next(); err != io.EOF {
		t.Fatal(err)
	}
	if r.buf != nil {
		t.Errorf("an emptied buffer is still held (%d bytes)", cap(r.buf))
	}
}

// An event's payload is read as a client reads it, its data lines joined by newlines, and
// written back on one line, its other fields kept; a payload's bytes are never changed but
// its line breaks (whitespace between JSON tokens).
func TestEventDataWholeJoinsAndReplaceKeepsOneLine(t *testing.T) {
	for _, c := range []struct{ ev, data string }{
		{"data: {\"a\":1}\n\n", `{"a":1}`},
		{"event: x\r\ndata:{\"a\":\r\ndata: 1}\r\n\r\n", "{\"a\":\n1}"},
		{"data: {\"a\":\ndata: 1,\ndata:\"b\":2}\n\n", "{\"a\":\n1,\n\"b\":2}"},
		{"id: 7\n\n", ""},
		{": c\rdata: {\"a\":\rdata: 1}\r\r", "{\"a\":\n1}"}, // a lone CR ends a line too
	} {
		got, ok := EventDataWhole([]byte(c.ev))
		if string(got) != c.data || ok != (c.data != "") {
			t.Errorf("EventDataWhole(%q) = %q, %v; want %q", c.ev, got, ok, c.data)
		}
	}
	out := ReplaceEventDataWhole([]byte("event: x\r\ndata: {\"a\":\r\ndata: 1}\r\nid: 3\r\n\r\n"), []byte("{\"a\":\n2,\"\xff\":\"é\"}"))
	if want := "event: x\r\ndata: {\"a\": 2,\"\xff\":\"é\"}\r\nid: 3\r\n\r\n"; string(out) != want {
		t.Errorf("ReplaceEventDataWhole = %q, want %q", out, want)
	}
}

// GetLast reads the member a client's JSON parser keeps when a key repeats: the last.
func TestGetLastIsWhatAClientReads(t *testing.T) {
	body := []byte(`{"usage":{"n":1},"x":2,"usage":{"n":3}}`)
	var v struct{ Usage json.RawMessage }
	if err := json.Unmarshal(body, &v); err != nil {
		t.Fatal(err)
	}
	if got, ok := GetLast(body, "usage"); !ok || string(got) != string(v.Usage) {
		t.Errorf("GetLast = %s, %v; encoding/json keeps %s", got, ok, v.Usage)
	}
	if got, ok := Get(body, "usage"); !ok || string(got) != `{"n":1}` {
		t.Errorf("Get = %s, %v", got, ok)
	}
	if _, ok := GetLast(body, "none"); ok {
		t.Error("GetLast found a member that is not there")
	}
}

// BenchmarkEventReader reads a stream of vLLM-sized token events, LF-ended, lent in 4 KiB views
// as Baton's upstream client lends them.
func BenchmarkEventReader(b *testing.B) {
	ev := `data: {"id":"chatcmpl-0d6f3c2a9b","object":"chat.completion.chunk","created":1764892800,"model":"m","choices":[{"index":0,"delta":{"content":" token"},"logprobs":null,"finish_reason":null}]}` + "\n\n"
	stream := []byte(strings.Repeat(ev, 1000))
	b.SetBytes(int64(len(stream)))
	for b.Loop() {
		drain(NewEventReader(&pieces{b: stream, n: 4 << 10}))
	}
}

// drain reads r's events to the stream's end.
func drain(r *EventReader) {
	for {
		if _, err := r.Next(); err != nil {
			return
		}
	}
}

// pieces lends b in views of n bytes.
type pieces struct {
	b []byte
	n int
}

func (p *pieces) Next() ([]byte, error) {
	if len(p.b) == 0 {
		return nil, io.EOF
	}
	v := p.b[:min(p.n, len(p.b))]
	p.b = p.b[len(v):]
	return v, nil
}

func (p *pieces) Read([]byte) (int, error) { panic("a viewer is read through Next") }

// BenchmarkEventReaderLongEvent reads one 4 MiB event (a long data line) lent in 4 KiB views: the
// scan for its end goes on where it stopped at each view, never from the event's start again.
func BenchmarkEventReaderLongEvent(b *testing.B) {
	stream := []byte("data: " + strings.Repeat("x", 4<<20) + "\n\n")
	b.SetBytes(int64(len(stream)))
	for b.Loop() {
		drain(NewEventReader(&pieces{b: stream, n: 4 << 10}))
	}
}

// A stream is named text/event-stream in any letter case, with or without parameters; another
// type that begins so is not one.
func TestIsEventStream(t *testing.T) {
	for ct, want := range map[string]bool{
		"text/event-stream": true, "Text/Event-Stream": true, "TEXT/EVENT-STREAM; charset=utf-8": true, "text/event-stream;charset=utf-8": true,
		"text/event-streams": false, "application/json": false, "": false, "text/event": false, "x-text/event-stream": false,
	} {
		if got := IsEventStream(ct); got != want {
			t.Errorf("IsEventStream(%q) = %v, want %v", ct, got, want)
		}
	}
}

// A line "data" without a colon is a data field with an empty value, as SSE reads fields: it
// joins the event's data, and a rewrite of the data takes it as one of the event's data lines.
func TestADataLineWithoutAColonIsAnEmptyDataField(t *testing.T) {
	for ev, want := range map[string]string{
		"data\n\n":                  "",
		"data\ndata: {\"a\":1}\n\n": "\n{\"a\":1}",
		"data: {\"a\":1}\ndata\n\n": "{\"a\":1}\n",
		"data\r\r":                  "",
	} {
		if got, ok := EventDataWhole([]byte(ev)); !ok || string(got) != want {
			t.Errorf("EventDataWhole(%q) = %q %v; a client reads %q", ev, got, ok, want)
		}
		if want := ssetest.Dispatched([]byte(ev)); len(want) != 1 {
			t.Fatalf("%q: the reference reads %q", ev, want)
		}
	}
	if got := string(ReplaceEventDataWhole([]byte("data\ndata: {\"a\":1}\n\n"), []byte(`{"a":2}`))); got != "data: {\"a\":2}\n\n" {
		t.Errorf("rewritten: %q", got)
	}
	if _, ok := EventDataWhole([]byte("database: x\n\n")); ok {
		t.Error("a field named otherwise is no data line")
	}
}
