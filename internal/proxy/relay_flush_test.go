package proxy

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/record"
)

// flushRecorder is a client's connection: what was written, and what of it was flushed; flushed
// is signalled once a flush carries want.
type flushRecorder struct {
	mu      sync.Mutex
	h       http.Header
	pending bytes.Buffer
	sent    bytes.Buffer
	want    string
	flushed chan struct{}
}

func (f *flushRecorder) Header() http.Header { return f.h }
func (f *flushRecorder) WriteHeader(int)     {}
func (f *flushRecorder) Write(b []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pending.Write(b)
}

func (f *flushRecorder) Flush() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sent.Write(f.pending.Bytes())
	f.pending.Reset()
	if f.flushed != nil && strings.Contains(f.sent.String(), f.want) {
		close(f.flushed)
		f.flushed = nil
	}
}

// No event waits for a later one, also where the event behind it is taken out of the stream: a
// token event that arrived in one read with the usage-only event Baton strips (Baton asked for
// usage the client did not) was written unflushed, the usage event being buffered, and the
// stripped event wrote nothing, so the token waited for the engine's next event. The engine
// here sends [DONE] once the client has the token, or after 5 s, and the client must have had
// the token before [DONE] was sent.
func TestAStrippedUsageEventHoldsBackNoEventBeforeIt(t *testing.T) {
	pr, pw := io.Pipe()
	rw := &flushRecorder{h: http.Header{}, want: `"last"`, flushed: make(chan struct{})}
	got := rw.flushed
	const token = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"last\"},\"finish_reason\":\"stop\"}]}\n\n"
	const usage = "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\n"
	beforeDone := make(chan bool, 1)
	go func() {
		_, _ = io.WriteString(pw, token+usage) // one read
		select {
		case <-got:
			beforeDone <- true
		case <-time.After(5 * time.Second):
			beforeDone <- false
		}
		_, _ = io.WriteString(pw, "data: [DONE]\n\n")
		pw.Close()
	}()
	h := http.Header{"Content-Type": {"text/event-stream"}}
	if err := testProxy().Relay(context.Background(), rw, upstreamAnswer(200, h, pr), nil, &record.Record{}, Orders{StripUsage: true}, nil); err != nil {
		t.Fatal(err)
	}
	if !<-beforeDone {
		t.Error("the token event reached the client only with [DONE], the event after the stripped usage")
	}
	if s := rw.sent.String(); strings.Contains(s, "usage") || !strings.HasSuffix(s, "data: [DONE]\n\n") {
		t.Errorf("the client got %q", s)
	}
}
