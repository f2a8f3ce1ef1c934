package server

import (
	"net/http"

	"github.com/baton-llm/baton/internal/openai"
)

// servePDAdvice answers GET /pd/advice?total=N&ttft_slo=D&tpot_slo=D (status listener): the
// recommended split of N workers (default: the fleet's) for the SLOs (default the
// configuration's), the predictions for it and for the current split, and the fit they rest
// on. A what-if the advisor cannot read is a 400.
func (s *Server) servePDAdvice(w http.ResponseWriter, r *http.Request) {
	if !s.d.Advising() {
		openai.WriteError(w, &openai.Error{Status: http.StatusNotFound, Code: openai.CodeNotFound, Message: "the PD advisor runs with --pd-disaggregation"})
		return
	}
	a, param, msg := s.d.AdviceFor(r.URL.RawQuery)
	if msg != "" {
		openai.WriteError(w, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidRequest, Param: param, Message: msg})
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(openai.MarshalJSON(a))
}
