// Package lora routes requests for LoRA adapters where the adapter is loaded, and loads declared
// adapters on demand: once for every request waiting on it (single flight), within a deadline,
// making room by unloading the least recently used adapter when asked to. What an engine has
// loaded is what its /v1/models lists (vLLM and SGLang both list an adapter with its base model
// as "parent"); what it runs and has waiting, vLLM's lora_requests_info.
package lora

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/worker"
)

// failHold is how long a failed load of an adapter on a worker answers the requests for it at
// once, instead of loading again: a load that fails is not retried in a loop.
const failHold = 30 * time.Second

// Settings are what a reload may change.
type Settings struct {
	Adapters  []config.Adapter
	UnloadLRU bool
	Affinity  bool
	Timeout   time.Duration
}

// Manager knows the declared adapters, loads them, and orders workers by adapter affinity.
type Manager struct {
	Registry *worker.Registry
	Client   *http.Client
	Log      *slog.Logger
	// Observe, when set, sees every load and unload Baton makes: op load or unload, result ok
	// or failed, and how long it took.
	Observe func(op, result string, d time.Duration)
	// Refresh, when set, reads w's engine load again (its adapter slots): called before making
	// room on a worker whose last reading is no longer fresh.
	Refresh func(ctx context.Context, w *worker.Worker)

	settings atomic.Pointer[settings]
	group    singleflight.Group

	mu     sync.Mutex
	use    map[string]*usage  // by worker URL and adapter: in flight and last use
	failed map[string]failure // by worker URL and adapter: a load that failed lately
	// loading is, with adapter affinity, the load of each adapter in progress: requests that
	// chose another worker wait for it and choose again, so a cold adapter is loaded once.
	loading map[string]*flight
	// busy serialises the loads and unloads of each worker (by URL): two loads of different
	// adapters must not both count the same free slot.
	busy map[string]*sync.Mutex
	// evicting is the adapters (by worker URL and adapter) chosen to be unloaded: a request for
	// one waits for the unload and loads it again rather than reach the engine as it goes.
	evicting map[string]bool
	// pending is the loads queued or under way on each worker (by URL).
	pending map[string]int
	now     func() time.Time // the clock; time.Now
}

// key names an adapter on a worker in the manager's maps.
func key(w *worker.Worker, adapter string) string { return w.URL + "\x00" + adapter }

type usage struct {
	inflight int
	last     time.Time
}

type flight struct {
	worker string
	done   chan struct{}
	err    error
}

// ErrReselect is a request that chose a worker while the adapter it names was being loaded on
// another: it is loaded there now, and the request chooses again.
var ErrReselect = errors.New("the adapter was loaded on another worker meanwhile")

type failure struct {
	err error
	at  time.Time
}

// settings are the Settings with the declared adapters by name.
type settings struct {
	Settings
	byName map[string]config.Adapter
}

// New returns a manager of s's adapters.
func New(reg *worker.Registry, client *http.Client, log *slog.Logger, s Settings) *Manager {
	m := &Manager{Registry: reg, Client: client, Log: log, use: map[string]*usage{}, failed: map[string]failure{},
		loading: map[string]*flight{}, busy: map[string]*sync.Mutex{}, evicting: map[string]bool{}, pending: map[string]int{}, now: time.Now}
	m.Set(s)
	return m
}

// Set makes s the settings from now on (at a reload).
func (m *Manager) Set(s Settings) {
	byName := make(map[string]config.Adapter, len(s.Adapters))
	for _, a := range s.Adapters {
		byName[a.Name] = a
	}
	m.settings.Store(&settings{Settings: s, byName: byName})
}

// Settings are the settings now.
func (m *Manager) Settings() Settings { return m.settings.Load().Settings }

// Declared reports whether the configuration declares any adapter Baton may load.
func (m *Manager) Declared() bool { return len(m.settings.Load().byName) > 0 }

// Loadable returns the declared adapter named model.
func (m *Manager) Loadable(model string) (config.Adapter, bool) {
	a, ok := m.settings.Load().byName[model]
	return a, ok
}

// Base is the base model of model when model is an adapter, declared or listed by an engine;
// "" otherwise.
func (m *Manager) Base(snap *worker.Snapshot, model string) string {
	if a, ok := m.Loadable(model); ok {
		return a.Base
	}
	return snap.Parent(model)
}

// Tier is how well a worker suits a request for an adapter: higher is better.
type Tier int

// The tiers, best last.
const (
	TierBusy    Tier = iota // no free adapter slot, and every adapter loaded has requests in flight: a load waits
	TierFull                // no free adapter slot: a load would unload an idle adapter
	TierFree                // a free adapter slot (or none known to be taken), or the adapter loaded on an engine that queues requests
	TierLoaded              // the adapter is loaded, and the engine queues no request
	TierRunning             // the adapter has requests running, and the engine queues none
)

func (t Tier) String() string {
	return [...]string{"busy", "full", "free_slot", "loaded", "running"}[t]
}

// TierOf is how well w suits a request for adapter now; an adapter being loaded on w counts
// as loaded.
func (m *Manager) TierOf(w *worker.Worker, adapter string, now time.Time) Tier {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.tierOf(w, adapter, now)
}

// tierOf is TierOf with m.mu held.
func (m *Manager) tierOf(w *worker.Worker, adapter string, now time.Time) Tier {
	l := w.EngineLoad()
	fresh := l.Fresh(now)
	if w.Lists(adapter) {
		switch {
		case fresh && l.HasWaiting && l.Waiting > 0:
			// Loaded, but the engine queues requests: no better than a free slot elsewhere, so
			// that a hot adapter is loaded on a second worker rather than queue on one.
			return TierFree
		case fresh && l.HasLoRA && slices.Contains(l.LoRARunning, adapter):
			return TierRunning
		}
		return TierLoaded
	}
	if f := m.loading[adapter]; f != nil && f.worker == w.URL {
		return TierLoaded
	}
	if c := loadedCap(w); c > 0 && len(w.Adapters()) >= c {
		if m.idle(w, l, fresh) {
			return TierFull
		}
		return TierBusy
	}
	if fresh && l.HasLoRA && l.MaxLoRA > 0 && len(l.LoRARunning) >= l.MaxLoRA {
		// vLLM's max_lora is the adapters one batch runs: with as many others running, this
		// one's requests would wait in the engine.
		return TierFull
	}
	return TierFree
}

// loadedCap is the most adapters w's engine holds loaded: SGLang's --max-loaded-loras (from its
// /server_info), past which it refuses a load; 0 for none known. vLLM has no such bound — it
// never refuses a load for room (its max_lora is the adapters one batch runs) — so Baton never
// unloads an adapter from vLLM to make room.
func loadedCap(w *worker.Worker) int {
	if in := w.Info(); in != nil {
		return in.MaxLoadedLoRAs
	}
	return 0
}

// idle reports, with m.mu held, whether some adapter loaded on w has no request in flight
// (Baton's, or the engine's while its report is fresh): one that could be unloaded now.
func (m *Manager) idle(w *worker.Worker, l worker.EngineLoad, fresh bool) bool {
	for _, name := range w.Adapters() {
		if u := m.use[key(w, name)]; u != nil && u.inflight > 0 {
			continue
		}
		if fresh && (slices.Contains(l.LoRARunning, name) || slices.Contains(l.LoRAWaiting, name)) {
			continue
		}
		return true
	}
	return false
}

// Best returns the workers of ws in the best tier for adapter, and that tier; when the best is
// a load (a free slot, or a full one), those with the fewest loads queued or under way, so that
// cold adapters are not loaded one after another on one worker. It allocates only when some
// are left out.
func (m *Manager) Best(ws []*worker.Worker, adapter string, now time.Time) ([]*worker.Worker, Tier) {
	m.mu.Lock()
	defer m.mu.Unlock()
	// rank orders a worker within a tier by the loads under way on it (only when it would load).
	rank := func(w *worker.Worker, t Tier) int {
		if t > TierFree {
			return 0
		}
		return m.pending[w.URL]
	}
	best, fewest := TierBusy, 0
	tiers := make([]Tier, len(ws))
	for i, w := range ws {
		tiers[i] = m.tierOf(w, adapter, now)
		switch r := rank(w, tiers[i]); {
		case i == 0 || tiers[i] > best:
			best, fewest = tiers[i], r
		case tiers[i] == best:
			fewest = min(fewest, r)
		}
	}
	keep := func(i int) bool { return tiers[i] == best && rank(ws[i], best) == fewest }
	for i := range ws {
		if !keep(i) {
			var out []*worker.Worker
			for j, w := range ws {
				if keep(j) {
					out = append(out, w)
				}
			}
			return out, best
		}
	}
	return ws, best
}

// Error is a load that failed: the adapter, the worker, and why.
type Error struct {
	Adapter, Worker string
	Err             error
}

func (e *Error) Error() string {
	return fmt.Sprintf("LoRA adapter %q could not be loaded on worker %s: %v", e.Adapter, e.Worker, e.Err)
}

func (e *Error) Unwrap() error { return e.Err }

// Ensure makes sure w has model loaded before a request for it is sent there: nothing when
// model is no declared adapter or w lists it already; otherwise one load for every request
// waiting on it (the first caller's leaving does not cancel it), within the load timeout, after
// unloading the least recently used adapter when w's slots are full and unload_lru is on. The
// load counts once w's engine lists the adapter. A failure is an *Error, and is answered at
// once for failHold rather than loaded again. With adapter affinity, a request that chose w
// while the adapter was being loaded on another worker waits for that load and gets
// ErrReselect: the adapter is loaded once, not on every worker a burst of requests chose.
func (m *Manager) Ensure(ctx context.Context, w *worker.Worker, model string) error {
	a, ok := m.Loadable(model)
	if !ok {
		return nil
	}
	key := key(w, model)
	affinity := m.settings.Load().Affinity
	m.mu.Lock()
	if w.Lists(model) && !m.evicting[key] {
		m.mu.Unlock()
		return nil
	}
	if f, ok := m.failed[key]; ok && m.now().Sub(f.at) < failHold {
		m.mu.Unlock()
		return f.err
	}
	var other *flight
	if affinity {
		if f := m.loading[model]; f != nil && f.worker != w.URL {
			other = f
		} else if f == nil {
			m.loading[model] = &flight{worker: w.URL, done: make(chan struct{})}
		}
	}
	m.mu.Unlock()
	if other != nil {
		select {
		case <-other.done:
		case <-ctx.Done():
			return ctx.Err()
		}
		if other.err != nil {
			return other.err
		}
		return ErrReselect
	}
	ch := m.group.DoChan(key, func() (any, error) {
		err := m.loadOnce(ctx, w, a, key)
		m.mu.Lock()
		if f := m.loading[model]; f != nil && f.worker == w.URL {
			f.err = err
			close(f.done)
			delete(m.loading, model)
		}
		m.mu.Unlock()
		return nil, err
	})
	// While the load waits its turn (another load or unload of w under way), the adapter may
	// appear on w — another replica loaded it, and a poll or a load read w's models: then the
	// request goes at once. A load making room waits for an idle adapter, and the requests
	// counted in flight on an adapter it could unload may be among those waiting here.
	tick := time.NewTicker(listedCheck)
	defer tick.Stop()
	for {
		select {
		case r := <-ch:
			return r.Err
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
			m.mu.Lock()
			ready := w.Lists(model) && !m.evicting[key]
			m.mu.Unlock()
			if ready {
				return nil
			}
		}
	}
}

// listedCheck is how often a request waiting on a load looks whether its adapter is on the
// worker already.
const listedCheck = 10 * time.Millisecond

// loadOnce loads a on w (unless a request before this one just did), detached from the request
// that asked, and records the outcome.
func (m *Manager) loadOnce(ctx context.Context, w *worker.Worker, a config.Adapter, key string) error {
	s := m.Settings()
	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.Timeout)
	defer cancel()
	start := m.now()
	m.mu.Lock()
	m.pending[w.URL]++
	m.mu.Unlock()
	err := m.load(lctx, w, a, s)
	m.mu.Lock()
	if m.pending[w.URL]--; m.pending[w.URL] <= 0 {
		delete(m.pending, w.URL)
	}
	m.mu.Unlock()
	result := "ok"
	if err != nil {
		result = "failed"
		var c contended
		race := errors.As(err, &c)
		err = &Error{Adapter: a.Name, Worker: w.ID, Err: err}
		if !race {
			m.mu.Lock()
			m.failed[key] = failure{err: err, at: m.now()}
			m.mu.Unlock()
		}
		m.Log.Warn("adapter not loaded", "adapter", a.Name, "worker", w.URL, "err", err)
	} else {
		m.mu.Lock()
		delete(m.failed, key)
		m.mu.Unlock()
		m.Log.Info("adapter loaded", "adapter", a.Name, "worker", w.URL, "took", m.now().Sub(start).Round(time.Millisecond))
	}
	if m.Observe != nil {
		m.Observe("load", result, m.now().Sub(start))
	}
	return err
}

// Relearn reads w's model list again (its adapters), after an answer says it changed behind
// Baton's back.
// Reads of one worker at once are one read: a burst of refusals (many requests meeting the
// same unload, or a client whose requests the engine keeps refusing) asks the engine once.
func (m *Manager) Relearn(ctx context.Context, w *worker.Worker) error {
	ch := m.group.DoChan("models "+w.URL, func() (any, error) {
		_, err := m.Registry.RefreshModels(context.WithoutCancel(ctx), m.Client, w)
		return nil, err
	})
	select {
	case r := <-ch:
		return r.Err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// ForgetFailures forgets the loads that failed lately: the next request for their adapters
// loads them again (an operator fixed what failed).
func (m *Manager) ForgetFailures() {
	m.mu.Lock()
	clear(m.failed)
	m.mu.Unlock()
}

// load makes room on w when asked to, loads a, and checks that w's engine lists it. One load or
// unload at a time per worker; when every slot holds an adapter with requests in flight, it
// waits (within ctx) for one to have none.
func (m *Manager) load(ctx context.Context, w *worker.Worker, a config.Adapter, s Settings) error {
	if !w.Lists(a.Base) {
		return fmt.Errorf("the worker does not serve its base model %q", a.Base)
	}
	m.mu.Lock()
	busy := m.busy[w.URL]
	if busy == nil {
		busy = &sync.Mutex{}
		m.busy[w.URL] = busy
	}
	m.mu.Unlock()
	busy.Lock()
	defer busy.Unlock()
	for try := 0; ; try++ {
		var c contended
		err := m.loadStep(ctx, w, a, s)
		if !errors.As(err, &c) {
			return err
		}
		// Another replica got there between this one's steps: after a short, jittered pause
		// (replicas that collided once should not collide again in step), try again — until the
		// load timeout (ctx) ends it.
		pause := min(raceBackoff<<min(try, 16), maxRacePause)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(pause/2 + rand.N(pause/2+1)):
		}
	}
}

// raceBackoff is the first pause between two tries of a load another replica's change to the
// engine defeated (filled again, the adapter unloaded just after it loaded); the pauses double
// up to maxRacePause, and the load timeout ends the tries.
const (
	raceBackoff  = 2 * time.Millisecond
	maxRacePause = 250 * time.Millisecond
)

// loadStep is one try of load, under w's load lock: room made when asked, the load sent, and the
// engine's model list read to see the adapter there. A race with another replica lost is a
// contended error, for load to try again.
func (m *Manager) loadStep(ctx context.Context, w *worker.Worker, a config.Adapter, s Settings) error {
	if w.Lists(a.Name) {
		return nil
	}
	if s.UnloadLRU && m.Refresh != nil && !w.EngineLoad().Fresh(m.now()) {
		m.Refresh(ctx, w)
	}
	for s.UnloadLRU {
		c := loadedCap(w)
		if c == 0 || len(w.Adapters()) < c {
			break
		}
		if err := m.makeRoom(ctx, w, a, c); err != nil {
			return err
		}
	}
	err := m.post(ctx, w, "load_lora_adapter", map[string]string{"lora_name": a.Name, "lora_path": a.Path})
	if errors.Is(err, errNoRoom) && s.UnloadLRU {
		// The engine is full although Baton's count said otherwise (another replica loaded one):
		// its models read again, the least recently used idle adapter goes, and the next try
		// loads. SGLang checks room before the name: the other replica may have loaded this one.
		if _, rerr := m.Registry.RefreshModels(ctx, m.Client, w); rerr != nil {
			return fmt.Errorf("the engine refused the load for room, and its model list could not be read: %w", rerr)
		}
		if w.Lists(a.Name) {
			return nil
		}
		if rerr := m.makeRoom(ctx, w, a, len(w.Adapters())); rerr != nil {
			return rerr
		}
		return contended{err}
	}
	if err != nil && !errors.Is(err, errAlreadyLoaded) {
		return err
	}
	// Loaded, or loaded by another replica since this one last read the engine's models: its
	// model list says which, and either way the adapter is there.
	if _, err := m.Registry.RefreshModels(ctx, m.Client, w); err != nil {
		return fmt.Errorf("the engine answered the load, but its model list could not be read: %w", err)
	}
	if !w.Lists(a.Name) {
		return contended{errors.New("the engine answered the load, but does not list the adapter")}
	}
	return nil
}

// makeRoom unloads the least recently used idle adapter of w (c its capacity, for the message),
// waiting within ctx while every one has requests in flight.
func (m *Manager) makeRoom(ctx context.Context, w *worker.Worker, a config.Adapter, c int) error {
	for {
		victim := m.lru(w, w.EngineLoad())
		if victim == "" {
			select {
			case <-ctx.Done():
				return fmt.Errorf("all %d adapters loaded had requests in flight until the load timeout", c)
			case <-time.After(10 * time.Millisecond):
				continue
			}
		}
		start := m.now()
		err := m.post(ctx, w, "unload_lora_adapter", map[string]string{"lora_name": victim})
		if errors.Is(err, errGone) {
			err = nil // another replica unloaded it first: the room is there
		}
		if m.Observe != nil {
			m.Observe("unload", map[bool]string{true: "ok", false: "failed"}[err == nil], m.now().Sub(start))
		}
		if err != nil {
			m.forget(w, victim)
			return fmt.Errorf("unloading %q to make room: %w", victim, err)
		}
		m.Log.Info("adapter unloaded to make room", "adapter", victim, "worker", w.URL, "for", a.Name)
		_, rerr := m.Registry.RefreshModels(ctx, m.Client, w)
		m.forget(w, victim) // after the refresh: w no longer lists it
		if rerr != nil {
			return fmt.Errorf("after unloading %q, the model list could not be read: %w", victim, rerr)
		}
		return nil
	}
}

// lru is the adapter loaded on w to unload first: none with requests in flight (Baton's, or
// the engine's while its report is fresh), the one used least recently (never used first); ""
// when every one is in use.
func (m *Manager) lru(w *worker.Worker, l worker.EngineLoad) string {
	var running, waiting []string
	if l.Fresh(m.now()) {
		running, waiting = l.LoRARunning, l.LoRAWaiting
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var victim string
	var oldest time.Time
	for _, name := range w.Adapters() {
		u := m.use[key(w, name)]
		if u == nil {
			// An adapter this replica never sent a request for: another replica's, or loaded
			// outside Baton. Its use is unknown here, so it counts as used when first seen —
			// never as the oldest: replicas would otherwise unload each other's adapters first.
			u = &usage{last: m.now()}
			m.use[key(w, name)] = u
		}
		if u.inflight > 0 || slices.Contains(running, name) || slices.Contains(waiting, name) {
			continue
		}
		last := u.last
		if victim == "" || last.Before(oldest) {
			victim, oldest = name, last
		}
	}
	if victim != "" {
		m.evicting[key(w, victim)] = true // Begin and Ensure see it under the same lock
	}
	return victim
}

// forget ends the eviction of adapter from w: unloaded, or not (err).
func (m *Manager) forget(w *worker.Worker, adapter string) {
	m.mu.Lock()
	delete(m.use, key(w, adapter))
	delete(m.evicting, key(w, adapter))
	m.mu.Unlock()
}

// Begin counts a request for the adapter on w in flight until the returned func is called;
// the least recently used adapter is the one whose last request began longest ago.
func (m *Manager) Begin(w *worker.Worker, adapter string) (end func()) {
	key := key(w, adapter)
	m.mu.Lock()
	u := m.use[key]
	if u == nil {
		u = &usage{}
		m.use[key] = u
	}
	u.inflight++
	u.last = m.now()
	m.mu.Unlock()
	return func() {
		m.mu.Lock()
		u.inflight--
		m.mu.Unlock()
	}
}

// Replicas share engines: what another Baton did since this one last read an engine's models is
// state, not failure. vLLM answers a load of an adapter it has 400 "The lora adapter 'X' has
// already been loaded." and an unload of one it has not 404 "The lora adapter 'X' cannot be
// found." (vllm/entrypoints/openai/serving_models.py, the load and unload checks); SGLang 400
// "Failed to load LoRA adapter X because it is already loaded"
// (python/sglang/srt/lora/lora_manager.py, validate_new_adapter) and 400 "LoRA with name X does
// not exist. …" (python/sglang/srt/lora/lora_registry.py, unregister).
var (
	errAlreadyLoaded = errors.New("the engine has the adapter loaded already")
	errGone          = errors.New("the engine has no such adapter loaded")
	// errNoRoom is SGLang refusing a load past --max-loaded-loras: "Cannot load LoRA adapter X
	// at path P. Maximum number of loaded LoRA adapters is N. Please unload some LoRA adapters
	// before loading new ones." (python/sglang/srt/managers/tokenizer_manager.py,
	// load_lora_adapter; test/srt/lora/test_lora_update.py expects it).
	errNoRoom = errors.New("the engine holds as many adapters as it may")
)

// contended is a failed load another replica's change to the engine explains (it filled the
// engine again, or unloaded the adapter, between this replica's steps): the request that met it
// fails, but the failure is not held for failHold — one race would otherwise answer 30 s of
// requests with it.
type contended struct{ error }

func (c contended) Unwrap() error { return c.error }

// maxAnswer bounds what Baton reads of an engine's answer to a load or unload.
const maxAnswer = 64 << 10

// post sends an adapter endpoint request: vLLM's under /v1, SGLang's at the root. A refusal is
// an error carrying the engine's message (bounded).
func (m *Manager) post(ctx context.Context, w *worker.Worker, op string, body map[string]string) error {
	path := "/v1/" + op
	if w.Runtime() == config.RuntimeSGLang {
		path = "/" + op
	}
	b, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.URL+path, bytes.NewReader(b))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if w.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+w.APIKey)
	}
	resp, err := m.Client.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("POST %s: no answer within the adapter load timeout", path)
		}
		return fmt.Errorf("POST %s: %w", path, err)
	}
	defer resp.Body.Close()
	answer, _ := io.ReadAll(io.LimitReader(resp.Body, maxAnswer))
	var sg struct {
		Success *bool  `json:"success"`
		Message string `json:"error_message"`
	}
	_ = json.Unmarshal(answer, &sg)
	if resp.StatusCode == http.StatusOK && (sg.Success == nil || *sg.Success) {
		return nil
	}
	switch {
	case op == "load_lora_adapter" && resp.StatusCode == http.StatusBadRequest &&
		(bytes.Contains(answer, []byte("has already been loaded")) || bytes.Contains(answer, []byte("because it is already loaded"))):
		return errAlreadyLoaded
	case op == "unload_lora_adapter" && resp.StatusCode == http.StatusNotFound && bytes.Contains(answer, []byte("cannot be found")),
		op == "unload_lora_adapter" && resp.StatusCode == http.StatusBadRequest && sg.Success != nil && bytes.Contains(answer, []byte("does not exist")):
		return errGone
	case op == "load_lora_adapter" && bytes.Contains(answer, []byte("Maximum number of loaded LoRA adapters")):
		return fmt.Errorf("%w: %s", errNoRoom, cmp.Or(sg.Message, openai.EngineMessage(answer)))
	}
	if resp.StatusCode == http.StatusNotFound && sg.Success == nil && !bytes.Contains(answer, []byte("adapter")) {
		return fmt.Errorf("POST %s answered 404: the engine serves no adapter endpoint (vLLM needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", path)
	}
	return fmt.Errorf("POST %s answered %d: %s", path, resp.StatusCode, cmp.Or(sg.Message, openai.EngineMessage(answer)))
}
