package policy

import (
	"cmp"
	"container/list"
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// prefixBlock is how many bytes of a prompt make one block of the approximate prefix index.
const prefixBlock = 64

// maxPromptBlocks bounds how much of a prompt the index looks at (64 KiB).
const maxPromptBlocks = 1024

func init() {
	Register(Kind{Name: config.PolicyCacheAware, Reason: ReasonCacheMatch, New: func(cfg config.Config) Policy {
		return &CacheAware{Threshold: cfg.CacheThreshold, BalanceAbs: cfg.BalanceAbsThreshold, BalanceRel: cfg.BalanceRelThreshold,
			LoadCost: cfg.CacheLoadCost, MaxBlocks: max(1, cfg.MaxTreeSize/prefixBlock), TTL: cfg.EvictionInterval}
	},
		Chooses: "the cheapest worker, cost = prompt blocks it has not seen (from an index of what Baton routed: 64-byte blocks, LRU-bounded by `max_tree_size`, forgotten after `eviction_interval_secs`) + `cache_load_cost` × its load; a prompt cached nowhere above `cache_threshold`, or an imbalanced fleet, goes to the least loaded worker with the fewest indexed blocks",
		GoodFor: "many distinct long prefixes: matches the longest cached part, not a fixed-length hash, and spreads a hot prefix to a second worker as its first one's queue grows. The approximate index is per replica; with KV events (see KV events) every replica reads the engines' own view and they agree"})
}

// CacheAware sends a request where the longest part of its prompt is likely cached, from what
// this gateway routed before (an approximate index: blocks of the prompt's bytes, each keyed by
// its whole prefix, remembered per worker, least recently used forgotten past MaxBlocks or after
// TTL, when set). It chooses by cost — the prompt blocks a worker would have to compute, plus its load
// weighted by LoadCost blocks per request — so that a hot prefix spreads to more workers as its
// worker's queue grows instead of burying it. When no worker has at least Threshold of the
// prompt, or the fleet is out of balance (the busiest above BalanceAbs requests and BalanceRel
// times the idlest), it falls back to the least loaded worker, the one with the fewest indexed
// blocks among equals.
type CacheAware struct {
	Threshold              float64
	BalanceAbs, BalanceRel float64
	LoadCost               float64 // prompt blocks one request of load is worth
	MaxBlocks              int
	TTL                    time.Duration
	// Precise, when set, gives each worker's cached share of the prompt from the engines' own
	// KV events (0..1), or -1 for a worker it knows nothing of (those, and every worker when it
	// returns nil, use the approximate index).
	Precise func(ctx context.Context, ws []*worker.Worker, req *Request) []float64
	// Speculative is how long what this gateway routed counts beside the engines' events; zero
	// means SpeculativeTTL.
	Speculative time.Duration
	// Now is the clock the TTLs read (nil: time.Now).
	Now func() time.Time

	mu    sync.Mutex
	index map[uint64]*entry      // block key -> the workers that had it
	lru   *list.List             // of *entry, most recent at the front
	owned map[*worker.Worker]int // blocks the index holds per worker: its cache pressure

	evictions atomic.Uint64
}

type entry struct {
	key     uint64
	workers []*worker.Worker // few: the workers this block was routed to
	seen    time.Time
	el      *list.Element
}

var _ Policy = (*CacheAware)(nil)

// Pick implements Policy.
func (p *CacheAware) Pick(ctx context.Context, ws []*worker.Worker, req *Request) *worker.Worker {
	w, _ := p.explain(ctx, ws, req)
	return w
}

func (p *CacheAware) explain(ctx context.Context, ws []*worker.Worker, req *Request) (*worker.Worker, Decision) {
	var model string
	if req != nil {
		model = req.Model
	}
	keys := blocksOf(model, promptOf(req))
	shares := p.shares(ctx, keys, ws, req)
	n := float64(len(keys))
	best, bestCost, bestShare := 0, 0.0, 0.0
	ties := 0
	for i, w := range ws {
		cost := (1-shares[i])*n + p.LoadCost*load(w)
		switch {
		case i == 0 || cost < bestCost:
			best, bestCost, bestShare, ties = i, cost, shares[i], 1
		case cost == bestCost:
			ties++
			if rand.IntN(ties) == 0 {
				best, bestShare = i, shares[i]
			}
		}
	}
	reason := ReasonCacheMatch
	switch {
	case len(keys) == 0:
		reason = ReasonNoPrompt
	case bestShare < p.Threshold:
		reason = ReasonCacheMiss
	case p.imbalanced(ws):
		reason = ReasonImbalanced
	}
	if reason != ReasonCacheMatch {
		best = p.roomiest(ws)
	}
	p.record(keys, ws[best])
	match := -1.0
	if len(keys) > 0 {
		match = shares[best]
	}
	return ws[best], Decision{Reason: reason, Match: match}
}

// shares returns each worker's cached share of the prompt: from the engines' events where
// Precise knows, else from the approximate index.
func (p *CacheAware) shares(ctx context.Context, keys []uint64, ws []*worker.Worker, req *Request) []float64 {
	now := p.now()
	matched := p.matches(keys, ws, now, p.TTL)
	out := make([]float64, len(ws))
	for i := range out {
		if len(keys) > 0 {
			out[i] = float64(matched[i]) / float64(len(keys))
		}
	}
	if p.Precise == nil || len(keys) == 0 {
		return out
	}
	if precise := p.Precise(ctx, ws, req); len(precise) == len(ws) {
		// What the engines confirmed, or what this gateway routed there in the last moments
		// (the engine's events for it may not have arrived yet): a burst of one prefix stays
		// together instead of scattering while its first request is still in prefill.
		recent := p.matches(keys, ws, now, cmp.Or(p.Speculative, SpeculativeTTL))
		for i, s := range precise {
			if s >= 0 {
				out[i] = min(max(s, float64(recent[i])/float64(len(keys))), 1)
			}
		}
	}
	return out
}

// roomiest is where a prompt nobody has cached goes: the least loaded worker, and among those
// the one the index holds fewest blocks for, so that prefixes spread over the fleet's caches
// instead of piling onto one worker's (ties at random).
func (p *CacheAware) roomiest(ws []*worker.Worker) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	best, bl, bo, ties := 0, load(ws[0]), p.owned[ws[0]], 1
	for i, w := range ws[1:] {
		l, o := load(w), p.owned[w]
		switch {
		case l < bl || (l == bl && o < bo):
			best, bl, bo, ties = i+1, l, o, 1
		case l == bl && o == bo:
			ties++
			if rand.IntN(ties) == 0 {
				best = i + 1
			}
		}
	}
	return best
}

// imbalanced reports whether the busiest worker is above BalanceAbs requests and BalanceRel
// times the idlest.
func (p *CacheAware) imbalanced(ws []*worker.Worker) bool {
	lo, hi := load(ws[0]), load(ws[0])
	for _, w := range ws[1:] {
		l := load(w)
		lo, hi = min(lo, l), max(hi, l)
	}
	return hi-lo > p.BalanceAbs && hi > p.BalanceRel*lo
}

// blocksOf returns the chained keys of prompt's blocks (the last partial one included), the
// chain seeded by the model: one prompt sent to two models shares no cache.
func blocksOf(model string, prompt []byte) []uint64 {
	if len(prompt) == 0 {
		return nil
	}
	n := min((len(prompt)+prefixBlock-1)/prefixBlock, maxPromptBlocks)
	keys := make([]uint64, n)
	h := xxhash.Sum64String(model)
	for i := range keys {
		end := min((i+1)*prefixBlock, len(prompt))
		h = mix(h ^ xxhash.Sum64(prompt[i*prefixBlock:end]))
		keys[i] = h
	}
	return keys
}

// matches returns, for each of ws, how many leading blocks of keys the index holds for it.
func (p *CacheAware) matches(keys []uint64, ws []*worker.Worker, now time.Time, ttl time.Duration) []int {
	out := make([]int, len(ws))
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, k := range keys {
		e := p.index[k]
		if e == nil || (ttl > 0 && now.Sub(e.seen) > ttl) {
			break
		}
		alive := 0 // workers still matching
		for j, w := range ws {
			if out[j] == i && holds(e, w) {
				out[j]++
				alive++
			}
		}
		if alive == 0 {
			break
		}
	}
	return out
}

func holds(e *entry, w *worker.Worker) bool {
	for _, x := range e.workers {
		if x == w {
			return true
		}
	}
	return false
}

// SpeculativeTTL is how long what this gateway routed counts beside the engines' events.
const SpeculativeTTL = 5 * time.Second

// maxHolders bounds the workers remembered per block: a block on more workers than this is
// everywhere as far as routing goes.
const maxHolders = 8

func (p *CacheAware) now() time.Time {
	if p.Now != nil {
		return p.Now()
	}
	return time.Now()
}

// record remembers that keys were routed to w.
func (p *CacheAware) record(keys []uint64, w *worker.Worker) {
	if len(keys) == 0 {
		return
	}
	now := p.now()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.index == nil {
		p.index, p.lru, p.owned = map[uint64]*entry{}, list.New(), map[*worker.Worker]int{}
	}
	for _, k := range keys {
		e := p.index[k]
		if e == nil {
			e = &entry{key: k}
			e.el = p.lru.PushFront(e)
			p.index[k] = e
		} else {
			p.lru.MoveToFront(e.el)
		}
		e.seen = now
		if !holds(e, w) {
			if len(e.workers) >= maxHolders {
				p.disown(e.workers[0])
				e.workers = e.workers[1:]
			}
			e.workers = append(e.workers, w)
			p.owned[w]++
		}
	}
	for p.lru.Len() > p.MaxBlocks {
		p.evictions.Add(1)
		old := p.lru.Remove(p.lru.Back()).(*entry)
		delete(p.index, old.key)
		for _, x := range old.workers {
			p.disown(x)
		}
	}
}

// disown forgets one block of w's; a worker with none leaves the map (which so stays bounded
// by the workers the index still mentions, whatever the fleet's churn).
func (p *CacheAware) disown(w *worker.Worker) {
	if p.owned[w]--; p.owned[w] <= 0 {
		delete(p.owned, w)
	}
}

// Evictions is the number of blocks forgotten to keep the index within MaxBlocks.
func (p *CacheAware) Evictions() uint64 { return p.evictions.Load() }

// Size is the number of blocks the index holds.
func (p *CacheAware) Size() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.lru == nil {
		return 0
	}
	return p.lru.Len()
}
