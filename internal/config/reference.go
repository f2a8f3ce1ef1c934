package config

import (
	"reflect"
	"strings"
)

// A refRow is one row of a settings table of docs/REFERENCE.md: the settings it documents (by
// YAML key) and what they mean. Its flag, YAML key and default cells are rendered from the
// settings' tags (a duration's integer spelling and a secret's -file flag included); Flag, Key
// and Default, when set, replace a cell the tags cannot say (one of the command's own flags, a
// YAML section with no flag, a default taken from the environment or from another setting).
type refRow struct {
	Keys               []string
	Flag, Key, Default string
	Meaning            string
}

// referenceTables are the settings tables of docs/REFERENCE.md, in order — the first of the
// top-level settings, the second of the sections' (retry, circuit breaker, health checks,
// admission) — the rows their meanings are declared in (TestReferenceTablesAreGenerated fails
// when the document drifts; BATON_UPDATE_DOCS=1 go test ./internal/config writes it). A setting
// with a flag and no row here is rendered at the end of its table, its help tag as its meaning.
var referenceTables = [...][]refRow{
	{
		{Flag: "`--config FILE`", Key: "—", Default: "—", Meaning: "YAML configuration file"},
		{Keys: []string{"host"}, Meaning: "address to bind"},
		{Keys: []string{"port"}, Meaning: "API port (0 picks a free one)"},
		{Keys: []string{"tls_cert_path", "tls_key_path"}, Meaning: "serve the API (and the admin API's own listener) over TLS with this PEM certificate chain and key, on both HTTP servers; both or neither; re-read on every reload — SIGHUP, `--watch-config`'s change of the `--config` file, and a change of the certificate files themselves (checked every 2 s) — so that a renewed certificate is served without a restart; one that cannot be read keeps the one served and makes the reload `partial`"},
		{Keys: []string{"metrics_port"}, Meaning: "Prometheus `/metrics` port (-1 disables)"},
		{Keys: []string{"worker_urls"}, Meaning: "regular workers by URL"},
		{Keys: []string{"admin_api_key"}, Meaning: "key of the admin API (also from a file, or `BATON_ADMIN_API_KEY`) (worker routes); without it the admin API answers only on a loopback listener of its own (see Changing the fleet)"},
		{Flag: "`--control-plane-api-keys`", Key: "—", Default: "—", Meaning: "`ID:NAME:admin:KEY`, smg's form of an admin API key (repeatable; also `CONTROL_PLANE_API_KEYS`, entries separated by commas, as smg reads it): as `--admin-api-key`; smg's `user` role is refused (Baton's admin API has one role)"},
		{Keys: []string{"admin_host", "admin_port"}, Meaning: "the admin API's own listener (-1: on the API port)"},
		{Keys: []string{"watch_config"}, Meaning: "re-read the `--config` file when it changes, as `SIGHUP` does"},
		{Keys: []string{"otlp_traces_endpoint"}, Default: "`OTEL_*`, else off", Meaning: "send traces: `http(s)://host:port` (OTLP/HTTP) or `grpc://host:port`, or smg's `host:port` (OTLP/gRPC) (see Observability)"},
		{Keys: []string{"trace_sample_ratio"}, Meaning: "share of new traces sampled"},
		{Keys: []string{"access_log"}, Meaning: "one info line per request"},
		{Keys: []string{"service_discovery"}, Meaning: "find workers among Kubernetes pods (see Running on Kubernetes)"},
		{Keys: []string{"selector", "prefill_selector", "decode_selector"}, Meaning: "pod labels of regular, prefill and decode workers: `key=value` pairs separated by spaces or commas, all must match"},
		{Keys: []string{"service_discovery_namespace"}, Default: "Baton's own", Meaning: "namespace of the worker pods"},
		{Keys: []string{"service_discovery_port"}, Meaning: "the workers' API port on their pods"},
		{Keys: []string{"kubeconfig"}, Default: "in-cluster", Meaning: "kubeconfig for discovery outside the cluster"},
		{Keys: []string{"inference_pool"}, Meaning: "the workers are the pods this InferencePool (`inference.networking.k8s.io/v1`) selects, on its target ports, in `--service-discovery-namespace` (see Baton behind a Gateway API gateway)"},
		{Keys: []string{"grpc_port"}, Meaning: "`baton epp`: port of the Endpoint Picker's ext_proc and gRPC health services"},
		{Keys: []string{"grpc_health_port"}, Meaning: "`baton epp`: plaintext port of the gRPC health services alone, for the kubelet's gRPC probes (which speak no TLS); `-1`: none"},
		{Keys: []string{"epp_secure_serving"}, Meaning: "`baton epp`: TLS on the gRPC port, as the reference picker serves it; with no certificate given, a self-signed one made at startup (the Gateway API implementations connect without verifying it)"},
		{Keys: []string{"epp_tls_cert_path", "epp_tls_key_path"}, Meaning: "`baton epp`: the gRPC port's certificate and key (PEM), re-read when the files change"},
		{Keys: []string{"epp_client_ca_path"}, Meaning: "`baton epp`: require a client certificate signed by this CA on the gRPC port (mTLS): only the gateway holding one reaches the picker"},
		{Keys: []string{"epp_max_streams", "epp_max_streams_per_connection", "epp_max_connections"}, Meaning: "`baton epp`: exchanges at once in all (past it a new stream ends at once with `RESOURCE_EXHAUSTED`), on one connection (HTTP/2's max concurrent streams), and connections at once (past it one is closed); each refusal counted in `baton_epp_cut_total`"},
		{Keys: []string{"epp_fallbacks"}, Meaning: "`baton epp`: endpoints named after each choice, least loaded first, for the gateway to retry down"},
		{Keys: []string{"epp_shed_queue_depth", "epp_shed_kv_usage"}, Meaning: "`baton epp`: a `batch`-class request is shed (429) when every worker that could serve it queues this many requests or uses this share of its KV cache (0: that measure off)"},
		{Keys: []string{"policy"}, Meaning: "a policy of the table in Routing policies, each registered one listed there"},
		{Keys: []string{"load_poll_interval"}, Meaning: "how often each engine's `/metrics` is read for its load; a reading older than three intervals is ignored"},
		{Keys: []string{"prefix_token_count"}, Meaning: "`prefix_hash`: how much of the prompt it hashes (×4 characters)"},
		{Keys: []string{"prefix_hash_load_factor"}, Meaning: "`prefix_hash`: a worker loaded above this times the mean is passed over"},
		{Keys: []string{"kv_events"}, Meaning: "subscribe to every worker's KV events at its `kv_events_endpoint` or `tcp://<host>:5557` (see KV events)"},
		{Keys: []string{"kv_events_listen"}, Meaning: "also listen for KV events from engines that connect out (`tcp://host:port`, `*` for every interface; see KV events)"},
		{Keys: []string{"cache_aware_source"}, Meaning: "where `cache_aware` learns what engines hold: `auto` and `events` (their KV events where subscribed, else Baton's approximate index) or `approx` (the approximate index only; see KV events)"},
		{Keys: []string{"route_header"}, Meaning: "add `X-Baton-Route` to responses: per choice the role, policy, reason, the worker's load and (`cache_aware`) the share of the prompt found cached"},
		{Keys: []string{"cache_threshold"}, Meaning: "`cache_aware`: share of the prompt that must be cached on a worker to follow the cache"},
		{Keys: []string{"cache_load_cost"}, Meaning: "`cache_aware`: 64-byte prompt blocks one request of load is worth"},
		{Keys: []string{"balance_abs_threshold", "balance_rel_threshold"}, Meaning: "`cache_aware`: balance load instead when the busiest worker is above both bounds of the idlest"},
		{Keys: []string{"eviction_interval"}, Meaning: "`cache_aware`: forget a prefix not routed for this long"},
		{Keys: []string{"max_tree_size"}, Meaning: "`cache_aware`: bound of the prefix index, in prompt characters"},
		{Keys: []string{"pd_disaggregation"}, Meaning: "prefill/decode disaggregation for generation routes"},
		{Flag: "`--prefill URL [PORT\\|none] [CONNECTOR]`", Key: "`workers` with `role: prefill`", Default: "—", Meaning: "a prefill worker, its bootstrap port and its KV connector (`nixl`, `mooncake` or vLLM's name; default `--kv-connector`) (repeatable)"},
		{Flag: "`--decode URL [CONNECTOR]`", Key: "`workers` with `role: decode`", Default: "—", Meaning: "a decode worker and its KV connector (repeatable); `GET /workers` and the status page show every vLLM worker's connector"},
		{Keys: []string{"prefill_policy", "decode_policy"}, Default: "`--policy`", Meaning: "policy of each leg"},
		{Keys: []string{"kv_connector"}, Meaning: "connector of vLLM prefill workers that configure none (`NixlConnector`, `MooncakeConnector`)"},
		{Keys: []string{"pd_require_handoff"}, Meaning: "strict mode: a request whose decode would recompute fails with 502"},
		{Keys: []string{"pd_local_prefill_threshold"}, Meaning: "conditional disaggregation: a PD request whose prompt has fewer uncached tokens than this on its chosen decode (the decode is chosen first; its uncached share from the engines' KV events where subscribed, else `cache_aware`'s index, else the whole prompt; tokens from the tokenizer's cached count, else the ids of a prompt given as token ids, else its bytes when they are under the threshold, else the chosen decode's count of it (`/tokenize`, the parts it cannot count in bytes), else its bytes) is served by that decode alone, computing the prompt (`X-Baton-Kv-Handoff: none-local-prefill`, class `by_design`, `baton_pd_local_prefill_total`); `0` always splits by length. Once the advisor has fitted the prefill's rate, a request also goes to its decode alone when no prefill it could use would start it sooner than the decode would finish it (the requests each has in flight × their mean prefill compute, against the prompt's compute and one decode step), when that compute is within `pd_advice_tpot_slo` and the decode within it at its batch. SGLang decodes never serve alone (they refuse a request without a bootstrap room). Not with `pd_require_handoff`"},
		{Keys: []string{"pd_prefill_serves_whole"}, Meaning: "the mirror case: once the PD advisor has fitted the decodes' pace, a PD request whose chosen decode would give a token slower than `pd_advice_tpot_slo` at the batch it holds goes whole to a vLLM prefill worker with nothing in flight, which decodes it too (`X-Baton-Kv-Handoff: none-prefill-whole`, class `by_design`, `baton_pd_prefill_whole_total`, the status page); never an SGLang prefill; a busy decode only (an idle one is as fast as any worker). Not with `pd_require_handoff`, nor in `baton epp`"},
		{Keys: []string{"pd_local_prefill_auto"}, Meaning: "the threshold follows the PD advisor: every 10 s, its recommendation for the fleet's current decode workers (`pd_local_prefill_threshold` is the starting value; while the advisor has fewer than 40 prefill legs to fit from, one request in ten under it is split anyway; while it cannot fit, the last one holds); the status page and `GET /pd/advice` show the threshold in force. Not with `pd_require_handoff`, nor in `baton epp` (the picker sees no prefill leg to fit from)"},
		{Keys: []string{"pd_advice_window"}, Meaning: "how far back the PD advisor fits from (at most its last 20,000 requests; from 10s to 1h): shorter follows a changing load sooner and leaves a start's cold caches behind sooner, longer is steadier"},
		{Keys: []string{"pd_advice_ttft_slo", "pd_advice_tpot_slo"}, Meaning: "the SLOs the PD advisor sizes the fleet for (`baton_pd_recommended_workers`, the status page); `GET /pd/advice` takes others"},
		{Keys: []string{"pd_prefiller_header"}, Meaning: "decode-side sidecar of an Endpoint Picker: a PD request's `x-prefiller-host-port` names its prefill — the first of the host:port it lists (comma-separated, or the header repeated) that is one of the prefill workers (see Baton behind a Gateway API gateway)"},
		{Keys: []string{"pd_prefiller_absent"}, Meaning: "the sidecar's request without `x-prefiller-host-port`: `decode` sends it to the decode worker alone, as llm-d's sidecar does (the picker chose so: a short prompt, a prefix the decode holds; `X-Baton-Kv-Handoff: none-local-prefill`, class `by_design`); `pick` has Baton choose a prefill"},
		{Keys: []string{"pd_mooncake_dispatch"}, Meaning: "Mooncake legs at once (`concurrent`) or prefill first (`sequential`)"},
		{Keys: []string{"request_timeout"}, Meaning: "bound on one request from arrival to its last byte, streams and writes to the client included (504 past it)"},
		{Keys: []string{"max_payload_size"}, Meaning: "largest request body in bytes (413 past it): 32 MiB holds a million-token context (≈ 4 MB of text) with a few base64 images; raise it for `prompt_embeds` tensors or large batches"},
		{Keys: []string{"max_buffered_body_bytes"}, Meaning: "request body bytes held at once over every request, counting a buffer and the one it grows into while both live; past it a body still arriving is refused (503 `overloaded`, `Retry-After: 1`) before more of it is read. At least twice `max_payload_size`"},
		{Keys: []string{"gc_heap_floor"}, Meaning: "the heap size at which Go's collector runs its next cycle while the live heap is small: after each cycle Baton sets the collector's percent (`go_gc_gogc_percent`, which therefore moves) so that the next is due at the floor (`go_memstats_next_gc_bytes`), never under `GOGC` and never over ten times it (with a live heap of a few MiB ten times `GOGC` reaches about 40 MiB: a larger floor is reached only as the live heap grows); once the live heap is large enough for `GOGC` to reach the floor, `GOGC` alone paces it, and `GOMEMLIMIT` (the chart's) caps every cycle. A gateway keeps a few MiB live while each request allocates a few KiB that die with it: at `GOGC` alone the collector runs dozens of times a second under load (see docs/BENCHMARKS.md, The collector's pace). At most a quarter of the memory limit (the smaller of `GOMEMLIMIT` and the container's cgroup limit): lowered to it with a warning at startup. The startup log says whether the floor is used: not with `GOGC=off` or `GOGC=0` (left alone), nor when it is under what `GOGC` alone reaches (4 MiB × `GOGC`/100). 0: `GOGC` alone"},
		{Keys: []string{"body_timeout"}, Meaning: "a request body must arrive whole within this (408 past it), however steadily it trickles"},
		{Keys: []string{"max_batch_size"}, Meaning: "largest `n` (and `best_of`, `/generate`'s `sampling_params.n`), and most prompts in one request (`prompt` and `prompt_embeds` lists, `/generate` batches), on every route (400 `batch_too_large` past it)"},
		{Keys: []string{"stalled_client_timeout"}, Meaning: "a client that sends no body bytes (408) or accepts no response bytes for this long is dropped"},
		{Keys: []string{"client_api_key"}, Meaning: "require `Authorization: Bearer <key>` on API routes (health routes stay open): the fleet's one client's key (tenant `default`'s; `tenants:` gives each team its own); also from a file or `BATON_CLIENT_API_KEY`. Baton's key: never sent to an engine"},
		{Keys: []string{"api_key"}, Meaning: "smg's meaning, all three of its parts: the key sent to every engine as `Authorization: Bearer <key>`, as `--worker-api-key` (they may not differ); the key clients must send (tenant `default`'s) unless `--client-api-key` gives theirs; and the admin API's unless `--admin-api-key` or `--control-plane-api-keys` give its own; also from a file or `BATON_API_KEY`"},
		{Keys: []string{"default_model"}, Meaning: "the model of a request that names none; without it such a request is 400 `model_required` (SGLang's `/generate`, which names none, still goes to any worker)"},
		{Flag: "`--model-alias`", Key: "`models.<ALIAS>.serve`", Default: "—", Meaning: "`ALIAS=MODEL`: a name clients may use for a model the workers serve (repeatable; smg's model-card alias, vLLM's `--served-model-name` seen from the gateway). See [Models, aliases and adapters](#models-aliases-and-adapters)"},
		{Keys: []string{"adapter_affinity"}, Meaning: "send a LoRA adapter's requests to workers with it running, then loaded, then with a free adapter slot, before the model's policy chooses among them (live on reload)"},
		{Keys: []string{"unload_lru"}, Meaning: "when the chosen SGLang worker holds its `--max-loaded-loras` (read from its `/server_info`), or refuses a load for room, unload its least recently used adapter with nothing in flight and load again (live on reload); vLLM never refuses a load for room, so nothing is unloaded from it"},
		{Keys: []string{"adapter_load_timeout"}, Meaning: "an adapter load (and the unload making room for it) must finish within this; the requests waiting on it then get 503 `adapter_load_failed` (live on reload)"},
		{Flag: "`--tenant-api-key`", Key: "—", Default: "—", Meaning: "`TENANT:KEY`, a tenant's key (repeatable; smg's form). Prefer the hashed `keys` of the `tenants:` section ([Tenants and limits](#tenants-and-limits))"},
		{Keys: []string{"trust_tenant_header", "tenant_header_name"}, Meaning: "smg's: where no tenant has a key, a request carrying the header is the tenant its value names (a configured tenant's name, which then needs no key; 401 for another name — smg makes any value a tenant of its own); where tenants have keys the key names the tenant and the header is removed unread, as in smg. Only behind a proxy that sets or strips the header (a WARN at startup says which of the two holds)"},
		{Keys: []string{"rate_limit_store"}, Meaning: "where tenants' limits are counted: `memory` (this replica) or `redis://[:PASSWORD@]HOST:PORT/DB` shared by replicas (`rediss://` for TLS; the password also from `REDIS_PASSWORD`; the URL also from `BATON_RATE_LIMIT_STORE`)"},
		{Keys: []string{"rate_limit_store_failure"}, Meaning: "Redis unreachable: `open` serves and counts in this replica (a warning a minute, `baton_rate_limit_store_up` 0), `closed` answers 503 `rate_limit_store_unavailable`"},
		{Keys: []string{"rate_limit_store_timeout"}, Meaning: "deadline of one call to the Redis store"},
		{Keys: []string{"tenant_max_tokens_estimate"}, Meaning: "the completion cap a request of a tenant under a token limit gets written into its body when it names none (chat, responses; completions get OpenAI's 16, `/generate` SGLang's 128); without a token limit, the completion tokens a request is estimated at for fairness (at most)"},
		{Keys: []string{"worker_api_key"}, Meaning: "the key sent to every engine, discovered pods included (a worker's own `api_key` wins); also from a file or `BATON_WORKER_API_KEY`"},
		{Keys: []string{"log_level"}, Meaning: "`debug`, `info`, `warn`, `error`"},
		{Keys: []string{"log_json"}, Meaning: "JSON log lines"},
		{Keys: []string{"shutdown_grace_period"}, Meaning: "how long in-flight requests and streams may drain after SIGTERM"},
		{Keys: []string{"read_header_timeout"}, Meaning: "a client must send its request headers within this"},
		{Keys: []string{"idle_timeout"}, Meaning: "idle keep-alive client connections close after this; streams are never cut"},
		{Keys: []string{"upstream_client"}, Meaning: "HTTP client to the engines: `net` (Go's net/http transport: it watches idle connections and drops one an engine writes to unasked) or `baton` (Baton's own HTTP/1.1 client: less memory per open stream; it checks a connection for pending bytes just before it writes a request on it, rather than watching it while idle)"},
		{Keys: []string{"http_server"}, Meaning: "server of the API listener: `baton` (Baton's own HTTP/1.1 server, Linux; elsewhere `net` is used) or `net` (Go's net/http)"},
		{Keys: []string{"enable_pprof"}, Meaning: "serve `/debug/pprof/` on the metrics port"},
		{Keys: []string{"forward_sim_faults"}, Meaning: "forward a client's `X-Sim-Fault` header to the workers (tests, demos)"},
		{Keys: []string{"detect_interval"}, Meaning: "longest wait between registration attempts for an engine that is not up yet"},
	},
	{
		{Keys: []string{"retry.max_retries"}, Meaning: "attempts in total, the first included"},
		{Keys: []string{"retry.initial_backoff"}, Meaning: "first wait"},
		{Keys: []string{"retry.max_backoff"}, Meaning: "longest wait"},
		{Keys: []string{"retry.backoff_multiplier"}, Meaning: "growth per attempt"},
		{Keys: []string{"retry.jitter_factor"}, Meaning: "± randomness of each wait"},
		{Keys: []string{"retry.disable"}, Meaning: "one attempt"},
		{Keys: []string{"circuit_breaker.failure_threshold"}, Meaning: "consecutive failures that open a worker's circuit"},
		{Keys: []string{"circuit_breaker.success_threshold"}, Meaning: "half-open probes (and successes) that close it"},
		{Keys: []string{"circuit_breaker.timeout_duration"}, Meaning: "time open before half-open"},
		{Keys: []string{"circuit_breaker.disable"}, Meaning: "never open"},
		{Keys: []string{"health_check.interval"}, Meaning: "time between probes of a worker"},
		{Keys: []string{"health_check.timeout"}, Meaning: "one probe's timeout"},
		{Keys: []string{"health_check.failure_threshold"}, Meaning: "failed probes that take a worker out"},
		{Keys: []string{"health_check.success_threshold"}, Meaning: "good probes that bring it back"},
		{Keys: []string{"health_check.endpoint"}, Meaning: "path probed"},
		{Keys: []string{"health_check.disable"}, Meaning: "no probes"},
		{Keys: []string{"admission.max_concurrent_requests"}, Meaning: "inference requests at once (-1: no limit)"},
		{Keys: []string{"admission.queue_size"}, Meaning: "requests that may wait for a slot, per priority class"},
		{Keys: []string{"admission.queue_timeout"}, Meaning: "longest wait for a slot, per priority class"},
		{Flag: "—", Key: "`admission.queue_classes`", Default: "—", Meaning: "per class: `{batch: {size: 1000, timeout: 10m, promote_after: 2m}}` (`promote_after`: that class's own `queue_promote_after`)"},
		{Flag: "—", Key: "`admission.reserved_slots`", Default: "—", Meaning: "slots kept for a class and those above it: `{critical: 8}`"},
		{Keys: []string{"admission.no_worker_wait"}, Meaning: "hold a request for a known model without a ready worker this long for one to become ready (scale from zero); 0: 503 at once"},
		{Keys: []string{"admission.queue_promote_after"}, Meaning: "a request waiting this long moves up one priority class (0: never)"},
		{Keys: []string{"admission.queue_retry_after"}, Meaning: "`Retry-After` of the queue's refusals (a full queue, a wait past its timeout, a drain), rounded up to seconds; `0s`: a tenth of `queue_timeout`, at least 1 s. Clients' SDKs wait this long before trying again"},
		{Keys: []string{"admission.queue_answers"}, Meaning: "the statuses of a full queue and of a wait past its timeout: `baton` (503 `queue_full`, 504 `queue_timeout`) or `smg` (429 and 408, as smg's priority scheduler answers); `Retry-After` either way"},
		{Keys: []string{"default_max_priority"}, Meaning: "the highest priority class of a tenant whose configuration gives no `max_priority`, and of every request where no tenant has keys (smg's `system` and `bulk` are `critical` and `batch`)"},
		{Keys: []string{"priority_scheduler_enabled"}, Meaning: "smg's switch: Baton's classes order the requests waiting for a slot whenever `--max-concurrent-requests` is set; given without it, the slots are the engines' capacity, as smg sizes them — what each available worker that runs requests (regular, or in PD the decodes) reports it runs at once (SGLang's `/server_info` `max_running_requests`, or the worker's `max_running_requests` label), 64 for one that reports nothing, 1024 while none is available — looked at every 5 s (reserved slots then need `--max-concurrent-requests`)"},
		{Keys: []string{"priority_scheduler_config"}, Meaning: "smg's priority scheduler YAML, read with `--priority-scheduler-enabled` (ignored without it, as in smg, with a WARN): each class's `queue_size`, `queue_timeout_secs` and `starvation_threshold_secs` become its `admission.queue_classes` entry (`size`, `timeout`, `promote_after`), `reserved_floor`/`reserved_per_slot` its `reserved_slots` (clamped to leave one shared slot, highest classes first), `tenant_policies` `max_class` the tenant's `max_priority` (docs/from-smg/rate-limits.md)"},
		{Keys: []string{"tenant_rate_limit_enabled", "tenant_rate_limit_config"}, Meaning: "smg's tenant rate-limit YAML: each `tenants` entry's limits and `model_rules` become the named tenant's `limits` and `model_limits` (`exact` a name, `prefix` a `name*`), `default_policy` those of every other tenant, each counted on its own; `tenant_key` `auth:NAME` (a tenant with a key), `auth:<SHA-256 hex>` (the tenant of that key), `header:NAME` (with `--trust-tenant-header`), `anonymous` (tenant `default`); `ip:` is refused (docs/from-smg/rate-limits.md)"},
		{Keys: []string{"admission.fair_input_weight"}, Meaning: "weight of a prompt token in a tenant's share of a full fleet"},
		{Keys: []string{"admission.fair_output_weight"}, Meaning: "weight of a completion token in it"},
		{Keys: []string{"pair_health.failure_threshold", "pair_health.quarantine"}, Meaning: "PD pair quarantine"},
	},
}

// renderReferenceTable is docs/REFERENCE.md's settings table n: its rows, then a row for each
// setting of the table with a flag and no row of its own.
func renderReferenceTable(n int) string {
	rowed := map[string]bool{}
	for _, table := range referenceTables {
		for _, r := range table {
			for _, k := range r.Keys {
				rowed[k] = true
			}
		}
	}
	table := referenceTables[n]
	for _, s := range settings {
		if section := strings.Contains(s.key, "."); s.flag != "" && !rowed[s.key] && section == (n == 1) {
			table = append(table[:len(table):len(table)], refRow{Keys: []string{s.key}, Meaning: s.help})
		}
	}
	var b strings.Builder
	b.WriteString("| flag | YAML key | default | meaning |\n|---|---|---|---|\n")
	for _, r := range table {
		var flags, keys, defs []string
		for _, k := range r.Keys {
			s := settingByKey(k)
			if s == nil {
				panic("config: docs/REFERENCE.md's table names " + k + ", which is no setting")
			}
			if s.flag != "" {
				f := "`--" + s.flag + "`"
				if s.unit != "" {
					f += ", `--" + s.flag + "-" + s.unit + "`"
				}
				if s.secret != "" {
					f += ", `--" + s.flag + "-file`"
				}
				flags = append(flags, f)
			}
			key := "`" + s.key + "`"
			if s.unit != "" {
				key += " (`" + s.key + "_" + s.unit + "`)"
			}
			keys = append(keys, key)
			def := "—"
			switch {
			case s.def != "":
				def = "`" + s.def + "`"
			case s.typ.Kind() == reflect.Bool:
				def = "`false`"
			}
			defs = append(defs, def)
		}
		if strings.Trim(strings.Join(defs, ""), "—") == "" {
			defs = defs[:min(len(defs), 1)] // none of them has a default: one dash says so
		}
		cell := func(over string, parts []string) string {
			if over != "" {
				return over
			}
			if len(parts) == 0 {
				return "—"
			}
			return strings.Join(parts, ", ")
		}
		b.WriteString("| " + cell(r.Flag, flags) + " | " + cell(r.Key, keys) + " | " + cell(r.Default, defs) + " | " + r.Meaning + " |\n")
	}
	return b.String()
}

// settingByKey is the setting of YAML key key, nil for none.
func settingByKey(key string) *setting {
	for i := range settings {
		if settings[i].key == key {
			return &settings[i]
		}
	}
	return nil
}
