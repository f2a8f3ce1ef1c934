package server

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/epp"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/worker"
)

// pickerFleet is the test gateway over three ready vLLM workers of "m", models its
// configuration's, and its picker.
func pickerFleet(t *testing.T, models map[string]config.ModelConfig) (*Server, epp.Picker, []*worker.Worker) {
	t.Helper()
	s, _, ws := gateway(t, []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"}, func(o *Options) {
		o.Models = func() (map[string]config.ModelConfig, string) { return models, "" }
	})
	return s, s.EndpointPicker(EPPOptions{Fallbacks: 2}), ws
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
	pick, err := p.Pick(context.Background(), &epp.Request{Method: http.MethodPost, Path: "/v1/completions", Header: http.Header{},
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
	pick.Done(epp.Outcome{Status: 200})
	if fallback.InFlight() != 0 || s.InFlight() != 0 {
		t.Fatalf("after Done: %d, %d", fallback.InFlight(), s.InFlight())
	}

	// A subset hint keeps the choice and its fallbacks within it.
	pick, err = p.Pick(context.Background(), &epp.Request{Method: http.MethodPost, Path: "/v1/completions", Header: http.Header{},
		Body: []byte(`{"model":"m","prompt":"x"}`), HasSubset: true, Subset: []string{ws[2].Endpoint}})
	if err != nil || !slices.Equal(pick.Endpoints, []string{ws[2].Endpoint}) {
		t.Fatalf("a subset of one: %v %v (the choice and every fallback within it)", pick, err)
	}
	pick.Done(epp.Outcome{Status: 200})

	for _, c := range []struct {
		name   string
		req    *epp.Request
		status int
		code   string
	}{
		{"no path", &epp.Request{Method: http.MethodPost}, 400, openai.CodeInvalidRequest},
		{"bad JSON", &epp.Request{Method: http.MethodPost, Path: "/v1/completions", Body: []byte(`{"model":`)}, 400, openai.CodeInvalidJSON},
		{"a model nobody serves", &epp.Request{Method: http.MethodPost, Path: "/v1/completions", Body: []byte(`{"model":"nope","prompt":"x"}`)}, 404, openai.CodeModelNotFound},
		{"an unknown priority", &epp.Request{Method: http.MethodPost, Path: "/v1/completions", Header: http.Header{"X-Baton-Priority": {"urgent!"}},
			Body: []byte(`{"model":"m","prompt":"x"}`)}, 400, openai.CodeInvalidPriority},
		{"an empty subset", &epp.Request{Method: http.MethodPost, Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":"x"}`), HasSubset: true}, 503, openai.CodeNoEndpointInSubset},
		{"a subset of no worker", &epp.Request{Method: http.MethodPost, Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":"x"}`),
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
	for _, w := range ws {
		w.SetReady(false)
	}
	_, err = p.Pick(context.Background(), &epp.Request{Method: http.MethodPost, Path: "/v1/completions", Header: http.Header{}, Body: []byte(`{"model":"m","prompt":"x"}`)})
	if e, ok := errors.AsType[*openai.Error](err); !ok || e.Status != 503 || e.Code != openai.CodeNoAvailableWorkers {
		t.Errorf("no ready worker: %v", err)
	}
}
