// Package record is the one record of a request Baton serves: created where the request
// arrives, carried on its context (From is the typed accessor), written by the stages that learn
// something (the model, how it was served, the attempts, the worker or pair, the KV handoff, the
// error code) and read once it ended by what reports it (metrics, status page, span, access
// log). No stage learns anything from headers it wrote itself or from the bytes it relayed.
//
// One goroutine — the request's handler — writes a record; the reporters read it after the
// handler returned.
package record

import (
	"context"
	"time"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/tenant"
)

// Record is what Baton knows of one request.
type Record struct {
	RequestID string // X-Request-Id: the client's, or Baton's
	// Method is the request's method; Client the address it came from (the connection's peer,
	// or what a gateway in front says it saw), for the access log.
	Method, Client string
	// Route is the route pattern that served it ("POST /v1/completions"), "other" for none;
	// set when the handler returned.
	Route string
	Model string // the model the client asked for ("" until the body is read)
	// Stream: the client asked for a stream (its first byte is the first token's).
	Stream bool
	// ModelLabel is Model's metric label (metrics.Model), once worked out for the request.
	ModelLabel string
	Mode       Mode // how it was served
	Attempts   int  // tries made, the first included

	// The attempt that answered: a regular worker, or a PD pair and its KV handoff outcome
	// (pd.Handoff*). Cleared between attempts (NextAttempt).
	Worker, Prefill, Decode string
	Handoff                 Handoff

	// Decisions is why each worker of the attempt was chosen (X-Baton-Route; only when asked for).
	Decisions string

	// Usage is what the answer said it cost, read by the relay from the engine's answer as it
	// reached the client (the PD usage rewrite included); UsageKnown is false when the answer
	// ended without one, or did not end.
	Usage      openai.Usage
	UsageKnown bool

	// Start is the request's arrival; FirstByte the first body byte to the client (zero: none).
	Start, FirstByte time.Time

	// Code is the error code of a failure Baton reported without an error answer of its own
	// (a stream that carried the engine's error event); an answer's own code is in its header.
	Code string

	// Room for the fleet sharing work: at what priority the request ran, and how long it
	// queued (who asked is Who).
	Class     Class
	QueueWait time.Duration

	// ByStreamUsage: the request is a tenant's stream, charged by the usage its events carried
	// should it end without its final usage (the engine asked for usage on every event); Streamed
	// is the completion tokens they reported last, summed over the stream's choices, and
	// StreamCounted says any came (proxy.Orders asks the relay to read them).
	ByStreamUsage bool
	// Samples is the samples asked per prompt (n, sampling_params.n; 0: one): each reports the
	// prompt, which is counted once.
	Samples       int
	Streamed      int
	StreamCounted bool
	// Reserved: the tenant's limits reserved tokens for the request, and its charge is counted
	// when that reservation is settled (baton_tenant_tokens_total), whether or not its answer
	// carried usage.
	Reserved bool
	// Served is the model the workers know the request's by, the one that served it (an alias's
	// target, a fallback); "" when it is the name the client gave.
	Served string
	// Who is the tenant Baton identified (Tenant is its name).
	Who *tenant.Tenant

	// What the engines did with the request, for charging one that ended without usage (see
	// Charge). PrefillComputed: a prefill leg was given the request (a connection was made) and
	// did not refuse it (no answer, or a 2xx); AnswerComputed: likewise a leg that generates (a
	// regular or decode leg; not a decode Baton cancelled, before its answer, because its prefill
	// failed). Each stays true once set, whatever a retry meets later.
	// EnginePrompt is the prompt tokens an engine reported before the answer ended (a prefill
	// leg's usage, a stream's first usage event), 0 when none did; of a request of several
	// prompts (Prompts), PromptsReported is how many of them it covers.
	PrefillComputed, AnswerComputed bool
	EnginePrompt                    int
	Prompts, PromptsReported        int

	// For the PD advisor: the prefill leg's time (dispatch to its answer; 0 when unknown), and
	// the requests the pair's prefill and decode had in flight besides it when it was chosen.
	PrefillTime             time.Duration
	PrefillBusy, DecodeBusy int
	// LocalPrefill: the attempt's decode serves it alone by pd_local_prefill_threshold.
	LocalPrefill bool
}

// Mode is how a request was served: by one worker, or through a pair (SGLang's style or
// vLLM's; the Endpoint Picker's pairs are "pd", the style being the data plane's sidecar's).
type Mode string

const (
	ModeRegular  Mode = "regular"
	ModePD       Mode = "pd"
	ModePDSGLang Mode = "pd_sglang"
	ModePDVLLM   Mode = "pd_vllm"
)

// Handoff is a PD request's KV handoff outcome (X-Baton-Kv-Handoff): pd's Handoff* values.
type Handoff string

// Class is the priority class a request ran at (X-Baton-Priority): admit.Class's names.
type Class string

type key struct{}

// With returns ctx carrying rec.
func With(ctx context.Context, rec *Record) context.Context {
	return context.WithValue(ctx, key{}, rec)
}

// From returns the record ctx carries; without one (a handler called outside the server's
// middleware, as `baton check` does), a fresh record nobody reads.
func From(ctx context.Context) *Record {
	if rec, ok := ctx.Value(key{}).(*Record); ok {
		return rec
	}
	return &Record{}
}

// TenantName names the tenant Baton identified ("" for none): Who's name, the one reference to
// the tenant the record keeps.
func (r *Record) TenantName() string {
	if r.Who == nil {
		return ""
	}
	return r.Who.Name
}

// NextAttempt clears what one attempt learned, as the next starts.
func (r *Record) NextAttempt() {
	r.Worker, r.Prefill, r.Decode, r.Handoff, r.Decisions = "", "", "", "", ""
	r.PrefillTime, r.PrefillBusy, r.DecodeBusy, r.LocalPrefill = 0, 0, 0, false
}

// Charge is what a request cost, in prompt and completion tokens, by what the engines did
// (the table "What a request is charged" of docs/REFERENCE.md, "Tenants and limits"):
//
//   - the engine's usage, when the answer carried it whole;
//   - when a leg that generates was given the request and did not refuse it: the prompt (the
//     count an engine reported, else the estimate) and, for a stream, the completion tokens the
//     engine last reported on its events (continuous_usage_stats); an answer that reported
//     none before it stopped (a non-streamed one shows no progress before it ends; an engine
//     that does not report on every event) is charged the completion it asked for,
//     completionEstimate (what the reservation covered);
//   - when only a prefill leg computed it (the decode refused it or never started): the prompt;
//   - nothing when no engine was given it (refused before dispatch, no connection made) or
//     every engine given it refused it with an error status.
func (r *Record) Charge(promptEstimate, completionEstimate int) (prompt, completion int) {
	if r.UsageKnown {
		return r.Usage.Prompt, r.Usage.Completion
	}
	if !r.AnswerComputed && !r.PrefillComputed {
		return 0, 0
	}
	prompt = promptEstimate
	switch {
	case r.EnginePrompt > 0 && r.Prompts > 1 && r.PromptsReported < r.Prompts:
		// Some of its prompts reported (a stream cut before the others' events): the whole
		// request's count, never the part reported alone.
		prompt = max(r.EnginePrompt, promptEstimate)
	case r.EnginePrompt > 0:
		prompt = r.EnginePrompt
	}
	switch {
	case !r.AnswerComputed:
		return prompt, 0
	case r.ByStreamUsage && r.StreamCounted:
		return prompt, r.Streamed
	}
	return prompt, completionEstimate
}
