// Package openai holds the wire helpers Baton shares across routes: the OpenAI error envelope,
// top-level JSON field reading and editing on raw bytes, and header names.
package openai

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
)

// Error codes Baton mints, every one of them: a client-visible code is one of these (a test
// fails on a literal elsewhere, and on a code docs/REFERENCE.md's error list misses). Upstream errors
// are relayed unchanged and never use these. The PD legs prefix the upstream codes with the leg:
// prefill_upstream_timeout, decode_upstream_unreachable, decode_upstream_error.
const (
	CodeInvalidJSON = "invalid_json"
	// CodeDuplicateKey: the body names a top-level member twice.
	CodeDuplicateKey    = "duplicate_key"
	CodeDuplicateHeader = "duplicate_header"
	CodeBatchTooLarge   = "batch_too_large"
	CodeBodyReadFailed  = "body_read_failed"
	CodePayloadTooLarge = "payload_too_large"
	CodeInvalidAPIKey   = "invalid_api_key"
	CodeModelNotFound   = "model_not_found"
	// CodeModelRequired: a request that names no model, without a default_model.
	CodeModelRequired = "model_required"
	// CodeInvalidModel: a "model" no name could be (longer than Baton reads one).
	CodeInvalidModel = "invalid_model"
	// CodeInvalidLoRAPath: a lora_path that names no one adapter Baton can route (not a name,
	// several adapters in one batch, no adapter known, another base than the model's).
	CodeInvalidLoRAPath = "invalid_lora_path"
	// CodeAdapterLoadFailed: the request's LoRA adapter could not be loaded where it was sent.
	CodeAdapterLoadFailed  = "adapter_load_failed"
	CodeNotFound           = "not_found"
	CodeClientTimeout      = "client_timeout"
	CodeNotImplementedInPD = "not_implemented_in_pd_mode"
	// CodeRouteNotServed: no worker of the model serves the route (SGLang's /generate on vLLM).
	CodeRouteNotServed      = "route_not_served"
	CodeNoAvailableWorkers  = "no_available_workers"
	CodeUpstreamUnreachable = "upstream_unreachable"
	CodeUpstreamTimeout     = "upstream_timeout"
	// CodeUpstreamError: a PD leg's engine answered an error (prefixed with the leg).
	CodeUpstreamError = "upstream_error"
	// CodeUpstreamStreamError: the engine reported an error inside a stream it answered 200.
	CodeUpstreamStreamError = "upstream_stream_error"
	// CodeCutMidAnswer: an answer Baton cut after its head went out (its engine failed or
	// stalled mid-stream, the deadline passed); the client sees the connection end.
	CodeCutMidAnswer = "cut_mid_answer"
	// CodeUpstreamErrorTooLarge keeps a worker's error status whose body was too large to hold.
	CodeUpstreamErrorTooLarge = "upstream_error_too_large"
	// CodeUpstreamKeyRefused: the engine refused the key Baton sends it (401, 403).
	CodeUpstreamKeyRefused = "upstream_key_refused"
	// CodeKVHandoffUnavailable: a vLLM prefill answered without the KV transfer parameters the
	// decode needs.
	CodeKVHandoffUnavailable = "kv_handoff_unavailable"
	// CodeBootstrapInjectionFailed: Baton could not add SGLang's bootstrap fields to the body.
	CodeBootstrapInjectionFailed = "bootstrap_injection_failed"
	CodeHealthGenerateFailed     = "health_generate_failed"
	CodeDraining                 = "server_draining"
	CodeOverloaded               = "overloaded"
	// A tenant's limits: requests or tokens per minute, requests at once; the shared store that
	// counts them cannot be reached (failing closed).
	CodeTenantRateLimit   = "tenant_rate_limit_exceeded"
	CodeTenantConcurrency = "tenant_concurrency_exceeded"
	// A request that could not fit in its tenant's whole token bucket: never retryable.
	CodeTenantRequestTooLarge     = "tenant_request_too_large"
	CodeRateLimitStoreUnavailable = "rate_limit_store_unavailable"
	// Admission: a priority class's queue is full, or a request waited its timeout in it; a
	// priority header Baton does not know.
	CodeQueueFull = "queue_full"
	// The Endpoint Picker's: no endpoint of the proxy's subset hint can serve the request; a
	// batch request shed because every worker that could serve it is saturated.
	CodeNoEndpointInSubset = "no_endpoint_in_subset"
	CodeRequestShed        = "request_shed"
	// CodeOwnedField: a field only Baton sets, in a body the picker cannot edit; CodeBodyUnread:
	// the data plane sends the picker no body at all.
	CodeOwnedField      = "owned_field"
	CodeBodyUnread      = "epp_body_unread"
	CodeQueueTimeout    = "queue_timeout"
	CodeInvalidPriority = "invalid_priority"
	CodeInternalError   = "internal_error"

	// CodeTooManyWhatIfs: GET /pd/advice asked a what-if while its client, or all clients, had
	// as many being answered as Baton answers at once.
	CodeTooManyWhatIfs = "too_many_what_ifs"

	// The admin API's.
	CodeWorkerExists   = "worker_already_exists"
	CodeWorkerNotFound = "worker_not_found"
	CodeBadRequest     = "bad_request"
	CodeAdminDisabled  = "admin_disabled"
	// A tenant's key on a route that shows the whole fleet (GET /workers on the API port).
	CodeAdminKeyRequired = "admin_key_required"
	// CodeUnsupportedMedia: an admin write whose body is not declared JSON.
	CodeUnsupportedMedia = "unsupported_media_type"

	// Malformed requests Baton's HTTP/1.1 server refuses before any handler.
	CodeInvalidRequest              = "invalid_request"
	CodeHeadersTooLarge             = "headers_too_large"
	CodeHTTPVersionNotSupported     = "http_version_not_supported"
	CodeUnsupportedTransferEncoding = "unsupported_transfer_encoding"
	CodeExpectationFailed           = "expectation_failed"
)

// Error is a gateway-minted error answer: its status and the fields of the OpenAI error
// envelope. It only renders; what a failure means (retry, the worker at fault) is
// outcome.Failure's.
type Error struct {
	Status  int    // HTTP status sent to the client.
	Code    string // Machine-readable code, e.g. "model_not_found".
	Message string // Human-readable message.
	Param   string // Request parameter at fault; empty means JSON null.

	// RetryAfter, when set, is sent as the Retry-After header.
	RetryAfter string
	// NoRetry sends x-should-retry: false, which OpenAI's SDKs obey: a retry of the same
	// request cannot succeed, whatever its status says.
	NoRetry bool
}

// Error implements error.
func (e *Error) Error() string { return strconv.Itoa(e.Status) + " " + e.Code + ": " + e.Message }

// ErrorType returns the OpenAI error "type" for a status.
func ErrorType(status int) string {
	switch {
	case status == http.StatusUnauthorized:
		return "authentication_error"
	case status == http.StatusForbidden:
		return "permission_error"
	case status == http.StatusNotFound:
		return "not_found_error"
	case status == http.StatusTooManyRequests:
		return "rate_limit_error"
	case status >= 400 && status < 500:
		return "invalid_request_error"
	case status == http.StatusServiceUnavailable:
		return "service_unavailable_error"
	default:
		return "server_error"
	}
}

type envelope struct {
	Error envelopeBody `json:"error"`
}

type envelopeBody struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Code    string  `json:"code"`
	Param   *string `json:"param"`
}

// Marshal returns the envelope bytes for e.
func (e *Error) Marshal() []byte {
	b := envelopeBody{Message: e.Message, Type: ErrorType(e.Status), Code: e.Code}
	if e.Param != "" {
		p := e.Param
		b.Param = &p
	}
	return MarshalJSON(envelope{Error: b})
}

// MarshalJSON is json.Marshal without its HTML escaping: what Baton writes (error messages, the
// admin API, the status page's data, baton check --json) reads "Bearer <key>" and "none-n>1", not
// "\u003ckey\u003e". The values are Baton's own (strings, numbers, maps of them): an error can
// only be a bug, and panics.
func MarshalJSON(v any) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		panic("openai: " + err.Error())
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}

// CodeNoter is a response writer that keeps the error code of an answer written through it:
// Baton's server notes it on the request's record, for the metrics, the status page and the
// access log, instead of reading it back from the header.
type CodeNoter interface{ NoteErrorCode(code string) }

// WriteError writes e as an OpenAI error envelope with its status.
func WriteError(w http.ResponseWriter, e *Error) {
	if n, ok := w.(CodeNoter); ok {
		n.NoteErrorCode(e.Code)
	}
	body := e.Marshal()
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set(HeaderErrorCode, e.Code)
	if e.RetryAfter != "" {
		h.Set("Retry-After", e.RetryAfter)
	}
	if e.NoRetry {
		h.Set(HeaderShouldRetry, "false")
	}
	w.WriteHeader(e.Status)
	_, _ = w.Write(body)
}

// EngineMessage extracts an engine's error message: error.message (vLLM's envelope), error as
// a string, message (SGLang's flat one), or the text, bounded.
func EngineMessage(body []byte) string {
	var v struct {
		Error   json.RawMessage `json:"error"`
		Message string          `json:"message"`
	}
	if json.Unmarshal(body, &v) == nil {
		var nested struct {
			Message string `json:"message"`
		}
		var flat string
		switch {
		case json.Unmarshal(v.Error, &nested) == nil && nested.Message != "":
			return nested.Message
		case json.Unmarshal(v.Error, &flat) == nil && flat != "":
			return flat
		case v.Message != "":
			return v.Message
		}
	}
	s := strings.TrimSpace(string(body))
	if len(s) > 1024 {
		s = s[:1024] + "…"
	}
	if s == "" {
		s = "(empty body)"
	}
	return s
}
