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

func TestChoiceIndex(t *testing.T) {
	for ev, want := range map[string]int{
		`data: {"id":"x","choices":[{"index":3,"delta":{"content":"a"}}],"usage":{"completion_tokens":2}}`: 3,
		`data: {"id":"x","choices": [ {"index": 0,"text":"a"}]}`:                                           0,
		`data: {"id":"x","choices":[],"usage":{"completion_tokens":2}}`:                                    -1,
		`data: {"type":"message_delta","usage":{"output_tokens":2}}`:                                       -1,
	} {
		i, ok := ChoiceIndex([]byte(ev))
		if !ok {
			i = -1
		}
		if i != want {
			t.Errorf("ChoiceIndex(%s) = %d, want %d", ev, i, want)
		}
	}
}

// The usage Baton asked of every event is taken out as the engine would have written the event
// without it: vLLM leaves the member out, SGLang writes it null; every other byte unchanged, an
// event Baton cannot edit plainly left whole.
func TestWithoutEventUsage(t *testing.T) {
	for _, c := range []struct {
		ev   string
		null bool
		want string
	}{
		{"data: {\"id\":\"a\",\"choices\":[{\"index\":0}],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n", false, "data: {\"id\":\"a\",\"choices\":[{\"index\":0}]}\n\n"},
		{"data: {\"id\":\"a\",\"choices\":[{\"index\":0}],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n", true, "data: {\"id\":\"a\",\"choices\":[{\"index\":0}],\"usage\":null}\n\n"},
		{"data:{\"usage\":{\"completion_tokens\":2},\"x\":18446744073709551617,\"u\":\"\\u00e9\"}\r\n\r\n", false, "data:{\"x\":18446744073709551617,\"u\":\"\\u00e9\"}\r\n\r\n"},
		{": c\ndata: {\"usage\":{\"completion_tokens\":2},\"id\":\"a\"}\n\n", false, ": c\ndata: {\"id\":\"a\"}\n\n"},
		{"data: {\"a\":1,\ndata: \"usage\":{}}\n\n", false, "data: {\"a\":1,\ndata: \"usage\":{}}\n\n"},
		{"data: [DONE]\n\n", false, "data: [DONE]\n\n"},
	} {
		if got := string(WithoutEventUsage([]byte(c.ev), c.null)); got != c.want {
			t.Errorf("WithoutEventUsage(%q, %v) = %q, want %q", c.ev, c.null, got, c.want)
		}
	}
}

// Every sample's usage of a /generate batch is read however the answer is cut into chunks; a
// key inside a sample's text is no usage, and each prompt is counted once for its samples.
func TestSampleSum(t *testing.T) {
	answer := `[{"text":"a \"meta_info\":{\"prompt_tokens\":999,\"completion_tokens\":999}","output_ids":[1],"meta_info":{"id":"r_0","finish_reason":{"type":"length"},"prompt_tokens":30,"completion_tokens":10,"cached_tokens":4,"e2e_latency":0.1}},` +
		`{"text":"b","output_ids":[2],"meta_info":{"id":"r_1","prompt_tokens":30,"completion_tokens":12,"cached_tokens":4,"output_token_logprobs":[[-0.5,2,null]]},"index":1},` +
		`{"text":"c","meta_info": null},` +
		`{"text":"d","meta_info":{"prompt_tokens":50,"completion_tokens":7,"cached_tokens":0}}]`
	for size := 1; size <= len(answer); size++ {
		var s SampleSum
		for b := []byte(answer); len(b) > 0; {
			n := min(size, len(b))
			s.Feed(b[:n])
			b = b[n:]
		}
		if u, ok := s.Usage(1); !ok || u != (Usage{Prompt: 110, Completion: 29, Cached: 8}) {
			t.Fatalf("chunks of %d: %+v, %v", size, u, ok)
		}
		if u, _ := s.Usage(2); u != (Usage{Prompt: 55, Completion: 29, Cached: 4}) {
			t.Fatalf("chunks of %d, two samples a prompt: %+v", size, u)
		}
	}
	var none SampleSum
	none.Feed([]byte(`[{"text":"x"}]`))
	if _, ok := none.Usage(1); ok {
		t.Error("usage read from an answer without any")
	}
}
