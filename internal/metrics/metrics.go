// Package metrics holds every Prometheus collector Baton exports, on a private registry.
// Names are baton_..., in base units; label values are bounded: no string a client chooses
// becomes a label unless a worker serves it (models), and every such value is length-capped.
package metrics

import (
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/baton-llm/baton/internal/memo"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/worker"
)

// MaxModels caps the distinct model label values; later models are reported as "other".
const MaxModels = 1024

// MaxLabelLen bounds a model label value in bytes; longer model names are "unknown".
const MaxLabelLen = 128

// Model label values that name no model.
const (
	ModelNone    = "none"    // the request named no model
	ModelUnknown = "unknown" // the request named a model no worker lists (or an unprintable one)
	ModelOther   = "other"   // a served model past MaxModels
)

// Upstream error kinds.
const (
	KindTransport = "transport"  // connection refused, reset before response
	KindTimeout   = "timeout"    // request deadline passed
	KindStatus    = "status"     // upstream answered 5xx
	KindMismatch  = "mismatch"   // an answer naming another request's id: closed, never relayed
	KindMidStream = "mid_stream" // upstream failed after the first byte reached the client
	KindStalled   = "stalled"    // a stream's engine sent nothing for stream_stall_timeout: aborted
	KindInBand    = "in_band"    // upstream reported an error inside a stream it answered 200
)

// DurationBuckets are the buckets of every *_seconds histogram, 1 ms to 2 h.
var DurationBuckets = []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200}

// Metrics is the set of Baton's collectors.
type Metrics struct {
	Registry *prometheus.Registry
	// The series of Requests, Duration, RouteDecisions, TTFT and Tokens, by their label values: a map read,
	// where the vector hashes and checks each value under its lock. Only for vectors whose
	// series are never deleted (a deleted child would go on counting unseen); maxChildren bounds
	// each.
	requests  memo.Map[requestKey, prometheus.Counter]
	durations memo.Map[[2]string, prometheus.Observer]
	decisions memo.Map[[3]string, prometheus.Counter]
	ttfts     memo.Map[[2]string, prometheus.Observer]
	tokens    memo.Map[[2]string, prometheus.Counter]
	// Declared, when set, reports whether the configuration names a model (an alias, a
	// fallback, a declared LoRA adapter): a label before any worker lists it. Set once, before
	// serving.
	Declared func(model string) bool
	// Servable, when set, returns the models the fleet names and whether each can be served
	// now (baton_model_servable). Set once, before serving.
	Servable func() (models []string, servable []bool)

	Requests       *prometheus.CounterVec   // route, model, status
	Duration       *prometheus.HistogramVec // route, model
	UpstreamErrors *prometheus.CounterVec   // worker, kind

	PDRequests          *prometheus.CounterVec   // model, dispatch, outcome
	PDTTFT              *prometheus.HistogramVec // model, runtime
	PDPrefillDuration   *prometheus.HistogramVec // model, runtime
	PDBootstrapFailures prometheus.Counter
	PDConnectorMode     *prometheus.CounterVec // mode
	PDHandoffs          *prometheus.CounterVec // outcome, class, connector
	PDHandoffsAbandoned *prometheus.CounterVec // connector
	PDLocalPrefill      *prometheus.CounterVec // model
	PDPrefillWhole      *prometheus.CounterVec // model
	PDDecodeRetries     prometheus.Counter

	Retries            *prometheus.CounterVec   // route, reason
	RetriesExhausted   *prometheus.CounterVec   // route
	QueueDepth         *prometheus.GaugeVec     // class
	QueueWait          *prometheus.HistogramVec // class
	Rejections         *prometheus.CounterVec   // reason
	BreakerTransitions *prometheus.CounterVec   // worker, from, to
	HealthChecks       *prometheus.CounterVec   // worker, result
	Panics             *prometheus.CounterVec   // where
	// UpstreamUnsolicited counts idle upstream connections dropped because the engine wrote to
	// them unasked.
	UpstreamUnsolicited prometheus.Counter
	// TraceExportFailures counts span exports to the OTLP collector that failed;
	// TraceSpansLost the spans lost, by cause (export_failed, queue_full).
	TraceExportFailures prometheus.Counter
	TraceSpansLost      *prometheus.CounterVec

	RouteDecisions *prometheus.CounterVec   // role, policy, reason
	RouteMatch     *prometheus.HistogramVec // role

	TTFT         *prometheus.HistogramVec // model, mode
	InterToken   *prometheus.HistogramVec // model, mode
	Tokens       *prometheus.CounterVec   // model, kind
	PairHandoffs *prometheus.CounterVec   // prefill, decode, outcome

	// Tenants: the label values are the configuration's tenant names only (a request without a
	// known key is refused before it is anyone's).
	TenantRequests   *prometheus.CounterVec // tenant, model, code
	TenantTokens     *prometheus.CounterVec // tenant, model, kind
	TenantRejections *prometheus.CounterVec // tenant, reason

	// ModelWaiting are requests held in the waiting room for a model without a ready worker,
	// ModelInFlight requests being served, by model: what an autoscaler scales engines on.
	ModelWaiting, ModelInFlight *prometheus.GaugeVec
	// ModelFallbacks counts requests served by a fallback model, by the model asked and the one
	// that served.
	ModelFallbacks *prometheus.CounterVec
	// AdapterOps counts the LoRA adapter loads and unloads Baton made, by op and result;
	// AdapterLoadSeconds times them.
	AdapterOps         *prometheus.CounterVec
	AdapterLoadSeconds *prometheus.HistogramVec
	// EPPDecisions counts the Endpoint Picker's answers by result (picked, or the refusal's
	// code); EPPDecisionSeconds times the choice from the request's last body byte;
	// EPPServedFallback counts requests the proxy served from a fallback endpoint.
	EPPDecisions       *prometheus.CounterVec
	EPPDecisionSeconds prometheus.Histogram
	EPPServedFallback  prometheus.Counter
	// EPPCut counts streams and connections the picker refused or ended for the data plane's
	// behaviour, by reason; EPPStreams is the exchanges being served.
	EPPCut     *prometheus.CounterVec
	EPPStreams prometheus.Gauge

	reg    *worker.Registry
	mu     sync.Mutex
	models map[string]struct{}
}

// New creates the collectors and registers them, plus per-worker gauges read from reg at scrape
// time (no cost on the request path).
func New(reg *worker.Registry) *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_requests_total",
			Help: "Client requests by route, model and final status.",
		}, []string{"route", "model", "status"}),
		Duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "baton_request_duration_seconds",
			Help:    "Time from request arrival to the end of the response, streams included.",
			Buckets: DurationBuckets,
		}, []string{"route", "model"}),
		UpstreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_upstream_errors_total",
			Help: "Failed upstream requests by worker and kind (transport, timeout, status, mid_stream, mismatch: an answer naming another request's X-Request-Id, closed and never relayed).",
		}, []string{"worker", "kind"}),
		PDRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_pd_requests_total",
			Help: "PD requests by model, dispatch (parallel, sequential, concurrent) and outcome (success, prefill_failed, decode_failed, client_cancelled, aborted, handoff_required).",
		}, []string{"model", "dispatch", "outcome"}),
		PDTTFT: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "baton_pd_ttft_seconds",
			Help:    "Time from dispatch of the first leg to the first byte of the decode response.",
			Buckets: DurationBuckets,
		}, []string{"model", "runtime"}),
		PDPrefillDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "baton_pd_prefill_duration_seconds",
			Help:    "Time from dispatch to the end of the prefill response.",
			Buckets: DurationBuckets,
		}, []string{"model", "runtime"}),
		PDBootstrapFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_pd_bootstrap_failures_total",
			Help: "Requests whose bootstrap fields could not be injected into the legs.",
		}),
		PDConnectorMode: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_pd_kv_connector_mode_total",
			Help: "vLLM PD requests by the prefill worker's connector mode (nixl, mooncake, passthrough).",
		}, []string{"mode"}),
		PDHandoffs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_pd_kv_handoffs_total",
			Help: "vLLM PD pair attempts (a request served alone by design: once, as it ended whole) by KV handoff outcome (nixl, mooncake, passthrough, recomputed, none-*), its class (handed_off; recomputed: a handoff was expected and the decode computed the prompt; by_design: n>1, a batch, a route without handoff; failed) and connector.",
		}, []string{"outcome", "class", "connector"}),
		PDLocalPrefill: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_pd_local_prefill_total",
			Help: "PD requests a decode worker served alone, computing the prompt itself, because its uncached part was under pd_local_prefill_threshold or every prefill was busier (conditional disaggregation).",
		}, []string{"model"}),
		PDPrefillWhole: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_pd_prefill_whole_total",
			Help: "PD requests an idle prefill worker served whole, decoding too, because the chosen decode was past the TPOT SLO at its batch (pd_prefill_serves_whole).",
		}, []string{"model"}),
		PDHandoffsAbandoned: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_pd_kv_handoffs_abandoned_total",
			Help: "KV handoffs prepared on a prefill but never consumed by a decode (decode failed or client left); the KV stays pinned until the engine's timeout.",
		}, []string{"connector"}),
		PDDecodeRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_pd_decode_retries_total",
			Help: "vLLM PD decode legs sent again, alone, to another decode worker with the same handoff after a retryable failure before their first byte.",
		}),
		Retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_retries_total",
			Help: "Retried attempts by route and the reason of the failed attempt (status_<code>, transport, timeout).",
		}, []string{"route", "reason"}),
		RetriesExhausted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_retries_exhausted_total",
			Help: "Requests that failed after their last allowed attempt.",
		}, []string{"route"}),
		QueueDepth: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "baton_queue_depth",
			Help: "Requests waiting for a slot (max_concurrent_requests), by priority class.",
		}, []string{"class"}),
		QueueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "baton_queue_wait_seconds",
			Help:    "Time requests waited for a slot, by the priority class they were served in.",
			Buckets: DurationBuckets,
		}, []string{"class"}),
		Rejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_rejections_total",
			Help: "Requests refused by admission control, by reason (queue_full, queue_timeout, draining).",
		}, []string{"reason"}),
		BreakerTransitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_worker_circuit_transitions_total",
			Help: "Circuit breaker state changes by worker.",
		}, []string{"worker", "from", "to"}),
		HealthChecks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_worker_health_checks_total",
			Help: "Active health probes by worker and result (ok, failed).",
		}, []string{"worker", "result"}),
		TraceExportFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_trace_export_failures_total",
			Help: "Span exports to the OTLP collector that failed (their spans are lost).",
		}),
		TraceSpansLost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_trace_spans_lost_total",
			Help: "Sampled spans that never reached the OTLP collector, by cause: export_failed, queue_full (2,048 spans were waiting for their export).",
		}, []string{"cause"}),
		UpstreamUnsolicited: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_upstream_unsolicited_total",
			Help: "Idle upstream connections dropped because the engine (or a proxy before it) sent bytes nobody asked for.",
		}),
		Panics: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_panics_total",
			Help: "Panics recovered while serving a request, by where (handler, prefill_leg, health_generate); each failed its request with 500.",
		}, []string{"where"}),
		RouteDecisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_route_decisions_total",
			Help: "Worker choices by role, policy and reason (turn, random, load, hash, cache_match, cache_miss, imbalanced, no_prompt).",
		}, []string{"role", "policy", "reason"}),
		RouteMatch: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "baton_route_prefix_match_ratio",
			Help:    "cache_aware: share of the prompt the chosen worker was found to have cached.",
			Buckets: []float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1},
		}, []string{"role"}),
		TTFT: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "baton_ttft_seconds",
			Help:    "Time from request arrival to the first byte of a successful answer, by model and mode (regular, pd_sglang, pd_vllm).",
			Buckets: DurationBuckets,
		}, []string{"model", "mode"}),
		InterToken: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "baton_inter_token_seconds",
			Help:    "Gaps between the events of a streamed answer as they reached the client, by model and mode.",
			Buckets: []float64{.001, .0025, .005, .01, .02, .035, .05, .075, .1, .15, .25, .5, 1, 2.5},
		}, []string{"model", "mode"}),
		Tokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_tokens_total",
			Help: "Tokens from the usage of successful answers, by model and kind (prompt, completion, cached: prompt tokens the engine had cached).",
		}, []string{"model", "kind"}),
		PairHandoffs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_pd_pair_handoffs_total",
			Help: "PD requests by prefill and decode worker and KV handoff outcome (nixl, mooncake, bootstrap, passthrough, none-*).",
		}, []string{"prefill", "decode", "outcome"}),
		TenantRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_tenant_requests_total",
			Help: "Requests by tenant, model and final HTTP status.",
		}, []string{"tenant", "model", "code"}),
		TenantTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_tenant_tokens_total",
			Help: "Tokens charged to tenants, by tenant, model and kind (prompt, completion, cached): the engines' usage, or what a limited tenant's request that ended without it was charged.",
		}, []string{"tenant", "model", "kind"}),
		TenantRejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_tenant_rejections_total",
			Help: "Requests refused for a tenant's limits, by tenant and reason (requests, tokens, concurrency, store_unavailable).",
		}, []string{"tenant", "reason"}),
		ModelWaiting: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "baton_model_waiting_requests",
			Help: "Requests waiting for a model's first ready worker (no_worker_wait), by model: the signal to scale an engine up from zero.",
		}, []string{"model"}),
		ModelInFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "baton_model_in_flight_requests",
			Help: "Requests being served (queued for a slot included), by model.",
		}, []string{"model"}),
		ModelFallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_model_fallbacks_total",
			Help: "Requests served by a fallback model (models.<name>.fallbacks), by the model asked for and the one that served.",
		}, []string{"from", "to"}),
		AdapterOps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_adapter_operations_total",
			Help: "LoRA adapter loads and unloads Baton made on engines, by op (load, unload) and result (ok, failed).",
		}, []string{"op", "result"}),
		AdapterLoadSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "baton_adapter_operation_seconds", Help: "How long LoRA adapter loads and unloads took, by op.",
			Buckets: []float64{.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120},
		}, []string{"op"}),
		EPPDecisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_epp_decisions_total",
			Help: "Endpoint Picker answers, by result: picked, or the code of the refusal (no_available_workers, request_shed, invalid_json, ...).",
		}, []string{"result"}),
		EPPDecisionSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "baton_epp_decision_seconds", Help: "How long the Endpoint Picker took to choose, from the request's last body byte to its answer.",
			Buckets: []float64{.00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .1, 1},
		}),
		EPPServedFallback: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_epp_served_fallback_total",
			Help: "Requests the proxy reports served by a fallback endpoint of the Endpoint Picker's list rather than its choice.",
		}),
		EPPCut: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_epp_cut_total",
			Help: "ext_proc streams and connections the Endpoint Picker refused or ended for its data plane's behaviour, by reason: max_streams, max_connections, request_phase_timeout, max_duration.",
		}, []string{"reason"}),
		EPPStreams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_epp_streams", Help: "ext_proc exchanges the Endpoint Picker is serving.",
		}),
		reg:    reg,
		models: map[string]struct{}{},
	}
	m.requests.Max, m.durations.Max, m.decisions.Max = maxChildren, maxChildren, maxChildren
	m.ttfts.Max, m.tokens.Max = maxChildren, maxChildren
	m.Registry.MustRegister(m.Requests, m.Duration, m.UpstreamErrors,
		m.PDRequests, m.PDTTFT, m.PDPrefillDuration, m.PDBootstrapFailures, m.PDConnectorMode, m.PDHandoffs, m.PDLocalPrefill, m.PDPrefillWhole, m.PDHandoffsAbandoned, m.PDDecodeRetries,
		m.Retries, m.RetriesExhausted, m.QueueDepth, m.QueueWait, m.Rejections, m.BreakerTransitions, m.HealthChecks, m.Panics, m.UpstreamUnsolicited,
		m.TraceExportFailures, m.TraceSpansLost,
		m.RouteDecisions, m.RouteMatch, m.TTFT, m.InterToken, m.Tokens, m.PairHandoffs,
		m.TenantRequests, m.TenantTokens, m.TenantRejections, m.ModelWaiting, m.ModelInFlight, m.ModelFallbacks, m.AdapterOps, m.AdapterLoadSeconds,
		m.EPPDecisions, m.EPPDecisionSeconds, m.EPPServedFallback, m.EPPCut, m.EPPStreams,
		&workerCollector{reg: reg}, &modelCollector{m: m},
		collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(liveHeap)), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// liveHeap adds go_gc_heap_live_bytes to the Go runtime's metrics: the heap the last collection
// found reachable, which garbage allocated since does not change (go_memstats_heap_alloc_bytes
// counts it until the next collection).
var liveHeap = collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(`^/gc/heap/live:bytes$`)}

// Model returns the label value for a request's model: the model itself when some registered
// worker lists it or the configuration names it (and it is printable UTF-8 of at most
// MaxLabelLen bytes), "unknown" for any
// other name a client sends, "none" for no model, and "other" past MaxModels distinct labels.
// A client therefore cannot grow the label set or put unchecked bytes into a label.
func (m *Metrics) Model(model string) string {
	switch {
	case model == "":
		return ModelNone
	case len(model) > MaxLabelLen || !printable(model),
		!m.reg.Snapshot().Lists(model) && (m.Declared == nil || !m.Declared(model)):
		return ModelUnknown
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.models[model]; ok {
		return model
	}
	if len(m.models) >= MaxModels {
		return ModelOther
	}
	m.models[model] = struct{}{}
	return model
}

// Known reports whether model is one Baton knows: a worker lists it (configured or reported),
// or requests for it were counted before (its workers may have left: scaled to zero).
func (m *Metrics) Known(model string) bool {
	if model == "" {
		return false
	}
	snap := m.reg.Snapshot()
	if snap.Lists(model) || slices.Contains(snap.Models(), model) {
		return true
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.models[model]
	return ok
}

// KnownLabel is the label of a model Known reported: the model itself while MaxModels allow.
func (m *Metrics) KnownLabel(model string) string {
	if len(model) > MaxLabelLen || !printable(model) {
		return ModelUnknown
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.models[model]; ok || len(m.models) < MaxModels {
		m.models[model] = struct{}{}
		return model
	}
	return ModelOther
}

// ForgetWorker drops the series labelled with a removed worker, so that a fleet whose workers
// come and go (Kubernetes pods) keeps a bounded number of series. Per-worker gauges are read
// from the registry at scrape time and leave with the worker on their own.
func (m *Metrics) ForgetWorker(url string) {
	for _, v := range []*prometheus.MetricVec{m.UpstreamErrors.MetricVec, m.BreakerTransitions.MetricVec, m.HealthChecks.MetricVec} {
		v.DeletePartialMatch(prometheus.Labels{"worker": url})
	}
	m.PairHandoffs.DeletePartialMatch(prometheus.Labels{"prefill": url})
	m.PairHandoffs.DeletePartialMatch(prometheus.Labels{"decode": url})
}

// PairHandoffCounts returns the handoff outcomes counted per PD pair: [prefill, decode] → outcome →
// requests (for the status page; read from baton_pd_pair_handoffs_total).
func (m *Metrics) PairHandoffCounts() map[[2]string]map[string]float64 {
	ch := make(chan prometheus.Metric, 64)
	go func() { m.PairHandoffs.Collect(ch); close(ch) }()
	out := map[[2]string]map[string]float64{}
	for c := range ch {
		var d dto.Metric
		if c.Write(&d) != nil || d.Counter == nil {
			continue
		}
		var prefill, decode, outcome string
		for _, l := range d.Label {
			switch l.GetName() {
			case "prefill":
				prefill = l.GetValue()
			case "decode":
				decode = l.GetValue()
			case "outcome":
				outcome = l.GetValue()
			}
		}
		k := [2]string{prefill, decode}
		if out[k] == nil {
			out[k] = map[string]float64{}
		}
		out[k][outcome] = d.Counter.GetValue()
	}
	return out
}

// printable reports whether s is valid UTF-8 without control characters.
func printable(s string) bool {
	for _, r := range s {
		if r < 0x20 || r == 0x7f || r == utf8.RuneError {
			return false
		}
	}
	return true
}

// ObserveRequest records one finished client request; model is a label from Model.
func (m *Metrics) ObserveRequest(route, model string, status int, seconds float64) {
	m.requests.Get(requestKey{route, model, status}, func() prometheus.Counter {
		return m.Requests.WithLabelValues(route, model, strconv.Itoa(status))
	}).Inc()
	m.durations.Get([2]string{route, model}, func() prometheus.Observer { return m.Duration.WithLabelValues(route, model) }).Observe(seconds)
}

// ObserveTTFT records a successful generation's time to its first byte; model is a label from
// Model, mode the request's dispatch mode.
func (m *Metrics) ObserveTTFT(model, mode string, seconds float64) {
	m.ttfts.Get([2]string{model, mode}, func() prometheus.Observer { return m.TTFT.WithLabelValues(model, mode) }).Observe(seconds)
}

// AddTokens counts a finished generation's tokens by kind; a cached count of zero adds no
// series for the model.
func (m *Metrics) AddTokens(model string, prompt, completion, cached int) {
	m.token(model, "prompt").Add(float64(prompt))
	m.token(model, "completion").Add(float64(completion))
	if cached > 0 {
		m.token(model, "cached").Add(float64(cached))
	}
}

func (m *Metrics) token(model, kind string) prometheus.Counter {
	return m.tokens.Get([2]string{model, kind}, func() prometheus.Counter { return m.Tokens.WithLabelValues(model, kind) })
}

// maxChildren bounds each vector's remembered series.
const maxChildren = 1024

// requestKey is a baton_requests_total series.
type requestKey struct {
	route, model string
	status       int
}

// Handler serves the registry in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{})
}

var (
	inflightDesc = prometheus.NewDesc("baton_worker_requests_active",
		"Requests in flight on a worker through Baton, streams included.", []string{"worker", "role"}, nil)
	readyDesc = prometheus.NewDesc("baton_worker_ready",
		"1 when the worker is registered and may receive traffic, else 0.", []string{"worker", "role"}, nil)
	breakerDesc = prometheus.NewDesc("baton_worker_circuit_state",
		"Circuit breaker state: 0 closed, 1 open, 2 half-open.", []string{"worker", "role"}, nil)
	engineDesc = prometheus.NewDesc("baton_worker_engine_load",
		"What the engine last reported of its load (running, waiting requests; kv_usage 0..1), while routing trusts it.", []string{"worker", "role", "signal"}, nil)
	outcomeDesc = prometheus.NewDesc("baton_worker_outcomes_total",
		"Outcome samples of requests a worker served (failure: transport error or 408/500/502/503/504).", []string{"worker", "role", "outcome"}, nil)
	healthFailureDesc = prometheus.NewDesc("baton_worker_health_failures_total",
		"Failed health probes of a worker by cause: status_4xx, status_5xx, status_other (the engine answered outside 2xx), timeout, refused, reset, dns, tls, error (no answer).", []string{"worker", "cause"}, nil)
)

var servableDesc = prometheus.NewDesc("baton_model_servable",
	"1 when a request for the model can be sent now (an available worker, or PD pair, or one of its fallbacks'), else 0; the gateway is ready while any model is 1.", []string{"model"}, nil)

// modelCollector reports each model's baton_model_servable, its label bounded as Model bounds it.
type modelCollector struct{ m *Metrics }

func (c *modelCollector) Describe(ch chan<- *prometheus.Desc) { ch <- servableDesc }

func (c *modelCollector) Collect(ch chan<- prometheus.Metric) {
	if c.m.Servable == nil {
		return
	}
	models, servable := c.m.Servable()
	values := map[string]float64{}
	for i, model := range models {
		// The fleet's own names (its workers' and its configuration's, never a client's),
		// bounded as Model bounds a label: a configured name no engine serves is named.
		label := model
		switch {
		case model == "":
			label = ModelNone
		case len(model) > MaxLabelLen || !printable(model):
			label = ModelUnknown
		case len(values) >= MaxModels:
			if _, ok := values[model]; !ok {
				label = ModelOther
			}
		}
		v, seen := values[label]
		if !seen || v == 1 { // models folded into one label (past the bound): 0 when any is
			values[label] = map[bool]float64{true: 1, false: 0}[servable[i]]
		}
	}
	for label, v := range values {
		ch <- prometheus.MustNewConstMetric(servableDesc, prometheus.GaugeValue, v, label)
	}
}

type workerCollector struct{ reg *worker.Registry }

func (c *workerCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- inflightDesc
	ch <- readyDesc
	ch <- outcomeDesc
	ch <- breakerDesc
	ch <- engineDesc
	ch <- healthFailureDesc
}

func (c *workerCollector) Collect(ch chan<- prometheus.Metric) {
	now := time.Now()
	for _, w := range c.reg.Snapshot().Workers {
		if l := w.EngineLoad(); l.Fresh(now) {
			for _, sig := range []struct {
				name string
				has  bool
				v    float64
			}{{"running", l.HasRunning, l.Running}, {"waiting", l.HasWaiting, l.Waiting}, {"kv_usage", l.HasKV, l.KVUsage}} {
				if sig.has {
					ch <- prometheus.MustNewConstMetric(engineDesc, prometheus.GaugeValue, sig.v, w.URL, w.Role, sig.name)
				}
			}
		}
		ch <- prometheus.MustNewConstMetric(inflightDesc, prometheus.GaugeValue, float64(w.InFlight()), w.URL, w.Role)
		ready := 0.0
		if w.Ready() {
			ready = 1
		}
		ch <- prometheus.MustNewConstMetric(readyDesc, prometheus.GaugeValue, ready, w.URL, w.Role)
		ch <- prometheus.MustNewConstMetric(breakerDesc, prometheus.GaugeValue, float64(w.BreakerState()), w.URL, w.Role)
		ok, failed := w.Outcomes()
		ch <- prometheus.MustNewConstMetric(outcomeDesc, prometheus.CounterValue, float64(ok), w.URL, w.Role, "success")
		ch <- prometheus.MustNewConstMetric(outcomeDesc, prometheus.CounterValue, float64(failed), w.URL, w.Role, "failure")
		for i, n := range w.HealthFailures() {
			ch <- prometheus.MustNewConstMetric(healthFailureDesc, prometheus.CounterValue, float64(n), w.URL, worker.HealthCauses[i])
		}
	}
}

// ObserveRoute counts a routing decision and, where the policy measured one, its prefix match:
// the selector's Observe hook.
func (m *Metrics) ObserveRoute(d policy.Decision) {
	m.decisions.Get([3]string{d.Role, d.Policy, d.Reason}, func() prometheus.Counter {
		return m.RouteDecisions.WithLabelValues(d.Role, d.Policy, d.Reason)
	}).Inc()
	if d.Match >= 0 {
		m.RouteMatch.WithLabelValues(d.Role).Observe(d.Match)
	}
}
