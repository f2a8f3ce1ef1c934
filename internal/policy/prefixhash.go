package policy

import (
	"context"

	"github.com/cespare/xxhash/v2"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/worker"
)

func init() {
	Register(Kind{Name: config.PolicyPrefixHash, Reason: ReasonHash, New: func(cfg config.Config) Policy {
		return &PrefixHash{PrefixBytes: max(1, 4*cfg.PrefixTokenCount), LoadFactor: max(1, cfg.PrefixHashLoadFactor)}
	},
		Chooses: "the worker a hash of the prompt's first `prefix_token_count` tokens ranks first (rendezvous hashing), passing over one loaded above `prefix_hash_load_factor` × the mean",
		GoodFor: "shared system prompts and multi-turn chats: their prefix stays cached on one worker; stateless, so every replica chooses alike, and a worker joining or leaving moves only its own prefixes"})
}

// PrefixHash sends requests whose prompts begin alike to the same worker, where their prefix is
// likely cached, with no state at all: the first PrefixBytes of the prompt are hashed and the
// workers ranked by rendezvous hashing (highest hash of prompt and worker wins), so every
// replica of Baton makes the same choice and a worker joining or leaving moves only the prefixes
// it wins or held. A worker loaded above LoadFactor times the mean (plus one request) is passed
// over for the next on the prefix's ranking, so one hot prefix cannot bury its worker. A request
// without a prompt goes to the least loaded worker.
type PrefixHash struct {
	PrefixBytes int     // how much of the prompt is hashed
	LoadFactor  float64 // ≥ 1
}

var _ Policy = (*PrefixHash)(nil)

// Pick implements Policy.
func (p *PrefixHash) Pick(ctx context.Context, ws []*worker.Worker, req *Request) *worker.Worker {
	prefix := promptOf(req)
	if len(ws) == 1 || len(prefix) == 0 {
		return LeastLoad{}.Pick(ctx, ws, req)
	}
	if len(prefix) > p.PrefixBytes {
		prefix = prefix[:p.PrefixBytes]
	}
	key := xxhash.Sum64(prefix)
	mean := 0.0
	for _, w := range ws {
		mean += load(w)
	}
	limit := p.LoadFactor*mean/float64(len(ws)) + 1
	var best *worker.Worker
	var bestScore uint64
	for _, w := range ws {
		if load(w) > limit {
			continue
		}
		if s := mix(key ^ xxhash.Sum64String(w.URL)); best == nil || s > bestScore {
			best, bestScore = w, s
		}
	}
	if best == nil {
		return LeastLoad{}.Pick(ctx, ws, req)
	}
	return best
}

// mix is a 64-bit finalizer (splitmix64's): it spreads a combined key over the whole range.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// promptOf returns the raw bytes of the request's prompt member (the first present), without
// decoding it: requests whose prompts begin alike have bytes that begin alike. nil when none.
func promptOf(req *Request) []byte {
	if req == nil {
		return nil
	}
	for _, k := range routes.Of(req.Path).Prompt {
		if raw, ok := req.get(k); ok && len(raw) > 0 && string(raw) != "null" {
			return raw
		}
	}
	return nil
}

// get reads a top-level member of the request's body: from the parsed request's index when
// there is one, else by scanning the body.
func (r *Request) get(key string) ([]byte, bool) {
	if r.Parsed != nil {
		return r.Parsed.Get(key)
	}
	return openai.Get(r.Body, key)
}
