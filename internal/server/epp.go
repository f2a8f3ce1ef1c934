package server

import (
	"context"

	"go.opentelemetry.io/otel/trace"

	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/record"
)

// Director is the server's director: the middle of every request, the Endpoint Picker's too.
func (s *Server) Director() *director.Director { return s.d }

// BodyBudget is the process-wide budget of request body bytes held at once: take reserves
// (false: they do not fit), give returns.
func (s *Server) BodyBudget() (take func(int64) bool, give func(int64)) {
	return s.bodies.take, s.bodies.give
}

// Begin counts a request another door took (the Endpoint Picker's) in flight.
func (s *Server) Begin() { s.inflight.Add(1) }

// Finish ends a request Begin counted: reported as the server reports its own (metrics, status
// page, span, access log).
func (s *Server) Finish(ctx context.Context, rec *record.Record, written int64, status int, span trace.Span, aborted bool) {
	s.inflight.Add(-1)
	s.finish(ctx, rec, written, status, span, aborted, aborted)
}

// Go runs f in the background; Wait waits for it.
func (s *Server) Go(f func()) { s.bg.Go(f) }
