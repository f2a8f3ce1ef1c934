package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/worker"
)

// servePD runs a generation request through a prefill/decode pair.
func (s *Server) servePD(w http.ResponseWriter, r *http.Request) {
	rec := recordOf(r)
	req, done := s.readRequest(w, r, rec)
	defer done()
	if req == nil {
		return
	}
	preq := &pd.Request{Request: req, Path: r.URL.Path}
	adm, ok := s.admitRequest(w, r, rec, preq)
	defer adm.End()
	if !ok {
		return
	}
	named := r.Header.Values(openai.HeaderPrefiller)
	if s.opts.PrefillerHeader && len(named) == 0 && !s.opts.PrefillerAbsentPicks && s.d.DecodeAloneServes() {
		// The picker in front named no prefill (a short prompt, a prefix the decode holds):
		// the decode serves the request alone, as llm-d's sidecar does.
		s.serveDecodeAlone(w, r, req, s.d.NewPlan(rec, req, r.URL.Path, config.RoleDecode))
		return
	}
	p := s.d.NewPlan(rec, req, r.URL.Path, config.RoleDecode)
	p.Pair = true
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
			notePair(rec, pair)
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

// serveDecodeAlone sends a PD request to a decode worker alone, as a regular request: no
// handoff fields, the decode computes the prompt — by design, and said so (X-Baton-Kv-Handoff
// none-local-prefill, baton_pd_kv_handoffs_total class by_design, the access log's handoff).
func (s *Server) serveDecodeAlone(w http.ResponseWriter, r *http.Request, req *openai.Request, p *director.Plan) {
	p.Rec.Handoff = pd.HandoffNoneLocalPrefill
	s.metrics.PDHandoffs.WithLabelValues(pd.HandoffNoneLocalPrefill, pd.HandoffClass(pd.HandoffNoneLocalPrefill), "").Inc()
	p.Sel.Allow = func(w *worker.Worker) bool { return w.Runtime() != config.RuntimeSGLang }
	s.serveOne(w, r, req, p)
}

// serveHealthGenerate checks a selected pair end to end: GET /health_generate on both.
func (s *Server) serveHealthGenerate(w http.ResponseWriter, r *http.Request) {
	pair, err := s.sel.Pair(r.Context(), &policy.Request{Path: "/health"}, nil)
	if err != nil {
		proxy.WriteFailure(w, director.SelectionError(err))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]string, 2)
	var panicked atomic.Bool
	for i, wk := range []*worker.Worker{pair.Prefill, pair.Decode} {
		wg.Go(func() {
			defer func() {
				if v := recover(); v != nil {
					s.proxy.Recovered("health_generate", v)
					panicked.Store(true)
				}
			}()
			path := "/health_generate"
			if !policy.Serves(wk, path) {
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
	prefill, err := s.sel.Worker(r.Context(), config.RolePrefill, &policy.Request{Path: r.URL.Path}, nil)
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
	if err := s.proxy.Relay(r.Context(), w, resp, nil); err != nil {
		var re *proxy.ReadError
		if errors.As(err, &re) && !re.Written {
			proxy.WriteFailure(w, proxy.Classify(prefill, pd.LegPrefill, 30*time.Second, err))
			return
		}
		if !errors.Is(err, proxy.ErrClientGone) {
			panic(http.ErrAbortHandler)
		}
	}
}

// notePair writes the chosen pair and its mode on the request's record. A function of its own,
// never inlined, so that the attempt's frame, under every open PD stream, stays small.
//
//go:noinline
func notePair(rec *record.Record, pair worker.Pair) {
	rec.Mode, rec.Prefill, rec.Decode, rec.Worker = pd.Mode(pair), pair.Prefill.URL, pair.Decode.URL, pair.Decode.URL
}
