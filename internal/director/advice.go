package director

import (
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/advisor"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
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
// prefill, or the decode alone, computed), its prefill leg, how busy its workers were, its
// duration (what a whole answer tells of its decode), and for a stream — whose first byte is its
// first token's — its TTFT and time per output token.
func (d *Director) ObserveEnded(rec *record.Record, ttft, dur time.Duration) {
	if d.o.Advisor == nil || rec.Decode == "" {
		return
	}
	u := rec.Usage
	s := advisor.Sample{At: rec.Start.Add(dur), Split: rec.Prefill != "", Prompt: u.Prompt, Uncached: max(0, u.Prompt-u.Cached), Output: u.Completion,
		PrefillTime: rec.PrefillTime, PrefillBusy: rec.PrefillBusy, DecodeBusy: rec.DecodeBusy, Duration: dur}
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
//
// The fleet's own answer (every argument 0) is made once per AdviceTTL under adviceMu. A
// what-if (any argument set) is made fresh from its own copy of the window (Advisor.Fit holds
// the advisor's lock only while it copies the samples) and holds no lock while it replays the
// load: a scrape of /metrics, which asks for the fleet's answer, never waits behind one.
func (d *Director) Advice(total int, ttft, tpot time.Duration) advisor.Advice {
	if total > 0 || ttft > 0 || tpot > 0 {
		return d.advise(total, ttft, tpot)
	}
	d.adviceMu.Lock()
	defer d.adviceMu.Unlock()
	now := time.Now()
	if d.advice.at.IsZero() || now.Sub(d.advice.at) >= AdviceTTL {
		d.advice = cachedAdvice{a: d.advise(0, 0, 0), at: now}
	}
	return d.advice.a
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

// AdviceFor answers a what-if read from a URL's raw query (advisor.ParseQuery) asked by client
// (an address: the bound is per address); the error is the answer to give instead: a query it
// cannot read (400), or one past the what-ifs answered at once (429). A query without
// parameters is the fleet's own answer, never refused.
func (d *Director) AdviceFor(client, rawQuery string) (advisor.Advice, *openai.Error) {
	q, err := advisor.ParseQuery(rawQuery)
	if err != nil {
		return advisor.Advice{}, &openai.Error{Status: statusBadRequest, Code: openai.CodeInvalidRequest, Param: err.Param, Message: err.Message}
	}
	if q != (advisor.Query{}) {
		release, refusal := d.whatIfs.acquire(client)
		if refusal != nil {
			return advisor.Advice{}, refusal
		}
		defer release()
	}
	return d.Advice(q.Total, q.TTFT, q.TPOT), nil
}

// The what-ifs answered at once: each replays the window's load for every split of the fleet
// it asks about (up to tens of milliseconds of a core), so a client looping on them would take
// the CPU the gateway serves with; the bound per client keeps one from holding every slot.
const (
	MaxWhatIfsPerClient = 2
	MaxWhatIfs          = 4
)

// whatIfs counts the what-ifs being answered, in all and by client. The zero value is ready; a
// client's count is dropped when it falls to 0, so it holds at most MaxWhatIfs clients.
type whatIfs struct {
	mu       sync.Mutex
	all      int
	byClient map[string]int
}

// acquire takes a slot for a what-if from client and returns how to give it back; past either
// bound it takes nothing and returns the refusal to answer with.
func (l *whatIfs) acquire(client string) (release func(), refusal *openai.Error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.byClient[client] >= MaxWhatIfsPerClient:
		return nil, whatIfRefusal(fmt.Sprintf("this client has %d PD what-ifs being answered, as many as it may: ask again once one is", MaxWhatIfsPerClient))
	case l.all >= MaxWhatIfs:
		return nil, whatIfRefusal(fmt.Sprintf("%d PD what-ifs are being answered, as many as Baton answers at once: ask again once one is", MaxWhatIfs))
	}
	if l.byClient == nil {
		l.byClient = map[string]int{}
	}
	l.all++
	l.byClient[client]++
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.all--
		if l.byClient[client]--; l.byClient[client] == 0 {
			delete(l.byClient, client)
		}
	}, nil
}

func whatIfRefusal(msg string) *openai.Error {
	return &openai.Error{Status: statusTooManyRequests, Code: openai.CodeTooManyWhatIfs, RetryAfter: "1", Message: msg}
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
