package kvevents

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"golang.org/x/sync/singleflight"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/routes"
)

// Tokenizer asks an engine for the token ids of a request's prompt (vLLM's and SGLang's
// POST /tokenize, with the chat template applied for messages), so that a request's blocks can
// be matched against the engines' KV events. Answers are cached (the same prompt is tokenized
// once, and concurrent asks for one prompt share one request); a failure or a prompt it cannot
// send (a list of prompts, token ids already) says no, and the caller falls back to its
// approximate index.
type Tokenizer struct {
	Client  *http.Client
	Timeout time.Duration
	// MaxEntries and MaxBytes bound the cache (token ids at 4 bytes each); the oldest answers
	// are forgotten first.
	MaxEntries, MaxBytes int

	// Hits counts answers from the cache (or from another caller's ask), Asks the requests
	// sent, Failures those that brought no token ids.
	Hits, Asks, Failures atomic.Uint64

	mu    sync.Mutex
	cache map[uint64][]uint32
	order []uint64 // cached keys, oldest first from head
	head  int
	bytes int
	asks  singleflight.Group // one /tokenize request per prompt at a time, shared by its callers
	wg    sync.WaitGroup     // callers' waits on asks still running
}

// Wait waits for the asks still running (each ends by its timeout at the latest).
func (t *Tokenizer) Wait() { t.wg.Wait() }

// answer is a /tokenize request's result, shared by the callers that waited on it.
type answer struct {
	toks []uint32
	ok   bool
}

// maxTokenizeAnswer bounds an engine's /tokenize answer.
const maxTokenizeAnswer = 16 << 20

// Tokens returns the token ids of the prompt of body (a request to path for model), asking the
// engine at base (with apiKey as its bearer token, when set) when not cached. ctx is the
// request's: a caller whose client left or whose deadline passed stops waiting at once; the ask
// itself runs to its own timeout (bounded by ctx's deadline) for whoever else waits on it.
func (t *Tokenizer) Tokens(ctx context.Context, base, apiKey, model, path string, body []byte) ([]uint32, bool) {
	if ctx == nil {
		ctx = context.Background()
	}
	req, key, ok := tokenizeRequest(model, path, body)
	if !ok {
		return nil, false
	}
	t.mu.Lock()
	toks, hit := t.cache[key]
	t.mu.Unlock()
	if hit {
		t.Hits.Add(1)
		return toks, true
	}
	timeout := t.Timeout
	if d, has := ctx.Deadline(); has {
		timeout = min(timeout, time.Until(d))
	}
	ran := false // only the caller whose function asks sends the request; the others share its answer
	ask := func() (any, error) {
		// An ask that ended between this caller's look at the cache and now has filled it.
		t.mu.Lock()
		toks, hit := t.cache[key]
		t.mu.Unlock()
		if hit {
			return answer{toks: toks, ok: true}, nil
		}
		ran = true
		return t.run(context.WithoutCancel(ctx), timeout, key, base, apiKey, req), nil
	}
	done := make(chan answer, 1)
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		v, _, _ := t.asks.Do(strconv.FormatUint(key, 16), ask)
		if !ran {
			t.Hits.Add(1)
		}
		done <- v.(answer)
	}()
	select {
	case a := <-done:
		return a.toks, a.ok
	case <-ctx.Done():
		return nil, false
	}
}

// Count returns how many tokens body's prompt has when an engine's answer for it is cached,
// without asking one (a tenant's reservation takes it over an estimate).
func (t *Tokenizer) Count(model, path string, body []byte) (int, bool) {
	t.mu.Lock()
	empty := len(t.cache) == 0
	t.mu.Unlock()
	if empty {
		return 0, false // nothing was ever asked (cache_aware does not read the engines' events)
	}
	_, key, ok := tokenizeRequest(model, path, body)
	if !ok {
		return 0, false
	}
	t.mu.Lock()
	toks, hit := t.cache[key]
	t.mu.Unlock()
	return len(toks), hit
}

// run sends one ask and caches a good answer.
func (t *Tokenizer) run(ctx context.Context, timeout time.Duration, key uint64, base, apiKey string, req []byte) answer {
	t.Asks.Add(1)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	toks, ok := t.ask(ctx, base, apiKey, req)
	if !ok {
		t.Failures.Add(1)
		return answer{}
	}
	t.mu.Lock()
	t.remember(key, toks)
	t.mu.Unlock()
	return answer{toks: toks, ok: true}
}

// tokenizeRequest returns the /tokenize body for a request's prompt and its cache key, or false
// for a prompt it cannot send (a list of prompts, token ids already, another route).
func tokenizeRequest(model, path string, body []byte) ([]byte, uint64, bool) {
	route := routes.Of(path)
	member, extra := route.Tokenize, route.TokenizeExtra
	if member == "" {
		return nil, 0, false
	}
	raw, ok := openai.Get(body, member)
	if !ok || (member == "prompt" && (len(raw) == 0 || raw[0] != '"')) {
		return nil, 0, false
	}
	m, _ := json.Marshal(model)
	req := append(append(append([]byte(`{"model":`), m...), `,"`+member+`":`...), raw...)
	for _, k := range extra {
		if v, ok := openai.Get(body, k); ok {
			req = append(append(append(append(req, `,"`...), k...), `":`...), v...)
		}
	}
	req = append(req, '}')
	d := xxhash.New()
	for _, part := range []string{path, "\x00"} {
		_, _ = d.WriteString(part)
	}
	_, _ = d.Write(req)
	return req, d.Sum64(), true
}

func (t *Tokenizer) ask(ctx context.Context, base, apiKey string, body []byte) ([]uint32, bool) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/tokenize", bytes.NewReader(body))
	if err != nil {
		return nil, false
	}
	req.Header.Set("Content-Type", "application/json")
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	resp, err := t.Client.Do(req)
	if err != nil {
		return nil, false
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxTokenizeAnswer+1))
	if err != nil || resp.StatusCode != http.StatusOK || len(b) > maxTokenizeAnswer {
		return nil, false
	}
	var v struct {
		Tokens []uint32 `json:"tokens"`
	}
	if json.Unmarshal(b, &v) != nil || len(v.Tokens) == 0 {
		return nil, false
	}
	return v.Tokens, true
}

// remember caches an answer, forgetting the oldest past either bound; an answer larger than
// the whole byte bound is not kept. Called with t.mu held.
func (t *Tokenizer) remember(key uint64, toks []uint32) {
	size := 4 * len(toks)
	if t.MaxBytes > 0 && size > t.MaxBytes {
		return
	}
	if t.cache == nil {
		t.cache = map[uint64][]uint32{}
	}
	if _, ok := t.cache[key]; ok {
		return
	}
	for len(t.order)-t.head > 0 && ((t.MaxEntries > 0 && len(t.order)-t.head >= t.MaxEntries) || (t.MaxBytes > 0 && t.bytes+size > t.MaxBytes)) {
		old := t.order[t.head]
		t.bytes -= 4 * len(t.cache[old])
		delete(t.cache, old)
		t.head++
	}
	if t.head > len(t.order)/2 { // compact the queue now and then
		t.order = append(t.order[:0], t.order[t.head:]...)
		t.head = 0
	}
	t.order = append(t.order, key)
	t.cache[key] = toks
	t.bytes += size
}

// Cached returns the number of cached answers and their token ids' bytes.
func (t *Tokenizer) Cached() (entries, bytes int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.cache), t.bytes
}

// maxCountAsks bounds the /tokenize asks one prompt's count makes (the texts of a list of
// prompts, of a conversation an engine cannot template): past it, a text counts by its bytes.
const maxCountAsks = 64

// textKeys are the members whose strings are a prompt's text, wherever they sit in it (chat
// and Anthropic content, parts' text, Responses' input, instructions and outputs, a tool call's
// arguments): each is asked of the engine when the whole cannot be.
var textKeys = map[string]bool{"content": true, "text": true, "input": true, "instructions": true, "system": true,
	"prompt": true, "output": true, "arguments": true}

// PromptCount counts the tokens of the prompt of body (a request to path for model), asking
// the engine at base (cached, as Tokens) for every shape it can count:
//   - a conversation whole, its chat template applied, when chat says the engine's /tokenize
//     takes messages (vLLM's TokenizeChatRequest; SGLang's TokenizeRequest takes a prompt
//     only): a chat's messages, and /v1/responses and /v1/messages mapped to chat messages when
//     every item is a message of text and no tools are named (chatOf);
//   - else each text the prompt holds, one ask each (vLLM's TokenizeCompletionRequest takes
//     one string): a completion's prompt or each of a list of prompts, /generate's text, the
//     texts of a conversation;
//   - token ids as given, one token each.
//
// What no ask counted — the structure around the texts (roles, the JSON between them, tool
// definitions, images), a text past maxCountAsks, an ask that failed — counts one token per
// byte: never less than an engine computes for it, so that a prompt Baton cannot have counted is
// not charged less than it cost. exact says every part was the engine's own count. ok is false
// for a route whose prompt Baton does not know.
func (t *Tokenizer) PromptCount(ctx context.Context, base, apiKey, model, path string, body []byte, chat bool) (n int, exact, ok bool) {
	if ctx == nil {
		ctx = context.Background()
	}
	if chat {
		if cb, ok := chatOf(path, body); ok {
			if toks, ok := t.Tokens(ctx, base, apiKey, model, "/v1/chat/completions", cb); ok {
				return len(toks), true, true
			}
		}
	}
	p, ok := piecesOf(path, body)
	if !ok {
		return 0, false, false
	}
	n, exact = p.ids+p.rest, p.rest == 0
	asks := 0
	for _, s := range p.texts {
		if s == "" {
			continue
		}
		if asks < maxCountAsks && ctx.Err() == nil {
			asks++
			q, _ := json.Marshal(s)
			m, _ := json.Marshal(model)
			req := append(append(append(append([]byte(`{"model":`), m...), `,"prompt":`...), q...), '}')
			if toks, ok := t.Tokens(ctx, base, apiKey, model, "/v1/completions", req); ok {
				n += len(toks)
				continue
			}
		}
		n, exact = n+len(s), false
	}
	return n, exact, true
}

// chatOf is body as a chat's /tokenize takes it (messages and what shapes their template), for
// the routes whose prompt is a conversation: a chat's own body; a Responses request whose
// instructions and input are text (a string, or items that are messages of text parts); an
// Anthropic messages request whose system and messages are text. False when an item or part is
// anything else (a tool call or its output, an image, reasoning) or tools are named: the engine
// templates those in its own way, which Baton does not rebuild.
func chatOf(path string, body []byte) ([]byte, bool) {
	switch path {
	case "/v1/chat/completions":
		return body, true
	case "/v1/responses", "/v1/messages":
	default:
		return nil, false
	}
	if _, has := openai.Get(body, "tools"); has {
		return nil, false
	}
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	var msgs []message
	add := func(role string, raw []byte) bool {
		text, ok := textOf(raw)
		if ok {
			msgs = append(msgs, message{role, text})
		}
		return ok
	}
	system, items := "instructions", "input"
	if path == "/v1/messages" {
		system, items = "system", "messages"
	}
	if raw, has := openai.Get(body, system); has && !isNull(raw) && !add("system", raw) {
		return nil, false
	}
	raw, has := openai.Get(body, items)
	if !has {
		return nil, false
	}
	if raw = bytes.TrimSpace(raw); len(raw) > 0 && raw[0] == '"' {
		if !add("user", raw) {
			return nil, false
		}
	} else {
		var list []struct {
			Type    string          `json:"type"`
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		}
		if json.Unmarshal(raw, &list) != nil || len(list) == 0 {
			return nil, false
		}
		for _, it := range list {
			role := it.Role
			if role == "developer" {
				role = "system" // Responses' developer message is the chat's system message
			}
			if it.Type != "" && it.Type != "message" || role == "" || !add(role, it.Content) {
				return nil, false
			}
		}
	}
	out, err := json.Marshal(struct {
		Messages []message `json:"messages"`
	}{msgs})
	return out, err == nil
}

// textOf is the text of a content: a string, or a list of text parts (Responses' input_text and
// output_text, Anthropic's and chat's text), joined.
func textOf(raw []byte) (string, bool) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, true
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if json.Unmarshal(raw, &parts) != nil || len(parts) == 0 {
		return "", false
	}
	var b bytes.Buffer
	for _, p := range parts {
		switch p.Type {
		case "text", "input_text", "output_text":
		default:
			return "", false
		}
		if p.Text == nil {
			return "", false
		}
		b.WriteString(*p.Text)
	}
	return b.String(), true
}

func isNull(raw []byte) bool { return bytes.Equal(bytes.TrimSpace(raw), []byte("null")) }

// pieces is a prompt taken apart: its texts, its token ids (as given), and the bytes of the
// rest (the structure around them).
type pieces struct {
	texts     []string
	ids, rest int
}

// piecesOf takes the prompt of body apart: every string under a text member (textKeys) or
// standing as a prompt (a member's value, an item of its list), every list of integers as token
// ids; the rest of the prompt's members (and of what shapes a chat's template: tools) is counted
// in bytes. False for a route whose prompt Baton does not know.
func piecesOf(path string, body []byte) (pieces, bool) {
	r := routes.Of(path)
	if len(r.Prompt) == 0 {
		return pieces{}, false
	}
	var p pieces
	members := append(append([]string(nil), r.Prompt...), r.TokenizeExtra...)
	if r.Batch == routes.BatchCompletions {
		members = append(members, "prompt_embeds") // no text: its bytes, far more than its tokens
	}
	for _, m := range members {
		raw, has := openai.Get(body, m)
		if !has || isNull(raw) {
			continue
		}
		d := json.NewDecoder(bytes.NewReader(raw))
		d.UseNumber()
		var v any
		if d.Decode(&v) != nil {
			p.rest += len(raw)
			continue
		}
		counted := p.walk(v, true)
		p.rest += max(0, len(raw)-counted)
	}
	return p, true
}

// walk collects v's texts and token ids (text: v stands where a text may) and returns the bytes
// they took in the body, about: what is not counted in bytes.
func (p *pieces) walk(v any, text bool) int {
	switch v := v.(type) {
	case string:
		if !text {
			return 0
		}
		p.texts = append(p.texts, v)
		q, _ := json.Marshal(v)
		return len(q)
	case []any:
		if n, ok := idsOf(v); ok {
			p.ids += len(v)
			return n
		}
		taken := 0
		for _, el := range v {
			taken += p.walk(el, text)
		}
		return taken
	case map[string]any:
		taken := 0
		for k, el := range v {
			taken += p.walk(el, textKeys[k])
		}
		return taken
	}
	return 0
}

// idsOf reports whether list is token ids (integers, at least one), and the bytes they took.
func idsOf(list []any) (int, bool) {
	n := 0
	for _, el := range list {
		num, ok := el.(json.Number)
		if !ok {
			return 0, false
		}
		if _, err := num.Int64(); err != nil {
			return 0, false
		}
		n += len(num) + 1
	}
	return n, len(list) > 0
}
