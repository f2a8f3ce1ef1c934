package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// Request is the small typed view of a client body that Baton routes on. The raw bytes stay the
// source of truth: Baton forwards them and edits only the members it owns.
type Request struct {
	// Body is the client's bytes, less the top-level members Baton owns (OwnedFields), which
	// never reach an engine from a client.
	Body   []byte
	Model  string // Top-level "model"; empty when absent or null.
	Stream bool   // Top-level "stream" is true.
	N      int    // Top-level "n"; 0 when absent.
	// ReturnLogprob is SGLang /generate's top-level "return_logprob" is true.
	ReturnLogprob bool
}

// OwnedFields are the top-level request members that steer the engines' KV handoff. Only Baton
// may set them: a client's kv_transfer_params would make a vLLM engine with a KV connector pin
// blocks for minutes (do_remote_decode) or connect to a host of the client's choosing
// (do_remote_prefill); SGLang's bootstrap and DP rank fields would send KV to, or wait on, a
// rendezvous the client names. ParseRequest removes them from every client body, on every route.
var OwnedFields = []string{
	"kv_transfer_params",
	"bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
	"routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank",
}

// ParseRequest validates body as a JSON object and reads the members Baton routes on in one pass
// over the top level, removing those Baton owns (OwnedFields; the rest of the bytes unchanged).
// Errors are client errors (HTTP 400).
func ParseRequest(body []byte) (*Request, error) {
	if !Valid(body) {
		return nil, fmt.Errorf("request body is not valid JSON")
	}
	r := &Request{Body: body}
	var perr error
	owned := false
	err := eachMember(body, func(key []byte, m member) bool {
		raw := body[m.valStart:m.valEnd]
		switch string(key) {
		case "model":
			if bytes.Equal(raw, []byte("null")) {
				return true
			}
			if len(raw) >= 2 && raw[0] == '"' && bytes.IndexByte(raw, '\\') < 0 {
				r.Model = string(raw[1 : len(raw)-1]) // no escapes: the bytes are the string
				return true
			}
			if err := json.Unmarshal(raw, &r.Model); err != nil {
				perr = fmt.Errorf(`"model" must be a string`)
				return false
			}
		case "stream":
			r.Stream = bytes.Equal(raw, []byte("true"))
		case "return_logprob":
			r.ReturnLogprob = bytes.Equal(raw, []byte("true"))
		case "n":
			if bytes.Equal(raw, []byte("null")) {
				return true
			}
			if err := json.Unmarshal(raw, &r.N); err != nil || r.N < 0 {
				perr = fmt.Errorf(`"n" must be a positive integer`)
				return false
			}
		default:
			owned = owned || isOwned(key)
		}
		return true
	})
	if err != nil {
		return nil, err
	}
	if perr != nil {
		return nil, perr
	}
	if owned {
		if r.Body, err = Edit(body, nil, OwnedFields); err != nil {
			return nil, err
		}
	}
	return r, nil
}

func isOwned(key []byte) bool {
	for _, f := range OwnedFields {
		if string(key) == f {
			return true
		}
	}
	return false
}
