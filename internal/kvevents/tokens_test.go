package kvevents

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// tokenizeServer answers /tokenize with one token per word of the prompt, counting requests and
// remembering the last Authorization header.
func tokenizeServer(t testing.TB) (*httptest.Server, *atomic.Int64, *atomic.Value) {
	var n atomic.Int64
	var auth atomic.Value
	auth.Store("")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		auth.Store(r.Header.Get("Authorization"))
		var v struct {
			Prompt string `json:"prompt"`
		}
		if r.URL.Path != "/tokenize" || json.NewDecoder(r.Body).Decode(&v) != nil {
			http.Error(w, "bad", 400)
			return
		}
		toks := make([]uint32, len(strings.Fields(v.Prompt)))
		for i := range toks {
			toks[i] = uint32(i + 1)
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": toks, "count": len(toks)})
	}))
	t.Cleanup(srv.Close)
	return srv, &n, &auth
}

func body(prompt string) []byte { return []byte(fmt.Sprintf(`{"model":"m","prompt":%q}`, prompt)) }

// Concurrent asks for one prompt send one request; the answer is cached; the worker's key is
// sent; the cache keeps within its byte bound, forgetting the oldest.
func TestTokenizer(t *testing.T) {
	srv, n, auth := tokenizeServer(t)
	tok := &Tokenizer{Client: srv.Client(), Timeout: time.Second, MaxEntries: 100, MaxBytes: 4 * 250}
	var wg sync.WaitGroup
	for i := 0; i < 16; i++ {
		wg.Go(func() {
			if toks, ok := tok.Tokens(t.Context(), srv.URL, "sk-worker", "m", "/v1/completions", body(strings.Repeat("w ", 100))); !ok || len(toks) != 100 {
				t.Errorf("tokens %d %v", len(toks), ok)
			}
		})
	}
	wg.Wait()
	if n.Load() != 1 || auth.Load() != "Bearer sk-worker" {
		t.Fatalf("%d requests for one prompt asked 16 times at once (auth %q)", n.Load(), auth.Load())
	}
	// 100 tokens each = 400 bytes: two fit in 1,000 bytes, the third forgets the first.
	tok.Tokens(t.Context(), srv.URL, "", "m", "/v1/completions", body(strings.Repeat("x ", 100)))
	tok.Tokens(t.Context(), srv.URL, "", "m", "/v1/completions", body(strings.Repeat("y ", 100)))
	if e, b := tok.Cached(); e != 2 || b != 800 {
		t.Fatalf("cached %d answers, %d bytes; want 2, 800", e, b)
	}
	tok.Tokens(t.Context(), srv.URL, "", "m", "/v1/completions", body(strings.Repeat("w ", 100)))
	if n.Load() != 4 {
		t.Fatalf("%d requests: the oldest answer should have been forgotten", n.Load())
	}
	// Larger than the whole bound: answered, not kept.
	tok.Tokens(t.Context(), srv.URL, "", "m", "/v1/completions", body(strings.Repeat("z ", 300)))
	if _, b := tok.Cached(); b > 1000 {
		t.Fatalf("%d bytes cached past the 1,000 bound", b)
	}
	// What it cannot send says no without asking.
	for _, b := range []string{`{"model":"m","prompt":["a","b"]}`, `{"model":"m","prompt":[1,2]}`, `{"model":"m"}`} {
		if _, ok := tok.Tokens(t.Context(), srv.URL, "", "m", "/v1/completions", []byte(b)); ok {
			t.Errorf("%s: tokenized", b)
		}
	}
	if got := tok.Hits.Load(); got < 15 {
		t.Errorf("hits %d, want the 15 callers that shared the first ask", got)
	}
	// Count reads the cache alone: a cached prompt's length, nothing for another, no ask.
	asked := n.Load()
	if c, ok := tok.Count("m", "/v1/completions", body(strings.Repeat("w ", 100))); !ok || c != 100 {
		t.Errorf("count of a cached prompt: %d %v", c, ok)
	}
	if _, ok := tok.Count("m", "/v1/completions", body("never asked")); ok || n.Load() != asked {
		t.Error("count of a prompt never asked answered, or asked the engine")
	}
}

// What tokenization costs a request: a cached prompt, and a prompt of ~1,000 words asked of a
// local /tokenize (the HTTP round trip and decoding; the engine's own tokenizer comes on top).
func BenchmarkTokens(b *testing.B) {
	srv, _, _ := tokenizeServer(b)
	prompt := body(strings.Repeat("word ", 1000))
	b.Run("cached", func(b *testing.B) {
		tok := &Tokenizer{Client: srv.Client(), Timeout: time.Second, MaxEntries: 10}
		tok.Tokens(b.Context(), srv.URL, "", "m", "/v1/completions", prompt)
		b.ReportAllocs()
		for b.Loop() {
			tok.Tokens(b.Context(), srv.URL, "", "m", "/v1/completions", prompt)
		}
	})
	b.Run("asked", func(b *testing.B) {
		tok := &Tokenizer{Client: srv.Client(), Timeout: time.Second, MaxEntries: 1}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			i++
			tok.Tokens(b.Context(), srv.URL, "", "m", "/v1/completions", body(fmt.Sprint(i, strings.Repeat(" word", 1000))))
		}
	})
}

// A caller whose request ended (client gone, deadline passed) stops waiting for the engine's
// /tokenize at once; the ask itself stays bounded by the timeout and the request's deadline.
func TestTokenizerTakesTheRequestContext(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release)
	tok := &Tokenizer{Client: srv.Client(), Timeout: time.Minute, MaxEntries: 10}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan bool)
	go func() {
		_, ok := tok.Tokens(ctx, srv.URL, "", "m", "/v1/completions", body("hangs"))
		done <- ok
	}()
	cancel()
	if ok := <-done; ok {
		t.Fatal("a cancelled request got token ids")
	}
	dctx, dcancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer dcancel()
	if _, ok := tok.Tokens(dctx, srv.URL, "", "m", "/v1/completions", body("hangs too")); ok {
		t.Fatal("a request past its deadline got token ids")
	}
	waitFor := func(cond func() bool) {
		for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the ask under the request's deadline never ended")
			}
		}
	}
	waitFor(func() bool { return tok.Failures.Load() >= 1 }) // the second ask ended with its request's deadline
}

// A chat's tools and template arguments are part of its prompt: they go to /tokenize and into
// the cache key.
func TestTokenizeRequestCarriesTheTemplate(t *testing.T) {
	chat := []byte(`{"model":"x","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}],"chat_template_kwargs":{"a":1},"add_generation_prompt":false,"continue_final_message":true,"temperature":0.5}`)
	req, key, ok := tokenizeRequest("m", "/v1/chat/completions", chat)
	want := `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}],"chat_template_kwargs":{"a":1},"add_generation_prompt":false,"continue_final_message":true}`
	if !ok || string(req) != want {
		t.Fatalf("got %s, want %s", req, want)
	}
	_, other, _ := tokenizeRequest("m", "/v1/chat/completions", []byte(`{"messages":[{"role":"user","content":"hi"}]}`))
	if other == key {
		t.Error("a chat without its tools shares the cache key of one with them")
	}
}

// A prompt /tokenize cannot take whole is counted in the shapes it can: a conversation as chat
// messages where the engine templates one, else each text; token ids as given; the rest by its
// bytes, never by bytes / 4.
func TestPromptCountAsksEveryShapeItCan(t *testing.T) {
	var asked []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var q struct {
			Prompt   *string           `json:"prompt"`
			Messages []json.RawMessage `json:"messages"`
		}
		if json.NewDecoder(r.Body).Decode(&q) != nil {
			w.WriteHeader(400)
			return
		}
		n := 0
		switch {
		case q.Prompt != nil:
			asked = append(asked, "prompt")
			n = len(strings.Fields(*q.Prompt))
		case len(q.Messages) > 0:
			asked = append(asked, "messages")
			n = 1000 + len(q.Messages)
		}
		json.NewEncoder(w).Encode(map[string]any{"tokens": make([]uint32, n)})
	}))
	defer srv.Close()
	for _, c := range []struct {
		name, path, body string
		chat             bool
		want             int
		wantExact        bool
		wantAsked        string
	}{
		{"a list of prompts, item by item", "/v1/completions", `{"prompt":["a b","c d e"]}`, true, 5 + len(`[,]`), false, "prompt prompt"},
		{"token ids as given", "/v1/completions", `{"prompt":[[1,2,3],[4]]}`, true, 4 + 5, false, ""}, // and the brackets past each id
		{"responses as chat messages", "/v1/responses", `{"instructions":"be brief","input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]}]}`, true, 1002, true, "messages"},
		{"messages as chat messages", "/v1/messages", `{"system":"be brief","messages":[{"role":"user","content":"hi"}]}`, true, 1002, true, "messages"},
		{"a chat where the engine takes no messages", "/v1/chat/completions", `{"messages":[{"role":"user","content":"a b c"}]}`, false,
			3 + len(`[{"role":"user","content":}]`), false, "prompt"},
		{"a tool call: texts and bytes", "/v1/responses", `{"input":[{"type":"function_call_output","call_id":"c","output":"x y"}]}`, true,
			2 + len(`[{"type":"function_call_output","call_id":"c","output":}]`), false, "prompt"},
	} {
		t.Run(c.name, func(t *testing.T) {
			asked = nil
			tk := &Tokenizer{Client: srv.Client(), Timeout: 5e9}
			n, exact, ok := tk.PromptCount(t.Context(), srv.URL, "", "m", c.path, []byte(c.body), c.chat)
			if !ok || n != c.want || exact != c.wantExact {
				t.Errorf("counted %d (exact %v, ok %v), want %d (exact %v)", n, exact, ok, c.want, c.wantExact)
			}
			if got := strings.Join(asked, " "); got != c.wantAsked {
				t.Errorf("asked %q, want %q", got, c.wantAsked)
			}
		})
	}
}
