package proxy

import (
	"bytes"
	"encoding/json"
	"strconv"
)

// An engine's error event is read as openai-python reads it (src/openai/_streaming.py,
// Stream.__stream__ and _raise_streaming_error): the event's data goes through Python's
// json.loads, and a mapping whose "error" member is truthy ends the stream with an APIError.
// Python's json reads what JSON allows and the constants NaN, Infinity and -Infinity; a
// mapping's member is found by its exact name, escapes decoded, and of two members of one name
// the last is kept. The scanner below reads the data so, without building it: a member of an
// unexpected type beside the error hides nothing, and a member named in another letter case is
// not the error.

// maxPyDepth bounds how deep the scanner follows nested arrays and objects (the watch gives it
// at most maxErrorLine bytes, so it is not reached there). Python's json fails on nesting near
// its recursion limit, which differs by version; data nested deeper than that is still read
// here, so an error is counted rather than missed.
const maxPyDepth = 10000

// pyMembers reads d as one JSON object, as Python's json.loads would, and returns the raw value
// of the last member of each name in names (nil for a name not there). ok is false when d is
// not one object in Python's JSON: then a client's json.loads fails, and no error member counts.
func pyMembers(d []byte, names ...string) (vals [][]byte, ok bool) {
	vals = make([][]byte, len(names))
	i := pyWS(d, 0)
	if i >= len(d) || d[i] != '{' {
		return vals, false
	}
	end, ok := pyObject(d, i, 0, func(key, val []byte) {
		name := key[1 : len(key)-1]
		if bytes.IndexByte(name, '\\') >= 0 {
			name = []byte(pyStr(key)) // escapes decoded once, for every name it is compared with
		}
		for j, n := range names {
			if string(name) == n {
				vals[j] = val
			}
		}
	})
	if !ok || pyWS(d, end) != len(d) {
		return make([][]byte, len(names)), false
	}
	return vals, true
}

// pyWS skips the whitespace Python's json skips: space, tab, LF and CR.
func pyWS(d []byte, i int) int {
	for i < len(d) && (d[i] == ' ' || d[i] == '\t' || d[i] == '\n' || d[i] == '\r') {
		i++
	}
	return i
}

// pyObject scans the object at d[i] ('{'), calling member, when not nil, with each member's raw
// key (its quotes included) and value; it returns the index after the object.
func pyObject(d []byte, i, depth int, member func(key, val []byte)) (int, bool) {
	if depth >= maxPyDepth {
		return 0, false
	}
	i = pyWS(d, i+1)
	if i < len(d) && d[i] == '}' {
		return i + 1, true
	}
	for {
		ks := i
		ke, ok := pyString(d, i)
		if !ok {
			return 0, false
		}
		i = pyWS(d, ke)
		if i >= len(d) || d[i] != ':' {
			return 0, false
		}
		vs := pyWS(d, i+1)
		ve, ok := pyValue(d, vs, depth+1)
		if !ok {
			return 0, false
		}
		if member != nil {
			member(d[ks:ke], d[vs:ve])
		}
		i = pyWS(d, ve)
		if i >= len(d) {
			return 0, false
		}
		switch d[i] {
		case '}':
			return i + 1, true
		case ',':
			i = pyWS(d, i+1)
		default:
			return 0, false
		}
	}
}

// pyValue scans the value at d[i] and returns the index after it.
func pyValue(d []byte, i, depth int) (int, bool) {
	if i >= len(d) {
		return 0, false
	}
	switch c := d[i]; {
	case c == '{':
		return pyObject(d, i, depth, nil)
	case c == '[':
		if depth >= maxPyDepth {
			return 0, false
		}
		i = pyWS(d, i+1)
		if i < len(d) && d[i] == ']' {
			return i + 1, true
		}
		for {
			e, ok := pyValue(d, i, depth+1)
			if !ok {
				return 0, false
			}
			i = pyWS(d, e)
			if i >= len(d) {
				return 0, false
			}
			switch d[i] {
			case ']':
				return i + 1, true
			case ',':
				i = pyWS(d, i+1)
			default:
				return 0, false
			}
		}
	case c == '"':
		return pyString(d, i)
	case c == '-' && i+1 < len(d) && d[i+1] == 'I':
		return pyWord(d, i, "-Infinity")
	case c == '-' || c >= '0' && c <= '9':
		return pyNumber(d, i)
	case c == 't':
		return pyWord(d, i, "true")
	case c == 'f':
		return pyWord(d, i, "false")
	case c == 'n':
		return pyWord(d, i, "null")
	case c == 'N':
		return pyWord(d, i, "NaN")
	case c == 'I':
		return pyWord(d, i, "Infinity")
	}
	return 0, false
}

func pyWord(d []byte, i int, w string) (int, bool) {
	if !bytes.HasPrefix(d[i:], []byte(w)) {
		return 0, false
	}
	return i + len(w), true
}

// pyString scans the string at d[i] ('"') as Python's json does by default (strict): no control
// character inside, and only JSON's escapes.
func pyString(d []byte, i int) (int, bool) {
	if i >= len(d) || d[i] != '"' {
		return 0, false
	}
	for i++; i < len(d); i++ {
		switch c := d[i]; {
		case c == '"':
			return i + 1, true
		case c < 0x20:
			return 0, false
		case c == '\\':
			i++
			if i >= len(d) {
				return 0, false
			}
			switch d[i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			case 'u':
				if i+4 >= len(d) {
					return 0, false
				}
				for _, h := range d[i+1 : i+5] {
					if !isHex(h) {
						return 0, false
					}
				}
				i += 4
			default:
				return 0, false
			}
		}
	}
	return 0, false
}

func isHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' }

// pyNumber scans JSON's number at d[i]: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?.
func pyNumber(d []byte, i int) (int, bool) {
	digits := func(i int) int {
		for i < len(d) && d[i] >= '0' && d[i] <= '9' {
			i++
		}
		return i
	}
	if d[i] == '-' {
		i++
	}
	switch {
	case i < len(d) && d[i] == '0':
		i++
	case i < len(d) && d[i] >= '1' && d[i] <= '9':
		i = digits(i)
	default:
		return 0, false
	}
	if i < len(d) && d[i] == '.' {
		e := digits(i + 1)
		if e == i+1 {
			return 0, false
		}
		i = e
	}
	if i < len(d) && (d[i] == 'e' || d[i] == 'E') {
		i++
		if i < len(d) && (d[i] == '-' || d[i] == '+') {
			i++
		}
		e := digits(i)
		if e == i {
			return 0, false
		}
		i = e
	}
	return i, true
}

// pyStr is the text of a raw JSON string value; "" for a value that is not a string.
func pyStr(v []byte) string {
	if len(v) == 0 || v[0] != '"' {
		return ""
	}
	if bytes.IndexByte(v, '\\') < 0 {
		return string(v[1 : len(v)-1])
	}
	var s string
	_ = json.Unmarshal(v, &s)
	return s
}

// pyTruthy is Python's truth of a raw JSON value, as Python's json reads it: an empty object,
// array or string, a number equal to zero (1e-400 reads as 0.0), false and null are false; NaN
// and the infinities are true.
func pyTruthy(v []byte) bool {
	if len(v) == 0 {
		return false
	}
	switch v[0] {
	case '{', '[':
		return pyWS(v, 1) < len(v)-1
	case '"':
		return len(v) > 2
	case 't', 'N', 'I':
		return true
	case 'f', 'n':
		return false
	case '-':
		if len(v) > 1 && v[1] == 'I' {
			return true
		}
	}
	f, err := strconv.ParseFloat(string(v), 64)
	if err != nil {
		if ne, ok := err.(*strconv.NumError); !ok || ne.Err != strconv.ErrRange {
			return false
		}
	}
	return f != 0
}
