package proxy

// The same hostile engines against both upstream clients, net/http's Transport and Baton's own:
// whatever an engine writes on its socket, no answer a client reads whole is another request's,
// and Baton's client accepts no answer net/http refuses. The engines echo the request id, as
// vLLM does with --enable-request-id-headers, so that the proxy can prove each answer.

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/worker"
)

// answerFor is an engine's well-formed answer to the request id: its body names the id.
func answerFor(id string) string {
	body := fmt.Sprintf(`{"answer_for":%q}`, id)
	return fmt.Sprintf("HTTP/1.1 200 OK\r\nX-Request-Id: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", id, len(body), body)
}

// script is what a hostile engine writes for the i-th request on a connection (id is the
// request's, prev the previous request's on that connection or ""), and whether the connection
// goes on after.
type script func(i int, id, prev string) (string, bool)

var scripts = map[string]script{
	"clean": func(_ int, id, _ string) (string, bool) { return answerFor(id), true },
	"duplicate at once": func(_ int, id, _ string) (string, bool) {
		return answerFor(id) + answerFor(id), true
	},
	"delayed duplicate": func(_ int, id, prev string) (string, bool) {
		if prev == "" {
			return answerFor(id), true
		}
		return answerFor(prev) + answerFor(id), true
	},
	"duplicate without id": func(_ int, id, prev string) (string, bool) {
		if prev == "" {
			return answerFor(id), true
		}
		return strings.Replace(answerFor(prev), "X-Request-Id: "+prev+"\r\n", "", 1) + answerFor(id), true
	},
	"bytes past the length": func(_ int, id, _ string) (string, bool) {
		return answerFor(id) + `{"answer_for":"LEAK"}`, true
	},
	"short body": func(_ int, id, _ string) (string, bool) {
		return strings.Replace(answerFor(id), "Content-Length: ", "Content-Length: 9", 1), false
	},
	"1xx first": func(_ int, id, _ string) (string, bool) {
		return "HTTP/1.1 100 Continue\r\n\r\n" + answerFor(id), true
	},
	"switching protocols": func(_ int, id, _ string) (string, bool) {
		return "HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: Upgrade\r\n\r\n" + answerFor(id), false
	},
	"bad chunk": func(_ int, id, _ string) (string, bool) {
		return "HTTP/1.1 200 OK\r\nX-Request-Id: " + id + "\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n", false
	},
	"204 with a body": func(_ int, id, _ string) (string, bool) {
		return "HTTP/1.1 204 No Content\r\nX-Request-Id: " + id + "\r\n\r\n" + answerFor(id), true
	},
	"closes mid-head": func(_ int, id, _ string) (string, bool) {
		return "HTTP/1.1 200 OK\r\nX-Request-Id: " + id + "\r\nContent-Le", false
	},
	"answer of another request": func(i int, id, _ string) (string, bool) {
		if i == 2 {
			return answerFor("someone-else"), true
		}
		return answerFor(id), true
	},
}

// scripted serves a raw engine that answers each POST as s has it, per connection.
func scripted(t testing.TB, s script) string {
	var mu sync.Mutex
	seen := map[net.Conn]int{}
	last := map[net.Conn]string{}
	return gwtest.SocketEngine(t, func(c net.Conn, req *http.Request) bool {
		id := req.Header.Get("X-Request-Id")
		mu.Lock()
		i, prev := seen[c], last[c]
		seen[c], last[c] = i+1, id
		mu.Unlock()
		out, more := s(i, id, prev)
		_, err := io.WriteString(c, out)
		return err == nil && more
	})
}

// result is what a client made of one request: its answer read whole, or the error that
// refused it (before the head or in the body).
type result struct {
	status int
	body   string
	err    error
}

// exchanges sends n requests one after another to the engine at url through a proxy over
// client, each with its own id and at most wait for its answer, and returns what each got.
func exchanges(t testing.TB, client, url string, n int, wait time.Duration) (ids []string, out []result) {
	tr := NewTransport(client)
	defer CloseIdle(tr, "")
	p := &Proxy{Transport: tr, Timeout: 5 * time.Second}
	w := worker.New(config.Worker{URL: url})
	for i := range n {
		id := fmt.Sprintf("req-%d", i)
		ids = append(ids, id)
		in := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
		in.Header.Set("X-Request-Id", id)
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		var leg Leg
		leg.Start(w, "")
		resp, err := p.Send(ctx, in, &leg, Call{Path: "/v1/completions", Body: []byte(`{}`)})
		o := result{err: err}
		if err == nil {
			var b []byte
			b, o.err = io.ReadAll(io.LimitReader(resp.Body, 1<<20))
			resp.Body.Close()
			o.status, o.body = resp.StatusCode, string(b)
		}
		leg.Excuse()
		cancel()
		out = append(out, o)
	}
	return ids, out
}

// mixed reports the first answer read whole that is not its request's: a body naming another
// request, or anything but the request's own answer under a 200.
func mixed(ids []string, out []result) string {
	for i, o := range out {
		if o.err != nil || o.status == http.StatusNoContent && o.body == "" {
			continue
		}
		if want := fmt.Sprintf(`{"answer_for":%q}`, ids[i]); o.body != want {
			return fmt.Sprintf("request %s got %d %q", ids[i], o.status, o.body)
		}
	}
	return ""
}

// Every hostile engine script, against both clients: no request reads another's answer or any
// stray byte whole, and a request net/http's client refuses is refused by Baton's too (where
// each request is alone on its connection, so that both clients face the same bytes).
func TestClientsAgainstHostileEngines(t *testing.T) {
	t.Parallel()
	for name, s := range scripts {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			got := map[string][]result{}
			for _, client := range []string{"net", "baton"} {
				ids, out := exchanges(t, client, scripted(t, s), 6, 5*time.Second)
				if m := mixed(ids, out); m != "" {
					t.Errorf("%s: %s", client, m)
				}
				got[client] = out
			}
			if _, more := s(0, "a", ""); more {
				return // a connection that goes on: the clients may meet its bytes at other moments
			}
			for i := range got["net"] {
				if got["net"][i].err != nil && got["baton"][i].err == nil {
					t.Errorf("request %d: net/http refused it (%v), Baton's client read %d %q", i, got["net"][i].err, got["baton"][i].status, got["baton"][i].body)
				}
			}
		})
	}
}

// Whatever bytes an engine that echoes request ids writes between two answers on one
// connection — a duplicate, a partial head, stray chunks — the second request never reads them,
// or the first's answer, as its own, under either client. (Bytes that name the second request's
// own id are its engine's answer to it: no client can tell them from it.) The seed corpus runs
// in CI; run it
// longer with: go test ./internal/proxy -run '^$' -fuzz FuzzNoAnswerOutOfStep -fuzztime 5m
func FuzzNoAnswerOutOfStep(f *testing.F) {
	for _, s := range []string{
		answerFor("req-0"),
		strings.Replace(answerFor("req-0"), "X-Request-Id: req-0\r\n", "", 1),
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
		"HTTP/1.1 200 OK\r\nX-Request-Id: req-9\r\nContent-Length: 2\r\n\r\n{}",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nstray\r\n0\r\n\r\n",
		"HTTP/1.1 100 Continue\r\n\r\n",
		"HTTP/1.1 20",
		"\r\n",
		"garbage",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, stray []byte) {
		if len(stray) > 4<<10 {
			return
		}
		s := func(i int, id, _ string) (string, bool) {
			if i == 1 {
				return string(stray) + answerFor(id), true
			}
			return answerFor(id), true
		}
		for _, client := range []string{"net", "baton"} {
			ids, out := exchanges(t, client, scripted(t, s), 3, 500*time.Millisecond) // a framing the bytes break waits out its answer
			if m := mixed(ids, out); m != "" {
				t.Fatalf("%s, stray %q: %s", client, stray, m)
			}
		}
	})
}
