package sim

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// The simulators load and unload adapters at run time as the engines do: vLLM's endpoints and
// answers, a request for an adapter that is not loaded refused, the adapters listed in
// /v1/models with their parent, a load beyond max-loras refused, a missing path refused.
func TestLoRAAdaptersVLLM(t *testing.T) {
	t.Parallel()
	e := start(t, Config{Engine: EngineVLLM, RuntimeLoRA: true, MaxLoRAs: 2, LoRAAdapters: []string{"a1"}, LoRAMissingPaths: []string{"/nowhere"}})
	chat := func(model string) reply {
		return post(t, e.URL()+"/v1/completions", `{"model":"`+model+`","prompt":"hi","max_tokens":2}`)
	}
	if r := chat("a1"); r.status != 200 {
		t.Fatalf("preloaded adapter: %d %s", r.status, r.raw)
	}
	if r := chat("a2"); r.status != 404 || !strings.Contains(r.raw, "The model `a2` does not exist.") {
		t.Fatalf("adapter not loaded: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/v1/load_lora_adapter", `{"lora_name":"a2","lora_path":"/p/a2"}`); r.status != 200 || r.raw != "Success: LoRA adapter 'a2' added successfully." {
		t.Fatalf("load: %d %s", r.status, r.raw)
	}
	if r := chat("a2"); r.status != 200 {
		t.Fatalf("loaded adapter: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/v1/load_lora_adapter", `{"lora_name":"a2","lora_path":"/p/a2"}`); r.status != 400 || !strings.Contains(r.raw, "has already been loaded") {
		t.Fatalf("second load: %d %s", r.status, r.raw)
	}
	// vLLM checks no capacity on a load: --max-loras bounds a batch, not what is loaded.
	if r := post(t, e.URL()+"/v1/load_lora_adapter", `{"lora_name":"a3","lora_path":"/p/a3"}`); r.status != 200 {
		t.Fatalf("load beyond max-loras: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/v1/unload_lora_adapter", `{"lora_name":"a3"}`); r.status != 200 {
		t.Fatalf("unload a3: %d %s", r.status, r.raw)
	}
	models := get(t, e.URL()+"/v1/models")
	if path(models.json, "data", 2, "id") != "a2" || path(models.json, "data", 2, "parent") != e.cfg.Model || path(models.json, "data", 2, "root") != "/p/a2" {
		t.Fatalf("/v1/models: %s", models.raw)
	}
	if r := post(t, e.URL()+"/v1/unload_lora_adapter", `{"lora_name":"a1"}`); r.status != 200 {
		t.Fatalf("unload: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/v1/unload_lora_adapter", `{"lora_name":"a1"}`); r.status != 404 || !strings.Contains(r.raw, "cannot be found") {
		t.Fatalf("second unload: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/v1/load_lora_adapter", `{"lora_name":"a3","lora_path":"/nowhere"}`); r.status != 404 || !strings.Contains(r.raw, "No adapter found") {
		t.Fatalf("missing path: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/v1/load_lora_adapter", `{"lora_name":"a3"}`); r.status != 400 {
		t.Fatalf("no path: %d %s", r.status, r.raw)
	}
	if got := e.LoadedAdapters(); strings.Join(got, ",") != "a2" {
		t.Fatalf("loaded %v", got)
	}
	if loads, unloads := e.LoRAStats(); loads != 2 || unloads != 2 { // a2 and a3; a3 and a1
		t.Fatalf("loads %d unloads %d", loads, unloads)
	}
}

// vllm:lora_requests_info names the adapters running and waiting, and max_lora; the label set
// before the current one stays exported with its older time, as vLLM's gauge keeps it.
func TestLoRARequestsInfo(t *testing.T) {
	t.Parallel()
	e := start(t, Config{Engine: EngineVLLM, MaxLoRAs: 4, LoRAAdapters: []string{"a1", "a2"}, MaxConcurrency: 1, DecodePerToken: 100 * time.Millisecond})
	var wg sync.WaitGroup
	for _, m := range []string{"a1", "a2"} {
		wg.Go(func() { post(t, e.URL()+"/v1/completions", `{"model":"`+m+`","prompt":"hi","max_tokens":4}`) })
		time.Sleep(50 * time.Millisecond) // a1 runs first, a2 waits behind it
	}
	m := get(t, e.URL()+"/metrics").raw
	if !strings.Contains(m, `vllm:lora_requests_info{max_lora="4",running_lora_adapters="a1",waiting_lora_adapters="a2"}`) {
		t.Fatalf("lora_requests_info while a1 runs and a2 waits:\n%s", m)
	}
	wg.Wait()
	m = get(t, e.URL()+"/metrics").raw
	if !strings.Contains(m, `running_lora_adapters="",waiting_lora_adapters=""`) || strings.Count(m, "vllm:lora_requests_info{") != 2 {
		t.Fatalf("lora_requests_info after: want the idle set now and the set before it:\n%s", m)
	}
}

// SGLang's endpoints have no /v1, answer {success, error_message, loaded_adapters}, and a
// request names an adapter as base:adapter (OpenAI routes) or lora_path (/generate).
func TestLoRAAdaptersSGLang(t *testing.T) {
	t.Parallel()
	e := start(t, Config{Engine: EngineSGLang, RuntimeLoRA: true, MaxLoRAs: 1})
	r := post(t, e.URL()+"/load_lora_adapter", `{"lora_name":"a1","lora_path":"/p/a1"}`)
	if r.status != 200 || path(r.json, "success") != true || path(r.json, "loaded_adapters", "a1") != "/p/a1" {
		t.Fatalf("load: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/load_lora_adapter", `{"lora_name":"a2","lora_path":"/p/a2"}`); r.status != 400 || path(r.json, "success") != false ||
		!strings.Contains(r.raw, "Maximum number of loaded LoRA adapters is 1") {
		t.Fatalf("load beyond max: %d %s", r.status, r.raw)
	}
	if info := get(t, e.URL()+"/server_info"); fmt.Sprint(path(info.json, "max_loaded_loras")) != "1" || fmt.Sprint(path(info.json, "max_loras_per_batch")) != "1" {
		t.Fatalf("/server_info: %s", info.raw)
	}
	if r := post(t, e.URL()+"/v1/chat/completions", `{"model":"`+e.cfg.Model+`:a1","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`); r.status != 200 || e.AdapterRequests("a1") != 1 {
		t.Fatalf("base:adapter: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/v1/chat/completions", `{"model":"a1","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`); r.status != 200 || e.AdapterRequests("a1") != 1 {
		t.Fatalf("a bare adapter name is served by the base model: %d %s, adapter requests %d", r.status, r.raw, e.AdapterRequests("a1"))
	}
	if r := post(t, e.URL()+"/generate", `{"text":"hi","lora_path":"a1","sampling_params":{"max_new_tokens":2}}`); r.status != 200 {
		t.Fatalf("/generate lora_path: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/generate", `{"text":"hi","lora_path":"a9","sampling_params":{"max_new_tokens":2}}`); r.status != 400 {
		t.Fatalf("/generate unknown lora_path: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/v1/load_lora_adapter", `{"lora_name":"a2","lora_path":"/p/a2"}`); r.status != 404 {
		t.Fatalf("vLLM's path on SGLang: %d", r.status)
	}
}

// SGLang's OpenAI routes take lora_path too; a release that reads no adapter from the model name
// (SGLangModelAdapterIgnored) answers base:adapter from the base model, and runs the adapter only
// when lora_path names it.
func TestLoRAPathOnSGLangOpenAIRoutes(t *testing.T) {
	t.Parallel()
	e := start(t, Config{Engine: EngineSGLang, RuntimeLoRA: true, LoRAAdapters: []string{"a1"}, SGLangModelAdapterIgnored: true})
	chat := func(extra string) reply {
		return post(t, e.URL()+"/v1/chat/completions", `{"model":"`+e.cfg.Model+`:a1","messages":[{"role":"user","content":"hi"}],"max_tokens":2`+extra+`}`)
	}
	if r := chat(""); r.status != 200 || e.AdapterRequests("a1") != 0 {
		t.Fatalf("base:adapter on an older release: %d %s, adapter requests %d (want the base's 200)", r.status, r.raw, e.AdapterRequests("a1"))
	}
	if r := chat(`,"lora_path":"a1"`); r.status != 200 || e.AdapterRequests("a1") != 1 {
		t.Fatalf("with lora_path: %d %s, adapter requests %d", r.status, r.raw, e.AdapterRequests("a1"))
	}
	if r := chat(`,"lora_path":"a9"`); r.status != 400 {
		t.Fatalf("a lora_path not loaded: %d %s", r.status, r.raw)
	}
}

// SGLang's own words for the races a shared engine meets, each cited in docs/ENGINES.md: a load
// of an adapter it has (refused for capacity first when full), an unload of one it lacks, and a
// request for one not loaded; and its precedence — the adapter of a base:adapter model before an
// explicit lora_path.
func TestSGLangAdapterAnswersAsSGLangWordsThem(t *testing.T) {
	t.Parallel()
	e := start(t, Config{Engine: EngineSGLang, RuntimeLoRA: true, MaxLoRAs: 2, LoRAAdapters: []string{"a1"}})
	if r := post(t, e.URL()+"/load_lora_adapter", `{"lora_name":"a1","lora_path":"/p/a1"}`); r.status != 400 || path(r.json, "success") != false ||
		path(r.json, "error_message") != "Failed to load LoRA adapter a1 because it is already loaded" {
		t.Fatalf("load of a loaded adapter: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/load_lora_adapter", `{"lora_name":"a2","lora_path":"/p/a2"}`); r.status != 200 {
		t.Fatalf("load: %d %s", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/load_lora_adapter", `{"lora_name":"a1","lora_path":"/p/a1"}`); r.status != 400 ||
		!strings.Contains(r.raw, "Maximum number of loaded LoRA adapters is 2") {
		t.Fatalf("load of a loaded adapter on a full engine: %d %s (capacity is checked first)", r.status, r.raw)
	}
	if r := post(t, e.URL()+"/unload_lora_adapter", `{"lora_name":"a9"}`); r.status != 400 || path(r.json, "success") != false ||
		path(r.json, "error_message") != "LoRA with name a9 does not exist. Loaded LoRAs: dict_keys(['a1', 'a2'])" {
		t.Fatalf("unload of an adapter not loaded: %d %s", r.status, r.raw)
	}
	chat := func(model, extra string) reply {
		return post(t, e.URL()+"/v1/chat/completions", `{"model":"`+model+`","messages":[{"role":"user","content":"hi"}],"max_tokens":2`+extra+`}`)
	}
	if r := chat(e.cfg.Model+":a9", ""); r.status != 400 || !strings.Contains(r.raw, "The following requested LoRA adapters are not loaded: a9") {
		t.Fatalf("base:adapter not loaded: %d %s", r.status, r.raw)
	}
	if r := chat(e.cfg.Model+":a1", `,"lora_path":"a2"`); r.status != 200 || e.AdapterRequests("a1") != 1 || e.AdapterRequests("a2") != 0 {
		t.Fatalf("base:adapter beside another lora_path: %d %s; a1 ran %d, a2 %d (the model's adapter wins)", r.status, r.raw, e.AdapterRequests("a1"), e.AdapterRequests("a2"))
	}
	if r := chat(e.cfg.Model, `,"lora_path":"a2"`); r.status != 200 || e.AdapterRequests("a2") != 1 {
		t.Fatalf("the base model with lora_path: %d %s; a2 ran %d", r.status, r.raw, e.AdapterRequests("a2"))
	}
	if r := post(t, e.URL()+"/generate", `{"text":"hi","lora_path":"a9","sampling_params":{"max_new_tokens":2}}`); r.status != 400 ||
		!strings.Contains(r.raw, "The following requested LoRA adapters are not loaded: a9") {
		t.Fatalf("/generate, an adapter not loaded: %d %s", r.status, r.raw)
	}
}

// SGLang refuses a streamed request for an adapter not loaded inside the stream, after its 200
// (the tokenizer manager acquires the adapter inside the generator the stream runs): the
// refusal is the stream's one event, then [DONE] — SGLang's OpenAI routes' error object with
// code 400, /generate's {"error": {"message"}}. Not streamed, it is the 400.
func TestSGLangRefusesAStreamForAnAdapterNotLoadedInsideIt(t *testing.T) {
	t.Parallel()
	e := start(t, Config{Engine: EngineSGLang, RuntimeLoRA: true, LoRAAdapters: []string{"a1"}})
	const refusal = "The following requested LoRA adapters are not loaded: a9\\nLoaded adapters: dict_keys(['a1'])."
	for _, c := range []struct{ path, body, want string }{
		{"/v1/completions", `{"model":"` + e.cfg.Model + `:a9","prompt":"hi","max_tokens":2,"stream":true}`,
			`{"error":{"code":400,"message":"` + refusal + `","object":"error","param":null,"type":"BadRequestError"}}`},
		{"/v1/chat/completions", `{"model":"` + e.cfg.Model + `","lora_path":"a9","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true}`,
			`{"error":{"code":400,"message":"` + refusal + `","object":"error","param":null,"type":"BadRequestError"}}`},
		{"/generate", `{"text":"hi","lora_path":"a9","stream":true,"sampling_params":{"max_new_tokens":2}}`,
			`{"error":{"message":"` + refusal + `"}}`},
	} {
		r := post(t, e.URL()+c.path, c.body)
		if r.status != 200 {
			t.Errorf("%s streamed: got %d %s, want 200 and the refusal in the stream", c.path, r.status, r.raw)
			continue
		}
		if got, want := sseData(t, r.raw), []string{c.want, "[DONE]"}; !slices.Equal(got, want) {
			t.Errorf("%s streamed: got events %q, want %q", c.path, got, want)
		}
		if r := post(t, e.URL()+c.path, strings.Replace(c.body, `"stream":true`, `"stream":false`, 1)); r.status != 400 {
			t.Errorf("%s not streamed: got %d %s, want 400", c.path, r.status, r.raw)
		}
	}
	if n := e.AdapterRequests("a9"); n != 0 {
		t.Errorf("the adapter not loaded ran %d requests", n)
	}
}

// vLLM runs at most --max-loras adapters in a batch: a request of another adapter waits (shown
// among lora_requests_info's waiting adapters) until one of those running is done, without
// holding a run slot another request could use; the loads themselves are never refused for it.
func TestVLLMBatchRunsAtMostMaxLoRAs(t *testing.T) {
	t.Parallel()
	e := start(t, Config{Engine: EngineVLLM, RuntimeLoRA: true, MaxLoRAs: 1, LoRAAdapters: []string{"a1", "a2"}, DecodePerToken: 20 * time.Millisecond, MaxConcurrency: 2})
	done := make(chan string, 3)
	send := func(adapter string) {
		r := post(t, e.URL()+"/v1/completions", `{"model":"`+adapter+`","prompt":"x","max_tokens":15,"ignore_eos":true}`)
		if r.status != 200 {
			t.Errorf("%s: %d %s", adapter, r.status, r.raw)
		}
		done <- adapter
	}
	go send("a1")
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(get(t, e.URL()+"/metrics").raw, `running_lora_adapters="a1"`) {
		if time.Now().After(deadline) {
			t.Fatal("a1 never ran")
		}
		time.Sleep(5 * time.Millisecond)
	}
	go send("a2")
	for !strings.Contains(get(t, e.URL()+"/metrics").raw, `running_lora_adapters="a1",waiting_lora_adapters="a2"`) {
		if time.Now().After(deadline) {
			t.Fatalf("a2 did not wait while a1 ran:\n%s", get(t, e.URL()+"/metrics").raw)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The waiting a2 holds no run slot: a base-model request takes the second one and finishes
	// while a1 still runs, as vLLM's scheduler runs another request in its place.
	go func() {
		r := post(t, e.URL()+"/v1/completions", `{"model":"`+e.cfg.Model+`","prompt":"x","max_tokens":1}`)
		if r.status != 200 {
			t.Errorf("base: %d %s", r.status, r.raw)
		}
		done <- "base"
	}()
	if first, second, third := <-done, <-done, <-done; first != "base" || second != "a1" || third != "a2" {
		t.Errorf("finished %s, %s, %s; want base, a1, a2", first, second, third)
	}
}
