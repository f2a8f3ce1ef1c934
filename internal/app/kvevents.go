package app

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/kvevents"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/worker"
)

// kvEventsPort is where vLLM and SGLang publish KV events by default (tcp://*:5557).
const kvEventsPort = "5557"

// maxKVIndexBlocks bounds the KV event index (about 139 MiB per million blocks).
const maxKVIndexBlocks = 4 << 20

// KVEvents is the gateway's subscription to its engines' KV events: one subscriber per worker
// that publishes, all feeding one index.
type KVEvents struct {
	Index *kvevents.Index
	subs  map[string][]*kvevents.Subscriber // by worker URL, one per DP rank
	wg    sync.WaitGroup
}

// newKVEvents subscribes to the workers with a KV events endpoint (every worker with kv_events
// on), or returns nil when none has one.
func newKVEvents(cfg config.Config, ws []*worker.Worker, log *slog.Logger) *KVEvents {
	k := &KVEvents{Index: kvevents.NewIndex(maxKVIndexBlocks), subs: map[string][]*kvevents.Subscriber{}}
	for _, w := range ws {
		ep := w.KVEventsEndpoint
		if ep == "" && cfg.KVEvents {
			if u, err := url.Parse(w.URL); err == nil {
				ep = "tcp://" + net.JoinHostPort(u.Hostname(), kvEventsPort)
			}
		}
		if ep == "" {
			continue
		}
		modelOf := func() string {
			if in := w.Info(); in != nil && len(in.Models) > 0 {
				return in.Models[0].ID
			}
			return ""
		}
		// A vLLM engine with DP ranks publishes rank r on the endpoint's port + r.
		for r := 0; r < max(1, w.DPSize); r++ {
			s := &kvevents.Subscriber{Worker: w.URL, Rank: r, Endpoint: portPlus(ep, r), Index: k.Index, Log: log, ModelOf: modelOf}
			if w.KVEventsReplayEndpoint != "" {
				s.ReplayEndpoint = portPlus(w.KVEventsReplayEndpoint, r)
			}
			k.subs[w.URL] = append(k.subs[w.URL], s)
		}
	}
	if len(k.subs) == 0 {
		return nil
	}
	return k
}

// Start runs the subscribers until ctx ends.
func (k *KVEvents) Start(ctx context.Context) {
	for _, ss := range k.subs {
		for _, s := range ss {
			k.wg.Go(func() { s.Run(ctx) })
		}
	}
}

// Wait waits for the subscribers to stop.
func (k *KVEvents) Wait() { k.wg.Wait() }

// KVEventsView is a worker's KV event subscription in GET /workers.
type KVEventsView struct {
	Endpoint  string  `json:"endpoint"` // rank 0's; rank r is at its port + r
	Ranks     int     `json:"ranks"`
	Healthy   bool    `json:"healthy"`
	Received  uint64  `json:"received"`
	Malformed uint64  `json:"malformed"`
	Ignored   uint64  `json:"ignored"`
	Gaps      uint64  `json:"gaps"`
	Resets    uint64  `json:"resets"`
	Replays   uint64  `json:"replays"` // gaps filled from the replay endpoint
	LastSeq   int64   `json:"last_seq"`
	LagMs     float64 `json:"lag_ms,omitempty"` // now minus the last batch's engine timestamp
}

// View returns w's subscription state, or nil when Baton does not subscribe to it.
func (k *KVEvents) View(w *worker.Worker) any {
	if k == nil || k.subs[w.URL] == nil {
		return nil
	}
	st, _ := k.stats(w.URL)
	v := &KVEventsView{Endpoint: k.subs[w.URL][0].Endpoint, Ranks: len(k.subs[w.URL]), Healthy: st.Healthy, Received: st.Received, Malformed: st.Malformed, Ignored: st.Ignored,
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

var (
	kvEventsDesc  = prometheus.NewDesc("baton_kv_events_total", "KV event messages from each worker's engine by result (received, malformed; ignored counts unknown events).", []string{"worker", "result"}, nil)
	kvGapsDesc    = prometheus.NewDesc("baton_kv_events_gaps_total", "KV event sequence gaps (events lost): each filled from the replay endpoint or, failing that, cleared the worker's blocks.", []string{"worker"}, nil)
	kvReplaysDesc = prometheus.NewDesc("baton_kv_events_replays_total", "KV event gaps filled from the engine's replay endpoint.", []string{"worker"}, nil)
	kvResetsDesc  = prometheus.NewDesc("baton_kv_events_resets_total", "KV event sequences that started again (the engine restarted): each cleared the worker's blocks.", []string{"worker"}, nil)
	kvHealthyDesc = prometheus.NewDesc("baton_kv_events_healthy", "1 when the worker's last KV event batch was decoded and applied.", []string{"worker"}, nil)
	kvBlocksDesc  = prometheus.NewDesc("baton_kv_index_blocks", "Blocks the KV event index holds, per worker and rank summed.", nil, nil)
	kvDroppedDesc = prometheus.NewDesc("baton_kv_index_dropped_total", "Stored blocks the KV event index refused past its bound.", nil, nil)
)

func (c kvCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{kvEventsDesc, kvGapsDesc, kvReplaysDesc, kvResetsDesc, kvHealthyDesc, kvBlocksDesc, kvDroppedDesc} {
		ch <- d
	}
}

func (c kvCollector) Collect(ch chan<- prometheus.Metric) {
	for url := range c.k.subs {
		st, _ := c.k.stats(url)
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
	n, dropped := c.k.Index.Size()
	ch <- prometheus.MustNewConstMetric(kvBlocksDesc, prometheus.GaugeValue, float64(n))
	ch <- prometheus.MustNewConstMetric(kvDroppedDesc, prometheus.CounterValue, float64(dropped))
}

// precise returns cache_aware's view from the engines' events: the prompt's token ids (asked of
// a subscribed candidate's /tokenize, cached), their blocks at that engine's block size, and
// each subscribed worker's resident share; -1 for workers without a healthy subscription, nil
// when none has one or the prompt cannot be tokenized.
func (k *KVEvents) precise(client *http.Client) func(ws []*worker.Worker, req *policy.Request) []float64 {
	tok := &kvevents.Tokenizer{Client: client, Timeout: 2 * time.Second, MaxEntries: 4096}
	return func(ws []*worker.Worker, req *policy.Request) []float64 {
		var via *worker.Worker
		bs := 0
		for _, w := range ws {
			if st, size := k.stats(w.URL); st.Healthy && size > 0 {
				via, bs = w, size
				break
			}
		}
		if via == nil {
			return nil
		}
		toks, ok := tok.Tokens(via.URL, req.Model, req.Path, req.Body)
		if !ok || len(toks) == 0 {
			return nil
		}
		model := req.Model
		if in := via.Info(); in != nil && len(in.Models) > 0 {
			model = in.Models[0].ID
		}
		held := k.Index.Match(kvevents.Keys(model, "", toks, bs))
		out := make([]float64, len(ws))
		for i, w := range ws {
			out[i] = -1
			if st, _ := k.stats(w.URL); st.Healthy {
				out[i] = float64(held[w.URL]*bs) / float64(len(toks))
			}
		}
		return out
	}
}

// stats sums a worker's subscriptions (one per DP rank): healthy when every rank's is; the
// engine's block size from any rank that reported one. Zero for a worker without any.
func (k *KVEvents) stats(url string) (kvevents.Stats, int) {
	var out kvevents.Stats
	bs := 0
	for i, s := range k.subs[url] {
		st := s.Stats()
		out.Received, out.Malformed, out.Ignored = out.Received+st.Received, out.Malformed+st.Malformed, out.Ignored+st.Ignored
		out.Gaps, out.Resets, out.Replays = out.Gaps+st.Gaps, out.Resets+st.Resets, out.Replays+st.Replays
		out.LastSeq, out.LastTS = max(out.LastSeq, st.LastSeq), max(out.LastTS, st.LastTS)
		out.Healthy = st.Healthy && (i == 0 || out.Healthy)
		bs = max(bs, s.BlockSize())
	}
	return out, bs
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
