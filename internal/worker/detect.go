package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/retry"
)

// ErrUnreachable means the engine did not answer; registration is retried.
var ErrUnreachable = errors.New("engine not reachable")

// ErrNeedsKey is an engine that refuses Baton's requests (401, 403): it wants a key Baton does not send.
var ErrNeedsKey = errors.New("engine wants a key")

// ErrNotEngine is a host that answers HTTP but not as an engine does: its /v1/models lists no
// model, and no engine info route (SGLang's /get_model_info, /server_info) names one.
var ErrNotEngine = errors.New("not an inference engine")

// probeTimeout bounds each registration probe.
const probeTimeout = 5 * time.Second

// Detect asks the engine what it is: GET /v1/models owned_by ("vllm"/"sglang"), else
// GET /version (vLLM), else GET /server_info or /get_server_info (SGLang), else generic. Models
// come from /v1/models. Configured runtime and models win over what the engine says.
func Detect(ctx context.Context, client *http.Client, w *Worker) (*Info, error) {
	in, err := detect(ctx, client, w)
	if err == nil && in.Runtime == config.RuntimeSGLang {
		in.DPSize, in.KVEvents, in.MaxLoadedLoRAs, in.BootstrapPort, in.MaxRunning = sglangServerInfo(ctx, client, w)
	}
	return in, err
}

// sglangServerInfo reads the data parallel size, the KV events publisher, the most LoRA
// adapters an SGLang engine may hold loaded (its --max-loaded-loras), its bootstrap port
// (--disaggregation-bootstrap-port, server_args.py's disaggregation_bootstrap_port, a
// prefill's) and the most requests it runs at once (--max-running-requests, server_args.py's
// max_running_requests) it reports (0, nil, 0, 0 and 0 when it does not).
func sglangServerInfo(ctx context.Context, client *http.Client, w *Worker) (int, *KVEventsPublisher, int, int, int) {
	for _, p := range []string{"/server_info", "/get_server_info"} {
		status, body, err := probe(ctx, client, w, p)
		if err != nil || status != http.StatusOK {
			continue
		}
		var v struct {
			DPSize         int  `json:"dp_size"`
			MaxLoadedLoRAs *int `json:"max_loaded_loras"`
			MaxRunning     *int `json:"max_running_requests"`
			BootstrapPort  *int `json:"disaggregation_bootstrap_port"`
			KVEvents       *struct {
				Publisher string `json:"publisher"`
				Host      string `json:"endpoint_host"`
				PortBase  int    `json:"endpoint_port_base"`
				Topic     string `json:"topic"`
				BlockSize int    `json:"block_size"`
				DPSize    int    `json:"dp_size"`
			} `json:"kv_events"`
		}
		if json.Unmarshal(body, &v) != nil {
			return 0, nil, 0, 0, 0
		}
		running := 0
		if r := v.MaxRunning; r != nil && *r > 0 && *r <= 1<<20 {
			running = *r
		}
		bport := 0
		if p := v.BootstrapPort; p != nil && *p >= 1 && *p <= 65535 {
			bport = *p
		}
		maxLoaded := 0
		if v.MaxLoadedLoRAs != nil && *v.MaxLoadedLoRAs > 0 {
			maxLoaded = *v.MaxLoadedLoRAs
		}
		var pub *KVEventsPublisher
		if k := v.KVEvents; k != nil && k.Publisher == "zmq" {
			host := k.Host
			if host == "" || host == "*" || host == "0.0.0.0" || host == "::" || host == "[::]" {
				host = w.BootstrapHost
			}
			ep := "tcp://" + net.JoinHostPort(strings.Trim(host, "[]"), strconv.Itoa(k.PortBase))
			if config.CheckKVEventsEndpoint(ep) == nil && k.BlockSize >= 0 && k.DPSize >= 0 && k.DPSize <= MaxTrackedRanks {
				pub = &KVEventsPublisher{Endpoint: ep, BlockSize: k.BlockSize, DPSize: k.DPSize, Topic: k.Topic}
			}
		}
		return v.DPSize, pub, maxLoaded, bport, running
	}
	return 0, nil, 0, 0, 0
}

// MaxRunning is the most requests w's engine runs at once, as it reports it or, for one that
// does not, as the worker's max_running_requests label (smg's) says; 0 when neither does.
func (w *Worker) MaxRunning() int {
	if in := w.Info(); in != nil && in.MaxRunning > 0 {
		return in.MaxRunning
	}
	if n, err := strconv.Atoi(w.configured.Labels["max_running_requests"]); err == nil && n > 0 && n <= 1<<20 {
		return n
	}
	return 0
}

// BootstrapMismatch says why w's configured bootstrap port is not its engine's: an SGLang
// prefill whose /server_info reports another disaggregation_bootstrap_port than the one Baton
// sends its decodes to (every handoff through it would look for the prefill's bootstrap server
// where none listens); "" when they agree, or either is unknown.
func (w *Worker) BootstrapMismatch() string {
	in := w.Info()
	if in == nil || w.Role != config.RolePrefill || in.Runtime != config.RuntimeSGLang || w.BootstrapPort == nil ||
		in.BootstrapPort == 0 || in.BootstrapPort == *w.BootstrapPort {
		return ""
	}
	return fmt.Sprintf("its bootstrap port is configured as %d, but its engine reports %d (/server_info disaggregation_bootstrap_port, --disaggregation-bootstrap-port): decodes would look for its bootstrap server where none listens; give it the engine's port",
		*w.BootstrapPort, in.BootstrapPort)
}

func detect(ctx context.Context, client *http.Client, w *Worker) (*Info, error) {
	in := &Info{Runtime: w.configured.Runtime, Models: w.modelsOf(nil)}
	status, body, err := probe(ctx, client, w, "/v1/models")
	if err != nil {
		return nil, err
	}
	if status >= 500 {
		return nil, fmt.Errorf("%w: GET /v1/models answered %d", ErrUnreachable, status)
	}
	if status == http.StatusUnauthorized || status == http.StatusForbidden {
		hint := "give the engines their key with --api-key or --worker-api-key (or the worker's api_key)"
		if w.APIKey != "" {
			hint = "the key Baton sends it (--worker-api-key or its api_key) is not the engine's"
		}
		return nil, fmt.Errorf("%w: GET /v1/models answered %d: %s", ErrNeedsKey, status, hint)
	}
	ownedBy := ""
	var reported []Model
	if status == http.StatusOK {
		reported, ownedBy = parseModels(body)
		in.Models = w.modelsOf(reported)
		in.Unserved = unserved(w.configured.Models, reported)
	}
	if len(reported) == 0 && !namesAModel(ctx, client, w) {
		hint := ""
		if strings.HasSuffix(w.URL, "/v1") {
			hint = " (the worker's URL ends in /v1: give the engine's base URL, Baton adds the routes' /v1)"
		}
		return nil, fmt.Errorf("%w: GET /v1/models answered %d with no model, and no engine info route (/get_model_info, /server_info) names one%s", ErrNotEngine, status, hint)
	}
	if in.Runtime != "" {
		return in, nil
	}
	switch ownedBy {
	case config.RuntimeVLLM:
		in.Runtime = config.RuntimeVLLM
		return in, nil
	case config.RuntimeSGLang:
		in.Runtime = config.RuntimeSGLang
		return in, nil
	}
	if s, _, err := probe(ctx, client, w, "/version"); err == nil && s == http.StatusOK {
		in.Runtime = config.RuntimeVLLM
		return in, nil
	}
	for _, p := range []string{"/server_info", "/get_server_info"} {
		if s, _, err := probe(ctx, client, w, p); err == nil && s == http.StatusOK {
			in.Runtime = config.RuntimeSGLang
			return in, nil
		}
	}
	in.Runtime = config.RuntimeGeneric
	return in, nil
}

// unserved are the configured models the engine's own list (reported) lacks: a request for
// one would be the engine's 404. None when nothing is configured.
func unserved(configured []string, reported []Model) []string {
	var out []string
	for _, id := range configured {
		if !slices.ContainsFunc(reported, func(m Model) bool { return m.ID == id }) {
			out = append(out, id)
		}
	}
	return out
}

// namesAModel reports whether an engine info route of w's names the model it serves (SGLang's
// /get_model_info, /server_info and /get_server_info give model_path): an engine whose
// /v1/models lists none.
func namesAModel(ctx context.Context, client *http.Client, w *Worker) bool {
	for _, p := range []string{"/get_model_info", "/server_info", "/get_server_info"} {
		status, body, err := probe(ctx, client, w, p)
		if err != nil || status != http.StatusOK {
			continue
		}
		var v struct {
			ModelPath string `json:"model_path"`
		}
		if json.Unmarshal(body, &v) == nil && v.ModelPath != "" {
			return true
		}
	}
	return false
}

// parseModels reads a /v1/models answer: each card's model (with its parent, for an adapter)
// and the first card's owned_by.
func parseModels(body []byte) (models []Model, ownedBy string) {
	var list struct {
		Data []json.RawMessage `json:"data"`
	}
	if json.Unmarshal(body, &list) != nil {
		return nil, ""
	}
	for _, raw := range list.Data {
		var card struct {
			ID      string `json:"id"`
			OwnedBy string `json:"owned_by"`
			Parent  any    `json:"parent"`
		}
		if json.Unmarshal(raw, &card) != nil || card.ID == "" {
			continue
		}
		if ownedBy == "" {
			ownedBy = card.OwnedBy
		}
		parent, _ := card.Parent.(string)
		if parent == card.ID {
			parent = ""
		}
		models = append(models, Model{ID: card.ID, Card: raw, Parent: parent})
	}
	return models, ownedBy
}

// withCards attaches reported cards to configured models of the same id, and adds the adapters
// the engine reports on a configured model.
func withCards(configured, reported []Model) []Model {
	for i := range configured {
		for _, r := range reported {
			if r.ID == configured[i].ID {
				configured[i].Card = r.Card
			}
		}
	}
	for _, r := range reported {
		if r.Parent != "" && slices.ContainsFunc(configured, func(m Model) bool { return m.ID == r.Parent }) &&
			!slices.ContainsFunc(configured, func(m Model) bool { return m.ID == r.ID }) {
			configured = append(configured, r)
		}
	}
	return configured
}

// modelsOf is w's models given those its engine reported: the reported ones, or the configured
// ones with their cards and the adapters the engine reports on them.
func (w *Worker) modelsOf(reported []Model) []Model {
	if len(w.configured.Models) == 0 {
		return reported
	}
	models := make([]Model, 0, len(w.configured.Models))
	for _, id := range w.configured.Models {
		models = append(models, Model{ID: id})
	}
	return withCards(models, reported)
}

// RefreshModels reads w's /v1/models again and, when the models it lists changed (an adapter
// loaded or unloaded), records them on w and rebuilds the model index; changed reports whether
// they did.
func (r *Registry) RefreshModels(ctx context.Context, client *http.Client, w *Worker) (changed bool, err error) {
	old := w.Info()
	if old == nil {
		return false, nil
	}
	status, body, err := probe(ctx, client, w, "/v1/models")
	if err != nil {
		return false, err
	}
	if status != http.StatusOK {
		return false, fmt.Errorf("GET /v1/models answered %d", status)
	}
	reported, _ := parseModels(body)
	models := w.modelsOf(reported)
	if slices.EqualFunc(models, old.Models, func(a, b Model) bool { return a.ID == b.ID && a.Parent == b.Parent }) {
		return false, nil
	}
	next := *old
	next.Models, next.Unserved = models, unserved(w.configured.Models, reported)
	w.SetInfo(&next)
	r.Rebuild()
	return true, nil
}

func probe(ctx context.Context, client *http.Client, w *Worker, path string) (int, []byte, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.URL+path, nil)
	if err != nil {
		return 0, nil, err
	}
	if w.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+w.APIKey)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return 0, nil, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	return resp.StatusCode, body, nil
}

// Registrar registers workers in the background: each worker is probed until it answers, then
// marked ready. An engine that is still loading never stops Baton from starting.
type Registrar struct {
	Registry    *Registry
	Client      *http.Client
	Log         *slog.Logger
	MaxInterval time.Duration // longest wait between attempts for one worker
	// OnRegistered, when set, is called once for each worker that registered, after its info is
	// set and before it is ready.
	OnRegistered func(w *Worker)

	wg  sync.WaitGroup
	mu  sync.Mutex
	ctx context.Context // Start's, for workers added later
}

// Start registers every worker of the registry that is not registered yet, each in its own
// goroutine, until it succeeds, the worker is removed or ctx ends. Wait waits for them.
func (r *Registrar) Start(ctx context.Context) {
	r.mu.Lock()
	r.ctx = ctx
	r.mu.Unlock()
	for _, w := range r.Registry.Snapshot().Workers {
		if w.Registered() {
			continue
		}
		r.wg.Go(func() { r.register(ctx, w) })
	}
}

// Register registers a worker added after Start, in the background.
func (r *Registrar) Register(w *Worker) {
	r.mu.Lock()
	ctx := r.ctx
	r.mu.Unlock()
	if ctx == nil {
		return // Start registers it
	}
	r.wg.Go(func() { r.register(ctx, w) })
}

// Wait waits for the registration goroutines to end.
func (r *Registrar) Wait() { r.wg.Wait() }

func (r *Registrar) register(ctx context.Context, w *Worker) {
	wait := retry.Backoff{Initial: 200 * time.Millisecond, Max: r.MaxInterval, Multiplier: 2}
	for attempt := 1; ; attempt++ {
		if w.Removed() {
			return
		}
		in, err := Detect(ctx, r.Client, w)
		w.noteRegistration(err)
		if err == nil {
			w.SetInfo(in)
			w.correlation.Store(correlatedNone) // a new registration: the engine (restarted, reconfigured) is seen anew
			// What the hook learns (a Mooncake prefill's engine ids) is known before the
			// worker takes traffic.
			if r.OnRegistered != nil {
				r.OnRegistered(w)
			}
			w.SetReady(true)
			r.Registry.Rebuild()
			ids := make([]string, len(in.Models))
			for i, m := range in.Models {
				ids[i] = m.ID
			}
			r.Log.Info("worker registered", "worker", w.URL, "role", w.Role, "runtime", in.Runtime, "models", ids)
			if why := w.BootstrapMismatch(); why != "" {
				r.Log.Warn("SGLang prefill worker's bootstrap port is not its engine's: every PD request through it fails its handoff",
					"worker", w.URL, "bootstrap_port", *w.BootstrapPort, "engine_bootstrap_port", in.BootstrapPort, "why", why)
			}
			if len(in.Unserved) > 0 {
				r.Log.Warn("worker's configuration names models its engine does not serve: requests for them are not sent to it, and /readiness lists any no engine serves (503 only when no model can be served)",
					"worker", w.URL, "unserved", in.Unserved)
			}
			return
		}
		switch {
		case attempt == 1 && (errors.Is(err, ErrNeedsKey) || errors.Is(err, ErrNotEngine)):
			r.Log.Error("worker refuses Baton's requests; it takes no traffic until it answers", "worker", w.URL, "err", err)
		case attempt == 1:
			r.Log.Warn("worker not reachable yet; registering it in the background", "worker", w.URL, "err", err)
		default:
			r.Log.Debug("worker still not reachable", "worker", w.URL, "attempt", attempt, "err", err)
		}
		if !retry.Sleep(ctx, wait.Delay(attempt)) {
			return
		}
	}
}
