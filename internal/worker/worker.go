// Package worker holds the inference engines Baton routes to: each Worker's fixed settings and
// live state (in atomics), the Registry (an immutable snapshot swapped atomically) and runtime
// detection at registration.
package worker

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/outcome"
)

// Model is one model a worker serves: its id and the card the worker reported in /v1/models.
type Model struct {
	ID   string
	Card json.RawMessage // nil when the model was configured rather than reported
	// Parent is the base model of a LoRA adapter (its card's "parent", vLLM's and SGLang's
	// alike); "" for a base model.
	Parent string
}

// Info is what registration learned about a worker. It is replaced whole, never mutated.
type Info struct {
	Runtime string  // vllm, sglang or generic
	Models  []Model // empty means the worker accepts any model
	// Unserved are models the worker's configuration names that its engine's /v1/models does
	// not list: the worker is not a candidate for them.
	Unserved []string
	// DPSize is the data parallel size the engine reports (SGLang /server_info), 0 if unknown.
	DPSize int
	// KVEvents is the KV events publisher the engine reports (SGLang /server_info kv_events),
	// nil when it reports none.
	KVEvents *KVEventsPublisher
	// MaxLoadedLoRAs is the most adapters the engine holds loaded (SGLang's --max-loaded-loras,
	// from /server_info), 0 when unbounded or unknown. vLLM has no such bound: its max_lora
	// (lora_requests_info) is the adapters one batch may run.
	MaxLoadedLoRAs int
	// BootstrapPort is the bootstrap server port the engine reports (SGLang /server_info
	// disaggregation_bootstrap_port), 0 when unknown; see Worker.BootstrapMismatch.
	BootstrapPort int
	// MaxRunning is the most requests the engine runs at once that it reports (SGLang
	// /server_info max_running_requests), 0 when unknown; a worker's max_running_requests label
	// (smg's) says it for an engine that does not.
	MaxRunning int
}

// KVEventsPublisher is an engine's own description of its KV events publisher.
type KVEventsPublisher struct {
	// Endpoint is rank 0's tcp://host:port, the worker's host when the engine binds every
	// interface; rank r publishes on port + r.
	Endpoint  string
	BlockSize int
	DPSize    int
	Topic     string
}

// Worker is one engine. Its identity and settings are fixed at construction; its live state is
// in atomics, safe to read on the hot path.
type Worker struct {
	// ID names the worker in the admin API: derived from its URL, so the same engine keeps it
	// across restarts of Baton and re-additions.
	ID     string
	URL    string // base URL without a trailing slash
	Role   string // regular, prefill or decode
	Labels map[string]string
	APIKey string // bearer token for this worker; empty forwards the client's

	// BootstrapHost is the host of URL, as SGLang legs name their prefill (IPv6 in brackets).
	BootstrapHost string
	// Endpoint is the worker's address as an Endpoint Picker names it: host:port of its URL
	// (the scheme's port when the URL gives none).
	Endpoint string
	// BootstrapPort is the prefill's bootstrap server port; nil sends JSON null.
	BootstrapPort *int
	// DPSize is the number of data parallel ranks Baton addresses; 0 or 1 means none.
	DPSize int
	// DPSizeInvalid is set when a dp_size label is not a positive integer: the DP topology
	// is unknown, and Baton mints no engine id for the worker (fail closed).
	DPSizeInvalid bool
	// KVConnector and KVEngineID are a vLLM prefill worker's connector settings (fields win
	// over the kv_connector and kv_engine_id labels).
	KVConnector, KVEngineID string
	// KVEventsEndpoint is the engine's KV events publisher, "" for none configured;
	// KVEventsReplayEndpoint its replay endpoint, "" for none.
	KVEventsEndpoint, KVEventsReplayEndpoint string

	configured config.Worker
	info       atomic.Pointer[Info]              // nil until registration succeeds
	regErr     atomic.Pointer[RegistrationError] // the last registration attempt's failure; nil after success
	engineIDs  atomic.Pointer[map[int]string]
	engineLoad atomic.Pointer[EngineLoad]
	// correlation is how its engine was seen naming its answers after the X-Request-Id Baton
	// sent, since it registered: correlatedNone, correlatedByID or correlatedByHeader.
	correlation atomic.Uint32
	ready       atomic.Bool
	draining    atomic.Bool // being removed: takes no new requests, whatever its health
	cordoned    atomic.Bool // its pod is not ready: no new requests until it is again
	removed     atomic.Bool // out of the registry: registration and subscriptions stop
	inflight    atomic.Int64
	rank        atomic.Uint64 // rotates the start of the rank search, so ties go round robin
	rankLoad    [MaxTrackedRanks]atomic.Int64
	successes   atomic.Int64
	failures    atomic.Int64
	breaker     *breaker // nil: always closed

	// health check state, owned by the HealthChecker
	healthFails, healthOKs atomic.Int32
	// lastHealth is the last failed health probe (nil: none yet); healthCauses counts the failed
	// probes by cause, indexed as HealthCauses.
	lastHealth   atomic.Pointer[HealthFailure]
	healthCauses [len(HealthCauses)]atomic.Int64

	// targets holds URL+path parsed, by path (Target), for at most maxTargets paths.
	targets  sync.Map // string → *url.URL
	ntargets atomic.Int32
}

// maxTargets bounds the paths whose parsed URL a worker keeps: the routes Baton sends to are a
// handful, and a path past the bound is parsed each time.
const maxTargets = 32

// Target returns the URL of path on the worker (its URL followed by path), parsed once per path
// and shared: the caller copies it before changing it. A URL that does not parse is an error, as
// url.Parse gives it.
func (w *Worker) Target(path string) (*url.URL, error) {
	if u, ok := w.targets.Load(path); ok {
		return u.(*url.URL), nil
	}
	u, err := url.Parse(w.URL + path)
	if err != nil {
		return nil, err
	}
	if w.ntargets.Load() < maxTargets && w.ntargets.Add(1) <= maxTargets {
		w.targets.Store(path, u)
	}
	return u, nil
}

// New returns a worker for c, not yet registered and not ready.
func New(c config.Worker) *Worker {
	role := c.Role
	if role == "" {
		role = config.RoleRegular
	}
	u := strings.TrimRight(c.URL, "/")
	host, endpoint := "localhost", ""
	if pu, err := url.Parse(u); err == nil && pu.Hostname() != "" {
		host = pu.Hostname()
		port := pu.Port()
		if port == "" {
			port = map[bool]string{true: "443", false: "80"}[pu.Scheme == "https"]
		}
		endpoint = net.JoinHostPort(host, port)
		if strings.Contains(host, ":") {
			host = "[" + host + "]"
		}
	}
	w := &Worker{
		ID:            ID(u),
		URL:           u,
		Role:          role,
		Labels:        c.Labels,
		APIKey:        c.APIKey,
		BootstrapHost: host,
		Endpoint:      endpoint,
		BootstrapPort: c.BootstrapPort,
		DPSize:        c.DPSize,
		KVConnector:   cmp.Or(c.KVConnector, c.Labels["kv_connector"]),
		KVEngineID:    cmp.Or(c.KVEngineID, c.Labels["kv_engine_id"]),
		configured:    c,

		KVEventsEndpoint:       cmp.Or(c.KVEventsEndpoint, c.Labels["kv_events_endpoint"]),
		KVEventsReplayEndpoint: cmp.Or(c.KVEventsReplayEndpoint, c.Labels["kv_events_replay_endpoint"]),
	}
	if label, ok := c.Labels["dp_size"]; ok && c.DPSize == 0 {
		if n, err := strconv.Atoi(label); err == nil && n > 0 {
			w.DPSize = n
		} else {
			w.DPSizeInvalid = true
		}
	}
	if label, ok := c.Labels["bootstrap_port"]; ok && c.BootstrapPort == nil {
		if n, err := strconv.Atoi(label); err == nil && n > 0 && n < 65536 {
			w.BootstrapPort = &n
		}
	}
	return w
}

// ID derives a worker's id from its URL: 16 hex digits of its SHA-256.
func ID(url string) string {
	sum := sha256.Sum256([]byte(strings.TrimRight(url, "/")))
	return hex.EncodeToString(sum[:8])
}

// Configured returns the settings the worker was made from.
func (w *Worker) Configured() config.Worker { return w.configured }

// Draining reports whether the worker is being removed.
func (w *Worker) Draining() bool { return w.draining.Load() }

// SetDraining stops new requests to the worker for good: it is being removed.
func (w *Worker) SetDraining() {
	w.draining.Store(true)
	w.ready.Store(false)
}

// Removed reports whether the worker has left the registry.
func (w *Worker) Removed() bool { return w.removed.Load() }

// String returns the worker's URL.
func (w *Worker) String() string { return w.URL }

// Info returns what registration learned, or nil before registration succeeded.
func (w *Worker) Info() *Info { return w.info.Load() }

// Registered reports whether registration has succeeded.
func (w *Worker) Registered() bool { return w.info.Load() != nil }

// Runtime returns the worker's runtime, or "" before registration.
func (w *Worker) Runtime() string {
	if in := w.info.Load(); in != nil {
		return in.Runtime
	}
	return w.configured.Runtime
}

// classRank orders the priority classes, highest first.
var classRank = map[string]int{config.PriorityCritical: 0, config.PriorityInteractive: 1, config.PriorityDefault: 2, config.PriorityBatch: 3}

// EnginePriority is the value of the engine's "priority" field for a request of class, and
// whether to send it: only to a worker marked forward_priority. default is 0, the engines' own
// default; the others are one step apart, signed by the engine's order (vLLM runs lower values
// first, SGLang higher ones unless started with --schedule-low-priority-values-first).
func (w *Worker) EnginePriority(class string) (int, bool) {
	c := w.configured
	rank, ok := classRank[class]
	if !c.ForwardPriority || !ok {
		return 0, false
	}
	order := c.PriorityOrder
	if order == "" {
		order = config.PriorityLowerFirst
		if w.Runtime() == config.RuntimeSGLang {
			order = config.PriorityHigherFirst
		}
	}
	if order == config.PriorityHigherFirst {
		return 2 - rank, true
	}
	return rank - 2, true
}

// Ready reports whether the worker may receive traffic.
func (w *Worker) Ready() bool { return w.ready.Load() }

// SetReady sets whether the worker may receive traffic; a draining or cordoned worker stays
// out.
func (w *Worker) SetReady(ok bool) { w.ready.Store(ok && !w.draining.Load() && !w.cordoned.Load()) }

// Cordoned reports whether the worker is held out of rotation by its platform (its Kubernetes
// pod is not ready).
func (w *Worker) Cordoned() bool { return w.cordoned.Load() }

// SetCordoned holds the worker out of rotation (requests in flight finish) or lets it back;
// back, it is ready if registered (health checks correct that at their next probe).
func (w *Worker) SetCordoned(on bool) {
	if w.cordoned.Swap(on) == on {
		return
	}
	if on {
		w.ready.Store(false)
	} else {
		w.ready.Store(w.Registered() && !w.draining.Load())
	}
}

// InFlight returns the number of requests the worker is serving through Baton.
func (w *Worker) InFlight() int64 { return w.inflight.Load() }

// Enter counts one request in flight on w and reports whether it is a half-open circuit's
// probe; Leave, called exactly once with that report, ends it.
func (w *Worker) Enter() (probe bool) {
	w.inflight.Add(1)
	probe = w.breaker != nil && BreakerState(w.breaker.state.Load()) == BreakerHalfOpen
	if probe {
		w.breaker.probes.Add(1)
	}
	return probe
}

// Leave ends a request Enter counted.
func (w *Worker) Leave(probe bool) {
	w.inflight.Add(-1)
	if probe {
		w.breaker.probes.Add(-1)
	}
}

// SetInfo records what registration learned about the worker; the registry indexes it on its
// next Rebuild.
func (w *Worker) SetInfo(in *Info) { w.info.Store(in) }

// RegistrationError is why a worker's last registration attempt failed: a Cause a program can
// branch on, and the message.
type RegistrationError struct {
	// Cause is one of wrong_key (the engine refuses Baton's key, or wants one), refused (the
	// connection was refused), timeout, not_an_engine (it answers HTTP, not as an engine),
	// unreachable (any other failure to get an answer).
	Cause, Message string
}

// LastRegistrationError is why w's last registration attempt failed, nil when it registered
// (or has not been tried).
func (w *Worker) LastRegistrationError() *RegistrationError { return w.regErr.Load() }

// noteRegistration records a registration attempt's failure (nil: it succeeded).
func (w *Worker) noteRegistration(err error) {
	if err == nil {
		w.regErr.Store(nil)
		return
	}
	w.regErr.Store(&RegistrationError{Cause: registrationCause(err), Message: err.Error()})
}

// registrationCause names the cause of a registration failure.
func registrationCause(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, ErrNeedsKey):
		return "wrong_key"
	case errors.Is(err, ErrNotEngine):
		return "not_an_engine"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	}
	return "unreachable"
}

// Record takes one outcome of a request this worker served: its status, or the error that kept
// it from answering; package outcome says whether it is a sample and a failure.
func (w *Worker) Record(status int, err error) {
	v := outcome.Of(status, err)
	switch {
	case !v.Sample:
		return
	case v.Failure:
		w.failures.Add(1)
	default:
		w.successes.Add(1)
	}
	if w.breaker != nil {
		w.breaker.record(v.Failure)
	}
}

// Outcomes returns the success and failure samples recorded so far.
func (w *Worker) Outcomes() (successes, failures int64) { return w.successes.Load(), w.failures.Load() }

// MaxTrackedRanks bounds the DP ranks whose in-flight legs Baton counts; ranks past it are
// chosen round robin.
const MaxTrackedRanks = 64

// NextRank returns the data parallel rank to use on this worker: the one with the fewest legs
// in flight (EnterRank), ties round robin; false when the worker has no DP ranks configured.
func (w *Worker) NextRank() (int, bool) { return w.NextRankOf(w.DPSize) }

// NextRankOf is NextRank over n ranks (n > 1), for a DP size learned from the engine.
func (w *Worker) NextRankOf(n int) (int, bool) {
	if n <= 1 {
		return 0, false
	}
	start := int((w.rank.Add(1) - 1) % uint64(n))
	if n > MaxTrackedRanks {
		return start, true
	}
	best, bestLoad := start, w.rankLoad[start].Load()
	for i := 1; i < n && bestLoad > 0; i++ {
		r := (start + i) % n
		if l := w.rankLoad[r].Load(); l < bestLoad {
			best, bestLoad = r, l
		}
	}
	return best, true
}

// RankFor returns the DP rank over n ranks to send a leg to when rank prefer holds the longest
// cached prefix of its prompt: prefer, unless its legs in flight exceed the least loaded rank's
// by more than rankSlack (a hot prefix must not bury one rank), else NextRankOf. prefer < 0 (none
// known) is NextRankOf.
func (w *Worker) RankFor(prefer, n int) (int, bool) {
	if prefer < 0 || prefer >= n || n <= 1 || n > MaxTrackedRanks {
		return w.NextRankOf(n)
	}
	least := w.rankLoad[prefer].Load()
	for r := 0; r < n; r++ {
		least = min(least, w.rankLoad[r].Load())
	}
	if w.rankLoad[prefer].Load() > least+rankSlack {
		return w.NextRankOf(n)
	}
	return prefer, true
}

// rankSlack is how many more legs in flight than the least loaded rank a rank holding the
// prompt's prefix may carry and still be chosen for it.
const rankSlack = 4

// EnterRank counts a leg in flight on DP rank r; LeaveRank uncounts it.
func (w *Worker) EnterRank(r int) {
	if r >= 0 && r < MaxTrackedRanks {
		w.rankLoad[r].Add(1)
	}
}

// LeaveRank uncounts a leg EnterRank counted.
func (w *Worker) LeaveRank(r int) {
	if r >= 0 && r < MaxTrackedRanks {
		w.rankLoad[r].Add(-1)
	}
}

// RankInFlight returns the legs in flight on each of the first n DP ranks (nil for n <= 1).
func (w *Worker) RankInFlight(n int) []int64 {
	if n <= 1 {
		return nil
	}
	out := make([]int64, min(n, MaxTrackedRanks))
	for i := range out {
		out[i] = w.rankLoad[i].Load()
	}
	return out
}

// EngineLoad is a worker's load as its engine reports it.
type EngineLoad struct {
	Running, Waiting float64   // requests running, and waiting in the engine's queue
	KVUsage          float64   // KV cache in use, 0..1
	At               time.Time // when it was read
	Until            time.Time // trusted until then: an older signal is ignored
	// Has* report whether the engine exports that signal at all.
	HasRunning, HasWaiting, HasKV bool
	// LoRARunning and LoRAWaiting are the adapters with requests running and waiting, MaxLoRA
	// the engine's adapter slots (vLLM's lora_requests_info); HasLoRA whether it exports them.
	LoRARunning, LoRAWaiting []string
	MaxLoRA                  int
	HasLoRA                  bool
}

// Lists reports whether w's engine lists model (a base model or a loaded adapter).
func (w *Worker) Lists(model string) bool {
	if in := w.Info(); in != nil {
		for _, m := range in.Models {
			if m.ID == model {
				return true
			}
		}
	}
	return false
}

// Adapters returns the LoRA adapters w's engine lists as loaded.
func (w *Worker) Adapters() []string {
	var out []string
	if in := w.Info(); in != nil {
		for _, m := range in.Models {
			if m.Parent != "" {
				out = append(out, m.ID)
			}
		}
	}
	return out
}

// Fresh reports whether l may still be trusted at now.
func (l EngineLoad) Fresh(now time.Time) bool { return !l.At.IsZero() && now.Before(l.Until) }

// How a worker's answers are proven their requests', the strongest seen since it registered.
const (
	correlatedNone     uint32 = iota
	correlatedByID            // its answers' id is named after the X-Request-Id Baton sent
	correlatedByHeader        // its answers echo that X-Request-Id
)

// noteCorrelation raises the worker's correlation to c (lowered only by ForgetCorrelation).
func (w *Worker) noteCorrelation(c uint32) {
	for old := w.correlation.Load(); old < c && !w.correlation.CompareAndSwap(old, c); old = w.correlation.Load() {
	}
}

// ForgetCorrelation sees the worker's engine anew: its answers are not proven until it names one
// after its request again (an engine restarted with other settings behind the same URL).
func (w *Worker) ForgetCorrelation() { w.correlation.Store(correlatedNone) }

// NoteEcho records that the worker's engine answered with the X-Request-Id Baton sent it
// (vLLM's --enable-request-id-headers): from then on an answer naming another id is one out of
// step on its connection.
func (w *Worker) NoteEcho() { w.noteCorrelation(correlatedByHeader) }

// Echoes reports whether the worker's engine was seen echoing Baton's X-Request-Id: its answers
// are proven to be their requests' before a byte is relayed.
func (w *Worker) Echoes() bool { return w.Proof().ByHeader() }

// Proof is how a worker's answers were proven when a request was sent to it: its answer is
// judged by that, not by what the worker's proof became while the answer was on its way (a
// circuit that opened meanwhile forgets it, and the answers already under way on connections
// that may be out of step would pass unjudged).
type Proof uint32

// Proof returns how the worker's answers are proven now, to judge the answer of a request about
// to be sent by.
func (w *Worker) Proof() Proof { return Proof(w.correlation.Load()) }

// ByHeader: the answer must echo the X-Request-Id sent.
func (p Proof) ByHeader() bool { return uint32(p) == correlatedByHeader }

// ByID: the answer (a 200 of a route whose answers carry an id) must begin with an id named
// after the X-Request-Id sent.
func (p Proof) ByID() bool { return uint32(p) >= correlatedByID }

// NoteIDEcho records that the worker's engine named an answer after the X-Request-Id Baton sent
// (vLLM's chatcmpl-<id> and cmpl-<id>, with or without --enable-request-id-headers).
func (w *Worker) NoteIDEcho() { w.noteCorrelation(correlatedByID) }

// IDEchoes reports whether the worker's engine was seen naming its answers after Baton's
// X-Request-Id: an answer named after another request is one out of step.
func (w *Worker) IDEchoes() bool { return w.Proof().ByID() }

// Correlation names how the worker's answers are proven, as GET /workers shows it:
// "x-request-id", "answer-id" or "none".
func (w *Worker) Correlation() string {
	switch w.correlation.Load() {
	case correlatedByHeader:
		return "x-request-id"
	case correlatedByID:
		return "answer-id"
	}
	return "none"
}

// SetEngineLoad records what the engine last reported of its load.
func (w *Worker) SetEngineLoad(l EngineLoad) { w.engineLoad.Store(&l) }

// EngineLoad returns what the engine last reported of its load (the zero value before any).
func (w *Worker) EngineLoad() EngineLoad {
	if p := w.engineLoad.Load(); p != nil {
		return *p
	}
	return EngineLoad{}
}

// SetEngineIDs records the KV engine id of each DP rank, as the engine's bootstrap server
// reports them (Mooncake's /query); nil forgets them.
func (w *Worker) SetEngineIDs(ids map[int]string) { w.engineIDs.Store(&ids) }

// EngineIDs returns the engine ids SetEngineIDs recorded, by DP rank, or nil.
func (w *Worker) EngineIDs() map[int]string {
	if p := w.engineIDs.Load(); p != nil {
		return *p
	}
	return nil
}
