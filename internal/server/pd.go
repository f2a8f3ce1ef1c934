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
	rec := recordOf(r)
	req, done := s.readRequest(w, r, rec)
	defer done()
	if req == nil {
		return
	}
	preq := &pd.Request{Request: req, Path: r.URL.Path, Rec: rec}
	adm, ok := s.admitRequest(w, r, rec, preq)
	defer adm.End()
	if !ok {
		return
	}
	preq.Orders = adm.Orders
	named := r.Header.Values(openai.HeaderPrefiller)
	if s.opts.PrefillerHeader && len(named) == 0 && !s.opts.PrefillerAbsentPicks && s.d.DecodeAloneServes() {
		// The picker in front named no prefill (a short prompt, a prefix the decode holds):
		// the decode serves the request alone, as llm-d's sidecar does.
		s.serveOne(w, r, req, s.d.PlanDecodeAlone(rec, req, r.URL.Path), adm.Orders)
		return
	}
	p := s.d.PlanPair(rec, req, r.URL.Path, nil)
	if s.opts.PrefillerHeader && len(named) > 0 {
		allow, e := s.d.Prefiller(named)
		if e != nil {
			openai.WriteError(w, e)
			return
		}
		p.Sel.Allow = allow
	}
	orig, client, sreq := req.Body, req.Model, p.Sel
	s.withRetries(w, r, rec, func(r *http.Request, avoid map[string]bool) error {
		return s.d.ContextFallbacks(rec, client, func(name string, _ bool) error { // a PD leg's refusal is never relayed as it is
			c, err := s.d.Choose(r.Context(), p, name, avoid)
			if err != nil {
				return err
			}
			defer c.Release()
			pair := c.Pair
			// Both legs share the body: the model the workers know (an SGLang adapter as
			// base:adapter), and the priority only for a pair whose two workers are marked
			// forward_priority and read it alike.
			body := director.ForWorkers(orig, r.URL.Path, client, sreq, pair.Prefill, pair.Decode)
			if b := director.WithPriority(body, rec.Class, pair.Prefill, pair.Decode); !bytes.Equal(b, req.Body) {
				if err := req.SetBody(b); err != nil {
					return err
				}
			}
			preq.Ranks = sreq.Ranks
			p.NotePair(pair)
			err = s.pd.Execute(w, r, preq, pair)
			if !s.d.DeclaredAdapter(sreq) {
				return err
			}
			// A leg whose engine says the adapter is gone (another replica unloaded it since
			// this one loaded it): nothing reached the client; the adapter is loaded again on
			// the pair and the request sent once more, a bounded number of times.
			for try := 1; try < director.MaxAdapterGone; try++ {
				gone := director.LegAdapterGone(err, pair)
				if gone == nil {
					return err
				}
				again, rerr := s.d.ReadyAgain(r.Context(), sreq.Model, gone, err, pair.Prefill, pair.Decode)
				if rerr != nil {
					return rerr
				}
				defer again()
				err = s.pd.Execute(w, r, preq, pair)
			}
			return err
		})
	})
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
	if f := outcome.FailureOf(s.proxy.Relay(r.Context(), w, resp, nil, recordOf(r), proxy.Orders{})); f != nil {
		switch {
		case f.Unread() != nil:
			proxy.WriteFailure(w, proxy.Classify(prefill, pd.LegPrefill, 30*time.Second, f.Cause))
		case f.Kind() != outcome.KindClientGone:
			panic(http.ErrAbortHandler)
		}
	}
}
