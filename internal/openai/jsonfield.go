package openai

import (
	"bytes"
	"encoding/json"
	"errors"
)

// ErrNotObject is returned when a body is valid JSON but not a JSON object.
var ErrNotObject = errors.New("request body must be a JSON object")

// errMalformed is returned by the scanner for bytes that are not valid JSON.
var errMalformed = errors.New("malformed JSON")

// member is one top-level member of a JSON object, as offsets into the raw bytes.
type member struct {
	keyStart int // index of the key's opening quote
	valStart int // index of the value's first byte
	valEnd   int // index just past the value's last byte
}

// eachMember calls fn for every top-level member of the JSON object in b, in order, with the
// unescaped key. It stops early when fn returns false. It does not allocate for keys without
// escapes. It checks structure only as far as it needs to; callers validate with json.Valid.
func eachMember(b []byte, fn func(key []byte, m member) bool) error {
	i := skipWS(b, 0)
	if i >= len(b) {
		return errMalformed
	}
	if b[i] != '{' {
		return ErrNotObject
	}
	i = skipWS(b, i+1)
	if i < len(b) && b[i] == '}' {
		return nil
	}
	for {
		if i >= len(b) || b[i] != '"' {
			return errMalformed
		}
		keyStart := i
		keyEnd, err := skipString(b, i)
		if err != nil {
			return err
		}
		key := b[keyStart+1 : keyEnd-1]
		if bytes.IndexByte(key, '\\') >= 0 {
			var s string
			if err := json.Unmarshal(b[keyStart:keyEnd], &s); err != nil {
				return errMalformed
			}
			key = []byte(s)
		}
		i = skipWS(b, keyEnd)
		if i >= len(b) || b[i] != ':' {
			return errMalformed
		}
		i = skipWS(b, i+1)
		valEnd, err := skipValue(b, i)
		if err != nil {
			return err
		}
		if !fn(key, member{keyStart: keyStart, valStart: i, valEnd: valEnd}) {
			return nil
		}
		i = skipWS(b, valEnd)
		if i >= len(b) {
			return errMalformed
		}
		switch b[i] {
		case ',':
			i = skipWS(b, i+1)
		case '}':
			return nil
		default:
			return errMalformed
		}
	}
}

func skipWS(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\r', '\n':
			i++
		default:
			return i
		}
	}
	return i
}

// skipString returns the index just past the string starting at b[i] == '"'. It finds the closing quote with bytes.IndexByte: a quote preceded by an odd
// run of backslashes is escaped and skipped.
func skipString(b []byte, i int) (int, error) {
	j := i + 1
	for {
		k := bytes.IndexByte(b[j:], '"')
		if k < 0 {
			return 0, errMalformed
		}
		j += k
		n := 0
		for p := j - 1; p > i && b[p] == '\\'; p-- {
			n++
		}
		if n%2 == 0 {
			return j + 1, nil
		}
		j++
	}
}

// skipValue returns the index just past the JSON value starting at b[i].
func skipValue(b []byte, i int) (int, error) {
	if i >= len(b) {
		return 0, errMalformed
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				end, err := skipString(b, j)
				if err != nil {
					return 0, err
				}
				j = end - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, errMalformed
	default:
		j := i
		for j < len(b) {
			switch b[j] {
			case ',', '}', ']', ' ', '\t', '\r', '\n':
				if j == i {
					return 0, errMalformed
				}
				return j, nil
			}
			j++
		}
		if j == i {
			return 0, errMalformed
		}
		return j, nil
	}
}

// ArrayLen counts the elements of the JSON array raw, stopping once it has counted limit, and
// returns the first byte of its first element ('"', '[', a digit, ...). It returns 0 for
// anything that is not a non-empty array. It does not allocate.
func ArrayLen(raw []byte, limit int) (n int, first byte) {
	i := skipWS(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return 0, 0
	}
	i = skipWS(raw, i+1)
	if i >= len(raw) || raw[i] == ']' {
		return 0, 0
	}
	first = raw[i]
	for n < limit {
		end, err := skipValue(raw, i)
		if err != nil {
			return n, first
		}
		n++
		i = skipWS(raw, end)
		if i >= len(raw) || raw[i] != ',' {
			return n, first
		}
		i = skipWS(raw, i+1)
	}
	return n, first
}

// Members calls fn for every top-level member of the JSON object body, in order, with its
// unescaped key and the bounds of its value in body (body[start:end]), until fn returns false.
// It reports a body that is not a well-formed object as far as it read; it does not validate
// (Valid does) and does not allocate for keys without escapes.
func Members(body []byte, fn func(key []byte, start, end int) bool) error {
	return eachMember(body, func(k []byte, m member) bool { return fn(k, m.valStart, m.valEnd) })
}

// Get returns the raw bytes of the top-level member key of the JSON object body.
func Get(body []byte, key string) (raw []byte, ok bool) {
	_ = eachMember(body, func(k []byte, m member) bool {
		if string(k) == key {
			raw, ok = body[m.valStart:m.valEnd], true
			return false
		}
		return true
	})
	return raw, ok
}

// GetLast returns the raw bytes of the last top-level member key of the JSON object body (before
// any point where body is malformed): the one encoding/json, Python's json and JSON.parse keep
// when a key repeats, so what a client will read.
func GetLast(body []byte, key string) (raw []byte, ok bool) {
	_ = eachMember(body, func(k []byte, m member) bool {
		if string(k) == key {
			raw, ok = body[m.valStart:m.valEnd], true
		}
		return true
	})
	return raw, ok
}

// Field is one top-level member to set: its key and raw JSON value.
type Field struct {
	Key   string
	Value []byte
}

// Set returns a copy of the JSON object body with the top-level member key set to the raw JSON
// value val: an existing member keeps its position (duplicates after the first are removed), a
// new one is appended. Every other byte is unchanged. val must be valid JSON.
func Set(body []byte, key string, val []byte) ([]byte, error) {
	return Edit(body, []Field{{key, val}}, nil)
}

// Delete returns body without the top-level member key (all occurrences), as Edit does. Every
// other byte is unchanged.
func Delete(body []byte, key string) ([]byte, error) {
	return Edit(body, nil, []string{key})
}

// Edit returns a copy of the JSON object body with sets applied as Set does and the members
// named in dels removed, in one pass over the body. Every other byte is unchanged. When there
// is nothing to change it returns body itself.
func Edit(body []byte, sets []Field, dels []string) ([]byte, error) {
	var (
		members [16]keptMember // on the stack for most bodies
		kept    = members[:0]  // the members written out, in order
		span    objectSpan
		removed bool
	)
	found := make([]bool, len(sets)) // sets[i] replaced an existing member
	err := eachMember(body, func(k []byte, m member) bool {
		span.add(m)
		for i, f := range sets {
			if string(k) == f.Key {
				if !found[i] {
					found[i] = true
					kept = append(kept, keptMember{m: m, val: f.Value})
				}
				return true
			}
		}
		for _, d := range dels {
			if string(k) == d {
				removed = true
				return true
			}
		}
		kept = append(kept, keptMember{m: m})
		return true
	})
	if err != nil {
		return nil, err
	}
	if len(sets) == 0 && !removed {
		return body, nil // nothing to change: no copy
	}
	return writeEdited(body, sets, kept, found, span), nil
}

// keptMember is a member Edit writes out, with its replacement value or nil for the original.
type keptMember struct {
	m   member
	val []byte
}

// objectSpan is where an object's members start and end.
type objectSpan struct {
	all         int // members seen
	first, last member
}

func (s *objectSpan) add(m member) {
	if s.all == 0 {
		s.first = m
	}
	s.last = m
	s.all++
}

// writeEdited builds the edited object: the kept members with their original separators where
// nothing between them was removed, then the sets that replaced nothing (found[i] false).
func writeEdited(body []byte, sets []Field, kept []keptMember, found []bool, span objectSpan) []byte {
	size := len(body)
	for _, f := range sets {
		size += len(f.Key) + len(f.Value) + 4
	}
	out := make([]byte, 0, size)
	var head, tail []byte // bytes before the first member and after the last
	if span.all == 0 {
		i := bytes.IndexByte(body, '{') + 1
		head, tail = body[:i], body[i:]
	} else {
		head, tail = body[:span.first.keyStart], body[span.last.valEnd:]
	}
	out = append(out, head...)
	prevEnd := -1
	for i, k := range kept {
		if i > 0 {
			// The separator that preceded this member, when its predecessor was kept too.
			if prevEnd >= 0 && !changedBetween(body, prevEnd, k.m.keyStart) {
				out = append(out, body[prevEnd:k.m.keyStart]...)
			} else {
				out = append(out, ',')
			}
		}
		out = append(out, body[k.m.keyStart:k.m.valStart]...)
		if k.val != nil {
			out = append(out, k.val...)
		} else {
			out = append(out, body[k.m.valStart:k.m.valEnd]...)
		}
		prevEnd = k.m.valEnd
	}
	for i, f := range sets {
		if !found[i] {
			if len(out) > len(head) {
				out = append(out, ',')
			}
			out = appendKey(out, f.Key)
			out = append(out, f.Value...)
		}
	}
	return append(out, tail...)
}

// changedBetween reports whether body[from:to] is more than one separator (whitespace and a
// single comma), i.e. whether members were removed in between.
func changedBetween(body []byte, from, to int) bool {
	commas := 0
	for _, c := range body[from:to] {
		switch c {
		case ',':
			commas++
		case ' ', '\t', '\r', '\n':
		default:
			return true
		}
	}
	return commas != 1
}

// appendKey appends key as encoding/json writes a string, then a colon: a key of printable ASCII
// that json.Marshal would not escape (the keys Baton sets) is copied as it is, any other is
// marshalled (FuzzAppendKey holds the two to the same bytes).
func appendKey(out []byte, key string) []byte {
	if plainKey(key) {
		out = append(out, '"')
		out = append(out, key...)
		return append(out, '"', ':')
	}
	k, _ := json.Marshal(key)
	out = append(out, k...)
	return append(out, ':')
}

// plainKey says whether json.Marshal writes s between quotes unchanged: printable ASCII without
// a quote, a backslash or the characters it escapes for HTML.
func plainKey(s string) bool {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c < 0x20 || c > 0x7e, c == '"', c == '\\', c == '<', c == '>', c == '&':
			return false
		}
	}
	return true
}

// eachElement calls fn with the raw bytes of each element of the JSON array raw, in order,
// until fn returns false; anything that is not an array has none.
func eachElement(raw []byte, fn func(el []byte) bool) error {
	i := skipWS(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return ErrNotObject
	}
	i = skipWS(raw, i+1)
	if i < len(raw) && raw[i] == ']' {
		return nil
	}
	for i < len(raw) {
		end, err := skipValue(raw, i)
		if err != nil {
			return err
		}
		if !fn(raw[i:end]) {
			return nil
		}
		i = skipWS(raw, end)
		if i >= len(raw) || raw[i] != ',' {
			return nil
		}
		i = skipWS(raw, i+1)
	}
	return nil
}

// Misspelled returns the first member of the JSON object obj whose key is one of keys in
// another letter case ("MAX_TOKENS" for max_tokens), "" when none is: an engine decoding JSON
// without regard to case reads it as the key, one that does not ignores it.
func Misspelled(obj []byte, keys ...string) string {
	var found string
	_ = eachMember(obj, func(k []byte, _ member) bool {
		found = misspelled(k, keys)
		return found == ""
	})
	return found
}

// misspelled is k when it is one of keys in another letter case, else "".
func misspelled(k []byte, keys []string) string {
	for _, key := range keys {
		if len(k) == len(key) && string(k) != key && bytes.EqualFold(k, []byte(key)) {
			return string(k)
		}
	}
	return ""
}

// DecodedBool returns what encoding/json decodes from the JSON value b into a struct's bool
// field named key (a plain name, as a tag without options gives it), and ok false where it
// would fail. Its members match key as encoding/json
// matches them (the unescaped key equal to key without regard to case), each in turn: the last
// true or false decides, a null leaves the field as it was, any other value fails; b must be
// valid JSON and an object (or null, which decodes to nothing). It does not allocate for keys
// without escapes.
func DecodedBool(b []byte, key string) (v, ok bool) {
	if !Valid(b) {
		return false, false
	}
	i := skipWS(b, 0)
	if b[i] != '{' {
		return false, b[i] == 'n' // null decodes to nothing; a string, number, array or bool fails
	}
	ok = true
	_ = eachMember(b, func(k []byte, m member) bool {
		if !bytes.EqualFold(k, []byte(key)) {
			return true
		}
		switch b[m.valStart] {
		case 't':
			v = true
		case 'f':
			v = false
		case 'n':
		default:
			ok = false
		}
		return true
	})
	return v && ok, ok
}
