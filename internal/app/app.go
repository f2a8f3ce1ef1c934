// Package app wires the gateway together and runs it: configuration, registry, registration,
// selection, servers, and the drain on shutdown. The developer tools (sim, demo, bench) live in
// package cli, apart from the gateway.
package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	stdlog "log"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/http/pprof"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	adminapi "github.com/baton-llm/baton/internal/admin"
	"github.com/baton-llm/baton/internal/advisor"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/discovery"
	"github.com/baton-llm/baton/internal/enginestate"
	"github.com/baton-llm/baton/internal/fleet"
	"github.com/baton-llm/baton/internal/gcpace"
	"github.com/baton-llm/baton/internal/h1"
	"github.com/baton-llm/baton/internal/kvfleet"
	"github.com/baton-llm/baton/internal/lora"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/server"
	"github.com/baton-llm/baton/internal/tracing"
	"github.com/baton-llm/baton/internal/worker"
)

// Run runs `baton serve` with args (a leading "serve" is allowed) until ctx ends. It returns
// nil after a clean shutdown and config.ErrHelp after printing help.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "serve" {
		args = args[1:]
	}
	cfg, err := config.Parse(args, stdout)
	if err != nil {
		return err
	}
	return Serve(ctx, cfg, stdout, stderr)
}

// version is set at build time with -ldflags "-X github.com/baton-llm/baton/internal/app.version=v1.2.3".
var version = ""

// Version describes this build: its version (from the build flag or the module), VCS revision
// and Go version.
func Version() string {
	v, rev, dirty := version, "", false
	if bi, ok := debug.ReadBuildInfo(); ok {
		if v == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			v = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
	}
	if v == "" {
		v = "devel"
	}
	out := "baton " + v
	if rev != "" {
		out += " " + rev[:min(12, len(rev))]
		if dirty {
			out += "-dirty"
		}
	}
	return out + " " + runtime.Version()
}

// NewLogger returns the slog logger the configuration asks for, writing to w.
func NewLogger(cfg config.Config, w io.Writer) *slog.Logger {
	var level slog.Level
	_ = level.UnmarshalText([]byte(cfg.LogLevel))
	opts := &slog.HandlerOptions{Level: level}
	if cfg.LogJSON {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// Gateway is a wired, not yet listening Baton: what Serve runs, and what tests drive in-process.
type Gateway struct {
	Config   config.Config
	cert     *certificate // the API's TLS certificate; nil: HTTP
	Registry *worker.Registry
	Metrics  *metrics.Metrics
	Server   *server.Server
	Parallel *pd.Parallel
	// Dispatcher runs PD requests over a given pair (baton check sends each pair one).
	Dispatcher pd.Executor
	// Proxy sends requests to a given worker (baton check sends each regular worker one).
	Proxy *proxy.Proxy
	// Selector chooses workers; its Compatible rule says which pairs can meet.
	Selector  *policy.Selector
	Adapters  *lora.Manager
	Registrar *worker.Registrar
	// Fleet adds, updates and removes workers while Baton runs.
	Fleet   *fleet.Fleet
	reloads *prometheus.CounterVec
	// traces is told of spans that never reach the OTLP collector.
	traces *tracing.Watch
	// reloadMu serialises reloads; applied is the configuration they compare with: Config with
	// the settings reloads applied since.
	reloadMu sync.Mutex
	applied  config.Config
	// discovery is the service discovery Baton runs, for the status page and the metrics.
	discovery *discoveryHealth
	// tenants are who may call (swapped by a reload) and the limiter counting their use.
	tenants *tenancy
	// models are the names clients use and the default model, swapped by a reload.
	models *atomic.Pointer[modelNames]
	Health *worker.HealthChecker // nil when health checks are disabled
	// Load reads each engine's load from its /metrics.
	Load *enginestate.Poller
	// KVEvents subscribes to the engines' KV events.
	KVEvents *kvfleet.KVEvents
	Log      *slog.Logger
}

// Start starts the background work: the stalled-upload sweeper, the KV event subscriptions,
// registration, health checks and the engine load poller, until ctx ends. The error is a KV
// events listener that cannot bind; the rest has started regardless.
func (g *Gateway) Start(ctx context.Context) error {
	g.Server.Start(ctx)
	err := g.KVEvents.Start(ctx)
	g.Registrar.Start(ctx)
	g.Load.Start(ctx)
	if g.Health != nil {
		g.Health.Start(ctx)
	}
	return err
}

// Wait waits for the background work Start began, and for prefill legs still finishing.
func (g *Gateway) Wait() {
	g.Server.Wait()
	g.Registrar.Wait()
	g.Load.Wait()
	g.Fleet.Wait()
	g.KVEvents.Wait()
	if g.Health != nil {
		g.Health.Wait()
	}
	g.Parallel.Wait()
}

// New wires a gateway from cfg. It does no I/O.
func New(cfg config.Config, log *slog.Logger) (*Gateway, error) {
	return build(cfg, log)
}

// newPolicies builds the routing policy of each role from cfg, and those of the models that
// have their own (by the served name: model -> role -> policy): at start and on a reload that
// changes one of them or their parameters.
func newPolicies(cfg config.Config, kv *kvfleet.KVEvents) (map[string]policy.Policy, map[string]map[string]policy.Policy, error) {
	build := func(name string) (policy.Policy, error) {
		p, err := policy.New(name, cfg)
		if ca, ok := p.(*policy.CacheAware); ok && cfg.CacheAwareSource != "approx" {
			ca.Precise = kv.Precise()
		}
		return p, err
	}
	roles := []string{config.RoleRegular, config.RolePrefill, config.RoleDecode}
	policies := map[string]policy.Policy{}
	for _, role := range roles {
		p, err := build(cfg.PolicyFor(role))
		if err != nil {
			return nil, nil, err
		}
		policies[role] = p
	}
	byModel := map[string]map[string]policy.Policy{}
	for name := range cfg.Models {
		for _, role := range roles {
			pol := cfg.ModelPolicyFor(name, role)
			if pol == "" {
				continue
			}
			p, err := build(pol)
			if err != nil {
				return nil, nil, err
			}
			served := cfg.Served(name)
			if byModel[served] == nil {
				byModel[served] = map[string]policy.Policy{}
			}
			byModel[served][role] = p
		}
	}
	return policies, byModel, nil
}

var (
	cacheIndexBlocks = prometheus.NewDesc("baton_route_cache_index_blocks",
		"cache_aware: prompt blocks its prefix index holds (bounded by max_tree_size / 64).", []string{"role"}, nil)
	cacheIndexEvictions = prometheus.NewDesc("baton_route_cache_index_evictions_total",
		"cache_aware: prompt blocks forgotten to keep its prefix index within max_tree_size.", []string{"role"}, nil)
)

// cacheIndexCollector reports the prefix index of each role whose policy is cache_aware now (a
// reload may change which are).
type cacheIndexCollector struct{ sel *policy.Selector }

func (c cacheIndexCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- cacheIndexBlocks
	ch <- cacheIndexEvictions
}

func (c cacheIndexCollector) Collect(ch chan<- prometheus.Metric) {
	for _, role := range []string{config.RoleRegular, config.RolePrefill, config.RoleDecode} {
		if ca, ok := c.sel.Policy(role).(*policy.CacheAware); ok {
			ch <- prometheus.MustNewConstMetric(cacheIndexBlocks, prometheus.GaugeValue, float64(ca.Size()), role)
			ch <- prometheus.MustNewConstMetric(cacheIndexEvictions, prometheus.CounterValue, float64(ca.Evictions()), role)
		}
	}
}

// build wires a gateway from cfg.
func build(cfg config.Config, log *slog.Logger) (*Gateway, error) {
	var ws []*worker.Worker
	for _, c := range cfg.AllWorkers() {
		ws = append(ws, worker.New(c))
	}
	reg := worker.NewRegistry(ws...)
	m := metrics.New(reg)
	transport := proxy.NewTransport(cfg.UpstreamClient)
	if cfg.UpstreamReuse == "off" {
		transport = proxy.WithoutReuse(transport)
	}
	proxy.TellUnsolicited(transport, m.UpstreamUnsolicited.Inc)
	breaker := newBreaker(cfg.CircuitBreaker, m, log, transport)
	for _, w := range ws {
		w.UseBreaker(breaker)
	}
	pairs := &worker.PairHealth{Threshold: cfg.PairHealth.FailureThreshold, Quarantine: cfg.PairHealth.Quarantine}
	kv := kvfleet.New(cfg, ws, reg, log)
	policies, modelPolicies, err := newPolicies(cfg, kv)
	if err != nil {
		return nil, err
	}
	px := &proxy.Proxy{Transport: transport, Timeout: cfg.RequestTimeout, StallTimeout: cfg.StreamStallTimeout, Metrics: m, Log: log}
	if cfg.ForwardSimFaults {
		px.ExtraHeaders = []string{"X-Sim-Fault"}
	}
	parallel := &pd.Parallel{Proxy: px, Metrics: m, Log: log, Pairs: pairs}
	sequential := &pd.Sequential{Proxy: px, Metrics: m, Log: log, DefaultConnector: cfg.KVConnector, Pairs: pairs,
		RequireHandoff: cfg.PDRequireHandoff, MooncakeConcurrent: cfg.PDMooncakeDispatch == "concurrent", Concurrent: parallel}
	client := &http.Client{Transport: transport}
	models := &atomic.Pointer[modelNames]{}
	models.Store(&modelNames{models: cfg.Models, def: cfg.DefaultModel})
	sel := &policy.Selector{Registry: reg, Policies: policies, Pairs: pairs,
		Compatible: func(p, d *worker.Worker) bool { return pd.Compatible(p, d, cfg.KVConnector) },
		Observe:    m.ObserveRoute}
	adapters := lora.New(reg, client, log, adapterSettings(cfg))
	m.Declared = func(model string) bool { // the configuration's names: bounded, labels before any worker lists them
		if _, ok := adapters.Loadable(model); ok {
			return true
		}
		_, ok := models.Load().models[model]
		return ok
	}
	adapters.Observe = func(op, result string, d time.Duration) {
		m.AdapterOps.WithLabelValues(op, result).Inc()
		m.AdapterLoadSeconds.WithLabelValues(op).Observe(d.Seconds())
	}
	load := &enginestate.Poller{Registry: reg, Client: client, Log: log, Interval: cfg.LoadPollInterval, Adapters: adapters.Declared}
	adapters.Refresh = func(ctx context.Context, w *worker.Worker) { load.Poll(ctx, w) }
	sel.Adapters = adapters
	var local *director.LocalRule
	if cfg.PDLocalPrefillThreshold > 0 || cfg.PDLocalPrefillAuto || cfg.PDPrefillServesWhole {
		local = director.NewLocalRule(cfg.PDLocalPrefillThreshold, cfg.PDLocalPrefillAuto, kv.PromptTokens)
		local.TPOTSLO = cfg.PDAdviceTPOTSLO
		local.CountPrompt = kv.CountPromptTokens
		if cfg.PDLocalPrefillThreshold > 0 || cfg.PDLocalPrefillAuto {
			sel.LocalPrefill = local.Decide
		}
		if cfg.PDPrefillServesWhole {
			local.Whole = true
			sel.ServeWhole = local.ServeWhole
		}
	}
	if !cfg.Retry.Disable {
		sequential.RedecodeAttempts = cfg.Retry.MaxRetries - 1
		sequential.Redecode = pd.RedecodeOver(sel)
	}
	dispatcher := &pd.Dispatcher{Sequential: sequential, Parallel: parallel}
	kv.SetTokenizeClient(client)
	m.Registry.MustRegister(cacheIndexCollector{sel})
	fl := fleet.New(cfg, reg, breaker, kv, m, log, cfg.RequestTimeout+5*time.Second)
	fl.CloseIdle = func(url string) { proxy.CloseIdle(transport, url) }
	parts := server.Options{Proxy: px, Dispatcher: dispatcher, Admin: adminapi.Options{Fleet: fl, SourceOf: fl.SourceOf, KVEventsView: kv.View},
		Director: director.Options{Registry: reg, Selector: sel, Metrics: m, Log: log, Adapters: adapters}}
	parts.Director.LocalRule = local
	parts.Director.Models = func() (map[string]config.ModelConfig, string) { mn := models.Load(); return mn.models, mn.def }
	sel.SetPolicies(policies, modelPolicies)
	m.Registry.MustRegister(kv.Collector())
	disc := &discoveryHealth{}
	parts.Notices = disc.notices
	tenants, err := newTenancy(cfg, m, log)
	if err != nil {
		return nil, err
	}
	parts.Director.Tenancy = director.Tenancy{Set: tenants.set.Load, Limiter: tenants.limiter, MaxTokens: cfg.TenantMaxTokens, PromptTokens: kv.PromptTokens,
		CountPrompt: kv.CountPromptTokens, AskPrompt: kv.AskPromptTokens}
	if cfg.TrustTenantHeader {
		parts.Director.Tenancy.TrustHeader = cfg.TenantHeaderName
	}
	traces := newTraceWatch(m, log)
	parts.Notices = func() []server.Notice {
		return append(append(disc.notices(), tenants.notices()...), traceNotices(traces.State())...)
	}
	learn := func(w *worker.Worker) { learnEngineIDs(log, cfg, client, w) }
	health := newHealth(cfg.HealthCheck, reg, client, m, log)
	if health != nil {
		health.OnBack = func(w *worker.Worker) { proxy.Rejudge(transport, w) }
	}
	if health != nil {
		count := health.OnProbe
		health.OnProbe = func(w *worker.Worker, ok bool) {
			count(w, ok)
			if ok {
				learn(w) // an engine that restarted may have registered a new engine id
			}
		}
	}
	onRegistered := func(w *worker.Worker) { learn(w); logConnector(log, cfg, w); kv.Registered(w) }
	registrar := &worker.Registrar{Registry: reg, Client: client, Log: log, MaxInterval: cfg.DetectInterval, OnRegistered: onRegistered}
	fl.Registrar, fl.OnRegistered, fl.Pairs = registrar, onRegistered, pairs
	reloads := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_config_reloads_total",
		Help: "Configuration reloads (SIGHUP or a changed file) by result: ok, partial (some workers refused, settings that need a restart changed, or the TLS certificate could not be read) or invalid (nothing changed)."}, []string{"result"})
	m.Registry.MustRegister(reloads)
	var cert *certificate
	if cfg.TLSCertPath != "" {
		cert = &certificate{certPath: cfg.TLSCertPath, keyPath: cfg.TLSKeyPath}
		if err := cert.load(); err != nil {
			return nil, err
		}
	}
	srv := server.New(serverOptions(cfg, parts))
	if c := srv.Director().AdviceCollector(); c != nil {
		m.Registry.MustRegister(c)
	}
	return &Gateway{
		Health:     health,
		traces:     traces,
		Config:     cfg,
		applied:    cfg,
		discovery:  disc,
		tenants:    tenants,
		models:     models,
		Registry:   reg,
		Metrics:    m,
		Parallel:   parallel,
		Dispatcher: dispatcher,
		Proxy:      px,
		Selector:   sel,
		Server:     srv,
		Registrar:  registrar,
		Fleet:      fl,
		reloads:    reloads,
		Load:       load,
		Adapters:   adapters,
		KVEvents:   kv,
		Log:        log,
		cert:       cert,
	}, nil
}

// adapterSettings are the LoRA adapter settings of cfg.
func adapterSettings(cfg config.Config) lora.Settings {
	return lora.Settings{Adapters: cfg.Adapters, UnloadLRU: cfg.UnloadLRU, Affinity: cfg.AdapterAffinity, Timeout: cfg.AdapterLoadTimeout}
}

// newBreaker is the circuit breaker every worker shares, its transitions counted and logged. A
// worker whose circuit opens is seen anew (rejudged), over none of its idle connections.
func newBreaker(cb config.CircuitBreaker, m *metrics.Metrics, log *slog.Logger, transport http.RoundTripper) *worker.BreakerConfig {
	return &worker.BreakerConfig{
		FailureThreshold: cb.FailureThreshold, SuccessThreshold: cb.SuccessThreshold, Timeout: cb.TimeoutDuration, Disabled: cb.Disable,
		OnTransition: func(w *worker.Worker, from, to worker.BreakerState) {
			f, t := from.String(), to.String()
			m.BreakerTransitions.WithLabelValues(w.URL, f, t).Inc()
			log.Warn("circuit breaker", "worker", w.URL, "role", w.Role, "from", f, "to", t)
			if to == worker.BreakerOpen {
				proxy.Rejudge(transport, w)
			}
		},
	}
}

// newHealth is the active health checker, or nil when health checks are disabled.
func newHealth(hc config.HealthCheck, reg *worker.Registry, client *http.Client, m *metrics.Metrics, log *slog.Logger) *worker.HealthChecker {
	if hc.Disable {
		return nil
	}
	return &worker.HealthChecker{
		Registry: reg, Client: client, Log: log, Endpoint: hc.Endpoint, Interval: hc.Interval, Timeout: hc.Timeout,
		FailureThreshold: hc.FailureThreshold, SuccessThreshold: hc.SuccessThreshold,
		OnProbe: func(w *worker.Worker, ok bool) {
			result := "ok"
			if !ok {
				result = "failed"
			}
			m.HealthChecks.WithLabelValues(w.URL, result).Inc()
		},
	}
}

// serverOptions fills the server's settings from the configuration into parts.
func serverOptions(cfg config.Config, parts server.Options) server.Options {
	o := parts
	d := &o.Director
	d.PD, d.APIKey, d.MaxBatchSize, d.RouteHeader = cfg.PDDisaggregation, cfg.ClientKey(), cfg.MaxBatchSize, cfg.RouteHeader
	d.Admission, d.Retry = cfg.Admission, cfg.Retry
	o.Admin.KVConnector = cfg.KVConnector
	o.MaxPayloadSize = cfg.MaxPayloadSize
	o.MaxBufferedBodyBytes, o.BodyTimeout = cfg.MaxBufferedBodyBytes, cfg.BodyTimeout
	o.PrefillerHeader, o.PrefillerAbsentPicks = cfg.PDPrefillerHeader, cfg.PDPrefillerAbsent == "pick"
	o.RequestTimeout, o.StalledClientTimeout = cfg.RequestTimeout, cfg.StalledClientTimeout
	if cfg.PDDisaggregation {
		d.Advisor, d.AdviceSLO = &advisor.Advisor{Window: cfg.PDAdviceWindow}, advisor.SLO{TTFT: cfg.PDAdviceTTFTSLO, TPOT: cfg.PDAdviceTPOTSLO}
	}

	o.AccessLog, o.Version = cfg.AccessLog, Version()
	o.Admin.Keys, o.Admin.Separate = cfg.AdminKeys(), cfg.AdminPort >= 0
	// Keyless only on a loopback listener of its own: a proxy on the same host in front of the
	// API listener makes every client look local.
	o.Admin.Open = o.Admin.Separate && config.IsLoopback(cfg.AdminHost)
	return o
}

// Serve runs the gateway until ctx ends, then drains: readiness turns 503, in-flight requests
// and streams finish (up to the grace period), and Serve returns nil.
func Serve(ctx context.Context, cfg config.Config, stdout, stderr io.Writer) error {
	log := NewLogger(cfg, stderr)
	g, err := New(cfg, log)
	if err != nil {
		return err
	}
	stdlog.SetFlags(0)
	stdlog.SetOutput(stdLogBridge{log: log, unsolicited: g.Metrics.UpstreamUnsolicited})
	defer gcpace.Floor(uint64(heapFloor(cfg.GCHeapFloor, log)))()
	ls, err := g.listen(cfg, log)
	if err != nil {
		return err
	}
	stopTracing, err := tracing.Setup(ctx, tracing.Config{Endpoint: cfg.OTLPTracesEndpoint, Ratio: cfg.TraceSampleRatio, Version: Version(), Watch: g.traces})
	if err != nil {
		ls.close()
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = stopTracing(sctx)
	}()
	if tracing.Enabled() {
		log.Info("tracing: sending spans over OTLP", "ratio", cfg.TraceSampleRatio)
	}
	bg, stopBG := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBG()
	if err := g.startBackground(bg, cfg, log); err != nil {
		stopBG()
		g.Wait()
		ls.close()
		return err
	}
	errc := ls.serve(stdout)
	var el *eppListener
	if cfg.EPP {
		if el, err = g.listenEPP(cfg); err != nil {
			g.drain(ls.api, 0)
			ls.closeSide()
			stopBG()
			g.Wait()
			return err
		}
		errc = either(errc, el.serve())
		go el.watch(bg)
		go el.watchCert(bg, 2*time.Second)
		fmt.Fprintf(stdout, "baton endpoint picker (ext_proc, gRPC health) on %s\n", el.ln.Addr())
		if el.hln != nil {
			fmt.Fprintf(stdout, "baton endpoint picker health (gRPC, plaintext) on %s\n", el.hln.Addr())
		}
		log.Info("endpoint picker serving", "addr", el.ln.Addr().String(), "fallbacks", cfg.EPPFallbacks, "inference_pool", cfg.InferencePool)
	}
	ls.logStart(cfg, g, log)

	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}
	g.drain(ls.api, cfg.ShutdownGracePeriod)
	if el != nil {
		el.stop(time.Now().Add(time.Second))
	}
	ls.closeSide()
	stopBG()
	g.Wait()
	if serveErr != nil && !errors.Is(serveErr, http.ErrServerClosed) {
		return fmt.Errorf("serve: %w", serveErr)
	}
	log.Info("baton stopped")
	return nil
}

// either is a channel with the first value of a or b.
func either(a, b <-chan error) <-chan error {
	out := make(chan error, 2)
	go func() {
		select {
		case v := <-a:
			out <- v
		case v := <-b:
			out <- v
		}
	}()
	return out
}

// startBackground starts what runs beside the listeners until bg ends: the gateway's own loops
// (health, load, KV events), the configuration watch and service discovery.
func (g *Gateway) startBackground(bg context.Context, cfg config.Config, log *slog.Logger) error {
	if err := g.Start(bg); err != nil {
		return err
	}
	go g.watchReload(bg, 2*time.Second)
	if !cfg.ServiceDiscovery && cfg.InferencePool == "" {
		return nil
	}
	d, err := discovery.New(cfg, g.Fleet, log)
	if err != nil {
		return err
	}
	g.UseDiscovery(d)
	go func() {
		if err := d.Run(bg); err != nil {
			log.Error("service discovery stopped", "err", err)
		}
	}()
	return nil
}

// modelNames are the configuration's models: aliases, fallbacks, the default.
type modelNames struct {
	models map[string]config.ModelConfig
	def    string
}

// discoveryHealth shows the service discovery's API server on the status page and in
// baton_service_discovery_connected.
type discoveryHealth struct {
	d atomic.Pointer[discovery.Discovery]
}

// UseDiscovery shows d's API server on the status page and in the metrics.
func (g *Gateway) UseDiscovery(d *discovery.Discovery) {
	if g.discovery.d.Swap(d) != nil {
		return
	}
	g.Metrics.Registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "baton_service_discovery_connected",
		Help: "1 while service discovery's Kubernetes API server answers; 0 while it does not (the discovered workers stay as they were)."},
		func() float64 {
			if g.discovery.d.Load().Health().Connected {
				return 1
			}
			return 0
		}))
}

func (h *discoveryHealth) notices() []server.Notice {
	d := h.d.Load()
	if d == nil {
		return nil
	}
	hl := d.Health()
	if hl.Connected {
		return nil
	}
	return []server.Notice{{Level: "bad", Text: fmt.Sprintf("Service discovery: the Kubernetes API server has not answered since %s (%s). The %d discovered workers stay as they were: pods that changed meanwhile are not seen until it answers again.",
		hl.Since.UTC().Format(time.RFC3339), hl.Err, hl.Workers)}}
}

// listeners are the gateway's listeners and their servers: the API's, and the metrics' and
// the admin API's when configured. Opened together, closed together.
type listeners struct {
	api                httpServer
	apiLn              net.Listener
	metrics, admin     *http.Server
	metricsLn, adminLn net.Listener
	scheme             string // the API's and the admin API's: http, or https with a certificate
}

// listen opens every listener the configuration asks for, or none: a failure closes those
// already open.
func (g *Gateway) listen(cfg config.Config, log *slog.Logger) (*listeners, error) {
	ls := &listeners{scheme: "http"}
	if g.cert != nil {
		ls.scheme = "https"
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.Port)))
	if err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	if g.cert != nil {
		ln = g.cert.listener(ln)
	}
	var refused func() uint64
	ls.api, ls.apiLn, refused = apiServer(cfg, ln, g.Server.Handler(), log)
	g.Metrics.Registry.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "baton_connections_refused_total",
		Help: "Client connections closed as they arrived because half the descriptor limit were open (the other half is kept for engines)."},
		func() float64 { return float64(refused()) }))
	if cfg.MetricsPort >= 0 {
		if ls.metricsLn, err = net.Listen("tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.MetricsPort))); err != nil {
			ls.close()
			return nil, fmt.Errorf("listen for metrics: %w", err)
		}
		ls.metrics = &http.Server{Handler: g.metricsMux(cfg), ReadHeaderTimeout: 10 * time.Second}
	}
	if cfg.AdminPort >= 0 {
		if ls.adminLn, err = net.Listen("tcp", net.JoinHostPort(cfg.AdminHost, strconv.Itoa(cfg.AdminPort))); err != nil {
			ls.close()
			return nil, fmt.Errorf("listen for the admin API: %w", err)
		}
		if g.cert != nil {
			ls.adminLn = g.cert.listener(ls.adminLn)
		}
		ls.admin = &http.Server{Handler: g.Server.AdminHandler(), ReadHeaderTimeout: 10 * time.Second,
			ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
	}
	return ls, nil
}

// metricsMux serves /metrics, the status page and, when enabled, the profiles.
func (g *Gateway) metricsMux(cfg config.Config) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", g.Metrics.Handler())
	status := g.Server.StatusHandler()
	for _, p := range []string{"GET /{$}", "GET /status", "GET /status.json", "GET /pd/advice"} {
		mux.Handle(p, status)
	}
	if cfg.EnablePprof { // behind the admin key when one is set: profiles show memory contents
		mux.Handle("/debug/pprof/", g.Server.AdminOnly(http.HandlerFunc(pprof.Index)))
		mux.Handle("/debug/pprof/profile", g.Server.AdminOnly(http.HandlerFunc(pprof.Profile)))
		mux.Handle("/debug/pprof/trace", g.Server.AdminOnly(http.HandlerFunc(pprof.Trace)))
	}
	mux.Handle("/", server.NoRoute())
	return mux
}

// close closes the listeners before they serve.
func (ls *listeners) close() {
	for _, l := range []net.Listener{ls.apiLn, ls.metricsLn, ls.adminLn} {
		if l != nil {
			l.Close()
		}
	}
}

// serve serves every listener, says where on stdout, and returns the channel of the first
// server that stops.
func (ls *listeners) serve(stdout io.Writer) <-chan error {
	errc := make(chan error, 3)
	go func() { errc <- ls.api.Serve(ls.apiLn) }()
	if ls.admin != nil {
		go func() { errc <- ls.admin.Serve(ls.adminLn) }()
		fmt.Fprintf(stdout, "baton admin API on %s://%s\n", ls.scheme, ls.adminLn.Addr())
	}
	if ls.metrics != nil {
		go func() { errc <- ls.metrics.Serve(ls.metricsLn) }()
		fmt.Fprintf(stdout, "baton serving on %s://%s (metrics on http://%s/metrics)\n", ls.scheme, ls.apiLn.Addr(), ls.metricsLn.Addr())
	} else {
		fmt.Fprintf(stdout, "baton serving on %s://%s\n", ls.scheme, ls.apiLn.Addr())
	}
	return errc
}

// closeSide closes the metrics and admin servers once the API's drain ended.
func (ls *listeners) closeSide() {
	for _, srv := range []*http.Server{ls.metrics, ls.admin} {
		if srv != nil {
			_ = srv.Close()
		}
	}
}

// logStart says Baton started, with what, and the configuration's warnings.
func (ls *listeners) logStart(cfg config.Config, g *Gateway, log *slog.Logger) {
	server := "baton"
	if _, ok := ls.api.(*http.Server); ok {
		server = "net"
		if cfg.HTTPServer == "baton" {
			log.Warn("http_server baton needs epoll (Linux); serving the API with net/http's server instead")
		}
	}
	attrs := []any{"version", Version(), "addr", ls.apiLn.Addr().String(), "workers", len(g.Registry.Snapshot().Workers), "policy", cfg.Policy}
	if cfg.PDDisaggregation {
		attrs = append(attrs, "prefill_policy", cfg.PolicyFor(config.RolePrefill), "decode_policy", cfg.PolicyFor(config.RoleDecode))
	}
	log.Info("baton started", append(attrs, "http_server", server, "upstream_client", cfg.UpstreamClient)...)
	if d := config.SmgDifferences(cfg); len(d) > 0 {
		log.Info("defaults that differ from smg's are in effect", "settings", strings.Join(d, "; "))
	}
	for _, w := range cfg.Warnings() {
		log.Warn(w)
	}
	logAdmin(log, cfg)
	logTenants(log, cfg, g.tenants)
	switch {
	case cfg.TrustTenantHeader && g.tenants.set.Load().Open():
		log.Warn("tenants are named by the " + cfg.TenantHeaderName + " header (--trust-tenant-header): only a proxy in front that sets or strips it may reach Baton, or any client names any tenant")
	case cfg.TrustTenantHeader:
		log.Warn("the " + cfg.TenantHeaderName + " header is not read (--trust-tenant-header): tenants have keys, and a key names its tenant (as in smg, the header names tenants only where no key does)")
	}
	if g.tenants.set.Load().Open() && !config.IsLoopback(cfg.Host) && !cfg.TrustTenantHeader {
		log.Warn("no client authentication: anyone who reaches "+net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.Port))+" may use the fleet; give --client-api-key or smg's --api-key (or the tenants' keys)",
			"host", cfg.Host)
	}
}

// httpServer is the API listener's server: Baton's own (internal/h1) or net/http's.
type httpServer interface {
	Serve(net.Listener) error
	Shutdown(context.Context) error
	Close() error
}

// apiServer builds the API listener's server, the listener it serves (net/http's server gets
// the client connection bound through it) and the count of connections refused past that
// bound. Neither server has a read or write timeout: they would cut long uploads and long
// streams; the request deadline (request_timeout) and the stalled-client timeout bound
// those instead.
func apiServer(cfg config.Config, ln net.Listener, h http.Handler, log *slog.Logger) (httpServer, net.Listener, func() uint64) {
	header := cfg.ReadHeaderTimeout
	idle := cfg.IdleTimeout
	if cfg.HTTPServer == "baton" && h1.Supported() {
		s := &h1.Server{Handler: h, ReadHeaderTimeout: header, IdleTimeout: idle, Log: log, Refuse: refusal}
		return s, ln, s.Refused.Load
	}
	limited := &h1.LimitListener{Listener: ln, Max: h1.DefaultMaxConns()}
	return &http.Server{Handler: h, ReadHeaderTimeout: header, IdleTimeout: idle, MaxHeaderBytes: h1.DefaultMaxHeaderBytes,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}, limited, limited.Refused.Load
}

// refusalCodes are the error codes of the requests Baton's HTTP/1.1 server refuses.
var refusalCodes = map[h1.RefusalKind]string{
	h1.RefusedRequest:          openai.CodeInvalidRequest,
	h1.RefusedHeadersTooLarge:  openai.CodeHeadersTooLarge,
	h1.RefusedVersion:          openai.CodeHTTPVersionNotSupported,
	h1.RefusedTransferEncoding: openai.CodeUnsupportedTransferEncoding,
	h1.RefusedExpectation:      openai.CodeExpectationFailed,
}

// refusal renders a request Baton's HTTP/1.1 server refuses before any handler in the OpenAI
// error envelope, its code also in X-Baton-Error-Code.
func refusal(r *h1.Refusal) (http.Header, []byte) {
	e := &openai.Error{Status: r.Status, Code: refusalCodes[r.Kind], Message: r.Message}
	return http.Header{"Content-Type": {"application/json"}, openai.HeaderErrorCode: {e.Code}}, e.Marshal()
}

// logAdmin says at startup where the admin API answers and how it is protected.
func logAdmin(log *slog.Logger, cfg config.Config) {
	where, host := "the API listener", cfg.Host
	if cfg.AdminPort >= 0 {
		where, host = "its own listener", cfg.AdminHost
	}
	switch {
	case len(cfg.AdminKeys()) > 0:
		log.Info("admin API (worker routes) on "+where+", behind the admin API key", "host", host)
	case cfg.AdminPort >= 0 && config.IsLoopback(host):
		log.Info("admin API (worker routes) on its own loopback listener, no key", "host", host)
	default:
		log.Info("admin API (worker routes) off (403): without --admin-api-key it answers only on a loopback listener of its own (--admin-host 127.0.0.1 --admin-port N); GET /workers on the API port still answers the API's one client (with tenants, only the admin key)", "host", host)
	}
}

// drain turns readiness to 503 and keeps serving until in-flight requests are done or grace
// passes, then closes the listener and waits for the last handlers.
func (g *Gateway) drain(api httpServer, grace time.Duration) {
	g.Server.SetDraining()
	g.Log.Info("draining", "in_flight", g.Server.InFlight(), "grace", grace)
	deadline := time.Now().Add(grace)
	for g.Server.InFlight() > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline.Add(time.Second))
	defer cancel()
	if err := api.Shutdown(ctx); err != nil {
		g.Log.Warn("drain grace period passed; closing open connections", "in_flight", g.Server.InFlight())
		_ = api.Close()
	}
}

// learnEngineIDs learns a Mooncake prefill's engine ids from its bootstrap server, when none is
// configured; a change is logged.
func learnEngineIDs(log *slog.Logger, cfg config.Config, client *http.Client, w *worker.Worker) {
	if w.Role != config.RolePrefill || w.Runtime() != config.RuntimeVLLM {
		return
	}
	before := w.EngineIDs()
	n, err := pd.LearnEngineIDs(context.Background(), client, w, cfg.KVConnector)
	switch {
	case errors.Is(err, pd.ErrNotMooncake):
		log.Error("the Mooncake prefill's bootstrap address answers as another server: no engine id is learned from it, and its decodes recompute (none-no-engine-id); set bootstrap_port to the engine's VLLM_MOONCAKE_BOOTSTRAP_PORT (8998 may be an SGLang prefill's) or kv_engine_id",
			"worker", w.URL, "err", err)
	case err != nil:
		log.Warn("could not learn the Mooncake engine ids from the prefill's bootstrap server", "worker", w.URL, "err", err)
	case n > 0 && !maps.Equal(before, w.EngineIDs()):
		log.Info("Mooncake engine ids learned from the bootstrap server", "worker", w.URL, "engine_ids", w.EngineIDs())
	}
}

// logConnector makes a vLLM prefill worker's effective KV connector visible at registration,
// and warns when none is configured: its decodes would recompute unless the engine happens to
// return kv_transfer_params.
func logConnector(log *slog.Logger, cfg config.Config, w *worker.Worker) {
	if in := w.Info(); in != nil && in.Runtime == config.RuntimeGeneric && len(in.Models) == 0 {
		log.Warn("worker registered as generic with no model list: it is offered every model; set its runtime (vllm, sglang) and models, or check that /v1/models answers",
			"worker", w.URL, "role", w.Role)
	}
	if in := w.Info(); in != nil && w.DPSize > 1 && in.DPSize > 0 && in.DPSize != w.DPSize {
		log.Warn("configured dp_size differs from the engine's: Baton addresses ranks the engine may not have (400s) or leaves ranks idle; set dp_size to the engine's",
			"worker", w.URL, "dp_size", w.DPSize, "engine_dp_size", in.DPSize)
	}
	if w.Role == config.RoleDecode && w.Runtime() == config.RuntimeSGLang && (cfg.PDLocalPrefillThreshold > 0 || cfg.PDLocalPrefillAuto) {
		log.Warn("SGLang decode worker under pd_local_prefill_threshold: SGLang's decode servers refuse a request without a bootstrap room (they never prefill a prompt themselves), so every request it serves still goes through a prefill",
			"worker", w.URL)
	}
	if w.Role == config.RolePrefill && w.Runtime() == config.RuntimeSGLang && w.BootstrapPort == nil {
		log.Warn("SGLang prefill worker without a bootstrap port: Baton sends bootstrap_port null and the engines use their default (8998); give it (--prefill URL PORT, bootstrap_port, or the sglang.ai/bootstrap-port annotation) if the engine's --disaggregation-bootstrap-port differs",
			"worker", w.URL)
	}
	if w.Role != config.RolePrefill || w.Runtime() != config.RuntimeVLLM {
		return
	}
	c := pd.ConnectorFor(w, cfg.KVConnector)
	switch {
	case c.Name == "":
		log.Warn("vLLM prefill worker has no KV connector configured: passthrough mode, decodes recompute unless the engine returns kv_transfer_params; set kv_connector (NixlConnector or MooncakeConnector) on the worker or --kv-connector",
			"worker", w.URL)
		return
	case c.Mode == pd.ModeMooncake && c.EngineID == "" && len(c.Learned) == 0:
		log.Warn("vLLM Mooncake prefill worker has no engine id, and its bootstrap server told none: every request to it recomputes on the decode (none-no-engine-id); check bootstrap_port (VLLM_MOONCAKE_BOOTSTRAP_PORT) or set kv_engine_id to the engine's kv_transfer_config.engine_id",
			"worker", w.URL, "bootstrap", c.BootstrapAddr)
	}
	log.Info("vLLM prefill worker KV connector", "worker", w.URL, "mode", c.Mode, "detail", c.String())
}

// newTraceWatch is the watch on span export: its losses counted in m, said in log.
func newTraceWatch(m *metrics.Metrics, log *slog.Logger) *tracing.Watch {
	return &tracing.Watch{Log: log, Lost: func(cause string, exports, spans int) {
		m.TraceExportFailures.Add(float64(exports))
		m.TraceSpansLost.WithLabelValues(cause).Add(float64(spans))
	}}
}

// traceNotices are the status page's words on span export: shown while exports fail.
func traceNotices(s tracing.State) []server.Notice {
	if !s.Failing {
		return nil
	}
	return []server.Notice{{Level: "warn", Text: fmt.Sprintf("Trace export to %s failing since %s: %d exports failed, %d spans lost (%d dropped with the queue full) — %s",
		s.Collector, s.FailingSince.UTC().Format(time.RFC3339), s.Failures, s.SpansLost, s.SpansDropped, s.LastError)}}
}

// stdLogBridge carries what the standard library logs (net/http's transport and servers) into
// Baton's log. net/http's "Unsolicited response received on idle HTTP channel" quotes the bytes
// an engine sent unasked — possibly another request's completion — so it is counted and said
// without them.
type stdLogBridge struct {
	log         *slog.Logger
	unsolicited prometheus.Counter
}

func (b stdLogBridge) Write(p []byte) (int, error) {
	line := strings.TrimSpace(string(p))
	if strings.HasPrefix(line, "Unsolicited response received on idle HTTP channel") {
		b.unsolicited.Inc()
		b.log.Warn("an engine sent bytes nobody asked for on an idle connection; the connection was dropped (the bytes are not logged: they may be another request's)")
		return len(p), nil
	}
	b.log.Warn("net/http: " + line)
	return len(p), nil
}

// heapFloor is the collector's heap floor for --gc-heap-floor: at most a quarter of the memory
// limit (the smaller of GOMEMLIMIT and the container's), said at startup — lowered, or not used
// (GOGC=off or 0, or a floor under the runtime's own minimum heap).
func heapFloor(floor int64, log *slog.Logger) int64 {
	limit, from := gcpace.MemoryLimit(gcpace.CgroupLimitFiles...)
	bound := gcpace.Bound(floor, limit)
	p := gcpace.Percent()
	used := bound > gcpace.HeapMinimum*int64(p)/100 // what GOGC alone reaches, it needs no floor for
	switch {
	case floor == 0:
	case p < 0:
		log.Info("gc-heap-floor not used: GOGC=off is the operator's")
	case p == 0:
		log.Info("gc-heap-floor not used: GOGC=0 is the operator's")
	case bound < floor:
		log.Warn("gc-heap-floor lowered to a quarter of the memory limit", "asked_bytes", floor, "floor_bytes", bound, "limit_bytes", limit, "limit_from", from, "used", used)
	case !used:
		log.Info("gc-heap-floor not used: GOGC alone paces the collector past it", "floor_bytes", bound, "gogc", p)
	default:
		log.Info("collector paced with a heap floor (--gc-heap-floor)", "floor_bytes", bound, "gogc", p)
	}
	return bound
}
