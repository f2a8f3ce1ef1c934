// Package config holds Baton's one configuration tree: defaults, YAML loading (strict), command
// line flags and validation that reports every problem at once.
package config

import (
	"cmp"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"

	"sigs.k8s.io/yaml"
)

// Worker roles.
const (
	RoleRegular = "regular"
	RolePrefill = "prefill"
	RoleDecode  = "decode"
)

// Worker runtimes. The empty runtime means "detect at registration".
const (
	RuntimeVLLM    = "vllm"
	RuntimeSGLang  = "sglang"
	RuntimeGeneric = "generic"
)

// Policy names.
const (
	PolicyRoundRobin = "round_robin"
	PolicyRandom     = "random"
	PolicyLeastLoad  = "least_load"
	PolicyPowerOfTwo = "power_of_two"
	PolicyPrefixHash = "prefix_hash"
	PolicyCacheAware = "cache_aware"
)

// Policies are the selection policies Baton knows.
var Policies = []string{PolicyRoundRobin, PolicyRandom, PolicyLeastLoad, PolicyPowerOfTwo, PolicyPrefixHash, PolicyCacheAware}

// Config is the whole of Baton's configuration. Every field has a YAML key and most a flag of
// the same name in kebab case.
type Config struct {
	// Host is the address the API server binds. Default "0.0.0.0".
	Host string `json:"host"`
	// Port is the API server's port. Default 30000; 0 picks a free port.
	Port int `json:"port"`
	// MetricsPort is the Prometheus /metrics port. Default 29000; 0 picks a free port; -1 disables.
	MetricsPort int `json:"metrics_port"`
	// WorkerURLs are regular workers given by URL only (the --worker-urls flag).
	WorkerURLs []string `json:"worker_urls"`
	// Workers are workers with full settings.
	Workers []Worker `json:"workers"`
	// Policy selects a worker among those serving a request's model: round_robin, random,
	// least_load, power_of_two, prefix_hash or cache_aware. Default "round_robin".
	Policy string `json:"policy"`
	// KVEvents subscribes to every worker's KV events (vLLM/SGLang ZMQ publishers), at its
	// kv_events_endpoint or tcp://<worker host>:5557. Off by default; a worker with an explicit
	// kv_events_endpoint is subscribed to either way.
	KVEvents bool `json:"kv_events"`
	// KVEventsListen is a ZMQ address (tcp://host:port, "*" for every interface) where Baton
	// listens for engines that publish KV events by connecting out; each names itself by its
	// topic kv@<ip>:<port>@<model>. Empty: no listener.
	KVEventsListen string `json:"kv_events_listen"`
	// CacheAwareSource is where cache_aware learns what engines hold: auto (their KV events,
	// for the workers Baton subscribes to and prompts it can tokenize, else its approximate
	// index), events (the same), approx (its approximate index only). Default "auto".
	CacheAwareSource string `json:"cache_aware_source"`
	// RouteHeader adds X-Baton-Route to responses: why each worker was chosen (policy, reason,
	// its load, the share of the prompt found cached). Off by default.
	RouteHeader bool `json:"route_header"`
	// CacheThreshold is the share of a prompt cache_aware must find cached on some worker to
	// follow the cache; below it, the load decides. Default 0.3.
	CacheThreshold float64 `json:"cache_threshold"`
	// BalanceAbsThreshold and BalanceRelThreshold: when the busiest worker is above the absolute
	// and the relative bound of the idlest, cache_aware balances load instead. Defaults 64, 1.5.
	BalanceAbsThreshold float64 `json:"balance_abs_threshold"`
	BalanceRelThreshold float64 `json:"balance_rel_threshold"`
	// CacheLoadCost is how many 64-byte prompt blocks one request of load costs cache_aware: the
	// higher, the sooner a hot prefix spreads from a busy worker. Default 16.
	CacheLoadCost float64 `json:"cache_load_cost"`
	// EvictionIntervalSecs: cache_aware forgets a prefix not routed for this long. Default 120.
	EvictionIntervalSecs int `json:"eviction_interval_secs"`
	// MaxTreeSize bounds cache_aware's index, in prompt characters (64 per block). Default
	// 16777216 (262,144 blocks, about 40 MB).
	MaxTreeSize int `json:"max_tree_size"`
	// LoadPollIntervalMs is how often each engine's /metrics is read for its load (running,
	// waiting, KV usage); a reading older than three intervals is ignored. Default 500.
	LoadPollIntervalMs int `json:"load_poll_interval_ms"`
	// PrefixTokenCount is how much of a prompt prefix_hash hashes, in tokens (about four
	// characters each). Default 256.
	PrefixTokenCount int `json:"prefix_token_count"`
	// PrefixHashLoadFactor lets prefix_hash leave a prefix's worker for the next one on its ring
	// when that worker's load exceeds this many times the mean. Default 1.25.
	PrefixHashLoadFactor float64 `json:"prefix_hash_load_factor"`
	// PDDisaggregation turns on prefill/decode disaggregation: generation routes go to a
	// prefill worker and a decode worker at once.
	PDDisaggregation bool `json:"pd_disaggregation"`
	// PrefillPolicy selects the prefill worker of a pair; empty means Policy.
	PrefillPolicy string `json:"prefill_policy"`
	// DecodePolicy selects the decode worker of a pair; empty means Policy.
	DecodePolicy string `json:"decode_policy"`
	// KVConnector is the KV connector of vLLM prefill workers that configure none.
	KVConnector string `json:"kv_connector"`
	// PDRequireHandoff turns a PD request whose decode would recompute the prompt (no KV
	// handoff) into a 502 instead of a silent fallback.
	PDRequireHandoff bool `json:"pd_require_handoff"`
	// PDMooncakeDispatch is how Mooncake legs are sent: concurrent (both at once, the decode
	// waits for the KV) or sequential (prefill first). Default concurrent.
	PDMooncakeDispatch string `json:"pd_mooncake_dispatch"`
	// RequestTimeoutSecs bounds one request from its arrival to the end of its response, streams
	// and writes to the client included; past it the client gets 504 (or, mid-stream, a broken
	// connection). Default 1800.
	RequestTimeoutSecs int `json:"request_timeout_secs"`
	// MaxPayloadSize is the largest request body accepted, in bytes. Default 32 MiB: a
	// million-token context is about 4 MB of text, and a few base64 images fit beside it;
	// prompt_embeds tensors or larger batches need it raised.
	MaxPayloadSize int64 `json:"max_payload_size"`
	// MaxBufferedBodyBytes bounds the request body bytes Baton holds at once, over every
	// request: past it a body still arriving is refused with 503 before more of it is read.
	// Default 256 MiB.
	MaxBufferedBodyBytes int64 `json:"max_buffered_body_bytes"`
	// BodyTimeoutSecs bounds how long a request body may take to arrive in all (a trickle of
	// bytes each inside the stalled-client timeout keeps no buffer longer). Default 120.
	BodyTimeoutSecs int `json:"body_timeout_secs"`
	// MaxBatchSize bounds "n" and the number of prompts in one request (a /generate or
	// /v1/completions list); past it the request is refused with 400. Default 1024.
	MaxBatchSize int `json:"max_batch_size"`
	// StalledClientTimeoutSecs drops a client that sends no request body bytes, or accepts no
	// response bytes, for this long. Default 60.
	StalledClientTimeoutSecs int `json:"stalled_client_timeout_secs"`
	// APIKey, when set, is required as "Authorization: Bearer <key>" on inference routes.
	APIKey string `json:"api_key"`
	// ServiceDiscovery finds workers among the Kubernetes pods of ServiceDiscoveryNamespace
	// (default: Baton's own namespace) that match Selector (regular workers), PrefillSelector
	// or DecodeSelector (PD roles), at ServiceDiscoveryPort (default 8000). KubeConfig, when
	// set, is used instead of the in-cluster service account.
	ServiceDiscovery          bool              `json:"service_discovery"`
	Selector                  map[string]string `json:"selector"`
	PrefillSelector           map[string]string `json:"prefill_selector"`
	DecodeSelector            map[string]string `json:"decode_selector"`
	ServiceDiscoveryNamespace string            `json:"service_discovery_namespace"`
	ServiceDiscoveryPort      int               `json:"service_discovery_port"`
	KubeConfig                string            `json:"kubeconfig"`
	// AdminAPIKey, when set, is required as "Authorization: Bearer <key>" on the admin API (the
	// worker routes); it is not the inference key. Without it the admin API answers only on a
	// loopback listener.
	AdminAPIKey string `json:"admin_api_key"`
	// AdminHost and AdminPort are the admin API's own listener; AdminPort -1 (the default)
	// serves the admin API on the API listener instead. Default host 127.0.0.1.
	AdminHost string `json:"admin_host"`
	AdminPort int    `json:"admin_port"`
	// WatchConfig re-reads the configuration file when it changes (as on SIGHUP), checking
	// every 2 s.
	WatchConfig bool `json:"watch_config"`
	// OTLPTracesEndpoint sends OpenTelemetry traces to a collector: http(s)://host:port for
	// OTLP/HTTP, grpc://host:port for OTLP/gRPC. Empty: the OTEL_EXPORTER_OTLP_* variables, or
	// no tracing. TraceSampleRatio is the share of new traces kept (default 1).
	OTLPTracesEndpoint string  `json:"otlp_traces_endpoint"`
	TraceSampleRatio   float64 `json:"trace_sample_ratio"`
	// AccessLog writes one info line per request (default on).
	AccessLog bool `json:"access_log"`
	// Args are the command-line arguments the configuration was parsed from (a reload parses
	// them again, re-reading the file they name).
	Args []string `json:"-"`
	// File is the --config file, "" for none; FileSum the SHA-256 of the content it was read
	// with.
	File    string `json:"-"`
	FileSum []byte `json:"-"`
	// LogLevel is debug, info, warn or error. Default "info".
	LogLevel string `json:"log_level"`
	// LogJSON writes logs as JSON lines instead of text.
	LogJSON bool `json:"log_json"`
	// EnablePprof serves Go's /debug/pprof/ on the metrics port, for profiling in place.
	EnablePprof bool `json:"enable_pprof"`
	// ForwardSimFaults forwards a client's X-Sim-Fault header to the workers, so that a test or
	// a demo can inject faults into simulated engines through the gateway. Off by default: a
	// client's headers are otherwise an allowlist.
	ForwardSimFaults bool `json:"forward_sim_faults"`
	// ReadHeaderTimeoutSecs bounds how long a client may take to send request headers; a slow
	// or stuck client is disconnected. Default 30.
	ReadHeaderTimeoutSecs int `json:"read_header_timeout_secs"`
	// IdleTimeoutSecs closes a client's keep-alive connection idle this long between requests.
	// It never cuts a request or a stream in progress. Default 120.
	IdleTimeoutSecs int `json:"idle_timeout_secs"`
	// HTTPServer is the server of the API listener: baton (Baton's own HTTP/1.1 server, less
	// CPU per request and memory per open stream; Linux only, elsewhere net is used) or net
	// (Go's net/http server). Default baton.
	HTTPServer string `json:"http_server"`
	// UpstreamClient is the HTTP client to the engines: net (Go's net/http transport, which
	// watches idle connections and drops one an engine writes to unasked) or baton (Baton's own
	// HTTP/1.1 client, less memory per open stream; it reuses a connection without watching it,
	// so stray bytes from a misbehaving engine or proxy could become another request's answer).
	// Default net.
	UpstreamClient string `json:"upstream_client"`
	// ShutdownGracePeriodSecs bounds how long in-flight requests may drain after SIGTERM.
	// Default 180.
	ShutdownGracePeriodSecs int `json:"shutdown_grace_period_secs"`
	// DetectIntervalSecs is the longest wait between registration attempts for a worker that
	// is not reachable yet. Default 10.
	DetectIntervalSecs int `json:"detect_interval_secs"`

	Retry          Retry          `json:"retry"`
	CircuitBreaker CircuitBreaker `json:"circuit_breaker"`
	HealthCheck    HealthCheck    `json:"health_check"`
	Admission      Admission      `json:"admission"`
	PairHealth     PairHealth     `json:"pair_health"`
}

// Retry is how a failed request is retried: on 408/429/500/502/503/504 and transport errors,
// before any byte reached the client, re-selecting the worker (PD: the pair) each time.
type Retry struct {
	// MaxRetries is the number of attempts in total, the first included. Default 5.
	MaxRetries int `json:"max_retries"`
	// InitialBackoffMs is the wait before the second attempt. Default 50.
	InitialBackoffMs int `json:"initial_backoff_ms"`
	// MaxBackoffMs caps a wait. Default 30000.
	MaxBackoffMs int `json:"max_backoff_ms"`
	// BackoffMultiplier grows the wait after each attempt. Default 1.5.
	BackoffMultiplier float64 `json:"backoff_multiplier"`
	// JitterFactor randomises each wait by ± this fraction. Default 0.2.
	JitterFactor float64 `json:"jitter_factor"`
	// Disable turns retries off (one attempt).
	Disable bool `json:"disable"`
}

// CircuitBreaker takes a failing worker out of rotation: open after FailureThreshold
// consecutive failures, half-open after TimeoutSecs (a few probe requests), closed after
// SuccessThreshold successes. 429 is no failure; client cancellations never count.
type CircuitBreaker struct {
	FailureThreshold int  `json:"failure_threshold"`     // default 10
	SuccessThreshold int  `json:"success_threshold"`     // default 3
	TimeoutSecs      int  `json:"timeout_duration_secs"` // default 60
	Disable          bool `json:"disable"`
}

// HealthCheck probes every worker periodically; workers leave and rejoin rotation on their own.
type HealthCheck struct {
	IntervalSecs     int    `json:"interval_secs"`     // default 60
	TimeoutSecs      int    `json:"timeout_secs"`      // default 5
	FailureThreshold int    `json:"failure_threshold"` // consecutive failures to leave rotation; default 3
	SuccessThreshold int    `json:"success_threshold"` // consecutive successes to rejoin; default 2
	Endpoint         string `json:"endpoint"`          // default /health
	Disable          bool   `json:"disable"`
}

// Admission bounds the requests Baton serves at once; beyond the queue it answers 503 with
// Retry-After.
type Admission struct {
	// MaxConcurrentRequests is the number of inference requests served at once; -1 or 0 means
	// no limit. Default -1.
	MaxConcurrentRequests int `json:"max_concurrent_requests"`
	// QueueSize is how many more may wait for a slot. Default 100.
	QueueSize int `json:"queue_size"`
	// QueueTimeoutSecs is how long one may wait. Default 60.
	QueueTimeoutSecs int `json:"queue_timeout_secs"`
}

// PairHealth quarantines a prefill/decode pair whose requests keep failing at the seam while
// each worker looks healthy on its own; other pairs are preferred meanwhile.
type PairHealth struct {
	FailureThreshold int `json:"failure_threshold"` // consecutive failures; default 3
	QuarantineSecs   int `json:"quarantine_secs"`   // default 30
}

// Worker is one inference engine Baton routes to.
type Worker struct {
	// URL is the engine's base URL, e.g. http://10.0.0.5:8000. Required.
	URL string `json:"url"`
	// Role is regular, prefill or decode. Default regular.
	Role string `json:"role,omitempty"`
	// Runtime is vllm, sglang or generic; empty means detect from the engine.
	Runtime string `json:"runtime,omitempty"`
	// Models the engine serves; empty means read them from the engine's /v1/models.
	Models []string `json:"models,omitempty"`
	// Labels are free-form key/value pairs.
	Labels map[string]string `json:"labels,omitempty"`
	// APIKey is sent to this worker as its bearer token instead of the client's.
	APIKey string `json:"api_key,omitempty"`
	// BootstrapPort is a prefill worker's bootstrap server port (SGLang); absent or null sends
	// bootstrap_port null, and the engines use their own default.
	BootstrapPort *int `json:"bootstrap_port,omitempty"`
	// DPSize is the worker's data parallel size; above 1 Baton picks a rank for each leg.
	DPSize int `json:"dp_size,omitempty"`
	// KVConnector is a vLLM prefill worker's KV connector, by vLLM's name or the short form,
	// any case: NixlConnector (nixl), MooncakeConnector (mooncake), or another vLLM connector
	// (passthrough). Empty uses the kv_connector label, then the global default.
	KVConnector string `json:"kv_connector,omitempty"`
	// KVEngineID is the vLLM engine id (kv_transfer_config.engine_id) Mooncake handoffs name;
	// with dp_size > 1 Baton appends _dp{rank}. Empty uses the kv_engine_id label.
	KVEngineID string `json:"kv_engine_id,omitempty"`
	// KVEventsEndpoint is the engine's KV events publisher (tcp://host:port) Baton subscribes
	// to; empty uses the kv_events_endpoint label, then, with kv_events on, tcp://<host>:5557.
	KVEventsEndpoint string `json:"kv_events_endpoint,omitempty"`
	// KVEventsReplayEndpoint is the engine's replay endpoint (vLLM replay_endpoint,
	// tcp://host:port): lost events are fetched from it instead of forgetting the worker. Empty
	// uses the kv_events_replay_endpoint label; none means a gap forgets the worker's blocks.
	KVEventsReplayEndpoint string `json:"kv_events_replay_endpoint,omitempty"`
}

// Default returns the configuration with every default filled in.
func Default() Config {
	return Config{
		Host:                     "0.0.0.0",
		Port:                     30000,
		MetricsPort:              29000,
		Policy:                   PolicyRoundRobin,
		PrefixTokenCount:         256,
		LoadPollIntervalMs:       500,
		CacheThreshold:           0.3,
		CacheAwareSource:         "auto",
		AdminHost:                "127.0.0.1",
		ServiceDiscoveryPort:     8000,
		TraceSampleRatio:         1,
		AccessLog:                true,
		AdminPort:                -1,
		BalanceAbsThreshold:      64,
		BalanceRelThreshold:      1.5,
		CacheLoadCost:            16,
		EvictionIntervalSecs:     120,
		MaxTreeSize:              16 << 20,
		PrefixHashLoadFactor:     1.25,
		RequestTimeoutSecs:       1800,
		MaxPayloadSize:           32 << 20,
		MaxBufferedBodyBytes:     256 << 20,
		BodyTimeoutSecs:          120,
		MaxBatchSize:             1024,
		StalledClientTimeoutSecs: 60,
		LogLevel:                 "info",
		ShutdownGracePeriodSecs:  180,
		ReadHeaderTimeoutSecs:    30,
		IdleTimeoutSecs:          120,
		PDMooncakeDispatch:       "concurrent",
		HTTPServer:               "baton",
		UpstreamClient:           "net",
		Retry:                    Retry{MaxRetries: 5, InitialBackoffMs: 50, MaxBackoffMs: 30000, BackoffMultiplier: 1.5, JitterFactor: 0.2},
		CircuitBreaker:           CircuitBreaker{FailureThreshold: 10, SuccessThreshold: 3, TimeoutSecs: 60},
		HealthCheck:              HealthCheck{IntervalSecs: 60, TimeoutSecs: 5, FailureThreshold: 3, SuccessThreshold: 2, Endpoint: "/health"},
		Admission:                Admission{MaxConcurrentRequests: -1, QueueSize: 100, QueueTimeoutSecs: 60},
		PairHealth:               PairHealth{FailureThreshold: 3, QuarantineSecs: 30},
		DetectIntervalSecs:       10,
	}
}

// LoadFile reads a YAML (or JSON) file into c, strictly: every unknown key and every value of
// the wrong kind is reported at once, with its path and line. Keys absent from the file keep
// c's values.
func (c *Config) LoadFile(path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	sum := sha256.Sum256(data)
	c.FileSum = sum[:]
	if problems := yamlProblems(data, c); len(problems) > 0 {
		return fmt.Errorf("config %s: %s", path, strings.Join(problems, "; "))
	}
	if err := yaml.UnmarshalStrict(data, c); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	return nil
}

// PolicyFor returns the policy name for workers of role.
func (c *Config) PolicyFor(role string) string {
	switch {
	case role == RolePrefill && c.PrefillPolicy != "":
		return c.PrefillPolicy
	case role == RoleDecode && c.DecodePolicy != "":
		return c.DecodePolicy
	}
	return c.Policy
}

// AllWorkers returns Workers followed by a regular worker for each of WorkerURLs.
func (c *Config) AllWorkers() []Worker {
	out := slices.Clone(c.Workers)
	for _, u := range c.WorkerURLs {
		out = append(out, Worker{URL: u, Role: RoleRegular})
	}
	return out
}

// Validate reports every problem in c at once, joined.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Port < 0 || c.Port > 65535 {
		bad("port %d is out of range 0-65535", c.Port)
	}
	if c.MetricsPort < -1 || c.MetricsPort > 65535 {
		bad("metrics_port %d is out of range -1-65535", c.MetricsPort)
	}
	if c.ServiceDiscovery {
		if len(c.Selector)+len(c.PrefillSelector)+len(c.DecodeSelector) == 0 {
			bad("service_discovery needs a selector, prefill_selector or decode_selector")
		}
		if (len(c.PrefillSelector) > 0 || len(c.DecodeSelector) > 0) && !c.PDDisaggregation {
			bad("prefill_selector and decode_selector need pd_disaggregation")
		}
		if c.ServiceDiscoveryPort < 1 || c.ServiceDiscoveryPort > 65535 {
			bad("service_discovery_port %d is out of range 1-65535", c.ServiceDiscoveryPort)
		}
	}
	if c.TraceSampleRatio < 0 || c.TraceSampleRatio > 1 {
		bad("trace_sample_ratio %v is out of range 0-1", c.TraceSampleRatio)
	}
	if c.AdminPort < -1 || c.AdminPort > 65535 {
		bad("admin_port %d is out of range -1-65535", c.AdminPort)
	}
	if c.AdminPort > 0 && (c.AdminPort == c.Port || c.AdminPort == c.MetricsPort) {
		bad("admin_port %d must differ from port and metrics_port", c.AdminPort)
	}
	if c.AdminAPIKey != "" && c.AdminAPIKey == c.APIKey {
		bad("admin_api_key must differ from api_key: a client with the inference key would control the fleet")
	}
	if c.MetricsPort > 0 && c.MetricsPort == c.Port {
		bad("metrics_port %d must differ from port", c.MetricsPort)
	}
	for _, p := range []struct{ key, val string }{{"policy", c.Policy}, {"prefill_policy", c.PrefillPolicy}, {"decode_policy", c.DecodePolicy}} {
		if (p.val != "" || p.key == "policy") && !slices.Contains(Policies, p.val) {
			bad("%s %q is unknown (want one of %s)", p.key, p.val, strings.Join(Policies, ", "))
		}
	}
	if _, _, err := ResolveKVConnector(c.KVConnector); err != nil {
		bad("%v", err)
	}
	if c.UpstreamClient != "baton" && c.UpstreamClient != "net" {
		bad("upstream_client %q is unknown (want net or baton)", c.UpstreamClient)
	}
	if c.HTTPServer != "baton" && c.HTTPServer != "net" {
		bad("http_server %q is unknown (want baton or net)", c.HTTPServer)
	}
	if c.PDMooncakeDispatch != "concurrent" && c.PDMooncakeDispatch != "sequential" {
		bad("pd_mooncake_dispatch %q is unknown (want concurrent or sequential)", c.PDMooncakeDispatch)
	}
	if c.RequestTimeoutSecs <= 0 {
		bad("request_timeout_secs must be positive, got %d", c.RequestTimeoutSecs)
	}
	if c.MaxBufferedBodyBytes/2 < c.MaxPayloadSize {
		bad("max_buffered_body_bytes %d is below twice max_payload_size %d: a body's buffer grows by doubling, so a body of the largest size holds up to twice its size while it arrives, and none could", c.MaxBufferedBodyBytes, c.MaxPayloadSize)
	}
	if c.BodyTimeoutSecs <= 0 {
		bad("body_timeout_secs must be positive, got %d", c.BodyTimeoutSecs)
	}
	if c.MaxPayloadSize <= 0 {
		bad("max_payload_size must be positive, got %d", c.MaxPayloadSize)
	}
	if c.CacheThreshold < 0 || c.CacheThreshold > 1 || c.BalanceAbsThreshold < 0 || c.BalanceRelThreshold < 1 || c.CacheLoadCost < 0 ||
		c.EvictionIntervalSecs <= 0 || c.MaxTreeSize < 64 {
		bad("cache_aware: want cache_threshold in [0,1], balance_abs_threshold >= 0, balance_rel_threshold >= 1, cache_load_cost >= 0, eviction_interval_secs > 0, max_tree_size >= 64")
	}
	if c.KVEventsListen != "" {
		if err := CheckKVEventsListen(c.KVEventsListen); err != nil {
			bad("kv_events_listen: %v", err)
		}
	}
	if !slices.Contains([]string{"auto", "events", "approx"}, c.CacheAwareSource) {
		bad("cache_aware_source %q is unknown (want auto, events or approx)", c.CacheAwareSource)
	}
	if c.LoadPollIntervalMs < 10 || c.LoadPollIntervalMs > 60000 {
		bad("load_poll_interval_ms must be within 10-60000, got %d", c.LoadPollIntervalMs)
	}
	if c.PrefixTokenCount < 1 || c.PrefixHashLoadFactor < 1 {
		bad("prefix_token_count must be at least 1 and prefix_hash_load_factor at least 1, got %d and %v", c.PrefixTokenCount, c.PrefixHashLoadFactor)
	}
	if c.MaxBatchSize < 1 {
		bad("max_batch_size must be at least 1, got %d", c.MaxBatchSize)
	}
	if c.StalledClientTimeoutSecs <= 0 {
		bad("stalled_client_timeout_secs must be positive, got %d", c.StalledClientTimeoutSecs)
	}
	if !slices.Contains([]string{"debug", "info", "warn", "error"}, strings.ToLower(c.LogLevel)) {
		bad("log_level %q is unknown (want debug, info, warn or error)", c.LogLevel)
	}
	if c.ReadHeaderTimeoutSecs <= 0 || c.IdleTimeoutSecs <= 0 {
		bad("read_header_timeout_secs and idle_timeout_secs must be positive, got %d and %d", c.ReadHeaderTimeoutSecs, c.IdleTimeoutSecs)
	}
	if c.ShutdownGracePeriodSecs < 0 {
		bad("shutdown_grace_period_secs must not be negative, got %d", c.ShutdownGracePeriodSecs)
	}
	if c.DetectIntervalSecs <= 0 {
		bad("detect_interval_secs must be positive, got %d", c.DetectIntervalSecs)
	}
	if r := c.Retry; r.MaxRetries < 1 || r.InitialBackoffMs <= 0 || r.MaxBackoffMs < r.InitialBackoffMs || r.BackoffMultiplier < 1 || r.JitterFactor < 0 || r.JitterFactor > 1 {
		bad("retry: want max_retries >= 1, initial_backoff_ms > 0, max_backoff_ms >= initial_backoff_ms, backoff_multiplier >= 1, jitter_factor in [0,1]; got %+v", r)
	}
	if b := c.CircuitBreaker; b.FailureThreshold < 1 || b.SuccessThreshold < 1 || b.TimeoutSecs <= 0 {
		bad("circuit_breaker: want failure_threshold >= 1, success_threshold >= 1, timeout_duration_secs > 0; got %+v", b)
	}
	if h := c.HealthCheck; h.IntervalSecs <= 0 || h.TimeoutSecs <= 0 || h.FailureThreshold < 1 || h.SuccessThreshold < 1 || !strings.HasPrefix(h.Endpoint, "/") {
		bad("health_check: want interval_secs > 0, timeout_secs > 0, thresholds >= 1, endpoint starting with /; got %+v", h)
	}
	if a := c.Admission; a.QueueSize < 0 || a.QueueTimeoutSecs <= 0 {
		bad("admission: want queue_size >= 0 and queue_timeout_secs > 0; got %+v", a)
	}
	if p := c.PairHealth; p.FailureThreshold < 1 || p.QuarantineSecs < 0 {
		bad("pair_health: want failure_threshold >= 1 and quarantine_secs >= 0; got %+v", p)
	}
	seen := map[string]bool{}
	for i, w := range c.AllWorkers() {
		where := fmt.Sprintf("worker %d (%s)", i, RedactURL(w.URL))
		if seen[w.URL] {
			bad("%s: URL is listed twice", where)
		}
		seen[w.URL] = true
		if err := c.CheckWorker(w); err != nil {
			for _, e := range unjoin(err) {
				bad("%s: %v", where, e)
			}
		}
	}
	errs = append(errs, c.checkPairs()...)
	return errors.Join(errs...)
}

// IsLoopback reports whether host (a listen address's host) accepts loopback connections only.
func IsLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// CheckWorker reports every problem of one worker's settings under c (joined): at startup, and
// for workers added or changed at run time.
func (c *Config) CheckWorker(w Worker) error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if err := CheckWorkerURL(w.URL); err != nil {
		bad("%v", err)
	}
	if !slices.Contains([]string{"", RoleRegular, RolePrefill, RoleDecode}, w.Role) {
		bad("role %q is unknown (want regular, prefill or decode)", w.Role)
	}
	if !slices.Contains([]string{"", RuntimeVLLM, RuntimeSGLang, RuntimeGeneric}, w.Runtime) {
		bad("runtime %q is unknown (want vllm, sglang or generic)", w.Runtime)
	}
	for _, m := range w.Models {
		if m == "" {
			bad("empty model name")
		}
	}
	if (w.Role == RolePrefill || w.Role == RoleDecode) && !c.PDDisaggregation {
		bad("role %s needs pd_disaggregation", w.Role)
	}
	if w.BootstrapPort != nil && (*w.BootstrapPort < 1 || *w.BootstrapPort > 65535) {
		bad("bootstrap_port %d is out of range 1-65535", *w.BootstrapPort)
	}
	if w.DPSize < 0 || w.DPSize > MaxDPSize {
		bad("dp_size %d is out of range 0-%d", w.DPSize, MaxDPSize)
	}
	for _, name := range []string{w.KVConnector, w.Labels["kv_connector"]} {
		if _, _, err := ResolveKVConnector(name); err != nil {
			bad("%v", err)
		}
	}
	for _, ep := range []string{w.KVEventsEndpoint, w.Labels["kv_events_endpoint"], w.KVEventsReplayEndpoint, w.Labels["kv_events_replay_endpoint"]} {
		if err := CheckKVEventsEndpoint(ep); ep != "" && err != nil {
			bad("kv events endpoint: %v", err)
		}
	}
	return errors.Join(errs...)
}

// ErrInvalidWorker wraps what is wrong with a worker's settings.
var ErrInvalidWorker = errors.New("invalid worker")

// WorkerPatch is what a worker update may change (the admin API's PATCH); nil fields stay.
type WorkerPatch struct {
	Labels                 map[string]string `json:"labels"`
	APIKey                 *string           `json:"api_key"`
	KVConnector            *string           `json:"kv_connector"`
	KVEngineID             *string           `json:"kv_engine_id"`
	DPSize                 *int              `json:"dp_size"`
	BootstrapPort          *int              `json:"bootstrap_port"`
	KVEventsEndpoint       *string           `json:"kv_events_endpoint"`
	KVEventsReplayEndpoint *string           `json:"kv_events_replay_endpoint"`
}

// Apply returns w with p's fields set.
func (p WorkerPatch) Apply(w Worker) Worker {
	if p.Labels != nil {
		w.Labels = maps.Clone(p.Labels)
	}
	for _, f := range []struct{ dst, v *string }{{&w.APIKey, p.APIKey}, {&w.KVConnector, p.KVConnector}, {&w.KVEngineID, p.KVEngineID},
		{&w.KVEventsEndpoint, p.KVEventsEndpoint}, {&w.KVEventsReplayEndpoint, p.KVEventsReplayEndpoint}} {
		if f.v != nil {
			*f.dst = *f.v
		}
	}
	if p.DPSize != nil {
		w.DPSize = *p.DPSize
	}
	if p.BootstrapPort != nil {
		w.BootstrapPort = p.BootstrapPort
	}
	return w
}

// MaxDPSize bounds a worker's data parallel size.
const MaxDPSize = 1024

// unjoin returns the errors errors.Join joined, or err alone.
func unjoin(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

// CheckKVEventsEndpoint checks a KV events endpoint: tcp://host:port, a host Baton can dial
// (not the engine's bind-all "*"), nothing else.
func CheckKVEventsEndpoint(ep string) error {
	hostport, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return fmt.Errorf("%q: want tcp://host:port", ep)
	}
	host, port, err := net.SplitHostPort(hostport)
	if err != nil || host == "" || host == "*" || strings.ContainsAny(host, "@/?#") {
		return fmt.Errorf("%q: want tcp://host:port with a host Baton can reach", ep)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("%q: port must be 1-65535", ep)
	}
	return nil
}

// CheckKVEventsListen checks the address Baton listens on for engines' KV events:
// tcp://host:port, where host may be "*" (every interface) and port 0 picks a free one.
func CheckKVEventsListen(addr string) error {
	hostport, ok := strings.CutPrefix(addr, "tcp://")
	if !ok {
		return fmt.Errorf("%q: want tcp://host:port", addr)
	}
	host, port, err := net.SplitHostPort(hostport)
	if err != nil || strings.ContainsAny(host, "@/?#") {
		return fmt.Errorf("%q: want tcp://host:port", addr)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
		return fmt.Errorf("%q: port must be 0-65535", addr)
	}
	return nil
}

// checkPairs reports each vLLM prefill whose KV no decode can take: a NIXL prefill is never
// paired with a Mooncake decode or the reverse, so a prefill with a connector needs a decode of
// the same connector, or of none configured, serving one of its models.
func (c *Config) checkPairs() []error {
	mode := func(w Worker) string {
		m, _ := KVConnectorMode(cmp.Or(w.KVConnector, w.Labels["kv_connector"], c.KVConnector))
		if cmp.Or(w.KVConnector, w.Labels["kv_connector"], c.KVConnector) == "" {
			return ""
		}
		return m
	}
	var errs []error
	for _, p := range c.Workers {
		pm := mode(p)
		if p.Role != RolePrefill || (pm != ConnectorNixl && pm != ConnectorMooncake) {
			continue
		}
		ok := false
		for _, d := range c.Workers {
			if d.Role == RoleDecode && (mode(d) == "" || mode(d) == pm) && sharesModel(p, d) {
				ok = true
				break
			}
		}
		if !ok {
			errs = append(errs, fmt.Errorf("prefill worker %s (kv connector %s) has no decode worker to hand its KV to: every decode serving its models names another connector; set kv_connector on the decodes that run %s",
				RedactURL(p.URL), pm, pm))
		}
	}
	return errs
}

// sharesModel reports whether a and b may serve one model: either lists none, or they share one.
func sharesModel(a, b Worker) bool {
	if len(a.Models) == 0 || len(b.Models) == 0 {
		return true
	}
	for _, m := range a.Models {
		if slices.Contains(b.Models, m) {
			return true
		}
	}
	return false
}

// KV connector modes: how Baton hands a vLLM prefill's KV to the decode.
const (
	ConnectorNixl        = "nixl"        // relay the kv_transfer_params the prefill returns
	ConnectorMooncake    = "mooncake"    // mint the params (transfer_id, engine id) for both legs
	ConnectorPassthrough = "passthrough" // tag nothing; relay params only if the prefill returns some
)

// kvConnectors are the connector names Baton accepts, lower-cased, with the mode each means:
// vLLM's registered connector names (vllm/distributed/kv_transfer/kv_connector/factory.py) and
// the short forms. NixlConnector is NixlPullConnector (the decode READs the prefill's blocks);
// NixlPushConnector has the prefill WRITE into blocks the decode registers — both relay the
// kv_transfer_params the prefill returns. MultiConnector is resolved from its inner connectors
// (ResolveKVConnector).
var kvConnectors = map[string]string{
	"nixlconnector": ConnectorNixl, "nixl": ConnectorNixl, "nixlpullconnector": ConnectorNixl, "nixlpushconnector": ConnectorNixl,
	"mooncakeconnector": ConnectorMooncake, "mooncake": ConnectorMooncake,
	"p2pncclconnector": ConnectorPassthrough, "lmcacheconnectorv1": ConnectorPassthrough,
	"lmcachempconnector":  ConnectorPassthrough,
	"offloadingconnector": ConnectorPassthrough, "sharedstorageconnector": ConnectorPassthrough,
	"exampleconnector": ConnectorPassthrough, "passthrough": ConnectorPassthrough,
}

// kvConnectorVariants name connectors of one mode that cannot meet: a NIXL pull engine and a
// NIXL push engine fail their handshake (the push mode is in NIXL's compatibility hash).
var kvConnectorVariants = map[string]string{
	"nixlconnector": "nixl-pull", "nixl": "nixl-pull", "nixlpullconnector": "nixl-pull", "nixlpushconnector": "nixl-push",
}

// KVConnectorMode returns the mode a connector setting means, and false for one Baton cannot
// use (ResolveKVConnector says why). The empty setting is passthrough.
func KVConnectorMode(setting string) (string, bool) {
	mode, _, err := ResolveKVConnector(setting)
	return mode, err == nil
}

// ResolveKVConnector reads a worker's connector setting: a connector name (vLLM's or the short
// form, any case), or the JSON of the engine's --kv-transfer-config. A MultiConnector hands
// off through its inner connectors (kv_connector_extra_config.connectors; the one that hands
// off owns the load, vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py): exactly
// one of them must be NIXL or Mooncake, and its mode is the connector's. variant distinguishes
// connectors of one mode that cannot pair (NIXL pull and push).
func ResolveKVConnector(setting string) (mode, variant string, err error) {
	name := strings.TrimSpace(setting)
	var inner []string
	if strings.HasPrefix(name, "{") {
		var tc struct {
			Connector string `json:"kv_connector"`
			Extra     struct {
				Connectors []struct {
					Connector string `json:"kv_connector"`
				} `json:"connectors"`
			} `json:"kv_connector_extra_config"`
		}
		if err := json.Unmarshal([]byte(name), &tc); err != nil {
			return "", "", fmt.Errorf("kv_connector: not a --kv-transfer-config JSON: %v", err)
		}
		name = tc.Connector
		for _, c := range tc.Extra.Connectors {
			inner = append(inner, c.Connector)
		}
	}
	lower := strings.ToLower(name)
	switch {
	case name == "":
		return ConnectorPassthrough, "", nil
	case lower == "multiconnector":
		return multiConnector(inner)
	}
	mode, ok := kvConnectors[lower]
	if !ok {
		return "", "", fmt.Errorf("kv_connector %q is unknown (want %s)", name, knownConnectors)
	}
	return mode, cmp.Or(kvConnectorVariants[lower], mode), nil
}

// multiConnector resolves a MultiConnector from its inner connectors' names.
func multiConnector(inner []string) (mode, variant string, err error) {
	if len(inner) == 0 {
		return "", "", errors.New(`kv_connector MultiConnector: give the engine's --kv-transfer-config JSON as the worker's kv_connector, so that its inner connectors (kv_connector_extra_config.connectors) say how it hands off`)
	}
	var handing []string
	for _, n := range inner {
		m, v, err := ResolveKVConnector(n)
		if err != nil {
			return "", "", fmt.Errorf("MultiConnector: %w", err)
		}
		if m != ConnectorPassthrough {
			handing = append(handing, n)
			mode, variant = m, v
		}
	}
	switch {
	case len(handing) == 0:
		return "", "", fmt.Errorf("kv_connector MultiConnector of %s hands off no KV (none is NIXL or Mooncake): its decodes would always recompute", strings.Join(inner, ", "))
	case len(handing) > 1:
		return "", "", fmt.Errorf("kv_connector MultiConnector of %s is ambiguous: more than one inner connector hands off KV", strings.Join(handing, ", "))
	}
	return mode, variant, nil
}

// knownConnectors lists the accepted names for an error message.
const knownConnectors = "NixlConnector (nixl), NixlPullConnector, NixlPushConnector, MooncakeConnector (mooncake), P2pNcclConnector, LMCacheConnectorV1, LMCacheMPConnector, OffloadingConnector, SharedStorageConnector, ExampleConnector, passthrough; any case; or the engine's --kv-transfer-config JSON (needed for MultiConnector)"

// Warnings returns what in a valid configuration will make Baton fail every request, or every
// request of a kind, so that it is said loudly at startup.
func (c *Config) Warnings() []string {
	var out []string
	roles := map[string]int{}
	for _, w := range c.AllWorkers() {
		roles[cmp.Or(w.Role, RoleRegular)]++
	}
	switch {
	case len(roles) == 0 && c.PDDisaggregation:
		out = append(out, "no workers are configured: every request will fail with 503; give prefill workers (--prefill URL) and decode workers (--decode URL)")
	case len(roles) == 0:
		out = append(out, "no workers are configured: every request will fail with 503; give workers with --worker-urls URL... or a workers list in --config")
	case c.PDDisaggregation && roles[RolePrefill] == 0:
		out = append(out, "pd_disaggregation is on but no prefill worker is configured: every generation request will fail with 503; add one with --prefill URL")
	case c.PDDisaggregation && roles[RoleDecode] == 0:
		out = append(out, "pd_disaggregation is on but no decode worker is configured: every generation request will fail with 503; add one with --decode URL")
	}
	return out
}

// CheckWorkerURL reports what is wrong with a worker URL. Credentials in it are refused: a URL
// is shown in headers, logs, metrics and GET /workers, so secrets go in api_key instead. Query
// strings and fragments are refused too: Baton appends route paths to the URL.
func CheckWorkerURL(raw string) error {
	if raw == "" {
		return errors.New("url is required")
	}
	u, err := url.Parse(raw)
	if err != nil {
		// url.Error repeats the whole URL, credentials included: say what is wrong without it.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return fmt.Errorf("url does not parse: %v", err)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("url scheme must be http or https")
	case u.User != nil:
		return fmt.Errorf("url must not contain credentials (user:password@); give the worker's key as api_key instead, sent as 'Authorization: Bearer <key>'")
	case u.Host == "":
		return fmt.Errorf("url has no host")
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
		return fmt.Errorf("url must not have a query or fragment")
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("url port %q is out of range 1-65535", p)
		}
	}
	if h := u.Hostname(); !validHost(h) {
		return fmt.Errorf("url host is not a host name or an IP address")
	}
	return nil
}

// validHost reports whether h is an IP address or a DNS name (letters, digits, '-', '_' and
// dots, 253 characters at most, 63 a label).
func validHost(h string) bool {
	if net.ParseIP(h) != nil {
		return true
	}
	if h == "" || len(h) > 253 {
		return false
	}
	for _, label := range strings.Split(strings.TrimSuffix(h, "."), ".") {
		if label == "" || len(label) > 63 {
			return false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

// RedactURL returns raw with any userinfo replaced by "redacted", for messages about a URL
// that failed validation.
func RedactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		if i, j := strings.Index(raw, "://"), strings.LastIndex(raw, "@"); i >= 0 && j > i {
			return raw[:i+3] + "redacted@" + raw[j+1:]
		}
		return raw
	}
	if u.User != nil { // a token may stand where the user name does: hide it all
		u.User = url.User("redacted")
	}
	return u.String()
}
