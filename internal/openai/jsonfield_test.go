package openai

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
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
	if diff := cmp.Diff(Request{Body: r.Body, Model: "llama", Stream: true}, *r, cmpopts.IgnoreUnexported(Request{})); diff != "" {
		t.Errorf("ParseRequest (-want +got):\n%s", diff)
	}
	for _, bad := range []string{`{"model":`, `[1,2]`, `"s"`, `{"model":3}`, ``} {
		if _, err := ParseRequest([]byte(bad)); err == nil {
			t.Errorf("ParseRequest(%q): want error", bad)
		}
	}
	// The members Baton owns are removed in any letter case or escape: an engine decoding JSON
	// without regard to case reads "PRIORITY" as priority.
	r, err = ParseRequest([]byte(`{"model":"m","PRIORITY":5,"Kv_Transfer_Params":{},"bootstr\u0061p_room":1,"x":2}`))
	if err != nil || string(r.Body) != `{"model":"m","x":2}` {
		t.Errorf("owned members in other spellings: %s, %v", r.Body, err)
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

// FuzzDecodedBool checks DecodedBool against encoding/json decoding into a bool field, on any
// bytes: the keys it tries match exactly, by case, by escape and by Unicode folding (K, the
// Kelvin sign, folds to k).
func FuzzDecodedBool(f *testing.F) {
	for _, s := range []string{`{"do_remote_decode":true}`, `{"do_remote_decode":false,"x":[1]}`, `null`, ` {"DO_Remote_decode":true}`,
		`{"do_remote_decode":true,"do_remote_decode":null}`, `{"do_remote_decode":true,"Do_remote_decode":false}`,
		`{"do_remote_decode":"yes"}`, `{"do_remote_decode":1}`, `[true]`, `"x"`, `{"do_remote_\u0064ecode":true}`,
		`{"kind":true}`, "{\"\u212aind\":true}", `{"do_remote_decode":true`, `{"a":{"do_remote_decode":true}}`} {
		f.Add([]byte(s), uint8(0))
	}
	f.Add([]byte(`{"kind":false,"KIND":true}`), uint8(1))
	f.Fuzz(func(t *testing.T, b []byte, which uint8) {
		key := "do_remote_decode"
		if which%2 == 1 {
			key = "kind"
		}
		got, gotOK := DecodedBool(b, key)
		var want bool
		wantOK := true
		if key == "kind" {
			var s struct {
				X bool `json:"kind"`
			}
			wantOK, want = json.Unmarshal(b, &s) == nil, s.X
		} else {
			var s struct {
				X bool `json:"do_remote_decode"`
			}
			wantOK, want = json.Unmarshal(b, &s) == nil, s.X
		}
		if !wantOK {
			want = false
		}
		if got != want || gotOK != wantOK {
			t.Fatalf("DecodedBool(%q, %q) = %v, %v; encoding/json: %v, %v", b, key, got, gotOK, want, wantOK)
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
	for _, s := range []string{`{"a":NaN,"b":[-Infinity,Infinity]}`, `-NaN`, `NaNaN`, `[--Infinity]`, `{"NaN":"Infinity"}`} {
		f.Add([]byte(s))
	}
	// Python's constants stand where a value may: read as true by json.Valid, the rest alike.
	asJSON := strings.NewReplacer("-Infinity", "true", "Infinity", "true", "NaN", "true")
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := Valid(b), json.Valid(b); got != want {
			t.Fatalf("Valid(%q) = %v, json.Valid = %v", b, got, want)
		}
		if got, want := ValidPython(b), json.Valid([]byte(asJSON.Replace(string(b)))); got != want {
			t.Fatalf("ValidPython(%q) = %v, json.Valid of it with its constants as true = %v", b, got, want)
		}
	})
}

// FuzzParseRequest: any bytes give a request or a client error, never a panic, and a request
// only for a valid JSON object.
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{`{"model":"m","stream":true,"n":2}`, `{"model":null}`, `[1]`, `{"n":-1}`, `{"model":"a\u0062"}`} {
		f.Add([]byte(s))
	}
	f.Add([]byte(`{"a":1,"a":2}`))
	f.Add([]byte(`{"prompt":"x","pr\u006fmpt":[1,2]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ParseRequest(b)
		if err != nil {
			return
		}
		if !json.Valid(b) || r == nil || (string(r.Body) != string(b) && !hasOwned(b)) {
			t.Fatalf("ParseRequest(%q) accepted a body it should not", b)
		}
		if !utf8.Valid(b) {
			return // encoding/json reads invalid UTF-8 as U+FFFD; the engines refuse such a body
		}
		// What ParseRequest accepts has no repeated key, so encoding/json's reading is the only
		// one: Get must find every member with its exact bytes, and nothing else.
		var members map[string]json.RawMessage
		if err := json.Unmarshal(b, &members); err != nil {
			t.Fatalf("ParseRequest accepted %q, encoding/json refuses it: %v", b, err)
		}
		n := 0
		_ = eachMember(b, func([]byte, member) bool { n++; return true })
		if n != len(members) {
			t.Fatalf("%q: %d members, encoding/json sees %d distinct keys (a duplicate was accepted)", b, n, len(members))
		}
		for k, want := range members {
			got, ok := Get(b, k)
			if !ok || string(got) != string(want) {
				t.Fatalf("%q: Get(%q) = %q, %v; encoding/json reads %q", b, k, got, ok, want)
			}
			if string(r.Body) != string(b) {
				continue // the owned members were removed: the index is of the new body
			}
			if got, ok := r.Get(k); !ok || string(got) != string(want) {
				t.Fatalf("%q: the index reads %q as %q, %v; encoding/json %q", b, k, got, ok, want)
			}
		}
		var model string
		if raw, ok := members["model"]; ok && json.Unmarshal(raw, &model) == nil && model != r.Model {
			t.Fatalf("%q: model %q, encoding/json reads %q", b, r.Model, model)
		}
	})
}

// hasOwned reports whether the object b names a member Baton owns (ParseRequest removes those).
func hasOwned(b []byte) bool {
	owned := false
	_ = eachMember(b, func(k []byte, _ member) bool { owned = owned || isOwned(k); return !owned })
	return owned
}

// A repeated top-level key is a DuplicateKeyError naming it, among few members or many (the
// set turns into a map past 16), spelled alike, through escapes or in another letter case (an
// engine decoding JSON without regard to case reads them as one); inside sampling_params (an
// object or a list of them) and stream_options, whose members Baton reads, too; other nested
// objects are not Baton's to judge.
func TestParseRequestRefusesDuplicateKeys(t *testing.T) {
	many := func(extra string) string {
		var b strings.Builder
		b.WriteString(`{"model":"m"`)
		for i := 0; i < 40; i++ {
			fmt.Fprintf(&b, `,"k%d":%d`, i, i)
		}
		return b.String() + extra + "}"
	}
	for body, key := range map[string]string{
		`{"a":1,"a":2}`:                  "a",
		`{"model":"m","mod\u0065l":"n"}`: "model",
		many(`,"k39":0`):                 "k39",
		many(`,"k3":0`):                  "k3",
		`{"` + strings.Repeat("x", 100) + `":1,"` + strings.Repeat("x", 100) + `":2}`: strings.Repeat("x", 64) + "…",
		`{"a":1,"A":2}`:                      "A",
		many(`,"K3":0`):                      "K3",
		`{"max_tokens":5,"MAX_TOKENS":1200}`: "MAX_TOKENS",
		`{"sampling_params":{"max_new_tokens":5,"max_new_tokens":1000}}`:                "sampling_params.max_new_tokens",
		`{"sampling_params":[{"n":1},{"n":1,"n":4}]}`:                                   "sampling_params.n",
		`{"sampling_params":{"max_new_tokens":5,"max_new_t\u006fkens":400}}`:            "sampling_params.max_new_tokens",
		`{"stream":true,"stream_options":{"include_usage":true,"include_usage":false}}`: "stream_options.include_usage",
		`{"stream":true,"stream_options":{"include_usage":true,"Include_Usage":false}}`: "stream_options.Include_Usage",
	} {
		_, err := ParseRequest([]byte(body))
		var dk *DuplicateKeyError
		if !errors.As(err, &dk) || dk.Key != key {
			t.Errorf("%.60s: %v, want the duplicate %q", body, err, key)
		}
	}
	for _, body := range []string{many(""), `{"a":{"b":1,"b":2},"c":[{"d":1,"d":2}]}`, `{"sampling_params":{"a":{"b":1,"b":2}}}`} {
		if _, err := ParseRequest([]byte(body)); err != nil {
			t.Errorf("%.60s: %v", body, err)
		}
	}
}

// A parsed request reads its members from the index of the scan that parsed it, the same bytes
// Get finds by scanning, also after the owned members were removed.
func TestRequestGetUsesTheIndex(t *testing.T) {
	for _, body := range []string{
		`{"model":"m","prompt":["a","b"],"n":2,"x":{"prompt":1}}`,
		`{"kv_transfer_params":{"a":1},"model":"m","prompt":"p","bootstrap_room":7,"best_of":3}`,
	} {
		r, err := ParseRequest([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		if len(r.members) == 0 {
			t.Fatalf("%s: no index", body)
		}
		for _, k := range []string{"model", "prompt", "n", "x", "best_of", "kv_transfer_params", "bootstrap_room", "absent"} {
			got, ok := r.Get(k)
			want, wok := Get(r.Body, k)
			if ok != wok || string(got) != string(want) {
				t.Errorf("%s: Get(%q) = %q %v, scanning finds %q %v", body, k, got, ok, want, wok)
			}
		}
	}
}

// FuzzAppendKey holds appendKey's copied keys to json.Marshal's bytes, for any key: printable,
// escaped, HTML characters, control characters, invalid UTF-8.
func FuzzAppendKey(f *testing.F) {
	for _, s := range []string{"max_tokens", "kv_transfer_params", "", `a"b`, `a\b`, "<x>", "a&b", "\x00", "\x7f", "é", "\u2028", "\xff", "~ !#"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, key string) {
		want, _ := json.Marshal(key)
		want = append(want, ':')
		if got := appendKey([]byte("{"), key); string(got[1:]) != string(want) {
			t.Fatalf("appendKey(%q) = %s, json.Marshal gives %s", key, got[1:], want)
		}
	})
}
