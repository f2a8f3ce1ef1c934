package config

import (
	"maps"
	"slices"
	"strconv"
	"strings"
)

// smg's command line, for users who replace smg with Baton: each of its flags either works in
// Baton with the same meaning (a Baton flag of the same name, or an alias below), or is refused
// with one line naming Baton's way (smgHints). TestEverySmgFlagWorksOrHints runs the whole list.

// smgAliases are smg's names for Baton's flags of the same meaning.
var smgAliases = map[string]string{
	"prometheus-port":       "metrics-port",
	"cache-match-threshold": "cache-threshold",
	"spill-abs-threshold":   "balance-abs-threshold",
	"spill-rel-threshold":   "balance-rel-threshold",
}

// smgHints are smg's flags Baton has no flag for, each with Baton's way.
var smgHints = map[string]string{
	"prometheus-host":                        "the metrics listener binds --host (keep it off the internet with a NetworkPolicy, or --metrics-port -1 to turn it off)",
	"health-check-port":                      "the probes (/liveness, /readiness, /health) are on the API port; --admin-port gives the admin API a listener of its own",
	"log-dir":                                "Baton logs to stderr (--log-json for JSON lines): collect it with the cluster's log agent",
	"cors-allowed-origins":                   "Baton answers no browser directly: set CORS on the ingress in front of it",
	"request-id-headers":                     "Baton reads X-Request-Id (one, at most 128 visible characters) and passes it to the engines; others are minted",
	"cb-window-duration-secs":                "Baton's breaker opens after --cb-failure-threshold consecutive failures: it has no window",
	"remove-unhealthy-workers":               "an unhealthy worker leaves rotation until it recovers; remove one with DELETE /workers/{id} on the admin API",
	"bootstrap-port-annotation":              "discovery reads the sglang.ai/bootstrap-port annotation, and baton.ai/* for the rest",
	"dp-aware":                               "Baton reads each engine's data parallel size (SGLang /server_info, or the worker's dp_size) and picks a rank per leg itself",
	"dp-minimum-tokens-scheduler":            "Baton picks each leg's DP rank by the cached prefix and the rank's load itself",
	"worker-startup-timeout-secs":            "workers register in the background and are retried (--detect-interval) until they answer; /readiness says which are missing",
	"worker-startup-check-interval":          "use --detect-interval (a duration, e.g. 10s)",
	"worker-startup-delay":                   "workers register in the background from the start; nothing waits for them",
	"enable-trace":                           "use --otlp-traces-endpoint (http(s)://host:4318 or grpc://host:4317), or the OTEL_EXPORTER_OTLP_* variables",
	"rate-limit-tokens-per-second":           "smg's tokens here are request permits, not LLM tokens: a tenant's requests_per_minute is the refill (tenants: limits), --max-concurrent-requests the requests at once",
	"backend":                                "Baton detects each engine's runtime at registration (set runtime on a worker to pin it)",
	"enable-igw":                             "one Baton serves every model of its fleet; there is no separate mode",
	"model-id-from":                          "discovered pods serve the models their engine lists (or the baton.ai/models annotation)",
	"drain-settle-secs":                      "a drained worker leaves once its requests finished; --shutdown-grace-period bounds Baton's own drain",
	"upstream-pool-idle-timeout-secs":        "Baton keeps idle engine connections 4 s, under uvicorn's 5 s keep-alive",
	"upstream-http2":                         "Baton speaks HTTP/1.1 to the engines (their servers do)",
	"prometheus-duration-buckets":            "Baton's histograms have fixed buckets suited to LLM latencies",
	"routing-key-override":                   "no sticky routing keys: prefix_hash or cache_aware keep a conversation on the worker that holds its prefix",
	"sticky-sessions":                        "no sticky routing keys: prefix_hash or cache_aware keep a conversation on the worker that holds its prefix",
	"routing-key-headers":                    "no sticky routing keys: prefix_hash or cache_aware keep a conversation on the worker that holds its prefix",
	"assignment-mode":                        "smg's manual policy is not Baton's: use prefix_hash",
	"max-idle-secs":                          "smg's manual policy is not Baton's: use prefix_hash",
	"sticky-key-idle-secs":                   "smg's manual policy is not Baton's: use prefix_hash",
	"block-size":                             "cache_aware indexes 64-byte prompt blocks, or the engines' own blocks with --kv-events",
	"cache-index":                            "cache_aware's index is a block index; --kv-events reads the engines' own",
	"cache-ttl-secs":                         "use --eviction-interval (a duration, e.g. 3m)",
	"cache-boundaries":                       "cache_aware splits prompts into fixed blocks",
	"overlap-decay":                          "cache_aware weighs cache and load by --cache-load-cost",
	"selection-temperature":                  "cache_aware picks the cheapest worker, ties by load",
	"balance-token-usage-threshold":          "cache_aware balances by --balance-abs-threshold and --balance-rel-threshold",
	"overload-token-usage-threshold":         "cache_aware balances by --balance-abs-threshold and --balance-rel-threshold",
	"least-load-kv-pressure-weight":          "least_load reads each engine's running and waiting requests (--load-poll-interval)",
	"least-load-mean-prefill-tokens":         "least_load reads each engine's running and waiting requests (--load-poll-interval)",
	"least-load-default-throughput":          "least_load reads each engine's running and waiting requests (--load-poll-interval)",
	"least-load-max-waiting-requests":        "least_load reads each engine's running and waiting requests (--load-poll-interval)",
	"prefix-hash-balance-abs-threshold":      "prefix_hash moves on along its ring past --prefix-hash-load-factor times the mean load",
	"worker-overload-protection":             "bound load with --max-concurrent-requests and --queue-size; unhealthy workers leave rotation",
	"worker-overload-token-usage":            "bound load with --max-concurrent-requests and --queue-size; unhealthy workers leave rotation",
	"worker-overload-waiting-requests":       "bound load with --max-concurrent-requests and --queue-size; unhealthy workers leave rotation",
	"grpc-mode":                              "Baton speaks HTTP to the engines",
	"load-monitor-interval":                  "use --load-poll-interval (a duration, e.g. 10s)",
	"data-parallel-size":                     "Baton launches no engines (smg serve): start them yourself and give --worker-urls (Baton reads each one's data parallel size)",
	"connection-mode":                        "Baton launches no engines (smg serve) and speaks HTTP to the engines it is given",
	"served-model-name":                      "use --model-alias NAME=MODEL for each name clients may use (smg's older releases' flag)",
	"worker-auto-recovery":                   "an unhealthy worker leaves rotation until it recovers; remove one with DELETE /workers/{id} on the admin API",
	"runtime":                                "Baton detects each engine's runtime at registration (set runtime on a worker to pin it)",
	"disable-load-monitoring":                "set --load-poll-interval 0 to read no engine's /metrics (least_load and the picker's shedding then see Baton's own counts only)",
	"engine-metrics":                         "Baton reads each engine's /metrics every --load-poll-interval (vLLM's and SGLang's names both)",
	"kv-indexer-ttl-secs":                    "--kv-events reads the engines' own KV events; the approximate index forgets after --eviction-interval",
	"kv-indexer-max-entries":                 "the KV index is bounded by a quarter of the memory limit (cgroup), not by a count",
	"job-queue-capacity":                     "workers register in the background, one goroutine each; nothing queues",
	"job-queue-concurrency":                  "workers register in the background, one goroutine each; nothing queues",
	"zmq-engine-count":                       "Baton speaks HTTP to the engines, and reads KV events over ZMQ with --kv-events",
	"upstream-http2-only":                    "Baton speaks HTTP/1.1 to the engines (their servers do)",
	"epd-disaggregation":                     "encode/prefill/decode (multimodal encoders) is out of Baton's scope: it disaggregates prefill and decode",
	"encode-policy":                          "encode/prefill/decode (multimodal encoders) is out of Baton's scope: it disaggregates prefill and decode",
	"encode":                                 "encode/prefill/decode (multimodal encoders) is out of Baton's scope: it disaggregates prefill and decode (--prefill, --decode)",
	"encode-selector":                        "encode/prefill/decode (multimodal encoders) is out of Baton's scope: it disaggregates prefill and decode",
	"multimodal-tensor-transport":            "Baton relays multimodal bodies as they are; the engines process them",
	"multimodal-shm-min-bytes":               "Baton relays multimodal bodies as they are; the engines process them",
	"router-selector":                        "replicas share nothing and need not find each other: no mesh, no router discovery",
	"enable-mesh":                            "replicas share nothing: each discovers the same pods and reads the same engines (tenants' counts shared through --rate-limit-store)",
	"mesh-server-name":                       "replicas share nothing: each discovers the same pods and reads the same engines (tenants' counts shared through --rate-limit-store)",
	"mesh-host":                              "replicas share nothing: each discovers the same pods and reads the same engines (tenants' counts shared through --rate-limit-store)",
	"mesh-advertise-host":                    "replicas share nothing: each discovers the same pods and reads the same engines (tenants' counts shared through --rate-limit-store)",
	"mesh-port":                              "replicas share nothing: each discovers the same pods and reads the same engines (tenants' counts shared through --rate-limit-store)",
	"mesh-peer-urls":                         "replicas share nothing: each discovers the same pods and reads the same engines (tenants' counts shared through --rate-limit-store)",
	"webrtc-bind-addr":                       "Baton serves HTTP only: no WebRTC",
	"webrtc-stun-server":                     "Baton serves HTTP only: no WebRTC",
	"runtime-worker-threads":                 "Go schedules on GOMAXPROCS threads (the container's CPU limit)",
	"storage-context-headers":                "Baton stores no conversations: no storage hooks",
	"history-backend":                        "Baton stores no conversations (the Responses API's store is the engine's): no history backend",
	"redis-url":                              "Baton stores no conversations; tenants' limits are shared through --rate-limit-store redis://HOST:PORT/DB",
	"redis-pool-max-size":                    "Baton stores no conversations; tenants' limits are shared through --rate-limit-store redis://HOST:PORT/DB",
	"redis-retention-days":                   "Baton stores no conversations; tenants' limits are shared through --rate-limit-store redis://HOST:PORT/DB",
	"postgres-db-url":                        "Baton stores no conversations: no history backend",
	"postgres-pool-max-size":                 "Baton stores no conversations: no history backend",
	"oracle-wallet-path":                     "Baton stores no conversations: no history backend",
	"oracle-tns-alias":                       "Baton stores no conversations: no history backend",
	"oracle-dsn":                             "Baton stores no conversations: no history backend",
	"oracle-user":                            "Baton stores no conversations: no history backend",
	"oracle-password":                        "Baton stores no conversations: no history backend",
	"oracle-external-auth":                   "Baton stores no conversations: no history backend",
	"oracle-pool-min":                        "Baton stores no conversations: no history backend",
	"oracle-pool-max":                        "Baton stores no conversations: no history backend",
	"oracle-pool-timeout-secs":               "Baton stores no conversations: no history backend",
	"schema-config":                          "Baton stores no conversations: no history backend",
	"enable-wasm":                            "no WASM plugins: Baton's middle is Go (docs/ARCHITECTURE.md)",
	"storage-hook-wasm-path":                 "no WASM plugins: Baton's middle is Go (docs/ARCHITECTURE.md)",
	"model-path":                             "Baton does not tokenize or template prompts itself: the engines do (cache_aware asks their /tokenize)",
	"model":                                  "Baton does not tokenize or template prompts itself: the engines do (cache_aware asks their /tokenize)",
	"tokenizer-path":                         "Baton does not tokenize or template prompts itself: the engines do (cache_aware asks their /tokenize)",
	"chat-template":                          "Baton does not template prompts: the engine applies its own chat template",
	"disable-tokenizer-autoload":             "Baton loads no tokenizer: the engines tokenize (cache_aware asks their /tokenize)",
	"tokenizer-cache-enable-l0":              "Baton loads no tokenizer; the engines' /tokenize answers are cached (4,096 prompts, 64 MiB)",
	"tokenizer-cache-l0-max-entries":         "Baton loads no tokenizer; the engines' /tokenize answers are cached (4,096 prompts, 64 MiB)",
	"tokenizer-cache-enable-l1":              "Baton loads no tokenizer; the engines' /tokenize answers are cached (4,096 prompts, 64 MiB)",
	"tokenizer-cache-l1-max-memory":          "Baton loads no tokenizer; the engines' /tokenize answers are cached (4,096 prompts, 64 MiB)",
	"reasoning-parser":                       "start the engine with its own --reasoning-parser: Baton relays its answers as they are",
	"tool-call-parser":                       "start the engine with its own --tool-call-parser: Baton relays its answers as they are",
	"mcp-config-path":                        "Baton runs no tools (MCP): the client or an agent framework does",
	"stream-request-bodies-over":             "Baton reads every request body whole, bounded by --max-payload-size and --max-buffered-body-bytes, so that it can be retried",
	"stream-body-stall-timeout-secs":         "use --body-timeout-secs (a body that stalls or does not arrive in time is 408)",
	"jwt-issuer":                             "no JWT: the admin API takes --admin-api-key, clients the tenants' keys (docs/REFERENCE.md: Security)",
	"jwt-audience":                           "no JWT: the admin API takes --admin-api-key, clients the tenants' keys (docs/REFERENCE.md: Security)",
	"jwt-jwks-uri":                           "no JWT: the admin API takes --admin-api-key, clients the tenants' keys (docs/REFERENCE.md: Security)",
	"jwt-role-claim":                         "no JWT: the admin API takes --admin-api-key, clients the tenants' keys (docs/REFERENCE.md: Security)",
	"jwt-role-mapping":                       "no JWT: the admin API takes --admin-api-key, clients the tenants' keys (docs/REFERENCE.md: Security)",
	"disable-audit-logging":                  "every admin API change is logged (fleet: worker added/updated/removed) and counted in baton_fleet_changes_total",
	"priority-scheduler-tenant-metric-top-n": "the tenant label takes only the configuration's tenants' names: bounded by the configuration",
}

// smgPolicyHints name Baton's policy for smg's policies Baton has not.
var smgPolicyHints = map[string]string{
	"manual":             "use prefix_hash (a prompt's prefix keeps its worker)",
	"consistent_hashing": "use prefix_hash (a consistent hash ring over the prompt's prefix)",
	"bucket":             "use cache_aware or least_load",
	"passthrough":        "use round_robin",
}

// unknownFlag explains a flag Baton does not know: smg's with Baton's way, or the nearest
// Baton flag's name.
func unknownFlag(name string, known map[string]*flag) string {
	if hint, ok := smgHints[name]; ok {
		return "unknown flag --" + name + " (smg's): " + hint
	}
	if near := nearest(name, known); near != "" {
		return "unknown flag --" + name + ": did you mean --" + near + "?"
	}
	return "unknown flag --" + name
}

// nearest returns the name among known's keys closest to name (within two edits), "" when
// none is: the suggestion for an unknown flag or YAML key.
func nearest[V any](name string, known map[string]V) string {
	best, bestD := "", 3
	for _, k := range slices.Sorted(maps.Keys(known)) {
		if d := editDistance(name, k); d < bestD {
			best, bestD = k, d
		}
	}
	return best
}

func editDistance(a, b string) int {
	if len(a) > 64 || len(b) > 64 {
		return 99
	}
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

// splitURLs splits smg's comma-separated --worker-urls a,b into its URLs.
func splitURLs(vals []string) []string {
	var out []string
	for _, v := range vals {
		for part := range strings.SplitSeq(v, ",") {
			if part = strings.TrimSpace(part); part != "" {
				out = append(out, part)
			}
		}
	}
	return out
}

// SmgDifferences names the settings in effect in c whose value is Baton's default where smg's
// default differs, each as "key=value (smg: …)": said once at startup, so that a command line
// taken from smg does not change behaviour unseen.
func SmgDifferences(c Config) []string {
	var out []string
	if c.Policy == defaults.Policy {
		out = append(out, "policy="+c.Policy+" (smg: cache_aware)")
	}
	if c.usesPolicy(PolicyCacheAware) && c.MaxTreeSize == defaults.MaxTreeSize {
		out = append(out, "max_tree_size="+strconv.Itoa(c.MaxTreeSize)+" prompt characters for the whole index (smg: 67108864, per worker)")
	}
	if c.ServiceDiscovery && c.ServiceDiscoveryPort == defaults.ServiceDiscoveryPort {
		out = append(out, "service_discovery_port="+strconv.Itoa(c.ServiceDiscoveryPort)+" (smg: 80)")
	}
	if c.ServiceDiscovery && c.ServiceDiscoveryNamespace == "" {
		out = append(out, "service_discovery_namespace=Baton's own (smg: every namespace)")
	}
	if c.Admission.MaxConcurrentRequests > 0 && c.Admission.QueueAnswers == defaults.Admission.QueueAnswers {
		out = append(out, "queue_answers=baton: past --queue-size 503 queue_full, past --queue-timeout 504 queue_timeout, both with Retry-After (smg: 429 and 408; --queue-answers smg)")
	}
	if c.Admission.MaxConcurrentRequests > 0 && c.DefaultMaxPriority == defaults.DefaultMaxPriority {
		out = append(out, "priority_scheduler_default_max_class="+c.DefaultMaxPriority+" (smg: default)")
	}
	if slices.ContainsFunc(c.Tenants, func(t Tenant) bool {
		return t.Limits != nil && t.Limits.TokensPerMinute != nil || slices.ContainsFunc(t.ModelLimits, func(l Limits) bool { return l.TokensPerMinute != nil })
	}) {
		out = append(out, "tokens_per_minute reserves each request's own cap (max_tokens; one written into a request naming none, within the tenant's bucket) and a request past the whole bucket is 429 tenant_request_too_large (smg: reserves the prompt's estimate and settles after)")
	}
	if c.PrioritySchedulerEnabled && c.PrioritySchedulerConfig == "" {
		out = append(out, "priority classes reserve no slots unless reserved_slots (or smg's file) says so (smg: system 32, interactive max(128, 25%), default 10% of capacity)")
	}
	return append(out, c.smgNotes...)
}

// usesPolicy reports whether any role's policy is name.
func (c *Config) usesPolicy(name string) bool {
	return c.Policy == name || c.PolicyFor(RolePrefill) == name || c.PolicyFor(RoleDecode) == name
}
