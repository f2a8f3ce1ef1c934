package proxy

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/worker"
)

// forwardFixture is a Proxy over both upstream clients, a worker at engine's URL, and a
// client request carrying a record.
func forwardProxy(t *testing.T, client string) *Proxy {
	t.Helper()
	tr := NewTransport(client)
	t.Cleanup(func() { CloseIdle(tr, "") })
	return &Proxy{Transport: tr, Timeout: 10 * time.Second, Metrics: metrics.New(worker.NewRegistry()),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
}

func engineAt(t *testing.T, h http.HandlerFunc) *worker.Worker {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return worker.New(config.Worker{URL: srv.URL, APIKey: "sk-worker"})
}

func clientRequest(ctx context.Context, body string) (*http.Request, *record.Record) {
	rec := &record.Record{}
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/completions?x=1", strings.NewReader(body))
	r.Header.Set("Authorization", "Bearer sk-client")
	r.Header.Set("Cookie", "session=1")
	r.Header.Set("Connection", "X-Hop")
	r.Header.Set("X-Hop", "1")
	r.Header[openai.HeaderRequestID] = []string{"rid-1"}
	return r, rec
}

// Forward sends the body as given with the allowlisted headers (the worker's key instead of the
// client's, no cookies, no hop-by-hop headers, no query) and relays the answer whole, its usage
// on the record; on both upstream clients.
func TestForwardRelaysTheAnswer(t *testing.T) {
	for _, client := range []string{"net", "baton"} {
		t.Run(client, func(t *testing.T) {
			var got *http.Request
			var gotBody string
			w := engineAt(t, func(rw http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				got, gotBody = r, string(b)
				rw.Header().Set("Content-Type", "text/event-stream")
				rw.Header().Set("X-Baton-Worker", "spoofed")
				rw.Header().Set("Keep-Alive", "timeout=5")
				io.WriteString(rw, "data: {\"choices\":[{\"text\":\"hi\"}]}\n\n")
				rw.(http.Flusher).Flush()
				io.WriteString(rw, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n")
			})
			p := forwardProxy(t, client)
			body := `{"model":"m","prompt":"x","big":18446744073709551615}`
			in, rec := clientRequest(context.Background(), body)
			rw := httptest.NewRecorder()
			if err := p.Forward(rw, in, w, &Call{Path: "/v1/completions", Body: []byte(body), Rec: rec}); err != nil {
				t.Fatal(err)
			}
			if gotBody != body || got.URL.RawQuery != "" || got.Header.Get("Authorization") != "Bearer sk-worker" || got.Header.Get("Cookie") != "" ||
				got.Header.Get("X-Hop") != "" || got.Header.Get(openai.HeaderRequestID) != "rid-1" {
				t.Errorf("the engine got %q, query %q, headers %v", gotBody, got.URL.RawQuery, got.Header)
			}
			if rw.Code != 200 || !strings.Contains(rw.Body.String(), "[DONE]") || rw.Header().Get("X-Baton-Worker") != "" || rw.Header().Get("Keep-Alive") != "" {
				t.Errorf("relayed %d %v %q", rw.Code, rw.Header(), rw.Body.String())
			}
			if !rec.UsageKnown || rec.Usage.Prompt != 3 || rec.Usage.Completion != 1 {
				t.Errorf("usage on the record: %+v %v", rec.Usage, rec.UsageKnown)
			}
			if ok, failed := w.Outcomes(); ok != 1 || failed != 0 || w.InFlight() != 0 {
				t.Errorf("the worker's outcomes %d/%d, in flight %d", ok, failed, w.InFlight())
			}
		})
	}
}

// Each way a worker can fail before the first byte is one classified failure: a retryable
// error answer is held whole (its body and headers, for a retry or to relay as it is), one too
// large to hold keeps its status in Baton's envelope, an unreachable worker and a worker past
// the deadline are named, and an informational final status is refused.
func TestForwardFailuresAreClassified(t *testing.T) {
	refused := func() *worker.Worker {
		ln, _ := net.Listen("tcp", "127.0.0.1:0")
		ln.Close()
		return worker.New(config.Worker{URL: "http://" + ln.Addr().String()})
	}
	for _, c := range []struct {
		name      string
		w         func(t *testing.T) *worker.Worker
		timeout   time.Duration
		status    int
		code      string // Baton's envelope; "" for the worker's own answer held
		retryable bool
		reason    string
	}{
		{"503 held", func(t *testing.T) *worker.Worker {
			return engineAt(t, func(rw http.ResponseWriter, r *http.Request) {
				rw.Header().Set("Retry-After", "3")
				rw.WriteHeader(503)
				io.WriteString(rw, `{"error":{"message":"busy"}}`)
			})
		}, 0, 503, "", true, "status_503"},
		{"error body too large", func(t *testing.T) *worker.Worker {
			return engineAt(t, func(rw http.ResponseWriter, r *http.Request) {
				rw.WriteHeader(502)
				io.WriteString(rw, strings.Repeat("x", maxErrorBody+10))
			})
		}, 0, 502, openai.CodeUpstreamErrorTooLarge, true, "status_502"},
		{"unreachable", func(t *testing.T) *worker.Worker { return refused() }, 0, 502, openai.CodeUpstreamUnreachable, true, "transport"},
		{"past the deadline", func(t *testing.T) *worker.Worker {
			return engineAt(t, func(rw http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body) // net/http's server notices a client leaving only once the body was read
				<-r.Context().Done()
			})
		}, 50 * time.Millisecond, 504, openai.CodeUpstreamTimeout, true, "timeout"},
		{"101 as the final answer", func(t *testing.T) *worker.Worker {
			return engineAt(t, func(rw http.ResponseWriter, r *http.Request) {
				conn, brw, _ := rw.(http.Hijacker).Hijack()
				brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: Upgrade\r\n\r\n")
				brw.Flush()
				conn.Close()
			})
		}, 0, 502, openai.CodeUpstreamUnreachable, true, "transport"},
	} {
		for _, client := range []string{"net", "baton"} {
			t.Run(c.name+"/"+client, func(t *testing.T) {
				w := c.w(t)
				ctx := context.Background()
				if c.timeout > 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeoutCause(ctx, c.timeout, outcome.ErrRequestTimeout)
					defer cancel()
				}
				in, _ := clientRequest(ctx, `{}`)
				rw := httptest.NewRecorder()
				err := forwardProxy(t, client).Forward(rw, in, w, &Call{Path: "/v1/completions", Body: []byte(`{}`)})
				var f *outcome.Failure
				if !errors.As(err, &f) {
					t.Fatalf("Forward = %v, want a failure", err)
				}
				v := f.Verdict()
				if f.ClientStatus() != c.status || v.Retryable != c.retryable || v.Reason != c.reason || f.Worker != w.URL {
					t.Errorf("failure %v: status %d, verdict %+v, worker %q", f, f.ClientStatus(), v, f.Worker)
				}
				if c.code == "" && (f.Answer != nil || !strings.Contains(string(f.Body), "busy") || f.Header.Get("Retry-After") != "3") {
					t.Errorf("the worker's answer was not held as it is: %+v", f)
				}
				if c.code != "" && (f.Answer == nil || f.Answer.Code != c.code) {
					t.Errorf("answer %+v, want code %s", f.Answer, c.code)
				}
				if rw.Body.Len() != 0 || rw.Code != 200 || len(rw.Header()) != 0 {
					t.Errorf("something reached the client before the caller chose: %d %v %q", rw.Code, rw.Header(), rw.Body.String())
				}
				WriteFailure(rw, f)
				if rw.Code != c.status {
					t.Errorf("written %d, want %d", rw.Code, c.status)
				}
				if _, failed := w.Outcomes(); failed != 1 || w.InFlight() != 0 {
					t.Errorf("the worker's failures %d, in flight %d", failed, w.InFlight())
				}
			})
		}
	}
}

// After the first byte nothing can be retried: a worker that breaks its answer mid-stream
// aborts the client's connection (ErrAbort) and counts against the worker; a client that left
// mid-stream counts against nobody.
func TestForwardMidStream(t *testing.T) {
	for _, client := range []string{"net", "baton"} {
		t.Run(client, func(t *testing.T) {
			broken := engineAt(t, func(rw http.ResponseWriter, r *http.Request) {
				conn, brw, _ := rw.(http.Hijacker).Hijack()
				brw.WriteString("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 100\r\n\r\ndata: {}\n\n")
				brw.Flush()
				conn.Close()
			})
			in, _ := clientRequest(context.Background(), `{}`)
			rw := httptest.NewRecorder()
			if err := forwardProxy(t, client).Forward(rw, in, broken, &Call{Path: "/v1/completions", Body: []byte(`{}`)}); !errors.Is(err, ErrAbort) {
				t.Errorf("mid-stream break: %v, want ErrAbort", err)
			}
			if _, failed := broken.Outcomes(); failed != 1 {
				t.Errorf("the break counted %d failures", failed)
			}

			started := make(chan struct{})
			slow := engineAt(t, func(rw http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				rw.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(rw, "data: {}\n\n")
				rw.(http.Flusher).Flush()
				close(started)
				<-r.Context().Done()
			})
			ctx, cancel := context.WithCancel(context.Background())
			in, _ = clientRequest(ctx, `{}`)
			go func() { <-started; cancel() }()
			err := forwardProxy(t, client).Forward(httptest.NewRecorder(), in, slow, &Call{Path: "/v1/completions", Body: []byte(`{}`)})
			if !errors.Is(err, ErrClientGone) {
				t.Errorf("client gone: %v", err)
			}
			if ok, failed := slow.Outcomes(); ok+failed != 0 || slow.InFlight() != 0 {
				t.Errorf("a client leaving counted %d/%d against the worker, in flight %d", ok, failed, slow.InFlight())
			}
		})
	}
}

// An engine's error event inside a stream it answered 200 reaches the client as sent, and the
// request is a failure with the event's status.
func TestForwardInBandError(t *testing.T) {
	w := engineAt(t, func(rw http.ResponseWriter, r *http.Request) {
		rw.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(rw, "data: {\"error\": {\"message\": \"oom\", \"code\": 503}}\n\ndata: [DONE]\n\n")
	})
	in, _ := clientRequest(context.Background(), `{}`)
	rw := httptest.NewRecorder()
	err := forwardProxy(t, "net").Forward(rw, in, w, &Call{Path: "/v1/completions", Body: []byte(`{}`)})
	var ib *InBandError
	if !errors.As(err, &ib) || ib.Status != 503 || !strings.Contains(rw.Body.String(), "oom") {
		t.Errorf("Forward = %v; relayed %q", err, rw.Body.String())
	}
	sc := bufio.NewScanner(strings.NewReader(rw.Body.String()))
	lines := 0
	for sc.Scan() {
		lines++
	}
	if lines != 4 {
		t.Errorf("the stream was not relayed whole: %d lines", lines)
	}
}

// A call's Hold statuses are held to be read (nothing reaches the client) — the caller's order
// for that one call; the same answer without them is relayed as the engine sent it.
func TestForwardHoldsWhatTheCallAsks(t *testing.T) {
	w := engineAt(t, func(rw http.ResponseWriter, r *http.Request) {
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(http.StatusNotFound)
		io.WriteString(rw, `{"object":"error","message":"The model `+"`x`"+` does not exist."}`)
	})
	for _, hold := range [][]int{nil, {http.StatusBadRequest}, {http.StatusNotFound, http.StatusBadRequest}} {
		in, _ := clientRequest(context.Background(), `{}`)
		rw := httptest.NewRecorder()
		err := forwardProxy(t, "net").Forward(rw, in, w, &Call{Path: "/v1/completions", Body: []byte(`{}`), Hold: hold})
		f, held := errors.AsType[*outcome.Failure](err)
		wantHeld := slices.Contains(hold, http.StatusNotFound)
		if held != wantHeld || held && (f.Status != 404 || !strings.Contains(string(f.Body), "does not exist") || rw.Body.Len() != 0) {
			t.Errorf("hold %v: err %v, relayed %q", hold, err, rw.Body.String())
		}
		if !wantHeld && (rw.Code != 404 || !strings.Contains(rw.Body.String(), "does not exist")) {
			t.Errorf("hold %v: relayed %d %q", hold, rw.Code, rw.Body.String())
		}
	}
}

// What a worker sends where an answer's head should be (on a connection out of step, the bytes
// of another request's answer) is never quoted: not to the client, not to Baton's log, under
// both upstream clients, whichever part of the head it breaks — its framing fields included.
func TestWhatAWorkerSentForAHeadIsNeverQuoted(t *testing.T) {
	const secret = "SECRET-of-another-request"
	for name, head := range map[string]string{
		"a body for a status line":         `{"id":"cmpl-other","choices":[{"text":"` + secret + `"}]}` + "\r\n\r\n",
		"a bad version":                    "HTTP/x.y 200 " + secret + "\r\n\r\n",
		"a bad status code":                "HTTP/1.1 abc " + secret + "\r\n\r\n",
		"a bad header line":                "HTTP/1.1 200 OK\r\n" + secret + "\r\n\r\n",
		"a bad Content-Length":             "HTTP/1.1 200 OK\r\nContent-Length: " + secret + "\r\n\r\n",
		"two Content-Lengths":              "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: " + secret + "\r\n\r\n",
		"an unsupported Transfer-Encoding": "HTTP/1.1 200 OK\r\nTransfer-Encoding: " + secret + strings.Repeat("x", 8000) + "\r\n\r\n",
		"two Transfer-Encodings":           "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: " + secret + "\r\n\r\n",
	} {
		for _, client := range []string{"net", "baton"} {
			t.Run(name+"/"+client, func(t *testing.T) {
				w := engineAt(t, func(rw http.ResponseWriter, r *http.Request) {
					conn, brw, _ := rw.(http.Hijacker).Hijack()
					brw.WriteString(head)
					brw.Flush()
					conn.Close()
				})
				var log strings.Builder
				p := forwardProxy(t, client)
				p.Log = slog.New(slog.NewTextHandler(&log, nil))
				in, _ := clientRequest(context.Background(), `{}`)
				rw := httptest.NewRecorder()
				err := p.Forward(rw, in, w, &Call{Path: "/v1/completions", Body: []byte(`{}`)})
				var f *outcome.Failure
				if !errors.As(err, &f) {
					t.Fatalf("Forward = %v, want a failure", err)
				}
				WriteFailure(rw, f)
				if !strings.Contains(log.String(), "upstream request failed") {
					t.Fatalf("the failure was not logged: %s", log.String())
				}
				for where, text := range map[string]string{"the log": log.String(), "the client": rw.Body.String(), "LogCause": LogCause(f.Cause)} {
					if strings.Contains(text, secret) {
						t.Errorf("%s quotes what the worker sent: %s", where, text)
					}
				}
			})
		}
	}
}
