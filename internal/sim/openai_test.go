package sim

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

func TestChatNonStream(t *testing.T) {
	e := start(t, Config{Engine: EngineVLLM, Model: "m"})
	r := post(t, e.URL()+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":5}`)
	if r.status != 200 {
		t.Fatalf("status %d %s", r.status, r.raw)
	}
	want, _ := expected("hello there", Sampling{MaxTokens: 5})
	if got := chatText(r); got != want || len(strings.Fields(got)) != 5 {
		t.Errorf("text %q, want %q (5 tokens)", got, want)
	}
	if f := path(r.json, "choices", 0, "finish_reason"); f != "length" {
		t.Errorf("finish_reason %v, want length", f)
	}
	if u := path(r.json, "usage"); num(path(u, "prompt_tokens")) != 4 || num(path(u, "completion_tokens")) != 5 ||
		num(path(u, "total_tokens")) != 9 || num(path(u, "prompt_tokens_details", "cached_tokens")) != 0 {
		t.Errorf("usage %v", u)
	}
	if r.header.Get(HeaderKVSource) != SourceRecompute || path(r.json, "object") != "chat.completion" {
		t.Errorf("source %q object %v", r.header.Get(HeaderKVSource), path(r.json, "object"))
	}
	// Same request, same text; a different seed, a different text.
	if again := post(t, e.URL()+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":5}`); chatText(again) != want {
		t.Errorf("not deterministic: %q vs %q", chatText(again), want)
	}
	if other := post(t, e.URL()+"/v1/chat/completions", `{"model":"m","seed":7,"messages":[{"role":"user","content":"hello there"}],"max_tokens":5}`); chatText(other) == want {
		t.Errorf("seed did not change the text")
	}
}

func TestFinishByStopAndEOS(t *testing.T) {
	e := start(t, Config{Model: "m"})
	natural, _ := expected("why", Sampling{})
	r := post(t, e.URL()+"/v1/chat/completions", `{"messages":[{"role":"user","content":"why"}]}`)
	if chatText(r) != natural || path(r.json, "choices", 0, "finish_reason") != "stop" {
		t.Errorf("uncapped: %q %v, want %q stop", chatText(r), path(r.json, "choices", 0, "finish_reason"), natural)
	}
	first := strings.Fields(natural)[0]
	r = post(t, e.URL()+"/v1/chat/completions", `{"messages":[{"role":"user","content":"why"}],"stop":["`+first+`"],"max_tokens":50}`)
	if chatText(r) != "" || path(r.json, "choices", 0, "finish_reason") != "stop" {
		t.Errorf("stop word: %q %v", chatText(r), path(r.json, "choices", 0, "finish_reason"))
	}
	r = post(t, e.URL()+"/v1/chat/completions", `{"messages":[{"role":"user","content":"why"}],"ignore_eos":true,"max_tokens":40}`)
	if n := len(strings.Fields(chatText(r))); n != 40 || path(r.json, "choices", 0, "finish_reason") != "length" {
		t.Errorf("ignore_eos: %d tokens %v", n, path(r.json, "choices", 0, "finish_reason"))
	}
}

func TestChatStreamFraming(t *testing.T) {
	e := start(t, Config{Model: "m"})
	r := post(t, e.URL()+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`)
	if r.status != 200 || r.header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("status %d type %q", r.status, r.header.Get("Content-Type"))
	}
	data := sseData(t, r.raw)
	// role chunk, 3 tokens, finish chunk, usage chunk, [DONE]
	if len(data) != 7 || data[6] != "[DONE]" {
		t.Fatalf("events %d: %q", len(data), data)
	}
	var text strings.Builder
	for _, d := range data[1:4] {
		var c map[string]any
		json.Unmarshal([]byte(d), &c)
		text.WriteString(path(c, "choices", 0, "delta", "content").(string))
	}
	want, _ := expected("hello there", Sampling{MaxTokens: 3})
	if text.String() != want {
		t.Errorf("streamed %q, want %q", text.String(), want)
	}
	var fin, usage map[string]any
	json.Unmarshal([]byte(data[4]), &fin)
	json.Unmarshal([]byte(data[5]), &usage)
	if path(fin, "choices", 0, "finish_reason") != "length" {
		t.Errorf("finish chunk %s", data[4])
	}
	if ch, _ := path(usage, "choices").([]any); ch == nil || len(ch) != 0 || path(usage, "usage", "completion_tokens").(float64) != 3 {
		t.Errorf("usage chunk %s", data[5])
	}
	// stream_options without stream is a vLLM 400.
	if r := post(t, e.URL()+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}`); r.status != 400 || path(r.json, "error", "code") == nil {
		t.Errorf("stream_options without stream: %d %s", r.status, r.raw)
	}
}

func TestCompletionsAndResponses(t *testing.T) {
	e := start(t, Config{Model: "m"})
	r := post(t, e.URL()+"/v1/completions", `{"model":"m","prompt":["a b c","d e"],"max_tokens":2,"n":2,"ignore_eos":true}`)
	if ch := path(r.json, "choices").([]any); len(ch) != 4 || num(path(r.json, "usage", "prompt_tokens")) != 5 || num(path(r.json, "usage", "completion_tokens")) != 8 {
		t.Fatalf("batch completions: %s", r.raw)
	}
	want := Detokenize(must(Generate(Digest(Tokenize("d e")), Sampling{MaxTokens: 2, Seed: 1, IgnoreEOS: true})))
	if got := path(r.json, "choices", 3, "text"); got != want {
		t.Errorf("choice 3 %v, want %q", got, want)
	}
	r = post(t, e.URL()+"/v1/completions", `{"prompt":"a b c","max_tokens":2,"stream":true}`)
	if d := sseData(t, r.raw); len(d) != 4 || d[3] != "[DONE]" || !strings.Contains(d[0], `"object":"text_completion"`) {
		t.Errorf("completion stream %q", d)
	}
	r = post(t, e.URL()+"/v1/responses", `{"model":"m","input":"hello there","max_output_tokens":4}`)
	wantR, _ := expected("hello there", Sampling{MaxTokens: 4})
	if path(r.json, "output", 0, "content", 0, "text") != wantR || num(path(r.json, "usage", "output_tokens")) != 4 {
		t.Errorf("responses: %s", r.raw)
	}
	r = post(t, e.URL()+"/v1/responses", `{"model":"m","input":"hello there","max_output_tokens":4,"stream":true}`)
	if !strings.Contains(r.raw, "event: response.completed\n") || strings.Count(r.raw, "response.output_text.delta\n") != 4 {
		t.Errorf("responses stream: %s", r.raw)
	}
	if r := post(t, e.URL()+"/v1/chat/completions", `{"model":"other","messages":[{"role":"user","content":"x"}]}`); r.status != 404 {
		t.Errorf("unknown model: %d", r.status)
	}
	if r := post(t, e.URL()+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":2,"min_tokens":3}`); r.status != 400 {
		t.Errorf("min_tokens > max_tokens: %d", r.status)
	}
}

func must[T any, U any](v T, _ U) T { return v }

func TestIdentityEndpoints(t *testing.T) {
	v := start(t, Config{Engine: EngineVLLM, Model: "m"})
	s := start(t, Config{Engine: EngineSGLang, Role: RolePrefill, Model: "m", DPSize: 2})
	if r := get(t, v.URL()+"/v1/models"); path(r.json, "data", 0, "owned_by") != "vllm" || path(r.json, "data", 0, "id") != "m" {
		t.Errorf("vllm models %s", r.raw)
	}
	if r := get(t, s.URL()+"/v1/models"); path(r.json, "data", 0, "owned_by") != "sglang" {
		t.Errorf("sglang models %s", r.raw)
	}
	if r := get(t, v.URL()+"/version"); r.status != 200 || path(r.json, "version") == nil {
		t.Errorf("/version %d", r.status)
	}
	if r := get(t, s.URL()+"/version"); r.status != 404 {
		t.Errorf("sglang /version %d, want 404", r.status)
	}
	for _, p := range []string{"/server_info", "/get_server_info"} {
		r := get(t, s.URL()+p)
		if path(r.json, "disaggregation_mode") != "prefill" || num(path(r.json, "disaggregation_bootstrap_port")) != s.BootstrapPort() || num(path(r.json, "dp_size")) != 2 {
			t.Errorf("%s: %s", p, r.raw)
		}
	}
	if r := get(t, v.URL()+"/health"); r.status != 200 {
		t.Errorf("health %d", r.status)
	}
	post(t, v.URL()+"/v1/completions", `{"prompt":"a b c"}`)
	m := get(t, v.URL()+"/metrics").raw
	for _, want := range []string{`vllm:prompt_tokens_by_source_total{source="local_compute"} 3`, `vllm:kv_handoffs_total{event="pinned"} 0`, "vllm:num_requests_running 0"} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %q:\n%s", want, m)
		}
	}
	if !strings.Contains(get(t, s.URL()+"/metrics").raw, "sglang:prompt_tokens_by_source_total") {
		t.Error("sglang metrics prefix")
	}
}

func TestGenerate(t *testing.T) {
	e := start(t, Config{Engine: EngineSGLang, Model: "m"})
	r := post(t, e.URL()+"/generate", `{"text":"a b c","sampling_params":{"max_new_tokens":3},"return_logprob":true}`)
	want := Detokenize(must(Generate(Digest(Tokenize("a b c")), Sampling{MaxTokens: 3})))
	if path(r.json, "text") != want || path(r.json, "meta_info", "finish_reason", "type") != "length" || num(path(r.json, "meta_info", "prompt_tokens")) != 3 {
		t.Fatalf("generate: %s", r.raw)
	}
	if in := path(r.json, "meta_info", "input_token_logprobs").([]any); len(in) != 3 || path(in, 0, 0) != nil {
		t.Errorf("input logprobs %v", in)
	}
	if out := path(r.json, "meta_info", "output_token_logprobs").([]any); len(out) != 3 {
		t.Errorf("output logprobs %v", out)
	}
	ids := mustJSON(Tokenize("a b c"))
	r2 := post(t, e.URL()+"/generate", `{"input_ids":`+ids+`,"sampling_params":{"max_new_tokens":3}}`)
	if path(r2.json, "text") != want {
		t.Errorf("input_ids text %v, want %q", path(r2.json, "text"), want)
	}
	rb := do(t, "POST", e.URL()+"/generate", `{"text":["a b c","x y"],"sampling_params":{"max_new_tokens":2}}`)
	var batch []map[string]any
	json.Unmarshal([]byte(rb.raw), &batch)
	if len(batch) != 2 || batch[1]["index"].(float64) != 1 {
		t.Errorf("batch: %s", rb.raw)
	}
	rs := post(t, e.URL()+"/generate", `{"text":"a b c","sampling_params":{"max_new_tokens":3},"stream":true}`)
	d := sseData(t, rs.raw)
	if len(d) != 4 || d[3] != "[DONE]" || !strings.Contains(d[2], mustJSON(want)) {
		t.Errorf("generate stream (cumulative text) %q", d)
	}
}

// The prefix cache keeps full blocks of 16 tokens, reuses them only after the same prefix, and
// evicts the least recently used past its capacity; only uncached tokens are computed.
func TestPrefixCache(t *testing.T) {
	e := start(t, Config{Model: "m", PrefixCache: true, PrefixCacheBlocks: 4})
	words := func(prefix string, n int) string {
		var b strings.Builder
		for i := 0; i < n; i++ {
			fmt.Fprintf(&b, "%s%d ", prefix, i)
		}
		return b.String()
	}
	shared := words("w", 32) // two full blocks
	cached := func(prompt string) int {
		r := post(t, e.URL()+"/v1/completions", `{"model":"m","prompt":"`+prompt+`","max_tokens":1,"ignore_eos":true}`)
		return int(num(path(r.json, "usage", "prompt_tokens_details", "cached_tokens")))
	}
	if c := cached(shared + "first question"); c != 0 {
		t.Errorf("a cold cache reported %d cached tokens", c)
	}
	if c := cached(shared + "second question"); c != 32 {
		t.Errorf("a shared 32-token prefix: %d cached, want 32", c)
	}
	if c := cached("different start " + shared); c != 0 {
		t.Errorf("the same blocks after another prefix: %d cached, want 0", c)
	}
	// Capacity 4 blocks: two more 2-block prompts evict the shared prefix.
	cached(words("x", 32))
	cached(words("y", 32))
	if c := cached(shared + "third question"); c != 0 {
		t.Errorf("after eviction: %d cached, want 0", c)
	}
	s := e.Stats()
	if s.PrefixCacheHits != 32 || s.PrefixCacheQueries == 0 {
		t.Errorf("stats %+v", s)
	}
}

// The engines read requests with pydantic: a field matches in its one letter case, and
// "MAX_TOKENS" is an unknown member, ignored — not Go's case-insensitive max_tokens. A member
// named twice keeps its last value, as Python's json does. vLLM refuses a priority it does not
// schedule by (vllm/v1/engine/processor.py); SGLang's /generate answer ends with its meta_info.
func TestRequestsReadAsTheEnginesReadThem(t *testing.T) {
	e := start(t, Config{Engine: EngineVLLM, Model: "m"})
	r := post(t, e.URL()+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":3,"ignore_eos":true,"MAX_TOKENS":50,"Max_Tokens":60}`)
	if r.status != 200 || num(path(r.json, "usage", "completion_tokens")) != 3 {
		t.Errorf("a cap in another letter case was read: %d %s", r.status, r.raw)
	}
	r = post(t, e.URL()+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":3,"ignore_eos":true,"max_tokens":5}`)
	if num(path(r.json, "usage", "completion_tokens")) != 5 {
		t.Errorf("a member named twice: %s, want the last value read", r.raw)
	}
	if r = post(t, e.URL()+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":3,"priority":-1}`); r.status != 400 || !strings.Contains(r.raw, "Priority scheduling is not enabled") {
		t.Errorf("vLLM without priority scheduling took a priority: %d %s", r.status, r.raw)
	}
	if r = post(t, e.URL()+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":3,"PRIORITY":-1}`); r.status != 200 {
		t.Errorf("PRIORITY, an unknown member to vLLM: %d %s", r.status, r.raw)
	}
	p := start(t, Config{Engine: EngineVLLM, Model: "m", SchedulingPolicy: SchedulingPriority})
	if r = post(t, p.URL()+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":3,"priority":-1}`); r.status != 200 || p.Stats().LastPriority != -1 {
		t.Errorf("vLLM scheduling by priority: %d %s, last priority %d", r.status, r.raw, p.Stats().LastPriority)
	}
	g := start(t, Config{Engine: EngineSGLang, Model: "m"})
	r = post(t, g.URL()+"/generate", `{"text":"hi","sampling_params":{"max_new_tokens":400,"ignore_eos":true,"MAX_NEW_TOKENS":1}}`)
	if i := strings.LastIndex(r.raw, `"meta_info":`); r.status != 200 || i < 0 || len(r.raw)-i > 512 || num(path(r.json, "meta_info", "completion_tokens")) != 400 {
		t.Errorf("/generate: %d, meta_info at %d of %d bytes", r.status, i, len(r.raw))
	}
}

// With EngineHeadersOnly an answer, whole or streamed, carries none of the simulator's own
// headers; without it, it carries all three.
func TestEngineHeadersOnlyLeavesTheSimulatorsHeadersOut(t *testing.T) {
	for _, only := range []bool{false, true} {
		e := start(t, Config{Model: "m", EngineHeadersOnly: only})
		for _, stream := range []string{"false", "true"} {
			r := post(t, e.URL()+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":2,"stream":`+stream+`}`)
			if r.status != 200 {
				t.Fatalf("%d %s", r.status, r.raw)
			}
			for _, h := range []string{HeaderKVSource, HeaderEngineID, HeaderDPRank} {
				if _, has := r.header[http.CanonicalHeaderKey(h)]; has == only {
					t.Errorf("EngineHeadersOnly %v, stream %s: %s present %v", only, stream, h, has)
				}
			}
		}
	}
}
