package openai

import (
	"bytes"
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
