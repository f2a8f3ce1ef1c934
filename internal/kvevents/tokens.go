package kvevents

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/baton-llm/baton/internal/openai"
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

	mu       sync.Mutex
	cache    map[uint64][]uint32
	order    []uint64 // cached keys, oldest first from head
	head     int
	bytes    int
	inflight map[uint64]*ask
}

// ask is one /tokenize request that concurrent callers for the same prompt wait on.
type ask struct {
	done chan struct{}
	toks []uint32
	ok   bool
}

// maxTokenizeAnswer bounds an engine's /tokenize answer.
const maxTokenizeAnswer = 16 << 20

// Tokens returns the token ids of the prompt of body (a request to path for model), asking the
// engine at base (with apiKey as its bearer token, when set) when not cached.
func (t *Tokenizer) Tokens(base, apiKey, model, path string, body []byte) ([]uint32, bool) {
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
	if toks, hit := t.cache[key]; hit {
		t.mu.Unlock()
		t.Hits.Add(1)
		return toks, true
	}
	if a := t.inflight[key]; a != nil {
		t.mu.Unlock()
		t.Hits.Add(1)
		<-a.done
		return a.toks, a.ok
	}
	a := &ask{done: make(chan struct{})}
	if t.inflight == nil {
		t.inflight = map[uint64]*ask{}
	}
	t.inflight[key] = a
	t.mu.Unlock()

	m, _ := json.Marshal(model)
	req := append(append(append(append([]byte(`{"model":`), m...), `,"`+member+`":`...), raw...), '}')
	t.Asks.Add(1)
	a.toks, a.ok = t.ask(base, apiKey, req)
	if !a.ok {
		t.Failures.Add(1)
	}
	t.mu.Lock()
	delete(t.inflight, key)
	if a.ok {
		t.remember(key, a.toks)
	}
	t.mu.Unlock()
	close(a.done)
	return a.toks, a.ok
}

func (t *Tokenizer) ask(base, apiKey string, body []byte) ([]uint32, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), t.Timeout)
	defer cancel()
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
