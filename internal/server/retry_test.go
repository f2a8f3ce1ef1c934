package server

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/worker"
)

func TestRetryReason(t *testing.T) {
	for _, tc := range []struct {
		err       error
		reason    string
		retryable bool
	}{
		{&proxy.UpstreamError{Status: 503}, "status_503", true},
		{&proxy.UpstreamError{Status: 429}, "status_429", true},
		{&proxy.UpstreamError{Status: 501}, "", false},
		{&openai.Error{Status: 502, Reason: "transport"}, "transport", true},
		{&openai.Error{Status: 504, Reason: "timeout"}, "timeout", true},
		{&openai.Error{Status: 503, Code: openai.CodeNoAvailableWorkers}, "status_503", true},
		{&openai.Error{Status: 502, NoRetry: true}, "", false},
		{&openai.Error{Status: 400}, "", false},
		{proxy.ErrAbort, "", false},
		{proxy.ErrClientGone, "", false},
		{outcome.ErrRequestTimeout, "", false},
	} {
		reason, ok := retryReason(tc.err)
		if reason != tc.reason || ok != tc.retryable {
			t.Errorf("retryReason(%v) = %q, %v; want %q, %v", tc.err, reason, ok, tc.reason, tc.retryable)
		}
	}
}

func TestAdmission(t *testing.T) {
	m := metrics.New(worker.NewRegistry())
	a := newAdmission(1, 1, 50*time.Millisecond, m)
	r := httptest.NewRequest(http.MethodPost, "/", nil)
	release, ok := a.acquire(httptest.NewRecorder(), r)
	if !ok {
		t.Fatal("the first request was not admitted")
	}
	// One may wait; it times out with 503 and Retry-After.
	rec := httptest.NewRecorder()
	if _, ok := a.acquire(rec, r); ok || rec.Code != 503 || rec.Header().Get("Retry-After") == "" {
		t.Errorf("queued past its timeout: admitted %v, %d %q", ok, rec.Code, rec.Header().Get("Retry-After"))
	}
	// While one waits, the next finds the queue full.
	waiting := make(chan bool)
	go func() {
		_, ok := a.acquire(httptest.NewRecorder(), r)
		waiting <- ok
	}()
	for a.waiting.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	rec = httptest.NewRecorder()
	if _, ok := a.acquire(rec, r); ok || rec.Code != 503 {
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
	if _, ok := a.acquire(rec, r.WithContext(ctx)); ok || rec.Body.Len() != 0 {
		t.Errorf("a gone client: admitted %v, answered %q", ok, rec.Body.String())
	}
	if release, ok := (*admission)(nil).acquire(httptest.NewRecorder(), r); !ok || release == nil {
		t.Error("no admission limit refused a request")
	}
}
