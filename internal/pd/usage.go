package pd

import (
	"bytes"
	"encoding/json"
	"strconv"

	"github.com/baton-llm/baton/internal/openai"
)

// The client's usage is the truth: prompt and cached tokens as the prefill saw them (its own
// prefix-cache hits), completion tokens from the decode. A decode that loaded the KV reports the
// transferred tokens as cached; Baton rewrites that in the body and in the streamed usage chunk.

// prefillUsage is the prompt side of the usage a prefill reported.
type prefillUsage struct {
	prompt, cached int
	ok             bool
}

type usageJSON struct {
	PromptTokens  *int `json:"prompt_tokens"`
	InputTokens   *int `json:"input_tokens"`
	CacheRead     *int `json:"cache_read_input_tokens"` // Anthropic-style messages
	PromptDetails struct {
		Cached int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
	InputDetails struct {
		Cached int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
}

// readPrefillUsage reads usage from a prefill response (chat/completions or responses shape).
func readPrefillUsage(body []byte) prefillUsage {
	// Only the usage object is decoded: the answer's top level is scanned, not unmarshalled
	// (this runs on every vLLM PD request).
	raw, ok := openai.Get(body, "usage")
	if !ok || len(raw) == 0 || raw[0] != '{' {
		return prefillUsage{}
	}
	var u usageJSON
	if json.Unmarshal(raw, &u) != nil {
		return prefillUsage{}
	}
	switch {
	case u.PromptTokens != nil:
		return prefillUsage{prompt: *u.PromptTokens, cached: u.PromptDetails.Cached, ok: true}
	case u.InputTokens != nil && u.CacheRead != nil:
		return prefillUsage{prompt: *u.InputTokens, cached: *u.CacheRead, ok: true}
	case u.InputTokens != nil:
		return prefillUsage{prompt: *u.InputTokens, cached: u.InputDetails.Cached, ok: true}
	}
	return prefillUsage{}
}

// fixUsage rewrites the usage of a decode response object (or of the response inside a
// responses-API event) with the prefill's prompt view. It returns obj unchanged when there is
// no usage to fix.
func fixUsage(obj []byte, pu prefillUsage) []byte {
	for _, key := range []string{"response", "message"} { // a responses or messages stream's event
		if inner, ok := openai.Get(obj, key); ok && len(inner) > 0 && inner[0] == '{' {
			if fixed := fixUsage(inner, pu); !bytes.Equal(fixed, inner) {
				if out, err := openai.Set(obj, key, fixed); err == nil {
					return out
				}
			}
			return obj
		}
	}
	u, ok := openai.Get(obj, "usage")
	if !ok || len(u) == 0 || u[0] != '{' {
		return obj
	}
	if _, ok := openai.Get(u, "cache_read_input_tokens"); ok {
		return fixAnthropicUsage(obj, u, pu)
	}
	var (
		promptKey, completionKey, detailsKey = "prompt_tokens", "completion_tokens", "prompt_tokens_details"
	)
	if _, ok := openai.Get(u, promptKey); !ok {
		promptKey, completionKey, detailsKey = "input_tokens", "output_tokens", "input_tokens_details"
		if _, ok := openai.Get(u, promptKey); !ok {
			return obj
		}
	}
	completion := 0
	if raw, ok := openai.Get(u, completionKey); ok {
		_ = json.Unmarshal(raw, &completion)
	}
	details := []byte("{}")
	if raw, ok := openai.Get(u, detailsKey); ok && len(raw) > 0 && raw[0] == '{' {
		details = raw
	}
	details, err := openai.Set(details, "cached_tokens", strconv.AppendInt(nil, int64(pu.cached), 10))
	if err != nil {
		return obj
	}
	u2, err := openai.Edit(u, []openai.Field{
		{Key: promptKey, Value: strconv.AppendInt(nil, int64(pu.prompt), 10)},
		{Key: "total_tokens", Value: strconv.AppendInt(nil, int64(pu.prompt+completion), 10)},
		{Key: detailsKey, Value: details},
	}, nil)
	if err != nil {
		return obj
	}
	out, err := openai.Set(obj, "usage", u2)
	if err != nil {
		return obj
	}
	return out
}

// fixAnthropicUsage rewrites an Anthropic-style usage in its own shape: input_tokens and
// cache_read_input_tokens from the prefill's view; nothing is added.
func fixAnthropicUsage(obj, u []byte, pu prefillUsage) []byte {
	sets := []openai.Field{{Key: "cache_read_input_tokens", Value: strconv.AppendInt(nil, int64(pu.cached), 10)}}
	if _, ok := openai.Get(u, "input_tokens"); ok {
		sets = append(sets, openai.Field{Key: "input_tokens", Value: strconv.AppendInt(nil, int64(pu.prompt), 10)})
	}
	u2, err := openai.Edit(u, sets, nil)
	if err != nil {
		return obj
	}
	if out, err := openai.Set(obj, "usage", u2); err == nil {
		return out
	}
	return obj
}

// fixUsageEvent rewrites the usage in one streamed event; events without usage pass unchanged.
func fixUsageEvent(ev []byte, pu prefillUsage) []byte {
	if !bytes.Contains(ev, []byte(`"usage"`)) {
		return ev
	}
	data, ok := openai.EventData(ev)
	if !ok || len(data) == 0 || data[0] != '{' {
		return ev
	}
	fixed := fixUsage(data, pu)
	if bytes.Equal(fixed, data) {
		return ev
	}
	return openai.ReplaceEventData(ev, fixed)
}
