package director

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/tenant"
	"github.com/baton-llm/baton/internal/worker"
)

// planFor is the plan of a regular request for model on /v1/completions, with its record.
func (f *fleet) planFor(t *testing.T, model string) *Plan {
	t.Helper()
	return f.d.PlanRegular(&record.Record{Model: model}, parsed(t, `{"model":"`+model+`","prompt":"x"}`), "/v1/completions")
}

// A regular request goes to the worker of its model, its record naming it (and the choice's
// reasons when X-Baton-Route is on); the model it asked for is the one served.
func TestChooseRegular(t *testing.T) {
	a, other := regular("http://a:8000", "m"), regular("http://o:8000", "other")
	f := newFleet(t, []*worker.Worker{a, other}, func(o *Options) { o.RouteHeader = true })
	p := f.planFor(t, "m")
	if p.Role != config.RoleRegular || p.Pair || p.Sel.Path != "/v1/completions" || !p.Sel.Explain {
		t.Fatalf("plan: %+v, selection %+v", p, p.Sel)
	}
	c, err := f.d.Choose(context.Background(), p, "m", nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.Worker != a || len(c.Workers()) != 1 || c.Workers()[0] != a || c.Pair.Prefill != nil {
		t.Fatalf("chose %v (workers %v)", c.Worker, c.Workers())
	}
	c.Release() // no adapter: nothing to end
	p.NoteWorker(c.Worker)
	if p.Rec.Worker != a.URL || p.Rec.Decode != "" || p.Rec.Served != "" || p.Sel.Model != "m" {
		t.Errorf("record %+v, selection's model %q", p.Rec, p.Sel.Model)
	}
	if !strings.Contains(p.Rec.Decisions, "role=regular; policy=round_robin") {
		t.Errorf("route header %q", p.Rec.Decisions)
	}
	if n := testutil.CollectAndCount(f.m.ModelFallbacks); n != 0 {
		t.Errorf("%d fallbacks counted", n)
	}
	if f.d.Disaggregated() || f.d.PD() || f.d.Registry() != f.reg || f.d.Selector() == nil || f.d.Log() == nil || f.d.Adapters() != nil {
		t.Error("the director's parts are not those it was given")
	}
}

// Without X-Baton-Route (and without tracing), no reasons are kept on the record.
func TestChooseWithoutRouteHeader(t *testing.T) {
	f := newFleet(t, []*worker.Worker{regular("http://a:8000", "m")})
	p := f.planFor(t, "m")
	if _, err := f.d.Choose(context.Background(), p, "m", nil); err != nil {
		t.Fatal(err)
	}
	if p.Sel.Explain || p.Rec.Decisions != "" || len(p.Sel.Decisions) != 0 {
		t.Errorf("explained %v: %q, %v", p.Sel.Explain, p.Rec.Decisions, p.Sel.Decisions)
	}
}

// With PD and no regular worker, a generation request goes to a prefill/decode pair, the
// record naming both and the mode; an Endpoint Picker's named prefill holds the choice to it.
func TestChoosePair(t *testing.T) {
	p1 := engineWorker("http://10.0.0.1:8000", config.RolePrefill, config.RuntimeVLLM, "m")
	p2 := engineWorker("http://10.0.0.2:8000", config.RolePrefill, config.RuntimeVLLM, "m")
	dec := engineWorker("http://10.0.0.3:8000", config.RoleDecode, config.RuntimeVLLM, "m")
	f := newFleet(t, []*worker.Worker{p1, p2, dec}, func(o *Options) { o.PD = true })
	if !f.d.Disaggregated() || !f.d.PD() {
		t.Fatal("a fleet of pairs is not disaggregated")
	}
	ctx := context.Background()
	seen := map[*worker.Worker]bool{}
	for range 4 {
		rec := &record.Record{Model: "m"}
		p := f.d.PlanPair(rec, parsed(t, `{"model":"m","messages":[]}`), "/v1/chat/completions", nil)
		if !p.Pair || p.Role != config.RoleDecode {
			t.Fatalf("plan %+v", p)
		}
		c, err := f.d.Choose(ctx, p, "m", nil)
		if err != nil {
			t.Fatal(err)
		}
		if c.Pair.Decode != dec || c.Worker != dec || (c.Pair.Prefill != p1 && c.Pair.Prefill != p2) {
			t.Fatalf("pair %v/%v, worker %v", c.Pair.Prefill, c.Pair.Decode, c.Worker)
		}
		if ws := c.Workers(); len(ws) != 2 || ws[0] != c.Pair.Prefill || ws[1] != dec {
			t.Errorf("workers %v", ws)
		}
		seen[c.Pair.Prefill] = true
		p.NotePair(c.Pair)
		if rec.Mode != pd.ModeSequential || rec.Prefill != c.Pair.Prefill.URL || rec.Decode != dec.URL || rec.Worker != dec.URL {
			t.Errorf("record %+v", rec)
		}
	}
	if len(seen) != 2 {
		t.Errorf("round robin over two prefills chose %d of them", len(seen))
	}
	// The picker named the second prefill: every choice holds to it.
	only, e := f.d.Prefiller([]string{"10.0.0.2:8000"})
	if e != nil {
		t.Fatal(e)
	}
	for range 3 {
		p := f.d.PlanPair(&record.Record{Model: "m"}, parsed(t, `{"model":"m","messages":[]}`), "/v1/chat/completions", only)
		c, err := f.d.Choose(ctx, p, "m", nil)
		if err != nil || c.Pair.Prefill != p2 {
			t.Fatalf("held to 10.0.0.2: chose %v (%v)", c.Pair.Prefill, err)
		}
	}
	// A regular worker serving beside the pairs: requests go to it, not disaggregated.
	if err := f.reg.Add(regular("http://10.0.0.4:8000", "m")); err != nil {
		t.Fatal(err)
	}
	if f.d.Disaggregated() {
		t.Error("a fleet with a regular worker is still disaggregated")
	}
}

// An SGLang pair is served in parallel; the health check chooses a pair of any model, an
// SGLang-only info route a prefill that serves it.
func TestPairModesAndInfoRoutes(t *testing.T) {
	sp := engineWorker("http://p:8000", config.RolePrefill, config.RuntimeSGLang, "m")
	sd := engineWorker("http://d:8000", config.RoleDecode, config.RuntimeSGLang, "m")
	f := newFleet(t, []*worker.Worker{sp, sd}, func(o *Options) { o.PD = true })
	ctx := context.Background()
	pair, err := f.d.HealthPair(ctx)
	if err != nil || pair.Prefill != sp || pair.Decode != sd {
		t.Fatalf("health pair %v/%v: %v", pair.Prefill, pair.Decode, err)
	}
	rec := &record.Record{}
	(&Plan{Rec: rec}).NotePair(pair)
	if rec.Mode != pd.ModeParallel {
		t.Errorf("an SGLang pair's mode is %q", rec.Mode)
	}
	if w, err := f.d.PrefillFor(ctx, "/get_server_info"); err != nil || w != sp {
		t.Errorf("an SGLang prefill for its info route: %v, %v", w, err)
	}
	if !Serves(sp, "/generate") {
		t.Error("an SGLang worker does not serve /generate")
	}
	vp := engineWorker("http://vp:8000", config.RolePrefill, config.RuntimeVLLM, "m")
	vf := newFleet(t, []*worker.Worker{vp}, func(o *Options) { o.PD = true })
	if Serves(vp, "/generate") {
		t.Error("a vLLM worker serves SGLang's /generate")
	}
	_, err = vf.d.PrefillFor(ctx, "/get_server_info")
	if _, a := answerOf(t, SelectionError(err)); a.Status != 501 || a.Code != openai.CodeRouteNotServed {
		t.Errorf("an SGLang route of vLLM prefills: %+v", a)
	}
}

// A decode serving a PD request alone says so on its record, is counted in the handoff metric
// once it ended whole (not as it is planned: a failed one was counted), and is never an SGLang decode (which refuses a request without a bootstrap).
func TestPlanDecodeAlone(t *testing.T) {
	sd := engineWorker("http://sd:8000", config.RoleDecode, config.RuntimeSGLang, "m")
	vd := engineWorker("http://vd:8000", config.RoleDecode, config.RuntimeVLLM, "m")
	f := newFleet(t, []*worker.Worker{sd, vd}, func(o *Options) { o.PD = true })
	if !f.d.DecodeAloneServes() {
		t.Error("a vLLM decode cannot serve alone")
	}
	for i := range 3 {
		rec := &record.Record{Model: "m"}
		p := f.d.PlanDecodeAlone(rec, parsed(t, `{"model":"m","prompt":"x"}`), "/v1/completions")
		c, err := f.d.Choose(context.Background(), p, "m", nil)
		if err != nil || c.Worker != vd {
			t.Fatalf("chose %v: %v", c.Worker, err)
		}
		p.NoteWorker(c.Worker)
		if rec.Handoff != pd.HandoffNoneLocalPrefill || !rec.LocalPrefill || rec.Worker != vd.URL || rec.Decode != vd.URL {
			t.Errorf("record %+v", rec)
		}
		f.d.PDEnded(rec, i != 0, false, 0, time.Second) // the first failed or was cut: not counted
	}
	class := pd.HandoffClass(pd.HandoffNoneLocalPrefill)
	if n := testutil.ToFloat64(f.m.PDHandoffs.WithLabelValues(pd.HandoffNoneLocalPrefill, class, "")); n != 2 || f.d.LocalPrefills() != 2 {
		t.Errorf("%v handoffs counted (status page %d), want 2: planned three, two ended whole", n, f.d.LocalPrefills())
	}
	// SGLang decodes alone: none may serve.
	g := newFleet(t, []*worker.Worker{engineWorker("http://sd:8000", config.RoleDecode, config.RuntimeSGLang, "m")}, func(o *Options) { o.PD = true })
	if g.d.DecodeAloneServes() {
		t.Error("an SGLang decode serves alone")
	}
	p := g.d.PlanDecodeAlone(&record.Record{Model: "m"}, parsed(t, `{"model":"m","prompt":"x"}`), "/v1/completions")
	_, err := g.d.Choose(context.Background(), p, "m", nil)
	if f, a := answerOf(t, err); a.Status != 503 || a.Code != openai.CodeNoAvailableWorkers || !f.NoWorker {
		t.Errorf("only SGLang decodes: %+v", a)
	}
	// A vLLM decode that is not ready serves nothing.
	vd.SetReady(false)
	sd.SetReady(false)
	if f.d.DecodeAloneServes() {
		t.Error("a decode that is not ready serves alone")
	}
}

// An alias is served by its target, on the record; the request's fallbacks take it when its
// model has no available worker, counted — a tenant's only where it may go.
func TestChooseAliasAndFallbacks(t *testing.T) {
	big, small, tiny := regular("http://big:8000", "big"), regular("http://small:8000", "small"), regular("http://tiny:8000", "tiny")
	models := map[string]config.ModelConfig{
		"alias": {Serve: "big"},
		"big":   {Fallbacks: []string{"small-alias", "tiny"}},
		// A fallback may itself be an alias: the workers' name for it is chosen.
		"small-alias": {Serve: "small"},
	}
	f := newFleet(t, []*worker.Worker{big, small, tiny}, withModels(models, ""))
	ctx := context.Background()
	if got := f.d.ModelChain("big"); strings.Join(got, ",") != "big,small,tiny" {
		t.Errorf("chain of big: %v", got)
	}
	if got := f.d.ModelChain("alias"); strings.Join(got, ",") != "big" {
		t.Errorf("chain of alias: %v (an alias has no fallbacks of its own)", got)
	}
	if got := f.d.ModelChain("big", func(m string) bool { return m == "tiny" }); strings.Join(got, ",") != "big,tiny" {
		t.Errorf("chain of big allowing tiny: %v", got)
	}

	p := f.planFor(t, "alias")
	c, err := f.d.Choose(ctx, p, "alias", nil)
	if err != nil || c.Worker != big || p.Rec.Served != "big" || p.Sel.Model != "big" {
		t.Fatalf("alias: %v, served %q (%v)", c.Worker, p.Rec.Served, err)
	}
	if n := testutil.CollectAndCount(f.m.ModelFallbacks); n != 0 {
		t.Errorf("an alias counted as a fallback (%d series)", n)
	}

	big.SetReady(false)
	p = f.planFor(t, "big")
	c, err = f.d.Choose(ctx, p, "big", nil)
	if err != nil || c.Worker != small || p.Rec.Served != "small" {
		t.Fatalf("big down: %v, served %q (%v)", c.Worker, p.Rec.Served, err)
	}
	if n := testutil.ToFloat64(f.m.ModelFallbacks.WithLabelValues("big", "small")); n != 1 {
		t.Errorf("fallback big→small counted %v", n)
	}
	small.SetReady(false)
	p = f.planFor(t, "big")
	if c, err = f.d.Choose(ctx, p, "big", nil); err != nil || c.Worker != tiny || p.Rec.Served != "tiny" {
		t.Fatalf("big and small down: %v, served %q (%v)", c.Worker, p.Rec.Served, err)
	}

	// A tenant that may use big alone gets no fallback: 503, none available.
	cfg := config.Default()
	cfg.Tenants = []config.Tenant{{Name: "team", Keys: []string{config.HashKey("k")}, Models: []string{"big"}}}
	set, err := tenant.Build(cfg, func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	who := set.Identify("k")
	p = f.planFor(t, "big")
	p.Rec.Who = who
	_, err = f.d.Choose(ctx, p, "big", nil)
	if fl, a := answerOf(t, err); a.Status != 503 || a.Code != openai.CodeNoAvailableWorkers || !fl.NoWorker || p.Rec.Served != "" {
		t.Errorf("a tenant without fallbacks: %+v, served %q", a, p.Rec.Served)
	}
	// One that may use tiny too skips small.
	cfg.Tenants[0].Models = []string{"big", "tiny"}
	if set, err = tenant.Build(cfg, func(string) string { return "" }); err != nil {
		t.Fatal(err)
	}
	small.SetReady(true)
	p = f.planFor(t, "big")
	p.Rec.Who = set.Identify("k")
	if c, err = f.d.Choose(ctx, p, "big", nil); err != nil || c.Worker != tiny {
		t.Errorf("a tenant allowed tiny: %v (%v)", c.Worker, err)
	}
}

// A retry avoids the workers that failed it while others are left; once every worker of the
// model failed it, the fallback serves it; with no fallback, one of the failed ones is tried
// again rather than none.
func TestChooseAvoids(t *testing.T) {
	a, b, fb := regular("http://a:8000", "m"), regular("http://b:8000", "m"), regular("http://fb:8000", "fb")
	f := newFleet(t, []*worker.Worker{a, b, fb}, withModels(map[string]config.ModelConfig{"m": {Fallbacks: []string{"fb"}}}, ""))
	ctx := context.Background()
	for range 3 {
		p := f.planFor(t, "m")
		c, err := f.d.Choose(ctx, p, "m", map[string]bool{a.URL: true})
		if err != nil || c.Worker != b || p.Rec.Served != "" {
			t.Fatalf("avoiding a: %v, served %q (%v)", c.Worker, p.Rec.Served, err)
		}
	}
	p := f.planFor(t, "m")
	c, err := f.d.Choose(ctx, p, "m", map[string]bool{a.URL: true, b.URL: true})
	if err != nil || c.Worker != fb || p.Rec.Served != "fb" {
		t.Fatalf("both of m failed: %v, served %q (%v)", c.Worker, p.Rec.Served, err)
	}
	if n := testutil.ToFloat64(f.m.ModelFallbacks.WithLabelValues("m", "fb")); n != 1 {
		t.Errorf("fallback counted %v", n)
	}
	// Without a fallback, a worker that failed is better than none.
	g := newFleet(t, []*worker.Worker{regular("http://a:8000", "m"), regular("http://b:8000", "m")})
	p = g.planFor(t, "m")
	if c, err = g.d.Choose(ctx, p, "m", map[string]bool{"http://a:8000": true, "http://b:8000": true}); err != nil || c.Worker == nil {
		t.Errorf("every worker failed once: %v (%v)", c.Worker, err)
	}
}

// A model no worker serves is 404 model_not_found; one whose workers are all down is 503
// no_available_workers, a failure a retry may mend.
func TestChooseRefusals(t *testing.T) {
	w := regular("http://a:8000", "m")
	f := newFleet(t, []*worker.Worker{w})
	ctx := context.Background()
	p := f.planFor(t, "nope")
	_, err := f.d.Choose(ctx, p, "nope", nil)
	fl, a := answerOf(t, err)
	if a.Status != 404 || a.Code != openai.CodeModelNotFound || a.Param != "model" || fl.Final || fl.NoWorker || !strings.Contains(a.Message, `"nope"`) {
		t.Errorf("unserved: %+v (final %v)", a, fl.Final)
	}
	w.SetReady(false)
	_, err = f.d.Choose(ctx, f.planFor(t, "m"), "m", nil)
	fl, a = answerOf(t, err)
	if a.Status != 503 || a.Code != openai.CodeNoAvailableWorkers || !fl.NoWorker || fl.Final {
		t.Errorf("none ready: %+v", a)
	}
	// An SGLang-only route of vLLM workers is refused for good (501).
	w.SetReady(true)
	p = f.d.PlanRegular(&record.Record{Model: "m"}, parsed(t, `{"model":"m","text":"x"}`), "/generate")
	_, err = f.d.Choose(ctx, p, "m", nil)
	if fl, a = answerOf(t, err); a.Status != 501 || a.Code != openai.CodeRouteNotServed || !fl.Final {
		t.Errorf("/generate on vLLM: %+v", a)
	}
}

// The waiting room holds a request for a known model without a ready worker: a worker made
// ready meanwhile is chosen, and the room is left empty.
func TestWaitingRoomServesWhenReady(t *testing.T) {
	w := regular("http://a:8000", "m")
	w.SetReady(false)
	f := newFleet(t, []*worker.Worker{w}, func(o *Options) { o.Admission.NoWorkerWait = time.Minute })
	waiting := f.m.ModelWaiting.WithLabelValues("m")
	type result struct {
		c   Choice
		err error
	}
	done := make(chan result, 1)
	p := f.planFor(t, "m")
	go func() {
		c, err := f.d.Choose(context.Background(), p, "m", nil)
		done <- result{c, err}
	}()
	waitFor(t, "the request waits", func() bool { return testutil.ToFloat64(waiting) == 1 })
	w.SetReady(true)
	r := <-done
	if r.err != nil || r.c.Worker != w {
		t.Fatalf("after the worker became ready: %v (%v)", r.c.Worker, r.err)
	}
	if n := testutil.ToFloat64(waiting); n != 0 {
		t.Errorf("%v still counted waiting", n)
	}
}

// The waiting room holds a request for a model whose workers all left (scaled to zero) until
// one registers.
func TestWaitingRoomScaleFromZero(t *testing.T) {
	old := regular("http://old:8000", "m")
	f := newFleet(t, []*worker.Worker{old}, func(o *Options) { o.Admission.NoWorkerWait = time.Minute })
	if f.m.Model("m") != "m" { // requests for m were counted: Baton knows it
		t.Fatal("m is not known")
	}
	f.reg.Remove(old)
	done := make(chan error, 1)
	var chosen *worker.Worker
	p := f.planFor(t, "m")
	go func() {
		c, err := f.d.Choose(context.Background(), p, "m", nil)
		chosen = c.Worker
		done <- err
	}()
	waitFor(t, "the request waits", func() bool { return testutil.ToFloat64(f.m.ModelWaiting.WithLabelValues("m")) == 1 })
	fresh := regular("http://new:8000", "m")
	if err := f.reg.Add(fresh); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || chosen != fresh {
		t.Fatalf("after a worker registered: %v (%v)", chosen, err)
	}
}

// A client that leaves the waiting room, or a wait that passes, gets the refusal the selection
// found; a model Baton does not know is never held.
func TestWaitingRoomGivesUp(t *testing.T) {
	w := regular("http://a:8000", "m")
	w.SetReady(false)
	f := newFleet(t, []*worker.Worker{w}, func(o *Options) { o.Admission.NoWorkerWait = time.Minute })
	waiting := f.m.ModelWaiting.WithLabelValues("m")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := f.d.Choose(ctx, f.planFor(t, "m"), "m", nil)
		done <- err
	}()
	waitFor(t, "the request waits", func() bool { return testutil.ToFloat64(waiting) == 1 })
	cancel()
	if _, a := answerOf(t, <-done); a.Status != 503 || a.Code != openai.CodeNoAvailableWorkers {
		t.Errorf("the client left: %+v", a)
	}
	if n := testutil.ToFloat64(waiting); n != 0 {
		t.Errorf("%v still counted waiting", n)
	}
	if w.Ready() {
		t.Fatal("the worker became ready")
	}

	// A short wait passes with no worker ready.
	g := newFleet(t, []*worker.Worker{w}, func(o *Options) { o.Admission.NoWorkerWait = 20 * time.Millisecond })
	_, err := g.d.Choose(context.Background(), g.planFor(t, "m"), "m", nil)
	if _, a := answerOf(t, err); a.Status != 503 || a.Code != openai.CodeNoAvailableWorkers {
		t.Errorf("the wait passed: %+v", a)
	}
	if n := testutil.ToFloat64(g.m.ModelWaiting.WithLabelValues("m")); n != 0 {
		t.Errorf("%v still counted waiting", n)
	}

	// A model no worker lists and no request counted: 404 at once, never held.
	h := newFleet(t, []*worker.Worker{regular("http://a:8000", "m")}, func(o *Options) { o.Admission.NoWorkerWait = time.Minute })
	_, err = h.d.Choose(context.Background(), h.planFor(t, "ghost"), "ghost", nil)
	if _, a := answerOf(t, err); a.Status != 404 || a.Code != openai.CodeModelNotFound {
		t.Errorf("an unknown model: %+v", a)
	}
	if n := testutil.CollectAndCount(h.m.ModelWaiting); n != 0 {
		t.Errorf("an unknown model was held (%d series)", n)
	}
}

// contextRefusal is an engine's refusal of a prompt longer than its model's context.
func contextRefusal(worker string) error {
	return &outcome.Failure{Worker: worker, Status: 400, Body: []byte(`{"message":"This model's maximum context length is 4096 tokens. However, you requested 9000 tokens."}`)}
}

// A prompt too long for the model moves to its context_window_fallbacks in turn, each chosen
// and counted, the record cleared between; the last refusal is the client's; any other
// answer ends it.
func TestContextFallbacks(t *testing.T) {
	m, long, xl := regular("http://m:8000", "m"), regular("http://long:8000", "m-long"), regular("http://xl:8000", "m-xl")
	models := map[string]config.ModelConfig{"m": {ContextWindowFallbacks: []string{"m-long", "m-xl"}}}
	f := newFleet(t, []*worker.Worker{m, long, xl}, withModels(models, ""))
	ctx := context.Background()
	type call struct {
		name         string
		fallbackLeft bool
		worker       string
	}
	run := func(rec *record.Record, answer func(name string) error) ([]call, error) {
		var calls []call
		p := f.d.PlanRegular(rec, parsed(t, `{"model":"`+rec.Model+`","prompt":"a long one"}`), "/v1/completions")
		err := f.d.ContextFallbacks(rec, rec.Model, func(name string, left bool) error {
			if rec.Worker != "" {
				t.Errorf("attempt %s: the record still names %s", name, rec.Worker)
			}
			c, err := f.d.Choose(ctx, p, name, nil)
			if err != nil {
				return err
			}
			p.NoteWorker(c.Worker)
			calls = append(calls, call{name, left, c.Worker.URL})
			return answer(name)
		})
		return calls, err
	}
	rec := &record.Record{Model: "m"}
	calls, err := run(rec, func(name string) error {
		if name == "m-xl" {
			return nil
		}
		return contextRefusal(name)
	})
	want := []call{{"m", true, m.URL}, {"m-long", true, long.URL}, {"m-xl", false, xl.URL}}
	if err != nil || len(calls) != 3 || calls[0] != want[0] || calls[1] != want[1] || calls[2] != want[2] {
		t.Fatalf("calls %v (%v), want %v", calls, err, want)
	}
	if rec.Served != "m-xl" || rec.Worker != xl.URL {
		t.Errorf("record %+v", rec)
	}
	if a, b := testutil.ToFloat64(f.m.ModelFallbacks.WithLabelValues("m", "m-long")), testutil.ToFloat64(f.m.ModelFallbacks.WithLabelValues("m", "m-xl")); a != 1 || b != 1 {
		t.Errorf("context fallbacks counted %v and %v", a, b)
	}

	// Every model too short: the last refusal is the client's, as the engine said it.
	calls, err = run(&record.Record{Model: "m"}, func(name string) error { return contextRefusal(name) })
	if len(calls) != 3 || !contextOverflow(err) {
		t.Errorf("all too short: %d calls, %v", len(calls), err)
	}
	// Another refusal (not the context) ends the chain at once.
	other := &outcome.Failure{Status: 400, Body: []byte(`{"message":"temperature must be positive"}`)}
	calls, err = run(&record.Record{Model: "m"}, func(string) error { return other })
	if len(calls) != 1 || err != other || !calls[0].fallbackLeft {
		t.Errorf("another refusal: %v, %v", calls, err)
	}

	// A tenant that may use m and m-xl skips m-long.
	cfg := config.Default()
	cfg.Tenants = []config.Tenant{{Name: "team", Keys: []string{config.HashKey("k")}, Models: []string{"m", "m-xl"}}}
	set, err := tenant.Build(cfg, func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	rec = &record.Record{Model: "m", Who: set.Identify("k")}
	calls, err = run(rec, func(name string) error {
		if name == "m" {
			return contextRefusal(m.URL)
		}
		return nil
	})
	if err != nil || len(calls) != 2 || calls[0] != (call{"m", true, m.URL}) || calls[1] != (call{"m-xl", false, xl.URL}) {
		t.Errorf("a tenant without m-long: %v (%v)", calls, err)
	}
	// A tenant allowed none: no fallback is left, the refusal is read as it is.
	cfg.Tenants[0].Models = []string{"m"}
	if set, err = tenant.Build(cfg, func(string) string { return "" }); err != nil {
		t.Fatal(err)
	}
	calls, err = run(&record.Record{Model: "m", Who: set.Identify("k")}, func(string) error { return contextRefusal(m.URL) })
	if len(calls) != 1 || calls[0].fallbackLeft || !contextOverflow(err) {
		t.Errorf("a tenant allowed no fallback: %v, %v", calls, err)
	}
	// A model without context fallbacks: one attempt, its refusal read as it is.
	calls, err = run(&record.Record{Model: "m-long"}, func(string) error { return contextRefusal(long.URL) })
	if len(calls) != 1 || calls[0] != (call{"m-long", false, long.URL}) || !contextOverflow(err) {
		t.Errorf("no context fallbacks configured: %v, %v", calls, err)
	}
}

// The routes as served: PD routes through pairs only where the fleet runs PD.
func TestRoutes(t *testing.T) {
	pdRoutes := map[string]bool{"/v1/chat/completions": true, "/v1/completions": true, "/v1/responses": true, "/v1/messages": true, "/generate": true}
	for _, on := range []bool{false, true} {
		f := newFleet(t, nil, func(o *Options) { o.PD = on })
		rs := f.d.Routes()
		if len(rs) != 8 {
			t.Errorf("PD %v: %d routes: %v", on, len(rs), rs)
		}
		for _, r := range rs {
			if r.PD != (on && pdRoutes[r.Path]) {
				t.Errorf("PD %v: %s served through pairs: %v", on, r.Path, r.PD)
			}
		}
	}
}

// Retries: the number of tries allowed, none past the first when disabled; the backoff ends
// with the client.
func TestTriesAndBackoff(t *testing.T) {
	f := newFleet(t, nil)
	if !f.d.TriesLeft(1) || !f.d.TriesLeft(2) || f.d.TriesLeft(3) {
		t.Error("max_retries 3: want tries 1 and 2 followed by another, 3 not")
	}
	g := newFleet(t, nil, func(o *Options) { o.Retry.Disable = true })
	if g.d.TriesLeft(1) {
		t.Error("retries disabled, and a second try is left")
	}
	if !f.d.Backoff(context.Background(), 1) {
		t.Error("a backoff of a millisecond did not end")
	}
	slow := newFleet(t, nil, func(o *Options) { o.Retry.InitialBackoff, o.Retry.MaxBackoff = time.Hour, time.Hour })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if slow.d.Backoff(ctx, 1) {
		t.Error("a backoff outlived its client")
	}
}
