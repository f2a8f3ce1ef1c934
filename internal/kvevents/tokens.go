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
