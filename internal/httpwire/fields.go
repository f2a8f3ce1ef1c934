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
	if k, ok := n.key(name); ok {
		return k
	}
	return http.CanonicalHeaderKey(string(name))
}

// key returns the one of Keys that is name, if one is.
func (n *Names) key(name []byte) (string, bool) {
	for _, k := range n.Keys {
		if len(k) == len(name) && equalFold(k, name) {
			return k, true
		}
	}
	return "", false
}

// Value returns v as a string, shared where it is one of Values, or the last value of key
// where key is Recent.
func (n *Names) Value(key string, v []byte) string {
	if s, ok := n.value(key, v); ok {
		return s
	}
	return string(v)
}

// value is Value where it has a shared string (of Values or Recent): ok false, and no string,
// where it has none.
func (n *Names) value(key string, v []byte) (s string, ok bool) {
	for _, c := range n.Values {
		if string(v) == c {
			return c, true
		}
	}
	for i, r := range n.Recent {
		if r == key {
			if p := n.last[i].Load(); p != nil && *p == string(v) {
				return *p, true
			}
			s := string(v)
			n.last[i].Store(&s)
			return s, true
		}
	}
	return "", false
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

// Recall remembers the first fields of one peer's last head, so that the next head from the same
// peer — a kept-alive connection's next answer, which an engine sends with the same names, most
// of them with the same values — takes its names and values from it instead of allocating them
// where Names has no shared string: an engine's own header names, a value that stays the same.
// A string is taken from it only when the bytes are the same, so nothing of one message's head
// reaches another's but what that head itself says. It is for one goroutine at a time (a
// connection's reader).
type Recall struct {
	f [recallFields]struct{ k, v string }
}

// recallFields bounds what a Recall keeps: engines answer with fewer fields than this. Only
// names and values of at most recallBytes are kept, so that what a connection holds from its last
// head stays small, and an open stream holds nothing large of the head it relayed already.
const (
	recallFields = 8
	recallBytes  = 64
)

// RecallField is r's Field with r made on the first field whose name Names does not have: a peer
// whose heads Names covers (vLLM's and SGLang's servers) costs its connection no Recall.
func RecallField(n *Names, r **Recall, i int, name, v []byte) (key, value string) {
	if *r == nil {
		k, known := n.key(name)
		if known {
			if s, ok := n.value(k, v); ok {
				return k, s
			}
			return k, string(v)
		}
		*r = new(Recall)
	}
	return (*r).Field(n, i, name, v)
}

// Field returns the canonical name and the value of a head's i-th field, name: v, from n, else
// from what the same peer's last head had, and remembers them for the next head.
func (r *Recall) Field(n *Names, i int, name, v []byte) (key, value string) {
	key, known := n.key(name)
	if !known {
		key = r.name(name)
	}
	value, shared := n.value(key, v)
	if !shared {
		value = r.value(key, v)
	}
	if i < recallFields {
		r.f[i].k, r.f[i].v = "", ""
		if len(key) <= recallBytes && len(value) <= recallBytes {
			r.f[i].k, r.f[i].v = key, value
		}
	}
	return key, value
}

// name is the canonical name kept for name, else a new one.
func (r *Recall) name(name []byte) string {
	for _, f := range r.f {
		if len(f.k) == len(name) && equalFold(f.k, name) {
			return f.k
		}
	}
	return http.CanonicalHeaderKey(string(name))
}

// value is the value of key kept with v's bytes, else a new one.
func (r *Recall) value(key string, v []byte) string {
	for _, f := range r.f {
		if f.k == key && f.v == string(v) {
			return f.v
		}
	}
	return string(v)
}
