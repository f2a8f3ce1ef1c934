package director

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/advisor"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/record"
)

// Advising reports whether the PD advisor runs (Options.Advisor).
func (d *Director) Advising() bool { return d.o.Advisor != nil }

// PDEnded accounts for a request once it ended — answered whole (ok), with its usage (usage):
// a local prefill is counted (CountLocalPrefill), and the advisor sees it (ObserveEnded).
func (d *Director) PDEnded(rec *record.Record, ok, usage bool, ttft, dur time.Duration) {
	if rec.LocalPrefill && ok {
		d.CountLocalPrefill(rec.Model, string(rec.Handoff))
	}
	if usage && rec.Handoff != pd.HandoffNonePrefillWhole { // a prefill's pace is not a decode's
		d.ObserveEnded(rec, ttft, dur)
	}
}

// ObserveEnded hands the advisor a PD request that ended whole (its answer carried usage):
// split or served by its decode alone, its tokens (the uncached part of the prompt is what the
// prefill, or the decode alone, computed), its prefill leg, how busy its workers were, and for
// a stream — whose first byte is its first token's — its TTFT and time per output token.
func (d *Director) ObserveEnded(rec *record.Record, ttft, dur time.Duration) {
	if d.o.Advisor == nil || rec.Decode == "" {
		return
	}
	u := rec.Usage
	s := advisor.Sample{At: rec.Start.Add(dur), Split: rec.Prefill != "", Prompt: u.Prompt, Uncached: max(0, u.Prompt-u.Cached), Output: u.Completion,
		PrefillTime: rec.PrefillTime, PrefillBusy: rec.PrefillBusy, DecodeBusy: rec.DecodeBusy}
	if rec.Stream {
		s.TTFT = ttft
		if u.Completion > 1 {
			s.TPOT = (dur - ttft) / time.Duration(u.Completion-1)
		}
	}
	d.o.Advisor.Observe(s)
}

// fleetSplit is the PD fleet as it stands: its registered prefill and decode workers.
func (d *Director) fleetSplit() (prefill, decode int) {
	for _, w := range d.reg.Snapshot().Workers {
		switch w.Role {
		case config.RolePrefill:
			prefill++
		case config.RoleDecode:
			decode++
		}
	}
	return prefill, decode
}

// Advice is the advisor's answer for a fleet of total workers (0: the fleet's) and SLOs (0:
// the configuration's), beside the fleet's current split and threshold. Advising must hold.
func (d *Director) Advice(total int, ttft, tpot time.Duration) advisor.Advice {
	d.adviceMu.Lock()
	defer d.adviceMu.Unlock()
	now := time.Now()
	fleet := total <= 0 && ttft <= 0 && tpot <= 0
	if fleet && !d.advice.at.IsZero() && now.Sub(d.advice.at) < AdviceTTL {
		return d.advice.a
	}
	a := d.advise(total, ttft, tpot)
	if fleet {
		d.advice = cachedAdvice{a: a, at: now}
	}
	return a
}

// AdviceTTL is how long the fleet's advice (what /metrics and the status page show) is reused:
// each answer replays the window's load for every split (tens of milliseconds on a large
// fleet), which a scrape per second would otherwise pay each time.
const AdviceTTL = 2 * time.Second

// cachedAdvice is an advice and when it was made.
type cachedAdvice struct {
	a  advisor.Advice
	at time.Time
}

// advise is Advice, made now.
func (d *Director) advise(total int, ttft, tpot time.Duration) advisor.Advice {
	p, dc := d.fleetSplit()
	if total <= 0 {
		total = p + dc
	}
	slo := d.o.AdviceSLO
	if ttft > 0 {
		slo.TTFT = ttft
	}
	if tpot > 0 {
		slo.TPOT = tpot
	}
	return d.o.Advisor.Fit().Advise(total, p, dc, d.LocalPrefillThreshold(), slo)
}

// AdviceFor answers a what-if read from a URL's raw query (advisor.ParseQuery); param and msg
// say what is wrong with a query it refuses.
func (d *Director) AdviceFor(rawQuery string) (a advisor.Advice, param, msg string) {
	q, err := advisor.ParseQuery(rawQuery)
	if err != nil {
		return a, err.Param, err.Message
	}
	return d.Advice(q.Total, q.TTFT, q.TPOT), "", ""
}

// AdviceCollector is the advisor's metrics for the fleet as it stands and the configured SLOs,
// published once it has fitted its rates (nothing before: a scaler reading them keeps its own
// floor); nil without an advisor.
func (d *Director) AdviceCollector() prometheus.Collector {
	if d.o.Advisor == nil {
		return nil
	}
	return adviceCollector{d}
}

type adviceCollector struct{ d *Director }

var (
	recommendedDesc = prometheus.NewDesc("baton_pd_recommended_workers", "The PD advisor's recommended workers of each role for the fleet's current total, at the current load and the configured SLOs (GET /pd/advice explains it).", []string{"role"}, nil)
	thresholdDesc   = prometheus.NewDesc("baton_pd_recommended_local_prefill_threshold", "The PD advisor's recommended pd_local_prefill_threshold (uncached prompt tokens) for the recommended split.", nil, nil)
	predTTFTDesc    = prometheus.NewDesc("baton_pd_predicted_ttft_p90_seconds", "The PD advisor's predicted TTFT p90 at the current load, for the current and the recommended split (-1: past capacity).", []string{"split"}, nil)
	predTPOTDesc    = prometheus.NewDesc("baton_pd_predicted_tpot_seconds", "The PD advisor's predicted time per output token at the current load, for the current and the recommended split (-1: past capacity).", []string{"split"}, nil)
)

func (c adviceCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- recommendedDesc
	ch <- thresholdDesc
	ch <- predTTFTDesc
	ch <- predTPOTDesc
}

func (c adviceCollector) Collect(ch chan<- prometheus.Metric) {
	a := c.d.Advice(0, 0, 0)
	if !a.Fit.Fitted() {
		return
	}
	ch <- prometheus.MustNewConstMetric(recommendedDesc, prometheus.GaugeValue, float64(a.Recommended.Prefill), config.RolePrefill)
	ch <- prometheus.MustNewConstMetric(recommendedDesc, prometheus.GaugeValue, float64(a.Recommended.Decode), config.RoleDecode)
	ch <- prometheus.MustNewConstMetric(thresholdDesc, prometheus.GaugeValue, float64(a.Recommended.Threshold))
	for _, p := range []struct {
		name string
		v    advisor.Prediction
	}{{"current", a.Current}, {"recommended", a.Recommended}} {
		ch <- prometheus.MustNewConstMetric(predTTFTDesc, prometheus.GaugeValue, p.v.TTFTp90S, p.name)
		ch <- prometheus.MustNewConstMetric(predTPOTDesc, prometheus.GaugeValue, p.v.TPOTS, p.name)
	}
}
