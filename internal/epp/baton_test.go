package epp

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/trace"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/worker"
)

// host is a gateway a test picker counts its requests in: in flight, finished, their records.
type host struct {
	mu       sync.Mutex
	inFlight int
	finished []*record.Record
	bg       sync.WaitGroup
}

func (h *host) Begin() { h.mu.Lock(); h.inFlight++; h.mu.Unlock() }
func (h *host) Finish(_ context.Context, rec *record.Record, _ int64, status int, _ trace.Span, _ bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.inFlight--
	h.finished = append(h.finished, rec)
}
func (h *host) Go(f func()) { h.bg.Go(f) }
func (h *host) InFlight() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.inFlight
}

// pickerFleet is a director over three ready vLLM workers of "m", models its configuration's,
// and its picker counting in a test host.
func pickerFleet(t *testing.T, models map[string]config.ModelConfig) (*host, Picker, []*worker.Worker) {
	t.Helper()
	var ws []*worker.Worker
	for _, u := range []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"} {
		w := worker.New(config.Worker{URL: u, Runtime: config.RuntimeVLLM, Models: []string{"m"}})
		w.SetInfo(&worker.Info{Runtime: config.RuntimeVLLM, Models: []worker.Model{{ID: "m"}}})
		w.SetReady(true)
		ws = append(ws, w)
	}
	reg := worker.NewRegistry(ws...)
	m := metrics.New(reg)
	rr, err := policy.New(config.PolicyRoundRobin, config.Default())
	if err != nil {
		t.Fatal(err)
	}
	d := director.New(director.Options{Registry: reg, Metrics: m, MaxBatchSize: 8,
		Selector: &policy.Selector{Registry: reg, Policies: map[string]policy.Policy{config.RoleRegular: rr}},
		Models:   func() (map[string]config.ModelConfig, string) { return models, "" }})
	h := &host{}
	return h, NewPicker(d, m, h, Options{Fallbacks: 2}), ws
}

// The picker's answers without a proxy behind it: the choice and its fallbacks (other available
// workers of the model), an alias's body renamed for the workers, the request counted in flight
// until Done, the served fallback taking the count over; and its refusals, each with its status
// and code.
func TestPickerChoosesAndRefuses(t *testing.T) {
	s, p, ws := pickerFleet(t, map[string]config.ModelConfig{"alias": {Serve: "m"}})
	byEndpoint := map[string]*worker.Worker{}
	for _, w := range ws {
		byEndpoint[w.Endpoint] = w
	}
	pick, err := p.Pick(context.Background(), &Request{Method: http.MethodPost, Path: "/v1/completions", Header: http.Header{},
		Body: []byte(`{"model":"alias","prompt":"x"}`)})
	if err != nil {
		t.Fatal(err)
	}
	if len(pick.Endpoints) != 3 || byEndpoint[pick.Endpoints[0]] == nil || string(pick.Body) != `{"model":"m","prompt":"x"}` {
		t.Fatalf("pick %v, body %s", pick.Endpoints, pick.Body)
	}
	chosen, fallback := byEndpoint[pick.Endpoints[0]], byEndpoint[pick.Endpoints[1]]
	if chosen.InFlight() != 1 || s.InFlight() != 1 {
		t.Fatalf("in flight: worker %d, server %d", chosen.InFlight(), s.InFlight())
	}
	pick.Served(fallback.Endpoint)
	if chosen.InFlight() != 0 || fallback.InFlight() != 1 {
		t.Fatalf("after the fallback served: %d, %d", chosen.InFlight(), fallback.InFlight())
	}
	pick.Done(Outcome{Status: 200})
	if fallback.InFlight() != 0 || s.InFlight() != 0 {
		t.Fatalf("after Done: %d, %d", fallback.InFlight(), s.InFlight())
	}

	// A subset hint keeps the choice and its fallbacks within it.
	pick, err = p.Pick(context.Background(), &Request{Method: http.MethodPost, Path: "/v1/completions", Header: http.Header{},
		Body: []byte(`{"model":"m","prompt":"x"}`), HasSubset: true, Subset: []string{ws[2].Endpoint}})
	if err != nil || !slices.Equal(pick.Endpoints, []string{ws[2].Endpoint}) {
		t.Fatalf("a subset of one: %v %v (the choice and every fallback within it)", pick, err)
	}
	pick.Done(Outcome{Status: 200})

	for _, c := range []struct {
		name   string
		req    *Request
		status int
		code   string
	}{
		{"no path", &Request{Method: http.MethodPost}, 400, openai.CodeInvalidRequest},
		{"bad JSON", &Request{Method: http.MethodPost, Path: "/v1/completions", Body: []byte(`{"model":`)}, 400, openai.CodeInvalidJSON},
		{"a model nobody serves", &Request{Method: http.MethodPost, Path: "/v1/completions", Body: []byte(`{"model":"nope","prompt":"x"}`)}, 404, openai.CodeModelNotFound},
		{"an unknown priority", &Request{Method: http.MethodPost, Path: "/v1/completions", Header: http.Header{"X-Baton-Priority": {"urgent!"}},
			Body: []byte(`{"model":"m","prompt":"x"}`)}, 400, openai.CodeInvalidPriority},
		{"an empty subset", &Request{Method: http.MethodPost, Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":"x"}`), HasSubset: true}, 503, openai.CodeNoEndpointInSubset},
		{"a subset of no worker", &Request{Method: http.MethodPost, Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":"x"}`),
			HasSubset: true, Subset: []string{"192.0.2.9:8000"}}, 503, openai.CodeNoEndpointInSubset},
	} {
		if c.req.Header == nil {
			c.req.Header = http.Header{}
		}
		_, err := p.Pick(context.Background(), c.req)
		e, ok := errors.AsType[*openai.Error](err)
		if !ok || e.Status != c.status || e.Code != c.code {
			t.Errorf("%s: %v, want %d %s", c.name, err, c.status, c.code)
		}
	}
	if s.InFlight() != 0 {
		t.Errorf("refusals left %d in flight", s.InFlight())
	}
	// Each pick and each refusal was reported once, as the gateway reports its own requests.
	if len(s.finished) != 7 { // a request without a path is no request to report
		t.Fatalf("%d requests reported, want 7", len(s.finished))
	}
	for _, rec := range s.finished[2:] {
		if rec.Code == "" || rec.Method != http.MethodPost || rec.RequestID == "" {
			t.Errorf("a refusal reported as %+v", rec)
		}
	}
	for _, w := range ws {
		w.SetReady(false)
	}
	_, err = p.Pick(context.Background(), &Request{Method: http.MethodPost, Path: "/v1/completions", Header: http.Header{}, Body: []byte(`{"model":"m","prompt":"x"}`)})
	if e, ok := errors.AsType[*openai.Error](err); !ok || e.Status != 503 || e.Code != openai.CodeNoAvailableWorkers {
		t.Errorf("no ready worker: %v", err)
	}
}

// In PD mode a subset hint naming only a vLLM decode gets that decode, which serves alone (no
// x-prefiller-host-port), as llm-d's picker answers; a hint naming a prefill too gets the pair;
// a hint naming only an SGLang decode, which cannot serve without a prefill, is the protocol's
// 503.
func TestPickerSubsetOfADecodeInPDMode(t *testing.T) {
	var ws []*worker.Worker
	for _, c := range []config.Worker{
		{URL: "http://10.0.0.1:8000", Role: config.RolePrefill, Runtime: config.RuntimeVLLM},
		{URL: "http://10.0.0.2:8000", Role: config.RoleDecode, Runtime: config.RuntimeVLLM},
		{URL: "http://10.0.0.3:8000", Role: config.RoleDecode, Runtime: config.RuntimeSGLang},
	} {
		c.Models = []string{"m"}
		w := worker.New(c)
		w.SetInfo(&worker.Info{Runtime: c.Runtime, Models: []worker.Model{{ID: "m"}}})
		w.SetReady(true)
		ws = append(ws, w)
	}
	prefill, decode, sglang := ws[0], ws[1], ws[2]
	reg := worker.NewRegistry(ws...)
	m := metrics.New(reg)
	policies := map[string]policy.Policy{}
	for _, role := range []string{config.RolePrefill, config.RoleDecode} {
		rr, err := policy.New(config.PolicyRoundRobin, config.Default())
		if err != nil {
			t.Fatal(err)
		}
		policies[role] = rr
	}
	d := director.New(director.Options{Registry: reg, Metrics: m, MaxBatchSize: 8, PD: true,
		Selector: &policy.Selector{Registry: reg, Policies: policies},
		Models:   func() (map[string]config.ModelConfig, string) { return nil, "" }})
	h := &host{}
	p := NewPicker(d, m, h, Options{Fallbacks: 2})
	ask := func(subset ...string) (*Pick, error) {
		return p.Pick(context.Background(), &Request{Method: http.MethodPost, Path: "/v1/completions", Header: http.Header{},
			Body: []byte(`{"model":"m","prompt":"x"}`), HasSubset: true, Subset: subset})
	}
	for _, c := range []struct {
		name        string
		subset      []string
		dest, pfill string
	}{
		{"the vLLM decode alone", []string{decode.Endpoint}, decode.Endpoint, ""},
		{"the decode and the prefill", []string{decode.Endpoint, prefill.Endpoint}, decode.Endpoint, prefill.Endpoint},
	} {
		pick, err := ask(c.subset...)
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if !slices.Equal(pick.Endpoints, []string{c.dest}) || pick.Prefill != c.pfill {
			t.Errorf("%s: endpoints %v, prefill %q; want [%s], %q", c.name, pick.Endpoints, pick.Prefill, c.dest, c.pfill)
		}
		pick.Done(Outcome{Status: 200})
	}
	_, err := ask(sglang.Endpoint)
	if e, ok := errors.AsType[*openai.Error](err); !ok || e.Status != 503 || e.Code != openai.CodeNoEndpointInSubset {
		t.Errorf("the SGLang decode alone: %v, want 503 %s", err, openai.CodeNoEndpointInSubset)
	}
	if h.InFlight() != 0 {
		t.Errorf("%d left in flight", h.InFlight())
	}
}
