package server

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/proxy"
)

// servePD runs a generation request through a prefill/decode pair.
func (s *Server) servePD(w http.ResponseWriter, r *http.Request) {
	a := s.admitPD(w, r)
	defer a.end()
	switch {
	case a.plan == nil: // answered
	case a.alone:
		s.serveOne(w, r, a.req, a.plan, a.adm.Orders)
	default:
		s.servePair(w, r, a)
	}
}

// admittedPD is a PD request read, admitted and planned (plan nil: answered already; alone: the
// decode serves it alone). preq is what the dispatch is given.
type admittedPD struct {
	admittedRegular
	preq  *pd.Request
	alone bool
}

// admitPD reads, admits and plans a PD request, answering it itself when it goes no further.
//
//go:noinline
func (s *Server) admitPD(w http.ResponseWriter, r *http.Request) *admittedPD {
	rec := recordOf(r)
	a := &admittedPD{}
	a.req, a.release = s.readRequest(w, r, rec)
	if a.req == nil {
		return a
	}
	a.preq = &pd.Request{Request: a.req, Path: r.URL.Path, Rec: rec}
	adm, ok := s.admitRequest(w, r, rec, a.preq)
	a.adm = adm
	if !ok {
		return a
	}
	a.preq.Orders = adm.Orders
	named := r.Header.Values(openai.HeaderPrefiller)
	if s.opts.PrefillerHeader && len(named) == 0 && !s.opts.PrefillerAbsentPicks && s.d.DecodeAloneServes() {
		// The picker in front named no prefill (a short prompt, a prefix the decode holds):
		// the decode serves the request alone, as llm-d's sidecar does.
		a.plan, a.alone = s.d.PlanDecodeAlone(rec, a.req, r.URL.Path), true
		return a
	}
	p := s.d.PlanPair(rec, a.req, r.URL.Path, nil)
	if s.opts.PrefillerHeader && len(named) > 0 {
		allow, e := s.d.Prefiller(named)
		if e != nil {
			openai.WriteError(w, e)
			return a
		}
		p.Sel.Allow = allow
	}
	a.plan = p
	return a
}

// servePair runs an admitted PD request through pairs chosen (and chosen again on a retry or a
// fallback model) by its policy.
func (s *Server) servePair(w http.ResponseWriter, r *http.Request, a *admittedPD) {
	s.withRetries(w, r, a.plan.Rec, s.pairAttempts(w, a))
}

// pairAttempts returns the attempt withRetries runs for a.
//
//go:noinline
func (s *Server) pairAttempts(w http.ResponseWriter, a *admittedPD) func(*http.Request, map[string]bool) error {
	// As the client sent them: SetBody changes the request's.
	t := &pairAttempts{s: s, w: w, a: a, orig: a.req.Body, client: a.req.Model}
	t.modelFn = t.model
	return t.attempt
}

// pairAttempts are a PD request's attempts (on the heap: a stream waits under small frames).
type pairAttempts struct {
	s      *Server
	w      http.ResponseWriter
	a      *admittedPD
	orig   []byte
	client string
	r      *http.Request // the attempt's
	avoid  map[string]bool

	modelFn func(name string, fallbackLeft bool) error // model, made once
}

func (t *pairAttempts) attempt(r *http.Request, avoid map[string]bool) error {
	t.r, t.avoid = r, avoid
	return t.s.d.ContextFallbacks(t.a.plan.Rec, t.client, t.modelFn) // a PD leg's refusal is never relayed as it is
}

// model runs the attempt's dispatch for the model name (the client's, or a fallback).
func (t *pairAttempts) model(name string, _ bool) error {
	s, r := t.s, t.r
	c, err := s.choosePair(r, t.a, t.orig, t.client, name, t.avoid)
	if err != nil {
		return err
	}
	defer c.Release()
	if c.Pair.Prefill == nil {
		return s.prefillLocally(t.w, r, t.a, c)
	}
	err = pd.For(s.pd, c.Pair).Execute(t.w, r, t.a.preq, c.Pair)
	if !s.d.DeclaredAdapter(t.a.plan.Sel) {
		return err
	}
	return s.executeAdapter(t.w, r, t.a, c, err)
}

// choosePair chooses the pair of one attempt, and sets the body both legs share: the model the
// workers know (an SGLang adapter as base:adapter), and the priority only for a pair whose two
// workers are marked forward_priority and read it alike.
//
//go:noinline
func (s *Server) choosePair(r *http.Request, a *admittedPD, orig []byte, client, name string, avoid map[string]bool) (director.Choice, error) {
	p, req := a.plan, a.req
	c, err := s.d.Choose(r.Context(), p, name, avoid)
	if err != nil {
		return c, err
	}
	pair := c.Pair
	if pair.Prefill == nil { // the decode serves it alone: prefillLocally
		s.d.NoteLocalPrefill(p, c.Worker)
		return c, nil
	}
	body := director.ForWorkers(orig, r.URL.Path, client, r.Header.Get(openai.HeaderRequestID), p.Sel, pair.Prefill, pair.Decode)
	if b := director.WithPriority(body, p.Rec.Class, pair.Prefill, pair.Decode); !bytes.Equal(b, req.Body) {
		if err := req.SetBody(b); err != nil {
			c.Release()
			return director.Choice{}, err
		}
	}
	a.preq.Ranks = p.Sel.Ranks
	p.NotePair(pair)
	return c, nil
}

// prefillLocally serves one attempt of a PD request on its chosen decode alone, as a regular
// request (conditional disaggregation: the prompt's uncached part was short): no handoff
// fields, the decode computes the prompt, the record says so (none-local-prefill).
//
//go:noinline
func (s *Server) prefillLocally(w http.ResponseWriter, r *http.Request, a *admittedPD, c director.Choice) error {
	wk, req, p := c.Worker, a.req, a.plan
	call := &proxy.Call{Path: r.URL.Path, Body: director.WithPriority(director.ForWorkers(a.preq.Body, r.URL.Path, req.Model, r.Header.Get(openai.HeaderRequestID), p.Sel, wk), p.Rec.Class, wk),
		Rec: p.Rec, Orders: a.adm.Orders, Stream: req.Stream}
	if !s.d.DeclaredAdapter(p.Sel) {
		return s.proxy.Forward(w, r, wk, call)
	}
	return s.forwardAdapter(w, r, c, p.Sel.Model, call)
}

// executeAdapter follows a dispatch for a declared adapter that ended with err: a leg whose
// engine says the adapter is gone (another replica unloaded it since this one loaded it) reached
// no client; the adapter is loaded again on the pair and the request sent once more, a bounded
// number of times.
//
//go:noinline
func (s *Server) executeAdapter(w http.ResponseWriter, r *http.Request, a *admittedPD, c director.Choice, err error) error {
	pair := c.Pair
	for try := 1; try < director.MaxAdapterGone; try++ {
		gone := director.LegAdapterGone(err, pair)
		if gone == nil {
			return err
		}
		again, rerr := s.d.ReadyAgain(r.Context(), a.plan.Sel.Model, gone, err, pair.Prefill, pair.Decode)
		if rerr != nil {
			return rerr
		}
		defer again()
		err = pd.For(s.pd, pair).Execute(w, r, a.preq, pair)
	}
	return err
}

// serveHealthGenerate checks a selected pair end to end: GET /health_generate on both.
func (s *Server) serveHealthGenerate(w http.ResponseWriter, r *http.Request) {
	pair, err := s.d.HealthPair(r.Context())
	if err != nil {
		proxy.WriteFailure(w, director.SelectionError(err))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]string, 2)
	var panicked atomic.Bool
	for i, wk := range pair.Both() {
		wg.Go(func() {
			defer func() {
				if v := recover(); v != nil {
					s.proxy.Recovered("health_generate", v)
					panicked.Store(true)
				}
			}()
			path := "/health_generate"
			if !director.Serves(wk, path) {
				path = "/health" // vLLM has no /health_generate: each leg's own health
			}
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, wk.URL+path, nil)
			proxy.CopyRequestHeaders(req.Header, r.Header, wk)
			resp, err := s.proxy.Transport.RoundTrip(req)
			if err != nil {
				errs[i] = fmt.Sprintf("%s %s: %v", wk.Role, wk.URL, err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode/100 != 2 {
				errs[i] = fmt.Sprintf("%s %s answered %d", wk.Role, wk.URL, resp.StatusCode)
			}
		})
	}
	wg.Wait()
	if panicked.Load() {
		openai.WriteError(w, proxy.InternalError())
		return
	}
	if msg := strings.Trim(strings.Join(errs, "; "), "; "); msg != "" {
		openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeHealthGenerateFailed, Message: msg})
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "health generate passed on prefill=%s decode=%s\n", pair.Prefill.URL, pair.Decode.URL)
}

// servePrefillInfo proxies GET /get_server_info and /get_model_info to a ready prefill worker,
// relaying its answer unchanged.
func (s *Server) servePrefillInfo(w http.ResponseWriter, r *http.Request) {
	prefill, err := s.d.PrefillFor(r.Context(), r.URL.Path)
	if err != nil {
		openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeNoAvailableWorkers,
			Message: "no prefill worker that serves " + r.URL.Path + " is ready (vLLM workers do not)"})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, prefill.URL+r.URL.Path, nil)
	proxy.CopyRequestHeaders(req.Header, r.Header, prefill)
	resp, err := s.proxy.Transport.RoundTrip(req)
	if err != nil {
		proxy.WriteFailure(w, proxy.Classify(prefill, pd.LegPrefill, 30*time.Second, err))
		return
	}
	defer resp.Body.Close()
	recordOf(r).Worker = prefill.URL
	if f := outcome.FailureOf(s.proxy.Relay(r.Context(), w, resp, nil, recordOf(r), proxy.Orders{}, nil)); f != nil {
		switch {
		case f.Unread() != nil:
			proxy.WriteFailure(w, proxy.Classify(prefill, pd.LegPrefill, 30*time.Second, f.Cause))
		case f.Kind() != outcome.KindClientGone:
			panic(http.ErrAbortHandler)
		}
	}
}
