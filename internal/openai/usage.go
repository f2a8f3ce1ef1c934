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
	depth, end := 0, -1
	inString := false
	for i := 0; i < len(b) && end < 0; i++ {
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
				end = i
			}
		}
	}
	if end < 0 {
		return Usage{}, false // cut off
	}
	obj := b[:end+1]
	var u Usage
	var okP, okC bool
	u.Prompt, okP = intAfter(obj, `"prompt_tokens":`)
	u.Completion, okC = intAfter(obj, `"completion_tokens":`)
	u.Cached, _ = intAfter(obj, `"cached_tokens":`)
	return u, okP && okC
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
