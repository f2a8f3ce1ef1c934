package server

import (
	"net/http"
	"strconv"
	"time"

	"github.com/baton-llm/baton/internal/openai"
)

// servePDAdvice answers GET /pd/advice?total=N&ttft_slo=D&tpot_slo=D (status listener): the
// recommended split of N workers (default: the fleet's; 2 to 10,000) for the SLOs (Go durations
// or seconds, above 0 and at most 1h; default the configuration's), the predictions for it and
// for the current split, and the fit they rest on.
func (s *Server) servePDAdvice(w http.ResponseWriter, r *http.Request) {
	bad := func(param, msg string) {
		openai.WriteError(w, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidRequest, Param: param, Message: msg})
	}
	if !s.d.Advising() {
		openai.WriteError(w, &openai.Error{Status: http.StatusNotFound, Code: openai.CodeNotFound, Message: "the PD advisor runs with --pd-disaggregation"})
		return
	}
	q := r.URL.Query()
	total, err := strconv.Atoi(q.Get("total"))
	if q.Get("total") == "" {
		total, err = 0, nil
	} else if err != nil || total < 2 || total > 10_000 {
		bad("total", "total must be a whole number of workers from 2 to 10000 (one of each role at least)")
		return
	}
	var slo [2]time.Duration
	for i, name := range []string{"ttft_slo", "tpot_slo"} {
		v := q.Get(name)
		if v == "" {
			continue
		}
		d, err := time.ParseDuration(v)
		if err != nil {
			if f, ferr := strconv.ParseFloat(v, 64); ferr == nil && f > 0 && f <= 3600 {
				d, err = time.Duration(f*float64(time.Second)), nil
			}
		}
		if err != nil || d <= 0 || d > time.Hour {
			bad(name, name+" must be a duration above 0 and at most 1h (e.g. 2s, 50ms, or seconds: 0.05)")
			return
		}
		slo[i] = d
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(openai.MarshalJSON(s.d.Advice(total, slo[0], slo[1])))
}
