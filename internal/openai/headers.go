package openai

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
)
