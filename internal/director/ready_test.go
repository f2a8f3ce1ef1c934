package director

import (
	"context"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/admit"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/worker"
)

// tripped is w with a circuit breaker opened by one failure (open for an hour).
func tripped(w *worker.Worker) *worker.Worker {
	w.UseBreaker(&worker.BreakerConfig{FailureThreshold: 1, SuccessThreshold: 1, Timeout: time.Hour})
	w.Record(http.StatusInternalServerError, nil)
	return w
}

// Readiness lists the models the workers and the configuration name (an alias's target, the
// default model's), and says per model it cannot serve now why: no ready worker (naming the
// aliases it is served for), no worker at all, open circuits, a configured model its engine
// does not serve.
func TestReadiness(t *testing.T) {
	down := regular("http://b:8000", "m2")
	down.SetReady(false)
	unserving := worker.New(config.Worker{URL: "http://u:8000", Models: []string{"m6"}})
	unserving.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM, Models: []worker.Model{{ID: "m6"}}, Unserved: []string{"m6"}})
	unserving.SetReady(true)
	f := newFleet(t, []*worker.Worker{regular("http://a:8000", "m1"), down, tripped(regular("http://c:8000", "m5")), unserving},
		withModels(map[string]config.ModelConfig{"fast": {Serve: "m2"}, "chat": {Serve: "m2"}, "m1": {}}, "m4"))
	models, missing := f.d.Readiness()
	if want := []string{"m1", "m2", "m4", "m5", "m6"}; !slices.Equal(models, want) {
		t.Errorf("models %v, want %v", models, want)
	}
	want := []string{
		`model "m2" (served for chat, fast): no ready worker (unreachable, still registering, unhealthy or drained)`,
		`model "m4": no worker serves it`,
		`model "m5": no available worker (the circuit of every ready one is open: its engine failed requests)`,
		`model "m6": named in the configuration of workers whose engines do not serve it`,
	}
	if !slices.Equal(missing, want) {
		t.Errorf("missing:\n%s\nwant:\n%s", strings.Join(missing, "\n"), strings.Join(want, "\n"))
	}
	// Every model served: ready.
	down.SetReady(true)
	ok := newFleet(t, []*worker.Worker{regular("http://a:8000", "m1"), down}, withModels(map[string]config.ModelConfig{"chat": {Serve: "m2"}}, "m1"))
	if models, missing := ok.d.Readiness(); !slices.Equal(models, []string{"m1", "m2"}) || len(missing) != 0 {
		t.Errorf("a fleet serving every model: %v, missing %v", models, missing)
	}
}

// Without a model known: no worker at all is not ready, a worker taking any model is; the
// models listed are none either way.
func TestReadinessWithoutModels(t *testing.T) {
	models, missing := newFleet(t, nil).d.Readiness()
	if len(models) != 0 || models == nil || !slices.Equal(missing, []string{"no model is known yet: no worker serves it"}) {
		t.Errorf("an empty fleet: models %#v, missing %v", models, missing)
	}
	models, missing = newFleet(t, []*worker.Worker{regular("http://any:8000")}).d.Readiness()
	if len(models) != 0 || len(missing) != 0 {
		t.Errorf("a worker of any model: models %v, missing %v", models, missing)
	}
}

// With PD a model needs an available prefill and decode that can hand KV to each other.
func TestReadinessPD(t *testing.T) {
	pre := func(url string) *worker.Worker { return engineWorker(url, config.RolePrefill, config.RuntimeVLLM, "m") }
	dec := func(url string) *worker.Worker { return engineWorker(url, config.RoleDecode, config.RuntimeVLLM, "m") }
	disagg := func(o *Options) { o.PD = true }
	never := func(o *Options) { o.Selector.Compatible = func(_, _ *worker.Worker) bool { return false } }
	same := func(o *Options) {
		o.Selector.Compatible = func(p, d *worker.Worker) bool { return p.KVConnector == d.KVConnector }
	}
	nixl := func(w *worker.Worker) *worker.Worker { w.KVConnector = "nixl"; return w }
	for _, c := range []struct {
		name string
		ws   []*worker.Worker
		tune []func(*Options)
		why  string // "" for ready
	}{
		{"pairs", []*worker.Worker{pre("http://p:8000"), dec("http://d:8000")}, nil, ""},
		{"no prefill", []*worker.Worker{dec("http://d:8000")}, nil, `model "m": no ready prefill worker (unreachable, still registering, unhealthy or drained)`},
		{"no decode", []*worker.Worker{pre("http://p:8000")}, nil, `model "m": no ready decode worker (unreachable, still registering, unhealthy or drained)`},
		{"prefill's circuit open", []*worker.Worker{tripped(pre("http://p:8000")), dec("http://d:8000")}, nil,
			`model "m": no available prefill worker (the circuit of every ready one is open: its engine failed requests)`},
		{"decode's circuit open", []*worker.Worker{pre("http://p:8000"), tripped(dec("http://d:8000"))}, nil,
			`model "m": no available decode worker (the circuit of every ready one is open: its engine failed requests)`},
		{"incompatible", []*worker.Worker{pre("http://p:8000"), dec("http://d:8000")}, []func(*Options){never},
			`model "m": no available prefill and decode can hand KV to each other (their runtimes or KV connectors differ, or a prefill's bootstrap port is not its engine's: GET /workers)`},
		{"one compatible pair", []*worker.Worker{pre("http://p:8000"), nixl(pre("http://p2:8000")), nixl(dec("http://d:8000"))}, []func(*Options){same}, ""},
	} {
		f := newFleet(t, c.ws, append([]func(*Options){disagg}, c.tune...)...)
		models, missing := f.d.Readiness()
		var want []string
		if c.why != "" {
			want = []string{c.why}
		}
		if !slices.Equal(models, []string{"m"}) || !slices.Equal(missing, want) {
			t.Errorf("%s: models %v, missing %v; want %v", c.name, models, missing, want)
		}
	}
	// A director without a selection: any pair hands KV.
	reg := worker.NewRegistry(pre("http://p:8000"), dec("http://d:8000"))
	d := New(Options{Registry: reg, PD: true})
	if _, missing := d.Readiness(); len(missing) != 0 {
		t.Errorf("without a selector: missing %v", missing)
	}
}

// Unregistered names the workers not registered yet, by URL with its credentials redacted, and
// counts them by cause: a worker whose engine refused Baton's key, one not tried yet.
func TestUnregistered(t *testing.T) {
	if named, byCause := newFleet(t, []*worker.Worker{regular("http://a:8000", "m")}).d.Unregistered(); named != nil || byCause != nil {
		t.Errorf("every worker registered: %v, %v", named, byCause)
	}
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, `{"error":"unauthorized"}`, http.StatusUnauthorized)
	}))
	defer engine.Close()
	secretURL := strings.Replace(engine.URL, "http://", "http://baton:s3cret@", 1)
	refusing := worker.New(config.Worker{URL: secretURL})
	waiting := worker.New(config.Worker{URL: "http://tok3n@10.0.0.9:8000"})
	f := newFleet(t, []*worker.Worker{regular("http://a:8000", "m"), refusing, waiting})

	// The engine refusing Baton's key: its registration is tried (and kept waiting) in the
	// background; the other worker is never tried.
	r := &worker.Registrar{Registry: worker.NewRegistry(refusing), Client: engine.Client(), Log: slog.New(slog.DiscardHandler), MaxInterval: time.Hour}
	ctx, cancel := context.WithCancel(context.Background())
	r.Start(ctx)
	waitFor(t, "the refusing engine's registration failed", func() bool { return refusing.LastRegistrationError() != nil })
	cancel()
	r.Wait()

	named, byCause := f.d.Unregistered()
	want := []map[string]string{
		{"url": strings.Replace(engine.URL, "http://", "http://redacted@", 1), "cause": "wrong_key"},
		{"url": "http://redacted@10.0.0.9:8000", "cause": "pending"},
	}
	if len(named) != len(want) {
		t.Fatalf("named %v", named)
	}
	for i := range want {
		if !maps.Equal(named[i], want[i]) {
			t.Errorf("%d: %v, want %v", i, named[i], want[i])
		}
	}
	if !maps.Equal(byCause, map[string]int{"wrong_key": 1, "pending": 1}) {
		t.Errorf("by cause %v", byCause)
	}
	for _, n := range named {
		if strings.Contains(n["url"], "s3cret") || strings.Contains(n["url"], "tok3n") || strings.Contains(n["url"], "baton:") {
			t.Errorf("credentials shown: %v", n)
		}
	}
}

// A worker never tried is pending.
func TestUnregisteredPending(t *testing.T) {
	f := newFleet(t, []*worker.Worker{worker.New(config.Worker{URL: "https://user:pw@engine.example:8443/"})})
	named, byCause := f.d.Unregistered()
	if len(named) != 1 || named[0]["url"] != "https://redacted@engine.example:8443" || named[0]["cause"] != "pending" || byCause["pending"] != 1 || len(byCause) != 1 {
		t.Errorf("named %v, by cause %v", named, byCause)
	}
}

// Prefiller holds a request to the first named prefill that is available; malformed lists are
// 400, a list naming no available prefill 503.
func TestPrefiller(t *testing.T) {
	p1 := engineWorker("http://10.0.0.1:8000", config.RolePrefill, config.RuntimeVLLM, "m")
	p2 := engineWorker("http://10.0.0.2:8000", config.RolePrefill, config.RuntimeVLLM, "m")
	p3 := engineWorker("http://10.0.0.3:8000", config.RolePrefill, config.RuntimeVLLM, "m")
	p3.SetReady(false)
	dec := engineWorker("http://10.0.0.4:8000", config.RoleDecode, config.RuntimeVLLM, "m")
	f := newFleet(t, []*worker.Worker{p1, p2, p3, dec}, func(o *Options) { o.PD = true })
	for _, c := range []struct {
		values []string
		want   *worker.Worker
	}{
		{[]string{"10.0.0.2:8000"}, p2},
		{[]string{" 10.0.0.2:8000 , 10.0.0.1:8000"}, p2},
		{[]string{"10.0.0.3:8000,10.0.0.1:8000"}, p1}, // the first is not ready: the next
		{[]string{"10.0.0.9:8000", "10.0.0.1:8000"}, p1},
		{[]string{"", "10.0.0.4:8000, 10.0.0.2:8000"}, p2}, // a decode is no prefill
	} {
		allow, e := f.d.Prefiller(c.values)
		if e != nil {
			t.Errorf("%q: %+v", c.values, e)
			continue
		}
		for _, w := range []*worker.Worker{p1, p2, p3} {
			if allow(w) != (w == c.want) {
				t.Errorf("%q: allows %s %v", c.values, w.URL, allow(w))
			}
		}
		if !allow(dec) {
			t.Errorf("%q: the decode is held out", c.values)
		}
	}
	many := make([]string, 17)
	for i := range many {
		many[i] = "10.0.0.1:8000"
	}
	for _, values := range [][]string{nil, {""}, {" , ,"}, many, {strings.Repeat("h", 300) + ":1"}} {
		if _, e := f.d.Prefiller(values); e == nil || e.Status != http.StatusBadRequest || e.Code != openai.CodeInvalidRequest || e.Param != openai.HeaderPrefiller {
			t.Errorf("%.60q: %+v", values, e)
		}
	}
	if _, e := f.d.Prefiller(many[:16]); e != nil {
		t.Errorf("16 entries: %+v", e)
	}
	for _, values := range [][]string{{"10.0.0.9:8000"}, {"10.0.0.3:8000"}, {"10.0.0.4:8000"}, {"http://10.0.0.1:8000"}} {
		if _, e := f.d.Prefiller(values); e == nil || e.Status != http.StatusServiceUnavailable || e.Code != openai.CodeNoAvailableWorkers ||
			!strings.Contains(e.Message, values[0]) {
			t.Errorf("%q: %+v", values, e)
		}
	}
}

// A decode serves alone when it is an available one of another runtime than SGLang.
func TestDecodeAloneServes(t *testing.T) {
	sg := engineWorker("http://s:30000", config.RoleDecode, config.RuntimeSGLang, "m")
	vl := engineWorker("http://v:8000", config.RoleDecode, config.RuntimeVLLM, "m")
	for _, c := range []struct {
		name  string
		ws    []*worker.Worker
		ready bool // vl's readiness
		want  bool
	}{
		{"SGLang decodes", []*worker.Worker{sg}, true, false},
		{"a vLLM decode", []*worker.Worker{sg, vl}, true, true},
		{"a vLLM decode not ready", []*worker.Worker{sg, vl}, false, false},
		{"a regular vLLM worker", []*worker.Worker{regular("http://r:8000", "m")}, true, false},
	} {
		vl.SetReady(c.ready)
		if got := newFleet(t, c.ws, func(o *Options) { o.PD = true }).d.DecodeAloneServes(); got != c.want {
			t.Errorf("%s: %v", c.name, got)
		}
	}
}

// The priority headers: Baton's first, in any case and spacing, smg's names too; an unknown
// X-Baton-Priority is 400 naming the valid ones, an unknown X-Smg-Priority the default class.
func TestPriorityClass(t *testing.T) {
	for _, c := range []struct {
		baton, smg string
		want       admit.Class
	}{
		{"", "", admit.Default},
		{"critical", "", admit.Critical},
		{" Interactive ", "", admit.Interactive},
		{"BATCH", "", admit.Batch},
		{"system", "", admit.Critical},
		{"", "bulk", admit.Batch},
		{"", "system", admit.Critical},
		{"", "nonsense", admit.Default},
		{"interactive", "batch", admit.Interactive},
		{"", "default", admit.Default},
	} {
		got, e := PriorityClass(c.baton, c.smg)
		if e != nil || got != c.want {
			t.Errorf("%q/%q: %v, %+v; want %v", c.baton, c.smg, got, e, c.want)
		}
	}
	for _, c := range []struct{ baton, smg string }{{"urgent", ""}, {"urgent", "batch"}, {strings.Repeat("x", 200), ""}} {
		_, e := PriorityClass(c.baton, c.smg)
		if e == nil || e.Status != http.StatusBadRequest || e.Code != openai.CodeInvalidPriority || e.Param != openai.HeaderPriority ||
			!strings.Contains(e.Message, "critical, interactive, default or batch") || len(e.Message) > 200 {
			t.Errorf("%.20q/%q: %+v", c.baton, c.smg, e)
		}
	}
}

// A prefill's open circuit says nothing of the decodes: with a healthy prefill beside it and no
// decode at all, readiness says there is no decode, not that every decode's circuit is open.
func TestReadinessNamesTheRoleThatIsMissing(t *testing.T) {
	open := tripped(engineWorker("http://p1:8000", config.RolePrefill, config.RuntimeVLLM, "m"))
	ok := engineWorker("http://p2:8000", config.RolePrefill, config.RuntimeVLLM, "m")
	f := newFleet(t, []*worker.Worker{open, ok}, func(o *Options) { o.PD = true })
	_, missing := f.d.Readiness()
	want := []string{`model "m": no ready decode worker (unreachable, still registering, unhealthy or drained)`}
	if !slices.Equal(missing, want) {
		t.Errorf("missing %q, want %q", missing, want)
	}
}

// A model none of whose workers is available is served through its fallbacks, as its requests
// are: it is no model readiness misses, unless a name clients use for it has none that serves.
func TestReadinessCountsAModelServedThroughItsFallbacks(t *testing.T) {
	down := regular("http://big:8000", "big")
	down.SetReady(false)
	f := newFleet(t, []*worker.Worker{down, regular("http://small:8000", "small")},
		withModels(map[string]config.ModelConfig{"big": {Fallbacks: []string{"small"}}}, ""))
	if models, missing := f.d.Readiness(); !slices.Equal(models, []string{"big", "small"}) || len(missing) != 0 {
		t.Errorf("a model whose fallback serves: models %v, missing %v", models, missing)
	}
	// An alias to it without fallbacks of its own: its clients cannot be served.
	g := newFleet(t, []*worker.Worker{down, regular("http://small:8000", "small")},
		withModels(map[string]config.ModelConfig{"big": {Fallbacks: []string{"small"}}, "large": {Serve: "big"}}, ""))
	if _, missing := g.d.Readiness(); len(missing) != 1 || !strings.Contains(missing[0], `"big" (served for large)`) {
		t.Errorf("an alias without a fallback: missing %v", missing)
	}
	if models, missing := g.d.Readiness(); !Servable(models, missing) {
		t.Error("a fleet serving one of its two models is not servable")
	}
}

// Servable: ready while any model can be served; with none known, when none is missing.
func TestServable(t *testing.T) {
	for _, c := range []struct {
		models, missing []string
		want            bool
	}{
		{[]string{"a", "b"}, nil, true},
		{[]string{"a", "b"}, []string{"a: down"}, true},
		{[]string{"a", "b"}, []string{"a: down", "b: down"}, false},
		{[]string{}, nil, true},
		{[]string{}, []string{"no model is known yet"}, false},
	} {
		if got := Servable(c.models, c.missing); got != c.want {
			t.Errorf("Servable(%v, %v) = %v", c.models, c.missing, got)
		}
	}
}

// logLines is a slog handler keeping each record's level, message and attributes as text.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) Enabled(context.Context, slog.Level) bool { return true }
func (l *logLines) Handle(_ context.Context, r slog.Record) error {
	line := r.Level.String() + " " + r.Message
	r.Attrs(func(a slog.Attr) bool { line += " " + a.String(); return true })
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, line)
	return nil
}
func (l *logLines) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logLines) WithGroup(string) slog.Handler      { return l }

// A model that can no longer be served while others can (readiness staying 200) is said in a
// WARN, once, and its return in an INFO; baton_model_servable says each model's state.
func TestAModelLostIsSaid(t *testing.T) {
	n := regular("http://n:8000", "n")
	logs := &logLines{}
	f := newFleet(t, []*worker.Worker{regular("http://m:8000", "m"), n}, func(o *Options) { o.Log = slog.New(logs) })
	last := f.d.noteServable(nil)
	n.SetReady(false)
	last = f.d.noteServable(last)
	last = f.d.noteServable(last)
	metric := testutil.ToFloat64(servableGauge(t, f, "n"))
	n.SetReady(true)
	f.d.noteServable(last)
	want := []string{
		`WARN a model can no longer be served; the gateway stays ready while any model can model=n why=model "n": no ready worker (unreachable, still registering, unhealthy or drained)`,
		`INFO a model can be served again model=n`,
	}
	if !slices.Equal(logs.lines, want) {
		t.Errorf("logged:\n%s\nwant:\n%s", strings.Join(logs.lines, "\n"), strings.Join(want, "\n"))
	}
	if metric != 0 || testutil.ToFloat64(servableGauge(t, f, "n")) != 1 || testutil.ToFloat64(servableGauge(t, f, "m")) != 1 {
		t.Errorf("baton_model_servable{model=n} was %v while n could not be served", metric)
	}
}

// servableGauge is baton_model_servable{model} as f's metrics report it now.
func servableGauge(t *testing.T, f *fleet, model string) prometheus.Collector {
	t.Helper()
	families, err := f.m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, fam := range families {
		if fam.GetName() != "baton_model_servable" {
			continue
		}
		for _, m := range fam.GetMetric() {
			if m.GetLabel()[0].GetValue() == model {
				g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "x"})
				g.Set(m.GetGauge().GetValue())
				return g
			}
		}
	}
	t.Fatalf("no baton_model_servable{model=%q}", model)
	return nil
}

// A configured name no engine serves is its own baton_model_servable series (it fell into
// "unknown" with every other such name); a model lost when it was the last one says the
// gateway turned not ready.
func TestAnUnservedConfiguredModelIsNamed(t *testing.T) {
	m := regular("http://m:8000", "m")
	logs := &logLines{}
	f := newFleet(t, []*worker.Worker{m}, withModels(map[string]config.ModelConfig{"ghost": {Serve: "nothing-here"}}, ""),
		func(o *Options) { o.Log = slog.New(logs) })
	if v := testutil.ToFloat64(servableGauge(t, f, "nothing-here")); v != 0 {
		t.Errorf("baton_model_servable{model=nothing-here} = %v", v)
	}
	last := f.d.noteServable(nil)
	m.SetReady(false)
	f.d.noteServable(last)
	if len(logs.lines) != 1 || !strings.Contains(logs.lines[0], "no model can: readiness answers 503") {
		t.Errorf("logged %q", logs.lines)
	}
}

// With smg's priority scheduler and no --max-concurrent-requests the requests served at once
// are the engines' capacity, as smg sizes them: what each available worker that runs requests
// reports (or its max_running_requests label), 64 for one that reports nothing, 1024 while none
// is available; recomputed as the fleet changes.
func TestSlotsSizedFromTheEngines(t *testing.T) {
	labelled := worker.New(config.Worker{URL: "http://a:8000", Labels: map[string]string{"max_running_requests": "10"}})
	labelled.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM})
	labelled.SetReady(true)
	reported := regular("http://b:8000", "m")
	reported.SetInfo(&worker.Info{Runtime: config.RuntimeSGLang, MaxRunning: 48})
	silent := regular("http://c:8000", "m")
	f := newFleet(t, []*worker.Worker{labelled, reported, silent}, func(o *Options) {
		o.Admission = config.Admission{SlotsFromEngines: true, QueueSize: 10, QueueTimeout: time.Minute}
	})
	if n := f.d.admit.s.Slots(); n != NoWorkerCapacity {
		t.Errorf("before any look: %d slots, want %d", n, NoWorkerCapacity)
	}
	f.d.sizeSlots()
	if n := f.d.admit.s.Slots(); n != 10+48+SlotsPerWorker {
		t.Errorf("%d slots, want %d", n, 10+48+SlotsPerWorker)
	}
	labelled.SetReady(false)
	reported.SetReady(false)
	silent.SetReady(false)
	f.d.sizeSlots()
	if n := f.d.admit.s.Slots(); n != NoWorkerCapacity {
		t.Errorf("no worker available: %d slots, want %d", n, NoWorkerCapacity)
	}
}
