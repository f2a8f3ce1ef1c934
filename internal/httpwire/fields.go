package httpwire

import (
	"net/http"
	"sync/atomic"
)

// Names are the header names and values a side meets on almost every message, turned into
// shared strings without allocating.
type Names struct {
	Keys   []string // canonical header names
	Values []string // exact values
	// Recent are names whose value changes seldom and is the same on most messages of a
	// moment (an engine's Date, once a second): the last value seen is shared.
	Recent []string
	last   []atomic.Pointer[string] // by Recent's index
}

// NewNames returns Names of keys, values and recent (each of recent must be in keys).
func NewNames(keys, values, recent []string) *Names {
	return &Names{Keys: keys, Values: values, Recent: recent, last: make([]atomic.Pointer[string], len(recent))}
}

// Key returns name in net/http's canonical form.
func (n *Names) Key(name []byte) string {
	for _, k := range n.Keys {
		if len(k) == len(name) && equalFold(k, name) {
			return k
		}
	}
	return http.CanonicalHeaderKey(string(name))
}

// Value returns v as a string, shared where it is one of Values, or the last value of key
// where key is Recent.
func (n *Names) Value(key string, v []byte) string {
	for _, c := range n.Values {
		if string(v) == c {
			return c
		}
	}
	for i, r := range n.Recent {
		if r == key {
			if p := n.last[i].Load(); p != nil && *p == string(v) {
				return *p
			}
			s := string(v)
			n.last[i].Store(&s)
			return s
		}
	}
	return string(v)
}

func equalFold(s string, b []byte) bool {
	for i := 0; i < len(b); i++ {
		x, y := s[i], b[i]
		if x == y {
			continue
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

// Fields builds a message's header: a name's first value is held in a slice that shares one
// backing array with the others' (capped at its one element, so that appending to it copies),
// instead of a slice of its own per name.
type Fields struct {
	H    http.Header
	vals []string
}

// NewFields returns Fields building a header of about n names.
func NewFields(n int) Fields {
	return Fields{H: make(http.Header, n), vals: make([]string, 0, n)}
}

// Add adds the value v of the canonical name k.
func (f *Fields) Add(k, v string) {
	if old, ok := f.H[k]; ok {
		f.H[k] = append(old, v)
		return
	}
	if len(f.vals) == cap(f.vals) {
		f.vals = make([]string, 0, max(8, cap(f.vals)))
	}
	f.vals = append(f.vals, v)
	n := len(f.vals)
	f.H[k] = f.vals[n-1 : n : n]
}
