package openai

// CodeDoc is one row of the error table of docs/REFERENCE.md, rendered from CodeDocs: the
// statuses a code is answered with, the codes (a PD leg's with its prefix), a note on them, and
// when a client gets one.
type CodeDoc struct {
	Status string
	Codes  []string
	Note   string
	When   string
}

// CodeDocs says when each code Baton mints is answered: the one declaration the reference's error
// table is generated from (TestErrorTableIsGenerated renders it, and fails when a code of
// errors.go has no row or the reference drifts).
var CodeDocs = []CodeDoc{
	{Status: "400", Codes: []string{CodeInvalidJSON}, When: "the body is not a JSON object, or `model`/`n` have the wrong type"},
	{Status: "400", Codes: []string{CodeDuplicateKey}, When: "the body names a top-level member twice, in any letter case or escape, or a member of `sampling_params` or `stream_options` twice (`param` names it): parsers disagree on which counts, so a bound checked on one could be bypassed by the other"},
	{Status: "400", Codes: []string{CodeBatchTooLarge}, When: "`n`, `best_of` or a prompt list past `--max-batch-size`"},
	{Status: "400", Codes: []string{CodeDuplicateHeader}, When: "more than one `Authorization` header"},
	{Status: "400", Codes: []string{CodeBodyReadFailed}, When: "the body could not be read (a broken upload)"},
	{Status: "400", Codes: []string{CodeBootstrapInjectionFailed}, When: "SGLang PD: the bootstrap fields could not be added to the body"},
	{Status: "400", Codes: []string{CodeInvalidRequest}, When: "Baton's HTTP/1.1 server: a malformed request line or header; a tenant under a token limit sending `/v1/messages` without `max_tokens`"},
	{Status: "400", Codes: []string{CodeBadRequest}, When: "admin API: an invalid worker"},
	{Status: "400", Codes: []string{CodeOwnedField}, When: "`baton epp` behind a data plane that streams bodies it cannot edit: a field only Baton sets (`kv_transfer_params`, `bootstrap_*`, `priority`, …) in the request's body (`param` names it)"},
	{Status: "401", Codes: []string{CodeInvalidAPIKey}, When: "a missing or wrong key"},
	{Status: "403", Codes: []string{CodeAdminDisabled}, When: "admin API: keyless from a proxy, a web page or a foreign `Host`"},
	{Status: "403", Codes: []string{CodeAdminKeyRequired}, When: "`GET /workers` on the API port with a tenant's key: the whole fleet is the admin's"},
	{Status: "404", Codes: []string{CodeModelNotFound}, When: "no worker lists the model"},
	{Status: "404", Codes: []string{CodeNotFound, CodeWorkerNotFound}, When: "no such route; admin API: no such worker"},
	{Status: "408", Codes: []string{CodeClientTimeout}, When: "the body stalled or did not arrive within `--body-timeout-secs`"},
	{Status: "409", Codes: []string{CodeWorkerExists}, When: "admin API"},
	{Status: "413", Codes: []string{CodePayloadTooLarge}, When: "the body past `--max-payload-size`"},
	{Status: "415", Codes: []string{CodeUnsupportedMedia}, When: "admin API: a write not declared JSON"},
	{Status: "417", Codes: []string{CodeExpectationFailed}, When: "an `Expect` other than `100-continue`"},
	{Status: "431", Codes: []string{CodeHeadersTooLarge}, When: "the request head past 64 KiB or 128 fields (through the Endpoint Picker: 256 fields, the data plane's own included)"},
	{Status: "429", Codes: []string{CodeTenantRateLimit, CodeTenantConcurrency}, When: "a tenant's requests or tokens per minute, or requests at once ([Tenants and limits](#tenants-and-limits)); `Retry-After` in seconds"},
	{Status: "429", Codes: []string{CodeTenantRequestTooLarge}, When: "a request whose completion cap (or cap and prompt) exceeds its tenant's whole token bucket; `param` names the field, `x-should-retry: false`, no `Retry-After`"},
	{Status: "500", Codes: []string{CodeInternalError}, When: "a panic while serving (the stack is logged)"},
	{Status: "500", Codes: []string{CodeBodyUnread}, When: "`baton epp` behind a data plane that sends no body (`NONE`): an inference request that has one, which the picker cannot read"},
	{Status: "501", Codes: []string{CodeRouteNotServed, CodeNotImplementedInPD}, When: "no worker of the model serves the route; a route PD mode cannot split"},
	{Status: "501", Codes: []string{CodeUnsupportedTransferEncoding}, When: "a request body coding other than `chunked`"},
	{Status: "502", Codes: []string{CodeUpstreamUnreachable, "prefill_" + CodeUpstreamUnreachable, "decode_" + CodeUpstreamUnreachable}, When: "the worker (or PD leg) could not be reached or answered malformed HTTP"},
	{Status: "502", Codes: []string{CodeKVHandoffUnavailable}, When: "vLLM PD: the prefill answered without the KV transfer parameters"},
	{Status: "502, 5xx", Codes: []string{CodeUpstreamStreamError}, When: "(access log and status page) an engine reported a failure inside a stream it answered 200"},
	{Status: "200", Codes: []string{CodeCutMidAnswer}, When: "(status page) an answer cut after its head went out: its engine failed or stalled mid-stream (`--stream-stall-timeout`), or the deadline passed; the client sees its connection end"},
	{Status: "4xx, 5xx", Codes: []string{"prefill_" + CodeUpstreamError, "decode_" + CodeUpstreamError, CodeUpstreamError}, Note: "(the leg's prefix on `upstream_error`, which alone names an engine's own error answer in `baton check`'s report)", When: "a PD leg's engine answered an error (its status kept)"},
	{Status: "4xx, 5xx", Codes: []string{CodeUpstreamErrorTooLarge}, When: "a worker's retryable error whose body passed 1 MiB (its status kept)"},
	{Status: "502", Codes: []string{CodeUpstreamKeyRefused}, When: "the engine answered 401 or 403 to the key Baton sends it (the worker named)"},
	{Status: "503", Codes: []string{CodeAdapterLoadFailed}, When: "the request's LoRA adapter could not be loaded on the worker chosen (the engine refused it, or `--adapter-load-timeout` passed): the adapter, the worker and the engine's reason named; `Retry-After: 1`"},
	{Status: "503", Codes: []string{CodeQueueFull}, When: "every slot is taken and the request's priority class queue is full (`Retry-After`)"},
	{Status: "503", Codes: []string{CodeNoEndpointInSubset}, When: "`baton epp`: the gateway's subset hint is empty, or none of its endpoints can serve the request"},
	{Status: "429", Codes: []string{CodeTooManyWhatIfs}, When: "`GET /pd/advice`: a what-if while 2 of the same client's (4 in all) are being answered (`Retry-After: 1`)"},
	{Status: "429", Codes: []string{CodeRequestShed}, When: "`baton epp`: a `batch` request while every worker that could serve it is saturated (`Retry-After`)"},
	{Status: "504", Codes: []string{CodeQueueTimeout}, When: "the request waited its class's queue timeout for a slot (`Retry-After`); 504 because OpenAI's SDKs retry it, as they do every 5xx (a 408 would blame the client)"},
	{Status: "400", Codes: []string{CodeModelRequired}, When: "the request names no model and there is no `default_model`; or a tenant held to some `models` sent `/generate` without `model`"},
	{Status: "400", Codes: []string{CodeInvalidModel}, When: "`model` is longer than 1,024 bytes (no model has such a name; every message naming the model stays small)"},
	{Status: "400", Codes: []string{CodeInvalidLoRAPath}, When: "`lora_path` names no adapter Baton serves (declared, or listed by a worker), several adapters (or the base beside one) in one batch, is not a name, null or a list of them, or names an adapter of another base than `model`"},
	{Status: "400", Codes: []string{CodeInvalidPriority}, When: "`X-Baton-Priority` is no class"},
	{Status: "503", Codes: []string{CodeNoAvailableWorkers, CodeOverloaded, CodeDraining}, When: "nobody healthy to send to (`Retry-After: 1`: a worker may be back within seconds); admission full or the body budget spent; shutting down"},
	{Status: "503", Codes: []string{CodeRateLimitStoreUnavailable}, When: "the Redis store of tenants' limits cannot be reached and `--rate-limit-store-failure closed`"},
	{Status: "503", Codes: []string{CodeHealthGenerateFailed}, When: "`/health_generate`: the fleet could not generate"},
	{Status: "504", Codes: []string{CodeUpstreamTimeout, "prefill_" + CodeUpstreamTimeout, "decode_" + CodeUpstreamTimeout}, When: "every timeout, PD legs included (`Retry-After: 1`: the worker that did not answer is avoided)"},
	{Status: "505", Codes: []string{CodeHTTPVersionNotSupported}, When: "a request in HTTP other than 1.0 and 1.1"},
}
