package sim

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// BenchmarkPrefillServesWhole measures, in the step model's time, what a PD fleet's mirror case
// would cost and give: a prefill worker serving its prefills — chat (a 40–160-token question
// after a 4,000-token system prompt it holds, 10 a second) or documents (2,000–4,000 new tokens,
// 5 a second) — also serves whole requests (a chat question, 32 output tokens) moved from a
// saturated decode pool, at 0 to 8 a second. It reports the prefills' leg p90 (what every split
// request's TTFT carries) and the moved requests' TTFT p90 and TPOT p90 there. At DefaultPerf's
// costs; the ratios are the point (docs/REFERENCE.md, "The mirror case").
//
//	go test ./internal/sim -run XXX -bench PrefillServesWhole -benchtime 1x
func BenchmarkPrefillServesWhole(b *testing.B) {
	p := DefaultPerf()
	for _, mix := range []string{"chat", "documents"} {
		for _, moved := range []float64{0, 1, 2, 4, 8} {
			b.Run(fmt.Sprintf("%s/moved=%v/s", mix, moved), func(b *testing.B) { prefillServesWhole(b, p, mix, moved) })
		}
	}
}

func prefillServesWhole(b *testing.B, p Perf, mix string, moved float64) {
	var prefillP90, ttftP90, tpotP90 time.Duration
	for range b.N {
		r := rand.New(rand.NewPCG(3, 5))
		var offered []Offered
		var whole []bool
		var at, next time.Duration
		const span = 10 * time.Minute
		for at < span {
			o := Offered{Compute: 40 + r.IntN(120), Cached: 4000, Want: 1}
			rate := 10.0
			if mix == "documents" {
				o.Compute, o.Cached, rate = 2000+r.IntN(2000), 0, 5
			}
			at += time.Duration(r.ExpFloat64() / rate * float64(time.Second))
			o.At = at
			offered, whole = append(offered, o), append(whole, false)
		}
		for moved > 0 && next < span {
			next += time.Duration(r.ExpFloat64() / moved * float64(time.Second))
			offered, whole = append(offered, Offered{At: next, Compute: 40 + r.IntN(120), Cached: 4000, Want: 32}), append(whole, true)
		}
		idx := make([]int, len(offered))
		for i := range idx {
			idx[i] = i
		}
		slices.SortFunc(idx, func(a, b int) int { return int(offered[a].At - offered[b].At) })
		sorted := make([]Offered, len(offered))
		for i, j := range idx {
			sorted[i] = offered[j]
		}
		first, last, err := Replay(p, sorted)
		if err != nil {
			b.Fatal(err)
		}
		var legs, ttfts, tpots []time.Duration
		for i, j := range idx {
			if whole[j] {
				ttfts, tpots = append(ttfts, first[i]), append(tpots, (last[i]-first[i])/31)
			} else {
				legs = append(legs, first[i])
			}
		}
		prefillP90, ttftP90, tpotP90 = pct90(legs), pct90(ttfts), pct90(tpots)
	}
	b.ReportMetric(float64(prefillP90)/1e6, "prefill-p90-ms")
	if moved > 0 {
		b.ReportMetric(float64(ttftP90)/1e6, "moved-ttft-p90-ms")
		b.ReportMetric(float64(tpotP90)/1e6, "moved-tpot-p90-ms")
	}
}

func pct90(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return ds[len(ds)*9/10]
}
