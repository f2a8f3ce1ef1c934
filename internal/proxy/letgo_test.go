package proxy

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"testing"
	"time"
	"weak"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// An answer being relayed does not hold the request that obtained it: a PD decode's body (which
// Baton built for the leg) and the request's headers are garbage once the answer's head is in,
// however long the stream stays open. (Under net/http's transport, --upstream-client net, the
// transport itself holds the request for as long as its answer is read.)
func TestAnOpenAnswerHoldsNotItsRequest(t *testing.T) {
	release := make(chan struct{})
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {}\n\n")
		w.(http.Flusher).Flush()
		<-release
	}))
	defer engine.Close()
	defer close(release)
	for _, client := range []string{"baton"} {
		t.Run(client, func(t *testing.T) {
			tr := NewTransport(client)
			defer CloseIdle(tr, "")
			p := &Proxy{Transport: tr, Timeout: 5 * time.Second}
			w := worker.New(config.Worker{URL: engine.URL})
			in := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			body := []byte(`{"model":"m","prompt":"a prompt long enough to be its own allocation","stream":true}`)
			held := weak.Make(&body[0])
			var leg Leg
			leg.Start(w, "")
			resp, err := p.Send(ctx, in, &leg, Call{Path: "/v1/completions", Body: body})
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			buf := make([]byte, 16)
			if _, err := resp.Body.Read(buf); err != nil {
				t.Fatal(err)
			}
			body = nil
			for range 3 {
				runtime.GC()
			}
			if held.Value() != nil {
				t.Error("the answer, still open, holds the body of the request that obtained it")
			}
			runtime.KeepAlive(resp)
			leg.Excuse()
		})
	}
}
