package advisor

import (
	"math/rand/v2"
	"testing"
	"time"
)

// traffic is rate requests a second for span, from a known fleet: a prefill leg of o + u / c
// when idle (and longer when not), a pair overhead, TPOT α + β·b.
type truth struct {
	c, o, pair, alpha, beta float64
}

func synth(t0 time.Time, tr truth, rate float64, span time.Duration, prompt func(*rand.Rand) int, output int, r *rand.Rand) []Sample {
	var out []Sample
	n := int(rate * span.Seconds())
	for i := range n {
		u := prompt(r)
		busy := r.IntN(3)
		b := 1 + r.IntN(40)
		leg := tr.o + float64(u)/tr.c
		if busy > 0 {
			leg *= 1 + float64(busy)
		}
		out = append(out, Sample{At: t0.Add(time.Duration(float64(i) / rate * float64(time.Second))), Split: true, Prompt: u + 10, Uncached: u, Output: output,
			PrefillTime: secs(leg), PrefillBusy: busy, TTFT: secs(leg + tr.pair), TPOT: secs((tr.alpha + tr.beta*float64(b)) * (1 + 0.02*r.NormFloat64())), DecodeBusy: b - 1})
	}
	return out
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

func near(got, want, tol float64) bool { return got >= want*(1-tol) && got <= want*(1+tol) }

// The fit recovers the rates the traffic came from, and says how many requests each rests on.
func TestFitRecoversTheFleetsRates(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	t0 := time.Unix(1_000_000, 0)
	tr := truth{c: 30_000, o: 0.004, pair: 0.012, alpha: 0.007, beta: 0.0002}
	a := &Advisor{Now: func() time.Time { return t0.Add(2 * time.Minute) }}
	for _, s := range synth(t0, tr, 10, 2*time.Minute, func(r *rand.Rand) int { return 100 + r.IntN(3000) }, 200, r) {
		a.Observe(s)
	}
	f := a.Fit()
	if !f.Fitted() || f.Requests != 1200 || !near(f.Rate, 10, 0.02) {
		t.Fatalf("fit %+v", f)
	}
	if !near(f.PrefillTokensPerS, tr.c, 0.02) || !near(f.PrefillOverheadS, tr.o, 0.05) || f.PrefillFrom < 300 {
		t.Errorf("prefill: %.0f tokens/s (want %.0f), overhead %.4f s (want %.4f), from %d", f.PrefillTokensPerS, tr.c, f.PrefillOverheadS, tr.o, f.PrefillFrom)
	}
	if !near(f.PairOverheadS, tr.pair, 0.01) || !near(f.DecodeBaseS, tr.alpha, 0.05) || !near(f.DecodePerRequestS, tr.beta, 0.05) {
		t.Errorf("pair %.4f (want %.4f), TPOT %.5f + %.6f·b (want %.5f + %.6f·b)", f.PairOverheadS, tr.pair, f.DecodeBaseS, f.DecodePerRequestS, tr.alpha, tr.beta)
	}
	// The window forgets: ten minutes later nothing is left to fit.
	a.Now = func() time.Time { return t0.Add(12 * time.Minute) }
	if f := a.Fit(); f.Requests != 0 || f.Fitted() {
		t.Errorf("an old window still fitted: %+v", f)
	}
}

// whole is traffic from a known fleet as in synth, each request of its own prompt and output:
// a prefill leg of o + u / c when idle, then the pair's fixed part (fixed, ±10 %), the decode
// step under way and the request's own, and a step for each further token, a step lasting
// α + β·b (±2 %). Streamed, a request shows its TTFT and TPOT; whole, only its duration.
func whole(t0 time.Time, tr truth, fixed float64, n int, rate float64, prompt, output func(*rand.Rand) int, streamed bool, r *rand.Rand) []Sample {
	var out []Sample
	for i := range n {
		u, o := prompt(r), output(r)
		busy, b := r.IntN(3), 1+r.IntN(40)
		leg := tr.o + float64(u)/tr.c
		if busy > 0 {
			leg *= 1 + float64(busy)
		}
		tpot := (tr.alpha + tr.beta*float64(b)) * (1 + 0.02*r.NormFloat64())
		ttft := leg + fixed*(1+0.1*r.NormFloat64()) + 1.5*tpot
		s := Sample{At: t0.Add(time.Duration(float64(i) / rate * float64(time.Second))), Split: true, Prompt: u + 10, Uncached: u, Output: o,
			PrefillTime: secs(leg), PrefillBusy: busy, DecodeBusy: b - 1, Duration: secs(ttft + float64(o-1)*tpot)}
		if streamed {
			s.TTFT, s.TPOT = secs(ttft), secs(tpot)
		}
		out = append(out, s)
	}
	return out
}

// Whole answers (not streamed) teach the decode's pace and the pair's overhead too: 240 of
// them, of prompts from 100 to 3,100 tokens and outputs from 8 to 400, fit the step α + β·b
// and the pair's overhead and fixed part about as near the fleet's as the same traffic
// streamed does, from every request; the fit says it read durations, and advises.
func TestFitFromWholeAnswers(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	tr := truth{c: 30_000, o: 0.004, alpha: 0.007, beta: 0.0002}
	const fixed = 0.012
	prompt := func(r *rand.Rand) int { return 100 + r.IntN(3000) }
	output := func(r *rand.Rand) int { return 8 + r.IntN(393) }
	fitOf := func(streamed bool) Fit {
		a := &Advisor{Now: func() time.Time { return t0.Add(time.Minute) }}
		for _, s := range whole(t0, tr, fixed, 240, 4, prompt, output, streamed, rand.New(rand.NewPCG(21, 22))) {
			a.Observe(s)
		}
		return a.Fit()
	}
	// The pair's overhead as the streams define it, TTFT less the prefill leg: fixed + 1.5 steps
	// at the median load (b = 20.5 of 1 to 40).
	pair := fixed + 1.5*(tr.alpha+tr.beta*20.5)
	for _, c := range []struct {
		name     string
		streamed bool
	}{{"streamed", true}, {"whole", false}} {
		f := fitOf(c.streamed)
		t.Logf("%s: step %.3f ms + %.4f ms·b (want %.3f + %.4f), pair %.2f ms (want %.2f), fixed %.2f ms (want %.2f), from %d and %d requests",
			c.name, 1000*f.DecodeBaseS, 1000*f.DecodePerRequestS, 1000*tr.alpha, 1000*tr.beta, 1000*f.PairOverheadS, 1000*pair, 1000*f.PairFixedS, 1000*fixed, f.DecodeFrom, f.PairFrom)
		if !f.Fitted() || f.DecodeFrom != 240 || f.PairFrom != 240 || f.DecodeFromDurations == c.streamed || f.DecodePaceBound {
			t.Fatalf("%s: fitted %v from %d (decode) and %d (pair) requests, from durations %v, bound %v; want 240 each, from durations %v",
				c.name, f.Fitted(), f.DecodeFrom, f.PairFrom, f.DecodeFromDurations, f.DecodePaceBound, !c.streamed)
		}
		if !near(f.DecodeBaseS, tr.alpha, 0.05) || !near(f.DecodePerRequestS, tr.beta, 0.05) {
			t.Errorf("%s: TPOT %.5f + %.6f·b, want %.5f + %.6f·b", c.name, f.DecodeBaseS, f.DecodePerRequestS, tr.alpha, tr.beta)
		}
		if !near(f.PairOverheadS, pair, 0.1) || !near(f.PairFixedS, fixed, 0.1) {
			t.Errorf("%s: pair overhead %.4f s (want %.4f), its fixed part %.4f s (want %.4f)", c.name, f.PairOverheadS, pair, f.PairFixedS, fixed)
		}
		slo := SLO{TTFT: 2 * time.Second, TPOT: 50 * time.Millisecond}
		if adv := f.Advise(8, 4, 4, 0, slo); adv.Recommended.TTFTp90S <= 0 || adv.Recommended.TPOTS <= 0 || adv.Fit.DecodeFrom != 240 {
			t.Errorf("%s: no advice: %+v (%s)", c.name, adv.Recommended, adv.Why)
		}
	}
}

// Whole answers all of one length cannot tell the decode's pace from what the pair pays once:
// the fit takes the bound they give (every second of the decode part counted as pace), says so,
// and still advises.
func TestFitFromWholeAnswersOfOneLength(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	tr := truth{c: 30_000, o: 0.004, alpha: 0.007, beta: 0.0002}
	a := &Advisor{Now: func() time.Time { return t0.Add(time.Minute) }}
	for _, s := range whole(t0, tr, 0.012, 240, 4, func(r *rand.Rand) int { return 100 + r.IntN(3000) }, func(*rand.Rand) int { return 200 }, false, rand.New(rand.NewPCG(23, 24))) {
		a.Observe(s)
	}
	f := a.Fit()
	// The bound: the decode part over its 200.5 steps, at the median load.
	bound := (0.012 + 200.5*(tr.alpha+tr.beta*20.5)) / 200.5
	if !f.Fitted() || !f.DecodePaceBound || !near(f.DecodeBaseS, bound, 0.05) || f.DecodePerRequestS != 0 || f.PairFixedS != 0 {
		t.Fatalf("fit: fitted %v, bound %v, step %.5f + %.6f·b (want the bound %.5f), fixed %.4f", f.Fitted(), f.DecodePaceBound, f.DecodeBaseS, f.DecodePerRequestS, bound, f.PairFixedS)
	}
	if adv := f.Advise(8, 4, 4, 0, SLO{TTFT: 2 * time.Second, TPOT: 50 * time.Millisecond}); adv.Recommended.TTFTp90S <= 0 {
		t.Errorf("no advice: %+v (%s)", adv.Recommended, adv.Why)
	}
}

// Predictions move the right way: more prefill workers lower TTFT, more decode workers lower
// TPOT, a role past its capacity is reported as such; the advice follows the workload — a
// long-prompt load wants more prefill than a long-output one.
func TestAdviceFollowsTheWorkload(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	tr := truth{c: 30_000, o: 0.004, pair: 0.012, alpha: 0.007, beta: 0.0002}
	fitOf := func(rate float64, prompt func(*rand.Rand) int, output int) Fit {
		a := &Advisor{Now: func() time.Time { return t0.Add(time.Minute) }}
		for _, s := range synth(t0, tr, rate, time.Minute, prompt, output, rand.New(rand.NewPCG(3, 4))) {
			a.Observe(s)
		}
		return a.Fit()
	}
	slo := SLO{TTFT: 2 * time.Second, TPOT: 50 * time.Millisecond}
	rag := fitOf(10, func(r *rand.Rand) int { return 6000 + r.IntN(4000) }, 100) // 80k prompt tokens/s
	p2, p4 := rag.Predict(2, 6, 0, slo), rag.Predict(4, 4, 0, slo)
	if p2.TTFTp90S != -1 || p4.TTFTp90S <= 0 {
		t.Errorf("80k prompt tokens/s on 2 prefills of 30k/s must overload them, on 4 not: %+v %+v", p2, p4)
	}
	if p5 := rag.Predict(5, 3, 0, slo); p5.TTFTp90S >= p4.TTFTp90S || p5.TPOTS <= p4.TPOTS {
		t.Errorf("one more prefill, one less decode: TTFT %.3f → %.3f, TPOT %.4f → %.4f", p4.TTFTp90S, p5.TTFTp90S, p4.TPOTS, p5.TPOTS)
	}
	// Chat: questions whose compute (under 5 ms) hides under a decode's memory-bound step (7 ms).
	chat := fitOf(20, func(r *rand.Rand) int { return 20 + r.IntN(130) }, 600)
	a, b := rag.Advise(8, 4, 4, 0, slo), chat.Advise(8, 4, 4, 0, slo)
	if a.Recommended.Prefill <= b.Recommended.Prefill || !a.Recommended.MeetsSLO || !b.Recommended.MeetsSLO {
		t.Errorf("long documents: %+v (%s); chat: %+v (%s)", a.Recommended, a.Why, b.Recommended, b.Why)
	}
	if n := len(a.Splits); n < 7 || n > 14 || len(rag.Advise(MaxListedSplits+1, 4, 4, 0, slo).Splits) != 0 {
		t.Errorf("the advice for 8 lists %d predictions (each split, with its threshold and without); for %d, %d", n, MaxListedSplits+1, len(rag.Advise(MaxListedSplits+1, 4, 4, 0, slo).Splits))
	}
	if b.Recommended.Threshold <= 0 {
		t.Errorf("short prompts should skip their prefill under some threshold: %+v", b.Recommended)
	}
	// Not enough traffic: no recommendation, and it says why.
	empty := (&Advisor{}).Fit().Advise(8, 4, 4, 0, slo)
	if empty.Why == "" || empty.Recommended.TTFTp90S != -1 {
		t.Errorf("no traffic: %+v", empty)
	}
}

// The samples kept are bounded, whatever the traffic.
func TestAdvisorKeepsABoundedWindow(t *testing.T) {
	a := &Advisor{}
	for i := range 3 * MaxSamples {
		a.Observe(Sample{At: time.Now(), Output: i})
	}
	if len(a.ring) != MaxSamples {
		t.Errorf("%d samples kept, bound %d", len(a.ring), MaxSamples)
	}
}

// A prediction reads the samples through their sums: it agrees with the sums taken one sample
// at a time, for any threshold.
func TestPredictionsFromSumsAreTheSamples(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	t0 := time.Unix(1_000_000, 0)
	a := &Advisor{Now: func() time.Time { return t0.Add(time.Minute) }}
	tr := truth{c: 30_000, o: 0.004, pair: 0.012, alpha: 0.007, beta: 0.0002}
	for _, s := range synth(t0, tr, 20, time.Minute, func(r *rand.Rand) int { return r.IntN(8000) }, 100, r) {
		a.Observe(s)
	}
	f := a.Fit()
	for _, threshold := range []int{0, 1, 100, 209, 210, 211, 3000, 7999, 1 << 30} {
		p := f.Predict(3, 5, threshold, SLO{})
		// By hand: the split prompts' mean, and the local prompts' compute past α.
		var split, local []int
		for _, u := range f.uncached {
			if u < threshold {
				local = append(local, u)
			} else {
				split = append(split, u)
			}
		}
		var rho float64
		if len(split) > 0 {
			var sum float64
			for _, u := range split {
				sum += float64(u)
			}
			rho = f.Rate * float64(len(split)) / float64(len(f.uncached)) * sum / float64(len(split)) / f.PrefillTokensPerS / 3
		}
		if !near(p.PrefillUtil, rho, 1e-9) {
			t.Errorf("threshold %d: prefill utilisation %v, by hand %v", threshold, p.PrefillUtil, rho)
		}
		var over float64
		for _, u := range local {
			over += max(0, float64(u)/f.PrefillTokensPerS-f.DecodeBaseS)
		}
		frac := 0.0
		if len(local) > 0 {
			frac = f.Rate * float64(len(local)) / float64(len(f.uncached)) / 5 * over / float64(len(local))
		}
		if frac < 1 && p.TPOTS > 0 && p.TPOTS < f.DecodeBaseS/(1-frac)-1e-12 {
			t.Errorf("threshold %d: TPOT %v below its stalled floor %v", threshold, p.TPOTS, f.DecodeBaseS/(1-frac))
		}
	}
}

// What one advice over the largest window and fleet costs (GET /pd/advice?total=10000 answers
// it; the metrics collector asks for the fleet's own total on every scrape).
func BenchmarkAdviseLargestFleet(b *testing.B) {
	r := rand.New(rand.NewPCG(7, 8))
	t0 := time.Unix(1_000_000, 0)
	a := &Advisor{Now: func() time.Time { return t0.Add(4 * time.Minute) }}
	tr := truth{c: 30_000, o: 0.004, pair: 0.2, alpha: 0.007, beta: 0.0002}
	for _, s := range synth(t0, tr, 80, 4*time.Minute, func(r *rand.Rand) int { return r.IntN(8000) }, 100, r) {
		a.Observe(s)
	}
	f := a.Fit()
	b.ResetTimer()
	for range b.N {
		f.Advise(10_000, 4, 4, 0, SLO{TTFT: time.Millisecond, TPOT: time.Millisecond})
	}
}

// The TTFT p90 is the whole load's: when a threshold keeps all but one request in a hundred on
// the decodes, the few long prompts still split — however slow — are past the 90th percentile,
// and the p90 is the local requests'.
func TestTTFTIsTheMixturesP90(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 9))
	t0 := time.Unix(1_000_000, 0)
	a := &Advisor{Now: func() time.Time { return t0.Add(time.Minute) }}
	tr := truth{c: 30_000, o: 0.004, pair: 0.012, alpha: 0.007, beta: 0.0002}
	for _, s := range synth(t0, tr, 20, time.Minute, func(r *rand.Rand) int {
		if r.IntN(100) == 0 {
			return 20_000 // two thirds of a second of a prefill's compute
		}
		return 50 + r.IntN(100)
	}, 100, r) {
		a.Observe(s)
	}
	f := a.Fit()
	p := f.Predict(2, 6, 1000, SLO{})
	if local := 2 * p.TPOTS; p.TTFTp90S <= 0 || p.TTFTp90S > local*1.01 {
		t.Errorf("1 %% split: TTFT p90 %.4f s, the local requests' %.4f s (TPOT %.4f s)", p.TTFTp90S, local, p.TPOTS)
	}
}

// Short prompts all computed within a step's floor do not show the prefill's rate; the fit
// takes the bound they give (the longest prompt over a median leg), says so, and advises.
func TestFitOfPromptsUnderTheFloor(t *testing.T) {
	r := rand.New(rand.NewPCG(4, 4))
	t0 := time.Unix(1_000_000, 0)
	a := &Advisor{Now: func() time.Time { return t0.Add(time.Minute) }}
	for i := range 1200 {
		u := 40 + r.IntN(121)
		leg := 0.071 * (1 + 0.01*r.NormFloat64()) // the floor, whatever the prompt
		a.Observe(Sample{At: t0.Add(time.Duration(i) * 50 * time.Millisecond), Split: true, Prompt: u + 4000, Uncached: u, Output: 32,
			PrefillTime: secs(leg), TTFT: secs(leg + 0.2), TPOT: secs(0.12 + 0.0006*float64(i%30)), DecodeBusy: i % 30})
	}
	f := a.Fit()
	if !f.Fitted() || !f.PrefillRateBound || !near(f.PrefillTokensPerS, 160/0.071, 0.05) || !near(f.PrefillFloorS, 0.071, 0.05) {
		t.Fatalf("fit: fitted %v, bound %v, %.0f tokens/s (want about %.0f), floor %.3f s", f.Fitted(), f.PrefillRateBound, f.PrefillTokensPerS, 160/0.071, f.PrefillFloorS)
	}
	if adv := f.Advise(8, 4, 4, 0, SLO{TTFT: 400 * time.Millisecond, TPOT: 150 * time.Millisecond}); adv.Recommended.TTFTp90S <= 0 {
		t.Errorf("no advice: %+v (%s)", adv.Recommended, adv.Why)
	}
}

// Where the decodes' pace decides (TPOT far tighter against its SLO than TTFT), a split with
// and without its threshold differ in TPOT by what no measurement tells apart: the TTFT
// decides, and auto mode's threshold for the fleet (ThresholdFor) is the advice's.
func TestThresholdAgreesWithTheAdvice(t *testing.T) {
	r := rand.New(rand.NewPCG(4, 4))
	t0 := time.Unix(1_000_000, 0)
	a := &Advisor{Now: func() time.Time { return t0.Add(time.Minute) }}
	tr := truth{c: 30_000, o: 0.004, pair: 0.030, alpha: 0.0077, beta: 0.00003}
	for _, s := range synth(t0, tr, 8, time.Minute, func(r *rand.Rand) int {
		if r.IntN(10) == 0 {
			return 300 + r.IntN(500) // a few short questions
		}
		return 1500 + r.IntN(1000)
	}, 100, r) {
		a.Observe(s)
	}
	f := a.Fit()
	slo := SLO{TTFT: 2 * time.Second, TPOT: 50 * time.Millisecond}
	th := f.Threshold(2, slo)
	with, without := f.Predict(1, 2, th, slo), f.Predict(1, 2, 0, slo)
	if th <= 0 || !nearRatio(with.score, without.score) || with.TTFTp90S >= without.TTFTp90S {
		t.Fatalf("the case is not made: threshold %d; with it TTFT %.4f TPOT %.5f, without %.4f %.5f", th, with.TTFTp90S, with.TPOTS, without.TTFTp90S, without.TPOTS)
	}
	adv := f.Advise(3, 1, 2, th, slo)
	if adv.Recommended.Prefill != 1 || adv.Recommended.Threshold != th {
		t.Errorf("recommended %d : %d under %d, want 1 : 2 under %d (TTFT %.4f against %.4f)", adv.Recommended.Prefill, adv.Recommended.Decode, adv.Recommended.Threshold, th, with.TTFTp90S, without.TTFTp90S)
	}
	if got := f.ThresholdFor(1, 2, slo); got != adv.Recommended.Threshold {
		t.Errorf("auto mode would apply %d, the advice recommends %d", got, adv.Recommended.Threshold)
	}
}
