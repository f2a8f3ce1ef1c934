package openai

import "bytes"

// Usage is what an answer says it cost in tokens.
type Usage struct {
	Prompt, Completion, Cached int
}

// LastUsage finds the last usage object in the tail of an answer: OpenAI's "usage" (with
// prompt_tokens_details.cached_tokens), or SGLang's /generate "meta_info"; false when the tail
// holds none (a null usage, a cut object, or none at all). It reads the numbers in place,
// without decoding the JSON: it runs at the end of every request.
func LastUsage(tail []byte) (Usage, bool) {
	for _, key := range [][]byte{[]byte(`"usage":`), []byte(`"meta_info":`)} {
		b := tail
		for {
			i := bytes.LastIndex(b, key)
			if i < 0 {
				break
			}
			if u, ok := scanUsage(tail[i+len(key):]); ok {
				return u, true
			}
			b = b[:i]
		}
	}
	return Usage{}, false
}

// scanUsage reads the token counts of the object b starts with, up to its closing brace.
func scanUsage(b []byte) (Usage, bool) {
	b = bytes.TrimLeft(b, " \t\r\n")
	if len(b) == 0 || b[0] != '{' {
		return Usage{}, false
	}
	end := closingBrace(b)
	if end < 0 {
		return Usage{}, false // cut off
	}
	u, okP, okC := usageFields(b[:end+1])
	return u, okP && okC
}

// usageFields reads the counts of one usage object: OpenAI's (prompt_tokens,
// completion_tokens, prompt_tokens_details.cached_tokens), or the Responses and Anthropic APIs'
// (input_tokens, output_tokens, input_tokens_details.cached_tokens or cache_read_input_tokens);
// okP and okC say which it holds.
func usageFields(obj []byte) (u Usage, okP, okC bool) {
	if u.Prompt, okP = intAfter(obj, `"prompt_tokens":`); !okP {
		u.Prompt, okP = intAfter(obj, `"input_tokens":`)
	}
	if u.Completion, okC = intAfter(obj, `"completion_tokens":`); !okC {
		u.Completion, okC = intAfter(obj, `"output_tokens":`)
	}
	var ok bool
	if u.Cached, ok = intAfter(obj, `"cached_tokens":`); !ok {
		u.Cached, _ = intAfter(obj, `"cache_read_input_tokens":`)
	}
	return u, okP, okC
}

// EventUsage reads the usage one stream event carries, whole or in part: an Anthropic stream
// gives the prompt's count in message_start and the completion's in message_delta.
func EventUsage(ev []byte) (u Usage, okP, okC bool) {
	for _, key := range [][]byte{[]byte(`"usage":`), []byte(`"meta_info":`)} {
		i := bytes.LastIndex(ev, key)
		if i < 0 {
			continue
		}
		b := bytes.TrimLeft(ev[i+len(key):], " \t\r\n")
		if len(b) == 0 || b[0] != '{' {
			continue
		}
		end := closingBrace(b)
		if end < 0 {
			continue
		}
		if u, okP, okC = usageFields(b[:end+1]); okP || okC {
			return u, okP, okC
		}
	}
	return Usage{}, false, false
}

// intAfter parses the non-negative integer that follows key in b.
func intAfter(b []byte, key string) (int, bool) {
	i := bytes.Index(b, []byte(key))
	if i < 0 {
		return 0, false
	}
	b = bytes.TrimLeft(b[i+len(key):], " \t\r\n")
	n, digits := 0, 0
	for _, c := range b {
		if c < '0' || c > '9' || digits > 15 {
			break
		}
		n, digits = n*10+int(c-'0'), digits+1
	}
	return n, digits > 0
}

// IsUsageOnlyEvent reports whether a stream event is the usage-only chunk that
// stream_options.include_usage adds before [DONE]: empty choices and a usage object.
func IsUsageOnlyEvent(ev []byte) bool {
	if !usageOnly(ev) {
		return false
	}
	// confirmed on what a client reads: the event's data, its comment lines and other fields
	// left out (a comment shaped like a usage event never takes a data line out with it), its
	// top-level members read as JSON: empty choices, a usage, and no error to be lost with it
	data, ok := EventDataWhole(ev)
	if !ok {
		return false
	}
	choices, ok := GetLast(data, "choices")
	if !ok || string(bytes.Join(bytes.Fields(choices), nil)) != "[]" {
		return false
	}
	if _, failed := GetLast(data, "error"); failed {
		return false
	}
	u, ok := GetLast(data, "usage")
	return ok && len(u) > 0 && u[0] == '{'
}

// usageOnly reports whether ev holds empty choices and a usage object.
func usageOnly(ev []byte) bool {
	i := bytes.Index(ev, []byte(`"choices":`))
	if i < 0 {
		return false
	}
	rest := bytes.TrimLeft(ev[i+len(`"choices":`):], " ")
	if len(rest) == 0 || rest[0] != '[' {
		return false
	}
	if rest = bytes.TrimLeft(rest[1:], " "); len(rest) == 0 || rest[0] != ']' {
		return false
	}
	_, ok := LastUsage(ev)
	return ok
}

// closingBrace is the index of the brace closing the object b starts with, -1 when cut off.
func closingBrace(b []byte) int {
	depth, inString := 0, false
	for i := 0; i < len(b); i++ {
		switch c := b[i]; {
		case inString && c == '\\':
			i++
		case c == '"':
			inString = !inString
		case inString:
		case c == '{':
			depth++
		case c == '}':
			if depth--; depth == 0 {
				return i
			}
		}
	}
	return -1
}

// ChoiceIndex reads the index of the choice a stream event carries — the first "index" of its
// "choices" array, where vLLM and SGLang write it, or the "index" of a /generate batch's sample
// event after its meta_info — and false for an event of no choice (the usage-only event, a
// /generate stream of one sample, another API's event).
func ChoiceIndex(ev []byte) (int, bool) {
	i := bytes.Index(ev, []byte(`"choices":`))
	if i < 0 {
		if m := bytes.LastIndex(ev, []byte(metaKey)); m >= 0 {
			if j := bytes.LastIndex(ev[m:], []byte(`"index":`)); j >= 0 {
				return intAfter(ev[m+j:], `"index":`)
			}
		}
		return 0, false
	}
	rest := bytes.TrimLeft(ev[i+len(`"choices":`):], " \t\r\n")
	if len(rest) == 0 || rest[0] != '[' {
		return 0, false
	}
	if r := bytes.TrimLeft(rest[1:], " \t\r\n"); len(r) == 0 || r[0] != '{' {
		return 0, false // empty choices
	}
	return intAfter(rest, `"index":`)
}

// WithoutEventUsage is the event ev with its data's top-level "usage" written null (null) or
// removed, every other byte as it was: the event its engine would have sent had the usage not
// been asked of it. An event whose data is not one JSON object on one data line is returned as
// it is.
func WithoutEventUsage(ev []byte, null bool) []byte {
	var data []byte
	rest, lines := ev, 0
	for len(rest) > 0 {
		var line []byte
		line, _, rest = nextLine(rest)
		if d, found := DataValue(line); found {
			data, lines = d, lines+1
		}
	}
	if lines != 1 || len(data) == 0 || data[0] != '{' {
		return ev
	}
	var edited []byte
	var err error
	if null {
		edited, err = Set(data, "usage", []byte("null"))
	} else {
		edited, err = Delete(data, "usage")
	}
	if err != nil {
		return ev
	}
	off := cap(ev) - cap(data) // data is a part of ev
	out := make([]byte, 0, len(ev)-len(data)+len(edited))
	return append(append(append(out, ev[:off]...), edited...), ev[off+len(data):]...)
}

// metaKey names the usage of an SGLang /generate sample; metaWindow bounds the bytes of one
// read for its counts, which SGLang writes first (id, finish_reason, prompt_tokens,
// completion_tokens, cached_tokens; the logprobs after them: tokenizer_manager.py).
const (
	metaKey    = `"meta_info":`
	metaWindow = 1 << 10
)

// SampleSum adds up the usage of every sample of an SGLang /generate answer that is a list — a
// batch of prompts, or n samples of one, each an object with its own meta_info — read in the
// chunks it is relayed in, keeping at most metaWindow bytes. A key inside a string is escaped
// (\"meta_info\":) and never read as one.
type SampleSum struct {
	matched   int    // the bytes of metaKey matched so far
	capturing bool   // reading a meta_info object
	obj       []byte // its bytes so far (at most metaWindow)
	depth     int
	inString  bool
	escaped   bool
	sum       Usage
	samples   int
}

// Feed reads the next chunk of the answer.
func (s *SampleSum) Feed(b []byte) {
	for _, c := range b {
		if s.capturing {
			s.capture(c)
			continue
		}
		switch {
		case c == metaKey[s.matched]:
			s.matched++
		case c == metaKey[0]:
			s.matched = 1
		default:
			s.matched = 0
		}
		if s.matched == len(metaKey) {
			s.matched, s.capturing, s.obj, s.depth, s.inString, s.escaped = 0, true, s.obj[:0], 0, false, false
		}
	}
}

// capture takes the next byte of a meta_info value, adding its counts once its object closed
// (or its first metaWindow bytes were read).
func (s *SampleSum) capture(c byte) {
	if s.depth == 0 && (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
		return // before the object
	}
	if s.depth == 0 && c != '{' {
		s.capturing = false // not an object (null): no counts
		return
	}
	s.obj = append(s.obj, c)
	switch {
	case s.escaped:
		s.escaped = false
	case s.inString && c == '\\':
		s.escaped = true
	case c == '"':
		s.inString = !s.inString
	case s.inString:
	case c == '{':
		s.depth++
	case c == '}':
		s.depth--
	}
	if s.depth == 0 || len(s.obj) >= metaWindow {
		if u, okP, okC := usageFields(s.obj); okP && okC {
			s.sum.Prompt += u.Prompt
			s.sum.Completion += u.Completion
			s.sum.Cached += u.Cached
			s.samples++
		}
		s.capturing = false
	}
}

// Usage is the answer's usage: every sample's completion, and its prompt (and cached) tokens
// once per prompt — each of a prompt's samples reports the prompt, which was computed once —
// given samples per prompt (n; 0 or 1: one); false when no sample reported its counts.
func (s *SampleSum) Usage(samples int) (Usage, bool) {
	u := s.sum
	if samples > 1 {
		u.Prompt, u.Cached = u.Prompt/samples, u.Cached/samples
	}
	return u, s.samples > 0
}
