package advisor

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/sim"
)

// The prefill's TTFT is predicted as the engine gives it: a chat load (short questions after a
// cached system prompt, and one in seven a new prompt of 1,000–4,000 tokens) is replayed through
// the simulator's step model of continuous batching (vLLM's scheduler, sim.Replay, model time)
// at three rates on one prefill; the advisor, fitted from what Baton would have seen of those
// legs, predicts each rate's TTFT p90 within 20 %. A queue that serves one prompt at a time
// (an M/M/1 on each prompt's o_p + u / C_p, the advisor's model before) misses it by half.
func TestPrefillPredictionFollowsTheEngine(t *testing.T) {
	const pair, alpha = 0.010, 0.008 // the KV transfer and second hop; the decode's step
	perf := sim.DefaultPerf()
	for _, rate := range []float64{15, 35, 55} {
		r := rand.New(rand.NewPCG(11, uint64(rate)))
		var offered []sim.Offered
		var at time.Duration
		for at < 10*time.Minute {
			at += time.Duration(r.ExpFloat64() / rate * float64(time.Second))
			o := sim.Offered{At: at, Compute: 40 + r.IntN(120), Cached: 4000, Want: 1}
			if r.IntN(100) < 15 {
				o.Compute, o.Cached = 1000+r.IntN(3000), 0
			}
			offered = append(offered, o)
		}
		_, legs, err := sim.Replay(perf, offered)
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.Unix(1_000_000, 0)
		var last time.Time
		a := &Advisor{Now: func() time.Time { return last }}
		var measured []time.Duration
		for i, o := range offered {
			busy := 0
			for j := i - 1; j >= 0 && i-j < 500; j-- {
				if offered[j].At+legs[j] > o.At {
					busy++
				}
			}
			end := t0.Add(o.At + legs[i])
			if end.After(last) {
				last = end
			}
			a.Observe(Sample{At: end, Split: true, Prompt: o.Compute + o.Cached, Uncached: o.Compute, Output: 20,
				PrefillTime: legs[i], PrefillBusy: busy, TTFT: legs[i] + secs(pair+1.5*alpha), TPOT: secs(alpha * (1 + 0.01*r.NormFloat64())), DecodeBusy: r.IntN(8)})
			if i >= len(offered)/10 {
				measured = append(measured, legs[i])
			}
		}
		slices.Sort(measured)
		want := measured[len(measured)*9/10].Seconds() + pair + 1.5*alpha
		f := a.Fit()
		if !f.Fitted() {
			t.Fatalf("%.0f req/s: not fitted: %+v", rate, f)
		}
		got := f.Predict(1, 4, 0, SLO{}).TTFTp90S
		s := f.Uncached / f.PrefillTokensPerS
		rho := f.Rate * s
		single := f.PrefillOverheadS + 2.302585092994046*s/(1-rho) + f.PairOverheadS
		t.Logf("%.0f req/s (prefill busy %.2f): the engine's TTFT p90 %.1f ms, predicted %.1f ms (a one-at-a-time queue: %.1f ms); fit %.0f tokens/s + %.1f ms, floor %.1f ms",
			rate, rho, 1000*want, 1000*got, 1000*single, f.PrefillTokensPerS, 1000*f.PrefillOverheadS, 1000*f.PrefillFloorS)
		if !near(got, want, 0.2) {
			t.Errorf("%.0f req/s: predicted TTFT p90 %.1f ms, the engine gave %.1f ms", rate, 1000*got, 1000*want)
		}
	}
}
