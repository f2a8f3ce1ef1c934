// Package kvfleet is the gateway's subscription to its engines' KV events over the fleet: per
// worker that publishes, one subscriber per DP rank (dialling the engine's publisher, or fed by
// the one listener engines that connect out publish to, its topics believed only from the
// worker's own address), all feeding one index; the tokenizer that turns a request's prompt
// into the engines' token ids; the collector of their metrics; and cache_aware's precise view.
package kvfleet

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gcpace"
	"github.com/baton-llm/baton/internal/kvevents"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/worker"
)

// kvEventsPort is where vLLM and SGLang publish KV events by default (tcp://*:5557).
const kvEventsPort = "5557"

// maxKVIndexBlocks bounds the KV event index when Baton knows no memory limit. The index costs
// about 146 bytes per block held and up to 182 while its maps grow (measured, 4 M blocks over
// 16 workers); kvIndexBytesPerBlock adds the collector's headroom.
const (
	maxKVIndexBlocks     = 4 << 20
	kvIndexBytesPerBlock = 256
)

// kvIndexBound sizes the index from the process's memory limit (the smaller of GOMEMLIMIT and
// the container's, read from cgroupFiles): a quarter of it, at kvIndexBytesPerBlock, never more
// than maxKVIndexBlocks. from names the limit used, "" when none is known.
func kvIndexBound(cgroupFiles ...string) (blocks int, from string, limit int64) {
	if limit, from = gcpace.MemoryLimit(cgroupFiles...); from == "" {
		return maxKVIndexBlocks, "", 0
	}
	return int(max(1024, min(maxKVIndexBlocks, limit/4/kvIndexBytesPerBlock))), from, limit
}

// KVEvents is the gateway's subscription to its engines' KV events, all feeding one index: per
// worker that publishes, one subscriber per DP rank, dialling the engine's publisher (an
// explicit kv_events_endpoint from startup; the one an SGLang engine reports in /server_info,
// or with --kv-events the worker's host:5557, once it registers) or, with --kv-events-listen,
// fed by the one socket engines that connect out publish to.
type KVEvents struct {
	Index *kvevents.Index
	// tokenizer asks the engines for request prompts' token ids (cached).
	tokenizer *kvevents.Tokenizer

	log      *slog.Logger
	all      bool // --kv-events: every worker, at its host's 5557 unless it says otherwise
	listener *kvevents.Listener
	reg      *worker.Registry // names the workers behind listener topics
	peers    kvPeers          // the addresses a listened-to worker publishes from

	mu   sync.RWMutex
	subs map[string]*workerSubs // by worker URL
	n    atomic.Int32           // len(subs): routing skips the event index when 0
	ctx  context.Context        // nil until Start
	wg   sync.WaitGroup
}

// workerSubs is one worker's subscription: where it comes from and one subscriber per DP rank
// (in listening mode, per rank heard from; nil entries for ranks not heard from yet).
type workerSubs struct {
	source string // configured, server_info, default or listen
	ranks  []*kvevents.Subscriber
	cancel context.CancelFunc // stops the dialling subscribers; nil before Start
}

// run starts ws's dialling subscribers under ctx. Called with k.mu held.
func (k *KVEvents) run(ctx context.Context, ws *workerSubs) {
	if ws.source == "listen" {
		return
	}
	ctx, ws.cancel = context.WithCancel(ctx)
	for _, s := range ws.ranks {
		k.wg.Go(func() { s.Run(ctx) })
	}
}

// Remove ends a removed worker's subscription and forgets what the index holds of it.
func (k *KVEvents) Remove(w *worker.Worker) {
	k.mu.Lock()
	ws := k.subs[w.URL]
	delete(k.subs, w.URL)
	k.n.Store(int32(len(k.subs)))
	k.mu.Unlock()
	if ws != nil && ws.cancel != nil {
		ws.cancel()
	}
	k.Index.ClearWorker(w.URL)
}

// New returns the gateway's KV events subscription, with the workers that name their
// endpoint subscribed from the start; others join as they register (Registered).
func New(cfg config.Config, ws []*worker.Worker, reg *worker.Registry, log *slog.Logger) *KVEvents {
	blocks, from, limit := kvIndexBound(gcpace.CgroupLimitFiles...)
	if from != "" && (cfg.KVEvents || cfg.KVEventsListen != "") {
		log.Info("kv events: the index holds at most a quarter of the memory limit", "blocks", blocks, "limit_from", from, "limit_mib", limit>>20)
	}
	k := &KVEvents{Index: kvevents.NewIndex(blocks), subs: map[string]*workerSubs{}, log: log, all: cfg.KVEvents, reg: reg,
		tokenizer: &kvevents.Tokenizer{Timeout: 2 * time.Second, MaxEntries: 4096, MaxBytes: 64 << 20},
		peers: kvPeers{lookup: func(ctx context.Context, host string) ([]netip.Addr, error) {
			return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		}}}
	if cfg.KVEventsListen != "" {
		k.listener = &kvevents.Listener{Addr: listenAddr(cfg.KVEventsListen), Route: k.route, Log: log}
	}
	for _, w := range ws {
		k.Configured(w)
	}
	return k
}

// Configured subscribes to a worker at the KV events endpoint its settings name, if any (from
// the start, before it registers).
func (k *KVEvents) Configured(w *worker.Worker) {
	if w.KVEventsEndpoint != "" {
		k.subscribe(w, w.KVEventsEndpoint, "configured", 0)
	}
}

// Registered subscribes to a worker that just registered, if it publishes and is not
// subscribed to yet: at the publisher its engine reports (SGLang /server_info), else with
// --kv-events at its host's port 5557.
func (k *KVEvents) Registered(w *worker.Worker) {
	in := w.Info()
	switch {
	case in != nil && in.KVEvents != nil:
		p := in.KVEvents
		k.subscribeRanks(w, p.Endpoint, "server_info", p.BlockSize, max(1, p.DPSize))
	case k.all:
		if u, err := url.Parse(w.URL); err == nil {
			k.subscribe(w, "tcp://"+net.JoinHostPort(u.Hostname(), kvEventsPort), "default", 0)
		}
	}
}

// subscribe subscribes to w at endpoint ep (rank r at its port + r, as engines with DP ranks
// publish), unless w already has a subscription.
func (k *KVEvents) subscribe(w *worker.Worker, ep, source string, blockSize int) {
	k.subscribeRanks(w, ep, source, blockSize, max(1, w.DPSize))
}

func (k *KVEvents) subscribeRanks(w *worker.Worker, ep, source string, blockSize, ranks int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if (k.subs[w.URL] != nil && k.subs[w.URL].source != "listen") || w.Removed() {
		return
	}
	ws := &workerSubs{source: source}
	for r := 0; r < ranks; r++ {
		s := k.newSubscriber(w, r)
		s.Endpoint = portPlus(ep, r)
		s.SetBlockSize(blockSize)
		if w.KVEventsReplayEndpoint != "" {
			s.ReplayEndpoint = portPlus(w.KVEventsReplayEndpoint, r)
		}
		ws.ranks = append(ws.ranks, s)
	}
	if k.ctx != nil {
		k.run(k.ctx, ws)
	}
	k.subs[w.URL] = ws
	k.n.Store(int32(len(k.subs)))
	k.log.Info("kv events: subscribing", "worker", w.URL, "endpoint", ep, "ranks", ranks, "source", source)
}

func (k *KVEvents) newSubscriber(w *worker.Worker, rank int) *kvevents.Subscriber {
	return &kvevents.Subscriber{Worker: w.URL, Rank: rank, Index: k.Index, Log: k.log, ModelOf: func() string {
		if in := w.Info(); in != nil && len(in.Models) > 0 {
			return in.Models[0].ID
		}
		return ""
	}}
}

// route names the subscriber of a listened-to message: the topic kv@<ip>:<port>@<model> (or
// kv@<ip>@<model>, when one worker has that host) names a worker by its URL's host and port;
// the rank is bounded by what Baton tracks. A worker that dials its engine keeps that. The
// message must come from the worker's own address (its URL's IP, or one its host name resolves
// to): anyone who reaches the listener could otherwise steer routing or clear a worker's blocks.
func (k *KVEvents) route(topic string, rank int, peer netip.Addr) (*kvevents.Subscriber, error) {
	rest, ok := strings.CutPrefix(topic, "kv@")
	if !ok || rank < 0 || rank >= worker.MaxTrackedRanks {
		return nil, kvevents.ErrUnknownTopic
	}
	addr, _, _ := strings.Cut(rest, "@")
	var found *worker.Worker
	for _, w := range k.reg.Snapshot().Workers {
		u, err := url.Parse(w.URL)
		if err != nil {
			continue
		}
		if u.Host == addr || (u.Port() != "" && net.JoinHostPort(u.Hostname(), u.Port()) == addr) {
			found = w
			break
		}
		if u.Hostname() == strings.Trim(addr, "[]") {
			if found != nil {
				return nil, kvevents.ErrUnknownTopic // several workers on that host: the topic must name the port
			}
			found = w
		}
	}
	if found == nil {
		return nil, kvevents.ErrUnknownTopic
	}
	if !k.peers.is(found.URL, peer) {
		return nil, kvevents.ErrForeignPeer
	}
	s := k.listened(found, rank, topic)
	if s == nil {
		return nil, kvevents.ErrUnknownTopic
	}
	return s, nil
}

// listened returns the listening-mode subscriber of w's rank, made on first use; nil when w's
// engine is dialled instead.
func (k *KVEvents) listened(found *worker.Worker, rank int, topic string) *kvevents.Subscriber {
	k.mu.RLock()
	ws := k.subs[found.URL]
	var s *kvevents.Subscriber
	if ws != nil && ws.source == "listen" && rank < len(ws.ranks) {
		s = ws.ranks[rank]
	}
	k.mu.RUnlock()
	if s != nil || (ws != nil && ws.source != "listen") {
		return s
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	ws = k.subs[found.URL]
	if ws == nil {
		ws = &workerSubs{source: "listen"}
		k.subs[found.URL] = ws
		k.n.Store(int32(len(k.subs)))
		k.log.Info("kv events: an engine connected and publishes", "worker", found.URL, "topic", topic)
	}
	if ws.source != "listen" {
		return nil
	}
	for len(ws.ranks) <= rank {
		ws.ranks = append(ws.ranks, nil)
	}
	if ws.ranks[rank] == nil {
		s := k.newSubscriber(found, rank)
		s.Endpoint = "listen"
		ws.ranks[rank] = s
	}
	return ws.ranks[rank]
}

// Start runs the subscribers (and the listener) until ctx ends; an error is a listener that
// cannot bind.
func (k *KVEvents) Start(ctx context.Context) error {
	k.mu.Lock()
	k.ctx = ctx
	for _, ws := range k.subs {
		k.run(ctx, ws)
	}
	k.mu.Unlock()
	if k.listener == nil {
		return nil
	}
	ready := make(chan error, 1)
	k.wg.Go(func() { k.listener.Run(ctx, ready) })
	if err := <-ready; err != nil {
		return fmt.Errorf("kv events listener %s: %w", k.listener.Addr, err)
	}
	k.log.Info("kv events: listening for engines that connect out", "addr", k.listener.BoundAddr())
	return nil
}

// ListenAddr is where the listener bound, "" without one.
func (k *KVEvents) ListenAddr() string {
	if k.listener == nil {
		return ""
	}
	return k.listener.BoundAddr()
}

// Wait waits for the subscribers to stop.
func (k *KVEvents) Wait() { k.wg.Wait(); k.tokenizer.Wait() }

// listenAddr turns the configured listen address into one to bind ("*" is every interface).
func listenAddr(addr string) string {
	hostport := strings.TrimPrefix(addr, "tcp://")
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return addr
	}
	if host == "*" {
		host = "0.0.0.0"
	}
	return "tcp://" + net.JoinHostPort(host, port)
}

// KVEventsView is a worker's KV event subscription in GET /workers.
type KVEventsView struct {
	Endpoint string `json:"endpoint"` // rank 0's (rank r is at its port + r); "listen" when the engine connects to Baton
	// Source says where the endpoint came from: configured, server_info (the engine reported
	// it), default (--kv-events: the worker's host:5557) or listen.
	Source  string `json:"source"`
	Ranks   int    `json:"ranks"`
	Healthy bool   `json:"healthy"`
	// Unindexable: the engine's block hashes cannot be chained (older SGLang); routing for the
	// worker uses the approximate index.
	Unindexable bool    `json:"unindexable,omitempty"`
	Received    uint64  `json:"received"`
	Malformed   uint64  `json:"malformed"`
	Ignored     uint64  `json:"ignored"`
	Gaps        uint64  `json:"gaps"`
	Resets      uint64  `json:"resets"`
	Replays     uint64  `json:"replays"` // gaps filled from the replay endpoint
	LastSeq     int64   `json:"last_seq"`
	LagMs       float64 `json:"lag_ms,omitempty"` // now minus the last batch's engine timestamp
}

// View returns w's subscription state, or nil when Baton does not subscribe to it.
func (k *KVEvents) View(w *worker.Worker) any {
	st, _, ws := k.stats(w.URL)
	if ws == nil {
		return nil
	}
	v := &KVEventsView{Endpoint: ws.endpoint, Source: ws.source, Ranks: ws.n, Healthy: st.Healthy, Unindexable: st.Unindexable, Received: st.Received, Malformed: st.Malformed, Ignored: st.Ignored,
		Gaps: st.Gaps, Resets: st.Resets, Replays: st.Replays, LastSeq: st.LastSeq}
	if st.LastTS > 0 {
		v.LagMs = float64(time.Now().UnixNano())/1e6 - st.LastTS*1e3
	}
	return v
}

// collector exports the subscriptions at scrape time: baton_kv_events_total{worker,result},
// baton_kv_events_gaps_total{worker}, baton_kv_events_resets_total{worker},
// baton_kv_events_healthy{worker}, baton_kv_index_blocks, baton_kv_index_dropped_total.
type kvCollector struct{ k *KVEvents }

// Collector exports the subscriptions' metrics at scrape time.
func (k *KVEvents) Collector() prometheus.Collector { return kvCollector{k} }

// PromptTokens is the token count of a request's prompt when the tokenizer has it cached.
func (k *KVEvents) PromptTokens(model, path string, body []byte) (int, bool) {
	return k.tokenizer.Count(model, path, body)
}

// CountPromptTokens asks the worker at workerURL (the one that computed the request) for the
// token count of its prompt within ctx: every shape its /tokenize can count is asked
// (kvevents.Tokenizer.PromptCount: a conversation whole where the engine templates one — vLLM,
// not SGLang, whose /tokenize takes no messages — else each text), the rest counted one token per
// byte. False when the worker is gone or the route has no prompt Baton knows.
func (k *KVEvents) CountPromptTokens(ctx context.Context, workerURL, model, path string, body []byte) (int, bool) {
	if k.reg == nil {
		return 0, false
	}
	w := k.reg.Snapshot().Get(workerURL)
	if w == nil {
		return 0, false
	}
	n, _, ok := k.tokenizer.PromptCount(ctx, w.URL, w.APIKey, model, path, body, w.Runtime() != config.RuntimeSGLang)
	return n, ok
}

// AskPromptTokens counts a request's prompt before it is sent (CountPromptTokens) at a worker
// that serves model, ready ones first; false when none does or the count is not the engines'
// own throughout (a part counted by its bytes).
func (k *KVEvents) AskPromptTokens(ctx context.Context, model, path string, body []byte) (int, bool) {
	if k.reg == nil {
		return 0, false
	}
	var via *worker.Worker
	for _, w := range k.reg.Snapshot().Workers {
		if in := w.Info(); in == nil || w.Removed() || !slices.ContainsFunc(in.Models, func(m worker.Model) bool { return m.ID == model }) {
			continue
		}
		if via == nil || w.Ready() && !via.Ready() {
			via = w
		}
	}
	if via == nil {
		return 0, false
	}
	n, exact, ok := k.tokenizer.PromptCount(ctx, via.URL, via.APIKey, model, path, body, via.Runtime() != config.RuntimeSGLang)
	return n, ok && exact
}

// SetTokenizeClient sets the HTTP client the tokenizer asks engines' /tokenize with.
func (k *KVEvents) SetTokenizeClient(c *http.Client) { k.tokenizer.Client = c }

// ListenerCounts returns the listener's message counts: received, malformed, unrouted (the
// topic named no known worker), refused (from another address than the worker's); zeros
// without a listener.
func (k *KVEvents) ListenerCounts() (received, malformed, unrouted, refused uint64) {
	if k.listener == nil {
		return 0, 0, 0, 0
	}
	l := k.listener
	return l.Received.Load(), l.Malformed.Load(), l.Unrouted.Load(), l.Refused.Load()
}

// BlockSize returns the block size of a worker's subscription (0 until known).
func (k *KVEvents) BlockSize(url string) int {
	_, bs, _ := k.stats(url)
	return bs
}

var (
	kvEventsDesc   = prometheus.NewDesc("baton_kv_events_total", "KV event messages from each worker's engine by result (received, malformed; ignored counts unknown events).", []string{"worker", "result"}, nil)
	kvGapsDesc     = prometheus.NewDesc("baton_kv_events_gaps_total", "KV event sequence gaps (events lost): each filled from the replay endpoint or, failing that, cleared the worker's blocks.", []string{"worker"}, nil)
	kvReplaysDesc  = prometheus.NewDesc("baton_kv_events_replays_total", "KV event gaps filled from the engine's replay endpoint.", []string{"worker"}, nil)
	kvResetsDesc   = prometheus.NewDesc("baton_kv_events_resets_total", "KV event sequences that started again (the engine restarted): each cleared the worker's blocks.", []string{"worker"}, nil)
	kvHealthyDesc  = prometheus.NewDesc("baton_kv_events_healthy", "1 when the worker's last KV event batch was decoded and applied.", []string{"worker"}, nil)
	kvBlocksDesc   = prometheus.NewDesc("baton_kv_index_blocks", "Blocks the KV event index holds, per worker and rank summed.", nil, nil)
	kvListenerDesc = prometheus.NewDesc("baton_kv_events_listener_total", "KV event messages on the --kv-events-listen socket by result (received, malformed, unrouted: the topic named no known worker; refused: it named a worker at another address than the connection came from).", []string{"result"}, nil)
	kvTokenizeDesc = prometheus.NewDesc("baton_kv_tokenize_total", "Prompts cache_aware needed token ids for, by result: cached, asked (an engine's /tokenize answered) or failed (routed by the approximate index instead).", []string{"result"}, nil)
	kvDroppedDesc  = prometheus.NewDesc("baton_kv_index_dropped_total", "Stored blocks the KV event index refused past its bound.", nil, nil)
)

func (c kvCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{kvEventsDesc, kvGapsDesc, kvReplaysDesc, kvResetsDesc, kvHealthyDesc, kvBlocksDesc, kvDroppedDesc, kvListenerDesc, kvTokenizeDesc} {
		ch <- d
	}
}

func (c kvCollector) Collect(ch chan<- prometheus.Metric) {
	c.k.mu.RLock()
	urls := make([]string, 0, len(c.k.subs))
	for url := range c.k.subs {
		urls = append(urls, url)
	}
	c.k.mu.RUnlock()
	for _, url := range urls {
		st, _, _ := c.k.stats(url)
		ch <- prometheus.MustNewConstMetric(kvEventsDesc, prometheus.CounterValue, float64(st.Received), url, "received")
		ch <- prometheus.MustNewConstMetric(kvEventsDesc, prometheus.CounterValue, float64(st.Malformed), url, "malformed")
		ch <- prometheus.MustNewConstMetric(kvEventsDesc, prometheus.CounterValue, float64(st.Ignored), url, "ignored")
		ch <- prometheus.MustNewConstMetric(kvGapsDesc, prometheus.CounterValue, float64(st.Gaps), url)
		ch <- prometheus.MustNewConstMetric(kvResetsDesc, prometheus.CounterValue, float64(st.Resets), url)
		ch <- prometheus.MustNewConstMetric(kvReplaysDesc, prometheus.CounterValue, float64(st.Replays), url)
		healthy := 0.0
		if st.Healthy {
			healthy = 1
		}
		ch <- prometheus.MustNewConstMetric(kvHealthyDesc, prometheus.GaugeValue, healthy, url)
	}
	if l := c.k.listener; l != nil {
		ch <- prometheus.MustNewConstMetric(kvListenerDesc, prometheus.CounterValue, float64(l.Received.Load()), "received")
		ch <- prometheus.MustNewConstMetric(kvListenerDesc, prometheus.CounterValue, float64(l.Malformed.Load()), "malformed")
		ch <- prometheus.MustNewConstMetric(kvListenerDesc, prometheus.CounterValue, float64(l.Unrouted.Load()), "unrouted")
		ch <- prometheus.MustNewConstMetric(kvListenerDesc, prometheus.CounterValue, float64(l.Refused.Load()), "refused")
	}
	t := c.k.tokenizer
	ch <- prometheus.MustNewConstMetric(kvTokenizeDesc, prometheus.CounterValue, float64(t.Hits.Load()), "cached")
	ch <- prometheus.MustNewConstMetric(kvTokenizeDesc, prometheus.CounterValue, float64(t.Asks.Load()-t.Failures.Load()), "asked")
	ch <- prometheus.MustNewConstMetric(kvTokenizeDesc, prometheus.CounterValue, float64(t.Failures.Load()), "failed")
	n, dropped := c.k.Index.Size()
	ch <- prometheus.MustNewConstMetric(kvBlocksDesc, prometheus.GaugeValue, float64(n))
	ch <- prometheus.MustNewConstMetric(kvDroppedDesc, prometheus.CounterValue, float64(dropped))
}

// Precise returns cache_aware's view from the engines' events: the prompt's token ids (asked of
// a subscribed candidate's /tokenize, cached), their blocks at that engine's block size, and
// each subscribed worker's resident share; -1 for workers without a healthy subscription, nil
// when none has one or the prompt cannot be tokenized.
func (k *KVEvents) Precise() func(ctx context.Context, ws []*worker.Worker, req *policy.Request) []float64 {
	tok := k.tokenizer
	return func(ctx context.Context, ws []*worker.Worker, req *policy.Request) []float64 {
		if k.n.Load() == 0 {
			return nil
		}
		var via *worker.Worker
		bs := 0
		for _, w := range ws {
			if st, size, _ := k.stats(w.URL); st.Healthy && size > 0 {
				via, bs = w, size
				break
			}
		}
		if via == nil {
			return nil
		}
		toks, ok := tok.Tokens(ctx, via.URL, via.APIKey, req.Model, req.Path, req.Body)
		if !ok || len(toks) == 0 {
			return nil
		}
		model, lora := chainOf(via, req.Model)
		held := map[string]int{}
		for h, n := range k.Index.MatchHolders(kvevents.Keys(model, lora, toks, bs)) {
			if n > held[h.Worker] {
				held[h.Worker] = n
				if req.Ranks == nil {
					req.Ranks = map[string]int{}
				}
				req.Ranks[h.Worker] = h.Rank // the rank holding the longest prefix
			}
		}
		out := make([]float64, len(ws))
		for i, w := range ws {
			out[i] = -1
			if st, _, _ := k.stats(w.URL); st.Healthy {
				out[i] = float64(held[w.URL]*bs) / float64(len(toks))
			}
		}
		return out
	}
}

// chainOf returns what the index roots a request for model on at worker w: the model its events
// are indexed under (its first listed model) and the LoRA adapter ("" for the base model). vLLM
// lists a loaded adapter in /v1/models under its own name with the base model as "parent", and
// its KV events name it in lora_name: a request for the adapter is matched against the
// adapter's blocks, never the base model's.
func chainOf(w *worker.Worker, model string) (base, lora string) {
	in := w.Info()
	if in == nil || len(in.Models) == 0 {
		return model, ""
	}
	base = in.Models[0].ID
	if model == base {
		return base, ""
	}
	for _, m := range in.Models[1:] {
		if m.ID != model || len(m.Card) == 0 {
			continue
		}
		var card struct {
			Parent *string `json:"parent"`
		}
		if json.Unmarshal(m.Card, &card) == nil && card.Parent != nil && *card.Parent != "" {
			return base, model
		}
	}
	return base, ""
}

// subsView is what stats reports of a worker's subscription besides the counters.
type subsView struct {
	endpoint, source string
	n                int
}

// stats sums a worker's subscriptions (one per DP rank): healthy when every rank's is; the
// engine's block size from any rank that reported one. Zero and nil for a worker without any.
func (k *KVEvents) stats(url string) (kvevents.Stats, int, *subsView) {
	k.mu.RLock()
	ws := k.subs[url]
	var ranks []*kvevents.Subscriber
	if ws != nil {
		ranks = ws.ranks
	}
	k.mu.RUnlock()
	if ws == nil {
		return kvevents.Stats{LastSeq: -1}, 0, nil
	}
	out := kvevents.Stats{LastSeq: -1, Healthy: true}
	view := &subsView{source: ws.source}
	bs := 0
	for _, s := range ranks {
		if s == nil {
			continue
		}
		if view.n == 0 {
			view.endpoint = s.Endpoint
		}
		view.n++
		st := s.Stats()
		out.Received, out.Malformed, out.Ignored = out.Received+st.Received, out.Malformed+st.Malformed, out.Ignored+st.Ignored
		out.Gaps, out.Resets, out.Replays = out.Gaps+st.Gaps, out.Resets+st.Resets, out.Replays+st.Replays
		out.LastSeq, out.LastTS = max(out.LastSeq, st.LastSeq), max(out.LastTS, st.LastTS)
		out.Healthy = out.Healthy && st.Healthy
		out.Unindexable = out.Unindexable || st.Unindexable
		bs = max(bs, s.BlockSize())
	}
	out.Healthy = out.Healthy && view.n > 0
	return out, bs, view
}

// portPlus returns the tcp://host:port endpoint ep with its port raised by r.
func portPlus(ep string, r int) string {
	if r == 0 {
		return ep
	}
	host, port, err := net.SplitHostPort(strings.TrimPrefix(ep, "tcp://"))
	p, perr := strconv.Atoi(port)
	if err != nil || perr != nil {
		return ep
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+r))
}
