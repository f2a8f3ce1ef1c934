package openai

import (
	"errors"
	"io"
	"testing"
)

// countingViews lends b in views cut at the given offsets and counts the calls.
type countingViews struct {
	b     []byte
	cuts  []int
	calls int
	last  []byte
}

func (v *countingViews) Next() ([]byte, error) {
	v.calls++
	for i := range v.last {
		v.last[i] = 'X'
	}
	if len(v.b) == 0 {
		return nil, io.EOF
	}
	n := len(v.b)
	if len(v.cuts) > 0 {
		n, v.cuts = min(v.cuts[0], n), v.cuts[1:]
	}
	v.last = append([]byte(nil), v.b[:n]...)
	v.b = v.b[n:]
	return v.last, nil
}
func (v *countingViews) Read([]byte) (int, error) { panic("views") }

// countingReader reads b cut at the given offsets and counts the reads.
type countingReader struct {
	b     []byte
	cuts  []int
	calls int
}

func (r *countingReader) Read(p []byte) (int, error) {
	r.calls++
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	n := len(r.b)
	if len(r.cuts) > 0 {
		n, r.cuts = min(r.cuts[0], n), r.cuts[1:]
	}
	n = copy(p, r.b[:n])
	r.b = r.b[n:]
	return n, nil
}

// Every stream over a small alphabet of SSE pieces, every single and double cut, over a reader
// and over views: the events are the client's (checkEventsAsAClientReadsThem), and Pending is
// true exactly when the next Next returns without reading (the relay's flush rule).
func TestEventReaderOverEveryShortStream(t *testing.T) {
	pieces := []string{"data: a", "\r", "\n", ": c", "data:b"}
	var streams []string
	var gen func(s string, depth int)
	gen = func(s string, depth int) {
		streams = append(streams, s)
		if depth == 0 {
			return
		}
		for _, p := range pieces {
			gen(s+p, depth-1)
		}
	}
	gen("", 6)
	checked := 0
	for _, s := range streams {
		b := []byte(s)
		var cutsets [][]int
		cutsets = append(cutsets, nil)
		for i := 1; i < len(b); i++ {
			cutsets = append(cutsets, []int{i})
			for j := 1; i+j < len(b) && len(b) <= 12; j++ {
				cutsets = append(cutsets, []int{i, j})
			}
		}
		for _, cuts := range cutsets {
			for kind := 0; kind < 2; kind++ {
				var er *EventReader
				var calls func() int
				if kind == 0 {
					v := &countingViews{b: b, cuts: append([]int(nil), cuts...)}
					er, calls = NewEventReader(v), func() int { return v.calls }
				} else {
					r := &countingReader{b: b, cuts: append([]int(nil), cuts...)}
					er, calls = NewEventReader(r), func() int { return r.calls }
				}
				var got []string
				for {
					ev, err := er.Next()
					if len(ev) > 0 {
						got = append(got, string(ev))
					}
					if err == io.EOF {
						break
					}
					if err != nil {
						t.Fatal(err)
					}
					pending := er.Pending()
					c := calls()
					ev2, err2 := er.Next()
					if len(ev2) > 0 {
						got = append(got, string(ev2))
					}
					read := calls() != c
					if pending && read {
						t.Fatalf("%q cuts %v kind %d: Pending said an event was buffered, Next read", s, cuts, kind)
					}
					if !pending && !read && len(ev2) > 0 && err2 == nil {
						t.Fatalf("%q cuts %v kind %d: Pending said none buffered, Next returned %q without reading", s, cuts, kind, ev2)
					}
					if err2 == io.EOF {
						break
					}
					if err2 != nil {
						t.Fatal(err2)
					}
				}
				checkEventsAsAClientReadsThem(t, b, got)
				checked++
			}
		}
	}
	t.Logf("%d streams, %d reads checked", len(streams), checked)
}

// An event of exactly MaxEventSize bytes is taken over a reader and over views; one byte more is
// ErrEventTooLarge. (Over views whose length does not divide the bound, an event up to one view
// past it is taken, since the bound is checked before a view is gathered.)
func TestEventReaderTakesEventsUpToMaxEventSize(t *testing.T) {
	mk := func(n int) []byte {
		b := make([]byte, n)
		copy(b, "data: ")
		for i := 6; i < n-2; i++ {
			b[i] = 'x'
		}
		b[n-2], b[n-1] = '\n', '\n'
		return b
	}
	for _, c := range []struct {
		n      int
		wantOK bool
	}{{MaxEventSize, true}, {MaxEventSize + 1, false}} {
		b := mk(c.n)
		for kind, r := range []io.Reader{&chunks{b: b, cuts: []byte{63}}, &pieces{b: b, n: 64 << 10}} {
			er := NewEventReader(r)
			ev, err := er.Next()
			ok := err == nil && len(ev) == c.n
			if ok != c.wantOK {
				t.Errorf("event of %d bytes, reader kind %d: %d bytes, %v; want ok %v", c.n, kind, len(ev), err, c.wantOK)
			}
			if !c.wantOK && err != nil && !errors.Is(err, ErrEventTooLarge) {
				t.Errorf("event of %d bytes: %v", c.n, err)
			}
		}
	}
}
