// Package pd runs prefill/decode disaggregated requests: one client request becomes a prefill
// leg and a decode leg on a selected pair of workers, and Baton owns the KV handoff between
// them. The Dispatcher chooses the strategy by the prefill's runtime: Parallel (SGLang and other
// bootstrap engines; bootstrap.go) sends both legs at once, the concurrent runner in legs.go;
// Sequential (vLLM; connector.go) sends a one-token prefill first and relays its
// kv_transfer_params, or Baton's minted Mooncake params, to the decode. relay.go holds what both
// share on the way back to the client.
package pd

import (
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/worker"
)

// Leg names, used in error codes, logs and metrics.
const (
	LegPrefill = "prefill"
	LegDecode  = "decode"
)

// Outcome is how a PD request ended: the outcome label of baton_pd_requests_total.
type Outcome string

// Outcomes of a PD request.
const (
	OutcomeSuccess         Outcome = "success"
	OutcomePrefillFailed   Outcome = "prefill_failed"
	OutcomeDecodeFailed    Outcome = "decode_failed"
	OutcomeClientCancelled Outcome = "client_cancelled"
	OutcomeAborted         Outcome = "aborted"          // the decode failed after its first byte
	OutcomeHandoffRequired Outcome = "handoff_required" // strict mode refused a recompute
)

// Request is one client request on a PD route.
type Request struct {
	*openai.Request
	Path string // route path, the same on the workers
	// Batch is BatchSize of the request, counted once when it arrived.
	Batch int
	// Samples is SamplesOf the request: its n, counted once when it arrived.
	Samples int
	// Ranks names per worker URL the DP rank holding the longest cached prefix of the prompt
	// (policy.Request.Ranks); the prefill leg goes there (worker.RankFor).
	Ranks map[string]int
	// Consumed is set by a vLLM executor once the decode answered with a handoff: what the
	// decode's own usage said of it (VerdictReceived, VerdictRecomputed, VerdictUnknown).
	Consumed string
	// Rec is the request's record, where the executor writes what it learns (the handoff, the
	// decode that served, the usage); Orders are the tenant's accounting asked of the relay.
	Rec    *record.Record
	Orders proxy.Orders
}

// What a decode's usage said about the KV it was handed (Request.Consumed).
const (
	VerdictReceived   = "received"
	VerdictRecomputed = "recomputed"
	VerdictUnknown    = "unknown" // no prompt_tokens_details.cached_tokens in the decode's usage
)

// Executor runs one PD request over a selected pair and writes the response. It returns nil
// when the whole response reached the client, proxy.ErrClientGone, proxy.ErrAbort (the caller
// must abort the connection), or, with nothing written yet, an *outcome.Failure for the caller
// to retry or write.
type Executor interface {
	Execute(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair) error
}

// Dispatcher chooses the strategy of each PD request by its prefill worker's runtime: vLLM's
// sequential relay of kv_transfer_params, or SGLang's parallel bootstrap rendezvous (also the
// choice for runtimes that are neither).
type Dispatcher struct {
	Sequential Executor
	Parallel   Executor
}

var _ Executor = (*Dispatcher)(nil)

// For is the executor that runs a request over pair: a Dispatcher's strategy for it, else e.
// (The server calls the strategy itself: one frame less under every PD stream.)
func For(e Executor, pair worker.Pair) Executor {
	if d, ok := e.(*Dispatcher); ok {
		if Mode(pair) == ModeSequential {
			return d.Sequential
		}
		return d.Parallel
	}
	return e
}

// Execute implements Executor.
func (d *Dispatcher) Execute(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair) error {
	if req.Rec == nil {
		req.Rec = &record.Record{} // a caller that reads nothing back
	}
	if Mode(pair) == ModeSequential {
		return d.Sequential.Execute(rw, r, req, pair)
	}
	return d.Parallel.Execute(rw, r, req, pair)
}

// The PD modes, as metrics label them: the sequential relay (vLLM's prefill first, then the
// decode with its KV transfer parameters) and the parallel bootstrap (both legs at once,
// meeting by bootstrap room: SGLang, and engines Baton cannot tell apart from it).
const (
	ModeSequential = record.ModePDVLLM
	ModeParallel   = record.ModePDSGLang
)

// Mode is how pair serves a request: the one rule that chooses both the executor and the
// label its metrics carry.
func Mode(pair worker.Pair) record.Mode {
	if pair.Prefill.Runtime() == config.RuntimeVLLM {
		return ModeSequential
	}
	return ModeParallel
}

// BatchSize returns how many sequences the request holds for bootstrap purposes, or 0 for a
// single one: a /generate batch (text list or input_ids list of lists), a /v1/completions prompt
// list (of strings or of token lists; a flat token list is one prompt) and prompt_embeds list
// (of base64 tensors). Samples (n) are counted apart: SamplesOf. It counts
// at most limit, without allocating: a client's list never costs more than its bytes.
func BatchSize(req *Request, limit int) int {
	switch routes.Of(req.Path).Batch {
	case routes.BatchGenerate:
		if raw, ok := req.Get("input_ids"); ok {
			return listLen(raw, true, limit)
		}
		if raw, ok := req.Get("text"); ok {
			return listLen(raw, false, limit)
		}
	case routes.BatchCompletions:
		// vLLM's CompletionRequest takes prompt_embeds as one base64 tensor or a list of them,
		// beside or instead of prompt: each listed tensor is one more prompt.
		n := 0
		if raw, ok := req.Get("prompt"); ok {
			n = listLen(raw, true, limit)
		}
		if raw, ok := req.Get("prompt_embeds"); ok && n <= limit {
			n += listLen(raw, false, limit)
		}
		return n
	}
	return 0
}

// SamplesOf returns how many samples the request asks for each prompt: "n" (or "best_of" when
// larger), or on /generate sampling_params.n; 1 when absent. A value that is not a positive integer counts as 1 (the
// engine refuses it).
func SamplesOf(req *Request) int {
	if routes.Of(req.Path).Samples != routes.SamplesSamplingParams {
		n := max(req.N, 1)
		if raw, ok := req.Get("best_of"); ok { // vLLM completions: best_of runs this many
			if b, err := strconv.Atoi(string(raw)); err == nil && b > n {
				n = b
			}
		}
		return n
	}
	sp, ok := req.Get("sampling_params")
	if !ok || len(sp) == 0 {
		return 1
	}
	if sp[0] == '[' {
		// One sampling_params per prompt (SGLang's list form): the most samples any asks, so
		// that prompts × samples bounds what the engine runs.
		var each []map[string]json.RawMessage
		if json.Unmarshal(sp, &each) != nil {
			return 1
		}
		n := 1
		for _, p := range each {
			n = max(n, samplesIn(p["n"]))
		}
		return n
	}
	if sp[0] != '{' {
		return 1
	}
	raw, _ := openai.Get(sp, "n")
	return samplesIn(raw)
}

// samplesIn reads a sampling_params n: at least 1.
func samplesIn(raw []byte) int {
	n, err := strconv.Atoi(string(raw))
	if err != nil || n < 1 {
		return 1
	}
	return n
}

// listLen returns the length of a JSON array of strings or arrays (up to limit), 0 for anything
// else. With nested set, an array of numbers (one token list) is not a batch.
func listLen(raw []byte, nested bool, limit int) int {
	n, first := openai.ArrayLen(raw, limit)
	switch {
	case first == '"':
		return n
	case first == '[' && nested:
		return n
	}
	return 0
}

// prefillRank returns the DP rank over n ranks for req's prefill leg on w: where its prefix is
// cached when that is known and not overloaded, else the least loaded.
func prefillRank(w *worker.Worker, req *Request, n int) (int, bool) {
	prefer, ok := req.Ranks[w.URL]
	if !ok {
		prefer = -1
	}
	return w.RankFor(prefer, n)
}
