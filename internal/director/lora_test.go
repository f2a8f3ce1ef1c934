package director

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/lora"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/worker"
)

// loraEngine is an engine serving "base" that loads adapters when asked (vLLM's
// /v1/load_lora_adapter, SGLang's /load_lora_adapter) and lists them in /v1/models with their
// parent, as both engines do.
type loraEngine struct {
	runtime string
	srv     *httptest.Server

	mu     sync.Mutex
	loaded []string
	posts  []string          // each load asked: path, adapter, its path
	refuse map[string]string // adapter -> the engine's message refusing its load
	models int               // the status of /v1/models; 0: 200
}

func newLoraEngine(t *testing.T, runtime string) *loraEngine {
	e := &loraEngine{runtime: runtime, refuse: map[string]string{}}
	e.srv = httptest.NewServer(http.HandlerFunc(e.serve))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *loraEngine) serve(w http.ResponseWriter, r *http.Request) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case r.Method == http.MethodPost && (r.URL.Path == "/v1/load_lora_adapter" || r.URL.Path == "/load_lora_adapter"):
		var body struct {
			LoraName string `json:"lora_name"`
			LoraPath string `json:"lora_path"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		e.posts = append(e.posts, r.URL.Path+" "+body.LoraName+" "+body.LoraPath)
		if msg, ok := e.refuse[body.LoraName]; ok {
			w.WriteHeader(http.StatusBadRequest)
			fmt.Fprintf(w, `{"object":"error","message":%q,"type":"BadRequestError","code":400}`, msg)
			return
		}
		if !slices.Contains(e.loaded, body.LoraName) {
			e.loaded = append(e.loaded, body.LoraName)
		}
		fmt.Fprintf(w, "Success: LoRA adapter '%s' added successfully.", body.LoraName)
	case r.Method == http.MethodGet && r.URL.Path == "/v1/models":
		if e.models != 0 {
			w.WriteHeader(e.models)
			return
		}
		cards := []map[string]any{{"id": "base", "object": "model", "owned_by": e.runtime, "parent": nil}}
		for _, a := range e.loaded {
			cards = append(cards, map[string]any{"id": a, "object": "model", "owned_by": e.runtime, "parent": "base"})
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": cards})
	default:
		http.NotFound(w, r)
	}
}

// loads are the loads the engine was asked for.
func (e *loraEngine) loads() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.posts)
}

// drop unloads adapter behind Baton's back (another replica did).
func (e *loraEngine) drop(adapter string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.loaded = slices.DeleteFunc(e.loaded, func(a string) bool { return a == adapter })
}

func (e *loraEngine) set(f func(*loraEngine)) {
	e.mu.Lock()
	defer e.mu.Unlock()
	f(e)
}

// worker is a ready worker of role on the engine, serving "base" with no adapter loaded, holding
// at most maxLoaded adapters (0: no bound known).
func (e *loraEngine) worker(role string, maxLoaded int) *worker.Worker {
	w := worker.New(config.Worker{URL: e.srv.URL, Role: role, Runtime: e.runtime})
	w.SetInfo(&worker.Info{Runtime: e.runtime, Models: []worker.Model{{ID: "base"}}, MaxLoadedLoRAs: maxLoaded})
	w.SetReady(true)
	return w
}

// declared are the adapters "sql" and "bad" of base, at /adapters/NAME.
var declared = []config.Adapter{{Name: "sql", Path: "/adapters/sql", Base: "base"}, {Name: "bad", Path: "/adapters/bad", Base: "base"}}

// withAdapters gives the director (and its selection) a manager of the declared adapters.
func withAdapters(o *Options) {
	m := lora.New(o.Registry, http.DefaultClient, slog.New(slog.DiscardHandler), lora.Settings{Adapters: declared, Timeout: 5 * time.Second})
	o.Adapters, o.Selector.Adapters = m, m
}

// A request for a declared adapter is sent to a worker of its base model with the adapter
// loaded there first — once: the next request finds it listed. The choice counts the request in
// flight on the adapter until it is released (an adapter in flight is never one to unload).
func TestChooseLoadsDeclaredAdapter(t *testing.T) {
	e := newLoraEngine(t, config.RuntimeSGLang)
	w := e.worker(config.RoleRegular, 1)
	f := newFleet(t, []*worker.Worker{w}, withAdapters)
	ctx := context.Background()
	p := f.d.PlanRegular(&record.Record{Model: "sql"}, parsed(t, `{"model":"sql","prompt":"x"}`), "/v1/completions")
	c, err := f.d.Choose(ctx, p, "sql", nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.Worker != w || p.Sel.Model != "sql" || p.Sel.AdapterBase != "base" || !f.d.DeclaredAdapter(p.Sel) {
		t.Fatalf("chose %v for %q (base %q)", c.Worker, p.Sel.Model, p.Sel.AdapterBase)
	}
	if got := e.loads(); !slices.Equal(got, []string{"/load_lora_adapter sql /adapters/sql"}) {
		t.Errorf("loads %q", got)
	}
	if !w.Lists("sql") || !slices.Equal(w.Adapters(), []string{"sql"}) || f.reg.Snapshot().Parent("sql") != "base" {
		t.Errorf("after the load the worker lists %v", w.Adapters())
	}
	// The worker holds its one adapter; with a request in flight on it, another adapter could
	// not unload it (busy); released, it could (full).
	now := time.Now()
	if tier := f.d.Adapters().TierOf(w, "other", now); tier != lora.TierBusy {
		t.Errorf("with the request in flight: %s", tier)
	}
	c.Release()
	if tier := f.d.Adapters().TierOf(w, "other", now); tier != lora.TierFull {
		t.Errorf("after Release: %s", tier)
	}
	again := f.d.PlanRegular(&record.Record{Model: "sql"}, parsed(t, `{"model":"sql","prompt":"y"}`), "/v1/completions")
	c, err = f.d.Choose(ctx, again, "sql", nil)
	if err != nil || c.Worker != w {
		t.Fatalf("again: %v, %v", c.Worker, err)
	}
	c.Release()
	if got := e.loads(); len(got) != 1 {
		t.Errorf("an adapter listed was loaded again: %q", got)
	}
	// The base model is no adapter: nothing loaded, nothing counted.
	base := f.d.PlanRegular(&record.Record{Model: "base"}, parsed(t, `{"model":"base","prompt":"y"}`), "/v1/completions")
	if c, err = f.d.Choose(ctx, base, "base", nil); err != nil || c.Worker != w || base.Sel.AdapterBase != "" || f.d.DeclaredAdapter(base.Sel) {
		t.Errorf("base: %v, %v, adapter base %q", c.Worker, err, base.Sel.AdapterBase)
	}
	c.Release()
	if got := e.loads(); len(got) != 1 {
		t.Errorf("loads %q", got)
	}
}

// A pair's legs both get the adapter, each its own load.
func TestChoosePairLoadsAdapterOnBothLegs(t *testing.T) {
	pe, de := newLoraEngine(t, config.RuntimeVLLM), newLoraEngine(t, config.RuntimeVLLM)
	pw, dw := pe.worker(config.RolePrefill, 0), de.worker(config.RoleDecode, 0)
	f := newFleet(t, []*worker.Worker{pw, dw}, func(o *Options) { o.PD = true }, withAdapters)
	p := f.d.PlanPair(&record.Record{Model: "sql"}, parsed(t, `{"model":"sql","messages":[]}`), "/v1/chat/completions", nil)
	c, err := f.d.Choose(context.Background(), p, "sql", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	if c.Pair.Prefill != pw || c.Pair.Decode != dw {
		t.Fatalf("pair %v/%v", c.Pair.Prefill, c.Pair.Decode)
	}
	for _, e := range []*loraEngine{pe, de} {
		if got := e.loads(); !slices.Equal(got, []string{"/v1/load_lora_adapter sql /adapters/sql"}) {
			t.Errorf("%s: loads %q", e.srv.URL, got)
		}
	}
	if !pw.Lists("sql") || !dw.Lists("sql") {
		t.Error("a leg does not list the adapter after its load")
	}
}

// An adapter the engine refuses to load is 503 adapter_load_failed naming it and saying the
// engine's reason, final (not retried elsewhere); the failure is answered at once for a while
// rather than loaded again.
func TestChooseAdapterLoadFailed(t *testing.T) {
	e := newLoraEngine(t, config.RuntimeVLLM)
	e.set(func(e *loraEngine) { e.refuse["bad"] = "No adapter found for /adapters/bad" })
	w := e.worker(config.RoleRegular, 0)
	f := newFleet(t, []*worker.Worker{w}, withAdapters)
	for range 2 {
		p := f.d.PlanRegular(&record.Record{Model: "bad"}, parsed(t, `{"model":"bad","prompt":"x"}`), "/v1/completions")
		c, err := f.d.Choose(context.Background(), p, "bad", nil)
		if c.Worker != nil {
			t.Errorf("chose %v", c.Worker)
		}
		fl, a := answerOf(t, err)
		if a.Status != http.StatusServiceUnavailable || a.Code != openai.CodeAdapterLoadFailed || a.Param != "model" || !fl.Final ||
			!strings.Contains(a.Message, `"bad"`) || !strings.Contains(a.Message, "No adapter found for /adapters/bad") {
			t.Errorf("final %v, %+v", fl.Final, a)
		}
	}
	if got := e.loads(); !slices.Equal(got, []string{"/v1/load_lora_adapter bad /adapters/bad"}) {
		t.Errorf("loads %q: want one, the failure held", got)
	}
	if w.Lists("bad") {
		t.Error("the worker lists an adapter whose load failed")
	}
}

// An engine that answered that the adapter is gone (another replica unloaded it): its models
// are read again and the adapter loaded once more where the request is sent again; when its
// models cannot be read, the request's answer is the engine's refusal as it was; when the
// load fails, the load's failure.
func TestReadyAgain(t *testing.T) {
	e := newLoraEngine(t, config.RuntimeVLLM)
	w := e.worker(config.RoleRegular, 0)
	f := newFleet(t, []*worker.Worker{w}, withAdapters)
	ctx := context.Background()
	p := f.d.PlanRegular(&record.Record{Model: "sql"}, parsed(t, `{"model":"sql","prompt":"x"}`), "/v1/completions")
	c, err := f.d.Choose(ctx, p, "sql", nil)
	if err != nil {
		t.Fatal(err)
	}
	c.Release()
	e.drop("sql")
	refused := &outcome.Failure{Status: http.StatusNotFound, Worker: w.URL, Body: []byte(`{"message":"The model ` + "`sql`" + ` does not exist."}`)}
	if !AdapterGone(refused) {
		t.Fatal("vLLM's 404 for a missing adapter is not read as the adapter gone")
	}
	end, err := f.d.ReadyAgain(ctx, "sql", w, refused, w)
	if err != nil || end == nil {
		t.Fatalf("ready again: %v", err)
	}
	end()
	if got := e.loads(); len(got) != 2 || got[1] != "/v1/load_lora_adapter sql /adapters/sql" {
		t.Errorf("loads %q: want the adapter loaded again", got)
	}
	if !w.Lists("sql") {
		t.Error("the worker does not list the adapter loaded again")
	}

	// The engine's models cannot be read: the refusal stands.
	e.set(func(e *loraEngine) { e.models = http.StatusInternalServerError })
	if end, err := f.d.ReadyAgain(ctx, "sql", w, refused, w); end != nil || err != refused {
		t.Errorf("models unreadable: %v (want the engine's refusal)", err)
	}
	// Gone again, and the engine refuses to load it.
	e.set(func(e *loraEngine) {
		e.models = 0
		e.refuse["sql"] = "out of GPU memory"
	})
	e.drop("sql")
	end, err = f.d.ReadyAgain(ctx, "sql", w, refused, w)
	if end != nil {
		t.Error("a failed load returned an end")
	}
	if _, a := answerOf(t, err); a.Status != http.StatusServiceUnavailable || a.Code != openai.CodeAdapterLoadFailed || !strings.Contains(a.Message, "out of GPU memory") {
		t.Errorf("the load refused: %+v", a)
	}
	if errors.Is(err, refused) {
		t.Error("a failed load answered as the engine's first refusal")
	}
	if got := e.loads(); len(got) != 3 {
		t.Errorf("loads %q", got)
	}
}

// DeclaredAdapter: a request's model that is an adapter Baton declares; not one only an engine
// lists, not a base model, not without an adapter manager.
func TestDeclaredAdapter(t *testing.T) {
	f := newFleet(t, []*worker.Worker{regular("http://a:8000", "base")}, withAdapters)
	plain := newFleet(t, []*worker.Worker{regular("http://a:8000", "base")})
	for _, c := range []struct {
		d    *Director
		sreq policy.Request
		want bool
	}{
		{f.d, policy.Request{Model: "sql", AdapterBase: "base"}, true},
		{f.d, policy.Request{Model: "listed", AdapterBase: "base"}, false},
		{f.d, policy.Request{Model: "sql"}, false},
		{f.d, policy.Request{Model: "base"}, false},
		{plain.d, policy.Request{Model: "sql", AdapterBase: "base"}, false},
	} {
		if got := c.d.DeclaredAdapter(&c.sreq); got != c.want {
			t.Errorf("%+v (adapters %v): %v", c.sreq, c.d.Adapters() != nil, got)
		}
	}
}
