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

// Set returns a copy of the JSON object body with the top-level member key set to the raw JSON
// value val: an existing member keeps its position (duplicates after the first are removed), a
// new one is appended. Every other byte is unchanged. val must be valid JSON.
func Set(body []byte, key string, val []byte) ([]byte, error) {
	return edit(body, key, val, true)
}

// Delete returns a copy of body without the top-level member key (all occurrences). Every other
// byte is unchanged.
func Delete(body []byte, key string) ([]byte, error) {
	return edit(body, key, nil, false)
}

func edit(body []byte, key string, val []byte, set bool) ([]byte, error) {
	var hits []member
	var last member
	n := 0
	err := eachMember(body, func(k []byte, m member) bool {
		if string(k) == key {
			hits = append(hits, m)
		}
		last = m
		n++
		return true
	})
	if err != nil {
		return nil, err
	}
	out := make([]byte, 0, len(body)+len(key)+len(val)+8)
	if len(hits) == 0 {
		if !set {
			return append(out, body...), nil
		}
		// Append after the last member, or into the empty object.
		var at int
		if n == 0 {
			at = bytes.IndexByte(body, '{') + 1
		} else {
			at = last.valEnd
		}
		out = append(out, body[:at]...)
		if n > 0 {
			out = append(out, ',')
		}
		out = appendKey(out, key)
		out = append(out, val...)
		return append(out, body[at:]...), nil
	}
	// Replace the first hit's value, remove later hits (and their separating comma).
	pos := 0
	for idx, h := range hits {
		if idx == 0 && set {
			out = append(out, body[pos:h.valStart]...)
			out = append(out, val...)
			pos = h.valEnd
			continue
		}
		start, end := memberSpan(body, h)
		out = append(out, body[pos:start]...)
		pos = end
	}
	return append(out, body[pos:]...), nil
}

// memberSpan returns the byte range to cut to remove member m together with one adjoining comma.
func memberSpan(body []byte, m member) (start, end int) {
	// Prefer removing the comma that precedes the member.
	j := m.keyStart - 1
	for j >= 0 && isWS(body[j]) {
		j--
	}
	if j >= 0 && body[j] == ',' {
		return j, m.valEnd
	}
	// First member: remove the comma that follows, and the whitespace after it.
	k := skipWS(body, m.valEnd)
	if k < len(body) && body[k] == ',' {
		return m.keyStart, skipWS(body, k+1)
	}
	return m.keyStart, m.valEnd
}

func isWS(c byte) bool { return c == ' ' || c == '\t' || c == '\r' || c == '\n' }

func appendKey(out []byte, key string) []byte {
	k, _ := json.Marshal(key)
	out = append(out, k...)
	return append(out, ':')
}
