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
	// Route is the route pattern that served it ("POST /v1/completions"), "other" for none;
	// set when the handler returned.
	Route string
	Model string // the model the client asked for ("" until the body is read)
	// ModelLabel is Model's metric label (metrics.Model), once worked out for the request.
	ModelLabel string
	Mode       string // regular, pd_sglang or pd_vllm: how it was served
	Attempts   int    // tries made, the first included

	// The attempt that answered: a regular worker, or a PD pair and its KV handoff outcome
	// (pd.Handoff*). Cleared between attempts (NextAttempt).
	Worker, Prefill, Decode string
	Handoff                 string

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

	// Room for the fleet sharing work: who asked, at what priority, and how long it queued.
	Tenant, Class string
	QueueWait     time.Duration

	// CountEvents asks the relay to count the token events of a stream into Events (a tenant's
	// stream that ends without usage is charged by them). StripUsage: Baton asked the engine for
	// the stream's usage, which the client did not: the relay reads it from the usage-only event
	// and keeps that event from the client, whose bytes stay as the engine would have sent them.
	CountEvents, StripUsage bool
	Events                  int
	// Served is the model the workers know the request's by, the one that served it (an alias's
	// target, a fallback); "" when it is the name the client gave.
	Served string
	// HoldRefusals asks the proxy to hold a worker's 400 answer (not relay it) so that it can be
	// read: a context-window fallback is left to try.
	HoldRefusals bool
	// Who is the tenant Baton identified (Tenant is its name).
	Who *tenant.Tenant
}

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

// NextAttempt clears what one attempt learned, as the next starts.
func (r *Record) NextAttempt() {
	r.Worker, r.Prefill, r.Decode, r.Handoff, r.Decisions = "", "", "", "", ""
}
