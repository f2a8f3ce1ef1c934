package openai

import (
	"bytes"
	"encoding/json"
	"strconv"

	"github.com/baton-llm/baton/internal/routes"
)

// RIDFor is the rid (raw JSON) Baton gives an SGLang engine for a request of body on path sent
// with the request id id — the route's answer prefix and id, so that the answer is named exactly
// as vLLM names it — and false for a request of many samples, or with no id, which get none.
func RIDFor(body []byte, path, id string) ([]byte, bool) {
	if id == "" || manySamples(body, path) {
		return nil, false
	}
	q, err := json.Marshal(routes.Of(path).AnswerID + id)
	return q, err == nil
}

// manySamples reports a request SGLang runs as a batch: n (or /generate's sampling_params.n)
// above 1, or a list of prompts (a completion's prompt, /generate's text or input_ids, that is a
// list of strings or of token lists) — anything but one prompt of one sample.
func manySamples(body []byte, path string) bool {
	if n, ok := Get(body, "n"); ok && above1(n) {
		return true
	}
	var prompts []string
	switch path {
	case "/v1/completions":
		prompts = []string{"prompt"}
	case "/generate":
		prompts = []string{"text", "input_ids"}
		if sp, ok := Get(body, "sampling_params"); ok {
			if n, ok := Get(sp, "n"); ok && above1(n) {
				return true
			}
		}
	}
	for _, k := range prompts {
		if v, ok := Get(body, k); ok && len(v) > 0 && v[0] == '[' {
			first := bytes.TrimLeft(v[1:], " \t\r\n")
			if len(first) > 0 && (first[0] == '"' || first[0] == '[') {
				return true
			}
		}
	}
	return false
}

// above1 reports a JSON number above 1 (a count SGLang would read as more than one sample; a
// value that is no number is the engine's to refuse).
func above1(raw []byte) bool {
	f, err := strconv.ParseFloat(string(bytes.TrimSpace(raw)), 64)
	return err == nil && f > 1
}
