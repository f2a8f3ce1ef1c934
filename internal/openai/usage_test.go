package openai

import "testing"

func TestLastUsage(t *testing.T) {
	for _, c := range []struct {
		tail string
		want Usage
		ok   bool
	}{
		{`{"choices":[],"usage":{"prompt_tokens":12,"total_tokens":19,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":8}}}`, Usage{12, 7, 8}, true},
		{"data: {\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\": 3, \"completion_tokens\": 4}}\n\ndata: [DONE]\n\n", Usage{3, 4, 0}, true},
		{`{"text":"a \"usage\": {","meta_info":{"prompt_tokens":5,"completion_tokens":6,"cached_tokens":2,"id":"x}"}}`, Usage{5, 6, 2}, true},
		{`{"usage":null}`, Usage{}, false},
		{`ns":7}}`, Usage{}, false},
		{`{"usage":{"prompt_tokens":1,"completion_`, Usage{}, false},
		{`"usage":{"prompt_tokens":1,"completion_tokens":2}, "usage":{"prompt_tokens":9`, Usage{1, 2, 0}, true},
		{``, Usage{}, false},
	} {
		got, ok := LastUsage([]byte(c.tail))
		if ok != c.ok || got != c.want {
			t.Errorf("%q: %+v %v, want %+v %v", c.tail, got, ok, c.want, c.ok)
		}
	}
}

func FuzzLastUsage(f *testing.F) {
	f.Add([]byte(`{"usage":{"prompt_tokens":12,"completion_tokens":7}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if u, ok := LastUsage(b); ok && (u.Prompt < 0 || u.Completion < 0 || u.Cached < 0) {
			t.Fatalf("negative counts %+v", u)
		}
	})
}

// SetBody indexes the new body: Get reads its bytes, not the old offsets.
func TestSetBodyReindexes(t *testing.T) {
	r, err := ParseRequest([]byte(`{"model":"m","stream":true,"max_tokens":7}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Set(r.Body, "stream_options", []byte(`{"include_usage":true}`))
	b, _ = Set(b, "model", []byte(`"a-much-longer-model-name"`))
	if err := r.SetBody(b); err != nil {
		t.Fatal(err)
	}
	if v, ok := r.Get("max_tokens"); !ok || string(v) != "7" || r.Model != "a-much-longer-model-name" {
		t.Errorf("max_tokens %q, model %q", v, r.Model)
	}
	if v, ok := r.Get("stream_options"); !ok || string(v) != `{"include_usage":true}` {
		t.Errorf("stream_options %q", v)
	}
}

// The usage-only event is the one whose data a client reads as empty choices and a usage: a
// comment line shaped like one, beside a data line that carries a token, is not it, and the event
// is kept whole.
func TestAUsageOnlyEventIsReadFromItsData(t *testing.T) {
	decoy := ": {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n" +
		"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"kept\"}}]}\n\n"
	if IsUsageOnlyEvent([]byte(decoy)) {
		t.Errorf("%q taken for a usage-only event", decoy)
	}
	real := "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\n"
	if !IsUsageOnlyEvent([]byte(real)) {
		t.Errorf("%q not taken for a usage-only event", real)
	}
}

// The usage-only event is read by its top-level members: choices nested in another member do
// not make a content event usage-only, and an event that also reports an error is not stripped,
// so its error is not lost with it.
func TestAUsageOnlyEventIsReadByItsTopLevelMembers(t *testing.T) {
	for _, ev := range []string{
		`data: {"meta":{"choices":[]},"choices":[{"index":0,"delta":{"content":"hello"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}` + "\n\n",
		`data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1},"error":{"message":"KV transfer failed","code":500}}` + "\n\n",
	} {
		if IsUsageOnlyEvent([]byte(ev)) {
			t.Errorf("%q taken for a usage-only event", ev)
		}
	}
	if ev := "data: {\"choices\": [ ],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n"; !IsUsageOnlyEvent([]byte(ev)) {
		t.Errorf("%q not taken for a usage-only event", ev)
	}
}
