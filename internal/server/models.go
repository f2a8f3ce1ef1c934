package server

import (
	"cmp"
	"encoding/json"
	"sort"

	"net/http"
	"strconv"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"

	"github.com/baton-llm/baton/internal/worker"
)

// serveModels answers GET /v1/models with the union of the models of every ready worker, each
// as the card its first worker reported.
func (s *Server) serveModels(w http.ResponseWriter, r *http.Request) {
	who := recordOf(r).Who // a tenant sees only the models it may use
	seen, served := map[string]bool{}, map[string]bool{}
	data := []json.RawMessage{}
	for _, wk := range s.reg.Snapshot().Workers {
		in := wk.Info()
		if in == nil || !wk.Ready() {
			continue
		}
		for _, m := range in.Models {
			served[m.ID] = true
			if seen[m.ID] || who != nil && !who.Allows(m.ID) {
				continue
			}
			seen[m.ID] = true
			card := m.Card
			if card == nil {
				card = openai.MarshalJSON(map[string]any{"id": m.ID, "object": "model", "created": 0, "owned_by": in.Runtime})
			}
			data = append(data, card)
		}
	}
	// Aliases beside the names the workers serve, when what they name is served.
	models, _ := s.d.Models()
	aliases := make([]string, 0, len(models))
	for name := range models {
		aliases = append(aliases, name)
	}
	sort.Strings(aliases)
	for _, name := range aliases {
		target := models[name].Serve
		if target == "" || seen[name] || !served[target] || who != nil && !who.Allows(name) {
			continue
		}
		seen[name] = true
		data = append(data, openai.MarshalJSON(map[string]any{"id": name, "object": "model", "created": 0, "owned_by": "baton", "root": target}))
	}
	// Declared adapters Baton loads on demand, where their base model is served.
	if s.opts.Adapters != nil {
		for _, a := range s.opts.Adapters.Settings().Adapters {
			if seen[a.Name] || !served[a.Base] || who != nil && !who.Allows(a.Name) {
				continue
			}
			seen[a.Name] = true
			data = append(data, openai.MarshalJSON(map[string]any{"id": a.Name, "object": "model", "created": 0, "owned_by": "baton", "parent": a.Base}))
		}
	}
	body := openai.MarshalJSON(map[string]any{"object": "list", "data": data})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	_, _ = w.Write(body)
}

// workerView is one worker in GET /workers.
type workerView struct {
	ID       string `json:"id"`
	URL      string `json:"url"`
	Source   string `json:"source,omitempty"` // config, admin or kubernetes
	Draining bool   `json:"draining,omitempty"`
	Cordoned bool   `json:"cordoned,omitempty"` // its pod is not ready
	// Health sums up the above: ready, registering, unhealthy, cordoned or draining.
	Health        string   `json:"health"`
	Breaker       string   `json:"breaker"` // closed, open or half-open
	Role          string   `json:"role"`
	Runtime       string   `json:"runtime,omitempty"`
	Models        []string `json:"models"`
	Ready         bool     `json:"ready"`
	Registered    bool     `json:"registered"`
	InFlight      int64    `json:"in_flight"`
	Successes     int64    `json:"successes"`
	Failures      int64    `json:"failures"`
	BootstrapPort *int     `json:"bootstrap_port,omitempty"`
	DPSize        int      `json:"dp_size,omitempty"`
	// DPInFlight is the legs Baton has in flight on each DP rank (which it balances).
	DPInFlight []int64 `json:"dp_in_flight,omitempty"`
	// KVConnector is the effective connector mode of a vLLM prefill worker.
	KVConnector string            `json:"kv_connector,omitempty"`
	KVDetail    string            `json:"kv_connector_detail,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`
	// Engine is the load the engine last reported; Fresh says whether routing still trusts it.
	Engine *engineView `json:"engine_load,omitempty"`
	// KVEvents is Baton's subscription to the engine's KV events, when it has one.
	KVEvents any `json:"kv_events,omitempty"`
}

// engineView is a worker's engine-reported load in GET /workers.
type engineView struct {
	Running *float64 `json:"running,omitempty"`
	Waiting *float64 `json:"waiting,omitempty"`
	KVUsage *float64 `json:"kv_usage,omitempty"`
	AgeMs   int64    `json:"age_ms"`
	Fresh   bool     `json:"fresh"`
}

func engineOf(w *worker.Worker, now time.Time) *engineView {
	l := w.EngineLoad()
	if l.At.IsZero() {
		return nil
	}
	v := &engineView{AgeMs: now.Sub(l.At).Milliseconds(), Fresh: l.Fresh(now)}
	if l.HasRunning {
		v.Running = &l.Running
	}
	if l.HasWaiting {
		v.Waiting = &l.Waiting
	}
	if l.HasKV {
		v.KVUsage = &l.KVUsage
	}
	return v
}

// serveWorkers answers GET /workers: every worker with its live state and, for vLLM prefill
// workers, the effective KV connector mode.
func (s *Server) serveWorkers(w http.ResponseWriter, _ *http.Request) {
	out := []workerView{}
	now := time.Now()
	for _, wk := range s.reg.Snapshot().Workers {
		out = append(out, s.view(wk, now))
	}
	body := openai.MarshalJSON(map[string]any{"workers": out, "total": len(out)})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	_, _ = w.Write(body)
}

// view is one worker's state as GET /workers shows it (never its api_key).
func (s *Server) view(wk *worker.Worker, now time.Time) workerView {
	ok, failed := wk.Outcomes()
	v := workerView{ID: wk.ID, URL: wk.URL, Draining: wk.Draining(), Cordoned: wk.Cordoned(), Role: wk.Role, Runtime: wk.Runtime(), Models: []string{}, Ready: wk.Ready(),
		Registered: wk.Registered(), InFlight: wk.InFlight(), Successes: ok, Failures: failed,
		BootstrapPort: wk.BootstrapPort, DPSize: wk.DPSize, Labels: wk.Labels, Engine: engineOf(wk, now)}
	if s.opts.Admin.SourceOf != nil {
		v.Source = s.opts.Admin.SourceOf(wk.URL)
	}
	v.Breaker = wk.BreakerState().String()
	switch {
	case v.Draining:
		v.Health = "draining"
	case v.Cordoned:
		v.Health = "cordoned"
	case !v.Registered:
		v.Health = "registering"
	case v.Ready:
		v.Health = "ready"
	default:
		v.Health = "unhealthy"
	}
	if in := wk.Info(); in != nil {
		for _, m := range in.Models {
			v.Models = append(v.Models, m.ID)
		}
	}
	dp := wk.DPSize
	switch {
	case wk.Role == config.RolePrefill && wk.Runtime() == config.RuntimeVLLM:
		c := pd.ConnectorFor(wk, s.opts.KVConnector)
		v.KVConnector, v.KVDetail = c.Mode, c.String()
		dp = max(dp, c.DPSize)
	case wk.Role == config.RoleDecode && wk.Runtime() == config.RuntimeVLLM:
		// The connector a decode's pairing reads (pd.Compatible): its own, else the default.
		if name := cmp.Or(wk.KVConnector, s.opts.KVConnector); name != "" {
			v.KVConnector, _ = config.KVConnectorMode(name)
		}
	}
	v.DPInFlight = wk.RankInFlight(dp)
	if s.opts.KVEventsView != nil {
		v.KVEvents = s.opts.KVEventsView(wk)
	}
	return v
}
