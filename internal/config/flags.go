package config

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// ErrHelp is returned by Parse when -h or --help was given; the usage has been written.
var ErrHelp = errors.New("help requested")

// flag is one command line flag. Flags are long, kebab case, smg-compatible: "--name value",
// "--name=value", and for lists "--name v1 v2 ..." (values up to the next "--flag").
type flag struct {
	name string
	arg  string // placeholder in usage; empty for booleans
	list bool
	// optPort: one value, then an optional second one when it is an integer or "none"
	// (--prefill URL [BOOTSTRAP_PORT|none]).
	optPort bool
	help    string
	apply   func(c *Config, vals []string) error
	// def reads the flag's value from a Config, for the usage's "(default ...)"; nil: none shown.
	def func(c *Config) string
}

func strFlag(name, help string, field func(*Config) *string) flag {
	return flag{name: name, arg: "STRING", help: help, def: func(c *Config) string { return *field(c) }, apply: func(c *Config, v []string) error {
		*field(c) = v[0]
		return nil
	}}
}

// selectorFlag is a list of k=v label matches.
func selectorFlag(name, help string, field func(*Config) *map[string]string) flag {
	return flag{name: name, arg: "K=V...", list: true, help: help, apply: func(c *Config, v []string) error {
		m := *field(c)
		if m == nil {
			m = map[string]string{}
		}
		for _, kv := range v {
			k, val, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				return fmt.Errorf("--%s: %q is not key=value", name, kv)
			}
			m[k] = val
		}
		*field(c) = m
		return nil
	}}
}

func intFlag(name, help string, field func(*Config) *int) flag {
	return flag{name: name, arg: "N", help: help, def: func(c *Config) string { return strconv.Itoa(*field(c)) }, apply: func(c *Config, v []string) error {
		n, err := strconv.Atoi(v[0])
		if err != nil {
			return fmt.Errorf("--%s: %q is not an integer", name, v[0])
		}
		*field(c) = n
		return nil
	}}
}

func bytesFlag(name, help string, field func(*Config) *int64) flag {
	return flag{name: name, arg: "BYTES", help: help, def: func(c *Config) string { return strconv.FormatInt(*field(c), 10) }, apply: func(c *Config, v []string) error {
		n, err := strconv.ParseInt(v[0], 10, 64)
		if err != nil {
			return fmt.Errorf("--%s: %q is not an integer", name, v[0])
		}
		*field(c) = n
		return nil
	}}
}

func floatFlag(name, help string, field func(*Config) *float64) flag {
	return flag{name: name, arg: "X", help: help, def: func(c *Config) string { return strconv.FormatFloat(*field(c), 'g', -1, 64) }, apply: func(c *Config, v []string) error {
		f, err := strconv.ParseFloat(v[0], 64)
		if err != nil {
			return fmt.Errorf("--%s: %q is not a number", name, v[0])
		}
		*field(c) = f
		return nil
	}}
}

func boolFlag(name, help string, field func(*Config) *bool) flag {
	return flag{name: name, help: help, apply: func(c *Config, v []string) error {
		if len(v) == 0 {
			*field(c) = true
			return nil
		}
		b, err := strconv.ParseBool(v[0])
		if err != nil {
			return fmt.Errorf("--%s: %q is not a boolean", name, v[0])
		}
		*field(c) = b
		return nil
	}}
}

var serveFlags = []flag{
	{name: "config", arg: "FILE", help: "YAML configuration file (strict: unknown keys are errors); flags override it"},
	strFlag("host", "address to bind", func(c *Config) *string { return &c.Host }),
	intFlag("port", "API port; 0 picks a free port", func(c *Config) *int { return &c.Port }),
	intFlag("metrics-port", "Prometheus /metrics port; 0 picks a free port, -1 disables", func(c *Config) *int { return &c.MetricsPort }),
	{name: "worker-urls", arg: "URL...", list: true, help: "regular workers by URL", apply: func(c *Config, v []string) error {
		c.WorkerURLs = append(c.WorkerURLs, v...)
		return nil
	}},
	strFlag("policy", "worker selection policy: round_robin | random | least_load | power_of_two | prefix_hash | cache_aware", func(c *Config) *string { return &c.Policy }),
	boolFlag("kv-events", "subscribe to every worker's KV events at its kv_events_endpoint or tcp://<host>:5557 (GET /workers shows their health)", func(c *Config) *bool { return &c.KVEvents }),
	strFlag("kv-events-listen", "listen for KV events from engines that connect out (tcp://host:port, * for every interface); each publishes on the topic kv@<ip>:<port>@<model>", func(c *Config) *string { return &c.KVEventsListen }),
	strFlag("cache-aware-source", "where cache_aware learns what engines hold: auto | events (their KV events where subscribed, else approximate) | approx", func(c *Config) *string { return &c.CacheAwareSource }),
	boolFlag("route-header", "add X-Baton-Route to responses: why each worker was chosen (policy, reason, load, cached share)", func(c *Config) *bool { return &c.RouteHeader }),
	floatFlag("cache-threshold", "cache_aware: share of the prompt that must be cached on a worker to follow the cache", func(c *Config) *float64 { return &c.CacheThreshold }),
	floatFlag("balance-abs-threshold", "cache_aware: balance load when the busiest worker has this many more requests than the idlest", func(c *Config) *float64 { return &c.BalanceAbsThreshold }),
	floatFlag("balance-rel-threshold", "cache_aware: … and this many times as many", func(c *Config) *float64 { return &c.BalanceRelThreshold }),
	floatFlag("cache-load-cost", "cache_aware: 64-byte prompt blocks one request of load is worth", func(c *Config) *float64 { return &c.CacheLoadCost }),
	intFlag("eviction-interval-secs", "cache_aware: forget a prefix not routed for this long", func(c *Config) *int { return &c.EvictionIntervalSecs }),
	intFlag("max-tree-size", "cache_aware: bound of the prefix index, in prompt characters", func(c *Config) *int { return &c.MaxTreeSize }),
	intFlag("load-poll-interval-ms", "how often each engine's /metrics is read for its load; older than three intervals is ignored", func(c *Config) *int { return &c.LoadPollIntervalMs }),
	intFlag("prefix-token-count", "prefix_hash: how much of the prompt to hash, in tokens (about 4 characters each)", func(c *Config) *int { return &c.PrefixTokenCount }),
	floatFlag("prefix-hash-load-factor", "prefix_hash: move on along the ring when a worker's load exceeds this times the mean", func(c *Config) *float64 { return &c.PrefixHashLoadFactor }),
	boolFlag("pd-disaggregation", "prefill/decode disaggregation: generation goes to a prefill and a decode worker", func(c *Config) *bool { return &c.PDDisaggregation }),
	{name: "prefill", arg: "URL [BOOTSTRAP_PORT|none]", optPort: true, help: "a prefill worker (repeatable); the bootstrap port SGLang legs name", apply: func(c *Config, v []string) error {
		w := Worker{URL: v[0], Role: RolePrefill}
		if len(v) > 1 && v[1] != "none" {
			n, err := strconv.Atoi(v[1])
			if err != nil {
				return fmt.Errorf("--prefill %s: bootstrap port %q is not an integer", v[0], v[1])
			}
			w.BootstrapPort = &n
		}
		c.Workers = append(c.Workers, w)
		return nil
	}},
	{name: "decode", arg: "URL", help: "a decode worker (repeatable)", apply: func(c *Config, v []string) error {
		c.Workers = append(c.Workers, Worker{URL: v[0], Role: RoleDecode})
		return nil
	}},
	strFlag("kv-connector", "KV connector of vLLM prefill workers that configure none: NixlConnector | MooncakeConnector", func(c *Config) *string { return &c.KVConnector }),
	boolFlag("pd-require-handoff", "strict mode: a PD request whose decode would recompute the prompt fails with 502", func(c *Config) *bool { return &c.PDRequireHandoff }),
	strFlag("pd-mooncake-dispatch", "Mooncake legs: concurrent or sequential", func(c *Config) *string { return &c.PDMooncakeDispatch }),
	strFlag("prefill-policy", "policy for the prefill worker of a pair (default: --policy)", func(c *Config) *string { return &c.PrefillPolicy }),
	strFlag("decode-policy", "policy for the decode worker of a pair (default: --policy)", func(c *Config) *string { return &c.DecodePolicy }),
	intFlag("request-timeout-secs", "bound on one request from arrival to the end of its response, streams included", func(c *Config) *int { return &c.RequestTimeoutSecs }),
	bytesFlag("max-payload-size", "largest request body accepted", func(c *Config) *int64 { return &c.MaxPayloadSize }),
	intFlag("max-batch-size", "largest n, and most prompts in one request; 400 past it", func(c *Config) *int { return &c.MaxBatchSize }),
	intFlag("body-timeout-secs", "a request body must arrive whole within this", func(c *Config) *int { return &c.BodyTimeoutSecs }),
	bytesFlag("max-buffered-body-bytes", "request body bytes held at once over every request (503 past it)", func(c *Config) *int64 { return &c.MaxBufferedBodyBytes }),
	intFlag("stalled-client-timeout-secs", "drop a client that sends no body bytes or accepts no response bytes for this long", func(c *Config) *int { return &c.StalledClientTimeoutSecs }),
	strFlag("api-key", "require 'Authorization: Bearer KEY' on inference routes", func(c *Config) *string { return &c.APIKey }),
	boolFlag("service-discovery", "find workers among Kubernetes pods (see --selector)", func(c *Config) *bool { return &c.ServiceDiscovery }),
	selectorFlag("selector", "pods that are regular workers: k=v labels, all must match", func(c *Config) *map[string]string { return &c.Selector }),
	selectorFlag("prefill-selector", "pods that are prefill workers: k=v labels", func(c *Config) *map[string]string { return &c.PrefillSelector }),
	selectorFlag("decode-selector", "pods that are decode workers: k=v labels", func(c *Config) *map[string]string { return &c.DecodeSelector }),
	strFlag("service-discovery-namespace", "namespace of the worker pods (default: Baton's own)", func(c *Config) *string { return &c.ServiceDiscoveryNamespace }),
	intFlag("service-discovery-port", "port of the workers' API on their pods (the baton.ai/port annotation overrides it)", func(c *Config) *int { return &c.ServiceDiscoveryPort }),
	strFlag("kubeconfig", "kubeconfig for discovery outside the cluster (default: the in-cluster service account)", func(c *Config) *string { return &c.KubeConfig }),
	strFlag("admin-api-key", "require 'Authorization: Bearer KEY' on the admin API (the worker routes); without it the admin API answers only on loopback", func(c *Config) *string { return &c.AdminAPIKey }),
	strFlag("admin-host", "address of the admin API's own listener", func(c *Config) *string { return &c.AdminHost }),
	intFlag("admin-port", "port of the admin API's own listener; -1 serves it on the API port; 0 picks a free one", func(c *Config) *int { return &c.AdminPort }),
	boolFlag("watch-config", "re-read the --config file when it changes (as SIGHUP does): workers added, drained, updated", func(c *Config) *bool { return &c.WatchConfig }),
	strFlag("otlp-traces-endpoint", "send OpenTelemetry traces: http(s)://host:port (OTLP/HTTP) or grpc://host:port (default: the OTEL_EXPORTER_OTLP_* variables, else off)", func(c *Config) *string { return &c.OTLPTracesEndpoint }),
	floatFlag("trace-sample-ratio", "share of new traces sampled (a client's sampled traceparent is followed)", func(c *Config) *float64 { return &c.TraceSampleRatio }),
	boolFlag("access-log", "one info line per request (--access-log=false turns it off)", func(c *Config) *bool { return &c.AccessLog }),
	strFlag("log-level", "debug | info | warn | error", func(c *Config) *string { return &c.LogLevel }),
	boolFlag("log-json", "log JSON lines", func(c *Config) *bool { return &c.LogJSON }),
	boolFlag("forward-sim-faults", "forward a client's X-Sim-Fault header to the workers (tests and demos against simulated engines)", func(c *Config) *bool { return &c.ForwardSimFaults }),
	boolFlag("enable-pprof", "serve /debug/pprof/ on the metrics port", func(c *Config) *bool { return &c.EnablePprof }),
	intFlag("read-header-timeout-secs", "a client must send its request headers within this", func(c *Config) *int { return &c.ReadHeaderTimeoutSecs }),
	strFlag("upstream-client", "HTTP client to the engines: net (Go's net/http transport; drops a connection an engine writes to unasked) or baton (Baton's own, less memory per stream)", func(c *Config) *string { return &c.UpstreamClient }),
	strFlag("http-server", "server of the API listener: baton (Baton's own HTTP/1.1 server; Linux) or net (Go's net/http)", func(c *Config) *string { return &c.HTTPServer }),
	intFlag("idle-timeout-secs", "idle keep-alive client connections are closed after this; streams are never cut", func(c *Config) *int { return &c.IdleTimeoutSecs }),
	intFlag("shutdown-grace-period-secs", "how long in-flight requests may drain on SIGTERM", func(c *Config) *int { return &c.ShutdownGracePeriodSecs }),
	intFlag("retry-max-retries", "attempts in total, the first included", func(c *Config) *int { return &c.Retry.MaxRetries }),
	intFlag("retry-initial-backoff-ms", "wait before the second attempt", func(c *Config) *int { return &c.Retry.InitialBackoffMs }),
	intFlag("retry-max-backoff-ms", "longest wait between attempts", func(c *Config) *int { return &c.Retry.MaxBackoffMs }),
	floatFlag("retry-backoff-multiplier", "growth of the wait per attempt", func(c *Config) *float64 { return &c.Retry.BackoffMultiplier }),
	floatFlag("retry-jitter-factor", "± fraction of randomness in each wait", func(c *Config) *float64 { return &c.Retry.JitterFactor }),
	boolFlag("disable-retries", "one attempt per request", func(c *Config) *bool { return &c.Retry.Disable }),
	intFlag("cb-failure-threshold", "consecutive failures that open a worker's circuit", func(c *Config) *int { return &c.CircuitBreaker.FailureThreshold }),
	intFlag("cb-success-threshold", "successes in half-open that close it", func(c *Config) *int { return &c.CircuitBreaker.SuccessThreshold }),
	intFlag("cb-timeout-duration-secs", "time open before half-open probes", func(c *Config) *int { return &c.CircuitBreaker.TimeoutSecs }),
	boolFlag("disable-circuit-breaker", "never open circuits", func(c *Config) *bool { return &c.CircuitBreaker.Disable }),
	intFlag("health-check-interval-secs", "time between health probes of a worker", func(c *Config) *int { return &c.HealthCheck.IntervalSecs }),
	intFlag("health-check-timeout-secs", "timeout of one health probe", func(c *Config) *int { return &c.HealthCheck.TimeoutSecs }),
	intFlag("health-failure-threshold", "failed probes that take a worker out of rotation", func(c *Config) *int { return &c.HealthCheck.FailureThreshold }),
	intFlag("health-success-threshold", "good probes that bring it back", func(c *Config) *int { return &c.HealthCheck.SuccessThreshold }),
	strFlag("health-check-endpoint", "path probed", func(c *Config) *string { return &c.HealthCheck.Endpoint }),
	boolFlag("disable-health-check", "no active health checks", func(c *Config) *bool { return &c.HealthCheck.Disable }),
	intFlag("max-concurrent-requests", "inference requests served at once; -1 = no limit", func(c *Config) *int { return &c.Admission.MaxConcurrentRequests }),
	intFlag("queue-size", "requests that may wait for a slot", func(c *Config) *int { return &c.Admission.QueueSize }),
	intFlag("queue-timeout-secs", "how long a request may wait for a slot", func(c *Config) *int { return &c.Admission.QueueTimeoutSecs }),
	intFlag("detect-interval-secs", "longest wait between registration attempts for an unreachable worker", func(c *Config) *int { return &c.DetectIntervalSecs }),
}

// Parse builds the serve configuration from defaults, then the --config file if given, then
// the other flags, and validates it. Every flag and validation problem is reported at once.
func Parse(args []string, usage io.Writer) (Config, error) {
	byName := map[string]*flag{}
	for i := range serveFlags {
		byName[serveFlags[i].name] = &serveFlags[i]
	}
	type setting struct {
		f    *flag
		vals []string
	}
	var (
		settings []setting
		errs     []error
		path     string
	)
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "-h" || a == "--help" || a == "-help" {
			writeUsage(usage)
			return Config{}, ErrHelp
		}
		if !strings.HasPrefix(a, "--") {
			errs = append(errs, fmt.Errorf("unexpected argument %q", a))
			continue
		}
		name, val, hasVal := strings.Cut(a[2:], "=")
		f, ok := byName[name]
		if !ok {
			errs = append(errs, fmt.Errorf("unknown flag --%s", name))
			continue
		}
		var vals []string
		switch {
		case hasVal:
			vals = []string{val}
		case f.arg == "": // boolean without a value
		case f.list:
			for i+1 < len(args) && !strings.HasPrefix(args[i+1], "--") {
				i++
				vals = append(vals, args[i])
			}
			if len(vals) == 0 {
				errs = append(errs, fmt.Errorf("--%s needs at least one value", name))
				continue
			}
		default:
			if i+1 >= len(args) {
				errs = append(errs, fmt.Errorf("--%s needs a value", name))
				continue
			}
			i++
			vals = []string{args[i]}
			if f.optPort && i+1 < len(args) && isPortArg(args[i+1]) {
				i++
				vals = append(vals, args[i])
			}
		}
		if name == "config" {
			path = vals[0]
			continue
		}
		settings = append(settings, setting{f, vals})
	}
	cfg := Default()
	cfg.Args, cfg.File = slices.Clone(args), path
	if path != "" {
		if err := cfg.LoadFile(path); err != nil {
			errs = append(errs, err)
		}
	}
	for _, s := range settings {
		if err := s.f.apply(&cfg, s.vals); err != nil {
			errs = append(errs, err)
		}
	}
	if err := cfg.Validate(); err != nil {
		errs = append(errs, err)
	}
	return cfg, errors.Join(errs...)
}

func writeUsage(w io.Writer) {
	fmt.Fprintln(w, "usage: baton [serve|check] [flags]   (check: send every PD pair one request, report its handoff)")
	fmt.Fprintln(w, "       baton sim|demo|bench [flags]  (see 'baton sim --help')")
	fmt.Fprintln(w, "       baton version")
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	d := Default()
	for _, f := range serveFlags {
		help := f.help
		if f.def != nil {
			if v := f.def(&d); v != "" && v != "0" {
				help += " (default " + v + ")"
			}
		}
		fmt.Fprintf(tw, "  --%s %s\t%s\n", f.name, f.arg, help)
	}
	_ = tw.Flush()
}

func isPortArg(s string) bool {
	if s == "none" {
		return true
	}
	_, err := strconv.Atoi(s)
	return err == nil
}
