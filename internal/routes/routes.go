// Package routes is Baton's one table of the routes it serves: per path, what every layer needs
// to know of it — whether it is inference (forwarded to workers), whether it goes through a
// prefill/decode pair in PD mode, which engine families can hand KV off on it, which members hold
// its prompt and its batch, what caps its generation, what /tokenize needs. server, pd, policy
// and kvevents read it; a new route is one row.
package routes

// Route is one row of the table.
type Route struct {
	Path string
	// Inference routes are POSTs forwarded to a worker's same path.
	Inference bool
	// PD routes go through a prefill and a decode worker in PD mode.
	PD bool
	// VLLMHandoff: vLLM's request type for the route carries kv_transfer_params, so a vLLM
	// prefill can hand its KV to the decode (vllm/entrypoints/openai: CompletionRequest,
	// ChatCompletionRequest, the Anthropic messages request; not ResponsesRequest).
	VLLMHandoff bool
	// SGLangPD: an SGLang prefill takes the route's request with bootstrap fields (SGLang's
	// /v1/responses does not pass them on, so a vLLM prefill must serve it).
	SGLangPD bool
	// SGLangOnly routes are served by SGLang (and engines Baton cannot tell apart from it);
	// a vLLM worker answers them 404.
	SGLangOnly bool
	// StreamOptions: a stream ends with its usage only when the request asks for it
	// (stream_options.include_usage, OpenAI's chat and completions).
	StreamOptions bool
	// Prompt are the members that hold the prompt, in the order they are read (the first
	// present is the prompt for prefix routing).
	Prompt []string
	// Batch says how the request lists several prompts (see the Batch constants).
	Batch Batch
	// Samples says where the request asks for several samples per prompt.
	Samples Samples
	// Cap is the member that caps generation, set to 1 on a vLLM prefill probe; CapAlt, when
	// present in the body, is used instead (and Cap removed); NoStore routes also get
	// store=false on the probe.
	Cap, CapAlt string
	NoStore     bool
	// Tokenize is the member vLLM's and SGLang's /tokenize take for the route's prompt (""
	// when the prompt cannot be tokenized that way); TokenizeExtra the members that shape the
	// templated prompt and go with it.
	Tokenize      string
	TokenizeExtra []string
	// AnswerID is what vLLM puts before the request's X-Request-Id in the id of the route's
	// answers and of its stream's every event (serving_chat.py: chatcmpl-, serving_completion.py:
	// cmpl-); "" where answers are not named after the request.
	AnswerID string
}

// Batch is how a route's request lists several prompts.
type Batch int

const (
	// BatchNone: one prompt per request.
	BatchNone Batch = iota
	// BatchGenerate: SGLang's /generate, input_ids (a list of token lists) else text (a list).
	BatchGenerate
	// BatchCompletions: prompt (a list of strings or token lists; a flat token list is one)
	// plus each of prompt_embeds (one base64 tensor or a list).
	BatchCompletions
)

// Samples is where a route's request asks for several samples per prompt.
type Samples int

const (
	// SamplesN: the top-level n, or best_of when larger.
	SamplesN Samples = iota
	// SamplesSamplingParams: SGLang's sampling_params.n.
	SamplesSamplingParams
)

// chatTokenizeExtra are the members of a chat request besides messages that shape the prompt the
// engine computes, and that vLLM's TokenizeChatRequest takes too: the tools and the template's
// arguments change the templated text, add_generation_prompt and continue_final_message its end.
// An engine that does not know a member ignores it.
var chatTokenizeExtra = []string{"tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
	"continue_final_message", "add_special_tokens", "documents", "mm_processor_kwargs"}

var table = []Route{
	{Path: "/v1/chat/completions", Inference: true, PD: true, VLLMHandoff: true, SGLangPD: true, StreamOptions: true,
		Prompt: []string{"messages"}, Cap: "max_tokens", CapAlt: "max_completion_tokens",
		Tokenize: "messages", TokenizeExtra: chatTokenizeExtra, AnswerID: "chatcmpl-"},
	{Path: "/v1/completions", Inference: true, PD: true, VLLMHandoff: true, SGLangPD: true, StreamOptions: true,
		Prompt: []string{"prompt"}, Batch: BatchCompletions, Cap: "max_tokens", Tokenize: "prompt", AnswerID: "cmpl-"},
	{Path: "/v1/responses", Inference: true, PD: true,
		Prompt: []string{"instructions", "input"}, Cap: "max_output_tokens", NoStore: true},
	{Path: "/v1/messages", Inference: true, PD: true, VLLMHandoff: true, SGLangPD: true,
		Prompt: []string{"system", "messages"}, Cap: "max_tokens"},
	{Path: "/generate", Inference: true, PD: true, SGLangPD: true, SGLangOnly: true,
		Prompt: []string{"text", "input_ids"}, Batch: BatchGenerate, Samples: SamplesSamplingParams, Cap: "max_tokens"},
	{Path: "/v1/embeddings", Inference: true},
	{Path: "/v1/rerank", Inference: true},
	{Path: "/rerank", Inference: true},
	{Path: "/get_server_info", SGLangOnly: true},
	{Path: "/get_model_info", SGLangOnly: true},
	{Path: "/health_generate", SGLangOnly: true},
}

var byPath = func() map[string]*Route {
	m := make(map[string]*Route, len(table))
	for i := range table {
		m[table[i].Path] = &table[i]
	}
	return m
}()

// none is the row of a path the table does not list: nothing is known of it.
var none = &Route{}

// Of returns path's row; a path the table does not list gets an empty row (no prompt, no
// handoff, not SGLang-only). The row is shared: read it, never change it.
func Of(path string) *Route {
	if r, ok := byPath[path]; ok {
		return r
	}
	return none
}

// Inference returns the inference routes, in the table's order.
func Inference() []*Route {
	var out []*Route
	for i := range table {
		if table[i].Inference {
			out = append(out, &table[i])
		}
	}
	return out
}
