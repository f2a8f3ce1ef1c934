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
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/baton-llm/baton/internal/memo"

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

// Policies are the selection policies Baton knows: its own, and any a policy registered
// (RegisterPolicy, from the policy package's registration).
var Policies = []string{PolicyRoundRobin, PolicyRandom, PolicyLeastLoad, PolicyPowerOfTwo, PolicyPrefixHash, PolicyCacheAware}

// RegisterPolicy adds a policy's name to those the configuration accepts (from an init
// function: Policies is read without a lock once Baton runs).
func RegisterPolicy(name string) {
	if !slices.Contains(Policies, name) {
		Policies = append(Policies, name)
	}
}

// Config is the whole of Baton's configuration. Each setting is declared once, on its field
// (settings.go reads the tags): its YAML key (json), its flag (flag), the flag's help (help),
// its default (default, in flag syntax), its bounds (check) or choices (oneof), and for a
// duration the unit of smg's integer alias (unit: --<flag>-secs N, <key>_secs: N). Rules that
// tie settings together are in Validate.
type Config struct {
	Host string `json:"host" flag:"host" default:"0.0.0.0" help:"address to bind"`
	Port int    `json:"port" flag:"port" default:"30000" check:"0..65535" help:"API port; 0 picks a free port"`
	// TLSCertPath and TLSKeyPath, both set, serve the API (and the admin API's own listener)
	// over TLS with this PEM certificate chain and key; re-read on every reload. Empty: HTTP.
	TLSCertPath string `json:"tls_cert_path" flag:"tls-cert-path" help:"PEM certificate (chain) to serve the API over TLS with (with --tls-key-path); re-read on reload"`
	TLSKeyPath  string `json:"tls_key_path" flag:"tls-key-path" help:"PEM private key of --tls-cert-path"`
	MetricsPort int    `json:"metrics_port" flag:"metrics-port" default:"29000" check:"-1..65535" help:"Prometheus /metrics port; 0 picks a free port, -1 disables"`
	// WorkerURLs are regular workers given by URL only.
	WorkerURLs []string `json:"worker_urls" flag:"worker-urls" help:"regular workers by URL (space- or comma-separated)"`
	// Workers are workers with full settings (YAML), or --prefill and --decode.
	Workers []Worker `json:"workers"`
	Policy  string   `json:"policy" reload:"live" flag:"policy" default:"round_robin" help:"worker selection policy: {policies}"`
	// A worker with an explicit kv_events_endpoint is subscribed to either way.
	KVEvents       bool   `json:"kv_events" flag:"kv-events" help:"subscribe to every worker's KV events at its kv_events_endpoint or tcp://<host>:5557 (GET /workers shows their health)"`
	KVEventsListen string `json:"kv_events_listen" flag:"kv-events-listen" help:"listen for KV events from engines that connect out (tcp://host:port, * for every interface); each publishes on the topic kv@<ip>:<port>@<model>"`
	// auto and events read the engines' KV events for the workers Baton subscribes to and
	// prompts it can tokenize, else the approximate index.
	CacheAwareSource string `json:"cache_aware_source" flag:"cache-aware-source" default:"auto" oneof:"auto|events|approx" help:"where cache_aware learns what engines hold: auto | events (their KV events where subscribed, else approximate) | approx"`
	RouteHeader      bool   `json:"route_header" flag:"route-header" help:"add X-Baton-Route to responses: why each worker was chosen (policy, reason, load, cached share)"`
	// cache_aware: below CacheThreshold, or when the busiest worker is above both balance
	// bounds of the idlest, the load decides.
	CacheThreshold      float64 `json:"cache_threshold" reload:"live" flag:"cache-threshold" default:"0.3" check:"0..1" help:"cache_aware: share of the prompt that must be cached on a worker to follow the cache"`
	BalanceAbsThreshold float64 `json:"balance_abs_threshold" reload:"live" flag:"balance-abs-threshold" default:"64" check:">=0" help:"cache_aware: balance load when the busiest worker has this many more requests than the idlest"`
	BalanceRelThreshold float64 `json:"balance_rel_threshold" reload:"live" flag:"balance-rel-threshold" default:"1.5" check:">=1" help:"cache_aware: … and this many times as many"`
	// The higher CacheLoadCost, the sooner a hot prefix spreads from a busy worker.
	CacheLoadCost    float64       `json:"cache_load_cost" reload:"live" flag:"cache-load-cost" default:"16" check:">=0" help:"cache_aware: 64-byte prompt blocks one request of load is worth"`
	EvictionInterval time.Duration `json:"eviction_interval" reload:"live" flag:"eviction-interval" unit:"secs" int:"secs" default:"2m" check:">0" help:"cache_aware: forget a prefix not routed for this long (a bare number is seconds, as smg's)"`
	// MaxTreeSize: the default, 16777216, is 262,144 blocks, about 40 MB.
	MaxTreeSize          int           `json:"max_tree_size" reload:"live" flag:"max-tree-size" default:"16777216" check:">=64" help:"cache_aware: bound of the prefix index, in prompt characters"`
	LoadPollInterval     time.Duration `json:"load_poll_interval" flag:"load-poll-interval" unit:"ms" default:"500ms" check:"10ms..60s" help:"how often each engine's /metrics is read for its load; older than three intervals is ignored"`
	PrefixTokenCount     int           `json:"prefix_token_count" reload:"live" flag:"prefix-token-count" default:"256" check:">=1" help:"prefix_hash: how much of the prompt to hash, in tokens (about 4 characters each)"`
	PrefixHashLoadFactor float64       `json:"prefix_hash_load_factor" reload:"live" flag:"prefix-hash-load-factor" default:"1.25" check:">=1" help:"prefix_hash: move on along the ring when a worker's load exceeds this times the mean"`
	PDDisaggregation     bool          `json:"pd_disaggregation" flag:"pd-disaggregation" help:"prefill/decode disaggregation: generation goes to a prefill and a decode worker"`
	// PrefillPolicy and DecodePolicy: empty means Policy.
	PrefillPolicy string `json:"prefill_policy" reload:"live" flag:"prefill-policy" help:"policy for the prefill worker of a pair (default: --policy)"`
	DecodePolicy  string `json:"decode_policy" reload:"live" flag:"decode-policy" help:"policy for the decode worker of a pair (default: --policy)"`
	KVConnector   string `json:"kv_connector" flag:"kv-connector" help:"KV connector of vLLM prefill workers that configure none: NixlConnector | MooncakeConnector"`
	// PDRequireHandoff: no silent fallback to a decode that recomputes.
	PDRequireHandoff bool `json:"pd_require_handoff" flag:"pd-require-handoff" help:"strict mode: a PD request whose decode would recompute the prompt fails with 502"`
	// PDLocalPrefillThreshold: conditional disaggregation. A PD request whose prompt has fewer
	// uncached tokens on its chosen decode than this is served by that decode alone.
	PDLocalPrefillThreshold int `json:"pd_local_prefill_threshold" flag:"pd-local-prefill-threshold" default:"0" check:">=0" help:"conditional disaggregation: a PD request whose prompt has fewer uncached tokens than this on its chosen decode worker (from the KV events where subscribed, else the cache-aware index, else the whole prompt) is served by that decode alone, computing the prompt itself (X-Baton-Kv-Handoff none-local-prefill); 0 always splits. SGLang decodes never serve alone"`
	// PDPrefillServesWhole: the mirror case of conditional disaggregation.
	PDPrefillServesWhole bool `json:"pd_prefill_serves_whole" flag:"pd-prefill-serves-whole" help:"the mirror case: once the PD advisor has fitted the decodes' pace, a PD request whose chosen decode would give a token slower than pd_advice_tpot_slo at the batch it holds goes whole to a vLLM prefill worker with nothing in flight, which decodes it too (X-Baton-Kv-Handoff none-prefill-whole)"`
	// PDLocalPrefillAuto: the threshold follows the PD advisor.
	PDLocalPrefillAuto bool `json:"pd_local_prefill_auto" flag:"pd-local-prefill-auto" help:"conditional disaggregation with the threshold the PD advisor recommends for the fleet's current split, refreshed every 10s (pd_local_prefill_threshold is its starting value; one request in ten under it is split while the advisor has too few prefill legs to fit from; the last fitted one holds while it cannot fit)"`
	// PDAdviceTTFTSLO and PDAdviceTPOTSLO are the SLOs the PD advisor sizes the fleet for by
	// default (its metrics; GET /pd/advice takes others).
	PDAdviceTTFTSLO time.Duration `json:"pd_advice_ttft_slo" flag:"pd-advice-ttft-slo" unit:"secs" default:"2s" check:">0" help:"the PD advisor's TTFT SLO (p90): the split it recommends keeps the predicted TTFT p90 within it"`
	PDAdviceTPOTSLO time.Duration `json:"pd_advice_tpot_slo" flag:"pd-advice-tpot-slo" unit:"secs" default:"50ms" check:">0" help:"the PD advisor's time-per-output-token SLO"`
	// PDAdviceWindow is how far back the PD advisor's samples reach.
	PDAdviceWindow time.Duration `json:"pd_advice_window" flag:"pd-advice-window" default:"5m" check:">0" help:"how far back the PD advisor fits from (at most 20,000 requests; from 10s to 1h)"`
	// PDPrefillerHeader makes Baton the decode-side sidecar of an Endpoint Picker that names
	// the prefill (llm-d's x-prefiller-host-port): the prefill leg runs there.
	PDPrefillerHeader bool `json:"pd_prefiller_header" flag:"pd-prefiller-header" help:"decode-side sidecar: a PD request's x-prefiller-host-port header names its prefill (the first of the listed host:port that is one of the prefill workers); without it the request goes to a decode worker alone"`
	// PDPrefillerAbsent is what the sidecar does with a request whose picker named no prefill:
	// decode (alone, as llm-d's sidecar does) or pick (a prefill of Baton's choice).
	PDPrefillerAbsent  string `json:"pd_prefiller_absent" flag:"pd-prefiller-absent" default:"decode" help:"decode-side sidecar, a PD request without x-prefiller-host-port: decode (the decode worker alone, as llm-d's sidecar does; the picker chose so) or pick (Baton picks a prefill)"`
	PDMooncakeDispatch string `json:"pd_mooncake_dispatch" flag:"pd-mooncake-dispatch" default:"concurrent" oneof:"concurrent|sequential" help:"Mooncake legs: concurrent or sequential"`
	// RequestTimeout: past it the client gets 504 (or, mid-stream, a broken connection).
	RequestTimeout time.Duration `json:"request_timeout" flag:"request-timeout" unit:"secs" default:"30m" check:">0" help:"bound on one request from arrival to the end of its response, streams included"`
	// StreamStallTimeout is nginx's proxy_read_timeout (60 s) for a stream once it began: an
	// engine silent that long mid-stream (hung, wedged) is given up on at once rather than at the
	// request deadline.
	StreamStallTimeout time.Duration `json:"stream_stall_timeout" flag:"stream-stall-timeout" unit:"secs" default:"1m" check:">=0" help:"a stream whose engine sends nothing for this long after its first byte is aborted, counted (baton_upstream_errors_total{kind=\"stalled\"}) and held against the worker's circuit (0: wait until the request deadline)"`
	// MaxPayloadSize: 32 MiB holds a million-token context (about 4 MB of text) and a few
	// base64 images; prompt_embeds tensors or larger batches need it raised.
	MaxPayloadSize int64 `json:"max_payload_size" flag:"max-payload-size" default:"33554432" check:">0" help:"largest request body accepted, in bytes"`
	// MaxBufferedBodyBytes: past it a body still arriving is refused with 503 before more of
	// it is read.
	MaxBufferedBodyBytes int64 `json:"max_buffered_body_bytes" flag:"max-buffered-body-bytes" default:"268435456" help:"request body bytes held at once over every request (503 past it)"`
	// GCHeapFloor paces Go's collector: while the live heap is small its next cycle is due at
	// this heap size, GOGC's pace past it (internal/gcpace). A gateway's live heap is a few MiB while each request allocates a
	// few KiB that die with it; at GOGC alone the collector runs dozens of times a second.
	GCHeapFloor int64 `json:"gc_heap_floor" flag:"gc-heap-floor" default:"16777216" check:"0..1073741824" help:"while the live heap is small, the collector's next cycle is due at this heap size (its percent raised, at most tenfold); GOGC paces a larger heap, GOMEMLIMIT caps every cycle; at most a quarter of the memory limit (0: GOGC alone)"`
	// BodyTimeout: a trickle of bytes each inside the stalled-client timeout keeps no buffer
	// longer.
	BodyTimeout          time.Duration `json:"body_timeout" flag:"body-timeout" unit:"secs" default:"2m" check:">0" help:"a request body must arrive whole within this"`
	MaxBatchSize         int           `json:"max_batch_size" flag:"max-batch-size" default:"1024" check:">=1" help:"largest n, and most prompts in one request; 400 past it"`
	StalledClientTimeout time.Duration `json:"stalled_client_timeout" flag:"stalled-client-timeout" unit:"secs" default:"1m" check:">0" help:"drop a client that sends no body bytes or accepts no response bytes for this long"`
	// ClientAPIKey is the key clients send when the fleet has one client (tenant default's key);
	// tenants: gives each team its own. It is Baton's: never sent to an engine.
	ClientAPIKey string `json:"client_api_key" flag:"client-api-key" secret:"BATON_CLIENT_API_KEY" help:"require 'Authorization: Bearer KEY' on inference routes (tenant default's key; tenants: gives each team its own)"`
	// APIKey is smg's --api-key, with smg's three meanings: the key sent to every engine (as
	// worker_api_key; the two may not differ), the clients' key when client_api_key gives none
	// (ClientKey), and the admin API's when no admin key is given (AdminKeys).
	APIKey string `json:"api_key" flag:"api-key" secret:"BATON_API_KEY" help:"smg's meaning: the key sent to every engine (as --worker-api-key), required of clients unless --client-api-key gives theirs, and of the admin API unless --admin-api-key or --control-plane-api-keys give its own"`
	// Models are names clients use: an alias of a model the workers serve, and the models to
	// fall back to (YAML models:). DefaultModel is the model of a request that names none.
	Models       map[string]ModelConfig `json:"models"`
	DefaultModel string                 `json:"default_model" reload:"live" flag:"default-model" help:"the model of a request that names none (else 400 model_required; SGLang's /generate names none and keeps going to any worker)"`
	// Adapters are the LoRA adapters Baton loads on a worker of their base model when no
	// available worker has one a request names (YAML adapters:).
	Adapters           []Adapter     `json:"adapters"`
	UnloadLRU          bool          `json:"unload_lru" flag:"unload-lru" reload:"live" help:"when every adapter slot of the chosen worker is taken, unload its least recently used adapter (none with requests in flight) before loading another"`
	AdapterAffinity    bool          `json:"adapter_affinity" flag:"adapter-affinity" default:"true" reload:"live" help:"send an adapter's requests to workers with it running, then loaded, then with a free adapter slot, before the model's policy chooses among them"`
	AdapterLoadTimeout time.Duration `json:"adapter_load_timeout" flag:"adapter-load-timeout" unit:"secs" default:"2m" check:">0" reload:"live" help:"an adapter load (and the unload making room for it) must finish within this; then the requests waiting on it get 503"`
	// Tenants are the teams sharing the fleet (tenants.go); TenantAPIKeys smg's
	// --tenant-api-key TENANT:KEY, flag only (a file holds hashes, never keys).
	Tenants       []Tenant `json:"tenants"`
	TenantAPIKeys []string `json:"-"`
	// TrustTenantHeader names the tenant by the TenantHeaderName header a trusted proxy in front
	// sets (smg's --trust-tenant-header): its value is a tenant's name; a request without it is
	// identified by its key as usual.
	TrustTenantHeader bool   `json:"trust_tenant_header" flag:"trust-tenant-header" help:"name the tenant by the --tenant-header-name header a proxy in front sets (its value a tenant's name); only behind a proxy that sets or strips it: a client reaching Baton directly could name any tenant"`
	TenantHeaderName  string `json:"tenant_header_name" flag:"tenant-header-name" default:"x-smg-tenant-id" help:"the header --trust-tenant-header reads"`
	// DefaultMaxPriority is the ceiling of a tenant whose configuration gives none (and of
	// every request where no tenant has keys); smg's --priority-scheduler-default-max-class,
	// its names system and bulk taken as critical and batch.
	DefaultMaxPriority string `json:"default_max_priority" flag:"priority-scheduler-default-max-class" default:"interactive" help:"the highest priority class of a tenant without max_priority (critical, interactive, default, batch; smg's system and bulk too)"`
	// PrioritySchedulerEnabled is smg's switch for its priority scheduler: Baton's classes are
	// on whenever requests are bounded (--max-concurrent-requests); without that bound the flag
	// bounds them by the engines' capacity, as smg does (Admission.SlotsFromEngines).
	PrioritySchedulerEnabled bool `json:"priority_scheduler_enabled" flag:"priority-scheduler-enabled" help:"smg's: priority classes order the requests waiting for a slot, one of --max-concurrent-requests or, without it, of the engines' capacity as smg sizes it"`
	// PrioritySchedulerConfig and TenantRateLimitConfig are smg's policy files, read into
	// admission: and tenants: (smgfiles.go); smgNotes what they could not carry over exactly.
	PrioritySchedulerConfig string `json:"priority_scheduler_config" flag:"priority-scheduler-config" help:"smg's priority scheduler YAML (with --priority-scheduler-enabled): its classes become admission's queue_classes and reserved_slots, its tenant_policies the tenants' max_priority"`
	TenantRateLimitEnabled  bool   `json:"tenant_rate_limit_enabled" flag:"tenant-rate-limit-enabled" help:"smg's: read --tenant-rate-limit-config (tenants: limits in --config hold without it)"`
	TenantRateLimitConfig   string `json:"tenant_rate_limit_config" flag:"tenant-rate-limit-config" help:"smg's tenant rate-limit YAML: default_policy and each tenant's policy become the tenants' limits and model_limits"`
	smgNotes                []string
	// ControlPlaneKeys are further admin API keys, from smg's --control-plane-api-keys
	// ID:NAME:ROLE:KEY (role admin; flag only).
	ControlPlaneKeys []string `json:"-"`
	// RateLimitStore is where tenants' counts live: memory (this replica) or a Redis URL shared by
	// replicas (redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS; REDIS_PASSWORD when the URL
	// has none).
	RateLimitStore        string        `json:"rate_limit_store" flag:"rate-limit-store" default:"memory" secret:"BATON_RATE_LIMIT_STORE" help:"where tenants' limits are counted: memory, or redis://HOST:PORT/DB shared by replicas (rediss:// for TLS; password in the URL or REDIS_PASSWORD)"`
	RateLimitStoreFailure string        `json:"rate_limit_store_failure" flag:"rate-limit-store-failure" default:"open" oneof:"open|closed" help:"when the Redis store cannot be reached: open (serve, counting in this replica) or closed (503 rate_limit_store_unavailable)"`
	RateLimitStoreTimeout time.Duration `json:"rate_limit_store_timeout" flag:"rate-limit-store-timeout" unit:"ms" default:"100ms" check:"1ms..10s" help:"deadline of one call to the Redis store"`
	// TenantMaxTokens is the completion tokens a request without max_tokens is reserved.
	TenantMaxTokens int `json:"tenant_max_tokens_estimate" flag:"tenant-max-tokens-estimate" default:"1024" check:">=1" help:"completion tokens reserved for a request without max_tokens (and the most reserved for one with it); settled against the engine's usage"`
	// WorkerAPIKey is what Baton sends the engines; a worker's own api_key wins. The clients'
	// key (APIKey) is Baton's and never reaches an engine.
	WorkerAPIKey string `json:"worker_api_key" flag:"worker-api-key" secret:"BATON_WORKER_API_KEY" help:"send 'Authorization: Bearer KEY' to every engine (a worker's own api_key wins; discovered pods too)"`
	// ServiceDiscovery finds workers among the Kubernetes pods of ServiceDiscoveryNamespace
	// (default: Baton's own namespace) that match Selector (regular workers), PrefillSelector
	// or DecodeSelector (PD roles). KubeConfig, when set, is used instead of the in-cluster
	// service account.
	ServiceDiscovery          bool              `json:"service_discovery" flag:"service-discovery" help:"find workers among Kubernetes pods (see --selector)"`
	Selector                  map[string]string `json:"selector" flag:"selector" help:"pods that are regular workers: k=v labels, all must match"`
	PrefillSelector           map[string]string `json:"prefill_selector" flag:"prefill-selector" help:"pods that are prefill workers: k=v labels"`
	DecodeSelector            map[string]string `json:"decode_selector" flag:"decode-selector" help:"pods that are decode workers: k=v labels"`
	ServiceDiscoveryNamespace string            `json:"service_discovery_namespace" flag:"service-discovery-namespace" help:"namespace of the worker pods (default: Baton's own)"`
	ServiceDiscoveryPort      int               `json:"service_discovery_port" flag:"service-discovery-port" default:"8000" help:"port of the workers' API on their pods (the baton.ai/port annotation overrides it)"`
	KubeConfig                string            `json:"kubeconfig" flag:"kubeconfig" help:"kubeconfig for discovery outside the cluster (default: the in-cluster service account)"`
	// The Endpoint Picker (baton epp): the ext_proc gRPC port, the fallback endpoints named
	// after each choice, when a batch request is shed, and the InferencePool whose pods are
	// the workers (in ServiceDiscoveryNamespace).
	GRPCPort          int     `json:"grpc_port" flag:"grpc-port" default:"9002" check:"0..65535" help:"baton epp: port of the Endpoint Picker's ext_proc and gRPC health services; 0 picks a free one"`
	EPPFallbacks      int     `json:"epp_fallbacks" flag:"epp-fallbacks" default:"2" check:"0..16" help:"baton epp: endpoints named after each choice, least loaded first, for the gateway to retry down"`
	EPPShedQueueDepth float64 `json:"epp_shed_queue_depth" flag:"epp-shed-queue-depth" default:"5" check:">=0" help:"baton epp: a batch-class request is shed (429) when every worker that could serve it queues at least this many requests (0: never on queue depth)"`
	EPPShedKVUsage    float64 `json:"epp_shed_kv_usage" flag:"epp-shed-kv-usage" default:"0.8" check:"0..1" help:"baton epp: ... or uses at least this share of its KV cache (0: never on KV use)"`
	// Bounds on what a data plane may hold of the picker: exchanges at once in all and per
	// connection, and connections.
	EPPMaxStreams              int `json:"epp_max_streams" flag:"epp-max-streams" default:"1024" check:">=1" help:"baton epp: ext_proc exchanges served at once over every connection; past it a new one ends at once with RESOURCE_EXHAUSTED (counted)"`
	EPPMaxStreamsPerConnection int `json:"epp_max_streams_per_connection" flag:"epp-max-streams-per-connection" default:"256" check:">=1" help:"baton epp: ext_proc exchanges at once on one connection (HTTP/2 max concurrent streams)"`
	EPPMaxConnections          int `json:"epp_max_connections" flag:"epp-max-connections" default:"128" check:">=1" help:"baton epp: connections to the gRPC port at once; past it a new one is closed (counted)"`
	// The picker's gRPC port speaks TLS unless told otherwise (as the reference picker does),
	// with the given certificate or one made at startup; a client CA requires the data plane's
	// certificate (mTLS). The health services are on a plaintext port of their own too, for
	// the kubelet's gRPC probes.
	EPPSecureServing bool   `json:"epp_secure_serving" flag:"epp-secure-serving" default:"true" help:"baton epp: TLS on the gRPC port (a self-signed certificate made at startup unless --epp-tls-cert-path gives one)"`
	EPPTLSCertPath   string `json:"epp_tls_cert_path" flag:"epp-tls-cert-path" help:"baton epp: the gRPC port's certificate (PEM), re-read when the file changes"`
	EPPTLSKeyPath    string `json:"epp_tls_key_path" flag:"epp-tls-key-path" help:"baton epp: its private key (PEM)"`
	EPPClientCAPath  string `json:"epp_client_ca_path" flag:"epp-client-ca-path" help:"baton epp: require a client certificate signed by this CA (PEM) on the gRPC port: only the gateway holding one reaches the picker"`
	GRPCHealthPort   int    `json:"grpc_health_port" flag:"grpc-health-port" default:"9003" check:"-1..65535" help:"baton epp: plaintext port of the gRPC health services alone (the kubelet's gRPC probes speak no TLS); -1: none, 0: a free one"`
	InferencePool    string `json:"inference_pool" flag:"inference-pool" help:"baton epp: the InferencePool (inference.networking.k8s.io/v1) whose selected pods and target ports are the workers, watched in --service-discovery-namespace"`
	// EPP is set by baton epp: serve the Endpoint Picker beside the HTTP listeners.
	EPP bool `json:"-"`
	// AdminAPIKey is not the inference key.
	AdminAPIKey string `json:"admin_api_key" flag:"admin-api-key" secret:"BATON_ADMIN_API_KEY" help:"require 'Authorization: Bearer KEY' on the admin API (the worker routes); without it the admin API answers only on loopback"`
	AdminHost   string `json:"admin_host" flag:"admin-host" default:"127.0.0.1" help:"address of the admin API's own listener"`
	AdminPort   int    `json:"admin_port" flag:"admin-port" default:"-1" check:"-1..65535" help:"port of the admin API's own listener; -1 serves it on the API port; 0 picks a free one"`
	// WatchConfig checks the file every 2 s.
	WatchConfig bool `json:"watch_config" flag:"watch-config" help:"re-read the --config file when it changes (as SIGHUP does): workers added, drained, updated"`
	// OTLPTracesEndpoint: http(s)://host:port for OTLP/HTTP, grpc://host:port for OTLP/gRPC.
	OTLPTracesEndpoint string  `json:"otlp_traces_endpoint" flag:"otlp-traces-endpoint" help:"send OpenTelemetry traces: http(s)://host:port (OTLP/HTTP) or grpc://host:port (default: the OTEL_EXPORTER_OTLP_* variables, else off)"`
	TraceSampleRatio   float64 `json:"trace_sample_ratio" flag:"trace-sample-ratio" default:"1" check:"0..1" help:"share of new traces sampled (a client's sampled traceparent is followed)"`
	AccessLog          bool    `json:"access_log" flag:"access-log" default:"true" help:"one info line per request (--access-log=false turns it off)"`
	// Args are the command-line arguments the configuration was parsed from (a reload parses
	// them again, re-reading the file they name).
	Args []string `json:"-"`
	// File is the --config file, "" for none; FileSum the SHA-256 of the content it was read
	// with.
	File     string `json:"-"`
	FileSum  []byte `json:"-"`
	LogLevel string `json:"log_level" flag:"log-level" default:"info" help:"debug | info | warn | error"`
	LogJSON  bool   `json:"log_json" flag:"log-json" help:"log JSON lines"`
	// EnablePprof is for profiling in place.
	EnablePprof bool `json:"enable_pprof" flag:"enable-pprof" help:"serve /debug/pprof/ on the metrics port"`
	// ForwardSimFaults: a client's headers are otherwise an allowlist.
	ForwardSimFaults  bool          `json:"forward_sim_faults" flag:"forward-sim-faults" help:"forward a client's X-Sim-Fault header to the workers (tests and demos against simulated engines)"`
	ReadHeaderTimeout time.Duration `json:"read_header_timeout" flag:"read-header-timeout" unit:"secs" default:"30s" check:">0" help:"a client must send its request headers within this"`
	IdleTimeout       time.Duration `json:"idle_timeout" flag:"idle-timeout" unit:"secs" default:"2m" check:">0" help:"idle keep-alive client connections are closed after this; streams are never cut"`
	// HTTPServer baton: less CPU per request and memory per open stream; Linux only, elsewhere
	// net is used.
	HTTPServer string `json:"http_server" flag:"http-server" default:"baton" oneof:"baton|net" help:"server of the API listener: baton (Baton's own HTTP/1.1 server; Linux) or net (Go's net/http)"`
	// UpstreamClient baton checks an idle connection for stray bytes just before it writes on it rather
	// than watching it; an answer out of step that arrives later is caught by correlation where
	// the engine echoes X-Request-Id, under either client (docs/REFERENCE.md, Security).
	UpstreamClient string `json:"upstream_client" flag:"upstream-client" default:"baton" oneof:"net|baton" help:"HTTP client to the engines: baton (Baton's own HTTP/1.1 client: less CPU and memory per request and open stream) or net (Go's net/http transport; watches idle connections)"`
	// UpstreamReuse off gives every upstream request a connection of its own: no answer can be
	// out of step with its request, at the cost of a connect per request (for workers whose
	// engines echo no X-Request-Id; GET /workers says which).
	UpstreamReuse       string        `json:"upstream_reuse" flag:"upstream-reuse" default:"on" oneof:"on|off" help:"keep connections to the engines for reuse (on), or open one per request (off: no answer can be another request's even from an engine that echoes no X-Request-Id)"`
	ShutdownGracePeriod time.Duration `json:"shutdown_grace_period" flag:"shutdown-grace-period" unit:"secs" default:"3m" check:">=0" help:"how long in-flight requests may drain on SIGTERM"`
	DetectInterval      time.Duration `json:"detect_interval" flag:"detect-interval" unit:"secs" default:"10s" check:">0" help:"longest wait between registration attempts for an unreachable worker"`

	Retry          Retry          `json:"retry"`
	CircuitBreaker CircuitBreaker `json:"circuit_breaker"`
	HealthCheck    HealthCheck    `json:"health_check"`
	Admission      Admission      `json:"admission"`
	PairHealth     PairHealth     `json:"pair_health"`
}

// Retry is how a failed request is retried: on 408/429/500/502/503/504 and transport errors,
// before any byte reached the client, re-selecting the worker (PD: the pair) each time.
type Retry struct {
	MaxRetries        int           `json:"max_retries" flag:"retry-max-retries" default:"5" check:">=1" hint:"for one attempt and no retry, --disable-retries" help:"attempts in total, the first included"`
	InitialBackoff    time.Duration `json:"initial_backoff" flag:"retry-initial-backoff" unit:"ms" default:"50ms" check:">0" help:"wait before the second attempt"`
	MaxBackoff        time.Duration `json:"max_backoff" flag:"retry-max-backoff" unit:"ms" default:"30s" check:">0" help:"longest wait between attempts"`
	BackoffMultiplier float64       `json:"backoff_multiplier" flag:"retry-backoff-multiplier" default:"1.5" check:">=1" help:"growth of the wait per attempt"`
	JitterFactor      float64       `json:"jitter_factor" flag:"retry-jitter-factor" default:"0.2" check:"0..1" help:"± fraction of randomness in each wait"`
	Disable           bool          `json:"disable" flag:"disable-retries" help:"one attempt per request"`
}

// CircuitBreaker takes a failing worker out of rotation: open after FailureThreshold
// consecutive failures, half-open after TimeoutDuration (a few probe requests), closed after
// SuccessThreshold successes. 429 is no failure; client cancellations never count.
type CircuitBreaker struct {
	FailureThreshold int           `json:"failure_threshold" flag:"cb-failure-threshold" default:"10" check:">=1" help:"consecutive failures that open a worker's circuit"`
	SuccessThreshold int           `json:"success_threshold" flag:"cb-success-threshold" default:"3" check:">=1" help:"successes in half-open that close it"`
	TimeoutDuration  time.Duration `json:"timeout_duration" flag:"cb-timeout-duration" unit:"secs" default:"1m" check:">0" help:"time open before half-open probes"`
	Disable          bool          `json:"disable" flag:"disable-circuit-breaker" help:"never open circuits"`
}

// HealthCheck probes every worker periodically; workers leave and rejoin rotation on their own.
type HealthCheck struct {
	Interval         time.Duration `json:"interval" flag:"health-check-interval" unit:"secs" default:"1m" check:">0" help:"time between health probes of a worker"`
	Timeout          time.Duration `json:"timeout" flag:"health-check-timeout" unit:"secs" default:"5s" check:">0" help:"timeout of one health probe"`
	FailureThreshold int           `json:"failure_threshold" flag:"health-failure-threshold" default:"3" check:">=1" help:"failed probes that take a worker out of rotation"`
	SuccessThreshold int           `json:"success_threshold" flag:"health-success-threshold" default:"2" check:">=1" help:"good probes that bring it back"`
	Endpoint         string        `json:"endpoint" flag:"health-check-endpoint" default:"/health" help:"path probed"`
	Disable          bool          `json:"disable" flag:"disable-health-check" help:"no active health checks"`
}

// Admission bounds the requests Baton serves at once; beyond the queue it answers 503 with
// Retry-After.
type Admission struct {
	MaxConcurrentRequests int           `json:"max_concurrent_requests" flag:"max-concurrent-requests" default:"-1" help:"inference requests served at once; -1 = no limit"`
	QueueSize             int           `json:"queue_size" flag:"queue-size" default:"100" check:">=0" help:"requests that may wait for a slot"`
	QueueTimeout          time.Duration `json:"queue_timeout" flag:"queue-timeout" unit:"secs" default:"1m" check:">0" help:"how long a request may wait for a slot"`
	// Classes override queue_size and queue_timeout per priority class (YAML: queue_classes:
	// {batch: {size: 1000, timeout: 10m}}).
	Classes map[string]QueueClass `json:"queue_classes"`
	// ReservedSlots keeps slots for a class and those above it (YAML: {critical: 8}).
	ReservedSlots map[string]int `json:"reserved_slots"`
	// SlotsFromEngines sizes the requests served at once from the engines' capacity, as smg's
	// priority scheduler does (priority_scheduler_enabled without max_concurrent_requests): set
	// by the configuration, not a key of its own.
	SlotsFromEngines bool `json:"-"`
	// NoWorkerWait holds a request for a known model with no ready worker until one is ready
	// (an engine scaling up from zero), at most this long; 0: no_available_workers at once.
	NoWorkerWait time.Duration `json:"no_worker_wait" flag:"no-worker-wait" unit:"secs" default:"0s" check:">=0" help:"hold a request for a known model without a ready worker this long for one to become ready (0: refuse at once)"`
	PromoteAfter time.Duration `json:"queue_promote_after" flag:"queue-promote-after" unit:"secs" default:"30s" check:">=0" help:"a request waiting this long moves up one priority class (0: never)"`
	// QueueAnswers are the statuses of a full queue and a wait past its timeout: baton (503
	// queue_full, 504 queue_timeout) or smg (429 and 408, smg's priority scheduler's).
	QueueAnswers string `json:"queue_answers" flag:"queue-answers" default:"baton" help:"statuses of a full queue and a wait past its timeout: baton (503, 504) or smg (429, 408); Retry-After either way"`
	// QueueRetryAfter is the Retry-After of the queue's refusals; 0: a tenth of queue_timeout.
	QueueRetryAfter time.Duration `json:"queue_retry_after" flag:"queue-retry-after" default:"0s" check:"0s..1h" help:"Retry-After of a full queue's, a wait's past its timeout and a drain's refusals, rounded up to seconds (0: a tenth of queue_timeout, at least 1 s)"`
	// The Virtual Token Counter's weights of prompt and completion tokens.
	FairInputWeight  float64 `json:"fair_input_weight" flag:"fair-input-weight" default:"1" check:">=0" help:"weight of a prompt token in a tenant's share of a full fleet"`
	FairOutputWeight float64 `json:"fair_output_weight" flag:"fair-output-weight" default:"2" check:">=0" help:"weight of a completion token in a tenant's share of a full fleet"`
}

// Adapter is a LoRA adapter Baton may load: its name (as requests and the engines name it), the
// path the engine loads it from, and its base model.
type Adapter struct {
	Name string `json:"name"`
	Path string `json:"path"`
	Base string `json:"base"`
}

// ModelConfig is one model name as clients use it.
type ModelConfig struct {
	// Serve is the model the workers know this name by: the body's "model" is rewritten to it
	// on the way to the worker. Empty: the name itself.
	Serve string `json:"serve"`
	// Fallbacks are the models tried, in order, when no worker of this one is available.
	Fallbacks []string `json:"fallbacks"`
	// ContextWindowFallbacks are the models tried, in order, when the engine refuses the prompt
	// as longer than the model's context.
	ContextWindowFallbacks []string `json:"context_window_fallbacks"`
	// Policy, PrefillPolicy and DecodePolicy route this model's requests (a small model and a
	// big one rarely want the same routing); empty: the fleet's.
	Policy        string `json:"policy"`
	PrefillPolicy string `json:"prefill_policy"`
	DecodePolicy  string `json:"decode_policy"`
}

// ModelPolicyFor is the policy of role for model's requests, "" when the model has none of its
// own.
func (c *Config) ModelPolicyFor(model, role string) string {
	m := c.Models[model]
	switch {
	case role == RolePrefill && m.PrefillPolicy != "":
		return m.PrefillPolicy
	case role == RoleDecode && m.DecodePolicy != "":
		return m.DecodePolicy
	}
	return m.Policy
}

// Served is the model the workers know name by (name itself when it is no alias).
func (c *Config) Served(name string) string {
	if m, ok := c.Models[name]; ok && m.Serve != "" {
		return m.Serve
	}
	return name
}

// QueueClass is one priority class's queue: its depth and how long a request waits in it.
type QueueClass struct {
	Size    *int          `json:"size"`
	Timeout time.Duration `json:"timeout"`
	// PromoteAfter is this class's own queue_promote_after: a request waiting this long moves
	// up one class (smg's starvation_threshold_secs).
	PromoteAfter time.Duration `json:"promote_after"`
}

// PairHealth quarantines a prefill/decode pair whose requests keep failing at the seam while
// each worker looks healthy on its own; other pairs are preferred meanwhile.
type PairHealth struct {
	FailureThreshold int           `json:"failure_threshold" default:"3" check:">=1"` // consecutive failures
	Quarantine       time.Duration `json:"quarantine" unit:"secs" default:"30s" check:">=0"`
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
	// ForwardPriority sends the request's priority class to the engine in its "priority" field:
	// only to an engine started to schedule by it (vLLM --scheduling-policy priority, SGLang
	// --enable-priority-scheduling), which a vLLM engine without it refuses.
	ForwardPriority bool `json:"forward_priority,omitempty"`
	// PriorityOrder is how the engine orders "priority": lower_first (vLLM; SGLang with
	// --schedule-low-priority-values-first) or higher_first (SGLang's default). Empty: by
	// runtime.
	PriorityOrder string `json:"priority_order,omitempty"`
}

// Default returns the configuration with every default filled in (the fields' default tags).
func Default() Config { return defaults }

// LoadFile reads a YAML (or JSON) file into c, strictly: every unknown key and every value of
// the wrong kind is reported at once, with its path and line. Keys absent from the file keep
// c's values.
func (c *Config) LoadFile(path string) error {
	data, err := ReadFile(path, MaxConfigFile)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	sum := sha256.Sum256(data)
	c.FileSum = sum[:]
	norm, problems := yamlProblems(data, c)
	if len(problems) > 0 {
		return fmt.Errorf("config %s: %s", path, strings.Join(problems, "; "))
	}
	if err := yaml.UnmarshalStrict(norm, c); err != nil {
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
	for i := range out {
		out[i] = c.WithEngineKey(out[i])
	}
	return out
}

// WithEngineKey gives w the fleet's engine key (worker_api_key) when it has none of its own.
func (c *Config) WithEngineKey(w Worker) Worker {
	if w.APIKey == "" {
		w.APIKey = cmp.Or(c.WorkerAPIKey, c.APIKey)
	}
	return w
}

// AdminKeys are the keys the admin API takes: admin_api_key and smg's control-plane keys.
func (c *Config) AdminKeys() []string {
	out := c.explicitAdminKeys()
	if len(out) == 0 && c.APIKey != "" {
		out = append(out, c.APIKey) // smg's admin routes take its shared --api-key
	}
	return out
}

func (c *Config) explicitAdminKeys() []string {
	var out []string
	if c.AdminAPIKey != "" {
		out = append(out, c.AdminAPIKey)
	}
	return append(out, c.ControlPlaneKeys...)
}

// ClientKey is the key of tenant default's clients: client_api_key, else smg's --api-key (which
// smg checks on clients too); "" for none.
func (c *Config) ClientKey() string { return cmp.Or(c.ClientAPIKey, c.APIKey) }

// Validate reports every problem in c at once, joined.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	for i := range settings {
		if err := settings[i].validate(c); err != nil {
			errs = append(errs, err)
		}
	}
	if (c.TLSCertPath == "") != (c.TLSKeyPath == "") {
		bad("tls_cert_path and tls_key_path go together: give both, or neither")
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
	switch {
	case c.InferencePool != "":
		if c.ServiceDiscovery {
			bad("inference_pool and service_discovery both find workers among pods: give one (the pool's selector says which pods)")
		}
		if len(c.Selector) > 0 {
			bad("selector is the InferencePool's with inference_pool: give prefill_selector and decode_selector only, to split the pool's pods")
		}
		if (len(c.PrefillSelector) > 0 || len(c.DecodeSelector) > 0) && !c.PDDisaggregation {
			bad("prefill_selector and decode_selector need pd_disaggregation")
		}
		if errs := validation.IsDNS1123Subdomain(c.InferencePool); len(errs) > 0 {
			bad("inference_pool %.80q is no Kubernetes object name: %s", c.InferencePool, strings.Join(errs, "; "))
		}
	case !c.ServiceDiscovery && len(c.Selector)+len(c.PrefillSelector)+len(c.DecodeSelector) > 0:
		bad("selector, prefill_selector and decode_selector find workers only with service_discovery: add --service-discovery")
	}
	if c.AdminPort > 0 && (c.AdminPort == c.Port || c.AdminPort == c.MetricsPort) {
		bad("admin_port %d must differ from port and metrics_port", c.AdminPort)
	}
	switch c.DefaultMaxPriority {
	case "system":
		c.DefaultMaxPriority = PriorityCritical
	case "bulk":
		c.DefaultMaxPriority = PriorityBatch
	}
	if !slices.Contains(PriorityClasses, c.DefaultMaxPriority) {
		bad("default_max_priority %q: want one of %s (smg's system and bulk too)", c.DefaultMaxPriority, strings.Join(PriorityClasses, ", "))
	}
	if c.PrioritySchedulerEnabled && c.Admission.MaxConcurrentRequests <= 0 && len(c.Admission.ReservedSlots) > 0 {
		bad("priority_scheduler_enabled: slots sized from the engines' capacity reserve none: give --max-concurrent-requests for reserved_slots (reserved_floor, reserved_per_slot)")
	}
	c.Admission.SlotsFromEngines = c.PrioritySchedulerEnabled && c.Admission.MaxConcurrentRequests <= 0
	for _, x := range []struct {
		name string
		d    time.Duration
	}{{"pd_advice_ttft_slo", c.PDAdviceTTFTSLO}, {"pd_advice_tpot_slo", c.PDAdviceTPOTSLO}} {
		if x.d < time.Millisecond || x.d > time.Hour {
			bad("%s %v: want from 1ms to 1h", x.name, x.d)
		}
	}
	if c.PDAdviceWindow < 10*time.Second || c.PDAdviceWindow > time.Hour {
		bad("pd_advice_window %v: want from 10s to 1h", c.PDAdviceWindow)
	}
	for _, x := range []struct {
		name string
		on   bool
		what string
	}{{"pd_local_prefill_threshold", c.PDLocalPrefillThreshold > 0, "serves short prompts on a decode alone"}, {"pd_local_prefill_auto", c.PDLocalPrefillAuto, "serves short prompts on a decode alone"},
		{"pd_prefill_serves_whole", c.PDPrefillServesWhole, "serves a request whole on an idle prefill"}} {
		if x.on && !c.PDDisaggregation {
			bad("%s needs pd_disaggregation", x.name)
		}
		if x.on && c.PDRequireHandoff {
			bad("%s %s, with no KV handoff, while pd_require_handoff fails any request that has none: choose one", x.name, x.what)
		}
	}
	if c.PDPrefillerAbsent != "decode" && c.PDPrefillerAbsent != "pick" {
		bad("pd_prefiller_absent %q: want decode or pick", c.PDPrefillerAbsent)
	}
	if c.Admission.QueueAnswers != "baton" && c.Admission.QueueAnswers != "smg" {
		bad("admission.queue_answers %q: want baton (503, 504) or smg (429, 408)", c.Admission.QueueAnswers)
	}
	for _, name := range slices.Sorted(maps.Keys(c.Models)) {
		if target := c.Models[name].Serve; target != "" && c.Models[target].Serve != "" {
			bad("models.%s serves %s, which is itself an alias (of %s): name the model the workers serve", name, target, c.Models[target].Serve)
		}
	}
	for _, k := range c.explicitAdminKeys() {
		if k == c.ClientKey() {
			bad("admin keys (admin_api_key, --control-plane-api-keys) must differ from client_api_key: a client with the inference key would control the fleet")
			break
		}
	}
	if c.APIKey != "" && c.WorkerAPIKey != "" && c.APIKey != c.WorkerAPIKey {
		bad("api_key (smg's: the key sent to the engines) and worker_api_key differ: give one of them")
	}
	if c.MetricsPort > 0 && c.MetricsPort == c.Port {
		bad("metrics_port %d must differ from port", c.MetricsPort)
	}
	for _, p := range []struct{ key, val string }{{"policy", c.Policy}, {"prefill_policy", c.PrefillPolicy}, {"decode_policy", c.DecodePolicy}} {
		if (p.val != "" || p.key == "policy") && !slices.Contains(Policies, p.val) {
			hint := ""
			if h, ok := smgPolicyHints[p.val]; ok {
				hint = " — smg's " + p.val + ": " + h
			}
			bad("%s %q is unknown (want one of %s)%s", p.key, p.val, strings.Join(Policies, ", "), hint)
		}
	}
	if _, _, err := ResolveKVConnector(c.KVConnector); err != nil {
		bad("%v", err)
	}
	if c.MaxBufferedBodyBytes/2 < c.MaxPayloadSize {
		bad("max_buffered_body_bytes %d is below twice max_payload_size %d: a body's buffer grows by doubling, so a body of the largest size holds up to twice its size while it arrives, and none could", c.MaxBufferedBodyBytes, c.MaxPayloadSize)
	}
	if c.KVEventsListen != "" {
		if err := CheckKVEventsListen(c.KVEventsListen); err != nil {
			bad("kv_events_listen: %v", err)
		}
	}
	if !slices.Contains([]string{"debug", "info", "warn", "error"}, strings.ToLower(c.LogLevel)) {
		bad("log_level %q is unknown (want debug, info, warn or error)", c.LogLevel)
	}
	if r := c.Retry; r.MaxBackoff < r.InitialBackoff {
		bad("retry.max_backoff %s is below retry.initial_backoff %s", formatDuration(r.MaxBackoff), formatDuration(r.InitialBackoff))
	}
	if !strings.HasPrefix(c.HealthCheck.Endpoint, "/") {
		bad("health_check.endpoint %q must start with /", c.HealthCheck.Endpoint)
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
	errs = append(errs, c.Admission.check()...)
	for name, m := range c.Models {
		if name == "" || strings.TrimSpace(name) != name {
			bad("models: %q is no model name", name)
		}
		for _, pol := range []string{m.Policy, m.PrefillPolicy, m.DecodePolicy} {
			if pol != "" && !slices.Contains(Policies, pol) {
				bad("models.%s: policy %q is unknown (want %s)", name, pol, strings.Join(Policies, ", "))
			}
		}
		for i, f := range m.Fallbacks {
			if f == "" || f == name || c.Served(f) == c.Served(name) {
				bad("models.%s.fallbacks[%d]: %q is no other model", name, i, f)
			}
		}
		for i, f := range m.ContextWindowFallbacks {
			if f == "" || f == name || c.Served(f) == c.Served(name) {
				bad("models.%s.context_window_fallbacks[%d]: %q is no other model", name, i, f)
			}
		}
	}
	seenAdapter := map[string]bool{}
	for i, a := range c.Adapters {
		where := fmt.Sprintf("adapters[%d]", i)
		switch {
		case a.Name == "" || strings.TrimSpace(a.Name) != a.Name || strings.Contains(a.Name, ":"):
			bad("%s: name %q is no adapter name (no spaces around it, no ':')", where, a.Name)
		case a.Path == "":
			bad("%s (%s): give the path the engine loads it from", where, a.Name)
		case a.Base == "" || a.Base == a.Name:
			bad("%s (%s): give its base model", where, a.Name)
		case seenAdapter[a.Name]:
			bad("%s: adapter %q is declared twice", where, a.Name)
		}
		seenAdapter[a.Name] = true
		if _, alias := c.Models[a.Name]; alias {
			bad("%s: %q is also a name of models:", where, a.Name)
		}
	}
	return errors.Join(errs...)
}

// check reports the problems of the per-class settings: unknown classes, reservations that
// leave no slot, sizes below 0.
func (a *Admission) check() []error {
	var errs []error
	known := func(name, where string) bool {
		if slices.Contains(PriorityClasses, name) {
			return true
		}
		errs = append(errs, fmt.Errorf("%s: %q is no priority class (want %s)", where, name, strings.Join(PriorityClasses, ", ")))
		return false
	}
	total := 0
	for name, n := range a.ReservedSlots {
		if known(name, "reserved_slots") {
			if n < 0 {
				errs = append(errs, fmt.Errorf("reserved_slots.%s: %d is below 0", name, n))
			}
			total += n
		}
	}
	if total > 0 && (a.MaxConcurrentRequests <= 0 || total >= a.MaxConcurrentRequests) {
		errs = append(errs, fmt.Errorf("reserved_slots: %d slots reserved need max_concurrent_requests above them (it is %d)", total, a.MaxConcurrentRequests))
	}
	for name, qc := range a.Classes {
		if known(name, "queue_classes") {
			if qc.Size != nil && *qc.Size < 0 {
				errs = append(errs, fmt.Errorf("queue_classes.%s.size: %d is below 0", name, *qc.Size))
			}
			if qc.Timeout < 0 {
				errs = append(errs, fmt.Errorf("queue_classes.%s.timeout: below 0", name))
			}
			if qc.PromoteAfter < 0 {
				errs = append(errs, fmt.Errorf("queue_classes.%s.promote_after: below 0", name))
			}
		}
	}
	return errs
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
	if !slices.Contains([]string{"", PriorityLowerFirst, PriorityHigherFirst}, w.PriorityOrder) {
		bad("priority_order %q is unknown (want lower_first or higher_first)", w.PriorityOrder)
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
	r := resolvedConnectors.Get(setting, func() resolvedConnector {
		mode, variant, err := resolveKVConnector(setting)
		return resolvedConnector{mode, variant, err}
	})
	return r.mode, r.variant, r.err
}

// resolvedConnectors remembers what each connector setting resolved to: pairing asks for every
// request, and a fleet has few settings (one per worker configuration). It is bounded, as
// settings come from configuration and from discovered pods' labels.
var resolvedConnectors = memo.Map[string, resolvedConnector]{Max: 256}

type resolvedConnector struct {
	mode, variant string
	err           error
}

func resolveKVConnector(setting string) (mode, variant string, err error) {
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
	case len(roles) == 0 && c.ServiceDiscovery:
		// Discovery brings the workers.
	case len(roles) == 0 && c.PDDisaggregation:
		out = append(out, "no workers are configured: every request will fail with 503; give prefill workers (--prefill URL) and decode workers (--decode URL)")
	case len(roles) == 0:
		out = append(out, "no workers are configured: every request will fail with 503; give workers with --worker-urls URL... or a workers list in --config")
	case c.PDDisaggregation && roles[RolePrefill] == 0:
		out = append(out, "pd_disaggregation is on but no prefill worker is configured: every generation request will fail with 503; add one with --prefill URL")
	case c.PDDisaggregation && roles[RoleDecode] == 0:
		out = append(out, "pd_disaggregation is on but no decode worker is configured: every generation request will fail with 503; add one with --decode URL")
	}
	if c.PrioritySchedulerConfig != "" && !c.PrioritySchedulerEnabled {
		out = append(out, "--priority-scheduler-config is ignored: as in smg, it is read only with --priority-scheduler-enabled")
	}
	if c.TenantRateLimitConfig != "" && !c.TenantRateLimitEnabled {
		out = append(out, "--tenant-rate-limit-config is ignored: as in smg, it is read only with --tenant-rate-limit-enabled; no tenant limit of it holds")
	}
	if c.StreamStallTimeout > 0 && c.StreamStallTimeout < minSaneStall {
		out = append(out, fmt.Sprintf("--stream-stall-timeout %s is under %s: every stream whose tokens come slower than that (an engine under load, a long prefill of another request sharing its step) is cut and held against its worker's circuit, which can take the fleet out of rotation; was %s meant to be seconds?",
			formatDuration(c.StreamStallTimeout), formatDuration(minSaneStall), formatDuration(c.StreamStallTimeout)))
	}
	return out
}

// minSaneStall is the stream stall timeout under which Baton warns at startup: engines' token
// gaps reach a second under load.
const minSaneStall = time.Second

// CheckWorkerURL reports what is wrong with a worker URL. Credentials in it are refused: a URL
// is shown in headers, logs, metrics and GET /workers, so secrets go in api_key instead. Query
// strings and fragments are refused too: Baton appends route paths to the URL.
func CheckWorkerURL(raw string) error {
	if raw == "" {
		return errors.New("url is required")
	}
	if !strings.Contains(raw, "://") {
		return fmt.Errorf("url has no scheme: add http:// (or https://) in front of it")
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
	case u.Scheme == "grpc" || u.Scheme == "grpcs":
		return fmt.Errorf("url scheme must be http or https: Baton speaks HTTP to the engines (start vLLM or SGLang with their OpenAI-compatible HTTP server, not the gRPC one)")
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
