package server

import (
	"net/http"

	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/record"
)

// admitRequest admits an inference request through the director (its batch, priority class,
// tenant and slot), rendering what the director decided: the class in X-Baton-Priority, the
// tenant's windows in OpenAI's rate-limit headers, a refusal as its error. Its End is to be
// deferred whatever ok says.
func (s *Server) admitRequest(w http.ResponseWriter, r *http.Request, rec *record.Record, preq *pd.Request) (*director.Admitted, bool) {
	a, ok := s.d.Admit(r.Context(), rec, preq, r.Header.Get(openai.HeaderPriority), r.Header.Get(openai.HeaderSmgPriority))
	if a.Class != "" {
		w.Header()[openai.HeaderPriority] = []string{string(a.Class)}
	}
	director.RateLimitHeaders(w.Header(), a.Limits)
	if !ok && a.Refusal != nil {
		openai.WriteError(w, a.Refusal)
	}
	return a, ok
}

// admitted admits requests to next in the default class, for routes without a body to read
// first.
func (s *Server) admitted(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		release, refusal, ok := s.d.Acquire(r.Context(), recordOf(r))
		if !ok {
			if refusal != nil {
				openai.WriteError(w, refusal)
			}
			return
		}
		defer release()
		next.ServeHTTP(w, r)
	})
}
