package proxy

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

// pyCases are event data and what openai-python does with them: whether its json.loads reads the
// data, and whether it then raises (a mapping whose "error" is truthy). The outcomes were taken
// from CPython 3.11's json module and openai-python's _raise_streaming_error rule
// (src/openai/_streaming.py).
var pyCases = []struct {
	data   string
	raises bool
}{
	{`{"error": {"message": "boom", "code": 503}}`, true},
	{`{"error": {"message": "boom", "code": 503}, "message": 5}`, true},     // a member of another type beside it
	{`{"error": {"message": "boom"}, "object": 7, "type": {}}`, true},       // two of them
	{`{"error": {"message": "boom"}, "x": NaN}`, true},                      // Python reads NaN
	{`{"error": {"message": "boom"}, "x": -Infinity, "y": Infinity}`, true}, // and the infinities
	{`{"error": true}`, true},
	{`{"error": 1}`, true},
	{`{"error": -0.5}`, true},
	{`{"error": [0]}`, true},
	{`{"error": NaN}`, true}, // NaN is true in Python
	{`{"error": -Infinity}`, true},
	{`{"error": 1e400}`, true}, // inf
	{`{"error": {}}`, false},
	{`{"error": { }}`, false},
	{`{"error": []}`, false},
	{`{"error": ""}`, false},
	{`{"error": 0}`, false},
	{`{"error": -0}`, false},
	{`{"error": 0.0e5}`, false},
	{`{"error": 1e-400}`, false}, // 0.0
	{`{"error": false}`, false},
	{`{"error": null}`, false},
	{`{"ERROR": {"message": "boom"}}`, false}, // names are matched exactly
	{`{"Error": "boom"}`, false},
	{`{"\u0065rror": {"message": "boom"}}`, true}, // escapes decoded
	{`{"erro\u0072": "boom"}`, true},
	{`{"error": {"message": "boom"}, "error": null}`, false}, // the last of a name is kept
	{`{"error": null, "error": {"message": "boom"}}`, true},
	{"  {\"error\": \"boom\"}\t\r\n", true},
	{`["error"]`, false},
	{`"error"`, false},
	{`{"error": {"message": "boom"}, "x": ` + strings.Repeat("[", 950) + strings.Repeat("]", 950) + `}`, true},
	// json.loads fails: the client's stream ends with a decode error, not an APIError
	{`{"error": {"message": "boom"}`, false},
	{`{"error": {"message": "boom"}} x`, false},
	{"{\"error\": {\"message\": \"bo\x01om\"}}", false},
	{`{"error": {"message": "boom"}, "x": 01}`, false},
	{`{"error": {"message": "boom"}, "x": nan}`, false},
	{`{"error": {"message": "boom"}, "x": .5}`, false},
	{`{"error": {"message": "boom"}, "x": "\x"}`, false},
	{`{"error": {"message": "boom"}, "x": "\u12"}`, false},
	{"{\"error\": \"bo\xffom\"}", false}, // not UTF-8: the client's decode fails first
}

// The watch counts an engine's stream as failed exactly where openai-python raises on its error
// event: whatever else the event holds, however the name is spelled, and never for an error
// member Python finds false.
func TestErrorEventReadsTheErrorMemberAsOpenAIPythonDoes(t *testing.T) {
	for _, tc := range pyCases {
		got := errorEvent([]byte(tc.data)) != nil
		if got != tc.raises {
			t.Errorf("%.80q: error event %v, openai-python raises: %v", tc.data, got, tc.raises)
		}
		// And through the watch, as one event of a stream.
		var w watch
		w.see([]byte("data: " + strings.NewReplacer("\r", "", "\n", "").Replace(tc.data) + "\n\n"))
		if (w.err != nil) != tc.raises {
			t.Errorf("%.80q in a stream: error %v, openai-python raises: %v", tc.data, w.err, tc.raises)
		}
	}
	e := errorEvent([]byte(`{"error": {"message": "boom", "code": 503}, "message": 5, "code": "x"}`))
	if e == nil || e.Status != 503 || e.Message != "boom" {
		t.Errorf("status and message from the error member: %+v", e)
	}
	e = errorEvent([]byte(`{"error": {"message": 7, "code": 429}}`))
	if e == nil || e.Status != 429 || e.Message != "" {
		t.Errorf("a message that is no string: %+v", e)
	}
}

// refRaises is openai-python's decision read with encoding/json, for data Go's JSON reads alike:
// no NaN or infinities (Go has none), valid UTF-8. skip says the data is not such.
func refRaises(data []byte) (raises, skip bool) {
	if !utf8.Valid(data) || bytes.Contains(data, []byte("NaN")) || bytes.Contains(data, []byte("Infinity")) {
		return false, true
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if dec.Decode(&v) != nil {
		return false, false
	}
	if strings.Trim(string(data[dec.InputOffset():]), " \t\r\n") != "" {
		return false, false // more than one value: json.loads' "Extra data"
	}
	m, ok := v.(map[string]any)
	if !ok {
		return false, false
	}
	switch e := m["error"].(type) {
	case map[string]any:
		return len(e) > 0, false
	case []any:
		return len(e) > 0, false
	case string:
		return e != "", false
	case json.Number:
		f, err := strconv.ParseFloat(string(e), 64)
		if err != nil && !strings.Contains(err.Error(), "range") {
			return false, false
		}
		return f != 0, false
	case bool:
		return e, false
	}
	return false, false
}

// The Python-flavoured scanner reads any data as encoding/json does, where the two read JSON
// alike: the same data parse, the same error member is found, and its truth is Python's.
func FuzzErrorMemberReadAsPythonDoes(f *testing.F) {
	for _, tc := range pyCases {
		if len(tc.data) <= 256 { // the deep one only slows the fuzzer's minimizing
			f.Add([]byte(tc.data))
		}
	}
	f.Add([]byte(`{"a":[1,{"b":"\"}"}],"error":{"message":"m"},"c":-1.5e+3}`))
	f.Add([]byte(`{"error":"\ud800"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		want, skip := refRaises(data)
		if skip {
			errorEvent(data) // must not panic
			return
		}
		vals, ok := pyMembers(data, "error")
		got := ok && pyTruthy(vals[0])
		if got != want {
			t.Fatalf("%q: scanner says the error member is true: %v (parsed %v); encoding/json: %v", data, got, ok, want)
		}
		if want && parseErrorEvent(data) == nil {
			t.Fatalf("%q: a true error member is no error event", data)
		}
		_, goOK := refParses(data)
		if ok != goOK {
			t.Fatalf("%q: scanner parses it: %v; encoding/json: %v", data, ok, goOK)
		}
	})
}

// refParses says whether encoding/json reads data as one object (whitespace around it).
func refParses(data []byte) (map[string]any, bool) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var m map[string]any
	if dec.Decode(&m) != nil || m == nil {
		return nil, false
	}
	return m, strings.Trim(string(data[dec.InputOffset():]), " \t\r\n") == ""
}
