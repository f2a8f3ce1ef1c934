// Package memo remembers the values of a pure function on the hot path: a lookup is one map
// read, without a lock.
package memo

import (
	"maps"
	"sync/atomic"
)

// Map remembers values by key, up to Max of them (past it, Get makes the value each time). The
// map is never changed once published; a new key publishes a copy, so it suits keys that are
// few and settle (configuration settings, label values). The zero Map is empty and ready.
type Map[K comparable, V any] struct {
	Max int
	m   atomic.Pointer[map[K]V]
}

// Get returns the value for k, made by mk the first time (or every time past Max).
func (c *Map[K, V]) Get(k K, mk func() V) V {
	known := c.m.Load()
	if known != nil {
		if v, ok := (*known)[k]; ok {
			return v
		}
	}
	v := mk()
	for c.Len() < c.Max {
		n := 0
		if known != nil {
			n = len(*known)
		}
		next := make(map[K]V, n+1)
		if known != nil {
			maps.Copy(next, *known)
		}
		next[k] = v
		if c.m.CompareAndSwap(known, &next) {
			break
		}
		known = c.m.Load() // another key was published meanwhile
	}
	return v
}

// Len is how many values are remembered.
func (c *Map[K, V]) Len() int {
	if m := c.m.Load(); m != nil {
		return len(*m)
	}
	return 0
}

// Has reports whether k's value is remembered.
func (c *Map[K, V]) Has(k K) bool {
	m := c.m.Load()
	if m == nil {
		return false
	}
	_, ok := (*m)[k]
	return ok
}
