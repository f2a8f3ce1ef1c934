package director

import (
	"context"
	"math"
	"sync/atomic"
	"time"

	"github.com/baton-llm/baton/internal/advisor"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/worker"
)

// LocalRule is conditional disaggregation's decision (pd_local_prefill_threshold,
// pd_local_prefill_auto): a PD request's chosen decode serves it alone when the prompt's
// uncached part is under the threshold, or — once the advisor has fitted the prefill's rate —
// when no prefill that could take it would start it sooner than the decode would finish it
// alone. In auto mode the threshold is the advisor's for the fleet's current split, refreshed
// every LocalRefresh; it starts at the configured one and stays at the last fitted one while
// the advisor cannot fit (too few split requests in its window, as when most go local).
type LocalRule struct {
	Threshold int
	Auto      bool
	// Whole lets an idle vLLM prefill serve a request whole when its chosen decode is past
	// TPOTSLO at its batch, by the advisor's fit (pd_prefill_serves_whole: the mirror case).
	// TPOTSLO also bounds what the busy-prefill rule moves to a decode.
	Whole   bool
	TPOTSLO time.Duration
	// PromptTokens is a prompt's token count when known (the tokenizer's cached count).
	PromptTokens func(model, path string, body []byte) (int, bool)
	// CountPrompt, when set, asks the worker at workerURL for a prompt's token count (every
	// shape its /tokenize can count, the rest by its bytes): a prompt whose bytes do not settle
	// the decision is counted by the chosen decode.
	CountPrompt func(ctx context.Context, workerURL, model, path string, body []byte) (int, bool)

	threshold atomic.Int64
	fit       atomic.Pointer[localFit]
	// explore: in auto mode, while the advisor has too few prefill legs to fit from, one in
	// ExploreEvery requests the threshold would keep on a decode is split anyway — else a
	// starting threshold above every prompt would never let the advisor see a prefill, and
	// never move.
	explore  atomic.Bool
	explored atomic.Uint64
}

// ExploreEvery: in auto mode, without a fit of the prefill, one in this many requests under
// the threshold is split anyway.
const ExploreEvery = 10

// localFit is what the advisor last fitted that the rule reads: a prompt token's prefill
// compute, the mean work each request in flight on a prefill puts before the next (prompts at
// or over the threshold), and a decode step's memory-bound floor.
type localFit struct {
	perToken, splitWork, step float64
	perRequest                float64 // what each request decoding beside it adds to a token
}

// LocalRefresh is how often the rule reads the advisor.
const LocalRefresh = 10 * time.Second

// NewLocalRule returns the rule for a configured threshold and mode.
func NewLocalRule(threshold int, auto bool, promptTokens func(model, path string, body []byte) (int, bool)) *LocalRule {
	r := &LocalRule{Threshold: threshold, Auto: auto, PromptTokens: promptTokens}
	r.threshold.Store(int64(threshold))
	r.explore.Store(auto)
	return r
}

// Current is the threshold in force.
func (r *LocalRule) Current() int { return int(r.threshold.Load()) }

// Decide is the selector's LocalPrefillFunc.
func (r *LocalRule) Decide(ctx context.Context, d *worker.Worker, match float64, req *policy.Request, prefills []*worker.Worker) bool {
	if d.Runtime() == config.RuntimeSGLang {
		return false // an SGLang decode refuses a request without a bootstrap room
	}
	uncached := func(n int) float64 {
		if match > 0 {
			return float64(n) * (1 - min(match, 1))
		}
		return float64(n)
	}
	threshold := float64(r.threshold.Load())
	n, ok := r.promptTokens(req)
	if !ok {
		// Its bytes bound its tokens: under the threshold by them, it is under it. Over it, the
		// decode counts it (a prompt the engine cannot count whole has the rest in bytes); a
		// prompt taken for its bytes / 4 could put a long one on a decode.
		n = promptBytes(req.Path, req.Body)
		if uncached(n) >= threshold && r.CountPrompt != nil {
			if c, counted := r.CountPrompt(ctx, d.URL, req.Model, req.Path, req.Body); counted && c > 0 {
				n = c
			}
		}
	}
	if uncached(n) < threshold {
		// Exploring splits only where a prefill can take it: with every prefill down, a
		// prompt under the threshold is still served by its decode.
		return len(prefills) == 0 || !r.explore.Load() || r.explored.Add(1)%ExploreEvery != 0
	}
	f := r.fit.Load()
	if f == nil || len(prefills) == 0 {
		return false
	}
	// Computed on the decode, the prompt holds every request decoding there for as long as
	// its compute takes: only a prompt whose compute keeps their next token within the TPOT
	// SLO, on a decode within it at its batch, may go there (a long document moved off a
	// queued prefill would stall a whole batch of decodes past it).
	alone := uncached(n) * f.perToken
	if slo := r.TPOTSLO.Seconds(); slo > 0 && (alone > slo || f.step+f.perRequest*float64(d.InFlight()+1) > slo) {
		return false
	}
	// The soonest a prefill would start it: the work of the requests it has in flight.
	wait := math.Inf(1)
	for _, p := range prefills {
		wait = min(wait, float64(p.InFlight())*f.splitWork)
	}
	return wait > alone+f.step
}

// promptTokens is a prompt's token count when known without asking: the tokenizer's cached
// count, or the ids of a prompt given as token ids.
func (r *LocalRule) promptTokens(req *policy.Request) (int, bool) {
	if r.PromptTokens != nil {
		if n, ok := r.PromptTokens(req.Model, req.Path, req.Body); ok {
			return n, true
		}
	}
	if req.Parsed != nil && req.Path == "/v1/completions" { // the one route whose prompt is "prompt": elsewhere an engine ignores it
		if raw, has := req.Parsed.Get("prompt"); has {
			return tokenIDs(raw)
		}
	}
	return 0, false
}

// ServeWhole is the selector's ServeWhole: with Whole, once the advisor has fitted the
// decode's pace, a request whose chosen decode would give a token slower than TPOTSLO at the
// batch it holds (α + β·(requests in flight + 1), and it holds some) goes whole to a prefill
// with nothing in flight, when there is one (vLLM only: an SGLang prefill refuses a request without a
// bootstrap room, as its decode does).
func (r *LocalRule) ServeWhole(_ context.Context, d *worker.Worker, _ *policy.Request, prefills []*worker.Worker) *worker.Worker {
	f := r.fit.Load()
	slo := r.TPOTSLO.Seconds()
	// Within the SLO at its batch, or past it alone (no batch's fault: a prefill is no faster)
	// — which an idle decode always is, one or the other.
	if !r.Whole || f == nil || slo <= 0 || f.step+f.perRequest*float64(d.InFlight()+1) <= slo || f.step+f.perRequest > slo {
		return nil
	}
	for _, p := range prefills {
		if p.Runtime() != config.RuntimeSGLang && p.InFlight() == 0 {
			return p
		}
	}
	return nil
}

// RefreshLocal reads the advisor's fit into conditional disaggregation's rule now (Start does
// it every LocalRefresh): the prefill's rates always, the threshold in auto mode for the
// decodes the fleet has.
func (d *Director) RefreshLocal() {
	r := d.o.LocalRule
	if r == nil || d.o.Advisor == nil {
		return
	}
	f := d.o.Advisor.Fit()
	r.explore.Store(r.Auto && f.PrefillFrom < 2*advisor.MinFit)
	if !f.Fitted() {
		return
	}
	t := r.Current()
	if r.Auto {
		prefill, decode := d.fleetSplit()
		if decode > 0 {
			t = f.ThresholdFor(prefill, decode, d.o.AdviceSLO)
			r.threshold.Store(int64(t))
		}
	}
	r.fit.Store(&localFit{perToken: 1 / f.PrefillTokensPerS, splitWork: f.SplitWork(t), step: f.DecodeBaseS, perRequest: f.DecodePerRequestS})
}

// tokenIDs counts the token ids of a prompt given as ids (a list of integers, or a batch of
// such lists): a prompt the client tokenized is its own count, where its bytes over four would
// take a list of five-digit ids for some 1.5 tokens each. False for a prompt of text.
func tokenIDs(raw []byte) (int, bool) {
	if len(raw) == 0 || raw[0] != '[' {
		return 0, false
	}
	n, in := 0, false
	for _, c := range raw {
		switch {
		case c >= '0' && c <= '9':
			if !in {
				n++
			}
			in = true
		case c == '[' || c == ']' || c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r':
			in = false
		default:
			return 0, false // text, or not ids
		}
	}
	return n, true
}
