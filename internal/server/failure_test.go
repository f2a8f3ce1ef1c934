package server

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"syscall"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/worker"
)

// Every kind of failure in every phase, read once at the attempt boundary (outcome.FailureOf)
// and rendered by the HTTP door: its kind and phase, what the client gets (status and code, an
// aborted connection, nothing at all), whether a retry follows, and what the worker's circuit
// breaker makes of it.
func TestEveryFailureKindAndPhase(t *testing.T) {
	w := worker.New(config.Worker{URL: "http://engine:8000"})
	dial := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	const abort, none = -1, 0 // the connection aborted; nothing written (the client left, or the stream went out whole)
	for _, c := range []struct {
		name    string
		err     error
		kind    outcome.Kind
		phase   outcome.Phase
		status  int
		code    string
		retry   bool
		failure bool // a failure the worker's circuit breaker records
	}{
		{"a worker's 503, held", &outcome.Failure{Worker: w.URL, Status: 503, Body: []byte(`{"error":"busy"}`)}, outcome.KindWorker, outcome.BeforeHead, 503, "", true, true},
		{"a worker's 400, held", &outcome.Failure{Worker: w.URL, Status: 400, Body: []byte(`{"error":"bad"}`)}, outcome.KindWorker, outcome.BeforeHead, 400, "", false, false},
		{"a worker unreachable", proxy.Classify(w, "", time.Second, dial), outcome.KindWorker, outcome.BeforeHead, 502, openai.CodeUpstreamUnreachable, true, true},
		{"a decode leg unreachable", proxy.Classify(w, "decode", time.Second, dial), outcome.KindWorker, outcome.BeforeHead, 502, "decode_" + openai.CodeUpstreamUnreachable, true, true},
		{"a worker past its deadline", proxy.Classify(w, "", time.Second, context.DeadlineExceeded), outcome.KindTimeout, outcome.BeforeHead, 504, openai.CodeUpstreamTimeout, true, true},
		{"no worker to choose", director.SelectionError(&policy.NoWorkerError{Role: "regular", Model: "m"}), outcome.KindNoWorker, outcome.BeforeHead, 503, openai.CodeNoAvailableWorkers, true, false},
		{"a model nobody serves", director.SelectionError(&policy.NoWorkerError{Model: "m", Unserved: true}), outcome.KindModelUnserved, outcome.BeforeHead, 404, openai.CodeModelNotFound, false, false},
		{"a route nobody serves", director.SelectionError(&policy.NoWorkerError{Model: "m", Unrouted: "/generate"}), outcome.KindRouteUnserved, outcome.BeforeHead, 501, openai.CodeRouteNotServed, false, false},
		{"refused by Baton", outcome.Answer(&openai.Error{Status: 400, Code: openai.CodeInvalidRequest, Message: "no"}), outcome.KindRefused, outcome.BeforeHead, 400, openai.CodeInvalidRequest, false, false},
		{"the client gone", proxy.ErrClientGone, outcome.KindClientGone, outcome.BeforeHead, none, "", false, false},
		{"the request's deadline", outcome.ErrRequestTimeout, outcome.KindTimeout, outcome.BeforeHead, 504, openai.CodeUpstreamTimeout, false, false},
		{"a panic", proxy.Classify(w, "", time.Second, &proxy.PanicError{Where: "handler", Value: "boom"}), outcome.KindInternal, outcome.BeforeHead, 500, openai.CodeInternalError, false, false},
		{"an error nothing classified", errors.New("something else"), outcome.KindInternal, outcome.BeforeHead, 500, openai.CodeInternalError, false, false},
		{"a read failure before the first byte", &proxy.ReadError{Err: errors.New("reset")}, outcome.KindWorker, outcome.BeforeHead, 500, openai.CodeInternalError, false, false},
		{"a failure after the first byte", proxy.ErrAbort, outcome.KindWorker, outcome.Streaming, abort, "", false, false},
		{"a read failure after the first byte", &proxy.ReadError{Err: errors.New("reset"), Written: true}, outcome.KindWorker, outcome.Streaming, abort, "", false, false},
		{"the engine's error event in a stream", &proxy.InBandError{Status: 500, Message: "oom"}, outcome.KindWorker, outcome.InBand, none, openai.CodeUpstreamStreamError, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := outcome.FailureOf(c.err)
			if f.Kind() != c.kind || f.Phase != c.phase {
				t.Errorf("kind %v, phase %d; want %v, %d", f.Kind(), f.Phase, c.kind, c.phase)
			}
			if v := f.Verdict(); v.Retryable != c.retry || (v.Sample && v.Failure && f.Worker != "") != c.failure {
				t.Errorf("verdict %+v; want retryable %v, breaker failure %v", v, c.retry, c.failure)
			}
			s := testServer(t)
			rw := httptest.NewRecorder()
			rec := &record.Record{}
			r := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
			aborted := func() (aborted bool) {
				defer func() {
					if v := recover(); v != nil {
						aborted = v == http.ErrAbortHandler
					}
				}()
				s.writeFailure(rw, r, rec, f)
				return false
			}()
			switch {
			case c.status == abort:
				if !aborted {
					t.Errorf("the connection was not aborted: %d %s", rw.Code, rw.Body)
				}
			case c.status == none:
				if aborted || rw.Body.Len() != 0 || rec.Code != c.code {
					t.Errorf("aborted %v, wrote %q, record's code %q; want nothing written, code %q", aborted, rw.Body, rec.Code, c.code)
				}
			default:
				got := ""
				if rw.Body.Len() > 0 && rw.Body.Bytes()[0] == '{' && c.code != "" {
					got = errorCode(t, rw.Body.String())
				}
				if aborted || rw.Code != c.status || got != c.code {
					t.Errorf("answered %d %q (aborted %v); want %d %q", rw.Code, got, aborted, c.status, c.code)
				}
			}
		})
	}
}
