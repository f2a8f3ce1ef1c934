package kvevents

import (
	"encoding/binary"
	"slices"
	"sync"

	"github.com/cespare/xxhash/v2"
)

// Holder is one place blocks are resident: a worker and, for engines with data parallel ranks,
// a rank.
type Holder struct {
	Worker string
	Rank   int
}

// Index is which token blocks each holder has, from its engine's events. A block's key is
// Baton's own chained hash of its tokens (Keys), never the engine's hash, which depends on
// seeds and salts Baton cannot reproduce; per holder, a map from the engine's hash to Baton's
// key resolves removals and parents. The index holds at most MaxBlocks (holder, block) pairs:
// past it, new blocks are not recorded (counted in Dropped) — an index that knows less routes
// less well, never wrongly.
type Index struct {
	MaxBlocks int

	mu      sync.RWMutex
	blocks  map[uint64][]Holder          // key -> holders
	engine  map[Holder]map[uint64]uint64 // holder -> engine hash -> key
	size    int
	dropped uint64
}

// NewIndex returns an empty index bounded to maxBlocks (holder, block) pairs.
func NewIndex(maxBlocks int) *Index {
	return &Index{MaxBlocks: maxBlocks, blocks: map[uint64][]Holder{}, engine: map[Holder]map[uint64]uint64{}}
}

// root is the key a chain of model (and LoRA adapter) starts from.
func root(model, lora string) uint64 {
	return xxhash.Sum64String(model + "\x00" + lora)
}

// next chains one block of tokens onto parent.
func next(parent uint64, tokens []uint32) uint64 {
	var buf [8 + 4*64]byte
	var d xxhash.Digest
	d.Reset()
	binary.LittleEndian.PutUint64(buf[:8], parent)
	_, _ = d.Write(buf[:8])
	for len(tokens) > 0 {
		n := min(len(tokens), 64)
		for i, t := range tokens[:n] {
			binary.LittleEndian.PutUint32(buf[8+4*i:], t)
		}
		_, _ = d.Write(buf[8 : 8+4*n])
		tokens = tokens[n:]
	}
	return d.Sum64()
}

// Keys returns the keys of the full blocks of tokens for model (and LoRA adapter lora, "" for
// the base model) at the engine's block size: what a request's prompt would find cached.
func Keys(model, lora string, tokens []uint32, blockSize int) []uint64 {
	if blockSize <= 0 {
		return nil
	}
	keys := make([]uint64, len(tokens)/blockSize)
	k := root(model, lora)
	for i := range keys {
		k = next(k, tokens[i*blockSize:(i+1)*blockSize])
		keys[i] = k
	}
	return keys
}

// Applied counts what one batch did to the index.
type Applied struct {
	Stored, Removed, Cleared int
	// Orphans are stored blocks whose parent the index does not know (the chain is unusable:
	// recording it as a root would claim a prefix the engine does not hold); Dropped are blocks
	// past MaxBlocks or without tokens to key them by.
	Orphans, Dropped int
}

// Apply applies a batch of model's events from worker (the batch's DP rank, if any, names the
// holder's rank).
func (x *Index) Apply(worker, model string, b Batch) Applied {
	h := Holder{Worker: worker, Rank: b.DPRank}
	var a Applied
	x.mu.Lock()
	defer x.mu.Unlock()
	for i := range b.Events {
		e := &b.Events[i]
		switch e.Kind {
		case KindStored:
			x.stored(h, model, e, &a)
		case KindRemoved:
			for _, eh := range e.Hashes {
				if x.remove(h, eh) {
					a.Removed++
				}
			}
		case KindCleared:
			x.clear(h)
			a.Cleared++
		}
	}
	return a
}

func (x *Index) stored(h Holder, model string, e *Event, a *Applied) {
	eng := x.engine[h]
	parent := root(model, e.LoRA)
	if e.HasParent {
		p, ok := eng[e.Parent]
		if !ok {
			a.Orphans += len(e.Hashes)
			return
		}
		parent = p
	}
	if e.BlockSize <= 0 || len(e.Tokens) != len(e.Hashes)*e.BlockSize {
		a.Dropped += len(e.Hashes) // e.g. a CPU-tier block announced without its tokens
		return
	}
	if eng == nil {
		eng = map[uint64]uint64{}
		x.engine[h] = eng
	}
	for i, eh := range e.Hashes {
		key := next(parent, e.Tokens[i*e.BlockSize:(i+1)*e.BlockSize])
		parent = key
		if old, ok := eng[eh]; ok {
			if old == key {
				continue // announced again
			}
			x.remove(h, eh)
		}
		if x.size >= x.MaxBlocks {
			a.Dropped++
			x.dropped++
			continue
		}
		eng[eh] = key
		x.blocks[key] = append(x.blocks[key], h)
		x.size++
		a.Stored++
	}
}

// remove forgets that h holds the block the engine calls eh.
func (x *Index) remove(h Holder, eh uint64) bool {
	eng := x.engine[h]
	key, ok := eng[eh]
	if !ok {
		return false
	}
	delete(eng, eh)
	hs := x.blocks[key]
	for i, o := range hs {
		if o == h {
			hs[i] = hs[len(hs)-1]
			hs = hs[:len(hs)-1]
			break
		}
	}
	if len(hs) == 0 {
		delete(x.blocks, key)
	} else {
		x.blocks[key] = hs
	}
	x.size--
	return true
}

func (x *Index) clear(h Holder) {
	for eh := range x.engine[h] {
		x.remove(h, eh)
	}
	delete(x.engine, h)
}

// ClearWorker forgets everything worker holds, on every rank: after its engine restarted, its
// events were lost, or it left the fleet. A stale index is worse than none.
func (x *Index) ClearWorker(worker string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for h := range x.engine {
		if h.Worker == worker {
			x.clear(h)
		}
	}
}

// Match returns, per worker, how many leading blocks of keys one of its holders has resident
// (the longest run from block 0 over its ranks). Workers with none are absent.
func (x *Index) Match(keys []uint64) map[string]int {
	out := map[string]int{}
	for h, n := range x.MatchHolders(keys) {
		out[h.Worker] = max(out[h.Worker], n)
	}
	return out
}

// MatchHolders returns, per holder (a worker's DP rank), how many leading blocks of keys it has
// resident. Holders with none are absent.
func (x *Index) MatchHolders(keys []uint64) map[Holder]int {
	out := map[Holder]int{}
	x.mu.RLock()
	defer x.mu.RUnlock()
	var alive []Holder // the holders of every block so far
	for i, k := range keys {
		hs := x.blocks[k]
		if i == 0 {
			alive = append(alive, hs...)
		} else {
			alive = slices.DeleteFunc(alive, func(h Holder) bool { return !slices.Contains(hs, h) })
		}
		if len(alive) == 0 {
			break
		}
		for _, h := range alive {
			out[h] = i + 1
		}
	}
	return out
}

// Size is the number of (holder, block) pairs the index holds; Dropped the blocks refused past
// MaxBlocks so far.
func (x *Index) Size() (size int, dropped uint64) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.size, x.dropped
}
