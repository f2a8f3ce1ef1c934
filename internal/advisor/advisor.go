// Package advisor sizes a prefill/decode fleet from the traffic Baton serves: from each PD
// request's prompt (and the part of it the decode did not hold), its output, its prefill leg
// and its decode's pace, with how busy each worker was when the request reached it, it fits
// each role's service capacity and predicts, for any split of a fleet, the TTFT and TPOT the
// current load would see. It recommends the split that best meets the operator's SLOs and the
// uncached length under which a request should skip its prefill, and shows its work: the fitted
// rates and how many requests each came from.
//
// The model, every term of which an operator can check against the receipt:
//   - prefill: a leg dispatched to an idle prefill lasts o_p + uncached / C_p (least squares
//     over such legs), never less than a floor m (their 10th percentile: a step's memory-bound
//     cost however few its tokens). Each prompt is s = uncached / C_p of work and a prefill
//     worker is busy ρ = λ_split·mean(s) / N_p. An engine batches: every prompt waiting when a
//     step starts joins it, and the step lasts max(m, o_p + its tokens / C_p). The leg's p90 is
//     that rule replayed over Poisson arrivals of the window's prompts at the worker's load
//     (a single-server queue, one prompt at a time, misses it by half);
//   - TTFT p90: the prefill leg's p90, the pair's fixed part (TTFT less the prefill leg less
//     1.5 TPOT: the KV transfer and the second hop) and the decode's first step at the
//     predicted TPOT (the one under way, half on average, and its own: 1.5 TPOT);
//   - decode: a token takes α + β·b with b requests decoding beside it (least squares over the
//     requests' TPOT and their decode's concurrency); a decode worker holds b = λ·mean(output)
//     ·TPOT / N_d requests (Little's law). A step is memory-bound: a prompt it computes itself
//     (one under the threshold) stalls it only by what its compute takes past α, and the share
//     f of the decode's time so stalled slows every token: TPOT = (α + β·b) / (1 − f);
//   - without MinFit streams (whole answers show no TTFT, no TPOT), the pair's fixed part and
//     α, β from the split requests' durations: duration − prefill leg = fixed + (n + ½)·(α + β·b)
//     for n output tokens, fitted across requests of different lengths (fitDurations);
//   - the threshold: the longest uncached length whose local compute costs no more than the
//     pair's overhead and the step α hides, lowered until the predicted TPOT meets its SLO.
package advisor

import (
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"time"
)

// Sample is one PD request as Baton saw it end.
type Sample struct {
	At time.Time
	// Split: it went through a pair (else its decode served it alone).
	Split bool
	// Prompt is its prompt tokens, Uncached those its decode did not hold (the prefill
	// computed them, or the decode did when alone), Output its completion tokens.
	Prompt, Uncached, Output int
	// PrefillTime is its prefill leg, from dispatch to the answer (split requests);
	// PrefillBusy the requests the prefill had in flight besides it then.
	PrefillTime time.Duration
	PrefillBusy int
	// TTFT is arrival to first byte; TPOT the time per output token after the first
	// ((end − first byte) / (Output − 1), 0 for fewer than two) — both of streams only (0
	// otherwise: a whole answer's first byte comes with its last token); DecodeBusy the requests
	// its decode had in flight besides it when it was sent there.
	TTFT, TPOT time.Duration
	DecodeBusy int
	// Duration is arrival to the answer's end, streamed or not (0: unknown). For a whole answer
	// of a split request it is what tells the decode's pace and the pair's overhead (Fit).
	Duration time.Duration
}

// Advisor keeps the latest samples (a ring) over a window and fits them on demand.
type Advisor struct {
	Window time.Duration    // samples older than this are not used; 0 means 5 minutes
	Now    func() time.Time // nil: time.Now

	mu   sync.Mutex
	ring []Sample
	next int
}

// MaxSamples bounds the samples kept.
const MaxSamples = 20_000

// Observe records a finished PD request.
func (a *Advisor) Observe(s Sample) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.ring) < MaxSamples {
		a.ring = append(a.ring, s)
		return
	}
	a.ring[a.next] = s
	a.next = (a.next + 1) % MaxSamples
}

func (a *Advisor) now() time.Time {
	if a.Now != nil {
		return a.Now()
	}
	return time.Now()
}

func (a *Advisor) window() time.Duration {
	if a.Window > 0 {
		return a.Window
	}
	return 5 * time.Minute
}

// recent returns the samples within the window, oldest first, and the span they cover.
func (a *Advisor) recent() ([]Sample, time.Duration) {
	now := a.now()
	from := now.Add(-a.window())
	a.mu.Lock()
	out := make([]Sample, 0, len(a.ring))
	for _, s := range a.ring {
		if !s.At.Before(from) {
			out = append(out, s)
		}
	}
	a.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].At.Before(out[j].At) })
	if len(out) == 0 {
		return nil, 0
	}
	first := out[0].At
	if first.Before(from) {
		first = from
	}
	return out, now.Sub(first)
}

// Fit is what the advisor learned from the window: every rate, and the requests it came from.
type Fit struct {
	Requests int     `json:"requests"` // in the window
	WindowS  float64 `json:"window_s"` // the span they cover
	Rate     float64 `json:"rate"`     // requests per second (λ)
	Output   float64 `json:"output"`   // mean output tokens
	Uncached float64 `json:"uncached"` // mean uncached prompt tokens
	Prompt   float64 `json:"prompt"`   // mean prompt tokens

	// PrefillTokensPerS is C_p, PrefillOverheadS o_p, from PrefillFrom legs sent to an idle
	// prefill (fewer than MinFit: not fitted).
	PrefillTokensPerS float64 `json:"prefill_tokens_per_s"`
	PrefillOverheadS  float64 `json:"prefill_overhead_s"`
	PrefillFrom       int     `json:"prefill_from"`
	// PrefillFloorS is the shortest a prefill step lasts however few its tokens (the weights
	// read once a step: an engine's memory-bound floor), the 10th percentile of those legs.
	PrefillFloorS float64 `json:"prefill_floor_s"`
	// PrefillRateBound: the legs did not vary with their prompts (all within the floor), and
	// PrefillTokensPerS is the lower bound they give — the longest prompt over a median leg.
	PrefillRateBound bool `json:"prefill_rate_is_bound,omitempty"`
	// PairOverheadS is o_pair, the median of TTFT less the prefill leg, over PairFrom requests;
	// PairFixedS the part of it that is not the decode's first step (the KV transfer and the
	// second hop): the median of TTFT less the prefill leg less 1.5 TPOT (the step under way
	// when the KV lands, half of one on average, then the request's own).
	PairOverheadS float64 `json:"pair_overhead_s"`
	PairFixedS    float64 `json:"pair_fixed_s"`
	PairFrom      int     `json:"pair_from"`
	// DecodeBaseS is α and DecodePerRequestS β of TPOT = α + β·b, from DecodeFrom requests.
	DecodeBaseS       float64 `json:"decode_base_s"`
	DecodePerRequestS float64 `json:"decode_per_request_s"`
	DecodeFrom        int     `json:"decode_from"`
	// DecodeFromDurations: fewer than MinFit streams showed their TPOT, and the decode's pace and
	// the pair's overhead (PairFrom, DecodeFrom) were fitted from split requests' durations —
	// whole answers' and streams' alike — instead (fitDurations).
	DecodeFromDurations bool `json:"decode_from_durations,omitempty"`
	// DecodePaceBound: those answers were too alike in length to tell the pace from the fixed
	// part; DecodeBaseS is the bound they give (the whole decode part over its tokens), no part
	// of it fixed.
	DecodePaceBound bool `json:"decode_pace_is_bound,omitempty"`

	uncached []int     // each request's uncached tokens, sorted
	cum      []float64 // cum[i]: the sum of uncached[:i] (a prediction reads sums, not samples)
	// curves holds, per split point k, the replayed prefill p90 at a grid of loads, filled as
	// predictions ask (a what-if over thousands of splits replays each curve once).
	curves *curves
}

// MinFit is the fewest samples a rate is fitted from.
const MinFit = 20

// Fitted reports whether every rate could be fitted.
func (f Fit) Fitted() bool {
	return f.PrefillFrom >= MinFit && f.DecodeFrom >= MinFit && f.PrefillTokensPerS > 0 && f.DecodeBaseS > 0
}

// Fit fits the window's samples.
func (a *Advisor) Fit() Fit {
	ss, span := a.recent()
	var f Fit
	f.Requests, f.WindowS = len(ss), span.Seconds()
	if len(ss) == 0 || span <= 0 {
		return f
	}
	f.Rate = float64(len(ss)) / span.Seconds()
	var px, py, dx, dy []float64
	var pair, fixed []float64
	var legs []decodeLeg
	for _, s := range ss {
		f.Output += float64(s.Output)
		f.Uncached += float64(s.Uncached)
		f.Prompt += float64(s.Prompt)
		f.uncached = append(f.uncached, s.Uncached)
		if s.Split && s.PrefillTime > 0 {
			if s.PrefillBusy == 0 {
				px, py = append(px, float64(s.Uncached)), append(py, s.PrefillTime.Seconds())
			}
			if s.Duration > s.PrefillTime && s.Output > 0 {
				legs = append(legs, decodeLeg{tokens: float64(s.Output), batch: float64(s.DecodeBusy + 1), s: (s.Duration - s.PrefillTime).Seconds()})
			}
			if s.TTFT > s.PrefillTime { // streams
				pair = append(pair, (s.TTFT - s.PrefillTime).Seconds())
				if s.TPOT > 0 {
					fixed = append(fixed, max(0, (s.TTFT-s.PrefillTime).Seconds()-1.5*s.TPOT.Seconds()))
				}
			}
		}
		if s.TPOT > 0 {
			dx, dy = append(dx, float64(s.DecodeBusy+1)), append(dy, s.TPOT.Seconds())
		}
	}
	n := float64(len(ss))
	f.Output, f.Uncached, f.Prompt = f.Output/n, f.Uncached/n, f.Prompt/n
	slices.Sort(f.uncached)
	f.curves = &curves{byK: map[int][][]float64{}}
	f.cum = make([]float64, len(f.uncached)+1)
	for i, u := range f.uncached {
		f.cum[i+1] = f.cum[i] + float64(u)
	}
	if len(px) >= MinFit {
		b0, b1 := line(px, py)
		lo, hi := slices.Min(px), slices.Max(px)
		sorted := slices.Sorted(slices.Values(py))
		median := sorted[len(sorted)/2]
		switch {
		case b1 > 0 && (hi-lo)*b1 >= 0.2*median:
			f.PrefillTokensPerS, f.PrefillOverheadS = 1/b1, max(b0, 0)
		case hi > 0:
			// The legs hardly vary with the prompt: every prompt seen was computed within a
			// step's memory-bound floor, and the rate cannot be told from them. What can: the
			// longest was computed within a typical leg — a lower bound on the rate, taken as
			// the rate (the predictions err towards too few prefills' capacity, not too much).
			f.PrefillTokensPerS, f.PrefillOverheadS, f.PrefillRateBound = hi/median, 0, true
		}
		if f.PrefillTokensPerS > 0 {
			f.PrefillFrom, f.PrefillFloorS = len(px), sorted[len(sorted)/10]
		}
	}
	if len(pair) > 0 {
		slices.Sort(pair)
		f.PairOverheadS, f.PairFrom = pair[len(pair)/2], len(pair)
		if len(fixed) > 0 {
			slices.Sort(fixed)
			f.PairFixedS = fixed[len(fixed)/2]
		}
	}
	if len(dx) >= MinFit {
		b0, b1 := line(dx, dy)
		if b1 < 0 { // no load effect seen: the pace alone
			b0, b1 = mean(dy), 0
		}
		f.DecodeBaseS, f.DecodePerRequestS, f.DecodeFrom = max(b0, 1e-6), b1, len(dx)
	}
	if len(pair) > 0 && len(fixed) == 0 { // no stream's TPOT beside its TTFT: the fitted pace stands for it
		f.PairFixedS = max(0, f.PairOverheadS-1.5*f.DecodeBaseS)
	}
	if len(dx) < MinFit && len(legs) >= MinFit { // too few streams: what the durations tell
		f.fitDurations(legs)
	}
	return f
}

// decodeLeg is what a split request's duration says of its decode: the part of it after its
// prefill leg (s, seconds), its completion tokens and the requests decoding beside it, itself
// included (batch).
type decodeLeg struct{ tokens, batch, s float64 }

// fitDurations fits the decode's pace and the pair's overhead from split requests' durations:
// what a whole answer shows (its first byte is its last token's, so it has no TTFT, no TPOT).
//
// The estimator is the model the predictions use, read over the whole decode part: after the
// prefill leg come the pair's fixed part F (KV transfer, second hop), the decode step under way
// when the KV lands and the request's own first (1.5 steps), then a step per further token, a
// step lasting α + β·b at b requests decoding, so
//
//	duration − prefill leg = F + (n + ½)·(α + β·b).
//
// A single request cannot tell F from α (one equation, two unknowns), so none is fitted alone
// (say, less an assumed F); requests of different lengths can. Divided by its n + ½ steps, each
// request's time per step is α + β·b + F / (n + ½): least squares of that over the window gives
// α (the intercept), β (the slope over the load) and F (the slope over 1 / (n + ½): what is paid
// once, spread over fewer steps the shorter the answer). Read per step, a long answer and a
// short one weigh alike: a request's pace wanders with the batch around it for as long as it
// decodes, which in seconds grows with its length and would let the longest answers drown what
// the short ones say of F. b is the decode's load when the request was sent, as the streams'
// fit reads it.
//
// When b does not vary apart from the lengths (every request on an idle decode), β cannot be
// told and is 0. When the lengths do not vary enough for the tokens' part to span a fifth of a
// typical decode part, F cannot be told from α: α is then the bound they give — the median
// decode part over its n + ½ steps, everything counted as pace — F is 0 and DecodePaceBound says
// so (the predictions err towards too slow a decode, not too fast).
//
// The pair's overhead, as the streams' fit defines it (TTFT less the prefill leg), is then
// F + 1.5 steps at the median load; its fixed part F.
func (f *Fit) fitDurations(legs []decodeLeg) {
	steps, perStep, once, load := make([]float64, len(legs)), make([]float64, len(legs)), make([]float64, len(legs)), make([]float64, len(legs))
	for i, l := range legs {
		steps[i] = l.tokens + 0.5
		perStep[i], once[i], load[i] = l.s/steps[i], 1/steps[i], l.batch
	}
	alpha, fixed, beta := plane(once, load, perStep)
	if beta <= 0 { // no load effect told apart: the pace alone
		alpha, fixed = line(once, perStep)
		beta = 0
	}
	parts := slices.Sorted(func(yield func(float64) bool) {
		for _, l := range legs {
			if !yield(l.s) {
				return
			}
		}
	})
	f.DecodePaceBound = alpha <= 0 || (slices.Max(steps)-slices.Min(steps))*alpha < 0.2*parts[len(parts)/2]
	if f.DecodePaceBound {
		slices.Sort(perStep)
		alpha, beta, fixed = perStep[len(perStep)/2], 0, 0
	}
	slices.Sort(load)
	f.DecodeBaseS, f.DecodePerRequestS, f.DecodeFrom, f.DecodeFromDurations = max(alpha, 1e-6), beta, len(legs), true
	f.PairFixedS, f.PairFrom = max(0, fixed), len(legs)
	f.PairOverheadS = f.PairFixedS + 1.5*(f.DecodeBaseS+beta*load[len(load)/2])
}

// plane is the least-squares y = b0 + b1·x1 + b2·x2; b1 = b2 = 0 (and b0 the mean) when x1 and
// x2 do not vary apart (then only a line can be fitted).
func plane(x1, x2, y []float64) (b0, b1, b2 float64) {
	m1, m2, my := mean(x1), mean(x2), mean(y)
	var s11, s12, s22, s1y, s2y float64
	for i := range y {
		d1, d2, dy := x1[i]-m1, x2[i]-m2, y[i]-my
		s11, s12, s22, s1y, s2y = s11+d1*d1, s12+d1*d2, s22+d2*d2, s1y+d1*dy, s2y+d2*dy
	}
	det := s11*s22 - s12*s12
	if det <= 1e-9*s11*s22 {
		return my, 0, 0
	}
	b1, b2 = (s1y*s22-s2y*s12)/det, (s2y*s11-s1y*s12)/det
	return my - b1*m1 - b2*m2, b1, b2
}

// line is the least-squares line y = b0 + b1·x; a flat b1 = 0 when x does not vary.
func line(x, y []float64) (b0, b1 float64) {
	mx, my := mean(x), mean(y)
	var sxx, sxy float64
	for i := range x {
		sxx += (x[i] - mx) * (x[i] - mx)
		sxy += (x[i] - mx) * (y[i] - my)
	}
	if sxx == 0 {
		return my, 0
	}
	b1 = sxy / sxx
	return my - b1*mx, b1
}

func mean(v []float64) float64 {
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(max(1, len(v)))
}

// SLO is what the operator asks of a request.
type SLO struct {
	TTFT, TPOT time.Duration
}

// Prediction is what a split and a threshold would give at the current load; an infinite
// latency (a role past its capacity) is reported as -1.
type Prediction struct {
	Prefill   int     `json:"prefill"`
	Decode    int     `json:"decode"`
	Threshold int     `json:"local_prefill_threshold"`
	TTFTp90S  float64 `json:"ttft_p90_s"`
	TPOTS     float64 `json:"tpot_s"`
	// PrefillUtil and DecodeBatch explain them: each prefill's busy share, each decode's mean
	// requests decoding at once.
	PrefillUtil float64 `json:"prefill_utilization"`
	DecodeBatch float64 `json:"decode_batch"`
	MeetsSLO    bool    `json:"meets_slo"`
	score       float64 // the worse of its two ratios to the SLOs (> 1: within)
	other       float64 // the better one
}

// Predict predicts split (prefill, decode) with local prefill under threshold tokens.
func (f Fit) Predict(prefill, decode, threshold int, slo SLO) Prediction {
	return f.predict(prefill, decode, threshold, slo, true)
}

// predict is Predict; without prefillSide it leaves the prefill's queue out (Threshold asks
// what the decodes alone would give).
func (f Fit) predict(prefill, decode, threshold int, slo SLO, prefillSide bool) Prediction {
	p := Prediction{Prefill: prefill, Decode: decode, Threshold: threshold, TTFTp90S: -1, TPOTS: -1}
	if !f.Fitted() || decode < 1 || len(f.uncached) == 0 {
		return p
	}
	cp := f.PrefillTokensPerS
	// The requests under the threshold stay on the decodes; the rest are split.
	k := sort.SearchInts(f.uncached, threshold)
	local, split := f.uncached[:k], f.uncached[k:]
	if prefill < 1 && len(split) > 0 {
		return p // a prefill is needed and there is none
	}
	share := float64(len(split)) / float64(len(f.uncached))
	lambdaSplit, lambdaLocal := f.Rate*share, f.Rate*(1-share)
	var ttft float64
	var prefillQ []float64 // the prefill leg's quantiles at the levels of quantileLevels
	if len(split) > 0 {
		// An engine batches prefills: a step's fixed cost (o_p) is shared by every prompt in
		// it, so capacity is in tokens — each prompt is u / C_p of work.
		s := (f.cum[len(f.uncached)] - f.cum[k]) / float64(len(split)) / cp
		rho := lambdaSplit * s / float64(prefill)
		p.PrefillUtil = rho
		if rho >= 1 {
			return p
		}
		switch {
		case !prefillSide:
		case rho < 0.02: // next to no queue: each prompt's own leg
			prefillQ = make([]float64, quantileLevels)
			for i := range prefillQ {
				prefillQ[i] = max(f.PrefillFloorS, f.PrefillOverheadS+float64(at(split, level(i)))/cp)
			}
		default:
			prefillQ = f.prefillQuantiles(rho, s, k)
		}
	}
	// Decode: a step is memory-bound (α) until its compute outgrows it. A prompt computed
	// there stalls the step beside it only by what its compute takes past α; the share of
	// the decode's time so stalled slows every token alike. Then TPOT at the batch it holds.
	frac := 0.0
	if len(local) > 0 {
		// Σ max(0, u / C_p − α) over the local prompts: those past α·C_p tokens, from the sums.
		a := min(k, sort.SearchInts(f.uncached, int(f.DecodeBaseS*cp)+1))
		over := (f.cum[k]-f.cum[a])/cp - f.DecodeBaseS*float64(k-a)
		frac = lambdaLocal / float64(decode) * max(0, over) / float64(len(local))
	}
	if frac >= 1 {
		return p
	}
	tpot := f.DecodeBaseS / (1 - frac)
	for range 100 { // b depends on TPOT and TPOT on b: to the fixed point
		b := f.Rate * f.Output * tpot / float64(decode)
		next := (f.DecodeBaseS + f.DecodePerRequestS*b) / (1 - frac)
		if next > 60 {
			return p
		}
		if math.Abs(next-tpot) < 1e-9 {
			break
		}
		tpot = next
	}
	p.DecodeBatch = f.Rate * f.Output * tpot / float64(decode)
	// TTFT p90 over both groups. A split request's: its prefill leg, the KV transfer and the
	// second hop, then the decode's first step — the one under way when the KV lands (half of
	// one, on average) and the request's own. A local one's: the step under way, then its own
	// (its compute, or the memory-bound step when that is longer). The p90 of the mixture, each
	// group weighted by its share.
	var splitQ, localQ []float64
	if len(split) > 0 && prefillSide {
		splitQ = make([]float64, quantileLevels)
		for i, q := range prefillQ {
			splitQ[i] = q + f.PairFixedS + 1.5*tpot
		}
	}
	if len(local) > 0 {
		localQ = make([]float64, quantileLevels)
		for i := range localQ {
			localQ[i] = tpot + max(float64(at(local, level(i)))/cp, tpot)
		}
	}
	ttft = mixtureP90(splitQ, localQ, share)
	p.TTFTp90S, p.TPOTS = ttft, tpot
	p.MeetsSLO = (slo.TTFT <= 0 || ttft <= slo.TTFT.Seconds()) && (slo.TPOT <= 0 || tpot <= slo.TPOT.Seconds())
	a, b := ratio(slo.TTFT, ttft), ratio(slo.TPOT, tpot)
	p.score, p.other = min(a, b), max(a, b)
	return p
}

// better reports whether prediction a is further within the SLOs than b: by the worse of its
// two ratios; where those are within 1 % of each other (a difference no measurement tells
// apart), by the other ratio. A tie keeps b.
func better(a, b Prediction) bool {
	if !nearRatio(a.score, b.score) {
		return a.score > b.score
	}
	return !nearRatio(a.other, b.other) && a.other > b.other
}

// weigh predicts split (prefill, decode) with Threshold's threshold and without one, and
// returns the one further within the SLOs (better; a tie keeps the threshold) and the other
// (zero when there is no threshold to weigh).
func (f Fit) weigh(prefill, decode int, slo SLO) (chosen, other Prediction) {
	t := f.Threshold(decode, slo)
	without := f.Predict(prefill, decode, 0, slo)
	if t <= 0 {
		return without, Prediction{}
	}
	with := f.Predict(prefill, decode, t, slo)
	if without.TTFTp90S >= 0 && (with.TTFTp90S < 0 || better(without, with)) {
		return without, with
	}
	return with, without
}

// nearRatio reports whether two ratios are within 1 % of each other.
func nearRatio(a, b float64) bool {
	if a == b {
		return true
	}
	if math.IsInf(a, 0) || math.IsInf(b, 0) {
		return false
	}
	return math.Abs(a-b) <= 0.01*max(math.Abs(a), math.Abs(b))
}

// ThresholdFor is the threshold Advise weighs best for split (prefill, decode): Threshold's,
// unless always splitting is predicted further within the SLOs (0) — what auto mode applies to
// the fleet as it stands, so that it agrees with the advice. Splits are compared with each
// other by the worse ratio alone; only a split's own two ways are weighed by better.
func (f Fit) ThresholdFor(prefill, decode int, slo SLO) int {
	if prefill < 1 {
		return f.Threshold(decode, slo)
	}
	c, _ := f.weigh(prefill, decode, slo)
	return c.Threshold
}

// ratio is how far within its SLO a latency is (> 1: within); without an SLO, 1 / latency.
func ratio(slo time.Duration, v float64) float64 {
	if v <= 0 {
		return math.Inf(1)
	}
	if slo <= 0 {
		return 1 / v
	}
	return slo.Seconds() / v
}

// Threshold is the uncached length under which a request should skip its prefill: the longest
// whose local compute costs no more than what the pair adds (its overhead) and what a decode
// step hides anyway (a memory-bound step of α computes that much for free), lowered until the
// predicted TPOT with decode workers meets its SLO; 0 when no length gains.
func (f Fit) Threshold(decode int, slo SLO) int {
	if !f.Fitted() || f.PairOverheadS <= 0 {
		return 0
	}
	t := int((f.PairOverheadS + f.DecodeBaseS) * f.PrefillTokensPerS)
	for t > 0 {
		p := f.predict(1, decode, t, slo, false) // the prefill side left out: the decode's cost alone
		if p.TPOTS >= 0 && (slo.TPOT <= 0 || p.TPOTS <= slo.TPOT.Seconds()) {
			return t
		}
		t = t * 3 / 4
	}
	return 0
}

// Advice is the advisor's answer for a fleet of Total workers.
type Advice struct {
	Total       int        `json:"total"`
	SLO         SLOView    `json:"slo"`
	Current     Prediction `json:"current"`
	Recommended Prediction `json:"recommended"`
	Fit         Fit        `json:"fit"`
	// Splits are the predictions weighed, each split with its threshold and without one, for
	// a fleet of at most MaxListedSplits workers (larger: left out).
	Splits []Prediction `json:"splits,omitempty"`
	// Why says what the recommendation rests on, or why there is none.
	Why string `json:"why"`
}

// SLOView is an SLO as the advice shows it.
type SLOView struct {
	TTFTS float64 `json:"ttft_s"`
	TPOTS float64 `json:"tpot_s"`
}

// MaxListedSplits is the largest fleet whose every split's prediction the advice lists.
const MaxListedSplits = 32

// Advise recommends a split of total workers (and the threshold) for slo, beside the current
// split (prefill, decode, threshold).
func (f Fit) Advise(total, prefill, decode, threshold int, slo SLO) Advice {
	adv := Advice{Total: total, SLO: SLOView{slo.TTFT.Seconds(), slo.TPOT.Seconds()}, Fit: f}
	adv.Current = f.Predict(prefill, decode, threshold, slo)
	if !f.Fitted() {
		adv.Why = "not enough traffic yet: each rate needs at least 20 requests in the window (see fit)"
		adv.Recommended = adv.Current
		return adv
	}
	best := Prediction{score: -1}
	for np := 1; np < total; np++ { // a PD fleet: at least one worker of each role
		nd := total - np
		// Each split with its threshold and without one (always split): whichever is
		// further within the SLOs.
		c, alt := f.weigh(np, nd, slo)
		if total <= MaxListedSplits {
			adv.Splits = append(adv.Splits, c)
			if alt.Decode > 0 {
				adv.Splits = append(adv.Splits, alt)
			}
		}
		if c.TTFTp90S >= 0 && (c.score > best.score || c.score == best.score && c.Decode > best.Decode) {
			best = c
		}
	}
	if best.score < 0 {
		adv.Why = "no split of the fleet keeps up with the current load: add workers"
		adv.Recommended = adv.Current
		return adv
	}
	adv.Recommended = best
	adv.Why = "the split whose predicted TTFT p90 and TPOT are furthest within their SLOs (the worse of the two ratios), at the current load"
	if !best.MeetsSLO {
		adv.Why = "no split meets the SLOs at the current load; this one comes closest: add workers"
	}
	return adv
}

// curves memoises the replayed prefill leg's quantiles per split point.
type curves struct {
	mu  sync.Mutex
	byK map[int][][]float64
}

// quantileLevels: a leg's distribution is kept as its quantiles at 0, 5 %, … 95 % and the
// longest.
const quantileLevels = 21

// level is the i-th of the quantile levels.
func level(i int) float64 { return float64(i) / (quantileLevels - 1) }

// at is the quantile q of sorted.
func at(sorted []int, q float64) int {
	return sorted[min(len(sorted)-1, int(q*float64(len(sorted))))]
}

// cdf is the share of a distribution, given by its quantiles, at or under x.
func cdf(qs []float64, x float64) float64 {
	if x < qs[0] {
		return 0
	}
	for i := 1; i < len(qs); i++ {
		if x < qs[i] {
			return level(i-1) + (level(i)-level(i-1))*(x-qs[i-1])/(qs[i]-qs[i-1])
		}
	}
	return 1
}

// mixtureP90 is the 90th percentile of two groups' latencies, given by their quantiles (nil:
// the group is empty or unknown), the first a share of the whole.
func mixtureP90(a, b []float64, share float64) float64 {
	switch {
	case a == nil && b == nil:
		return 0
	case b == nil:
		return a[(quantileLevels-1)*9/10]
	case a == nil:
		return b[(quantileLevels-1)*9/10]
	}
	lo, hi := min(a[0], b[0]), max(a[quantileLevels-1], b[quantileLevels-1])
	for range 60 {
		mid := (lo + hi) / 2
		if share*cdf(a, mid)+(1-share)*cdf(b, mid) < 0.9 {
			lo = mid
		} else {
			hi = mid
		}
	}
	return hi
}

// The loads the replay is run at: 1 − ρ from 0.98 down to 0.002, geometrically.
const gridPoints = 20

func gridRho(i int) float64 { return 1 - 0.98*math.Pow(0.002/0.98, float64(i)/(gridPoints-1)) }

// prefillQuantiles is the prefill leg's quantiles on a prefill worker at utilisation rho (0.02
// ≤ rho < 1) of the split prompts from k on (mean work s each): the replay's at the grid's
// loads, and between them interpolated (log of each quantile against log(1 − ρ)); past the
// grid's last load, a queue growing as 1 / (1 − ρ).
func (f Fit) prefillQuantiles(rho, s float64, k int) []float64 {
	c := f.curves
	if c == nil { // a Fit not made by Advisor.Fit: nothing to keep the curve in
		c = &curves{byK: map[int][][]float64{}}
	}
	c.mu.Lock()
	curve, ok := c.byK[k]
	if !ok {
		curve = make([][]float64, gridPoints)
		for i := range curve {
			curve[i] = f.replayQuantiles(gridRho(i)/s, k)
		}
		c.byK[k] = curve
	}
	c.mu.Unlock()
	out := make([]float64, quantileLevels)
	x := math.Log(1 - rho)
	for i := 1; i < gridPoints; i++ {
		if x >= math.Log(1-gridRho(i)) {
			x0, x1 := math.Log(1-gridRho(i-1)), math.Log(1-gridRho(i))
			w := (x - x0) / (x1 - x0)
			for j := range out {
				out[j] = math.Exp((1-w)*math.Log(curve[i-1][j]) + w*math.Log(curve[i][j]))
			}
			return out
		}
	}
	for j := range out {
		out[j] = curve[gridPoints-1][j] * (1 - gridRho(gridPoints-1)) / (1 - rho)
	}
	return out
}

// replayQuantiles is the quantiles of a prefill leg on one prefill worker offered lambda
// split requests a second, whose prompts are the window's from the k-th shortest up: a replay
// of the engine's continuous batching — every prompt waiting when a step starts joins it, and
// the step lasts o_p + its tokens / C_p, never less than the fitted floor — over 20,000 Poisson
// arrivals (a fixed seed: the same window gives the same answer), the first 2,000 left out as
// warm-up. A single-server queue (each prompt its own o_p + u / C_p in turn) is what an engine
// is not: it puts every short prompt behind every other, where the engine computes them in
// one step that costs no more than one of them under its memory-bound floor.
func (f Fit) replayQuantiles(lambda float64, k int) []float64 {
	const n, warm = 20_000, 2000
	split := f.uncached[k:]
	r := rand.New(rand.NewPCG(uint64(len(split)), uint64(k)))
	type waiting struct {
		at float64
		u  int
	}
	queue := make([]waiting, 0, 64)
	sojourn := make([]float64, 0, n-warm)
	arrival, free := r.ExpFloat64()/lambda, 0.0
	for i, done := 0, 0; done < n; {
		if len(queue) == 0 && i < n {
			free = max(free, arrival)
		}
		for i < n && arrival <= free {
			queue = append(queue, waiting{arrival, split[r.IntN(len(split))]})
			arrival += r.ExpFloat64() / lambda
			i++
		}
		tokens := 0
		for _, w := range queue {
			tokens += w.u
		}
		free += max(f.PrefillFloorS, f.PrefillOverheadS+float64(tokens)/f.PrefillTokensPerS)
		for _, w := range queue {
			if done >= warm {
				sojourn = append(sojourn, free-w.at)
			}
			done++
		}
		queue = queue[:0]
	}
	slices.Sort(sojourn)
	out := make([]float64, quantileLevels)
	for i := range out {
		out[i] = sojourn[min(len(sojourn)-1, int(level(i)*float64(len(sojourn))))]
	}
	return out
}

// SplitWork is the mean prefill compute, in seconds, of a prompt at or over threshold uncached
// tokens (those a split still sends to a prefill): what each request a prefill has in flight
// puts before the next one. 0 when unfitted or none.
func (f Fit) SplitWork(threshold int) float64 {
	if !f.Fitted() || len(f.uncached) == 0 {
		return 0
	}
	k := sort.SearchInts(f.uncached, threshold)
	if k == len(f.uncached) {
		return 0
	}
	return (f.cum[len(f.uncached)] - f.cum[k]) / float64(len(f.uncached)-k) / f.PrefillTokensPerS
}
