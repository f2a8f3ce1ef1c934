// Package enginestate holds what the engines tell Baton about themselves: their load (requests
// running and waiting, KV cache usage), scraped from their Prometheus /metrics. Every replica of
// Baton reads the same engines, so each sees the whole fleet's load, not only its own share.
package enginestate

import (
	"context"
	"io"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/baton-llm/baton/internal/worker"
)

// maxMetricsBody bounds an engine's /metrics page that Baton reads.
const maxMetricsBody = 8 << 20

// Metric names, vLLM's and SGLang's (current and older spellings).
var (
	runningNames = []string{"vllm:num_requests_running", "sglang:num_running_reqs"}
	waitingNames = []string{"vllm:num_requests_waiting", "sglang:num_queue_reqs"}
	kvNames      = []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"}
)

// Poller scrapes every registered worker's /metrics each Interval and records its load on the
// worker, trusted for three intervals: a signal older than that is ignored, not believed.
type Poller struct {
	Registry *worker.Registry
	Client   *http.Client
	Interval time.Duration
	Log      *slog.Logger
	// Adapters, when it reports true, has every worker's /v1/models read on each poll (Baton
	// loads adapters); otherwise only a worker whose engine lists or reports adapters is.
	Adapters func() bool

	wg sync.WaitGroup
}

// Start polls until ctx ends; Wait waits for it.
func (p *Poller) Start(ctx context.Context) {
	p.wg.Go(func() {
		t := time.NewTicker(p.Interval)
		defer t.Stop()
		for {
			p.PollAll(ctx)
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	})
}

// Wait waits for the poll loop to end.
func (p *Poller) Wait() { p.wg.Wait() }

// PollAll scrapes every registered worker once, concurrently.
func (p *Poller) PollAll(ctx context.Context) {
	var wg sync.WaitGroup
	for _, w := range p.Registry.Snapshot().Workers {
		if !w.Registered() {
			continue
		}
		wg.Go(func() {
			if l, ok := p.Poll(ctx, w); ok && (l.HasLoRA || len(w.Adapters()) > 0 || p.Adapters != nil && p.Adapters()) {
				p.RefreshModels(ctx, w)
			}
		})
	}
	wg.Wait()
}

// Poll reads w's load now and records it on w, trusted for three intervals.
func (p *Poller) Poll(ctx context.Context, w *worker.Worker) (worker.EngineLoad, bool) {
	l, err := Scrape(ctx, p.Client, w, p.Interval)
	if err != nil {
		p.Log.Debug("engine load not read", "worker", w.URL, "err", err)
		return l, false
	}
	l.Until = l.At.Add(3 * p.Interval)
	w.SetEngineLoad(l)
	return l, true
}

// RefreshModels reads w's /v1/models again (the adapters it has loaded) and rebuilds the
// registry's model index when they changed.
func (p *Poller) RefreshModels(ctx context.Context, w *worker.Worker) {
	ctx, cancel := context.WithTimeout(ctx, p.Interval)
	defer cancel()
	changed, err := p.Registry.RefreshModels(ctx, p.Client, w)
	if err != nil {
		p.Log.Debug("engine models not read", "worker", w.URL, "err", err)
		return
	}
	if changed {
		p.Log.Info("worker's adapters changed", "worker", w.URL, "adapters", w.Adapters())
	}
}

// Scrape reads w's load from its /metrics, within timeout.
func Scrape(ctx context.Context, client *http.Client, w *worker.Worker, timeout time.Duration) (worker.EngineLoad, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.URL+"/metrics", nil)
	if err != nil {
		return worker.EngineLoad{}, err
	}
	if w.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+w.APIKey)
	}
	resp, err := client.Do(req)
	if err != nil {
		return worker.EngineLoad{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return worker.EngineLoad{}, &statusError{resp.StatusCode}
	}
	return Parse(io.LimitReader(resp.Body, maxMetricsBody))
}

type statusError struct{ status int }

func (e *statusError) Error() string { return "GET /metrics answered " + http.StatusText(e.status) }

// Parse reads an engine's load from Prometheus text: running and waiting summed over every
// series (models, DP ranks), KV usage the highest of any series.
func Parse(r io.Reader) (worker.EngineLoad, error) {
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(r)
	if err != nil && len(fams) == 0 {
		return worker.EngineLoad{}, err
	}
	l := worker.EngineLoad{At: time.Now()}
	sum := func(names []string, agg func(float64, float64) float64) (float64, bool) {
		v, found := 0.0, false
		for _, n := range names {
			f, ok := fams[n]
			if !ok {
				continue
			}
			for _, m := range f.GetMetric() {
				x := value(m)
				if math.IsNaN(x) || math.IsInf(x, 0) || x < 0 {
					continue // no load: an engine's NaN must not reach routing or GET /workers
				}
				v, found = agg(v, x), true
			}
			if found {
				break
			}
		}
		return v, found
	}
	add := func(a, b float64) float64 { return a + b }
	highest := func(a, b float64) float64 { return max(a, b) }
	l.Running, l.HasRunning = sum(runningNames, add)
	l.Waiting, l.HasWaiting = sum(waitingNames, add)
	l.KVUsage, l.HasKV = sum(kvNames, highest)
	l.LoRARunning, l.LoRAWaiting, l.MaxLoRA, l.HasLoRA = loraInfo(fams[loraInfoName])
	return l, nil
}

// loraInfoName is vLLM's gauge of the adapters with requests running and waiting.
const loraInfoName = "vllm:lora_requests_info"

// maxAdapterNames bounds the adapters read from one label: an engine's label is bounded too.
const maxAdapterNames = 1024

// loraInfo reads vLLM's lora_requests_info: its value is the time the label set was set, and
// the gauge keeps every set it ever had, so the one with the latest time is now. A value more
// than a day ahead of this clock is no such time (a multiprocess gauge summed over several API
// servers reads as one far in the future) and is passed over. Baton reads the gauge as a ranking
// hint only: one process's view under several API servers ranks a worker, never fails a request.
func loraInfo(f *dto.MetricFamily) (running, waiting []string, maxLoRA int, ok bool) {
	if f == nil {
		return nil, nil, 0, false
	}
	horizon := float64(time.Now().Add(24 * time.Hour).Unix())
	var latest *dto.Metric
	for _, m := range f.GetMetric() {
		v := value(m)
		if math.IsNaN(v) || v > horizon {
			continue
		}
		if latest == nil || v > value(latest) {
			latest = m
		}
	}
	if latest == nil {
		return nil, nil, 0, false
	}
	names := func(v string) []string {
		var out []string
		for n := range strings.SplitSeq(v, ",") {
			if n = strings.TrimSpace(n); n != "" && len(out) < maxAdapterNames {
				out = append(out, n)
			}
		}
		return out
	}
	for _, lp := range latest.GetLabel() {
		switch lp.GetName() {
		case "running_lora_adapters":
			running = names(lp.GetValue())
		case "waiting_lora_adapters":
			waiting = names(lp.GetValue())
		case "max_lora":
			if n, err := strconv.Atoi(lp.GetValue()); err == nil && n >= 0 {
				maxLoRA = n
			}
		}
	}
	return running, waiting, maxLoRA, true
}

// value is a gauge's (or untyped sample's) value.
func value(m *dto.Metric) float64 {
	if m.GetGauge() != nil {
		return m.GetGauge().GetValue()
	}
	return m.GetUntyped().GetValue()
}
