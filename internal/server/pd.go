package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/epp"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/tracing"
	"github.com/baton-llm/baton/internal/worker"
)

// servePD runs a generation request through a prefill/decode pair.
func (s *Server) servePD(w http.ResponseWriter, r *http.Request) {
	req, done := s.readRequest(w, r)
	defer done()
	if req == nil {
		return
	}
	preq := &pd.Request{Request: req, Path: r.URL.Path}
	adm, ok := s.admitRequest(w, r, preq)
	defer adm.end()
	if !ok {
		return
	}
	sreq := &policy.Request{Model: req.Model, Path: r.URL.Path, Body: req.Body, Parsed: req, Explain: s.opts.RouteHeader || tracing.Enabled()}
	if s.opts.PrefillerHeader && len(r.Header.Values(epp.HeaderPrefiller)) == 0 && !s.opts.PrefillerAbsentPicks && s.decodeAloneServes() {
		// The picker in front named no prefill (a short prompt, a prefix the decode holds):
		// the decode serves the request alone, as llm-d's sidecar does.
		s.serveDecodeAlone(w, r, req, sreq)
		return
	}
	if s.opts.PrefillerHeader && !s.prefillerNamed(w, r, sreq) {
		return
	}
	orig, client := req.Body, req.Model
	waited := false // the waiting room holds a request once
	s.withRetries(w, r, func(r *http.Request, avoid map[string]bool) error {
		return s.withContextFallbacks(r, client, func(name string, _ bool) error { // a PD leg's refusal is never relayed as it is
			var pair worker.Pair
			inFlight, err := s.choose(r, name, sreq, &waited, avoid, func() (err error) {
				pair, err = s.sel.Pair(r.Context(), sreq, avoid)
				return err
			}, func() []*worker.Worker { return []*worker.Worker{pair.Prefill, pair.Decode} })
			if err != nil {
				return err
			}
			defer inFlight()
			s.noteDecisions(r, sreq)
			// Both legs share the body: the model the workers know (an SGLang adapter as
			// base:adapter), and the priority only for a pair whose two workers are marked
			// forward_priority and read it alike.
			body := forWorkers(orig, r.URL.Path, client, sreq, pair.Prefill, pair.Decode)
			if b := withPriority(body, record.From(r.Context()).Class, pair.Prefill, pair.Decode); !bytes.Equal(b, req.Body) {
				if err := req.SetBody(b); err != nil {
					return err
				}
			}
			preq.Ranks = sreq.Ranks
			notePair(r, pair)
			err = s.pd.Execute(w, r, preq, pair)
			if !s.declaredAdapter(sreq) {
				return err
			}
			// A leg whose engine says the adapter is gone (another replica unloaded it since
			// this one loaded it): nothing reached the client; the adapter is loaded again on
			// the pair and the request sent once more, a bounded number of times.
			for try := 1; try < maxAdapterGone; try++ {
				gone := legAdapterGone(err, pair)
				if gone == nil {
					return err
				}
				again, rerr := s.readyAgain(r, sreq.Model, gone, err, pair.Prefill, pair.Decode)
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

// legAdapterGone is the worker of pair whose engine refused a PD leg because the request's
// adapter is not there (vLLM's 404 "does not exist", SGLang's 400 "… are not loaded"); nil
// for any other outcome.
func legAdapterGone(err error, pair worker.Pair) *worker.Worker {
	var f *outcome.Failure
	if !errors.As(err, &f) || f.Leg == "" || f.Answer == nil || !goneAnswer(f.Status, f.Answer.Message) {
		return nil
	}
	switch f.Worker {
	case pair.Prefill.URL:
		return pair.Prefill
	case pair.Decode.URL:
		return pair.Decode
	}
	return nil
}

// decodeAloneServes reports whether a decode worker can serve a request alone: a vLLM one (its
// KV connector computes the prompt when no handoff comes); SGLang's decode mode refuses a
// request without a bootstrap, so a fleet of SGLang decodes picks a prefill instead.
func (s *Server) decodeAloneServes() bool {
	for _, w := range worker.Available(s.reg.Snapshot().Workers) {
		if w.Role == config.RoleDecode && w.Runtime() != config.RuntimeSGLang {
			return true
		}
	}
	return false
}

// serveDecodeAlone sends a PD request to a decode worker alone, as a regular request: no
// handoff fields, the decode computes the prompt — by design, and said so (X-Baton-Kv-Handoff
// none-local-prefill, baton_pd_kv_handoffs_total class by_design, the access log's handoff).
func (s *Server) serveDecodeAlone(w http.ResponseWriter, r *http.Request, req *openai.Request, sreq *policy.Request) {
	rec := record.From(r.Context())
	rec.Handoff = pd.HandoffNoneLocalPrefill
	s.metrics.PDHandoffs.WithLabelValues(pd.HandoffNoneLocalPrefill, pd.HandoffClass(pd.HandoffNoneLocalPrefill), "").Inc()
	sreq.Allow = func(w *worker.Worker) bool { return w.Runtime() != config.RuntimeSGLang }
	s.serveOne(w, r, req, sreq, config.RoleDecode)
}

// maxEndpointLen bounds a host:port header value.
const maxEndpointLen = 300

// prefillerNamed holds the request, when it carries an Endpoint Picker's x-prefiller-host-port,
// to the prefill worker that header names (by its host:port): Baton is then the decode-side
// sidecar and runs the prefill leg where the picker chose. As llm-d's sidecar reads it, the
// header may list several (comma-separated, or the header repeated): the first that is one of
// the available prefill workers is taken. A header naming none of them is answered 503 (false).
func (s *Server) prefillerNamed(w http.ResponseWriter, r *http.Request, sreq *policy.Request) bool {
	vs := r.Header.Values(epp.HeaderPrefiller)
	if len(vs) == 0 {
		return true
	}
	var named []string
	for _, v := range vs {
		for e := range strings.SplitSeq(v, ",") {
			if e = strings.TrimSpace(e); e != "" {
				named = append(named, e)
			}
		}
	}
	if len(named) == 0 || len(named) > maxPrefillers || slices.ContainsFunc(named, func(e string) bool { return len(e) > maxEndpointLen }) {
		openai.WriteError(w, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidRequest, Param: epp.HeaderPrefiller,
			Message: fmt.Sprintf("%s must list 1 to %d host:port", epp.HeaderPrefiller, maxPrefillers)})
		return false
	}
	available := worker.Available(s.reg.Snapshot().Workers)
	for _, hp := range named {
		for _, p := range available {
			if p.Role == config.RolePrefill && p.Endpoint == hp {
				sreq.Allow = func(w *worker.Worker) bool { return w.Role != config.RolePrefill || w.Endpoint == hp }
				return true
			}
		}
	}
	openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeNoAvailableWorkers,
		Message: fmt.Sprintf("none of the prefills %s names (%.80q) is one of Baton's available prefill workers", epp.HeaderPrefiller, strings.Join(named, ","))})
	return false
}

// maxPrefillers bounds the endpoints an x-prefiller-host-port header may list.
const maxPrefillers = 16

// countBatch counts the request's prompts and samples into req, and refuses a request past
// max_batch_size (on every route: the engine would run them all).
func (s *Server) countBatch(req *pd.Request) *openai.Error {
	if req.Batch = pd.BatchSize(req, s.opts.MaxBatchSize+1); req.Batch > s.opts.MaxBatchSize {
		return &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeBatchTooLarge,
			Message: fmt.Sprintf("the request holds more than %d prompts (max_batch_size)", s.opts.MaxBatchSize)}
	}
	if req.Samples = pd.SamplesOf(req); req.Samples > s.opts.MaxBatchSize {
		return &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeBatchTooLarge,
			Message: fmt.Sprintf("the request asks %d samples per prompt (n, best_of or sampling_params.n), above the limit of %d (max_batch_size)", req.Samples, s.opts.MaxBatchSize)}
	}
	return nil
}

// serveHealthGenerate checks a selected pair end to end: GET /health_generate on both.
func (s *Server) serveHealthGenerate(w http.ResponseWriter, r *http.Request) {
	pair, err := s.sel.Pair(r.Context(), &policy.Request{Path: "/health"}, nil)
	if err != nil {
		proxy.WriteFailure(w, selectionError(err))
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
	record.From(r.Context()).Worker = prefill.URL
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
func notePair(r *http.Request, pair worker.Pair) {
	rec := record.From(r.Context())
	rec.Mode, rec.Prefill, rec.Decode, rec.Worker = pd.Mode(pair), pair.Prefill.URL, pair.Decode.URL, pair.Decode.URL
}
