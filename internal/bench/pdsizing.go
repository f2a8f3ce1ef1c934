package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/baton-llm/baton/internal/sim"
)

// The pd-sizing workload: eight simulated vLLM engines with the step model, split every static
// way between prefill and decode, under two mixes at a fixed open-loop arrival rate; goodput is
// the requests a second that met both SLOs. The engines run the step model on a GPU ten times
// slower than DefaultPerf's H100 (every cost ×10), so that eight of them stay within what one
// Baton and the load generator relay on this machine's two cores: the shapes (what is
// compute- and what memory-bound, how a prefill chunk slows the decodes beside it) are the
// model's, the clock ten times longer.
const (
	sizingEngines = 8
	sizingSlow    = 10
)

// sizingMix is one workload: its prompts, output lengths, arrival rate and SLOs.
type sizingMix struct {
	name     string
	about    string
	rate     float64 // requests a second
	output   [2]int  // output tokens, uniform in [lo, hi]
	ttft     time.Duration
	tpot     time.Duration
	prompt   func(r *rand.Rand, i int) string
	defaultT int // the threshold the conditional runs use when the advisor has none
}

// sizingWords is a prompt of n distinct-enough words (one simulator token each, ~4 bytes, so
// that Baton's bytes / 4 estimate counts them about right).
func sizingWords(seed string, n int) string {
	var sb strings.Builder
	sb.WriteString(seed)
	for j := range n {
		fmt.Fprintf(&sb, " w%02d", (j*7+len(seed))%97)
	}
	return sb.String()
}

// mixes are the workloads o names (all when none).
func (o Options) mixes() []sizingMix {
	var out []sizingMix
	for _, m := range sizingMixes(o.Quick) {
		if len(o.Mixes) == 0 || slices.Contains(o.Mixes, m.name) {
			out = append(out, m)
		}
	}
	return out
}

func sizingMixes(quick bool) []sizingMix {
	systems := make([]string, 4)
	for i := range systems {
		systems[i] = sizingWords(fmt.Sprintf("system%d", i), 4000)
	}
	mixes := []sizingMix{
		{name: "chat", about: "short-prompt chat: one of 4 shared 4,000-token system prompts and a 40–160-token question, 16–48 output tokens",
			rate: 30, output: [2]int{16, 48}, ttft: 400 * time.Millisecond, tpot: 150 * time.Millisecond, defaultT: 512,
			prompt: func(r *rand.Rand, i int) string {
				return systems[r.IntN(len(systems))] + sizingWords(fmt.Sprintf(" question%d", i), 40+r.IntN(120))
			}},
		{name: "rag", about: "long-document RAG: a distinct 2,000–4,000-token document and question, 16–48 output tokens",
			rate: 3, output: [2]int{16, 48}, ttft: 4 * time.Second, tpot: 150 * time.Millisecond, defaultT: 512,
			prompt: func(r *rand.Rand, i int) string {
				return sizingWords(fmt.Sprintf("document%d", i), 2000+r.IntN(2000))
			}},
	}
	return mixes
}

// sizingPerf is the slowed step model of every engine.
func sizingPerf() *sim.Perf {
	p := sim.DefaultPerf()
	p.StepOverhead *= sizingSlow
	p.ComputePerToken *= sizingSlow
	p.WeightRead *= sizingSlow
	p.KVReadPerToken *= sizingSlow
	return &p
}

// sizingConf is one configuration a mix runs on: its split, its threshold (and whether it
// follows the advisor from there) and the arrival rate offered.
type sizingConf struct {
	prefill, threshold int
	auto               bool
	rate               float64
}

// sizingResult is one run of a mix on one split.
type sizingResult struct {
	prefill, threshold int
	auto               bool
	rate               float64
	attained           float64 // the share of the requests sent that met both SLOs
	sent, done, good   int
	goodput            float64 // requests a second that met both SLOs
	ttftP90, tpotP90   time.Duration
	local              int // served by a decode alone
	advice             *sizingAdvice
}

// sizingAdvice is what GET /pd/advice recommended.
type sizingAdvice struct {
	Recommended struct {
		Prefill   int     `json:"prefill"`
		Decode    int     `json:"decode"`
		Threshold int     `json:"local_prefill_threshold"`
		TTFT      float64 `json:"ttft_p90_s"`
		TPOT      float64 `json:"tpot_s"`
	} `json:"recommended"`
	Splits []sizingPrediction `json:"splits"`
	Fit    struct {
		Requests int     `json:"requests"`
		Prefill  float64 `json:"prefill_tokens_per_s"`
		Floor    float64 `json:"prefill_floor_s"`
		Pair     float64 `json:"pair_overhead_s"`
		Fixed    float64 `json:"pair_fixed_s"`
		Base     float64 `json:"decode_base_s"`
		Per      float64 `json:"decode_per_request_s"`
	} `json:"fit"`
	Why string `json:"why"`
}

// sizingRun starts eight fresh engines (prefill of them prefill, the rest decode) and a PD Baton
// with the local-prefill threshold, offers the mix for warm + measure, and measures the
// requests that arrived after warm; with advise it asks the advisor at the end.
func (r *runner) sizingRun(ctx context.Context, mix sizingMix, c sizingConf, warm, measure time.Duration, advise bool) (sizingResult, error) {
	prefill, threshold := c.prefill, c.threshold
	res := sizingResult{prefill: prefill, threshold: threshold, auto: c.auto, rate: c.rate}
	var es []*sim.Engine
	defer func() { closeAll(es) }()
	args := []string{"--pd-disaggregation", "--kv-connector", "NixlConnector", "--prefill-policy", "cache_aware", "--decode-policy", "cache_aware",
		"--request-timeout", "120s", "--access-log=false", "--pd-local-prefill-threshold", strconv.Itoa(threshold),
		"--pd-advice-ttft-slo", mix.ttft.String(), "--pd-advice-tpot-slo", mix.tpot.String()}
	if c.auto {
		args = append(args, "--pd-local-prefill-auto")
	}
	if advise { // the advisor fits from the measured window, the engines' cold caches left behind
		args = append(args, "--pd-advice-window", measure.String())
	}
	for i := range sizingEngines {
		role := sim.RoleDecode
		if i < prefill {
			role = sim.RolePrefill
		}
		e, err := engine(sim.Config{Engine: sim.EngineVLLM, Role: role, KVConnector: sim.ConnectorNixl, PrefixCache: true, PrefixCacheBlocks: 16384, Steps: sizingPerf()})
		if err != nil {
			return res, err
		}
		es = append(es, e)
		if role == sim.RolePrefill {
			args = append(args, "--prefill", e.URL(), "none", "nixl")
		} else {
			args = append(args, "--decode", e.URL(), "nixl")
		}
	}
	b, err := startBaton(r.o.Binary, 1, args...)
	if err != nil {
		return res, err
	}
	defer b.stop()
	rng := rand.New(rand.NewPCG(uint64(len(mix.name)), 42)) // the same arrivals and prompts for every split
	type outcome struct {
		at         time.Duration
		ok         bool
		ttft, tpot time.Duration
		local      bool
	}
	var mu sync.Mutex
	var outs []outcome
	var wg sync.WaitGroup
	start := time.Now()
	end := warm + measure
	next := time.Duration(0)
	for i := 0; ; i++ {
		next += time.Duration(rng.ExpFloat64() / c.rate * float64(time.Second))
		if next >= end {
			break
		}
		prompt := mix.prompt(rng, i)
		out := mix.output[0] + rng.IntN(mix.output[1]-mix.output[0]+1)
		if d := time.Until(start.Add(next)); d > 0 {
			select {
			case <-time.After(d):
			case <-ctx.Done():
				return res, ctx.Err()
			}
		}
		at := next
		wg.Go(func() {
			ttft, tpot, local, err := sizingRequest(ctx, r.client, b.URL, prompt, out)
			mu.Lock()
			outs = append(outs, outcome{at: at, ok: err == nil, ttft: ttft, tpot: tpot, local: local})
			mu.Unlock()
		})
	}
	wg.Wait()
	if advise {
		if a, err := askAdvice(ctx, r.client, strings.TrimSuffix(b.MetricsURL, "/metrics"), mix); err == nil {
			res.advice = a
		} else {
			fmt.Fprintf(r.out, "_(the advisor could not be asked: %v)_\n\n", err)
		}
	}
	var ttfts, tpots []time.Duration
	for _, o := range outs {
		if o.at < warm {
			continue
		}
		res.sent++
		if !o.ok {
			continue
		}
		res.done++
		if o.local {
			res.local++
		}
		ttfts, tpots = append(ttfts, o.ttft), append(tpots, o.tpot)
		if o.ttft <= mix.ttft && o.tpot <= mix.tpot {
			res.good++
		}
	}
	res.goodput = float64(res.good) / measure.Seconds()
	if res.sent > 0 {
		res.attained = float64(res.good) / float64(res.sent)
	}
	res.ttftP90, res.tpotP90 = p90(ttfts), p90(tpots)
	return res, nil
}

func p90(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return ds[min(len(ds)-1, len(ds)*9/10)]
}

// sizingRequest streams one completion of out tokens and returns its TTFT (send to the first
// token), its time per output token after the first, and whether a decode served it alone.
func sizingRequest(ctx context.Context, client *http.Client, base, prompt string, out int) (ttft, tpot time.Duration, local bool, err error) {
	p, _ := json.Marshal(prompt)
	body := fmt.Sprintf(`{"model":%q,"prompt":%s,"max_tokens":%d,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, benchModel, p, out)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(body))
	if err != nil {
		return 0, 0, false, err
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return 0, 0, false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return 0, 0, false, fmt.Errorf("%d %s", resp.StatusCode, b)
	}
	local = resp.Header.Get("X-Baton-Kv-Handoff") == "none-local-prefill"
	br := bufio.NewReader(resp.Body)
	var first, last time.Time
	n := 0
	for {
		line, rerr := br.ReadBytes('\n')
		if bytes.HasPrefix(line, []byte(`data: {"id"`)) && bytes.Contains(line, []byte(`"text":"`)) && !bytes.Contains(line, []byte(`"text":""`)) {
			now := time.Now()
			if first.IsZero() {
				first = now
			}
			last = now
			n++
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return 0, 0, local, rerr
		}
	}
	if n == 0 {
		return 0, 0, local, fmt.Errorf("no token came")
	}
	ttft = first.Sub(start)
	if n > 1 {
		tpot = last.Sub(first) / time.Duration(n-1)
	}
	return ttft, tpot, local, nil
}

// askAdvice asks the Baton's advisor for an eight-worker fleet at the mix's SLOs.
func askAdvice(ctx context.Context, client *http.Client, base string, mix sizingMix) (*sizingAdvice, error) {
	url := fmt.Sprintf("%s/pd/advice?total=%d&ttft_slo=%s&tpot_slo=%s", base, sizingEngines, mix.ttft, mix.tpot)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != 200 {
		return nil, fmt.Errorf("%d %s", resp.StatusCode, b)
	}
	var a sizingAdvice
	if err := json.Unmarshal(b, &a); err != nil {
		return nil, err
	}
	return &a, nil
}

// pdSizing: every static split of eight engines under two mixes, always split and with
// conditional disaggregation (the advisor's threshold, auto); the advisor's recommendation
// after a run at 4:4; then the highest rate each mode's best splits serve with 90 % of the
// requests within both SLOs; the goals.
func (r *runner) pdSizing(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 16. PD sizing: static splits, conditional disaggregation, the advisor")
	fmt.Fprintln(r.out)
	warm, measure, adviseFor := 12*time.Second, 30*time.Second, 60*time.Second
	ladderWarm, ladderMeasure := 12*time.Second, 20*time.Second
	if r.o.Quick {
		warm, measure, adviseFor, ladderMeasure = 12*time.Second, 15*time.Second, 30*time.Second, 10*time.Second
	}
	fmt.Fprintf(r.out, "%d simulated vLLM engines (NIXL, prefix caches) with the step model at a tenth of DefaultPerf's speed (a step %s + max(tokens × %s, %s + context × %s)), split every static way between prefill and decode behind one PD Baton (`cache_aware` both roles); open-loop Poisson arrivals, the same requests for every split; %s of warm-up, then %s measured. Goodput: the requests a second that arrived in the measured window and met both SLOs (TTFT from send to the first token; TPOT over the rest). Conditional runs use `--pd-local-prefill-auto` from the threshold the advisor gave after its probe. Capacity: the highest rate, in steps of a quarter of the mix's rate, at which a split keeps 90 %% of its requests within both SLOs (%s warm-up, %s measured a step).\n\n",
		sizingEngines, sizingPerf().StepOverhead, sizingPerf().ComputePerToken, sizingPerf().WeightRead, sizingPerf().KVReadPerToken, warm, measure, ladderWarm, ladderMeasure)
	type plotted struct {
		name           string
		always, thresh []float64
	}
	var plots []plotted
	for _, mix := range r.o.mixes() {
		fmt.Fprintf(r.out, "### %s — %s; %.0f requests/s; SLO TTFT ≤ %s, TPOT ≤ %s\n\n", mix.name, mix.about, mix.rate, mix.ttft, mix.tpot)
		fmt.Fprintln(r.out, "| prefill : decode | local prefill under | goodput req/s | met SLOs | answered / sent | served by a decode alone | TTFT p90 ms | TPOT p90 ms |")
		fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---:|---:|---:|")
		row := func(x sizingResult) {
			t := "off"
			if x.threshold > 0 || x.auto {
				t = strconv.Itoa(x.threshold)
				if x.auto {
					t = "auto from " + t
				}
			}
			fmt.Fprintf(r.out, "| %d : %d | %s | %.2f | %d | %d / %d | %d | %.0f | %.0f |\n", x.prefill, sizingEngines-x.prefill, t, x.goodput, x.good, x.done, x.sent, x.local,
				float64(x.ttftP90)/1e6, float64(x.tpotP90)/1e6)
		}
		pl := plotted{name: mix.name}
		var always []sizingResult
		for p := 1; p < sizingEngines; p++ {
			x, err := r.sizingRun(ctx, mix, sizingConf{prefill: p, rate: mix.rate}, warm, measure, false)
			if err != nil {
				return err
			}
			row(x)
			always = append(always, x)
			pl.always = append(pl.always, x.goodput)
		}
		// The advisor: a run at 4:4 without a threshold, then its recommendation for eight, fitted
		// from the run past its warm-up.
		probe, err := r.sizingRun(ctx, mix, sizingConf{prefill: sizingEngines / 2, rate: mix.rate}, warm, adviseFor, true)
		if err != nil {
			return err
		}
		threshold := mix.defaultT
		recP := 0
		if a := probe.advice; a != nil {
			recP = a.Recommended.Prefill
			if a.Recommended.Threshold > 0 {
				threshold = a.Recommended.Threshold
			}
		}
		var cond []sizingResult
		for p := 1; p < sizingEngines; p++ {
			x, err := r.sizingRun(ctx, mix, sizingConf{prefill: p, threshold: threshold, auto: true, rate: mix.rate}, warm, measure, false)
			if err != nil {
				return err
			}
			row(x)
			cond = append(cond, x)
			pl.thresh = append(pl.thresh, x.goodput)
		}
		plots = append(plots, pl)
		fmt.Fprintln(r.out)
		best := bestSplits(always, 1)[0]
		fmt.Fprintf(r.out, "Best static split, always disaggregated: **%d : %d** at %.2f req/s.", best.prefill, sizingEngines-best.prefill, best.goodput)
		if a := probe.advice; a != nil {
			fmt.Fprintf(r.out, " The advisor, fitted from %s at 4 : 4 after the warm-up (%d requests; prefill %.0f tokens/s, at least %.0f ms a leg; pair overhead %.0f ms, %.0f ms past the decode's first step; TPOT %.1f ms + %.2f ms per request decoding): **%d : %d**, local prefill under %d tokens, predicted TTFT p90 %.0f ms and TPOT %.0f ms — %s.",
				adviseFor, a.Fit.Requests, a.Fit.Prefill, 1000*a.Fit.Floor, 1000*a.Fit.Pair, 1000*a.Fit.Fixed, 1000*a.Fit.Base, 1000*a.Fit.Per, a.Recommended.Prefill, a.Recommended.Decode, a.Recommended.Threshold,
				1000*a.Recommended.TTFT, 1000*a.Recommended.TPOT, a.Why)
		}
		fmt.Fprintln(r.out)
		fmt.Fprintln(r.out)
		// Capacity: the best two splits of each mode, up a ladder of rates.
		fmt.Fprintln(r.out, "| mode | prefill : decode | rate req/s | within both SLOs | TTFT p90 ms | TPOT p90 ms |")
		fmt.Fprintln(r.out, "|---|---|---:|---:|---:|---:|")
		capacity := func(name string, from []sizingResult) (float64, sizingResult, error) {
			var top float64
			var at sizingResult
			for _, b := range bestSplits(from, 2) {
				c := sizingConf{prefill: b.prefill, threshold: b.threshold, auto: b.auto}
				held := 0.0
				for step := 4; step <= 8; step++ { // 1×, 1.25×, … 2× the mix's rate
					c.rate = mix.rate * float64(step) / 4
					x, err := r.sizingRun(ctx, mix, c, ladderWarm, ladderMeasure, false)
					if err != nil {
						return 0, at, err
					}
					fmt.Fprintf(r.out, "| %s | %d : %d | %.1f | %.0f %% | %.0f | %.0f |\n", name, c.prefill, sizingEngines-c.prefill, c.rate, 100*x.attained, float64(x.ttftP90)/1e6, float64(x.tpotP90)/1e6)
					if x.attained < 0.9 {
						break
					}
					held = c.rate
				}
				if held > top {
					top, at = held, b
				}
			}
			return top, at, nil
		}
		capA, atA, err := capacity("always split", always)
		if err != nil {
			return err
		}
		capC, atC, err := capacity("conditional", cond)
		if err != nil {
			return err
		}
		fmt.Fprintln(r.out)
		fmt.Fprintf(r.out, "Capacity at 90 %% within both SLOs: always split %.1f req/s (%d : %d), conditional %.1f req/s (%d : %d).\n\n",
			capA, atA.prefill, sizingEngines-atA.prefill, capC, atC.prefill, sizingEngines-atC.prefill)
		if recP > 0 {
			// The advisor recommends a split and a threshold: it is judged against the best
			// static split of the same mode (conditional when its threshold is on), and said
			// against always splitting too.
			same, mode := best, "always split"
			recGood := always[recP-1].goodput
			if probe.advice.Recommended.Threshold > 0 {
				same, mode, recGood = bestSplits(cond, 1)[0], "with its threshold", cond[recP-1].goodput
			}
			fmt.Fprintf(r.out, "- The advisor's split is %+d worker(s) from the best static split %s (%d : %d; goal within ±1); its goodput %.2f req/s = %.0f %% of that split's (goal ≥ 95 %%)",
				recP-same.prefill, mode, same.prefill, sizingEngines-same.prefill, recGood, 100*recGood/max(same.goodput, 1e-9))
			if same != best {
				fmt.Fprintf(r.out, ", %+d worker(s) from the best always-split one and %.0f %% of its goodput", recP-best.prefill, 100*recGood/max(best.goodput, 1e-9))
			}
			fmt.Fprintln(r.out, ".")
		}
		fmt.Fprintf(r.out, "- Conditional disaggregation (auto, from %d tokens): capacity %+.0f %% against always splitting, each at its best split (goal: ≥ +20 %% on chat, ≥ −2 %% on RAG).\n\n",
			threshold, 100*(capC/max(capA, 1e-9)-1))
	}
	if r.o.Plot != "" {
		var series []goodputSeries
		for _, p := range plots {
			series = append(series, goodputSeries{p.name + ", always split", p.always}, goodputSeries{p.name + ", conditional", p.thresh})
		}
		if err := goodputPlot(r.o.Plot, series); err != nil {
			return err
		}
		fmt.Fprintf(r.out, "Goodput per split: %s\n\n", r.o.Plot)
	}
	return nil
}

// bestSplits returns the n runs of the most goodput, the lower TTFT p90 first among those
// within 2 % of each other.
func bestSplits(rs []sizingResult, n int) []sizingResult {
	out := slices.Clone(rs)
	slices.SortStableFunc(out, func(a, b sizingResult) int {
		if math.Abs(a.goodput-b.goodput) > 0.02*max(a.goodput, b.goodput) {
			if a.goodput > b.goodput {
				return -1
			}
			return 1
		}
		return int(a.ttftP90 - b.ttftP90)
	})
	return out[:min(n, len(out))]
}

// pdAdvice is pd-sizing's advisor alone: for each mix, the run at 4 : 4 the advisor fits from,
// and what it recommends for eight workers — each split's prediction beside it, to set against
// pd-sizing's measured tables.
func (r *runner) pdAdvice(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 17. PD advice: what the advisor recommends after a minute at 4 : 4")
	fmt.Fprintln(r.out)
	warm, adviseFor := 12*time.Second, 60*time.Second
	for _, mix := range r.o.mixes() {
		probe, err := r.sizingRun(ctx, mix, sizingConf{prefill: sizingEngines / 2, rate: mix.rate}, warm, adviseFor, true)
		if err != nil {
			return err
		}
		a := probe.advice
		if a == nil {
			return fmt.Errorf("%s: the advisor could not be asked", mix.name)
		}
		fmt.Fprintf(r.out, "### %s — %.0f requests/s; SLO TTFT ≤ %s, TPOT ≤ %s\n\n", mix.name, mix.rate, mix.ttft, mix.tpot)
		fmt.Fprintf(r.out, "Fitted from %d requests: prefill %.0f tokens/s, at least %.0f ms a leg; pair overhead %.0f ms, %.0f ms past the decode's first step; TPOT %.1f ms + %.2f ms per request decoding. Recommended **%d : %d**, local prefill under %d tokens — %s.\n\n",
			a.Fit.Requests, a.Fit.Prefill, 1000*a.Fit.Floor, 1000*a.Fit.Pair, 1000*a.Fit.Fixed, 1000*a.Fit.Base, 1000*a.Fit.Per, a.Recommended.Prefill, a.Recommended.Decode, a.Recommended.Threshold, a.Why)
		fmt.Fprintln(r.out, "| prefill : decode | local prefill under | predicted TTFT p90 ms | TPOT ms | prefill busy | within the SLOs |")
		fmt.Fprintln(r.out, "|---|---:|---:|---:|---:|---|")
		for _, x := range a.Splits {
			fmt.Fprintf(r.out, "| %d : %d | %d | %s | %s | %.0f %% | %v |\n", x.Prefill, x.Decode, x.Threshold, msOrPast(x.TTFT), msOrPast(x.TPOT), 100*x.Util, x.Meets)
		}
		fmt.Fprintln(r.out)
	}
	return nil
}

// sizingPrediction is one split's prediction in the advice.
type sizingPrediction struct {
	Prefill   int     `json:"prefill"`
	Decode    int     `json:"decode"`
	Threshold int     `json:"local_prefill_threshold"`
	TTFT      float64 `json:"ttft_p90_s"`
	TPOT      float64 `json:"tpot_s"`
	Util      float64 `json:"prefill_utilization"`
	Meets     bool    `json:"meets_slo"`
}

// msOrPast writes a predicted latency in milliseconds, or that it is past capacity.
func msOrPast(s float64) string {
	if s < 0 {
		return "past capacity"
	}
	return strconv.FormatFloat(1000*s, 'f', 0, 64)
}
