package metrics

import (
	"maps"
	"sync/atomic"
)

// children remembers a vector's children by their label values, for the series every request
// touches: a lookup is one map read, where the vector hashes and checks each value under its
// lock. The map is never changed once published; a new series publishes a copy. Past
// maxChildren series, get asks the vector each time. Only for vectors whose series are never
// deleted (a deleted child would go on counting unseen).
type children[K comparable, M any] struct {
	m atomic.Pointer[map[K]M]
}

// maxChildren bounds each children map.
const maxChildren = 1024

// get returns the child for k, made by child (the vector's WithLabelValues) the first time.
func (c *children[K, M]) get(k K, child func() M) M {
	known := c.m.Load()
	if known != nil {
		if v, ok := (*known)[k]; ok {
			return v
		}
	}
	v := child()
	for known == nil || len(*known) < maxChildren {
		next := make(map[K]M, 1+lenOf(known))
		if known != nil {
			maps.Copy(next, *known)
		}
		next[k] = v
		if c.m.CompareAndSwap(known, &next) {
			break
		}
		known = c.m.Load() // another series was published meanwhile
	}
	return v
}

func lenOf[K comparable, M any](m *map[K]M) int {
	if m == nil {
		return 0
	}
	return len(*m)
}
