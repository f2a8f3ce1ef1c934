package openai

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
)

// Header names Baton reads or writes, all in one place. Baton owns every X-Baton-* header: a
// worker's values for them are never relayed.
const (
	// HeaderRequestID carries the request id, the client's (when sane) or Baton's, to workers
	// and back.
	HeaderRequestID = "X-Request-Id"
	// HeaderTraceparent and HeaderTracestate are W3C trace context, forwarded to workers.
	HeaderTraceparent = "Traceparent"
	HeaderTracestate  = "Tracestate"

	// HeaderBatonPrefix starts every header Baton owns.
	HeaderBatonPrefix = "X-Baton-"
	// HeaderErrorCode repeats the code of an error Baton minted.
	HeaderErrorCode = "X-Baton-Error-Code"
	// HeaderShouldRetry is OpenAI's: its SDKs do not retry an answer that says false.
	HeaderShouldRetry = "X-Should-Retry"
	// HeaderModel names the model that served the request: the workers' name for it, a
	// fallback's when one served.
	HeaderModel = "X-Baton-Model"
	// HeaderWorker names the worker that answered (PD: the decode).
	HeaderWorker = "X-Baton-Worker"
	// HeaderPrefillWorker and HeaderDecodeWorker name a PD request's pair.
	HeaderPrefillWorker = "X-Baton-Prefill-Worker"
	HeaderDecodeWorker  = "X-Baton-Decode-Worker"
	// HeaderKVHandoff names a PD request's KV handoff outcome (nixl, mooncake, bootstrap, none-*).
	HeaderKVHandoff = "X-Baton-Kv-Handoff"
	// HeaderRoute says why each worker was chosen (opt-in: route_header).
	HeaderRoute = "X-Baton-Route"

	// HeaderDPRank pins a vLLM leg to a data parallel rank.
	HeaderDPRank = "X-Data-Parallel-Rank"

	// HeaderPriority names a request's priority class (echoed in the answer); HeaderSmgPriority
	// is smg's, read for switchers (its class names system and bulk too).
	HeaderPriority    = "X-Baton-Priority"
	HeaderSmgPriority = "X-Smg-Priority"
	// HeaderPrefiller is llm-d's header naming the prefill endpoint of a disaggregated request.
	HeaderPrefiller = "x-prefiller-host-port"
)

// maxRequestIDLen bounds a client's X-Request-Id; a longer one is replaced.
const maxRequestIDLen = 128

// MaxRequestIDLen is the longest X-Request-Id Baton takes from a client, and sends upstream.
const MaxRequestIDLen = maxRequestIDLen

// RequestID returns the request's id: the client's X-Request-Id when it sent exactly one of at
// most maxRequestIDLen visible ASCII characters, else a fresh one. The header is set to it, so
// that workers see the same id.
func RequestID(h http.Header) string {
	if v := h[HeaderRequestID]; len(v) == 1 && validRequestID(v[0]) {
		return v[0]
	}
	var b [16]byte
	_, _ = rand.Read(b[:])
	rid := hex.EncodeToString(b[:])
	h[HeaderRequestID] = []string{rid}
	return rid
}

func validRequestID(s string) bool {
	if s == "" || len(s) > maxRequestIDLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
