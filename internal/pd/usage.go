package pd

import (
	"bytes"
	"math"
	"slices"
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

// readPrefillUsage reads usage from a prefill response (chat/completions or responses shape).
// Nothing is unmarshalled (this runs on every vLLM PD request): the answer's top level is
// scanned for its usage, the usage for the members that matter, and their integers parsed in
// place. A member present with anything but an integer (or null) makes the usage unreadable.
func readPrefillUsage(body []byte) prefillUsage {
	raw, ok := openai.GetLast(body, "usage")
	if !ok || len(raw) == 0 || raw[0] != '{' {
		return prefillUsage{}
	}
	prompt, hasPrompt, ok1 := intMember(raw, "prompt_tokens")
	input, hasInput, ok2 := intMember(raw, "input_tokens")
	cacheRead, hasCacheRead, ok3 := intMember(raw, "cache_read_input_tokens")
	promptCached, ok4 := cachedTokens(raw, "prompt_tokens_details")
	inputCached, ok5 := cachedTokens(raw, "input_tokens_details")
	if !ok1 || !ok2 || !ok3 || !ok4 || !ok5 {
		return prefillUsage{}
	}
	switch {
	case hasPrompt:
		return prefillUsage{prompt: prompt, cached: promptCached, ok: true}
	case hasInput && hasCacheRead:
		return prefillUsage{prompt: input, cached: cacheRead, ok: true}
	case hasInput:
		return prefillUsage{prompt: input, cached: inputCached, ok: true}
	}
	return prefillUsage{}
}

// intMember reads the integer member key of obj: its value, whether it is there (not null),
// and false when it is there but not an integer.
func intMember(obj []byte, key string) (n int, present, ok bool) {
	raw, found := openai.GetLast(obj, key)
	if !found || string(raw) == "null" {
		return 0, false, true
	}
	n, err := strconv.Atoi(string(raw))
	if err != nil || raw[0] == '+' || (len(raw) > 1 && raw[0] == '0') || (len(raw) > 2 && raw[0] == '-' && raw[1] == '0') {
		if n, ok := wholeNumber(raw); ok {
			return n, true, true
		}
		return 0, false, false
	}
	return n, true, true
}

// wholeNumber reads a JSON number with a fraction or an exponent whose value is a whole number
// (1e2, 100.0): the count a client's JSON parser reads from it (JavaScript's numbers, Python's
// float as its SDK's int). Past 2^53 no float is exact, and such a spelling is not read.
func wholeNumber(raw []byte) (int, bool) {
	if !jsonNumber(raw) {
		return 0, false
	}
	f, err := strconv.ParseFloat(string(raw), 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		return 0, false
	}
	return int(f), true
}

// jsonNumber reports whether b is a number in JSON's grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
func jsonNumber(b []byte) bool {
	digits := func(i int) int { // the end of the run of digits at i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		return i
	}
	i := 0
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		i = digits(i)
	default:
		return false
	}
	if i < len(b) && b[i] == '.' {
		if j := digits(i + 1); j > i+1 {
			i = j
		} else {
			return false
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if j := digits(i); j > i {
			i = j
		} else {
			return false
		}
	}
	return i == len(b)
}

// cachedTokens reads details.cached_tokens of obj, 0 when absent.
func cachedTokens(obj []byte, details string) (int, bool) {
	raw, found := openai.GetLast(obj, details)
	if !found || string(raw) == "null" {
		return 0, true
	}
	if len(raw) == 0 || raw[0] != '{' {
		return 0, false
	}
	n, _, ok := intMember(raw, "cached_tokens")
	return n, ok
}

// answerTop is what one pass over an answer object's top level finds for the decode's usage
// check and its rewrite: the last response, message and usage members (of a key that repeats,
// the last is what a client's JSON parser keeps), the first usage's bounds, how many usages
// there are, and the scan's error. The check and the rewrite share it,
// where a Get for each member would scan the answer once per member and per reader.
type answerTop struct {
	found        [3][]byte // response, message, usage: the last of each
	uStart, uEnd int       // the first usage's bounds, for the rewrite
	usages       int
	err          error
}

// scanTop scans obj's top level once for answerTop.
func scanTop(obj []byte) answerTop {
	var t answerTop
	t.err = openai.Members(obj, func(k []byte, start, end int) bool {
		i := 0
		switch string(k) {
		case "response":
		case "message":
			i = 1
		case "usage":
			if i = 2; t.usages == 0 {
				t.uStart, t.uEnd = start, end
			}
			t.usages++
		default:
			return true
		}
		t.found[i] = obj[start:end]
		return true
	})
	return t
}

// fixUsage rewrites the usage of a decode response object (or of the response inside a
// responses-API event) with the prefill's prompt view. It returns obj unchanged when there is
// no usage to fix.
func fixUsage(obj []byte, pu prefillUsage) []byte { return fixUsageTop(obj, scanTop(obj), pu) }

// fixUsageTop is fixUsage with obj's top level already scanned (t).
func fixUsageTop(obj []byte, t answerTop, pu prefillUsage) []byte {
	found := t.found
	for i, key := range []string{"response", "message"} { // a responses or messages stream's event
		if inner := found[i]; found[2] == nil && len(inner) > 0 && inner[0] == '{' { // a usage of its own is the one clients read
			if fixed := fixUsage(inner, pu); !bytes.Equal(fixed, inner) {
				if out, err := openai.Set(obj, key, fixed); err == nil {
					return out
				}
			}
			return obj
		}
	}
	u := found[2]
	if len(u) == 0 || u[0] != '{' {
		return obj
	}
	if _, ok := openai.GetLast(u, "cache_read_input_tokens"); ok {
		return fixAnthropicUsage(obj, u, pu)
	}
	u2, ok := fixedUsage(u, pu)
	if !ok {
		return obj
	}
	if t.usages == 1 && t.err == nil { // the one usage member's value replaced in place
		return slices.Concat(obj[:t.uStart], u2, obj[t.uEnd:])
	}
	out, err := openai.Set(obj, "usage", u2)
	if err != nil {
		return obj
	}
	return out
}

// fixedUsage returns the OpenAI-shaped usage object u (chat and completions, or responses)
// rewritten with the prefill's prompt view, and false when u is neither shape or cannot be
// edited.
func fixedUsage(u []byte, pu prefillUsage) ([]byte, bool) {
	promptKey, completionKey, detailsKey := "prompt_tokens", "completion_tokens", "prompt_tokens_details"
	if _, ok := openai.GetLast(u, promptKey); !ok {
		promptKey, completionKey, detailsKey = "input_tokens", "output_tokens", "input_tokens_details"
		if _, ok := openai.GetLast(u, promptKey); !ok {
			return nil, false
		}
	}
	completion, _, _ := intMember(u, completionKey) // 0 when it is not an integer
	details := []byte("{}")
	if raw, ok := openai.GetLast(u, detailsKey); ok && len(raw) > 0 && raw[0] == '{' {
		details = raw
	}
	details, err := openai.Set(details, "cached_tokens", strconv.AppendInt(nil, int64(pu.cached), 10))
	if err != nil {
		return nil, false
	}
	u2, err := openai.Edit(u, []openai.Field{
		{Key: promptKey, Value: strconv.AppendInt(nil, int64(pu.prompt), 10)},
		{Key: "total_tokens", Value: strconv.AppendInt(nil, int64(pu.prompt+completion), 10)},
		{Key: detailsKey, Value: details},
	}, nil)
	return u2, err == nil
}

// fixAnthropicUsage rewrites an Anthropic-style usage in its own shape: input_tokens and
// cache_read_input_tokens from the prefill's view; nothing is added.
func fixAnthropicUsage(obj, u []byte, pu prefillUsage) []byte {
	sets := []openai.Field{{Key: "cache_read_input_tokens", Value: strconv.AppendInt(nil, int64(pu.cached), 10)}}
	if _, ok := openai.GetLast(u, "input_tokens"); ok {
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
func fixUsageEvent(ev []byte, pu prefillUsage) []byte { return checkEvent(ev, nil, pu) }

// checkEvent checks the decode's usage in one streamed event (check, when set) and rewrites it
// to the prefill's view (pu, when known), the event's JSON scanned once for both; events without
// usage pass unchanged. The event is read as a client reads it: its data lines joined, a key
// spelled with escapes ("us\u0061ge") the key it spells.
func checkEvent(ev []byte, check *kvCheck, pu prefillUsage) []byte {
	if !bytes.Contains(ev, []byte(`"usage"`)) && !bytes.Contains(ev, []byte(`\u`)) { // only \u escapes spell letters
		return ev
	}
	data, ok := openai.EventDataWhole(ev)
	data = bytes.TrimLeft(data, " \t\r\n") // JSON's whitespace before the object, which clients' parsers skip
	if !ok || len(data) == 0 || data[0] != '{' {
		return ev
	}
	t := scanTop(data)
	if check != nil {
		check.observeTop(t)
	}
	if !pu.ok {
		return ev
	}
	fixed := fixUsageTop(data, t, pu)
	if bytes.Equal(fixed, data) {
		return ev
	}
	return openai.ReplaceEventDataWhole(ev, fixed)
}
