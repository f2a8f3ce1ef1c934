package proxy

import (
	"bytes"
	"encoding/json"
	"net/http"

	"github.com/baton-llm/baton/internal/outcome"
)

// Engines that answered a stream with 200 report a later failure inside it: vLLM writes
// data: {"error": {"message", "type", "param", "code"}} and then [DONE] (older releases, and
// SGLang's OpenAI routes, the flat {"object": "error", …, "code"} inside "error" or alone);
// SGLang's /generate ends with a chunk whose meta_info.finish_reason is {"type": "abort",
// "status_code", "message"}; responses streams send {"type": "error"} or "response.failed", and
// messages streams {"type": "error", "error": {…}}. Baton relays these bytes as they are — the
// client's SDK reads them — and counts the request as failed.

// InBandError is an engine's error event inside a stream it had answered 200 (outcome's).
type InBandError = outcome.InBandError

// maxErrorLine bounds an unfinished SSE line the watch keeps to read once it ends: error events
// are short; a longer line is passed over.
const maxErrorLine = 4 << 10

// watch spots an engine's error event in a stream relayed as it is, line by line across reads.
type watch struct {
	partial []byte // the start of an unfinished line (≤ maxErrorLine), allocated when first needed
	skip    bool   // the unfinished line is too long to be an error event: pass over it
	err     *InBandError
}

// see reads one chunk of the stream. Its lines end at LF, CR or CRLF, as an SSE client reads
// them (the LF of a CRLF ends an empty line, which no error event is); the chunk's next LF is
// looked for once, not once per line, so a chunk of lone CRs is read in one pass.
func (w *watch) see(b []byte) {
	lf := -1 // b's first LF at or after pos; len(b) when there is none
	for pos := 0; pos < len(b) && w.err == nil; {
		if lf < pos {
			if lf = bytes.IndexByte(b[pos:], '\n'); lf >= 0 {
				lf += pos
			} else {
				lf = len(b)
			}
		}
		end := lf
		if k := bytes.IndexByte(b[pos:lf], '\r'); k >= 0 {
			end = pos + k
		}
		line, ended := b[pos:end], end < len(b)
		pos = end + 1
		if w.skip {
			w.skip = !ended
			continue
		}
		if len(w.partial) > 0 {
			if len(w.partial)+len(line) > maxErrorLine {
				w.partial, w.skip = w.partial[:0], !ended
				continue
			}
			w.partial = append(w.partial, line...)
			line = w.partial
		}
		if !ended {
			if len(line) > maxErrorLine {
				w.partial, w.skip = w.partial[:0], true
			} else if len(w.partial) == 0 {
				w.partial = append(w.partial, line...)
			}
			continue
		}
		w.err = errorEvent(line)
		w.partial = w.partial[:0]
	}
}

// errorMarks are in the data of every engine's error event, whatever member comes first: a
// member or value "error" (vLLM, SGLang's OpenAI routes, responses and messages streams),
// "response.failed", or SGLang's "abort" finish reason. Each ends with its closing quote, which
// a JSON string's own text has escaped, so text that merely mentions them never matches; they
// begin without the opening quote, which JSON has everywhere and searching for it is slow.
var errorMarks = [][]byte{[]byte(`error"`), []byte(`abort"`), []byte(`.failed"`)}

// errorEvent returns the error one complete SSE line reports, or nil.
func errorEvent(line []byte) *InBandError {
	data, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r"), []byte("data:"))
	if !ok {
		return nil
	}
	data = bytes.TrimLeft(data, " \t\r\n") // SSE's one space, then what JSON parsers skip
	if len(data) == 0 || data[0] != '{' {
		return nil
	}
	for _, m := range errorMarks {
		if bytes.Contains(data, m) {
			return parseErrorEvent(data)
		}
	}
	return nil
}

// parseErrorEvent reads the status and message of an error event's data; nil when it turns out
// to be none.
func parseErrorEvent(data []byte) *InBandError {
	var v struct {
		Object   string          `json:"object"`
		Type     string          `json:"type"`
		Error    json.RawMessage `json:"error"`
		Code     json.RawMessage `json:"code"`
		Message  string          `json:"message"`
		MetaInfo *struct {
			FinishReason *struct {
				Type       string          `json:"type"`
				StatusCode json.RawMessage `json:"status_code"`
				Message    string          `json:"message"`
			} `json:"finish_reason"`
		} `json:"meta_info"`
	}
	if json.Unmarshal(data, &v) != nil {
		return nil
	}
	var detail struct {
		Code    json.RawMessage `json:"code"`
		Message string          `json:"message"`
	}
	switch {
	case len(v.Error) > 0 && v.Error[0] == '{':
		_ = json.Unmarshal(v.Error, &detail)
		return inBand(detail.Code, detail.Message)
	case len(v.Error) > 0 && v.Error[0] == '"':
		var msg string
		_ = json.Unmarshal(v.Error, &msg)
		return inBand(nil, msg)
	case v.Object == "error", v.Type == "error", v.Type == "response.failed":
		return inBand(v.Code, v.Message)
	case v.MetaInfo != nil && v.MetaInfo.FinishReason != nil && v.MetaInfo.FinishReason.Type == "abort":
		return inBand(v.MetaInfo.FinishReason.StatusCode, v.MetaInfo.FinishReason.Message)
	}
	return nil
}

// inBand builds the error of an event naming code (an HTTP status, or anything else) and msg.
func inBand(code json.RawMessage, msg string) *InBandError {
	status := http.StatusInternalServerError
	var n int
	if json.Unmarshal(code, &n) == nil && n >= 400 && n <= 599 {
		status = n
	}
	if len(msg) > 256 {
		msg = msg[:256] + "…"
	}
	return &InBandError{Status: status, Message: msg}
}
