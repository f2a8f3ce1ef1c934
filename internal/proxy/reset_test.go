package proxy

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/upstream"
)

// resettingEngine answers every request with a stream's head, then resets the connection
// before the first event (an engine that crashed after accepting the stream).
func resettingEngine(t *testing.T) string {
	return gwtest.SocketEngine(t, func(c net.Conn, req *http.Request) bool {
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		time.Sleep(50 * time.Millisecond)
		c.(*net.TCPConn).SetLinger(0)
		return false
	})
}

// The reason a client is given for an engine that reset its stream before the first byte
// (Classify's message, from safeCause) is the same whichever way Baton's client read the body:
// with Read (a plain read of the connection) or with Next (the stream's wait without a buffer,
// httpwire.FillWaiting). It names the reset, not an invalid answer.
func TestResetBeforeTheFirstEventIsNamedAsAReset(t *testing.T) {
	url := resettingEngine(t)
	tr := upstream.New(http.DefaultTransport, 64<<10)
	causes := map[string]string{}
	for _, how := range []string{"Read", "Next"} {
		req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, url+"/v1/completions", strings.NewReader("{}"))
		req.ContentLength = 2
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		var rerr error
		if how == "Read" {
			_, rerr = resp.Body.Read(make([]byte, 64))
		} else {
			_, rerr = resp.Body.(interface{ Next() ([]byte, error) }).Next()
		}
		resp.Body.Close()
		causes[how] = safeCause(rerr)
		t.Logf("%s: %v (%T) -> %q", how, rerr, rerr, causes[how])
	}
	if causes["Next"] != causes["Read"] {
		t.Errorf("the client is told %q for a reset met in the stream's wait, %q for the same reset met by a plain read", causes["Next"], causes["Read"])
	}
}
