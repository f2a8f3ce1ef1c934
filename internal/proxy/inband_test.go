package proxy

import (
	"strings"
	"testing"
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
		{"no line end at the end but a CR", `data: {"error": {"code": 504}}` + "\r", 504},
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
	w.see([]byte("\n" + `data: {"error": {"code": 429}}` + "\n"))
	if w.err == nil || w.err.Status != 429 {
		t.Fatalf("after a long line: %v", w.err)
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
