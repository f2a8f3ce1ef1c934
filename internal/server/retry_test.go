package server

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/worker"
)

// The retry loop decides from the outcome table's verdict on one failure type, whoever minted
// it: a held worker answer, a transport failure, a deadline, Baton's own exhaustion or panic, a
// selection that found nothing, a failure marked final.
func TestRetryReason(t *testing.T) {
	w := &worker.Worker{URL: "http://w"}
	dial := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	for _, tc := range []struct {
		err       error
		reason    string
		retryable bool
		worker    string
	}{
		{&outcome.Failure{Worker: w.URL, Status: 503}, "status_503", true, w.URL},
		{&outcome.Failure{Worker: w.URL, Status: 429}, "status_429", true, w.URL},
		{&outcome.Failure{Worker: w.URL, Status: 501}, "", false, w.URL},
		{proxy.Classify(w, "", time.Second, dial), "transport", true, w.URL},
		{proxy.Classify(w, "decode", time.Second, context.DeadlineExceeded), "timeout", true, w.URL},
		{proxy.Classify(w, "", time.Second, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.EMFILE}), "local", false, ""},
		{proxy.Classify(w, "", time.Second, &proxy.PanicError{Where: "prefill_leg", Value: "boom"}), "internal", false, ""},
		{director.SelectionError(&policy.NoWorkerError{}), "status_503", true, ""},
		{director.SelectionError(&policy.NoWorkerError{Unserved: true}), "", false, ""},
		{&outcome.Failure{Status: 502, Final: true}, "status_502", false, ""},
		{outcome.Answer(&openai.Error{Status: 400}), "", false, ""},
		{proxy.ErrAbort, "", false, ""},
		{proxy.ErrClientGone, "", false, ""},
		{outcome.ErrRequestTimeout, "", false, ""},
	} {
		f := outcome.FailureOf(tc.err)
		v := f.Verdict()
		if v.Reason != tc.reason || v.Retryable != tc.retryable || f.Worker != tc.worker {
			t.Errorf("%v: verdict %q, %v, worker %q; want %q, %v, %q", tc.err, v.Reason, v.Retryable, f.Worker, tc.reason, tc.retryable, tc.worker)
		}
	}
}

// The tries ending because no worker is left to try (the ones that failed are avoided) answer
// with the last worker's answer, unchanged, and name that worker — not with "no available
// workers", which would hide a 429 behind a 503.
func TestLastWorkersAnswerWins(t *testing.T) {
	s, _, _ := gateway(t, nil)
	tries := 0
	busy := &outcome.Failure{Worker: "http://w:1", Status: 429, Header: http.Header{"Retry-After": {"7"}}, Body: []byte(`{"error":{"message":"rate limited"}}`)}
	rec := httptest.NewRecorder()
	r := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
	s.observe(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.withRetries(w, r, recordOf(r), func(r *http.Request, avoid map[string]bool) error {
			tries++
			if tries == 1 {
				return busy
			}
			return director.SelectionError(&policy.NoWorkerError{Role: "decode"})
		})
	})).ServeHTTP(rec, r)
	if rec.Code != 429 || !strings.Contains(rec.Body.String(), "rate limited") || rec.Header().Get("Retry-After") != "7" || rec.Header().Get(openai.HeaderWorker) != "http://w:1" {
		t.Errorf("after %d tries: %d %v %s", tries, rec.Code, rec.Header(), rec.Body.String())
	}
	if tries != 3 {
		t.Errorf("%d tries, want 3 (the selection may find a worker back)", tries)
	}
	// With no worker's answer at all, "no available workers" is the answer.
	rec = httptest.NewRecorder()
	s.observe(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.withRetries(w, r, recordOf(r), func(*http.Request, map[string]bool) error { return director.SelectionError(&policy.NoWorkerError{}) })
	})).ServeHTTP(rec, r)
	if rec.Code != 503 || !strings.Contains(rec.Body.String(), openai.CodeNoAvailableWorkers) || rec.Header().Get("Retry-After") != "1" {
		t.Errorf("no worker ever: %d, Retry-After %q: %s", rec.Code, rec.Header().Get("Retry-After"), rec.Body.String())
	}
}
