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

	"github.com/baton-llm/baton/internal/admit"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
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
		{selectionError(&policy.NoWorkerError{}), "status_503", true, ""},
		{selectionError(&policy.NoWorkerError{Unserved: true}), "", false, ""},
		{&outcome.Failure{Status: 502, Final: true}, "status_502", false, ""},
		{outcome.Answer(&openai.Error{Status: 400}), "", false, ""},
		{proxy.ErrAbort, "", false, ""},
		{proxy.ErrClientGone, "", false, ""},
		{outcome.ErrRequestTimeout, "", false, ""},
	} {
		reason, ok := retryReason(tc.err)
		if reason != tc.reason || ok != tc.retryable || failedWorker(tc.err) != tc.worker {
			t.Errorf("retryReason(%v) = %q, %v, worker %q; want %q, %v, %q", tc.err, reason, ok, failedWorker(tc.err), tc.reason, tc.retryable, tc.worker)
		}
	}
}

func TestAdmission(t *testing.T) {
	m := metrics.New(worker.NewRegistry())
	a := newAdmission(Admission{Max: 1, QueueSize: 1, QueueTimeout: 50 * time.Millisecond}, m)
	r := httptest.NewRequest(http.MethodPost, "/", nil)
	release, ok := a.acquire(httptest.NewRecorder(), r, admit.Default, admit.Default, 10, 10)
	if !ok {
		t.Fatal("the first request was not admitted")
	}
	// One may wait; it times out with 504 queue_timeout and Retry-After.
	rec := httptest.NewRecorder()
	if _, ok := a.acquire(rec, r, admit.Default, admit.Default, 10, 10); ok || rec.Code != 504 || rec.Header().Get("Retry-After") == "" || errorCode(t, rec.Body.String()) != openai.CodeQueueTimeout {
		t.Errorf("queued past its timeout: admitted %v, %d %q %s", ok, rec.Code, rec.Header().Get("Retry-After"), rec.Body)
	}
	// While one waits, the next finds the queue full.
	waiting := make(chan bool)
	go func() {
		_, ok := a.acquire(httptest.NewRecorder(), r, admit.Default, admit.Default, 10, 10)
		waiting <- ok
	}()
	for a.s.Waiting(admit.Default) == 0 {
		time.Sleep(time.Millisecond)
	}
	rec = httptest.NewRecorder()
	if _, ok := a.acquire(rec, r, admit.Default, admit.Default, 10, 10); ok || rec.Code != 503 || errorCode(t, rec.Body.String()) != openai.CodeQueueFull {
		t.Errorf("queue full: admitted %v, %d", ok, rec.Code)
	}
	release()
	if !<-waiting {
		t.Error("the waiting request did not get the released slot")
	}
	// A client that leaves while waiting is answered nothing and takes no slot.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	rec = httptest.NewRecorder()
	if _, ok := a.acquire(rec, r.WithContext(ctx), admit.Default, admit.Default, 10, 10); ok || rec.Body.Len() != 0 {
		t.Errorf("a gone client: admitted %v, answered %q", ok, rec.Body.String())
	}
	// Drain: a waiting request gets 503 server_draining at once.
	done := make(chan *httptest.ResponseRecorder)
	go func() {
		rec := httptest.NewRecorder()
		a.acquire(rec, r, admit.Batch, admit.Batch, 1, 1)
		done <- rec
	}()
	for a.s.Waiting(admit.Batch) == 0 {
		time.Sleep(time.Millisecond)
	}
	a.drain()
	if rec := <-done; rec.Code != 503 || errorCode(t, rec.Body.String()) != openai.CodeDraining {
		t.Errorf("drained: %d %s", rec.Code, rec.Body)
	}
	if release, ok := (*admission)(nil).acquire(httptest.NewRecorder(), r, admit.Default, admit.Default, 0, 0); !ok || release == nil {
		t.Error("no admission limit refused a request")
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
		s.withRetries(w, r, func(r *http.Request, avoid map[string]bool) error {
			tries++
			if tries == 1 {
				return busy
			}
			return selectionError(&policy.NoWorkerError{Role: "decode"})
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
		s.withRetries(w, r, func(*http.Request, map[string]bool) error { return selectionError(&policy.NoWorkerError{}) })
	})).ServeHTTP(rec, r)
	if rec.Code != 503 || !strings.Contains(rec.Body.String(), openai.CodeNoAvailableWorkers) {
		t.Errorf("no worker ever: %d %s", rec.Code, rec.Body.String())
	}
}

// The configuration's per-class settings reach the scheduler by class.
func TestClassSettings(t *testing.T) {
	size := 1000
	reserved, depth, timeout, promote := ClassSettings(config.Admission{ReservedSlots: map[string]int{"critical": 2},
		Classes: map[string]config.QueueClass{"batch": {Size: &size, Timeout: 10 * time.Minute, PromoteAfter: 2 * time.Minute}}})
	if reserved[admit.Critical] != 2 || reserved[admit.Batch] != 0 || depth[admit.Batch] == nil || *depth[admit.Batch] != 1000 ||
		depth[admit.Default] != nil || timeout[admit.Batch] != 10*time.Minute || timeout[admit.Default] != 0 ||
		promote[admit.Batch] != 2*time.Minute || promote[admit.Default] != 0 {
		t.Errorf("reserved %v, depth %v, timeout %v, promote %v", reserved, depth, timeout, promote)
	}
}
