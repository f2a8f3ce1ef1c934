package openai

import "testing"

// SGLang is given Baton's rid for a request of one prompt and one sample — the route's answer
// prefix and the request id, JSON-escaped — and none for a request SGLang runs as a batch
// (io_struct.py _normalize_rid names each sample rid_<i>).
func TestRIDFor(t *testing.T) {
	for _, tc := range []struct {
		path, body, id, want string
	}{
		{"/v1/chat/completions", `{"messages":[]}`, "abc", `"chatcmpl-abc"`},
		{"/v1/completions", `{"prompt":"p"}`, "abc", `"cmpl-abc"`},
		{"/v1/completions", `{"prompt":[1,2,3]}`, "abc", `"cmpl-abc"`},
		{"/v1/completions", `{"prompt":"p","n":1}`, "abc", `"cmpl-abc"`},
		{"/generate", `{"text":"p"}`, "abc", `"abc"`},
		{"/generate", `{"input_ids":[1,2]}`, "abc", `"abc"`},
		{"/v1/completions", `{"prompt":"p"}`, `a"b\c`, `"cmpl-a\"b\\c"`},
		{"/v1/completions", `{"prompt":"p","n":2}`, "abc", ""},
		{"/v1/completions", `{"prompt":"p","n":2.0}`, "abc", ""},
		{"/v1/chat/completions", `{"messages":[],"n":3}`, "abc", ""},
		{"/v1/completions", `{"prompt":["a","b"]}`, "abc", ""},
		{"/v1/completions", `{"prompt":[ [1],[2]]}`, "abc", ""},
		{"/generate", `{"text":["a","b"]}`, "abc", ""},
		{"/generate", `{"input_ids":[[1],[2]]}`, "abc", ""},
		{"/generate", `{"text":"a","sampling_params":{"n":2}}`, "abc", ""},
		{"/v1/completions", `{"prompt":"p"}`, "", ""},
	} {
		got, ok := RIDFor([]byte(tc.body), tc.path, tc.id)
		if string(got) != tc.want || ok != (tc.want != "") {
			t.Errorf("RIDFor(%s %s, %q) = %s, %v; want %s", tc.path, tc.body, tc.id, got, ok, tc.want)
		}
	}
}
