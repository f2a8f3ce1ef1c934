package pd

import (
	"sync/atomic"

	"github.com/baton-llm/baton/internal/openai"
)

// Whether the decode consumed the KV it was handed is read from the decode's own usage, before
// Baton rewrites it to the prefill's view: after loading the KV, vLLM reports
// prompt_tokens_details.cached_tokens (input_tokens_details on /v1/responses) as prompt_tokens
// - 1 — the last prompt token is computed again for its logits — and, when it computed the
// prompt, only its own prefix-cache hits (vllm/v1/core/sched/scheduler.py sets num_cached_tokens
// from num_computed_tokens once the remote KV arrived). vLLM sends the details only when started
// with --enable-prompt-tokens-details; without them, and on /v1/messages (whose usage has no
// such count of the decode's own), the check cannot tell, and the handoff keeps the
// connector's name.

// kvCheck is what a decode's usage said about its handoff.
type kvCheck struct{ v atomic.Int32 }

const (
	kvUnknown int32 = iota
	kvReceived
	kvRecomputed
)

// verdict names what the decode's usage said (Request.Consumed).
func (c *kvCheck) verdict() string {
	switch c.v.Load() {
	case kvReceived:
		return VerdictReceived
	case kvRecomputed:
		return VerdictRecomputed
	}
	return VerdictUnknown
}

// recomputed reports whether the decode said it computed the prompt it was handed.
func (c *kvCheck) recomputed() bool { return c != nil && c.v.Load() == kvRecomputed }

// observeTop reads the decode's usage in an answer, or a streamed event's JSON, whose top level
// is t, and reports whether it says the prompt was computed.
func (c *kvCheck) observeTop(t answerTop) bool {
	prompt, cached, ok := decodeUsageTop(t)
	switch {
	case !ok:
		return false
	case cached < prompt && uint64(prompt-cached) > 1: // the difference, without cached+1 wrapping
		c.v.Store(kvRecomputed)
		return true
	}
	c.v.CompareAndSwap(kvUnknown, kvReceived)
	return false
}

// decodeUsage reads the prompt and cached tokens of the usage in obj, or in the response it
// carries (a responses stream's event): ok false when either is missing.
func decodeUsage(obj []byte) (prompt, cached int, ok bool) { return decodeUsageTop(scanTop(obj)) }

// decodeUsageTop is decodeUsage with the answer's top level already scanned (t).
func decodeUsageTop(t answerTop) (prompt, cached int, ok bool) {
	u := t.found[2]
	if inner := t.found[0]; u == nil && len(inner) > 0 && inner[0] == '{' { // a usage of its own is the one clients read
		u, _ = openai.GetLast(inner, "usage")
	}
	if len(u) == 0 || u[0] != '{' {
		return 0, 0, false
	}
	for _, k := range [...][2]string{{"prompt_tokens", "prompt_tokens_details"}, {"input_tokens", "input_tokens_details"}} {
		p, present, okP := intMember(u, k[0])
		if !present || !okP {
			continue
		}
		raw, found := openai.GetLast(u, k[1])
		if !found || len(raw) == 0 || raw[0] != '{' {
			return 0, 0, false // vLLM without --enable-prompt-tokens-details
		}
		c, present, okC := intMember(raw, "cached_tokens")
		return p, c, present && okC
	}
	return 0, 0, false
}
