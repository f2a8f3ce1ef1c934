package kvevents

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/baton-llm/baton/internal/openai"
)

// Tokenizer asks an engine for the token ids of a request's prompt (vLLM's POST /tokenize, with
// the chat template applied for messages), so that a request's blocks can be matched against
// the engines' KV events. Answers are cached (the same prompt is tokenized once); a failure or
// a prompt it cannot send (a list of prompts, token ids already) says no, and the caller falls
// back to its approximate index.
type Tokenizer struct {
	Client     *http.Client
	Timeout    time.Duration
	MaxEntries int // cached answers, oldest forgotten first

	mu    sync.Mutex
	cache map[uint64][]uint32
	order []uint64 // ring of cached keys, oldest at next
	next  int
}

// maxTokenizeAnswer bounds an engine's /tokenize answer.
const maxTokenizeAnswer = 16 << 20

// Tokens returns the token ids of the prompt of body (a request to path for model), asking the
// engine at base when not cached.
func (t *Tokenizer) Tokens(base, model, path string, body []byte) ([]uint32, bool) {
	member := "prompt"
	if path == "/v1/chat/completions" {
		member = "messages"
	} else if path != "/v1/completions" {
		return nil, false
	}
	raw, ok := openai.Get(body, member)
	if !ok || (member == "prompt" && (len(raw) == 0 || raw[0] != '"')) {
		return nil, false
	}
	d := xxhash.New()
	for _, part := range []string{path, "\x00", model, "\x00"} {
		_, _ = d.WriteString(part)
	}
	_, _ = d.Write(raw)
	key := d.Sum64()
	t.mu.Lock()
	toks, hit := t.cache[key]
	t.mu.Unlock()
	if hit {
		return toks, true
	}
	m, _ := json.Marshal(model)
	req := append(append(append(append([]byte(`{"model":`), m...), `,"`+member+`":`...), raw...), '}')
	toks, ok = t.ask(base, req)
	if !ok {
		return nil, false
	}
	t.remember(key, toks)
	return toks, true
}

func (t *Tokenizer) ask(base string, body []byte) ([]uint32, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), t.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/tokenize", bytes.NewReader(body))
	if err != nil {
		return nil, false
	}
	req.Header.Set("Content-Type", "application/json")
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

func (t *Tokenizer) remember(key uint64, toks []uint32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.cache == nil {
		t.cache, t.order = map[uint64][]uint32{}, make([]uint64, max(1, t.MaxEntries))
	}
	if _, ok := t.cache[key]; ok {
		return
	}
	if old := t.order[t.next]; old != 0 {
		delete(t.cache, old)
	}
	t.order[t.next] = key
	t.next = (t.next + 1) % len(t.order)
	t.cache[key] = toks
}
