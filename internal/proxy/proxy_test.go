package proxy

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/worker"
)

func testProxy() *Proxy { return &Proxy{Log: slog.New(slog.NewTextHandler(io.Discard, nil))} }

func upstreamAnswer(status int, header http.Header, body io.Reader) *http.Response {
	if header == nil {
		header = http.Header{}
	}
	return &http.Response{StatusCode: status, Header: header, Body: io.NopCloser(body)}
}

func TestRelayPassesTheAnswerThrough(t *testing.T) {
	rec := httptest.NewRecorder()
	h := http.Header{"Content-Type": {"application/json"}, "X-Engine": {"e"}, "Connection": {"X-Hop"}, "X-Hop": {"1"},
		"Transfer-Encoding": {"chunked"}, "X-Baton-Worker": {"spoofed"}, "X-Request-Id": {"spoofed"}}
	err := testProxy().Relay(context.Background(), rec, upstreamAnswer(201, h, iotest.HalfReader(strings.NewReader(`{"big":18446744073709551615}`))), nil, nil, Orders{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Code != 201 || rec.Body.String() != `{"big":18446744073709551615}` {
		t.Errorf("relayed %d %q", rec.Code, rec.Body.String())
	}
	got := rec.Header()
	if got.Get("X-Engine") != "e" || got.Get("X-Hop") != "" || got.Get("Transfer-Encoding") != "" || got.Get("X-Baton-Worker") != "" || got.Get("X-Request-Id") != "" {
		t.Errorf("headers %v: want the engine's, without hop-by-hop ones or Baton's", got)
	}
}

func TestRelayTransformsEventsAndKeepsTheRest(t *testing.T) {
	rec := httptest.NewRecorder()
	h := http.Header{"Content-Type": {"text/event-stream"}, "Content-Length": {"99"}}
	body := "data: {\"n\":1}\n\n: comment\n\ndata: [DONE]\n\n"
	err := testProxy().Relay(context.Background(), rec, upstreamAnswer(200, h, iotest.OneByteReader(strings.NewReader(body))), func(ev []byte) []byte {
		return []byte(strings.ReplaceAll(string(ev), `"n":1`, `"n":2`))
	}, nil, Orders{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := strings.ReplaceAll(body, `"n":1`, `"n":2`); rec.Body.String() != want || rec.Header().Get("Content-Length") != "" {
		t.Errorf("relayed %q (content-length %q), want %q", rec.Body.String(), rec.Header().Get("Content-Length"), want)
	}
	if !rec.Flushed {
		t.Error("a stream was not flushed")
	}
}

func TestRelayReportsWhetherAnythingWasWritten(t *testing.T) {
	broken := errors.New("reset")
	rec := httptest.NewRecorder()
	err := testProxy().Relay(context.Background(), rec, upstreamAnswer(200, nil, iotest.ErrReader(broken)), nil, nil, Orders{}, nil)
	var re *ReadError
	if !errors.As(err, &re) || re.Written || !errors.Is(err, broken) || rec.Code != 200 || rec.Body.Len() != 0 {
		t.Errorf("failure before any byte: %v (written %v), wrote %q", err, re != nil && re.Written, rec.Body.String())
	}
	// A whole answer that breaks within its first buffer writes nothing (the client's 502); one
	// that breaks past it wrote its first part.
	rec = httptest.NewRecorder()
	err = testProxy().Relay(context.Background(), rec, upstreamAnswer(200, nil, io.MultiReader(strings.NewReader("part"), iotest.ErrReader(broken))), nil, nil, Orders{}, nil)
	if !errors.As(err, &re) || re.Written || rec.Body.Len() != 0 {
		t.Errorf("failure within the first buffer: %v (written %v), wrote %q", err, re != nil && re.Written, rec.Body.String())
	}
	rec = httptest.NewRecorder()
	long := strings.Repeat("x", 16<<10+4)
	err = testProxy().Relay(context.Background(), rec, upstreamAnswer(200, nil, io.MultiReader(strings.NewReader(long), iotest.ErrReader(broken))), nil, nil, Orders{}, nil)
	if !errors.As(err, &re) || !re.Written {
		t.Errorf("failure after a buffer of bytes: %v, want a ReadError with Written", err)
	}
}

func TestCopyRequestHeaders(t *testing.T) {
	src := http.Header{"Authorization": {"Bearer client"}, "X-Request-Id": {"a", "b"}, "Traceparent": {"00-x"},
		"Tracestate": {"a=1", "b=2"}, "Cookie": {"secret"}, "X-Other": {"1"}}
	dst := http.Header{}
	CopyRequestHeaders(dst, src, worker.New(config.Worker{URL: "http://w"}))
	if dst.Get("Authorization") != "Bearer client" || dst.Get("Traceparent") != "00-x" || len(dst["Tracestate"]) != 2 {
		t.Errorf("forwarded %v", dst)
	}
	if dst.Get("X-Request-Id") != "" || dst.Get("Cookie") != "" || dst.Get("X-Other") != "" {
		t.Errorf("forwarded %v: a repeated single header or one off the allowlist", dst)
	}
	dst = http.Header{}
	CopyRequestHeaders(dst, src, worker.New(config.Worker{URL: "http://w", APIKey: "worker-key"}))
	if dst.Get("Authorization") != "Bearer worker-key" {
		t.Errorf("authorization %q, want the worker's own key", dst.Get("Authorization"))
	}
}

func TestLegEndsOnce(t *testing.T) {
	w := worker.New(config.Worker{URL: "http://w"})
	leg := &Leg{}
	leg.Start(w, "")
	if w.InFlight() != 1 {
		t.Fatalf("in flight %d after Open", w.InFlight())
	}
	leg.Done(503, nil)
	leg.Done(200, nil)
	leg.Excuse()
	if ok, failed := w.Outcomes(); ok != 0 || failed != 1 || w.InFlight() != 0 {
		t.Errorf("outcomes %d/%d, in flight %d: want one failure and the worker released", ok, failed, w.InFlight())
	}
	leg = &Leg{}
	leg.Start(w, "")
	leg.Excuse()
	leg.Done(503, nil)
	if _, failed := w.Outcomes(); failed != 1 || w.InFlight() != 0 {
		t.Errorf("an excused leg was recorded: %d failures, in flight %d", failed, w.InFlight())
	}
}

// The relay leaves a 200 answer's usage on the request's record once the answer ended — read
// from the engine's answer as it went out, a byte at a time here — and none for an answer cut
// short or an error answer.
func TestRelayNotesUsageOnTheRecord(t *testing.T) {
	h := http.Header{"Content-Type": {"text/event-stream"}}
	pad := strings.Repeat(`data: {"choices":[{"text":"xxxxxxxxxxxxxxxx"}]}`+"\n\n", 200) // more than the tail holds
	body := pad + `data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}` + "\n\ndata: [DONE]\n\n"
	for _, c := range []struct {
		name   string
		status int
		body   io.Reader
		want   bool
	}{
		{"ended", 200, iotest.OneByteReader(strings.NewReader(body)), true},
		{"cut", 200, io.MultiReader(strings.NewReader(body[:len(body)-20]), iotest.ErrReader(errors.New("reset"))), false},
		{"error answer", 500, strings.NewReader(body), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			rec := &record.Record{}
			_ = testProxy().Relay(context.Background(), httptest.NewRecorder(), upstreamAnswer(c.status, h, c.body), nil, rec, Orders{}, nil)
			want := record.Record{}
			if c.want {
				want.Usage, want.UsageKnown = openai.Usage{Prompt: 7, Completion: 3, Cached: 4}, true
			}
			if rec.Usage != want.Usage || rec.UsageKnown != want.UsageKnown {
				t.Errorf("usage %+v known %v, want %+v %v", rec.Usage, rec.UsageKnown, want.Usage, want.UsageKnown)
			}
		})
	}
}

// slowClient is a client that takes delay to accept its first write (its window full).
type slowClient struct {
	*httptest.ResponseRecorder
	delay  time.Duration
	writes int
}

func (c *slowClient) Write(b []byte) (int, error) {
	if c.writes++; c.writes == 1 {
		time.Sleep(c.delay)
	}
	return c.ResponseRecorder.Write(b)
}

// The stall watch times the engine, not the client: while a write to a slow client blocks
// (the engine is not read meanwhile), no stall is called, however long it takes; an engine silent
// for the stall timeout with a quick client is given up on. A hostile review cut streams of
// clients that paused, and took their worker out of rotation.
func TestAStallIsTheEnginesNotTheClients(t *testing.T) {
	sse := http.Header{"Content-Type": {"text/event-stream"}}
	for _, c := range []struct {
		name        string
		clientDelay time.Duration // the first write's
		engineGap   time.Duration // after the first event
		wantStall   bool
	}{
		{"a slow client", 800 * time.Millisecond, 0, false},
		{"a silent engine", 0, 800 * time.Millisecond, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			pr, pw := io.Pipe()
			go func() {
				io.WriteString(pw, "data: {\"n\":1}\n\n")
				time.Sleep(c.engineGap)
				io.WriteString(pw, "data: {\"n\":2}\n\ndata: [DONE]\n\n")
				pw.Close()
			}()
			p := testProxy()
			p.StallTimeout = 300 * time.Millisecond
			rw := &slowClient{ResponseRecorder: httptest.NewRecorder(), delay: c.clientDelay}
			err := p.Relay(context.Background(), rw, upstreamAnswer(200, sse, pr), nil, nil, Orders{}, func(cause error) { pr.CloseWithError(cause) })
			if stalled := errors.Is(err, outcome.ErrStalled); stalled != c.wantStall {
				t.Fatalf("stalled %v (%v), want %v; relayed %q", stalled, err, c.wantStall, rw.Body.String())
			}
			if !c.wantStall && !strings.Contains(rw.Body.String(), "[DONE]") {
				t.Errorf("relayed %q", rw.Body.String())
			}
		})
	}
}
