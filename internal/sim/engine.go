package sim

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Header names the simulator reads or writes.
const (
	HeaderKVSource = "X-Sim-KV-Source" // where the KV of this response came from
	HeaderEngineID = "X-Sim-Engine-Id" // engine id of the rank that served
	HeaderDPRank   = "X-Sim-Dp-Rank"   // data parallel rank that served
	HeaderFault    = "X-Sim-Fault"     // per-request fault injection
	HeaderDPRankIn = "X-Data-Parallel-Rank"
)

// KV sources, as reported in HeaderKVSource and the prompt-token counters.
const (
	SourceRemote     = "remote"      // loaded from a prefill engine
	SourceRecompute  = "recompute"   // computed here
	SourceLocalCache = "local-cache" // found in this engine's prefix cache
)

// Engine is one simulated inference engine.
type Engine struct {
	cfg       Config
	engineIDs []string // per DP rank
	client    *http.Client

	ln        net.Listener
	srv       *http.Server
	side      []*http.Server // NIXL side channel, one per DP rank
	sidePorts []int
	boot      *http.Server // SGLang or Mooncake bootstrap server (prefill engines)
	bootPort  int

	slots   chan struct{}
	steps   *stepper // the step model (Config.Steps), nil for per-token costs
	waiting atomic.Int64
	running atomic.Int64
	rr      atomic.Uint64

	kv     *kvStore
	lora   *loraSet
	rooms  *roomTable
	prefix *prefixCache // nil without PrefixCache
	kvpub  *kvPublisher // nil without KVEvents
	// prefixes and kvpubs are each DP rank's cache and publisher with KVEventsPerRank (rank 0's
	// are prefix and kvpub).
	prefixes []*prefixCache
	kvpubs   []*kvPublisher

	stats   stats
	wg      sync.WaitGroup
	started time.Time
}

// Stats are the engine's counters, as exported on /metrics.
type Stats struct {
	PromptTokensRemote     int64 // prompt tokens whose KV came from a prefill engine
	PromptTokensRecompute  int64 // prompt tokens computed here
	PromptTokensLocalCache int64 // prompt tokens found in the prefix cache
	HandoffsPinned         int64 // prefill KV pinned for a decode engine
	HandoffsPulled         int64 // pinned KV taken by a decode engine
	HandoffsExpired        int64 // pinned KV freed by timeout, never taken
	HandoffsReleased       int64 // pinned KV freed because the decode engine refused its request
	StaleKVReads           int64 // KV read after it was freed: the decode's answer is built on another request's blocks
	KVLoadFailures         int64 // decode could not load the KV it was told about
	KVConnectorMismatches  int64 // decode got params of a connector it does not run: no transfer
	PrefixCacheQueries     int64 // prompt tokens looked up in the prefix cache
	PrefixCacheHits        int64 // of those, found cached
	RequestsReceived       int64 // inference requests that reached a handler
	RequestsOK             int64
	RequestsFailed         int64
	RequestsCancelled      int64 // the client left before the answer was complete
	RequestsRejected       int64 // 503: queue full
	TokensGenerated        int64 // output tokens computed, those of requests cut short included
	// RequestsWithPriority counts requests whose body carried a "priority"; LastPriority is the
	// last such value.
	RequestsWithPriority, LastPriority int64
}

type stats struct {
	remote, recompute, local                  atomic.Int64
	pinned, pulled, expired, loadFail         atomic.Int64
	released, staleReads                      atomic.Int64
	mismatch                                  atomic.Int64
	cacheQueries, cacheHits                   atomic.Int64
	received, ok, failed, cancelled, rejected atomic.Int64
	generated, priority, lastPriority         atomic.Int64
}

// Stats returns a snapshot of the counters.
func (e *Engine) Stats() Stats {
	s := &e.stats
	return Stats{
		PromptTokensRemote: s.remote.Load(), PromptTokensRecompute: s.recompute.Load(), PromptTokensLocalCache: s.local.Load(),
		HandoffsPinned: s.pinned.Load(), HandoffsPulled: s.pulled.Load(), HandoffsExpired: s.expired.Load(),
		HandoffsReleased: s.released.Load(), StaleKVReads: s.staleReads.Load(),
		KVLoadFailures: s.loadFail.Load(), KVConnectorMismatches: s.mismatch.Load(),
		PrefixCacheQueries: s.cacheQueries.Load(), PrefixCacheHits: s.cacheHits.Load(), RequestsReceived: s.received.Load(), RequestsOK: s.ok.Load(), RequestsFailed: s.failed.Load(),
		RequestsCancelled: s.cancelled.Load(), RequestsRejected: s.rejected.Load(), TokensGenerated: s.generated.Load(),
		RequestsWithPriority: s.priority.Load(), LastPriority: s.lastPriority.Load(),
	}
}

// Start starts an engine for cfg: its API server and, by role, its NIXL side channel or
// bootstrap server. Close stops everything.
func Start(cfg Config) (*Engine, error) {
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	e := &Engine{
		cfg:     c,
		client:  &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}},
		slots:   make(chan struct{}, slotsOf(c)),
		rooms:   newRoomTable(),
		started: time.Now(),
	}
	e.kv = newKVStore(e)
	e.lora = newLoRASet(c)
	if c.Steps != nil {
		e.steps = newStepper(*c.Steps)
	}
	if c.PrefixCache {
		e.prefix = newPrefixCache(c.PrefixCacheBlocks)
		e.prefixes = []*prefixCache{e.prefix}
		for r := 1; c.KVEventsPerRank && r < c.DPSize; r++ {
			e.prefixes = append(e.prefixes, newPrefixCache(c.PrefixCacheBlocks))
		}
	}
	base := c.EngineID
	if base == "" {
		base = c.Engine + "-" + randHex(4)
	}
	for r := 0; r < c.DPSize; r++ {
		id := base
		if c.DPSize > 1 {
			id = fmt.Sprintf("%s_dp%d", base, r)
		}
		e.engineIDs = append(e.engineIDs, id)
	}
	var err error
	if e.ln, err = net.Listen("tcp", net.JoinHostPort(c.Host, strconv.Itoa(c.Port))); err != nil {
		return nil, fmt.Errorf("sim listen: %w", err)
	}
	if c.PrefixCache && c.KVEvents {
		if err := e.startPublishers(); err != nil {
			_ = e.ln.Close()
			return nil, err
		}
	}
	e.srv = &http.Server{Handler: e.routes(), ReadHeaderTimeout: 10 * time.Second}
	if err := e.startSide(); err != nil {
		e.Close()
		return nil, err
	}
	e.serve(e.srv, e.ln)
	return e, nil
}

func (e *Engine) serve(s *http.Server, ln net.Listener) {
	e.wg.Go(func() { _ = s.Serve(ln) })
}

// startSide starts the KV side servers this engine's role and connector need.
func (e *Engine) startSide() error {
	c := e.cfg
	prefill := c.Role == RolePrefill || c.Role == RoleBoth
	switch {
	case c.Engine == EngineVLLM && c.KVConnector == ConnectorNixl && prefill:
		for r := 0; r < c.DPSize; r++ {
			port := 0
			if c.SideChannelPort > 0 {
				port = c.SideChannelPort + r
			}
			ln, err := net.Listen("tcp", net.JoinHostPort(c.Host, strconv.Itoa(port)))
			if err != nil {
				return fmt.Errorf("nixl side channel: %w", err)
			}
			s := &http.Server{Handler: e.sideRoutes(r), ReadHeaderTimeout: 10 * time.Second}
			e.side = append(e.side, s)
			e.sidePorts = append(e.sidePorts, ln.Addr().(*net.TCPAddr).Port)
			sameProcess.Store(netJoin(c.Host, e.sidePorts[r]), e)
			e.serve(s, ln)
		}
	case (c.Engine == EngineVLLM && c.KVConnector == ConnectorMooncake && prefill) ||
		(c.Engine == EngineSGLang && c.Role == RolePrefill):
		ln, err := net.Listen("tcp", net.JoinHostPort(c.Host, strconv.Itoa(c.BootstrapPort)))
		if err != nil {
			return fmt.Errorf("bootstrap server: %w", err)
		}
		e.bootPort = ln.Addr().(*net.TCPAddr).Port
		e.boot = &http.Server{Handler: e.bootstrapRoutes(), ReadHeaderTimeout: 10 * time.Second}
		e.serve(e.boot, ln)
	}
	return nil
}

// Close stops the engine's servers and timers; open requests are cut.
func (e *Engine) Close() {
	for _, port := range e.sidePorts {
		sameProcess.CompareAndDelete(netJoin(e.cfg.Host, port), e)
	}
	for _, s := range append(e.side, e.srv, e.boot) {
		if s != nil {
			_ = s.Close()
		}
	}
	e.kv.close()
	if e.steps != nil {
		e.steps.close()
	}
	for _, p := range e.kvpubs {
		p.close()
	}
	e.wg.Wait()
	e.client.CloseIdleConnections()
}

// startPublishers starts the KV event publisher, or with KVEventsPerRank one per DP rank on
// consecutive ports (rank r at the first's port + r, its replay endpoint likewise), as vLLM's DP
// engine cores publish.
func (e *Engine) startPublishers() error {
	c := e.cfg
	topic := c.KVEventsTopic
	if topic == "" && c.KVEventsConnect != "" {
		topic = "kv@" + e.ln.Addr().String() + "@" + c.Model
	}
	n := len(e.prefixes)
	for try := 0; ; try++ {
		port, replay := c.KVEventsPort, c.KVEventsReplayPort
		var pubs []*kvPublisher
		var err error
		for r := 0; r < n && err == nil; r++ {
			var pub *kvPublisher
			pub, err = startKVPublisher(c.Host, port, &kvPublisher{encoding: c.KVEventsEncoding, topic: topic,
				dropEvery: c.KVEventsDropEvery, sglang: c.Engine == EngineSGLang, connect: c.KVEventsConnect, hybrid: c.HybridKV,
				replayPort: replay, legacy: c.SGLangLegacyHashes, ranked: n > 1, rank: r})
			if err == nil {
				pubs = append(pubs, pub)
				if r == 0 {
					port, replay = pub.port(), pub.boundReplayPort()
				}
				port, replay = port+1, replay+1
			}
		}
		if err == nil {
			e.kvpubs, e.kvpub = pubs, pubs[0]
			for r, p := range pubs {
				e.prefixes[r].onChange = p.publish
			}
			return nil
		}
		for _, p := range pubs {
			p.close()
		}
		if n == 1 || c.KVEventsPort != 0 || try == 20 {
			return err
		}
	}
}

// prefixOf is the prefix cache of DP rank r.
func (e *Engine) prefixOf(r int) *prefixCache {
	if r >= 0 && r < len(e.prefixes) {
		return e.prefixes[r]
	}
	return e.prefix
}

// KVEventsEndpoint is where the engine publishes its KV events, "" when it does not.
func (e *Engine) KVEventsEndpoint() string {
	if e.kvpub == nil {
		return ""
	}
	return e.kvpub.endpoint()
}

// KVEventsReplayEndpoint is where the engine replays missed KV event batches, "" without events.
func (e *Engine) KVEventsReplayEndpoint() string {
	if e.kvpub == nil {
		return ""
	}
	return e.kvpub.replayEndpoint()
}

// URL is the engine's API base URL.
func (e *Engine) URL() string { return "http://" + e.ln.Addr().String() }

// Addr is the engine's API host:port.
func (e *Engine) Addr() string { return e.ln.Addr().String() }

// BootstrapPort is the bootstrap server's port, or 0 when the engine runs none.
func (e *Engine) BootstrapPort() int { return e.bootPort }

// EngineIDs are the KV engine ids, one per DP rank.
func (e *Engine) EngineIDs() []string { return e.engineIDs }

// echoRequestID sets every answer's X-Request-Id to the request's (a random one when it sent
// none), before the handler writes.
func echoRequestID(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("X-Request-Id")
		if id == "" {
			id = randHex(16)
		}
		w.Header().Set("X-Request-Id", id)
		h.ServeHTTP(w, r)
	})
}

func (e *Engine) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", e.inference(routeChat))
	mux.HandleFunc("POST /v1/completions", e.inference(routeCompletions))
	mux.HandleFunc("POST /v1/responses", e.inference(routeResponses))
	mux.HandleFunc("POST /tokenize", e.tokenize)
	if e.cfg.Engine == EngineVLLM {
		mux.HandleFunc("POST /v1/messages", e.inference(routeMessages))
	}
	mux.HandleFunc("GET /v1/models", e.serveModels)
	if e.cfg.RuntimeLoRA {
		prefix := "/v1"
		if e.cfg.Engine == EngineSGLang {
			prefix = ""
		}
		mux.HandleFunc("POST "+prefix+"/load_lora_adapter", e.serveLoad)
		mux.HandleFunc("POST "+prefix+"/unload_lora_adapter", e.serveUnload)
	}
	mux.HandleFunc("GET /health", e.serveHealth)
	mux.HandleFunc("GET /metrics", e.serveMetrics)
	mux.HandleFunc("GET /debug/kv", e.serveDebugKV)
	if e.cfg.Engine == EngineVLLM {
		mux.HandleFunc("GET /version", func(w http.ResponseWriter, _ *http.Request) {
			writeJSON(w, 200, map[string]any{"version": "0.11.0+baton.sim"})
		})
	} else {
		mux.HandleFunc("POST /generate", e.inference(routeGenerate))
		mux.HandleFunc("GET /server_info", e.serveServerInfo)
		mux.HandleFunc("GET /get_server_info", e.serveServerInfo)
		mux.HandleFunc("GET /get_model_info", e.serveModelInfo)
		mux.HandleFunc("GET /model_info", e.serveModelInfo)
		mux.HandleFunc("GET /health_generate", e.serveHealth)
	}
	if e.cfg.EchoRequestID {
		return echoRequestID(mux)
	}
	return mux
}

func (e *Engine) serveHealth(w http.ResponseWriter, r *http.Request) {
	if f := e.faults(r); f.Hang {
		<-r.Context().Done()
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (e *Engine) serveModels(w http.ResponseWriter, _ *http.Request) {
	data := []any{map[string]any{
		"id": e.cfg.Model, "object": "model", "created": 1700000000, "owned_by": e.cfg.Engine,
		"root": e.cfg.Model, "parent": nil, "max_model_len": 32768,
	}}
	for _, a := range e.lora.list() { // the cards of loaded adapters, vLLM's and SGLang's alike
		data = append(data, map[string]any{"id": a.name, "object": "model", "created": 1700000000, "owned_by": e.cfg.Engine,
			"root": a.path, "parent": e.cfg.Model, "max_model_len": nil})
	}
	writeJSON(w, 200, map[string]any{"object": "list", "data": data})
}

// served reports whether name is the engine's model or one of its loaded adapters, and which
// adapter ("" for the base model). SGLang also names an adapter as base:adapter.
func (e *Engine) served(name string) (lora string, ok bool) {
	if name == e.cfg.Model {
		return "", true
	}
	if e.cfg.Engine == EngineSGLang {
		// SGLang's OpenAI routes take an adapter as base:adapter; a bare adapter name is no
		// adapter to them, and the base model serves it.
		if base, a, cut := strings.Cut(name, ":"); cut && base == e.cfg.Model {
			if e.cfg.SGLangModelAdapterIgnored {
				return "", e.lora.has(a) // an older release: the base model answers
			}
			return strings.TrimSpace(a), true // acquired (or refused as not loaded) after
		}
		return "", e.lora.has(name)
	}
	if e.lora.has(name) {
		return name, true
	}
	return "", false
}

func (e *Engine) serveServerInfo(w http.ResponseWriter, _ *http.Request) {
	mode := "null"
	if e.cfg.Role != RoleBoth {
		mode = e.cfg.Role
	}
	var bport any
	if e.bootPort != 0 {
		bport = e.bootPort
	} else if e.cfg.BootstrapPort != 0 {
		bport = e.cfg.BootstrapPort
	}
	info := map[string]any{
		"model_path": e.cfg.Model, "served_model_name": e.cfg.Model, "tp_size": 1, "dp_size": e.cfg.DPSize,
		"disaggregation_mode": mode, "disaggregation_bootstrap_port": bport, "disaggregation_transfer_backend": "fake",
		"load_balance_method": "follow_bootstrap_room", "max_queued_requests": e.cfg.QueueSize,
		"internal_states": []any{map[string]any{"last_gen_throughput": 0.0}}, "version": "0.5.0+baton.sim",
	}
	if e.cfg.MaxLoRAs > 0 {
		info["max_loaded_loras"], info["max_loras_per_batch"] = e.cfg.MaxLoRAs, e.cfg.MaxLoRAs
	}
	// The KV events publisher descriptor SGLang reports when it binds one (endpoint_host "*"
	// means the engine's own address). The simulator's ranks share one prefix cache and one
	// publisher, so it describes one.
	if e.kvpub != nil && e.kvpub.port() != 0 {
		info["kv_events"] = map[string]any{"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": e.kvpub.port(),
			"topic": e.kvpub.topic, "block_size": blockSize, "dp_size": 1}
	}
	writeJSON(w, 200, info)
}

func (e *Engine) serveModelInfo(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, 200, map[string]any{"model_path": e.cfg.Model, "tokenizer_path": e.cfg.Model, "is_generation": true,
		"preferred_sampling_params": nil, "weight_version": "default"})
}

// serveMetrics writes engine-style Prometheus text.
func (e *Engine) serveMetrics(w http.ResponseWriter, _ *http.Request) {
	p := e.cfg.Engine + ":"
	s := e.Stats()
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	var b strings.Builder
	gauge := func(name, help string, v int64) {
		fmt.Fprintf(&b, "# HELP %s%s %s\n# TYPE %s%s gauge\n%s%s %d\n", p, name, help, p, name, p, name, v)
	}
	// The engines' own names: vLLM num_requests_running/waiting and kv_cache_usage_perc,
	// SGLang num_running_reqs/num_queue_reqs and token_usage.
	running, waiting, usage := "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"
	if e.cfg.Engine == EngineSGLang {
		running, waiting, usage = "num_running_reqs", "num_queue_reqs", "token_usage"
	}
	run, wait, use := e.running.Load(), e.waiting.Load(), float64(e.running.Load())/float64(max(1, e.cfg.MaxConcurrency))
	if e.steps != nil { // the scheduler's own counts: admitted here is not yet running there
		r, w, u := e.steps.counts()
		run, wait, use = int64(r), e.waiting.Load()+int64(w), u
	}
	gauge(running, "Requests running.", run)
	gauge(waiting, "Requests waiting in the queue.", wait)
	fmt.Fprintf(&b, "# HELP %s%s KV cache in use, 0..1.\n# TYPE %s%s gauge\n%s%s %g\n", p, usage, p, usage, p, usage, use)
	type sample struct {
		label string
		v     int64
	}
	counter := func(name, help, label string, samples ...sample) {
		fmt.Fprintf(&b, "# HELP %s%s %s\n# TYPE %s%s counter\n", p, name, help, p, name)
		for _, x := range samples {
			fmt.Fprintf(&b, "%s%s{%s=%q} %d\n", p, name, label, x.label, x.v)
		}
	}
	counter("prompt_tokens_by_source_total", "Prompt tokens by where their KV came from.", "source",
		sample{"external_kv_transfer", s.PromptTokensRemote}, sample{"local_compute", s.PromptTokensRecompute}, sample{"local_cache_hit", s.PromptTokensLocalCache})
	counter("kv_handoffs_total", "Prefill KV handoffs by event.", "event",
		sample{"pinned", s.HandoffsPinned}, sample{"pulled", s.HandoffsPulled}, sample{"expired", s.HandoffsExpired}, sample{"load_failed", s.KVLoadFailures},
		sample{"released", s.HandoffsReleased}, sample{"stale_read", s.StaleKVReads})
	plain := func(name, help string, v int64) {
		fmt.Fprintf(&b, "# HELP %s%s %s\n# TYPE %s%s counter\n%s%s %d\n", p, name, help, p, name, p, name, v)
	}
	plain("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", s.PrefixCacheQueries)
	plain("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", s.PrefixCacheHits)
	counter("requests_total", "Requests by outcome.", "outcome",
		sample{"ok", s.RequestsOK}, sample{"failed", s.RequestsFailed}, sample{"cancelled", s.RequestsCancelled}, sample{"rejected", s.RequestsRejected})
	if e.cfg.Engine == EngineVLLM && (e.cfg.RuntimeLoRA || len(e.cfg.LoRAAdapters) > 0 || e.cfg.MaxLoRAs > 0) {
		e.lora.writeInfo(&b)
	}
	_, _ = io.WriteString(w, b.String())
}

func (e *Engine) serveDebugKV(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, 200, map[string]any{"pinned": e.kv.list(), "rooms": e.rooms.list(), "stats": e.Stats()})
}

// slotsOf is how many requests an engine takes before its bounded queue: MaxConcurrency, or
// with the step model every request its scheduler may hold (it runs MaxSeqs of them and queues
// the rest itself).
func slotsOf(c Config) int {
	if c.Steps != nil {
		return c.Steps.MaxSeqs + c.QueueSize
	}
	return c.MaxConcurrency
}

// admit takes a run slot, waiting in the bounded queue; false means the queue is full.
func (e *Engine) admit(ctx context.Context) (release func(), ok bool, err error) {
	select {
	case e.slots <- struct{}{}:
	default:
		if e.waiting.Add(1) > int64(e.cfg.QueueSize) {
			e.waiting.Add(-1)
			return nil, false, nil
		}
		select {
		case e.slots <- struct{}{}:
			e.waiting.Add(-1)
		case <-ctx.Done():
			e.waiting.Add(-1)
			return nil, true, ctx.Err()
		}
	}
	e.running.Add(1)
	return func() { e.running.Add(-1); <-e.slots }, true, nil
}

// slot takes a run slot for a request the engine took already (no queue bound applies to it).
func (e *Engine) slot(ctx context.Context) (release func(), err error) {
	e.waiting.Add(1)
	defer e.waiting.Add(-1)
	select {
	case e.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	e.running.Add(1)
	return func() { e.running.Add(-1); <-e.slots }, nil
}

// faults returns the engine's faults overlaid with the request's X-Sim-Fault header.
func (e *Engine) faults(r *http.Request) Faults {
	f := e.cfg.Faults
	h := r.Header.Get(HeaderFault)
	if h == "" {
		return f
	}
	for _, part := range strings.Split(h, ",") {
		k, v, _ := strings.Cut(strings.TrimSpace(part), "=")
		switch k {
		case "status":
			f.Status, _ = strconv.Atoi(v)
		case "rate":
			f.Rate, _ = strconv.ParseFloat(v, 64)
		case "latency":
			f.Latency, _ = time.ParseDuration(v)
		case "hang":
			f.Hang = true
		case "drop-after":
			f.DropAfter, _ = strconv.Atoi(v)
		case "hang-after":
			f.HangAfter, _ = strconv.Atoi(v)
		}
	}
	return f
}

func (f Faults) fails() bool {
	return f.Status != 0 && (f.Rate == 0 || rand.Float64() < f.Rate)
}

// drops reports whether this stream is to be dropped after DropAfter events.
func (f Faults) drops() bool {
	return f.DropAfter > 0 && (f.Status != 0 || f.Rate == 0 || rand.Float64() < f.Rate)
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// apiError is an error the engine answers with.
type apiError struct {
	status int
	msg    string
	// inBand: the engine refuses the request inside the stream it answered 200
	// (writeStreamRefusal), not with the status.
	inBand bool
}

func (e *apiError) Error() string { return fmt.Sprintf("%d: %s", e.status, e.msg) }

func errorf(status int, format string, args ...any) *apiError {
	return &apiError{status: status, msg: fmt.Sprintf(format, args...)}
}

// errorBody is the engine's error JSON: vLLM's nested envelope or SGLang's flat one.
func (e *Engine) errorBody(ae *apiError) map[string]any {
	if e.cfg.Engine == EngineSGLang {
		return map[string]any{"object": "error", "message": ae.msg, "type": http.StatusText(ae.status), "param": nil, "code": ae.status}
	}
	typ := map[int]string{400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailableError"}[ae.status]
	if typ == "" {
		typ = strings.ReplaceAll(http.StatusText(ae.status), " ", "") + "Error"
	}
	return map[string]any{"error": map[string]any{"message": ae.msg, "type": typ, "param": nil, "code": ae.status}}
}

func (e *Engine) writeError(w http.ResponseWriter, ae *apiError) {
	writeJSON(w, ae.status, e.errorBody(ae))
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b := marshalIDFirst(v)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = crand.Read(b)
	return hex.EncodeToString(b)
}

var errDropped = errors.New("connection dropped by fault injection")

// marshalIDFirst encodes v as JSON, an object's "id" key first: vLLM's response models declare
// id as their first field (CompletionResponse, ChatCompletionResponse and their stream chunks in
// vllm/entrypoints/openai/protocol.py), so its answers and events begin {"id":... — where Baton
// reads an answer's id to prove it is its request's. Other keys follow in Go's order.
func marshalIDFirst(v any) []byte {
	m, ok := v.(map[string]any)
	id, has := m["id"]
	if !ok || !has {
		b, _ := json.Marshal(v)
		return b
	}
	rest := make(map[string]any, len(m)-1)
	for k, x := range m {
		if k != "id" {
			rest[k] = x
		}
	}
	ib, _ := json.Marshal(id)
	rb, _ := json.Marshal(rest)
	out := append([]byte(`{"id":`), ib...)
	if len(rb) > 2 {
		out = append(append(out, ','), rb[1:]...)
	} else {
		out = append(out, '}')
	}
	return out
}
