// Package openai holds the wire helpers Baton shares across routes: the OpenAI error envelope,
// top-level JSON field reading and editing on raw bytes, and header names.
package openai

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Error codes Baton mints. Upstream errors are relayed unchanged and never use these.
const (
	CodeInvalidJSON        = "invalid_json"
	CodePayloadTooLarge    = "payload_too_large"
	CodeInvalidAPIKey      = "invalid_api_key"
	CodeModelNotFound      = "model_not_found"
	CodeNotImplementedInPD = "not_implemented_in_pd_mode"
	// CodeRouteNotServed: no worker of the model serves the route (SGLang's /generate on vLLM).
	CodeRouteNotServed      = "route_not_served"
	CodeNoAvailableWorkers  = "no_available_workers"
	CodeUpstreamUnreachable = "upstream_unreachable"
	CodeUpstreamTimeout     = "upstream_timeout"
	// CodeUpstreamStreamError: the engine reported an error inside a stream it answered 200.
	CodeUpstreamStreamError = "upstream_stream_error"
	CodeDraining            = "server_draining"
	CodeOverloaded          = "overloaded"
	CodeNotFound            = "not_found"
	CodeInternalError       = "internal_error"
	CodeDuplicateHeader     = "duplicate_header"
	CodeClientTimeout       = "client_timeout"
	CodeBatchTooLarge       = "batch_too_large"
	// CodeUpstreamErrorTooLarge keeps a worker's error status whose body was too large to hold.
	CodeUpstreamErrorTooLarge = "upstream_error_too_large"
)

// Error is a gateway-minted error: its status and the fields of the OpenAI error envelope.
type Error struct {
	Status  int    // HTTP status sent to the client.
	Code    string // Machine-readable code, e.g. "model_not_found".
	Message string // Human-readable message.
	Param   string // Request parameter at fault; empty means JSON null.

	// RetryAfter, when set, is sent as the Retry-After header.
	RetryAfter string
	// Worker is the URL of the worker whose failure this is, if any; a retry avoids it.
	Worker string
	// NoRetry marks a failure that a retry cannot fix, even with a retryable status.
	NoRetry bool
	// Reason is why a retry happens (metrics label) when it is not the status: transport,
	// timeout.
	Reason string
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
	out, _ := json.Marshal(envelope{Error: b}) // plain strings: cannot fail
	return out
}

// WriteError writes e as an OpenAI error envelope with its status.
func WriteError(w http.ResponseWriter, e *Error) {
	body := e.Marshal()
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set(HeaderErrorCode, e.Code)
	if e.RetryAfter != "" {
		h.Set("Retry-After", e.RetryAfter)
	}
	w.WriteHeader(e.Status)
	_, _ = w.Write(body)
}
