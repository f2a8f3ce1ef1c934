// Package ssetest is a reference SSE client for tests: what a client dispatches from a whole
// stream, by the HTML Living Standard's rules for interpreting an event stream, written plainly
// so that Baton's own readers can be held to it.
package ssetest

import (
	"bytes"
	"strings"
)

// Dispatched returns the data of each event a client dispatches from stream. Lines end at CRLF,
// LF or CR. A field is named by its line up to the first colon (the whole line without one), and
// its value loses one leading space; a comment's name is empty. The values of an event's "data"
// fields are joined by LF, and a blank line dispatches them when the event had one. A last line
// that never ended is not read. A leading byte order mark is not stripped: a caller that reads
// as browsers do strips it first.
func Dispatched(stream []byte) []string {
	var out, data []string
	for len(stream) > 0 {
		i := bytes.IndexAny(stream, "\r\n")
		if i < 0 {
			break
		}
		line := string(stream[:i])
		if stream[i] == '\r' && i+1 < len(stream) && stream[i+1] == '\n' {
			i++
		}
		stream = stream[i+1:]
		if line == "" {
			if data != nil {
				out = append(out, strings.Join(data, "\n"))
			}
			data = nil
			continue
		}
		if name, value, _ := strings.Cut(line, ":"); name == "data" {
			data = append(data, strings.TrimPrefix(value, " "))
		}
	}
	return out
}
