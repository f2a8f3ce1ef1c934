package kvevents

import "sync"

// A hybrid-attention model (gpt-oss, Gemma 2 and 3, …) keeps one KV-cache group per attention
// kind, and vLLM announces BlockStored and BlockRemoved per group with the same block hashes
// (group_idx, and kv_cache_spec_kind on BlockStored: vllm/distributed/kv_events.py). A
// sliding-window group frees a prompt's early blocks as soon as they leave its window; read as
// removals of the prompt's blocks, they would erase the full-attention prefix from the index,
// and routing from events would find nothing on such a model. Only the full-attention groups
// are indexed: what a request's prefix can reuse.

// fullAttention reports whether blocks of a group of this kv_cache_spec_kind hold a whole
// prefix (vllm/v1/kv_cache_interface.py KVCacheSpecKind).
func fullAttention(kind string) bool {
	switch kind {
	case "full_attention", "mla_attention", "sink_full_attention":
		return true
	}
	return false
}

// groups remembers, for one engine, which KV-cache groups are indexed.
type groups struct {
	mu   sync.Mutex
	full map[int]bool // group_idx → indexed, learned from BlockStored's kv_cache_spec_kind
}

// indexed reports whether e's blocks go into the index: events of no group (one-group engines,
// older vLLM, SGLang) always; a group announced as full attention, yes, any other kind, no; a
// group never announced with a kind, only group 0 — then the groups cannot be told apart, and
// indexing one keeps another's removals from erasing it.
func (g *groups) indexed(e *Event) bool {
	if e.Group < 0 {
		return true
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if e.Kind == KindStored && e.SpecKind != "" {
		if g.full == nil {
			g.full = map[int]bool{}
		}
		full := fullAttention(e.SpecKind)
		g.full[e.Group] = full
		return full
	}
	if full, known := g.full[e.Group]; known {
		return full
	}
	return e.Group == 0
}
