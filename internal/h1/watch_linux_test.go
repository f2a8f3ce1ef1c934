package h1

import (
	"context"
	"io"
	"net/http"
	"testing"
	"time"
)

// The watcher that notices clients leaving belongs to its server: it ends once the server shut
// down and its last connection went (it was one goroutine and an epoll set for the life of the
// process, whatever servers came and went).
func TestWatcherEndsWithItsServer(t *testing.T) {
	for _, stop := range []string{"shutdown", "close"} {
		t.Run(stop, func(t *testing.T) {
			s, addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
			resp, err := http.Get("http://" + addr + "/")
			if err != nil {
				t.Fatal(err)
			}
			io.ReadAll(resp.Body)
			resp.Body.Close()
			w := s.watcher()
			if w.err != nil {
				t.Skipf("SKIPPED: epoll is unavailable here (%v)", w.err)
			}
			if stop == "shutdown" {
				http.DefaultClient.CloseIdleConnections()
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				if err := s.Shutdown(ctx); err != nil {
					t.Fatal(err)
				}
			} else {
				s.Close()
			}
			select {
			case <-w.done:
			case <-time.After(5 * time.Second):
				t.Fatal("the watcher outlived its server")
			}
		})
	}
}
