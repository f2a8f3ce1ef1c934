// Package sim holds engine simulators: real HTTP servers that follow vLLM's and SGLang's
// protocols (OpenAI routes, NIXL and Mooncake KV handoffs, SGLang bootstrap rendezvous, data
// parallel ranks) around a deterministic fake model. Tests, the demo and the benchmarks run them
// in-process; `baton sim` runs one as a process.
package sim

import (
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Engines, roles and connectors.
const (
	EngineVLLM   = "vllm"
	EngineSGLang = "sglang"

	RolePrefill = "prefill"
	RoleDecode  = "decode"
	RoleBoth    = "both"

	ConnectorNixl     = "nixl"
	ConnectorMooncake = "mooncake"
	ConnectorNone     = "none"

	PolicyFail      = "fail"
	PolicyRecompute = "recompute"

	// SchedulingPriority is vLLM's --scheduling-policy priority (the default is fcfs).
	SchedulingPriority = "priority"
)

// Config describes one simulated engine. The zero value of a duration means "no delay".
type Config struct {
	Engine      string // vllm or sglang
	Role        string // prefill, decode or both
	KVConnector string // vLLM: nixl, mooncake or none
	Model       string // served model name
	EngineID    string // KV engine id (vLLM); "" makes one up. DP ranks get "_dp{rank}".
	DPSize      int    // data parallel size; 0 means 1
	Host        string // address to bind; the KV side channel and bootstrap server bind it too
	Port        int    // API port; 0 picks a free one

	// BootstrapPort is the SGLang / Mooncake bootstrap server port on a prefill engine; 0 picks
	// a free one. An SGLang decode engine uses it when a request's bootstrap_port is null.
	BootstrapPort int
	// SideChannelPort is the first NIXL side channel port (rank r listens on +r); 0 picks free ones.
	SideChannelPort int

	// SchedulingPolicy is vLLM's --scheduling-policy: "" (fcfs) refuses a request whose
	// priority is not 0, as vLLM does; "priority" takes it.
	SchedulingPolicy string
	PrefillPerToken  time.Duration // cost of each prompt token computed locally
	DecodePerToken   time.Duration // cost of each output token
	MaxConcurrency   int           // requests running at once; 0 means 256
	// Steps replaces the per-token costs with the step-level model of continuous batching
	// (Perf): requests share steps, prefill chunks slow the decodes beside them, KV blocks are
	// bounded and a full cache preempts. nil keeps the simple per-token costs.
	Steps     *Perf
	QueueSize int // requests waiting beyond that; 0 means 1024; more get 503

	KVTimeout        time.Duration // pinned prefill KV is freed after this (NIXL/Mooncake); 0 means 30 s
	BootstrapTimeout time.Duration // SGLang: a leg whose partner never arrives fails; 0 means 10 s
	KVLoadFailure    string        // decode whose KV cannot be loaded: fail (500) or recompute
	// SameProcessKV has a NIXL decode engine take the KV of a prefill engine started in this
	// process by a call instead of a pull over the prefill's side channel: the same take, the
	// same rules and counters, without an HTTP exchange. A benchmark whose load generator and
	// engines share one core sets it, so that the harness's cost per request stays below what
	// the proxy under test can serve (a real NIXL transfer is engine to engine and never touches
	// the proxy either way).
	SameProcessKV bool
	// EngineHeadersOnly answers without the simulator's own X-Sim-KV-Source, X-Sim-Engine-Id
	// and X-Sim-Dp-Rank, which no engine sends: a benchmark of what a proxy costs per answer sets
	// it, so that the heads it reads and relays are an engine's.
	EngineHeadersOnly bool
	PrefixCache       bool // keep computed prompts' KV in a block prefix cache (LRU)
	// EchoRequestID answers every request with its X-Request-Id header (a random one when it
	// sent none), as vLLM does with --enable-request-id-headers
	// (vllm/entrypoints/serve/middleware/x_request_id.py).
	EchoRequestID bool
	// PrefixCacheBlocks is the prefix cache's capacity in blocks of 16 tokens; 0 means 4096.
	PrefixCacheBlocks int
	// KVEvents publishes the prefix cache's changes as KV events on a ZMQ PUB socket (port
	// KVEventsPort, 0 picks a free one), in KVEventsEncoding: array (default) or map.
	KVEvents         bool
	KVEventsPort     int
	KVEventsEncoding string
	// KVEventsReplayPort is the replay endpoint's port; 0 picks a free one.
	KVEventsReplayPort int
	// KVEventsPerRank gives each DP rank its own prefix cache and KV events publisher (vLLM's DP
	// engine cores): rank r publishes at the KV events port + r, its batches naming the rank.
	KVEventsPerRank bool
	// KVEventsDropEvery loses every Nth batch on the PUB socket (kept for replay): a fault.
	KVEventsDropEvery int
	// KVEventsConnect makes the publisher dial this endpoint (a gateway listening for engines,
	// tcp://host:port) instead of binding, as vLLM and SGLang do for an endpoint without "*".
	KVEventsConnect string
	// KVEventsTopic is the first frame of every message; "" publishes none, except that a
	// publisher that connects out names itself kv@<host>:<port>@<model>.
	KVEventsTopic string

	// LoRAAdapters are LoRA adapters loaded on the engine, served under their own names (vLLM:
	// listed in /v1/models with the base model as parent; their KV blocks are keyed apart and
	// their KV events carry lora_name).
	LoRAAdapters []string
	// MaxLoRAs is each engine's own LoRA bound (0: none). vLLM: --max-loras, the adapters one
	// batch may run — loads past it are taken (vLLM's load_lora_adapter checks no capacity); it is
	// max_lora in lora_requests_info. SGLang: --max-loaded-loras, the adapters held loaded — a
	// load past it is refused with SGLang's own words — reported in /server_info with
	// max_loras_per_batch. LoRALoadTime is how long a load takes.
	MaxLoRAs     int
	LoRALoadTime time.Duration
	// RuntimeLoRA serves the adapter load and unload endpoints (vLLM answers them only when
	// started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).
	RuntimeLoRA bool
	// LoRAMissingPaths are adapter paths that do not exist: their loads fail (404 "No adapter
	// found"), as the engines' do.
	LoRAMissingPaths []string
	// MooncakeQueryByEngineID answers the bootstrap server's GET /query keyed by engine id
	// ({engine_id: {dp_rank: {tp_rank: {pp_rank: addr}}}}), as one vLLM release does, instead
	// of by DP rank.
	MooncakeQueryByEngineID bool
	// MooncakeRegistering makes GET /query answer 503 "Workers still registering" for this long
	// after start, as vLLM's does until every worker registered.
	MooncakeRegistering time.Duration
	// SGLangLegacyHashes publishes KV events as older SGLang did: each block's hash of its own
	// tokens alone, and a parent named even for a prompt's first block.
	SGLangLegacyHashes bool
	// SGLangModelAdapterIgnored models SGLang releases before the base:adapter model syntax:
	// their OpenAI routes run the base model whatever "model" names, and only lora_path selects
	// an adapter — a request naming its adapter by model alone gets a 200 from the base model.
	SGLangModelAdapterIgnored bool
	// HybridKV publishes KV events as a hybrid-attention model does (vLLM): each block once per
	// KV-cache group, full attention (group 0) and sliding window (group 1), the sliding window
	// freeing a chain's blocks but its last at once.
	HybridKV bool
	// NoPromptTokensDetails answers prompt_tokens_details null, as vLLM does unless started with
	// --enable-prompt-tokens-details: the usage then says nothing of cached tokens.
	NoPromptTokensDetails bool
	// StreamInterval is the tokens a stream's event carries (vLLM's and SGLang's
	// --stream-interval; speculative decoding sends several at once too); 0 or 1: one per event.
	StreamInterval int

	Faults Faults // faults applied to every inference request
}

// Faults make an engine misbehave. A request may add its own with the X-Sim-Fault header, e.g.
// "status=503,rate=0.5", "latency=200ms", "hang", "drop-after=3", "hang-after=3".
type Faults struct {
	Status    int           // fail with this status ...
	Rate      float64       // ... with this probability (0 means always); without Status, the probability of DropAfter
	Latency   time.Duration // added before answering
	Hang      bool          // never answer (until the client leaves)
	DropAfter int           // stream: drop the connection after this many events (0: never)
	HangAfter int           // stream: send nothing more after this many events, the connection held open (0: never)
}

func (c *Config) withDefaults() Config {
	out := *c
	if out.Engine == "" {
		out.Engine = EngineVLLM
	}
	if out.Role == "" {
		out.Role = RoleBoth
	}
	if out.KVConnector == "" {
		out.KVConnector = ConnectorNone
		if out.Engine == EngineVLLM && out.Role != RoleBoth {
			out.KVConnector = ConnectorNixl
		}
	}
	if out.Model == "" {
		out.Model = "sim-model"
	}
	if out.DPSize <= 0 {
		out.DPSize = 1
	}
	if out.Host == "" {
		out.Host = "127.0.0.1"
	}
	if out.MaxConcurrency <= 0 {
		out.MaxConcurrency = 256
	}
	if out.KVEventsEncoding == "" {
		out.KVEventsEncoding = KVEventsArray
	}
	if out.PrefixCacheBlocks <= 0 {
		out.PrefixCacheBlocks = 4096
	}
	if out.QueueSize <= 0 {
		out.QueueSize = 1024
	}
	if out.KVTimeout <= 0 {
		out.KVTimeout = 30 * time.Second
	}
	if out.BootstrapTimeout <= 0 {
		out.BootstrapTimeout = 10 * time.Second
	}
	if out.KVLoadFailure == "" {
		out.KVLoadFailure = PolicyFail
	}
	return out
}

func (c *Config) validate() error {
	var errs []error
	if !slices.Contains([]string{EngineVLLM, EngineSGLang}, c.Engine) {
		errs = append(errs, fmt.Errorf("engine %q: want vllm or sglang", c.Engine))
	}
	if !slices.Contains([]string{RolePrefill, RoleDecode, RoleBoth}, c.Role) {
		errs = append(errs, fmt.Errorf("role %q: want prefill, decode or both", c.Role))
	}
	if !slices.Contains([]string{ConnectorNixl, ConnectorMooncake, ConnectorNone}, c.KVConnector) {
		errs = append(errs, fmt.Errorf("kv-connector %q: want nixl, mooncake or none", c.KVConnector))
	}
	if c.KVEvents && !c.PrefixCache {
		errs = append(errs, fmt.Errorf("kv-events: needs prefix-cache (the events are its changes)"))
	}
	if c.KVEventsEncoding != KVEventsArray && c.KVEventsEncoding != KVEventsMap {
		errs = append(errs, fmt.Errorf("kv-events-encoding %q: want array or map", c.KVEventsEncoding))
	}
	if !slices.Contains([]string{PolicyFail, PolicyRecompute}, c.KVLoadFailure) {
		errs = append(errs, fmt.Errorf("kv-load-failure-policy %q: want fail or recompute", c.KVLoadFailure))
	}
	if c.Steps != nil {
		if err := c.Steps.validate(); err != nil {
			errs = append(errs, err)
		}
	}
	if c.Faults.Rate < 0 || c.Faults.Rate > 1 {
		errs = append(errs, fmt.Errorf("fault-rate %v: want 0..1", c.Faults.Rate))
	}
	if c.MaxLoRAs < 0 || c.Engine == EngineSGLang && c.MaxLoRAs > 0 && len(c.LoRAAdapters) > c.MaxLoRAs {
		errs = append(errs, fmt.Errorf("max-loras %d: want 0 (no limit), or on SGLang at least the %d adapters of lora-modules", c.MaxLoRAs, len(c.LoRAAdapters)))
	}
	return errors.Join(errs...)
}

// ParseFlags reads a simulator configuration from `baton sim` flags, defined on fs.
func ParseFlags(fs *flag.FlagSet, args []string) (Config, error) {
	var c Config
	fs.StringVar(&c.Engine, "engine", EngineVLLM, "vllm | sglang")
	fs.StringVar(&c.Role, "role", RoleBoth, "prefill | decode | both")
	fs.StringVar(&c.KVConnector, "kv-connector", "", "vLLM KV connector: nixl | mooncake | none (default nixl for prefill/decode)")
	fs.StringVar(&c.Model, "model", "sim-model", "served model name")
	fs.StringVar(&c.EngineID, "engine-id", "", "KV engine id (default: made up)")
	fs.IntVar(&c.DPSize, "data-parallel-size", 1, "data parallel ranks")
	fs.StringVar(&c.Host, "host", "127.0.0.1", "address to bind")
	fs.IntVar(&c.Port, "port", 8000, "API port (0 picks a free one)")
	fs.IntVar(&c.BootstrapPort, "bootstrap-port", 0, "bootstrap server port for SGLang/Mooncake prefill (0 picks a free one)")
	fs.IntVar(&c.SideChannelPort, "side-channel-port", 0, "first NIXL side channel port (0 picks free ones)")
	fs.DurationVar(&c.PrefillPerToken, "prefill-per-token", 0, "cost of each prompt token computed locally, e.g. 20us")
	fs.StringVar(&c.SchedulingPolicy, "scheduling-policy", "", "vLLM: priority takes a request's priority; otherwise (fcfs) a priority other than 0 is refused, as vLLM does")
	fs.DurationVar(&c.DecodePerToken, "decode-per-token", 0, "cost of each output token, e.g. 10ms")
	fs.IntVar(&c.MaxConcurrency, "max-concurrency", 256, "requests running at once")
	steps := DefaultPerf()
	stepModel := fs.Bool("step-model", false, "model continuous batching step by step (a token budget per step, chunked prefill slowing the decodes beside it, KV blocks with preemption) instead of per-token costs; the defaults model Llama-3.1-8B on one H100 (docs/ENGINES.md)")
	fs.IntVar(&steps.MaxBatchedTokens, "max-num-batched-tokens", steps.MaxBatchedTokens, "step model: a step's token budget")
	fs.IntVar(&steps.MaxSeqs, "max-num-seqs", steps.MaxSeqs, "step model: requests running at once")
	fs.IntVar(&steps.LongPrefill, "long-prefill-token-threshold", 0, "step model: a prefill chunk's bound (0: none)")
	fs.IntVar(&steps.KVBlocks, "kv-blocks", steps.KVBlocks, "step model: KV cache capacity in blocks of 16 tokens")
	fs.DurationVar(&steps.StepOverhead, "step-overhead", steps.StepOverhead, "step model: a step's fixed cost")
	fs.DurationVar(&steps.ComputePerToken, "compute-per-token", steps.ComputePerToken, "step model: compute per token scheduled in a step")
	fs.DurationVar(&steps.WeightRead, "weight-read", steps.WeightRead, "step model: reading the weights, a step's memory floor")
	fs.DurationVar(&steps.KVReadPerToken, "kv-read-per-token", steps.KVReadPerToken, "step model: reading one token of a decoding request's context")
	fs.IntVar(&c.QueueSize, "queue-size", 1024, "requests waiting beyond max-concurrency; more get 503")
	fs.DurationVar(&c.KVTimeout, "kv-timeout", 30*time.Second, "pinned prefill KV is freed after this")
	fs.DurationVar(&c.BootstrapTimeout, "bootstrap-timeout", 10*time.Second, "SGLang: a leg whose partner never arrives fails after this")
	fs.StringVar(&c.KVLoadFailure, "kv-load-failure-policy", PolicyFail, "fail | recompute")
	fs.BoolVar(&c.EchoRequestID, "enable-request-id-headers", false, "answer with the request's X-Request-Id header, as vLLM does with the same flag")
	fs.BoolVar(&c.PrefixCache, "prefix-cache", false, "keep computed prompts' KV in a block prefix cache: a prompt that starts like an earlier one computes only the rest")
	fs.BoolVar(&c.KVEvents, "kv-events", false, "publish the prefix cache's changes as KV events on a ZMQ PUB socket, in the --engine's format (needs --prefix-cache)")
	fs.IntVar(&c.KVEventsPort, "kv-events-port", 0, "port of the KV events publisher (0: a free one)")
	fs.StringVar(&c.KVEventsEncoding, "kv-events-encoding", KVEventsArray, "KV event encoding: array (msgspec array_like) or map (tagged maps)")
	fs.StringVar(&c.KVEventsConnect, "kv-events-connect", "", "publish KV events by dialling this endpoint (a gateway's --kv-events-listen, tcp://host:port) instead of binding")
	fs.StringVar(&c.KVEventsTopic, "kv-events-topic", "", "KV events topic (default: none; kv@<host>:<port>@<model> with --kv-events-connect)")
	fs.IntVar(&c.PrefixCacheBlocks, "prefix-cache-blocks", 4096, "prefix cache capacity in blocks of 16 tokens (least recently used evicted)")
	fs.BoolVar(&c.HybridKV, "hybrid-kv", false, "publish KV events as a hybrid-attention model: full-attention and sliding-window groups (vLLM)")
	fs.BoolVar(&c.NoPromptTokensDetails, "no-prompt-tokens-details", false, "answer prompt_tokens_details null, as vLLM does without --enable-prompt-tokens-details")
	fs.IntVar(&c.StreamInterval, "stream-interval", 1, "tokens per stream event, as vLLM's and SGLang's --stream-interval")
	fs.Func("lora-modules", "a LoRA adapter loaded at start, NAME (repeatable, or comma separated)", func(v string) error {
		for _, n := range strings.Split(v, ",") {
			if n = strings.TrimSpace(n); n != "" {
				c.LoRAAdapters = append(c.LoRAAdapters, n)
			}
		}
		return nil
	})
	fs.IntVar(&c.MaxLoRAs, "max-loras", 0, "most LoRA adapters loaded at once (0: no limit); a load beyond it is refused")
	fs.DurationVar(&c.LoRALoadTime, "lora-load-time", 0, "how long loading a LoRA adapter takes, e.g. 200ms")
	fs.BoolVar(&c.RuntimeLoRA, "runtime-lora", false, "serve the LoRA load/unload endpoints (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
	fs.IntVar(&c.Faults.Status, "fault-status", 0, "fail requests with this status")
	fs.Float64Var(&c.Faults.Rate, "fault-rate", 0, "probability of the fault status (0 with a status: always)")
	fs.DurationVar(&c.Faults.Latency, "fault-latency", 0, "latency added to every request")
	fs.BoolVar(&c.Faults.Hang, "fault-hang", false, "never answer")
	fs.IntVar(&c.Faults.DropAfter, "fault-drop-after", 0, "drop streams after this many events")
	fs.IntVar(&c.Faults.HangAfter, "fault-hang-after", 0, "streams: send nothing more after this many events, holding the connection")
	if err := fs.Parse(args); err != nil {
		return Config{}, err
	}
	if fs.NArg() > 0 {
		return Config{}, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if *stepModel {
		c.Steps = &steps
	}
	d := c.withDefaults()
	return d, d.validate()
}
