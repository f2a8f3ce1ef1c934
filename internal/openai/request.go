package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
)

// Request is the small typed view of a client body that Baton routes on. The raw bytes stay the
// source of truth: Baton forwards them and edits only the members it owns.
type Request struct {
	// Body is the client's bytes, less the top-level members Baton owns (OwnedFields), which
	// never reach an engine from a client.
	Body   []byte
	Model  string // Top-level "model"; empty when absent or null.
	Stream bool   // Top-level "stream" is true, as the engines read it (LaxTrue).
	N      int    // Top-level "n"; 0 when absent.
	// ReturnLogprob is SGLang /generate's top-level "return_logprob" is true.
	ReturnLogprob bool

	// members indexes Body's top-level members, from the one scan ParseRequest made: Get reads
	// a member without scanning the body again. It starts in fixed (a request body has about a
	// dozen members), so that indexing allocates nothing more for most.
	members []indexed
	fixed   [12]indexed
}

// indexed is one top-level member of a parsed body: its key (the body's own bytes, or its
// unescaped copy) and where its value lies.
type indexed struct {
	key        []byte
	start, end int
}

// Get returns the raw bytes of the top-level member key of the parsed body, from the index of
// the scan that parsed it; a Request not made by ParseRequest is scanned.
func (r *Request) Get(key string) ([]byte, bool) {
	if r.members == nil {
		return Get(r.Body, key)
	}
	for _, m := range r.members {
		if string(m.key) == key {
			return r.Body[m.start:m.end], true
		}
	}
	return nil, false
}

// Misspelled is Misspelled of the parsed body's top level, read from the index of the scan that
// parsed it (no second scan).
func (r *Request) Misspelled(keys ...string) string {
	if r.members == nil {
		return Misspelled(r.Body, keys...)
	}
	for _, m := range r.members {
		if k := misspelled(m.key, keys); k != "" {
			return k
		}
	}
	return ""
}

// OwnedFields are the top-level request members that steer the engines' KV handoff. Only Baton
// may set them: a client's kv_transfer_params would make a vLLM engine with a KV connector pin
// blocks for minutes (do_remote_decode) or connect to a host of the client's choosing
// (do_remote_prefill); SGLang's bootstrap and DP rank fields would send KV to, or wait on, a
// rendezvous the client names. "priority" is the engines' scheduling priority: on an engine
// scheduling by it a client's value would outrank every class and every tenant's ceiling; Baton
// writes its own (the request's class) for workers marked forward_priority. ParseRequest removes
// them from every client body, on every route.
var OwnedFields = []string{
	"kv_transfer_params",
	"bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
	"routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank",
	"priority",
}

// SetBody makes b, an edit of r's body by Baton (a field it set), r's body, and indexes it again,
// so that Get reads the new bytes.
func (r *Request) SetBody(b []byte) error {
	nr, err := ParseRequest(b)
	if err != nil {
		return err
	}
	r.Body, r.Model, r.Stream, r.N, r.ReturnLogprob = nr.Body, nr.Model, nr.Stream, nr.N, nr.ReturnLogprob
	r.members = append(r.fixed[:0], nr.members...)
	return nil
}

// ParseRequest validates body as a JSON object and reads the members Baton routes on in one pass
// over the top level, removing those Baton owns (OwnedFields; the rest of the bytes unchanged).
// Errors are client errors (HTTP 400).
func ParseRequest(body []byte) (*Request, error) {
	if !Valid(body) {
		return nil, fmt.Errorf("request body is not valid JSON")
	}
	r := &Request{Body: body}
	r.members = r.fixed[:0]
	var perr error
	var owned []string // the spellings of the owned members present
	var seen repeats
	err := eachMember(body, func(key []byte, m member) bool {
		if seen.in(r.members, key) {
			perr = &DuplicateKeyError{Key: truncateKey(string(key))}
			return false
		}
		r.members = append(r.members, indexed{key: key, start: m.valStart, end: m.valEnd})
		raw := body[m.valStart:m.valEnd]
		switch string(key) {
		case "model":
			if bytes.Equal(raw, []byte("null")) {
				return true
			}
			if len(raw) >= 2 && raw[0] == '"' && bytes.IndexByte(raw, '\\') < 0 {
				r.Model = string(raw[1 : len(raw)-1]) // no escapes: the bytes are the string
				return true
			}
			if err := json.Unmarshal(raw, &r.Model); err != nil {
				perr = fmt.Errorf(`"model" must be a string`)
				return false
			}
		case "stream":
			r.Stream = LaxTrue(raw)
		case "return_logprob":
			r.ReturnLogprob = bytes.Equal(raw, []byte("true"))
		case "n":
			if bytes.Equal(raw, []byte("null")) {
				return true
			}
			if err := json.Unmarshal(raw, &r.N); err != nil || r.N < 0 {
				perr = fmt.Errorf(`"n" must be a positive integer`)
				return false
			}
		case "sampling_params", "stream_options":
			// Baton reads members of these (max_new_tokens, n, include_usage): one named twice
			// would be read one way by Baton and another by the engine.
			if k, dup := nestedDuplicate(raw); dup {
				perr = &DuplicateKeyError{Key: truncateKey(string(key) + "." + k)}
				return false
			}
		default:
			if isOwned(key) {
				owned = append(owned, string(key))
			}
		}
		return true
	})
	if err != nil {
		return nil, err
	}
	if perr != nil {
		return nil, perr
	}
	if len(owned) > 0 {
		if r.Body, err = Edit(body, nil, owned); err != nil {
			return nil, err
		}
		r.members = r.members[:0] // the edit moved the members: index the new body
		_ = eachMember(r.Body, func(key []byte, m member) bool {
			r.members = append(r.members, indexed{key: key, start: m.valStart, end: m.valEnd})
			return true
		})
	}
	return r, nil
}

// DuplicateKeyError is a body that names a top-level member twice (Key: the member, at most 64
// bytes of it). JSON parsers disagree on
// which one counts (Baton's readers took the first or the last, Python's json — the engines' —
// the last): a limit Baton checks on one could be bypassed by the other reaching the engine.
type DuplicateKeyError struct{ Key string }

func (e *DuplicateKeyError) Error() string {
	return fmt.Sprintf("the request body names the member %q more than once", e.Key)
}

// truncateKey bounds a key quoted back to the client.
func truncateKey(k string) string { return Clip(k, 64) }

// Clip bounds what a client sent before an answer or a log line quotes it: at most n bytes,
// marked cut.
func Clip(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

// repeats says whether a key is already among the members indexed so far, in any letter case
// (an engine decoding JSON without regard to case reads "MAX_TOKENS" as max_tokens): a look along the
// index for the usual dozen members, a map of it past 16, so that a body of many members costs
// linear time.
type repeats struct{ many map[string]struct{} }

// in reports whether key is among members (the keys before it).
func (d *repeats) in(members []indexed, key []byte) bool {
	if len(members) <= 16 {
		for _, m := range members {
			if bytes.EqualFold(m.key, key) {
				return true
			}
		}
		return false
	}
	if d.many == nil {
		d.many = make(map[string]struct{}, 2*len(members))
		for _, m := range members[:len(members)-1] {
			d.many[string(bytes.ToLower(m.key))] = struct{}{}
		}
	}
	d.many[string(bytes.ToLower(members[len(members)-1].key))] = struct{}{} // the member added since the last look
	_, ok := d.many[string(bytes.ToLower(key))]
	return ok
}

// OwnedIn names the first top-level member of body that Baton owns (OwnedFields, in any letter
// case), "" for none or for a body that is no JSON object.
func OwnedIn(body []byte) string {
	var found string
	_ = eachMember(body, func(k []byte, _ member) bool {
		if isOwned(k) {
			found = truncateKey(string(k))
		}
		return found == ""
	})
	return found
}

// isOwned reports whether key is an owned member in any letter case: an engine decoding JSON
// without regard to case (Go's encoding/json does) reads "PRIORITY" as priority.
func isOwned(key []byte) bool {
	for _, f := range OwnedFields {
		if len(key) == len(f) && bytes.EqualFold(key, []byte(f)) {
			return true
		}
	}
	return false
}

// nestedDuplicate reports a key named twice (in any letter case, escaped or not) in the object
// raw, or in any object of the array raw; other values have none.
func nestedDuplicate(raw []byte) (string, bool) {
	var dup string
	check := func(obj []byte) {
		var keys [][]byte
		_ = eachMember(obj, func(k []byte, _ member) bool {
			for _, p := range keys {
				if bytes.EqualFold(p, k) {
					dup = string(k)
					return false
				}
			}
			keys = append(keys, k)
			return len(keys) < 1024 || dup != ""
		})
	}
	switch {
	case len(raw) > 0 && raw[0] == '{':
		check(raw)
	case len(raw) > 0 && raw[0] == '[':
		_ = eachElement(raw, func(el []byte) bool {
			if len(el) > 0 && el[0] == '{' {
				check(el)
			}
			return dup == ""
		})
	}
	return dup, dup != ""
}

// LaxTrue reports whether a JSON value is true as vLLM's and SGLang's request models read a
// boolean (pydantic's lax mode): true, 1, and the strings "1", "on", "t", "true", "y", "yes" in
// any letter case — a client's "stream": 1 is a stream to the engine, and so to Baton.
func LaxTrue(raw []byte) bool {
	raw = bytes.TrimSpace(raw)
	switch string(raw) {
	case "true", "1":
		return true
	}
	if len(raw) < 2 || raw[0] != '"' || raw[len(raw)-1] != '"' {
		return false
	}
	switch strings.ToLower(string(raw[1 : len(raw)-1])) {
	case "1", "on", "t", "true", "y", "yes":
		return true
	}
	return false
}
