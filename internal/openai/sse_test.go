package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"
	"testing/iotest"
)

func TestEventReader(t *testing.T) {
	in := "data: {\"a\":1}\n\nevent: x\r\ndata: two\r\n\r\n: comment\n\ndata: [DONE]\n\ntrailing"
	want := []string{"data: {\"a\":1}\n\n", "event: x\r\ndata: two\r\n\r\n", ": comment\n\n", "data: [DONE]\n\n", "trailing"}
	for _, r := range []io.Reader{strings.NewReader(in), iotest.OneByteReader(strings.NewReader(in))} {
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

// Over views of any sizes, the event reader returns the same events as over a plain reader.
func FuzzEventReaderOverViews(f *testing.F) {
	f.Add([]byte("data: a\n\ndata: b\r\n\r\n: c\n\ndata: d"), []byte{0, 5, 1})
	f.Add([]byte("data: {\"x\":1}\n\n\n\ndata: [DONE]\n\n"), []byte{3})
	f.Fuzz(func(t *testing.T, b, cuts []byte) {
		want, werr := events(NewEventReader(bytes.NewReader(b)))
		got, gerr := events(NewEventReader(&views{b: b, cuts: cuts}))
		if fmt.Sprint(got) != fmt.Sprint(want) || werr != gerr {
			t.Fatalf("%q cut %v: over views %q %v, over a reader %q %v", b, cuts, got, gerr, want, werr)
		}
	})
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
