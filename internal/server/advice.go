package server

import (
	"net"
	"net/http"

	"github.com/baton-llm/baton/internal/openai"
)

// servePDAdvice answers GET /pd/advice?total=N&ttft_slo=D&tpot_slo=D (status listener): the
// recommended split of N workers (default: the fleet's) for the SLOs (default the
// configuration's), the predictions for it and for the current split, and the fit they rest
// on. A what-if the advisor cannot read is a 400; one past the bounds of what-ifs answered at
// once (director.MaxWhatIfsPerClient, by the connection's host, and director.MaxWhatIfs) a 429.
func (s *Server) servePDAdvice(w http.ResponseWriter, r *http.Request) {
	if !s.d.Advising() {
		openai.WriteError(w, &openai.Error{Status: http.StatusNotFound, Code: openai.CodeNotFound, Message: "the PD advisor runs with --pd-disaggregation"})
		return
	}
	// The peer's host, not a header such as X-Forwarded-For: a client chooses what it sends.
	client, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		client = r.RemoteAddr
	}
	a, refusal := s.d.AdviceFor(client, r.URL.RawQuery)
	if refusal != nil {
		openai.WriteError(w, refusal)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(openai.MarshalJSON(a))
}
