package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/ssetest"
)

// The watch finds the engines' in-band error events, whatever the reads' boundaries, and
// nothing in ordinary events.
func TestWatchFindsEngineErrorEvents(t *testing.T) {
	token := `data: {"id":"x","choices":[{"index":0,"delta":{"content":"{\"error\": 1, \"type\":\"abort\"}"}}]}` + "\n\n"
	for _, tc := range []struct {
		name, stream string
		status       int
	}{
		{"vllm", token + `data: {"error": {"message": "KV load failed", "type": "InternalServerError", "param": null, "code": 500}}` + "\n\ndata: [DONE]\n\n", 500},
		{"vllm older", `data: {"error": {"object": "error", "message": "busy", "type": "ServiceUnavailableError", "param": null, "code": 503}}` + "\n\n", 503},
		{"sglang openai", token + `data: {"error":{"object":"error","message":"The request queue is full.","type":"Service Unavailable","param":null,"code":503}}` + "\n\n", 503},
		{"sglang generate abort", `data: {"text":"ab","output_ids":[1,2],"meta_info":{"id":"r","finish_reason":{"type":"abort","message":"Prefill transfer failed","status_code":500}}}` + "\n\ndata: [DONE]\n\n", 500},
		{"sglang generate abort spaced", `data: {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "busy", "status_code": 503}}}` + "\r\n\r\n", 503},
		{"flat with a code that is no status", `data: {"object":"error","message":"m","code":"invalid"}` + "\n\n", 500},
		{"responses", "event: error\n" + `data: {"type":"error","code":"server_error","message":"failed"}` + "\n\n", 500},
		{"responses failed", "event: response.failed\n" + `data: {"type": "response.failed", "response": {"status": "failed"}}` + "\n\n", 500},
		{"messages", "event: error\n" + `data: {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}` + "\n\n", 500},
		{"ordinary", token + token + "data: [DONE]\n\n", 0},
		{"generate finished", `data: {"text":"ab","meta_info":{"finish_reason":{"type":"length","length":2}}}` + "\n\n", 0},
		{"no newline at the end", `data: {"error": {"code": 503}}`, 0},
		{"lines ended by lone CRs", strings.ReplaceAll(token, "\n", "\r") + `data: {"error": {"message": "KV load failed", "code": 503}}` + "\r\rdata: [DONE]\r\r", 503},
		{"an error line behind a comment's lone CR", ": keep-alive\r" + `data: {"error": {"message": "m", "code": 502}}` + "\n\n", 502},
		{"no blank line after it", `data: {"error": {"code": 504}}` + "\r", 0},
		{"a CRLF cut anywhere", `data: {"error":` + "\r\n" + `data: {"code": 504}}` + "\r\n\r\n", 504},
		{"over two data lines", "data: {\"error\":\ndata: {\"message\":\"boom\",\"code\":500}}\n\ndata: [DONE]\n\n", 500},
		{"a data field without a colon first", "data\ndata: {\"error\":{\"code\":502}}\n\n", 502},
		{"an error event's data split by a comment", "data: {\"error\":\n: keep-alive\ndata: {\"code\":503}}\n\n", 503},
		{"lines the client reads as another field", "dataX: {\"error\":{\"code\":500}}\n\n", 0},
		{"a tab before the JSON", "data:\t" + `{"error":{"message":"boom","code":500}}` + "\n\n", 500},
		{"a space after the brace", `data: { "error":{"message":"boom","code":500}}` + "\n\n", 500},
		{"another member first", `data: {"id":"c","error":{"message":"boom","code":502}}` + "\n\n", 502},
		{"a flat error with its type first", `data: {"type":"x","object":"error","message":"m","code":503}` + "\n\n", 503},
	} {
		for cut := 0; cut <= len(tc.stream); cut++ {
			var w watch
			w.see([]byte(tc.stream[:cut]))
			w.see([]byte(tc.stream[cut:]))
			got := 0
			if w.err != nil {
				got = w.err.Status
			}
			if got != tc.status {
				t.Fatalf("%s, read cut at %d: status %d, want %d (%v)", tc.name, cut, got, tc.status, w.err)
			}
		}
	}
}

// A line longer than an error event could be is passed over without being kept.
func TestWatchBoundsWhatItKeeps(t *testing.T) {
	var w watch
	long := "data: " + strings.Repeat("x", 3*maxErrorLine)
	for i := 0; i < len(long); i += 1000 {
		w.see([]byte(long[i:min(i+1000, len(long))]))
		if len(w.partial) > maxErrorLine {
			t.Fatalf("kept %d bytes of an unfinished line", len(w.partial))
		}
	}
	w.see([]byte("\n" + `data: {"error": {"code": 500}}` + "\n"))
	if len(w.data) > maxErrorLine {
		t.Fatalf("kept %d bytes of an event's data", len(w.data))
	}
	w.see([]byte("\n" + `data: {"error": {"code": 429}}` + "\n\n"))
	if w.err == nil || w.err.Status != 429 {
		t.Fatalf("after a long event: %v (the long event's own error line is no error event of its own)", w.err)
	}
	// an event whose data lines together pass the bound is passed over, not kept
	w = watch{}
	for range 3 * maxErrorLine / 100 {
		w.see([]byte("data: " + strings.Repeat("y", 94) + "\n"))
		if len(w.data) > maxErrorLine {
			t.Fatalf("kept %d bytes of an event's data", len(w.data))
		}
	}
}

// What watching a relayed stream costs: one chat stream of 256 token events, read event by event.
func BenchmarkWatch(b *testing.B) {
	var events [][]byte
	for i := 0; i < 256; i++ {
		events = append(events, []byte(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":" token"},"logprobs":null,"finish_reason":null}]}`+"\n\n"))
	}
	b.SetBytes(int64(256 * len(events[0])))
	b.ReportAllocs()
	for b.Loop() {
		var w watch
		for _, ev := range events {
			w.see(ev)
		}
		if w.err != nil {
			b.Fatal(w.err)
		}
	}
}

// clientErrorStatus is the status of the first error event an SSE client dispatches from a whole
// stream, read by the HTML standard's rules (lines end at CRLF, LF or CR; a field named by the
// line up to its colon, the whole line without one; a blank line dispatches the data lines joined
// by LF; [DONE] ends what it reads), its events past the watch's bound (the data joined over
// maxErrorLine) passed over as the watch passes them; 0 when there is none.
func clientErrorStatus(stream []byte) int {
	for _, data := range ssetest.Dispatched(stream) {
		switch {
		case len(data) > maxErrorLine:
			continue // passed over, as the watch passes it
		case strings.HasPrefix(data, "[DONE]"):
			return 0 // a client reads no further
		}
		if e := errorEvent([]byte(data)); e != nil {
			return e.Status
		}
	}
	return 0
}

// The watch finds the error event a client reads, and none that it does not, however the stream
// is cut into reads and however its lines end.
func FuzzWatchReadsErrorsAsAClientDoes(f *testing.F) {
	f.Add([]byte("data: {\"error\":\r\ndata: {\"code\": 504}}\r\n\r\n"), []byte{3, 1})
	f.Add([]byte("data: {\"choices\":[]}\r\rdata: {\"error\": {\"code\": 503}}\r\r"), []byte{20})
	f.Add([]byte("data\ndata: {\"error\":{\"code\":502}}\n\n"), []byte{0})
	f.Add([]byte(": c\rdata: {\"id\":\"c\",\"error\":{\"code\":502}}\n\ndata: [DONE]\n\n"), []byte{5, 9})
	f.Add([]byte("data: {\"text\":\"\",\"meta_info\":{\"finish_reason\":{\"type\":\"abort\",\"status_code\":503}}}\n\n"), []byte{})
	f.Fuzz(func(t *testing.T, stream, cuts []byte) {
		if len(stream) > 3*maxErrorLine {
			return
		}
		var w watch
		for rest, i := stream, 0; len(rest) > 0 && w.err == nil; i++ {
			n := len(rest)
			if len(cuts) > 0 {
				n = min(n, int(cuts[i%len(cuts)])+1)
			}
			w.see(rest[:n])
			rest = rest[n:]
		}
		got := 0
		if w.err != nil {
			got = w.err.Status
		}
		if want := clientErrorStatus(stream); got != want {
			t.Fatalf("%q cut %v: the watch says %d, a client reads %d", stream, cuts, got, want)
		}
	})
}

// A comment (or another field) longer than an error event, in the error event's own block, is
// passed over as a client passes it, whether it came in one read or across several; the error
// is seen either way.
func TestWatchPassesOverALongCommentAcrossReads(t *testing.T) {
	stream := ": " + strings.Repeat("x", 5000) + "\n" + `data: {"error":{"message":"boom","code":503}}` + "\n\n"
	for _, cut := range []int{len(stream), 100, 4097, 5001} {
		var w watch
		w.see([]byte(stream[:cut]))
		w.see([]byte(stream[cut:]))
		if w.err == nil || w.err.Status != 503 {
			t.Errorf("read cut at %d: %v, want 503", cut, w.err)
		}
	}
}

// openai-python stops reading a stream at [DONE]: an error event after it is none of the
// request's.
func TestWatchReadsNothingAfterDone(t *testing.T) {
	var w watch
	w.see([]byte("data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n" +
		`data: {"error":{"message":"late","code":500}}` + "\n\n"))
	if w.err != nil {
		t.Fatalf("the client ended at [DONE] and read a success; the watch says %v", w.err)
	}
}

// A stream waiting between events holds nothing of the watch's, also after a line cut across
// reads.
func TestWatchHoldsNothingBetweenEvents(t *testing.T) {
	var w watch
	ev := `data: {"id":"c","choices":[{"index":0,"delta":{"content":"` + strings.Repeat("t", 3000) + `"}}]}` + "\n\n"
	w.see([]byte(ev[:2000]))
	w.see([]byte(ev[2000:]))
	if cap(w.partial) != 0 || cap(w.data) != 0 {
		t.Fatalf("between events the watch holds partial cap %d, data cap %d", cap(w.partial), cap(w.data))
	}
}

// A data line longer than an error event's makes its event too long, even when the read that
// began it ended inside its field's name ("d", "da", "dat", "data"): the line after it is part
// of the same event, not an event of its own.
func TestWatchReadsALongDataLineCutInsideItsName(t *testing.T) {
	for _, next := range []string{`data: {"error":{"message":"boom","code":503}}` + "\n\n", "data: [DONE]\n\n" + `data: {"error":{"code":502}}` + "\n\n"} {
		stream := "data: " + strings.Repeat("x", 5000) + "\n" + next
		want := clientErrorStatus([]byte(stream))
		for cut := 1; cut <= 6; cut++ {
			if got := watchCut(stream, cut); got != want {
				t.Errorf("first read %q, then %.20q: the watch says %d, a client reads %d", stream[:cut], next, got, want)
			}
		}
	}
}

// An error event whose data is up to maxErrorLine bytes is looked at, whether it came in one read
// or cut anywhere; one a byte longer is passed over, cut anywhere.
func TestWatchLooksAtEveryEventUpToItsBoundHoweverCut(t *testing.T) {
	head, tail := `{"error":{"code":503,"message":"`, `"}}`
	for _, size := range []int{maxErrorLine - 3, maxErrorLine, maxErrorLine + 1} {
		data := head + strings.Repeat("m", size-len(head)-len(tail)) + tail
		for _, stream := range []string{"data: " + data + "\n\n", "data:" + data + "\r\n\r\n", "data: " + data[:9] + "\ndata: " + data[9:] + "\n\n"} { // cut after {"error":
			want := 503
			if len(data) > maxErrorLine || strings.Count(stream, "data") == 2 && len(data)+1 > maxErrorLine {
				want = 0
			}
			if ref := clientErrorStatus([]byte(stream)); ref != want {
				t.Fatalf("the reference client reads %d for %d bytes of data", ref, len(data))
			}
			for _, cut := range []int{len(stream), 1, 3, 6, 100, 2048, 4096, 4100, len(stream) - 3} {
				cut = min(cut, len(stream))
				if got := watchCut(stream, cut); got != want {
					t.Errorf("%d bytes of data in %d lines, read cut at %d: %d, want %d", len(data), strings.Count(stream, "data"), cut, got, want)
				}
			}
		}
	}
}

// watchCut is the status the watch finds in stream read in two reads, cut at cut; 0 for none.
func watchCut(stream string, cut int) int {
	var w watch
	w.see([]byte(stream[:cut]))
	w.see([]byte(stream[cut:]))
	if w.err == nil {
		return 0
	}
	return w.err.Status
}

// An empty read changes nothing: a CR that ended the read before it still takes the LF after it
// as its own.
func TestWatchAnEmptyReadKeepsACRsLF(t *testing.T) {
	var w watch
	w.see([]byte(`data: {"error":{"code":503}}` + "\r"))
	w.see(nil)
	w.see([]byte("\n" + `data: {"x":1}` + "\r\n\r\n"))
	if w.err != nil {
		t.Fatalf("the CRLF cut by an empty read ended the event: %v", w.err)
	}
}

// The error's message is cut at 256 bytes, never inside a character; an error given as text
// takes the event's own code.
func TestInBandMessageAndCode(t *testing.T) {
	e := errorEvent([]byte(`{"error":{"code":503,"message":"` + strings.Repeat("é", 200) + `"}}`))
	if e == nil || !utf8.ValidString(e.Message) || !strings.HasSuffix(e.Message, "…") || len(e.Message) > 256+len("…") {
		t.Fatalf("a long message: %+v", e)
	}
	if e := errorEvent([]byte(`{"error":"overloaded","code":503}`)); e == nil || e.Status != 503 || e.Message != "overloaded" {
		t.Fatalf("an error given as text beside its code: %+v", e)
	}
}

// openai-python decodes lines with utf-8, which keeps a leading byte order mark: the stream's
// first line is then a field it does not know, and an error event there is not raised. The
// watch reads it so; the next error event is counted.
func TestWatchReadsALeadingBOMAsOpenAIPythonDoes(t *testing.T) {
	bom := "\xef\xbb\xbf"
	var w watch
	w.see([]byte(bom + `data: {"error":{"code":503}}` + "\n\n"))
	if w.err != nil {
		t.Fatalf("an error line behind a byte order mark: %v; openai-python ignores the line", w.err)
	}
	w.see([]byte(`data: {"error":{"code":502}}` + "\n\n"))
	if w.err == nil || w.err.Status != 502 {
		t.Fatalf("the next error event: %v, want 502", w.err)
	}
}

// A stream whose first event is an engine's refusal (SGLang refuses a streamed request inside
// the stream it answered 200) is held as the answer of the status it names when the call holds
// that status — nothing reaches the client, and the failure carries the event's data — on both
// upstream clients; an event naming no status (SGLang's /generate) is held as a 400. A refusal
// of a status not held, a stream that begins with tokens, or a call that holds nothing is
// relayed byte for byte as it came, the bytes read to look at its first event included.
func TestStreamRefusedInItsFirstEventIsHeld(t *testing.T) {
	const (
		openAI   = ": keep-alive\n\ndata: {\"error\":{\"object\":\"error\",\"message\":\"The following requested LoRA adapters are not loaded: a9\",\"type\":\"BadRequestError\",\"param\":null,\"code\":400}}\n\ndata: [DONE]\n\n"
		generate = "data: {\"error\":{\"message\":\"The following requested LoRA adapters are not loaded: a9\"}}\r\n\r\ndata: [DONE]\r\n\r\n"
		aborted  = "data: {\"error\":{\"message\":\"queue full\",\"code\":503}}\n\ndata: [DONE]\n\n"
		tokens   = "data: {\"choices\":[{\"text\":\"hi\"}]}\n\ndata: {\"error\":{\"message\":\"late\",\"code\":400}}\n\ndata: [DONE]\n\n"
	)
	for _, client := range []string{"net", "baton"} {
		for _, c := range []struct {
			name, stream string
			hold         []int
			held         int    // the status held; 0: relayed
			body         string // the held answer's body
		}{
			{"openai route", openAI, []int{404, 400}, 400, `{"error":{"object":"error","message":"The following requested LoRA adapters are not loaded: a9","type":"BadRequestError","param":null,"code":400}}`},
			{"generate", generate, []int{404, 400}, 400, `{"error":{"message":"The following requested LoRA adapters are not loaded: a9"}}`},
			{"status not held", aborted, []int{404, 400}, 0, ""},
			{"tokens first", tokens, []int{404, 400}, 0, ""},
			{"nothing held", openAI, nil, 0, ""},
		} {
			t.Run(client+"/"+c.name, func(t *testing.T) {
				w := engineAt(t, func(rw http.ResponseWriter, r *http.Request) {
					rw.Header().Set("Content-Type", "text/event-stream")
					rw.WriteHeader(http.StatusOK)
					for _, part := range strings.SplitAfter(c.stream, "\n") { // in pieces, as an engine flushes
						io.WriteString(rw, part)
						rw.(http.Flusher).Flush()
					}
				})
				p := forwardProxy(t, client)
				in, rec := clientRequest(context.Background(), `{"stream":true}`)
				rw := httptest.NewRecorder()
				err := p.Forward(rw, in, w, &Call{Path: "/v1/completions", Body: []byte(`{"stream":true}`), Rec: rec, Stream: true, Hold: c.hold})
				if c.held == 0 {
					if rw.Code != http.StatusOK || rw.Body.String() != c.stream {
						t.Errorf("relayed: got %d %q, want 200 %q", rw.Code, rw.Body.String(), c.stream)
					}
					return
				}
				var f *outcome.Failure
				if !errors.As(err, &f) || f.Status != c.held || string(f.Body) != c.body || f.Answer != nil {
					t.Fatalf("got %v, want the held answer %d %s", err, c.held, c.body)
				}
				if rw.Body.Len() > 0 || rw.Code != http.StatusOK && rw.Code != 0 {
					t.Errorf("the client got %d %q before the refusal was held", rw.Code, rw.Body.String())
				}
				out := httptest.NewRecorder()
				WriteFailure(out, f)
				if out.Code != c.held || out.Header().Get("Content-Type") != "application/json" || out.Body.String() != c.body {
					t.Errorf("written: got %d %s %q, want %d application/json %q", out.Code, out.Header().Get("Content-Type"), out.Body.String(), c.held, c.body)
				}
			})
		}
	}
}
