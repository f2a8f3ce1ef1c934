package openai

import (
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"
)

func TestGet(t *testing.T) {
	body := []byte(` { "model" : "m\u0031", "seed":9007199254740993, "nested":{"model":"x"}, "s":"a\"b}", "arr":[1,{"k":"]"}], "t":true } `)
	tests := []struct {
		key  string
		want string
		ok   bool
	}{
		{"model", `"m\u0031"`, true},
		{"seed", `9007199254740993`, true},
		{"nested", `{"model":"x"}`, true},
		{"s", `"a\"b}"`, true},
		{"arr", `[1,{"k":"]"}]`, true},
		{"t", `true`, true},
		{"absent", ``, false},
	}
	for _, tc := range tests {
		got, ok := Get(body, tc.key)
		if ok != tc.ok || string(got) != tc.want {
			t.Errorf("Get(%q) = %q, %v; want %q, %v", tc.key, got, ok, tc.want, tc.ok)
		}
	}
}

func TestGetEscapedKey(t *testing.T) {
	got, ok := Get([]byte(`{"mod\u0065l":"a"}`), "model")
	if !ok || string(got) != `"a"` {
		t.Fatalf("got %q %v, want \"a\" true", got, ok)
	}
}

func TestSetDelete(t *testing.T) {
	tests := []struct {
		name, in, key, val, want string
		del                      bool
	}{
		{"replace keeps position", `{"a":1, "b" : 2,"c":3}`, "b", `"x"`, `{"a":1, "b" : "x","c":3}`, false},
		{"append", `{"a":1}`, "b", `[1]`, `{"a":1,"b":[1]}`, false},
		{"append empty", `{ }`, "b", `null`, `{"b":null }`, false},
		{"duplicates collapse", `{"b":1,"a":2,"b":3}`, "b", `4`, `{"b":4,"a":2}`, false},
		{"delete middle", `{"a":1,"b":2,"c":3}`, "b", ``, `{"a":1,"c":3}`, true},
		{"delete first", `{"b":2, "c":3}`, "b", ``, `{"c":3}`, true},
		{"delete only", `{"b":2}`, "b", ``, `{}`, true},
		{"delete absent", `{"a":1}`, "b", ``, `{"a":1}`, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var got []byte
			var err error
			if tc.del {
				got, err = Delete([]byte(tc.in), tc.key)
			} else {
				got, err = Set([]byte(tc.in), tc.key, []byte(tc.val))
			}
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want {
				t.Errorf("got %s, want %s", got, tc.want)
			}
			if !json.Valid(got) {
				t.Errorf("result is not valid JSON: %s", got)
			}
		})
	}
}

func TestParseRequest(t *testing.T) {
	r, err := ParseRequest([]byte(`{"stream":true,"model":"llama","x":{"model":"no"}}`))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(Request{Body: r.Body, Model: "llama", Stream: true}, *r); diff != "" {
		t.Errorf("ParseRequest (-want +got):\n%s", diff)
	}
	for _, bad := range []string{`{"model":`, `[1,2]`, `"s"`, `{"model":3}`, ``} {
		if _, err := ParseRequest([]byte(bad)); err == nil {
			t.Errorf("ParseRequest(%q): want error", bad)
		}
	}
}

// FuzzMembers checks the scanner against encoding/json on every valid object: same keys, same
// values, and Set/Delete keep the document valid.
func FuzzMembers(f *testing.F) {
	for _, s := range []string{`{"a":1}`, `{"model":"x","n":[1,{"b":"}"}],"s":"\\\""}`, `{}`, ` {"a" : null , "a":true}`, `{"stream":true}`, `{"a":1,"stream":2}`, `{"stream":1, "a":2 ,"model":3}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var want map[string]json.RawMessage
		// encoding/json rewrites invalid UTF-8 in keys, so it is no oracle for those bytes.
		if !utf8.Valid(b) || !json.Valid(b) || json.Unmarshal(b, &want) != nil || want == nil {
			return
		}
		got := map[string]json.RawMessage{}
		if err := eachMember(b, func(k []byte, m member) bool {
			got[string(k)] = json.RawMessage(b[m.valStart:m.valEnd])
			return true
		}); err != nil {
			t.Fatalf("eachMember(%q): %v", b, err)
		}
		if len(got) != len(want) {
			t.Fatalf("keys: got %d, want %d", len(got), len(want))
		}
		for k := range want {
			if _, ok := got[k]; !ok {
				t.Fatalf("missing key %q", k)
			}
		}
		s, err := Set(b, "kv", []byte(`{"x":1}`))
		if err != nil || !json.Valid(s) {
			t.Fatalf("Set(%q) = %q, %v", b, s, err)
		}
		d, err := Delete(b, "model")
		if err != nil || !json.Valid(d) {
			t.Fatalf("Delete(%q) = %q, %v", b, d, err)
		}
		if _, ok := Get(d, "model"); ok {
			t.Fatalf("Delete left model in %q", d)
		}
		// Several edits at once: the result means what the edits say.
		e, err := Edit(b, []Field{{"kv", []byte(`[1]`)}, {"model", []byte(`"m"`)}}, []string{"stream", "a"})
		if err != nil || !json.Valid(e) {
			t.Fatalf("Edit(%q) = %q, %v", b, e, err)
		}
		var after map[string]json.RawMessage
		if err := json.Unmarshal(e, &after); err != nil {
			t.Fatalf("Edit result %q: %v", e, err)
		}
		want["kv"], want["model"] = json.RawMessage(`[1]`), json.RawMessage(`"m"`)
		delete(want, "stream")
		delete(want, "a")
		if len(after) != len(want) {
			t.Fatalf("Edit(%q) = %q: keys %d, want %d", b, e, len(after), len(want))
		}
		for k, v := range want {
			if k == "kv" || k == "model" {
				if string(after[k]) != string(v) {
					t.Fatalf("Edit(%q) = %q: %s = %s", b, e, k, after[k])
				}
			} else if _, ok := after[k]; !ok {
				t.Fatalf("Edit(%q) = %q lost %q", b, e, k)
			}
		}
	})
}

func TestValid(t *testing.T) {
	for _, s := range []string{`{}`, `[]`, ` 1 `, `-0.5e+10`, `"a\u00e9\n"`, `{"a":[true,false,null,{"b":"c"}]}`, `"` + strings.Repeat("x", 100) + `\"y"`} {
		if !Valid([]byte(s)) {
			t.Errorf("Valid(%q) = false", s)
		}
	}
	for _, s := range []string{``, `{`, `{"a"}`, `01`, `1.`, `-`, `"\x"`, "\"a\tb\"", `[1,]`, `{"a":1,}`, `tru`, `"\u12g4"`, `1 2`, "\"\x01\""} {
		if Valid([]byte(s)) {
			t.Errorf("Valid(%q) = true", s)
		}
	}
}

// FuzzValid checks Valid against encoding/json.
func FuzzValid(f *testing.F) {
	for _, s := range []string{`{"a":1}`, `[1,2.5e-3,"x\"\\"]`, `"\u00e9abcdefghij"`, `{"k":"0123456789abcdef\n"}`, "\"\x1f\""} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := Valid(b), json.Valid(b); got != want {
			t.Fatalf("Valid(%q) = %v, json.Valid = %v", b, got, want)
		}
	})
}

// FuzzParseRequest: any bytes give a request or a client error, never a panic, and a request
// only for a valid JSON object.
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{`{"model":"m","stream":true,"n":2}`, `{"model":null}`, `[1]`, `{"n":-1}`, `{"model":"a\u0062"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ParseRequest(b)
		if err == nil && (!json.Valid(b) || r == nil || string(r.Body) != string(b)) {
			t.Fatalf("ParseRequest(%q) accepted a body it should not", b)
		}
	})
}
