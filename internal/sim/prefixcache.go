package sim

import (
	"container/list"
	"sync"
)

// prefixCache is an engine's prefix cache: the KV of full blocks of blockSize tokens, each keyed
// by the chained hash of its tokens and of every block before it (so a block is reused only
// after the same prefix), at most capacity blocks, the least recently used evicted first.
type prefixCache struct {
	mu       sync.Mutex
	capacity int
	lru      *list.List               // of uint64 block keys, most recent at the front
	blocks   map[uint64]*list.Element // key -> element in lru
	// onChange, when set, is told (under the lock, in order) of the blocks each compute stored,
	// with their parents and tokens, and of those it evicted: the engine's KV events.
	onChange func(stored []storedBlock, removed []uint64)
}

// storedBlock is one block newly cached: its key, its parent's (0 for the first block), its
// tokens, and the LoRA adapter whose KV it is ("" for the base model).
type storedBlock struct {
	key, parent uint64
	tokens      []uint32
	lora        string
}

func newPrefixCache(capacity int) *prefixCache {
	return &prefixCache{capacity: capacity, lru: list.New(), blocks: map[uint64]*list.Element{}}
}

// blockKeys returns the chained keys of prompt's full blocks under LoRA adapter lora ("" for
// the base model): an adapter's KV differs from the base model's for the same tokens.
func blockKeys(prompt []uint32, lora string) []uint64 {
	keys := make([]uint64, 0, len(prompt)/blockSize)
	h := uint64(0x9e3779b97f4a7c15)
	for i := 0; i < len(lora); i++ {
		h = mix(h ^ uint64(lora[i]))
	}
	for i := 0; i+blockSize <= len(prompt); i += blockSize {
		for _, t := range prompt[i : i+blockSize] {
			h = mix(h ^ uint64(t))
		}
		keys = append(keys, h)
	}
	return keys
}

// compute looks prompt up and stores its blocks: it returns how many leading tokens were
// cached (full blocks only, and never the last token, which is always computed).
func (c *prefixCache) compute(prompt []uint32, lora string) int {
	keys := blockKeys(prompt, lora)
	c.mu.Lock()
	defer c.mu.Unlock()
	hits := 0
	for _, k := range keys {
		if _, ok := c.blocks[k]; !ok {
			break
		}
		hits++
	}
	var stored []storedBlock
	var removed []uint64
	for i, k := range keys {
		if el, ok := c.blocks[k]; ok {
			c.lru.MoveToFront(el)
			continue
		}
		c.blocks[k] = c.lru.PushFront(k)
		if c.onChange != nil {
			var parent uint64
			if i > 0 {
				parent = keys[i-1]
			}
			stored = append(stored, storedBlock{key: k, parent: parent, tokens: prompt[i*blockSize : (i+1)*blockSize], lora: lora})
		}
		for c.lru.Len() > c.capacity {
			old := c.lru.Back()
			delete(c.blocks, old.Value.(uint64))
			c.lru.Remove(old)
			removed = append(removed, old.Value.(uint64))
		}
	}
	if c.onChange != nil && (len(stored) > 0 || len(removed) > 0) {
		c.onChange(stored, removed)
	}
	return min(hits*blockSize, len(prompt)-1)
}
