package pd

import (
	"bytes"
	"encoding/json"

	"github.com/baton-llm/baton/internal/openai"
)

// SGLang /generate with return_logprob: the prefill engine holds the prompt's input logprobs,
// the decode engine the rest. Baton prepends the prefill's meta_info.input_token_logprobs to the
// decode's, per batch index, in non-streamed bodies and in every streamed event that has them.

const keyMeta, keyInputLogprobs = "meta_info", "input_token_logprobs"

// prefillLogprobs returns the prefill's input_token_logprobs arrays by batch index, from a JSON
// object, a JSON array (batch) or an SSE body (the first event of each index).
func prefillLogprobs(body []byte) map[int][]byte {
	out := map[int][]byte{}
	trimmed := bytes.TrimSpace(body)
	switch {
	case len(trimmed) == 0:
	case trimmed[0] == '{':
		if lp := inputLogprobs(trimmed); lp != nil {
			out[indexOf(trimmed, 0)] = lp
		}
	case trimmed[0] == '[':
		var items []json.RawMessage
		if json.Unmarshal(trimmed, &items) == nil {
			for i, it := range items {
				if lp := inputLogprobs(it); lp != nil {
					out[indexOf(it, i)] = lp
				}
			}
		}
	default:
		er := openai.NewEventReader(bytes.NewReader(body))
		for {
			ev, err := er.Next()
			if data, ok := openai.EventData(ev); ok && len(data) > 0 && data[0] == '{' {
				if lp := inputLogprobs(data); lp != nil {
					if _, seen := out[indexOf(data, 0)]; !seen {
						out[indexOf(data, 0)] = bytes.Clone(lp)
					}
				}
			}
			if err != nil {
				break
			}
		}
	}
	return out
}

func inputLogprobs(obj []byte) []byte {
	meta, ok := openai.Get(obj, keyMeta)
	if !ok {
		return nil
	}
	lp, ok := openai.Get(meta, keyInputLogprobs)
	if !ok || len(lp) == 0 || lp[0] != '[' {
		return nil
	}
	return lp
}

func indexOf(obj []byte, def int) int {
	var i int
	if raw, ok := openai.Get(obj, "index"); ok && json.Unmarshal(raw, &i) == nil {
		return i
	}
	return def
}

// mergeObject prepends pre[index] to the object's meta_info.input_token_logprobs. It returns
// obj unchanged when either side has none.
func mergeObject(obj []byte, def int, pre map[int][]byte) []byte {
	p, ok := pre[indexOf(obj, def)]
	if !ok {
		return obj
	}
	meta, ok := openai.Get(obj, keyMeta)
	if !ok {
		return obj
	}
	d, ok := openai.Get(meta, keyInputLogprobs)
	if !ok || len(d) == 0 || d[0] != '[' {
		return obj
	}
	meta2, err := openai.Set(meta, keyInputLogprobs, concatArrays(p, d))
	if err != nil {
		return obj
	}
	out, err := openai.Set(obj, keyMeta, meta2)
	if err != nil {
		return obj
	}
	return out
}

// concatArrays joins two raw JSON arrays.
func concatArrays(a, b []byte) []byte {
	a, b = bytes.TrimSpace(a), bytes.TrimSpace(b)
	ia, ib := bytes.TrimSpace(a[1:len(a)-1]), bytes.TrimSpace(b[1:len(b)-1])
	out := make([]byte, 0, len(a)+len(b))
	out = append(out, '[')
	out = append(out, ia...)
	if len(ia) > 0 && len(ib) > 0 {
		out = append(out, ',')
	}
	out = append(out, ib...)
	return append(out, ']')
}

// mergeBody merges into a non-streamed decode body (object or batch array).
func mergeBody(body []byte, pre map[int][]byte) []byte {
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 || len(pre) == 0 {
		return body
	}
	if trimmed[0] == '{' {
		return mergeObject(trimmed, 0, pre)
	}
	var items []json.RawMessage
	if trimmed[0] != '[' || json.Unmarshal(trimmed, &items) != nil {
		return body
	}
	out := []byte{'['}
	for i, it := range items {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, mergeObject(it, i, pre)...)
	}
	return append(out, ']')
}

// mergeEvent merges into one streamed decode event; other events pass unchanged.
func mergeEvent(ev []byte, pre map[int][]byte) []byte {
	data, ok := openai.EventData(ev)
	if !ok || len(data) == 0 || data[0] != '{' {
		return ev
	}
	merged := mergeObject(data, 0, pre)
	if len(merged) == len(data) && bytes.Equal(merged, data) {
		return ev
	}
	return openai.ReplaceEventData(ev, merged) // event: and id: lines are kept
}
