package proxy

import "testing"

// An answer's id is read where OpenAI-style engines put it — the first key of a JSON answer or
// of a stream's first event — and nowhere else; an id Baton cannot read plainly is no id.
func TestAnswerID(t *testing.T) {
	for in, want := range map[string]string{
		`{"id":"chatcmpl-abc","object":"chat.completion"}`:  "chatcmpl-abc",
		`{"id": "cmpl-x-retry-2","choices":[]}`:             "cmpl-x-retry-2",
		"data: {\"id\":\"cmpl-7\",\"choices\":[]}\n\n":      "cmpl-7",
		"\r\ndata:{\"id\":\"chatcmpl-8\"}\n\n":              "chatcmpl-8",
		`{"object":"text_completion","id":"cmpl-late"}`:     "",
		`{"id":"cmpl-\"quoted\""}`:                          "",
		`{"id":"cmpl-unterminated`:                          "",
		`{"error":{"message":"x"}}`:                         "",
		": keep-alive\n\ndata: {\"id\":\"cmpl-after\"}\n\n": "",
	} {
		id, ok := answerID([]byte(in))
		if string(id) != want || ok != (want != "") {
			t.Errorf("answerID(%q) = %q, %v; want %q", in, id, ok, want)
		}
	}
}
