package lora

import (
	"io"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// node is a registered worker serving base with adapters loaded and the engine load l.
func node(url string, l worker.EngineLoad, adapters ...string) *worker.Worker {
	w := worker.New(config.Worker{URL: url})
	in := &worker.Info{Runtime: config.RuntimeVLLM, Models: []worker.Model{{ID: "base"}}}
	for _, a := range adapters {
		in.Models = append(in.Models, worker.Model{ID: a, Parent: "base"})
	}
	w.SetInfo(in)
	w.SetEngineLoad(l)
	return w
}

// The tiers, best first: the adapter running on an engine that queues nothing, loaded, a free
// slot (or loaded where the engine queues), full with an idle adapter to unload, full with every
// adapter in flight. Among load tiers, the workers with the fewest loads under way.
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
	full := node("http://full", fresh(worker.EngineLoad{}), "y", "z")
	busy := node("http://busy", fresh(worker.EngineLoad{LoRARunning: []string{"y", "z"}}), "y", "z")
	m := New(worker.NewRegistry(running, loaded, queueing, free, full, busy), http.DefaultClient, slog.New(slog.NewTextHandler(io.Discard, nil)),
		Settings{Adapters: []config.Adapter{{Name: "x", Path: "/x", Base: "base"}}, Affinity: true, Timeout: time.Second})
	for w, want := range map[*worker.Worker]Tier{running: TierRunning, loaded: TierLoaded, queueing: TierFree, free: TierFree, full: TierFull, busy: TierBusy} {
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
