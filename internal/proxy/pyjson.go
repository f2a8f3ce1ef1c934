package proxy

import (
	"bytes"
	"encoding/json"
	"strconv"

	"github.com/baton-llm/baton/internal/openai"
)

// An engine's error event is read as openai-python reads it (src/openai/_streaming.py,
// Stream.__stream__ and _raise_streaming_error): the event's data goes through Python's
// json.loads, and a mapping whose "error" member is truthy ends the stream with an APIError.
// Python's json reads what JSON allows and the constants NaN, Infinity and -Infinity; a
// mapping's member is found by its exact name, escapes decoded, and of two members of one name
// the last is kept. pyMembers reads the data so (openai.ValidPython, then openai.Members),
// without building it: a member of an unexpected type beside the error hides nothing, and a
// member named in another letter case is not the error.

// jsonSpace is the whitespace JSON and Python's json skip.
const jsonSpace = " \t\r\n"

// pyMembers reads d as one JSON object, as Python's json.loads would, and returns the raw value
// of the last member of each name in names (nil for a name not there), names matched exactly,
// escapes decoded. ok is false when d is not one object in Python's JSON: then a client's
// json.loads fails, and no error member counts.
func pyMembers(d []byte, names ...string) (vals [][]byte, ok bool) {
	vals = make([][]byte, len(names))
	if t := bytes.TrimLeft(d, jsonSpace); len(t) == 0 || t[0] != '{' || !openai.ValidPython(d) {
		return vals, false
	}
	_ = openai.Members(d, func(key []byte, start, end int) bool {
		for j, n := range names {
			if string(key) == n {
				vals[j] = d[start:end]
			}
		}
		return true
	})
	return vals, true
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
		return len(bytes.TrimLeft(v[1:], jsonSpace)) > 1 // more than the closing bracket
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
