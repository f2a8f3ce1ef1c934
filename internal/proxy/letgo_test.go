package proxy

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"
	"weak"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// headWriter renders its head when it is written and keeps no header map past it, as Baton's
// HTTP server does for a stream.
type headWriter struct {
	mu     sync.Mutex
	header http.Header
	head   bytes.Buffer
	body   bytes.Buffer
}

func (w *headWriter) Header() http.Header {
	if w.header == nil {
		w.header = http.Header{}
	}
	return w.header
}

func (w *headWriter) WriteHeader(code int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.header.Write(&w.head)
	w.header = nil
}

func (w *headWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.body.Write(p)
}

func (w *headWriter) Flush() {}

func (w *headWriter) bodyString() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.body.String()
}

// An answer being relayed holds neither the request that obtained it (a PD decode's body, which
// Baton built for the leg, its headers) nor, once its head went out, the engine's head: they are
// garbage while the stream stays open. (Under net/http's transport, --upstream-client net, the
// transport itself holds the request for as long as its answer is read.)
func TestAnOpenAnswerHoldsNotItsRequest(t *testing.T) {
	release := make(chan struct{})
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("X-Large", strings.Repeat("v", 4096))
		io.WriteString(w, "data: {}\n\n")
		w.(http.Flusher).Flush()
		<-release
	}))
	defer engine.Close()
	defer close(release)
	tr := NewTransport("baton")
	defer CloseIdle(tr, "")
	p := &Proxy{Transport: tr, Timeout: 5 * time.Second}
	w := worker.New(config.Worker{URL: engine.URL})
	in := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	body := []byte(`{"model":"m","prompt":"a prompt long enough to be its own allocation","stream":true}`)
	bodyHeld := weak.Make(&body[0])
	var leg Leg
	leg.Start(w, "")
	defer leg.Excuse()
	resp, err := p.Send(ctx, in, &leg, Call{Path: "/v1/completions", Body: body})
	if err != nil {
		t.Fatal(err)
	}
	body = nil
	v := resp.Header.Get("X-Large")
	headHeld := weak.Make(unsafe.StringData(v))
	v = ""
	rw := &headWriter{}
	relayed := make(chan error, 1)
	go func() { relayed <- p.Relay(ctx, rw, resp, nil, nil, Orders{}, nil) }()
	for !strings.Contains(rw.bodyString(), "data: {}") {
		select {
		case err := <-relayed:
			t.Fatalf("the relay ended: %v", err)
		case <-time.After(time.Millisecond):
		}
	}
	for range 3 {
		runtime.GC()
	}
	if bodyHeld.Value() != nil {
		t.Error("the answer, still open, holds the body of the request that obtained it")
	}
	if headHeld.Value() != nil {
		t.Error("the answer, still open, holds the engine's head it relayed already")
	}
	cancel()
	<-relayed
}
