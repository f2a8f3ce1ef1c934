package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"sync"
)

type route int

const (
	routeChat route = iota
	routeCompletions
	routeResponses
	routeGenerate
	routeMessages // vLLM's Anthropic-style /v1/messages
)

// bootstrap is one item's SGLang bootstrap fields.
type bootstrap struct {
	host string
	port *int // nil: the decode engine's own configured bootstrap port
	room uint64
}

func (b *bootstrap) fake() bool { return b != nil && b.host == fakeBootstrapHost }

type item struct {
	prompt []uint32
	boot   *bootstrap
	// samples are the bootstrap fields of each of the item's n samples when n > 1: SGLang sends
	// every sample as a request of its own, each with its own room.
	samples []*bootstrap
}

// job is one parsed inference request.
type job struct {
	route         route
	items         []item
	n             int
	s             Sampling
	stream        bool
	includeUsage  bool
	eachUsage     bool // every event of the stream carries its choice's usage so far
	kv            *kvParams
	rank          int    // DP rank serving this request
	routed        bool   // the rank was asked for (routed_dp_rank or the rank header)
	lora          string // the LoRA adapter asked for, "" for the base model
	prefillRank   int    // SGLang decode: the prefill's DP rank (-1: room % prefill dp size)
	returnLogprob bool
	id            string // response id
	reqID         string // internal request id
	seq           *seq   // the request in the step model (Config.Steps), once it prefills
	ticks         int    // tokens a stream has written (the step model paces them)
}

type message struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type rawSampling struct {
	MaxNewTokens *int            `json:"max_new_tokens"`
	Stop         json.RawMessage `json:"stop"`
	StopTokenIDs []uint32        `json:"stop_token_ids"`
	IgnoreEOS    bool            `json:"ignore_eos"`
	N            *int            `json:"n"`
	Seed         *int64          `json:"sampling_seed"`
}

type rawRequest struct {
	Model *string `json:"model"`
	// LoRAPath is SGLang's adapter by name (every route): a name, null, or one per prompt of a
	// /generate batch. vLLM has no such field and ignores it.
	LoRAPath       json.RawMessage `json:"lora_path"`
	Messages       []message       `json:"messages"`
	Prompt         json.RawMessage `json:"prompt"`
	Input          json.RawMessage `json:"input"`
	Instructions   string          `json:"instructions"`
	System         json.RawMessage `json:"system"`
	StopSequences  json.RawMessage `json:"stop_sequences"`
	Text           json.RawMessage `json:"text"`
	InputIDs       json.RawMessage `json:"input_ids"`
	SamplingParams *rawSampling    `json:"sampling_params"`
	Stream         laxBool         `json:"stream"`
	StreamOptions  *struct {
		IncludeUsage         bool `json:"include_usage"`
		ContinuousUsageStats bool `json:"continuous_usage_stats"`
	} `json:"stream_options"`
	MaxTokens           *laxInt         `json:"max_tokens"`
	MaxCompletionTokens *laxInt         `json:"max_completion_tokens"`
	MaxOutputTokens     *laxInt         `json:"max_output_tokens"`
	MinTokens           *int            `json:"min_tokens"`
	N                   *int            `json:"n"`
	Seed                *int64          `json:"seed"`
	Stop                json.RawMessage `json:"stop"`
	StopTokenIDs        []uint32        `json:"stop_token_ids"`
	IgnoreEOS           bool            `json:"ignore_eos"`
	KVTransferParams    *kvParams       `json:"kv_transfer_params"`
	BootstrapHost       json.RawMessage `json:"bootstrap_host"`
	BootstrapPort       json.RawMessage `json:"bootstrap_port"`
	BootstrapRoom       json.RawMessage `json:"bootstrap_room"`
	RoutedDPRank        *int            `json:"routed_dp_rank"`
	DisaggPrefillDPRank *int            `json:"disagg_prefill_dp_rank"`
	ReturnLogprob       bool            `json:"return_logprob"`
	Priority            *int64          `json:"priority"`
	// RID is SGLang's request id, which names its answers (vLLM has none).
	RID json.RawMessage `json:"rid"`
	template
}

// caseSensitive returns body without the members an engine would not read: the engines parse
// requests with Python (pydantic), whose field names match in their one letter case, where Go's
// encoding/json would take "MAX_TOKENS" for max_tokens. A member named in another case than a
// field's (at the top level, in sampling_params and stream_options) is dropped; a member named
// twice keeps its last value, as Python's json does. A body that is no object is left as it is.
func caseSensitive(body []byte) []byte {
	var top map[string]json.RawMessage
	if json.Unmarshal(body, &top) != nil || top == nil {
		return body
	}
	keep(top, requestFields())
	for _, nested := range []struct {
		key    string
		fields map[string]bool
	}{{"sampling_params", samplingFields()}, {"stream_options", streamOptionFields}} {
		var obj map[string]json.RawMessage
		if raw, ok := top[nested.key]; ok && json.Unmarshal(raw, &obj) == nil && obj != nil {
			keep(obj, nested.fields)
			top[nested.key], _ = json.Marshal(obj)
		}
	}
	out, err := json.Marshal(top)
	if err != nil {
		return body
	}
	return out
}

// plainObject reports whether body reads as caseSensitive's rewrite of it reads, so that parse
// may decode it as it is (the rewrite costs the simulator a tenth of its time per request): one
// JSON object whose member names are plain ASCII without escapes, none named twice, none named
// like one of fields in another letter case, and each value as json.Marshal would write it back
// (no space outside strings, none of <, >, &, U+2028, U+2029), where the rewrite's values would
// differ in their bytes; where nested names the fields of a member that is an object, the same
// holds of it, spaces between its members aside. It judges names and the bytes json.Marshal
// changes, not JSON: parse decodes the rewrite after all when the body fails to decode, so that a
// body's errors are the rewrite's (FuzzParseShortcut holds the two to the same request).
func plainObject(body []byte, fields map[string]bool, nested func(name string) map[string]bool) bool {
	i := skipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return false
	}
	var seen [24]string
	names := seen[:0]
	i = skipSpace(body, i+1)
	if i < len(body) && body[i] == '}' {
		return skipSpace(body, i+1) == len(body)
	}
	for {
		if i >= len(body) || body[i] != '"' {
			return false
		}
		end := i + 1
		for end < len(body) && body[end] != '"' {
			if c := body[end]; c == '\\' || c < 0x20 || c >= 0x80 {
				return false
			}
			end++
		}
		if end >= len(body) {
			return false
		}
		name := string(body[i+1 : end])
		if !fields[name] {
			for f := range fields {
				if strings.EqualFold(name, f) {
					return false
				}
			}
		}
		if len(names) == cap(seen) {
			return false // many members: the rewrite's map, not this quadratic look
		}
		for _, n := range names {
			if n == name {
				return false
			}
		}
		names = append(names, name)
		i = skipSpace(body, end+1)
		if i >= len(body) || body[i] != ':' {
			return false
		}
		if i = skipSpace(body, i+1); i >= len(body) {
			return false
		}
		var vend int
		if inner := nestedObject(nested, name, body[i]); inner != nil {
			if vend = skipValue(body, i); vend < 0 || !plainObject(body[i:vend], inner, nil) {
				return false
			}
		} else if vend = skipCompact(body, i); vend < 0 {
			return false
		}
		i = skipSpace(body, vend)
		if i >= len(body) {
			return false
		}
		if body[i] == '}' {
			return skipSpace(body, i+1) == len(body)
		}
		if body[i] != ',' {
			return false
		}
		i = skipSpace(body, i+1)
	}
}

// nestedObject is the field names of the member named name whose value begins with c, where
// nested names them and the value is an object; nil otherwise.
func nestedObject(nested func(string) map[string]bool, name string, c byte) map[string]bool {
	if nested == nil || c != '{' {
		return nil
	}
	return nested(name)
}

// nestedFields is the field names of a request's member named name where caseSensitive looks
// into it: sampling_params and stream_options.
func nestedFields(name string) map[string]bool {
	switch name {
	case "sampling_params":
		return samplingFields()
	case "stream_options":
		return streamOptionFields
	}
	return nil
}

// skipSpace returns the index of the first byte at or after i that is not JSON whitespace.
func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipValue returns the index just past the JSON value starting at b[i], or -1 where b ends
// first: a string to its closing quote, an object or array to its closing bracket (brackets in
// strings aside), anything else to the next comma, bracket or space. It does not judge the value.
func skipValue(b []byte, i int) int {
	if i >= len(b) {
		return -1
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				if i = skipString(b, i); i < 0 {
					return -1
				}
				continue
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return -1
	}
	for i < len(b) && !strings.ContainsRune(",}] \t\n\r", rune(b[i])) {
		i++
	}
	return i
}

// skipCompact returns the index just past the JSON value starting at b[i] where its bytes are
// as json.Marshal writes a json.RawMessage back (no space outside strings; none of <, >, & and
// U+2028, U+2029, which it escapes), and -1 where they are not or b ends first.
func skipCompact(b []byte, i int) int {
	end := skipValue(b, i)
	if end < 0 {
		return -1
	}
	in := false
	for j := i; j < end; j++ {
		switch c := b[j]; {
		case in && c == '\\':
			j++
		case c == '"':
			in = !in
		case c == '<' || c == '>' || c == '&':
			return -1
		case c == 0xE2 && j+2 < end && b[j+1] == 0x80 && (b[j+2] == 0xA8 || b[j+2] == 0xA9):
			return -1
		case !in && (c == ' ' || c == '\t' || c == '\n' || c == '\r'):
			return -1
		}
	}
	return end
}

// skipString returns the index just past the JSON string starting at b[i], or -1 where b ends
// first.
func skipString(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return -1
}

// keep drops from obj the members named like one of fields in another letter case.
func keep(obj map[string]json.RawMessage, fields map[string]bool) {
	for k := range obj {
		if fields[k] {
			continue
		}
		for f := range fields {
			if strings.EqualFold(k, f) {
				delete(obj, k)
				break
			}
		}
	}
}

// The field names caseSensitive keeps, read once from the request types.
var (
	requestFields      = sync.OnceValue(fieldsOf[rawRequest])
	samplingFields     = sync.OnceValue(fieldsOf[rawSampling])
	streamOptionFields = map[string]bool{"include_usage": true}
)

// fieldsOf returns the JSON field names of struct T (and of its embedded structs).
func fieldsOf[T any]() map[string]bool {
	out := map[string]bool{}
	var walk func(t reflect.Type)
	walk = func(t reflect.Type) {
		for i := range t.NumField() {
			f := t.Field(i)
			if f.Anonymous && f.Type.Kind() == reflect.Struct {
				walk(f.Type)
				continue
			}
			if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); name != "" && name != "-" {
				out[name] = true
			}
		}
	}
	walk(reflect.TypeFor[T]())
	return out
}

// oneAdapter is the adapter a lora_path names: a name, null (""), or a list naming one adapter
// for every prompt (or none). The simulator runs one adapter per request; SGLang would run a
// list naming several, one per prompt.
func oneAdapter(raw json.RawMessage) (string, error) {
	var one *string
	if json.Unmarshal(raw, &one) == nil {
		if one == nil {
			return "", nil
		}
		return *one, nil
	}
	var list []*string
	if err := json.Unmarshal(raw, &list); err != nil {
		return "", errors.New("want an adapter's name, null, or a list of them")
	}
	name := ""
	for i, n := range list {
		v := ""
		if n != nil {
			v = *n
		}
		if i > 0 && v != name {
			return "", errors.New("the simulator runs one adapter per request, not one per prompt")
		}
		name = v
	}
	return name, nil
}

// decodeCaseSensitive reads body's members into a request's fields as an engine would
// (caseSensitive): the body as it is where plainObject finds it reads as the rewrite, the
// rewrite otherwise and wherever the body fails to decode, so that errors are the rewrite's.
func decodeCaseSensitive(body []byte) (rawRequest, error) {
	if plainObject(body, requestFields(), nestedFields) {
		if raw, err := decodeRequest(body); err == nil {
			return raw, nil
		}
	}
	return decodeRequest(caseSensitive(body))
}

// laxBool is a boolean as the engines' request models read it (pydantic's lax mode): true and
// false, 1 and 0, and the strings 1/0, on/off, t/f, true/false, y/n, yes/no in any letter case.
type laxBool bool

func (v *laxBool) UnmarshalJSON(b []byte) error {
	s := strings.ToLower(strings.Trim(string(b), `"`))
	switch {
	case string(b) == "true" || string(b) == "1" || len(b) > 1 && b[0] == '"' && (s == "1" || s == "on" || s == "t" || s == "true" || s == "y" || s == "yes"):
		*v = true
	case string(b) == "false" || string(b) == "0" || string(b) == "null" || len(b) > 1 && b[0] == '"' && (s == "0" || s == "off" || s == "f" || s == "false" || s == "n" || s == "no"):
		*v = false
	default:
		return fmt.Errorf("input should be a valid boolean: %s", b)
	}
	return nil
}

// laxInt is a cap of the OpenAI routes as the engines' request models read an int field
// (pydantic's lax mode: vLLM's OpenAIBaseModel, SGLang's protocol.py models): an integer, a
// number with no fraction (100.0, 1e2), a string of digits ("100").
type laxInt int

func (n *laxInt) UnmarshalJSON(b []byte) error {
	v := b
	if len(b) > 2 && b[0] == '"' && b[len(b)-1] == '"' {
		v = b[1 : len(b)-1]
		if len(v) == 0 || bytes.IndexFunc(v, func(r rune) bool { return r < '0' || r > '9' }) >= 0 {
			return fmt.Errorf("input should be a valid integer, unable to parse string as an integer: %s", b)
		}
	}
	f, err := strconv.ParseFloat(string(v), 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		return fmt.Errorf("input should be a valid integer: %s", b)
	}
	*n = laxInt(f)
	return nil
}

// int is n as an *int (nil for none).
func (n *laxInt) int() *int {
	if n == nil {
		return nil
	}
	v := int(*n)
	return &v
}

// decodeRequest reads a request's members into their fields, numbers as they were written.
func decodeRequest(body []byte) (rawRequest, error) {
	var raw rawRequest
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	err := dec.Decode(&raw)
	return raw, err
}

// parse reads a request body into a job, validating it the way the engine would.
func (e *Engine) parse(rt route, r *http.Request, body []byte) (*job, *apiError) {
	raw, err := decodeCaseSensitive(body)
	if err != nil {
		return nil, errorf(400, "invalid request body: %v", err)
	}
	var lora string
	if raw.Model != nil && rt != routeGenerate {
		var ok bool
		if lora, ok = e.served(*raw.Model); !ok {
			return nil, errorf(404, "The model `%s` does not exist.", *raw.Model)
		}
	}
	// SGLang takes lora_path on /generate and on its OpenAI routes (protocol.py's completion and
	// chat requests carry it). Its OpenAI serving takes the adapter from a base:adapter model
	// first and from lora_path only when the model names none (serving_base.py,
	// _resolve_lora_path, "priority: model parameter > explicit lora_path", at sgl-project/sglang
	// main of 2026; releases before the syntax, SGLangModelAdapterIgnored, read lora_path only).
	// An adapter not loaded is refused by the registry's acquire: 400 "The following requested
	// LoRA adapters are not loaded: X" (python/sglang/srt/lora/lora_registry.py). The tokenizer
	// manager acquires it inside generate_request, which a stream runs after its 200 is out: a
	// streamed request is refused in its stream (writeStreamRefusal).
	if e.cfg.Engine == EngineSGLang {
		if lora == "" && raw.LoRAPath != nil {
			var err error
			if lora, err = oneAdapter(raw.LoRAPath); err != nil {
				return nil, errorf(400, "lora_path: %v", err)
			}
		}
		if lora != "" && !e.lora.has(lora) {
			aerr := errorf(400, "The following requested LoRA adapters are not loaded: %s\nLoaded adapters: %s.", lora, e.lora.keys())
			aerr.inBand = bool(raw.Stream)
			return nil, aerr
		}
	}
	if raw.Priority != nil {
		e.stats.priority.Add(1)
		e.stats.lastPriority.Store(*raw.Priority)
		// vLLM refuses a priority other than 0 unless it schedules by priority
		// (vllm/v1/engine/processor.py, Processor.process_inputs).
		if e.cfg.Engine == EngineVLLM && *raw.Priority != 0 && e.cfg.SchedulingPolicy != SchedulingPriority {
			return nil, errorf(400, "Got priority %d but Priority scheduling is not enabled.", *raw.Priority)
		}
	}
	j := &job{route: rt, stream: bool(raw.Stream), kv: raw.KVTransferParams, prefillRank: -1, n: 1, lora: lora}
	if aerr := e.checkKVParams(rt, j); aerr != nil {
		return nil, aerr
	}
	if raw.StreamOptions != nil {
		if !raw.Stream && e.cfg.Engine == EngineVLLM {
			return nil, errorf(400, "Stream options can only be defined when `stream=True`.")
		}
		j.includeUsage = raw.StreamOptions.IncludeUsage
		// vLLM puts usage on every event only when both are asked (should_include_usage in
		// vllm/entrypoints/openai/serving_engine.py: include_usage and continuous_usage_stats);
		// SGLang on continuous_usage_stats alone (serving_chat.py, serving_completions.py).
		j.eachUsage = raw.StreamOptions.ContinuousUsageStats && (j.includeUsage || e.cfg.Engine == EngineSGLang)
	}
	prompts, aerr := e.prompts(rt, &raw)
	if aerr != nil {
		return nil, aerr
	}
	s := Sampling{IgnoreEOS: raw.IgnoreEOS, StopTokenIDs: raw.StopTokenIDs}
	var stop json.RawMessage
	switch rt {
	case routeChat:
		s.MaxTokens = firstInt(raw.MaxCompletionTokens.int(), raw.MaxTokens.int())
		stop = raw.Stop
	case routeCompletions:
		s.MaxTokens = firstInt(raw.MaxTokens.int())
		stop = raw.Stop
	case routeResponses:
		s.MaxTokens = firstInt(raw.MaxOutputTokens.int())
	case routeMessages:
		if raw.MaxTokens == nil {
			return nil, errorf(400, "max_tokens: Field required")
		}
		s.MaxTokens = int(*raw.MaxTokens)
		stop = raw.StopSequences
		// vLLM's Anthropic messages request has no ignore_eos, nor stop_token_ids: dropped unread.
		s.IgnoreEOS, s.StopTokenIDs = false, nil
	case routeGenerate:
		if sp := raw.SamplingParams; sp != nil {
			s.MaxTokens = firstInt(sp.MaxNewTokens)
			s.IgnoreEOS, s.StopTokenIDs, stop = sp.IgnoreEOS, sp.StopTokenIDs, sp.Stop
			if sp.N != nil {
				raw.N = sp.N
			}
			if sp.Seed != nil {
				raw.Seed = sp.Seed
			}
		}
		j.returnLogprob = raw.ReturnLogprob
	}
	if len(stop) > 0 && !bytes.Equal(stop, []byte("null")) {
		var one string
		if json.Unmarshal(stop, &one) == nil {
			s.Stop = []string{one}
		} else if err := json.Unmarshal(stop, &s.Stop); err != nil {
			return nil, errorf(400, "stop must be a string or a list of strings")
		}
	}
	if raw.Seed != nil {
		s.Seed = uint64(*raw.Seed)
	}
	if raw.N != nil {
		if *raw.N < 1 {
			return nil, errorf(400, "n must be at least 1, got %d", *raw.N)
		}
		j.n = *raw.N
	}
	if raw.MinTokens != nil && s.MaxTokens > 0 && *raw.MinTokens > s.MaxTokens {
		return nil, errorf(400, "min_tokens (%d) must be less than or equal to max_tokens (%d)", *raw.MinTokens, s.MaxTokens)
	}
	if s.MaxTokens < 0 {
		return nil, errorf(400, "max_tokens must be at least 1")
	}
	j.s = s
	for _, p := range prompts {
		if len(p) == 0 {
			return nil, errorf(400, "the prompt is empty")
		}
		j.items = append(j.items, item{prompt: p})
	}
	if e.cfg.Engine == EngineSGLang && rt == routeResponses {
		// SGLang's ResponsesRequest has no bootstrap fields: they are dropped unread.
		raw.BootstrapHost, raw.BootstrapPort, raw.BootstrapRoom = nil, nil, nil
	}
	if aerr := e.parseBootstrap(j, &raw); aerr != nil {
		return nil, aerr
	}
	if aerr := e.pickRank(j, &raw, r); aerr != nil {
		return nil, aerr
	}
	prefix := map[route]string{routeChat: "chatcmpl-", routeCompletions: "cmpl-", routeResponses: "resp_", routeGenerate: "", routeMessages: "msg_"}[rt]
	if rid, ok := e.sglangAnswerID(raw.RID, rt, j); ok {
		j.id = rid
	} else {
		rid := r.Header.Get("X-Request-Id")
		if rid == "" {
			rid = randHex(8)
		}
		j.id = prefix + rid
	}
	j.reqID = j.id + "-" + randHex(4) // vLLM ≥ 0.14 randomizes internal ids
	return j, nil
}

// sglangAnswerID is the id an SGLang engine names a request's answer with on its OpenAI routes
// and /generate, and true; false on vLLM. SGLang takes the body's rid and never the
// X-Request-Id header (serving_base.py _generate_request_id: the request's rid, else the route's
// prefix and a fresh uuid4; /generate's meta_info id is the rid, else a uuid4 hex); a request of
// many samples names each rid_<i> and its answer after the first (io_struct.py _normalize_rid).
func (e *Engine) sglangAnswerID(rawRID json.RawMessage, rt route, j *job) (string, bool) {
	if e.cfg.Engine != EngineSGLang || rt == routeResponses || rt == routeMessages {
		return "", false
	}
	var rid string
	if json.Unmarshal(rawRID, &rid) != nil || rid == "" {
		switch rt {
		case routeChat:
			return "chatcmpl-" + randHex(16), true
		case routeCompletions:
			return "cmpl-" + randHex(16), true
		}
		return randHex(16), true
	}
	if j.n > 1 || len(j.items) > 1 {
		return rid + "_0", true
	}
	return rid, true
}

func firstInt(ps ...*int) int {
	for _, p := range ps {
		if p != nil {
			return *p
		}
	}
	return 0
}

// prompts returns the token ids of each prompt of the request.
func (e *Engine) prompts(rt route, raw *rawRequest) ([][]uint32, *apiError) {
	switch rt {
	case routeChat:
		if len(raw.Messages) == 0 {
			return nil, errorf(400, "messages must not be empty")
		}
		return [][]uint32{chatPrompt(raw.Messages, raw.template)}, nil
	case routeMessages:
		if len(raw.Messages) == 0 {
			return nil, errorf(400, "messages must not be empty")
		}
		msgs := raw.Messages
		if len(raw.System) > 0 && !bytes.Equal(raw.System, []byte("null")) {
			msgs = append([]message{{Role: "system", Content: raw.System}}, msgs...)
		}
		return [][]uint32{chatPrompt(msgs)}, nil
	case routeResponses:
		var msgs []message
		if raw.Instructions != "" {
			b, _ := json.Marshal(raw.Instructions)
			msgs = append(msgs, message{Role: "system", Content: b})
		}
		var s string
		if json.Unmarshal(raw.Input, &s) == nil {
			b, _ := json.Marshal(s)
			msgs = append(msgs, message{Role: "user", Content: b})
		} else {
			var in []message
			if err := json.Unmarshal(raw.Input, &in); err != nil || len(in) == 0 {
				return nil, errorf(400, "input must be a string or a list of messages")
			}
			msgs = append(msgs, in...)
		}
		return [][]uint32{chatPrompt(msgs)}, nil
	case routeCompletions:
		return textOrIDs(raw.Prompt, "prompt")
	default:
		if len(raw.InputIDs) > 0 && !bytes.Equal(raw.InputIDs, []byte("null")) {
			return textOrIDs(raw.InputIDs, "input_ids")
		}
		return textOrIDs(raw.Text, "text")
	}
}

// textOrIDs reads a string, a list of strings, a list of ids or a list of id lists.
func textOrIDs(raw json.RawMessage, field string) ([][]uint32, *apiError) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return [][]uint32{Tokenize(s)}, nil
	}
	var ss []string
	if json.Unmarshal(raw, &ss) == nil && len(ss) > 0 {
		out := make([][]uint32, len(ss))
		for i, t := range ss {
			out[i] = Tokenize(t)
		}
		return out, nil
	}
	var ids []uint32
	if json.Unmarshal(raw, &ids) == nil && len(ids) > 0 {
		return [][]uint32{ids}, nil
	}
	var batch [][]uint32
	if json.Unmarshal(raw, &batch) == nil && len(batch) > 0 {
		return batch, nil
	}
	return nil, errorf(400, "%s must be a string, a list of strings, or token ids", field)
}

// template is what shapes a chat prompt besides its messages, as vLLM's chat requests and
// TokenizeChatRequest both take it.
type template struct {
	Tools                json.RawMessage `json:"tools"`
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs"`
	AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
	ContinueFinalMessage bool            `json:"continue_final_message"`
}

// chatPrompt applies the fake chat template: the tools and the template's arguments (their
// JSON's words), a role token and the content's words per message, then the assistant token
// unless add_generation_prompt is false or the final message is continued.
func chatPrompt(msgs []message, tpl ...template) []uint32 {
	var ids []uint32
	var t template
	if len(tpl) > 0 {
		t = tpl[0]
	}
	for _, x := range []struct {
		mark string
		raw  json.RawMessage
	}{{"<|tools|>", t.Tools}, {"<|kwargs|>", t.ChatTemplateKwargs}} {
		if len(x.raw) > 0 && string(x.raw) != "null" {
			ids = append(append(ids, wordID(x.mark)), Tokenize(string(x.raw))...)
		}
	}
	for _, m := range msgs {
		ids = append(ids, wordID("<|"+m.Role+"|>"))
		ids = append(ids, Tokenize(contentText(m.Content))...)
	}
	if t.ContinueFinalMessage || (t.AddGenerationPrompt != nil && !*t.AddGenerationPrompt) {
		return ids
	}
	return append(ids, wordID("<|assistant|>"))
}

func contentText(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var parts []struct {
		Text string `json:"text"`
	}
	_ = json.Unmarshal(raw, &parts)
	out := ""
	for _, p := range parts {
		out += " " + p.Text
	}
	return out
}

// checkKVParams applies what vLLM does with kv_transfer_params: ResponsesRequest has no such
// field, so /v1/responses ignores them; and a decode engine is never asked to prefill for a
// remote decode — a relayed prefill tag (do_remote_decode true) is a gateway bug, refused here
// so that a test sees it.
func (e *Engine) checkKVParams(rt route, j *job) *apiError {
	if e.cfg.Engine != EngineVLLM || j.kv == nil {
		return nil
	}
	if rt == routeResponses {
		j.kv = nil
		return nil
	}
	if e.cfg.Role == RoleDecode && j.kv.DoRemoteDecode {
		return errorf(400, "kv_transfer_params ask this decode engine to prefill for a remote decode (do_remote_decode=true): a prefill's request tag was relayed")
	}
	return nil
}

// parseBootstrap reads SGLang's bootstrap fields, scalar or one per item. An SGLang server in
// either disaggregation mode refuses a request without a room
// (python/sglang/srt/managers/scheduler.py, Scheduler.handle_generate_request): a decode never
// prefills a prompt itself.
func (e *Engine) parseBootstrap(j *job, raw *rawRequest) *apiError {
	if len(raw.BootstrapRoom) == 0 || bytes.Equal(raw.BootstrapRoom, []byte("null")) {
		if e.cfg.Engine == EngineSGLang && e.cfg.Role != RoleBoth {
			return errorf(400, "Invalid request: Disaggregated request received without bootstrap room id.")
		}
		return nil
	}
	n := len(j.items)
	rooms, err := scalarOrList[uint64](raw.BootstrapRoom, n)
	if err != nil {
		return errorf(400, "bootstrap_room: %v", err)
	}
	hosts, err := scalarOrList[string](raw.BootstrapHost, n)
	if err != nil {
		return errorf(400, "bootstrap_host: %v", err)
	}
	ports, err := scalarOrList[*int](raw.BootstrapPort, n)
	if err != nil {
		return errorf(400, "bootstrap_port: %v", err)
	}
	if j.n > 1 {
		return e.parseSampleBootstrap(j, raw)
	}
	if len(rooms) != n {
		return errorf(400, "bootstrap_room has %d entries for a batch of %d", len(rooms), n)
	}
	for i := range j.items {
		j.items[i].boot = &bootstrap{host: pick(hosts, i), port: pick(ports, i), room: rooms[i]}
	}
	if raw.DisaggPrefillDPRank != nil {
		j.prefillRank = *raw.DisaggPrefillDPRank
	}
	return nil
}

// parseSampleBootstrap reads the bootstrap fields of a request with n > 1 samples as SGLang's
// GenerateReqInput._normalize_bootstrap_params does: the B prompts become B×n requests, sample
// c of prompt i being number k = c×B + i (the text list repeated n times), and a scalar
// bootstrap_room r becomes r + k for request k. A list of rooms with n > 1 is refused, as by the
// releases that require parallel_sample_num == 1 for lists (others repeat the list n times,
// giving every sample of a prompt the same room).
func (e *Engine) parseSampleBootstrap(j *job, raw *rawRequest) *apiError {
	var room uint64
	if err := json.Unmarshal(raw.BootstrapRoom, &room); err != nil {
		return errorf(400, "Cannot use list bootstrap_room with parallel_sample_num > 1")
	}
	var host string
	var port *int
	if err := json.Unmarshal(raw.BootstrapHost, &host); err != nil && len(raw.BootstrapHost) > 0 {
		return errorf(400, "Cannot use list bootstrap_host with parallel_sample_num > 1")
	}
	if err := json.Unmarshal(raw.BootstrapPort, &port); err != nil && len(raw.BootstrapPort) > 0 {
		return errorf(400, "Cannot use list bootstrap_port with parallel_sample_num > 1")
	}
	b := len(j.items)
	for i := range j.items {
		for c := 0; c < j.n; c++ {
			j.items[i].samples = append(j.items[i].samples, &bootstrap{host: host, port: port, room: room + uint64(c*b+i)})
		}
		j.items[i].boot = j.items[i].samples[0]
	}
	if raw.DisaggPrefillDPRank != nil {
		j.prefillRank = *raw.DisaggPrefillDPRank
	}
	return nil
}

func pick[T any](xs []T, i int) T {
	var zero T
	if i < len(xs) {
		return xs[i]
	}
	if len(xs) == 1 {
		return xs[0]
	}
	return zero
}

// scalarOrList reads a JSON scalar (repeated n times) or a list.
func scalarOrList[T any](raw json.RawMessage, n int) ([]T, error) {
	if len(raw) == 0 {
		return make([]T, n), nil
	}
	var one T
	if err := json.Unmarshal(raw, &one); err == nil {
		out := make([]T, n)
		for i := range out {
			out[i] = one
		}
		return out, nil
	}
	var list []T
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, err
	}
	return list, nil
}

// pickRank chooses the DP rank that serves the request: routed_dp_rank (SGLang), the
// X-Data-Parallel-Rank header, the bootstrap room (SGLang follow_bootstrap_room), or round robin.
func (e *Engine) pickRank(j *job, raw *rawRequest, r *http.Request) *apiError {
	size := e.cfg.DPSize
	check := func(rank int) *apiError {
		if rank < 0 || rank >= size {
			return errorf(400, "data_parallel_rank %d is out of range [0, %d)", rank, size)
		}
		j.rank = rank
		return nil
	}
	if e.cfg.Engine == EngineSGLang && raw.RoutedDPRank != nil {
		// The prefill follows the bootstrap room (load_balance_method follow_bootstrap_room, as
		// /server_info says): a routed rank that disagrees with a request's room is a conflict.
		if r := *raw.RoutedDPRank; e.cfg.Role == RolePrefill && size > 1 && r >= 0 && r < size {
			for _, it := range j.items {
				for _, b := range append([]*bootstrap{it.boot}, it.samples...) {
					if b != nil && uint64(r) != b.room%uint64(size) {
						return errorf(400, "follow_bootstrap_room conflict: routed_dp_rank %d, but bootstrap_room %d %% dp_size %d = %d",
							r, b.room, size, b.room%uint64(size))
					}
				}
			}
		}
		j.routed = true
		return check(*raw.RoutedDPRank)
	}
	if h := r.Header.Get(HeaderDPRankIn); h != "" {
		if rank, err := strconv.Atoi(h); err == nil {
			j.routed = true
			return check(rank)
		}
	}
	if e.cfg.Engine == EngineSGLang && len(j.items) > 0 && j.items[0].boot != nil {
		j.rank = int(j.items[0].boot.room % uint64(size))
		return nil
	}
	j.rank = int((e.rr.Add(1) - 1) % uint64(size))
	return nil
}

// tokenize answers POST /tokenize as vLLM does: {"model", "prompt"} or {"model", "messages"} →
// {"count", "max_model_len", "tokens"}, the token ids the engine would compute for that prompt
// (chat: with the template applied).
func (e *Engine) tokenize(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<20))
	if err != nil {
		e.writeError(w, errorf(400, "reading the body: %v", err))
		return
	}
	var raw rawRequest
	if err := json.Unmarshal(body, &raw); err != nil {
		e.writeError(w, errorf(400, "invalid JSON: %v", err))
		return
	}
	rt := routeCompletions
	if len(raw.Messages) > 0 {
		rt = routeChat
	}
	ps, apiErr := e.prompts(rt, &raw)
	if apiErr != nil {
		e.writeError(w, apiErr)
		return
	}
	if len(ps) != 1 {
		e.writeError(w, errorf(400, "tokenize takes one prompt"))
		return
	}
	writeJSON(w, 200, map[string]any{"count": len(ps[0]), "max_model_len": 1 << 20, "tokens": ps[0]})
}
