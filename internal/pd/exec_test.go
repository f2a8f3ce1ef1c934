package pd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

const model = "m"

// pdFixture is a prefill and a decode engine (simulated), their workers, and a Dispatcher over
// them built as the gateway builds it.
type pdFixture struct {
	p, d *sim.Engine
	pair worker.Pair
	x    *Dispatcher
	par  *Parallel
	m    *metrics.Metrics
	logs *logBuffer
}

// logBuffer is a log's output, written from the legs' goroutines.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func engine(t *testing.T, c sim.Config) *sim.Engine {
	t.Helper()
	c.Model = model
	if c.BootstrapTimeout == 0 {
		c.BootstrapTimeout = 30 * time.Second
	}
	e, err := sim.Start(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e
}

// newPD starts the pair: engine "vllm" with connector (nixl, mooncake) or "sglang".
func newPD(t *testing.T, eng, connector string, pc, dc sim.Config) *pdFixture {
	t.Helper()
	return newPDOver(t, "net", eng, connector, pc, dc)
}

// newPDOver is newPD with the upstream client named (net or baton).
func newPDOver(t *testing.T, client, eng, connector string, pc, dc sim.Config) *pdFixture {
	t.Helper()
	pc.Engine, pc.Role, pc.KVConnector, pc.EngineID = eng, sim.RolePrefill, connector, "p"
	dc.Engine, dc.Role, dc.EngineID = eng, sim.RoleDecode, "d"
	if dc.KVConnector == "" {
		dc.KVConnector = connector
	}
	f := &pdFixture{p: engine(t, pc), d: engine(t, dc)}
	pw := config.Worker{URL: f.p.URL(), Role: config.RolePrefill, Runtime: eng, Models: []string{model}, KVEngineID: "p"}
	if eng == config.RuntimeVLLM {
		pw.KVConnector = connector
	}
	if port := f.p.BootstrapPort(); port != 0 { // SGLang's bootstrap server, Mooncake's KV side
		pw.BootstrapPort = &port
	}
	f.pair = worker.Pair{Prefill: worker.New(pw),
		Decode: worker.New(config.Worker{URL: f.d.URL(), Role: config.RoleDecode, Runtime: eng, Models: []string{model}, KVEngineID: "d"})}
	f.m = metrics.New(worker.NewRegistry(f.pair.Prefill, f.pair.Decode))
	tr := proxy.NewTransport(client)
	t.Cleanup(func() { proxy.CloseIdle(tr, "") })
	f.logs = &logBuffer{}
	log := slog.New(slog.NewTextHandler(f.logs, nil))
	px := &proxy.Proxy{Transport: tr, Timeout: 20 * time.Second, Metrics: f.m, Log: log, ExtraHeaders: []string{sim.HeaderFault}}
	par := &Parallel{Proxy: px, Metrics: f.m, Log: log}
	f.par, f.x = par, &Dispatcher{Parallel: par, Sequential: &Sequential{Proxy: px, Metrics: f.m, Log: log, MooncakeConcurrent: true, Concurrent: par}}
	t.Cleanup(par.Wait)
	return f
}

// run sends one request through the pair; fault, when set, is the X-Sim-Fault the engines see.
func (f *pdFixture) run(t *testing.T, path, body, fault string) (*httptest.ResponseRecorder, *record.Record, *Request, error) {
	t.Helper()
	req, err := openai.ParseRequest([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	preq := &Request{Request: req, Path: path}
	preq.Batch, preq.Samples = BatchSize(preq, 1024), SamplesOf(preq)
	rec := &record.Record{}
	preq.Rec = rec
	in := httptest.NewRequestWithContext(context.Background(), http.MethodPost, path, strings.NewReader(body))
	if fault != "" {
		in.Header.Set(sim.HeaderFault, fault)
	}
	rw := httptest.NewRecorder()
	err = f.x.Execute(rw, in, preq, f.pair)
	return rw, rec, preq, err
}

// Every strategy, whole and streamed, over both upstream clients (Baton's lends its buffer's
// views to the relay and the event reader): the answer is the decode's, the handoff it names is
// the one that happened (the decode received the KV), the usage on the record is the client's —
// prompt and cached tokens as the prefill saw them — and each leg counts on its own worker.
func TestEveryStrategyHandsOff(t *testing.T) {
	for _, client := range []string{"net", "baton"} {
		t.Run(client, func(t *testing.T) { everyStrategy(t, client) })
	}
}

func everyStrategy(t *testing.T, client string) {
	for _, c := range []struct {
		eng, connector, handoff, path, body string
	}{
		{config.RuntimeVLLM, sim.ConnectorNixl, HandoffNixl, "/v1/completions", `{"model":"m","prompt":"the quick brown fox","max_tokens":4}`},
		{config.RuntimeVLLM, sim.ConnectorNixl, HandoffNixl, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi there"}],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`},
		{config.RuntimeVLLM, sim.ConnectorMooncake, HandoffMooncake, "/v1/completions", `{"model":"m","prompt":"the quick brown fox","max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`},
		{config.RuntimeVLLM, sim.ConnectorMooncake, HandoffMooncake, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3}`},
		{config.RuntimeSGLang, "", HandoffBootstrap, "/generate", `{"text":"the quick brown fox","sampling_params":{"max_new_tokens":4}}`},
		{config.RuntimeSGLang, "", HandoffBootstrap, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`},
	} {
		t.Run(c.eng+"/"+c.connector+c.path, func(t *testing.T) {
			f := newPDOver(t, client, c.eng, c.connector, sim.Config{}, sim.Config{})
			rw, rec, preq, err := f.run(t, c.path, c.body, "")
			if err != nil {
				t.Fatalf("Execute: %v", err)
			}
			if strings.Contains(c.body, `"stream":true`) && (!strings.HasSuffix(rw.Body.String(), "data: [DONE]\n\n") || strings.Count(rw.Body.String(), "data: ") < 3) {
				t.Errorf("the stream was not relayed whole: %q", rw.Body.String())
			}
			if rw.Code != 200 || string(rec.Handoff) != c.handoff {
				t.Fatalf("%d, handoff %q (want %q): %s", rw.Code, rec.Handoff, c.handoff, rw.Body.String())
			}
			if c.eng == config.RuntimeVLLM && preq.Consumed != VerdictReceived {
				t.Errorf("the decode's usage says %q of the handoff", preq.Consumed)
			}
			if c.path != "/generate" && (!rec.UsageKnown || rec.Usage.Prompt == 0) {
				t.Errorf("usage on the record %+v (known %v): %s", rec.Usage, rec.UsageKnown, rw.Body.String())
			}
			if c.path != "/generate" && rec.Usage.Cached != 0 {
				t.Errorf("the transferred prompt reported as cached to the client: %+v", rec.Usage)
			}
			f.par.Wait()
			for _, w := range []*worker.Worker{f.pair.Prefill, f.pair.Decode} {
				if ok, failed := w.Outcomes(); ok != 1 || failed != 0 || w.InFlight() != 0 {
					t.Errorf("%s: outcomes %d/%d, in flight %d", w, ok, failed, w.InFlight())
				}
			}
			if n := testutil.ToFloat64(f.m.PDHandoffs.WithLabelValues(c.handoff, HandoffClass(c.handoff), ConnectorFor(f.pair.Prefill, "").Mode)); c.eng == config.RuntimeVLLM && n != 1 {
				t.Errorf("handoffs counted %v", n)
			}
		})
	}
}

// A failing leg is the client's answer with that leg's status and a code naming it; the other
// leg is not blamed, and a request that asks for n>1 is decoded alone (no handoff can serve it).
func TestLegFailures(t *testing.T) {
	for _, c := range []struct {
		name, eng, connector string
		status               int
		blamed               string // the leg that fails: prefill or decode
	}{
		{"vLLM prefill 500", config.RuntimeVLLM, sim.ConnectorNixl, 500, LegPrefill},
		{"vLLM decode 503", config.RuntimeVLLM, sim.ConnectorNixl, 503, LegDecode},
		{"SGLang prefill 500", config.RuntimeSGLang, "", 500, LegPrefill},
		{"SGLang decode 502", config.RuntimeSGLang, "", 502, LegDecode},
	} {
		t.Run(c.name, func(t *testing.T) {
			var pc, dc sim.Config
			if c.blamed == LegPrefill {
				pc.Faults.Status = c.status
			} else {
				dc.Faults.Status = c.status
			}
			f := newPD(t, c.eng, c.connector, pc, dc)
			_, rec, _, err := f.run(t, "/v1/completions", `{"model":"m","prompt":"hello","max_tokens":2}`, "")
			var fl *outcome.Failure
			if !errors.As(err, &fl) || fl.ClientStatus() != c.status || fl.Answer == nil || fl.Answer.Code != c.blamed+"_"+openai.CodeUpstreamError || fl.Leg != c.blamed {
				t.Fatalf("Execute = %v (%+v)", err, fl)
			}
			if rec.Handoff != HandoffNoneFailed {
				t.Errorf("handoff %q, want %q", rec.Handoff, HandoffNoneFailed)
			}
			f.par.Wait()
			other := f.pair.Decode
			if c.blamed == LegDecode {
				other = f.pair.Prefill
			}
			if _, failed := other.Outcomes(); failed != 0 {
				t.Errorf("the %s leg's failure counted against %s", c.blamed, other)
			}
			// The log line says what failed, with no empty fields (err=<nil>).
			if logs := f.logs.String(); !strings.Contains(logs, fmt.Sprintf("status=%d", c.status)) || strings.Contains(logs, "<nil>") {
				t.Errorf("log:\n%s", logs)
			}
		})
	}
	t.Run("n>1 is decoded alone", func(t *testing.T) {
		f := newPD(t, config.RuntimeVLLM, sim.ConnectorNixl, sim.Config{}, sim.Config{})
		rw, rec, _, err := f.run(t, "/v1/completions", `{"model":"m","prompt":"hello","max_tokens":2,"n":2}`, "")
		if err != nil || rw.Code != 200 || rec.Handoff != HandoffNoneN {
			t.Fatalf("%v %d handoff %q", err, rw.Code, rec.Handoff)
		}
		if ok, _ := f.pair.Prefill.Outcomes(); ok != 0 {
			t.Error("the prefill was sent a request no handoff can serve")
		}
	})
}

// A decode that recomputes the prompt it was handed the KV of (here its connector reads none
// of the prefill's params) is named — on the record, so in the header of a whole answer, and
// in the metric — for streams too; strict mode refuses a request no handoff can serve with a
// final 502, the prefill never sent.
func TestRecomputeIsNeverSilent(t *testing.T) {
	f := newPD(t, config.RuntimeVLLM, sim.ConnectorNixl, sim.Config{}, sim.Config{KVConnector: sim.ConnectorMooncake})
	rw, rec, preq, err := f.run(t, "/v1/completions", `{"model":"m","prompt":"computed again after all","max_tokens":2}`, "")
	if err != nil || rw.Code != 200 || rec.Handoff != HandoffRecomputed || preq.Consumed != VerdictRecomputed {
		t.Fatalf("%v %d: handoff %q, consumed %q", err, rw.Code, rec.Handoff, preq.Consumed)
	}
	_, rec, _, err = f.run(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"again"}],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}`, "")
	if err != nil || rec.Handoff != HandoffRecomputed {
		t.Fatalf("stream: %v, handoff %q", err, rec.Handoff)
	}
	if n := testutil.ToFloat64(f.m.PDHandoffs.WithLabelValues(HandoffRecomputed, HandoffClass(HandoffRecomputed), ModeNixl)); n != 2 {
		t.Errorf("recomputes counted %v, want 2", n)
	}

	f.x.Sequential.(*Sequential).RequireHandoff = true
	_, rec, _, err = f.run(t, "/v1/completions", `{"model":"m","prompt":"x","max_tokens":2,"n":3}`, "")
	var fl *outcome.Failure
	if !errors.As(err, &fl) || fl.ClientStatus() != 502 || fl.Answer.Code != openai.CodeKVHandoffUnavailable || fl.Verdict().Retryable {
		t.Fatalf("strict n>1: %v", err)
	}
	if rec.Handoff != HandoffNoneN {
		t.Errorf("strict n>1: handoff %q", rec.Handoff)
	}
}
