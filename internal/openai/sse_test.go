package openai

import (
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
