package director

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/advisor"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/worker"
)

// A PD request answered whole (not streamed) is fed to the advisor with its duration: from
// such answers alone, of varied lengths, the advisor fits the decode's pace and the pair's
// overhead, and advises.
func TestWholeAnswersFeedTheDecodesPace(t *testing.T) {
	adv := &advisor.Advisor{}
	f := newFleet(t, []*worker.Worker{worker.New(config.Worker{URL: "http://p:1", Role: config.RolePrefill}), worker.New(config.Worker{URL: "http://d:1", Role: config.RoleDecode})}, func(o *Options) {
		o.PD, o.Advisor, o.AdviceSLO = true, adv, advisor.SLO{TTFT: time.Second, TPOT: 100 * time.Millisecond}
	})
	r := rand.New(rand.NewPCG(1, 1))
	start := time.Now().Add(-time.Minute)
	const step, fixed = 10 * time.Millisecond, 20 * time.Millisecond
	for i := range 60 {
		n, u := 5+r.IntN(200), 100+r.IntN(2000)
		leg := 5*time.Millisecond + time.Duration(u)*10*time.Microsecond
		rec := &record.Record{Start: start.Add(time.Duration(i) * time.Second), Prefill: "http://p:1", Decode: "http://d:1", Handoff: pd.HandoffNixl,
			Usage: openai.Usage{Prompt: u, Completion: n}, UsageKnown: true, PrefillTime: leg}
		dur := leg + fixed + time.Duration((float64(n)+0.5)*float64(step))
		f.d.PDEnded(rec, true, true, dur, dur) // a whole answer's first byte comes with its end
	}
	fit := f.d.Advice(2, 0, 0).Fit
	if !fit.Fitted() || fit.DecodeFrom != 60 || fit.PairFrom != 60 || !fit.DecodeFromDurations {
		t.Fatalf("from 60 whole answers: fitted %v, decode from %d, pair from %d, from durations %v", fit.Fitted(), fit.DecodeFrom, fit.PairFrom, fit.DecodeFromDurations)
	}
	if d := fit.DecodeBaseS - step.Seconds(); d > 1e-6 || d < -1e-6 {
		t.Errorf("decode step %.6f s, want %.6f", fit.DecodeBaseS, step.Seconds())
	}
	if d := fit.PairFixedS - fixed.Seconds(); d > 1e-6 || d < -1e-6 {
		t.Errorf("pair's fixed part %.6f s, want %.6f", fit.PairFixedS, fixed.Seconds())
	}
}
