package lora

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// node is a registered vLLM worker serving base with adapters loaded and the engine load l.
func node(url string, l worker.EngineLoad, adapters ...string) *worker.Worker {
	return nodeOf(config.RuntimeVLLM, 0, url, l, adapters...)
}

// nodeOf is node of runtime, holding at most maxLoaded adapters (SGLang's --max-loaded-loras).
func nodeOf(runtime string, maxLoaded int, url string, l worker.EngineLoad, adapters ...string) *worker.Worker {
	w := worker.New(config.Worker{URL: url})
	in := &worker.Info{Runtime: runtime, Models: []worker.Model{{ID: "base"}}, MaxLoadedLoRAs: maxLoaded}
	for _, a := range adapters {
		in.Models = append(in.Models, worker.Model{ID: a, Parent: "base"})
	}
	w.SetInfo(in)
	w.SetEngineLoad(l)
	return w
}

// The tiers, best first: the adapter running on an engine that queues nothing, loaded, a free
// slot (or loaded where the engine queues), full — SGLang holding --max-loaded-loras with an
// idle adapter to unload, or vLLM's batch running max_lora other adapters — and SGLang full with
// every adapter in flight. Among load tiers, the workers with the fewest loads under way.
func TestTiers(t *testing.T) {
	now := time.Now()
	fresh := func(l worker.EngineLoad) worker.EngineLoad {
		l.At, l.Until, l.HasLoRA, l.HasWaiting, l.MaxLoRA = now, now.Add(time.Minute), true, true, 2
		return l
	}
	running := node("http://running", fresh(worker.EngineLoad{LoRARunning: []string{"x"}}), "x")
	loaded := node("http://loaded", fresh(worker.EngineLoad{}), "x")
	queueing := node("http://queueing", fresh(worker.EngineLoad{LoRARunning: []string{"x"}, Waiting: 3}), "x")
	free := node("http://free", fresh(worker.EngineLoad{}), "y")
	full := nodeOf(config.RuntimeSGLang, 2, "http://full", fresh(worker.EngineLoad{}), "y", "z")
	busy := nodeOf(config.RuntimeSGLang, 2, "http://busy", fresh(worker.EngineLoad{LoRARunning: []string{"y", "z"}}), "y", "z")
	// vLLM holding more adapters than max_lora is no full worker (it never refuses a load);
	// one whose batch runs max_lora others is.
	manyIdle := node("http://many-idle", fresh(worker.EngineLoad{}), "y", "z", "w")
	batchFull := node("http://batch-full", fresh(worker.EngineLoad{LoRARunning: []string{"y", "z"}}), "y", "z")
	m := New(worker.NewRegistry(running, loaded, queueing, free, full, busy, manyIdle, batchFull), http.DefaultClient, slog.New(slog.NewTextHandler(io.Discard, nil)),
		Settings{Adapters: []config.Adapter{{Name: "x", Path: "/x", Base: "base"}}, Affinity: true, Timeout: time.Second})
	for w, want := range map[*worker.Worker]Tier{running: TierRunning, loaded: TierLoaded, queueing: TierFree, free: TierFree, full: TierFull, busy: TierBusy,
		manyIdle: TierFree, batchFull: TierFull} {
		if got := m.TierOf(w, "x", now); got != want {
			t.Errorf("%s: %s, want %s", w.URL, got, want)
		}
	}
	order := []*worker.Worker{busy, full, free, queueing, loaded, running}
	for i := range order {
		got, tier := m.Best(order[:i+1], "x", now)
		if len(got) == 0 || got[len(got)-1] != order[i] || tier != m.TierOf(order[i], "x", now) {
			t.Errorf("best of %d: %v (%s)", i+1, got, tier)
		}
	}
	// A Baton request in flight makes an idle adapter busy; it ends, and the adapter is idle.
	end := m.Begin(full, "y")
	m.Set(Settings{Adapters: []config.Adapter{{Name: "x", Path: "/x", Base: "base"}, {Name: "y", Path: "/y", Base: "base"}}, Affinity: true, Timeout: time.Second})
	end()
	end = m.Begin(full, "y")
	end2 := m.Begin(full, "z")
	if got := m.TierOf(full, "x", now); got != TierBusy {
		t.Errorf("every adapter in flight: %s", got)
	}
	end()
	end2()
	if got := m.TierOf(full, "x", now); got != TierFull {
		t.Errorf("none in flight: %s", got)
	}
	// A load under way on free puts it behind another free worker.
	free2 := node("http://free2", fresh(worker.EngineLoad{}), "y")
	m.mu.Lock()
	m.pending[free.URL] = 1
	m.mu.Unlock()
	if got, _ := m.Best([]*worker.Worker{free, free2}, "x", now); len(got) != 1 || got[0] != free2 {
		t.Errorf("a load under way: %v", got)
	}
}

// Making room on SGLang (--max-loaded-loras, read from its /server_info) unloads the least
// recently used adapter that has no request in flight: an older one still in flight stays.
func TestUnloadSkipsAdaptersInFlight(t *testing.T) {
	e, err := sim.Start(sim.Config{Engine: sim.EngineSGLang, Model: "base", RuntimeLoRA: true, MaxLoRAs: 2, LoRAAdapters: []string{"a1", "a2"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	w := worker.New(config.Worker{URL: e.URL()})
	in, err := worker.Detect(context.Background(), http.DefaultClient, w)
	if err != nil {
		t.Fatal(err)
	}
	w.SetInfo(in)
	if in.MaxLoadedLoRAs != 2 {
		t.Fatalf("max_loaded_loras read from /server_info: %d", in.MaxLoadedLoRAs)
	}
	var declared []config.Adapter
	for _, n := range []string{"a1", "a2", "a3"} {
		declared = append(declared, config.Adapter{Name: n, Path: "/adapters/" + n, Base: "base"})
	}
	m := New(worker.NewRegistry(w), http.DefaultClient, slog.New(slog.NewTextHandler(io.Discard, nil)),
		Settings{Adapters: declared, UnloadLRU: true, Affinity: true, Timeout: 5 * time.Second})
	inFlight := m.Begin(w, "a2") // the older use, still in flight
	defer inFlight()
	time.Sleep(time.Millisecond)
	m.Begin(w, "a1")() // a newer use, ended
	if err := m.Ensure(context.Background(), w, "a3"); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(e.LoadedAdapters(), ","); got != "a2,a3" {
		t.Fatalf("loaded %s, want a2,a3: a1 (idle) unloaded, a2 (in flight) kept", got)
	}
}

// Another replica's load or unload is state, not failure: a load the engine answers "has already
// been loaded" is a loaded adapter (the model list read again), and an unload of an adapter
// already gone makes the room it was for.
func TestReplicaRacesAreState(t *testing.T) {
	for _, c := range []struct {
		engine, runtime, prefix string
		max                     int
	}{
		{sim.EngineVLLM, config.RuntimeVLLM, "/v1/", 0},
		{sim.EngineSGLang, config.RuntimeSGLang, "/", 0},
		// Full: SGLang checks room before the name, and refuses for room a load of an adapter
		// another replica just loaded; that is the adapter there, not a reason to unload one.
		{sim.EngineSGLang, config.RuntimeSGLang, "/", 1},
	} {
		t.Run(fmt.Sprintf("%s-max%d", c.engine, c.max), func(t *testing.T) {
			e, err := sim.Start(sim.Config{Engine: c.engine, Model: "base", RuntimeLoRA: true, MaxLoRAs: c.max})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			w := worker.New(config.Worker{URL: e.URL()})
			w.SetInfo(&worker.Info{Runtime: c.runtime, Models: []worker.Model{{ID: "base"}}, MaxLoadedLoRAs: c.max})
			m := New(worker.NewRegistry(w), http.DefaultClient, slog.New(slog.NewTextHandler(io.Discard, nil)),
				Settings{Adapters: []config.Adapter{{Name: "x", Path: "/x", Base: "base"}}, UnloadLRU: true, Timeout: 5 * time.Second})
			// Another replica loads x behind this one's back; this one's model list does not show it.
			resp, err := http.Post(e.URL()+c.prefix+"load_lora_adapter", "application/json", strings.NewReader(`{"lora_name":"x","lora_path":"/x"}`))
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("the other replica's load: %v %v", resp, err)
			}
			resp.Body.Close()
			if w.Lists("x") {
				t.Fatal("the test needs a stale model list")
			}
			if err := m.Ensure(context.Background(), w, "x"); err != nil {
				t.Fatalf("a load another replica made: %v", err)
			}
			if !w.Lists("x") {
				t.Error("the model list was not read again")
			}
			if l, u := e.LoRAStats(); l != 1 || u != 0 {
				t.Errorf("the engine saw %d loads and %d unloads, want 1 and 0", l, u)
			}
			// An unload of an adapter another replica already unloaded is the room it was for.
			if err := m.post(context.Background(), w, "unload_lora_adapter", map[string]string{"lora_name": "gone"}); !errors.Is(err, errGone) {
				t.Errorf("an unload of an adapter not loaded: %v", err)
			}
		})
	}
}

// vLLM never refuses a load for room: with unload_lru on, a load past its max_lora unloads
// nothing. SGLang refusing one (another replica filled it behind Baton's count) has the least
// recently used idle adapter unloaded and the load tried once more.
func TestCapacityAsEachEngineMeansIt(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	declared := func(names ...string) (out []config.Adapter) {
		for _, n := range names {
			out = append(out, config.Adapter{Name: n, Path: "/adapters/" + n, Base: "base"})
		}
		return out
	}
	v, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Model: "base", RuntimeLoRA: true, MaxLoRAs: 1, LoRAAdapters: []string{"a1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	w := worker.New(config.Worker{URL: v.URL()})
	in, err := worker.Detect(context.Background(), http.DefaultClient, w)
	if err != nil {
		t.Fatal(err)
	}
	w.SetInfo(in)
	now := time.Now()
	w.SetEngineLoad(worker.EngineLoad{HasLoRA: true, MaxLoRA: 1, At: now, Until: now.Add(time.Minute)})
	m := New(worker.NewRegistry(w), http.DefaultClient, quiet, Settings{Adapters: declared("a1", "a2"), UnloadLRU: true, Timeout: 5 * time.Second})
	if err := m.Ensure(context.Background(), w, "a2"); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(v.LoadedAdapters(), ","); got != "a1,a2" {
		t.Errorf("vLLM: loaded %s, want a1,a2 (nothing unloaded for a batch bound)", got)
	}

	s, err := sim.Start(sim.Config{Engine: sim.EngineSGLang, Model: "base", RuntimeLoRA: true, MaxLoRAs: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	sw := worker.New(config.Worker{URL: s.URL()})
	if in, err = worker.Detect(context.Background(), http.DefaultClient, sw); err != nil {
		t.Fatal(err)
	}
	sw.SetInfo(in)
	// Another replica fills the engine behind this one's count.
	resp, err := http.Post(s.URL()+"/load_lora_adapter", "application/json", strings.NewReader(`{"lora_name":"b1","lora_path":"/adapters/b1"}`))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("the other replica's load: %v %v", resp, err)
	}
	resp.Body.Close()
	sm := New(worker.NewRegistry(sw), http.DefaultClient, quiet, Settings{Adapters: declared("b1", "b2"), UnloadLRU: true, Timeout: 5 * time.Second})
	if err := sm.Ensure(context.Background(), sw, "b2"); err != nil {
		t.Fatalf("SGLang full behind Baton's count: %v", err)
	}
	if got := strings.Join(s.LoadedAdapters(), ","); got != "b2" {
		t.Errorf("SGLang: loaded %s, want b2 (b1, idle, unloaded to make room)", got)
	}
}

// A load the engine answers but then does not list (another replica unloaded the adapter between
// the load and this replica's read of the models) is tried again until the load timeout; one that
// loses every try fails the request that met it, but is not held for failHold: the next request
// loads again instead of getting the same 503 for 30 s.
func TestARaceLostIsNotHeld(t *testing.T) {
	var loads int
	var mu sync.Mutex
	e := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/load_lora_adapter":
			mu.Lock()
			loads++
			mu.Unlock()
			w.Write([]byte("Success: LoRA adapter 'x' added successfully."))
		case "/v1/models": // the other replica's unload came first
			w.Header().Set("Content-Type", "application/json")
			w.Write([]byte(`{"object":"list","data":[{"id":"base","object":"model"}]}`))
		default:
			http.NotFound(w, r)
		}
	}))
	defer e.Close()
	w := worker.New(config.Worker{URL: e.URL})
	w.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM, Models: []worker.Model{{ID: "base"}}})
	m := New(worker.NewRegistry(w), http.DefaultClient, slog.New(slog.NewTextHandler(io.Discard, nil)),
		Settings{Adapters: []config.Adapter{{Name: "x", Path: "/x", Base: "base"}}, Timeout: 300 * time.Millisecond})
	last := 0
	for i := 1; i <= 2; i++ {
		if err := m.Ensure(context.Background(), w, "x"); err == nil || !strings.Contains(err.Error(), "does not list") {
			t.Fatalf("load %d: %v", i, err)
		}
		mu.Lock()
		n := loads
		mu.Unlock()
		if n-last < 2 {
			t.Fatalf("request %d: the engine saw %d loads, want more than one (tried again until the load timeout; a lost race held tries none)", i, n-last)
		}
		last = n
	}
}

// An adapter this replica never sent a request for (another replica's) counts, for the choice of
// what to unload, as used when first seen — never as the oldest: the one this replica used long
// ago goes first, and only once the other's has been idle longer does it go.
func TestAnotherReplicasAdapterIsNotTheOldest(t *testing.T) {
	clock := time.Now()
	w := nodeOf(config.RuntimeSGLang, 2, "http://w", worker.EngineLoad{}, "mine", "theirs")
	m := New(worker.NewRegistry(w), http.DefaultClient, slog.New(slog.NewTextHandler(io.Discard, nil)), Settings{Timeout: time.Second})
	m.now = func() time.Time { return clock }
	m.Begin(w, "mine")() // used, and ended, now
	clock = clock.Add(time.Hour)
	if got := m.lru(w, worker.EngineLoad{}); got != "mine" {
		t.Fatalf("unloaded %q first, want mine (theirs was only just seen)", got)
	}
	m.forget(w, "mine")
	clock = clock.Add(time.Hour)
	m.Begin(w, "mine")()
	if got := m.lru(w, worker.EngineLoad{}); got != "theirs" {
		t.Errorf("unloaded %q, want theirs (idle since first seen, an hour before mine's last use)", got)
	}
}

// A burst of reads of one worker's models is one read of its engine.
func TestRelearnsOfOneWorkerAreOneRead(t *testing.T) {
	var mu sync.Mutex
	reads := 0
	release := make(chan struct{})
	e := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		mu.Lock()
		reads++
		mu.Unlock()
		<-release
		rw.Header().Set("Content-Type", "application/json")
		rw.Write([]byte(`{"object":"list","data":[{"id":"base","object":"model"}]}`))
	}))
	defer e.Close()
	w := worker.New(config.Worker{URL: e.URL})
	w.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM, Models: []worker.Model{{ID: "base"}}})
	m := New(worker.NewRegistry(w), http.DefaultClient, slog.New(slog.NewTextHandler(io.Discard, nil)), Settings{Timeout: time.Second})
	var wg sync.WaitGroup
	for i := 0; i < 20; i++ {
		wg.Go(func() {
			if err := m.Relearn(context.Background(), w); err != nil {
				t.Error(err)
			}
		})
	}
	time.Sleep(100 * time.Millisecond) // every Relearn has joined the read in flight
	close(release)
	wg.Wait()
	if reads != 1 {
		t.Errorf("20 relearns at once read the engine %d times", reads)
	}
}

// A request waiting its turn for a load on a worker (another load holds the worker) goes as
// soon as its adapter appears there — another replica loaded it — not when the load ahead ends:
// a load making room could otherwise wait on this very request's count in flight.
func TestAWaitingRequestGoesOnceItsAdapterIsListed(t *testing.T) {
	release := make(chan struct{})
	e := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/load_lora_adapter" {
			<-release // the load ahead never ends during the test
		}
		rw.Header().Set("Content-Type", "application/json")
		rw.Write([]byte(`{"object":"list","data":[{"id":"base","object":"model"}]}`))
	}))
	defer e.Close()
	defer close(release)
	w := worker.New(config.Worker{URL: e.URL})
	w.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM, Models: []worker.Model{{ID: "base"}}})
	m := New(worker.NewRegistry(w), http.DefaultClient, slog.New(slog.NewTextHandler(io.Discard, nil)),
		Settings{Adapters: []config.Adapter{{Name: "a", Path: "/a", Base: "base"}, {Name: "b", Path: "/b", Base: "base"}}, Timeout: time.Minute})
	go m.Ensure(context.Background(), w, "a")
	time.Sleep(50 * time.Millisecond)
	done := make(chan error, 1)
	go func() { done <- m.Ensure(context.Background(), w, "b") }()
	time.Sleep(50 * time.Millisecond)
	w.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM, Models: []worker.Model{{ID: "base"}, {ID: "b", Parent: "base"}}})
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the request waited for the load ahead although its adapter is on the worker")
	}
}
