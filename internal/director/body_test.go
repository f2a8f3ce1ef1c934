package director

import (
	"errors"
	"fmt"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/worker"
)

func runtimeWorker(runtime, url string) *worker.Worker {
	w := worker.New(config.Worker{URL: url})
	w.SetInfo(&worker.Info{Runtime: runtime, Models: []worker.Model{{ID: "base"}}})
	return w
}

// The body each kind of worker takes for an adapter's request: vLLM the adapter as model;
// SGLang base:adapter and lora_path (the client's own replaced), on /generate lora_path alone;
// a pair of mixed runtimes the adapter's own name; a base request untouched.
func TestBodiesForWorkers(t *testing.T) {
	v, sg := runtimeWorker(config.RuntimeVLLM, "http://v"), runtimeWorker(config.RuntimeSGLang, "http://s")
	adapter := &policy.Request{Model: "sql", AdapterBase: "base"}
	base := &policy.Request{Model: "base"}
	for _, c := range []struct {
		path, body, client string
		sreq               *policy.Request
		ws                 []*worker.Worker
		want               string
	}{
		{"/v1/completions", `{"model":"sql","x":1}`, "sql", adapter, []*worker.Worker{v}, `{"model":"sql","x":1}`},
		{"/v1/completions", `{"model":"sql","x":1}`, "sql", adapter, []*worker.Worker{sg}, `{"model":"base:sql","x":1,"lora_path":"sql"}`},
		{"/v1/completions", `{"model":"sql","lora_path":null}`, "sql", adapter, []*worker.Worker{sg, sg}, `{"model":"base:sql","lora_path":"sql"}`},
		{"/generate", `{"text":"x","lora_path":["sql"]}`, "sql", adapter, []*worker.Worker{sg}, `{"text":"x","lora_path":"sql"}`},
		{"/v1/completions", `{"model":"sql"}`, "sql", adapter, []*worker.Worker{v, sg}, `{"model":"sql"}`},
		{"/v1/completions", `{"model":"base","lora_path":null}`, "base", base, []*worker.Worker{sg}, `{"model":"base","lora_path":null}`},
		{"/v1/completions", `{"model":"alias"}`, "alias", base, []*worker.Worker{v}, `{"model":"base"}`},
	} {
		if got := string(ForWorkers([]byte(c.body), c.path, c.client, "", c.sreq, c.ws...)); got != c.want {
			t.Errorf("%s %s to %v: %s, want %s", c.path, c.body, c.ws, got, c.want)
		}
	}
}

// Which engine answers say the adapter is gone, on a regular request and on a PD leg; which
// say the prompt is too long for the model.
func TestEngineRefusalsRead(t *testing.T) {
	held := func(status int, body string) error {
		return fmt.Errorf("attempt: %w", &outcome.Failure{Worker: "http://w", Status: status, Body: []byte(body)})
	}
	for _, c := range []struct {
		err       error
		gone, ctx bool
	}{
		{held(404, `{"message":"The model `+"`sql`"+` does not exist."}`), true, false},
		{held(400, `{"message":"The following requested LoRA adapters are not loaded: sql\nLoaded adapters: dict_keys([])."}`), true, false},
		{held(404, `{"message":"no route"}`), false, false},
		{held(400, `{"message":"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens."}`), false, true},
		{held(400, `{"message":"The input (5000 tokens) is longer than the model's context length (4096 tokens)."}`), false, true},
		{held(500, `{"message":"does not exist"}`), false, false},
		{outcome.Answer(&openai.Error{Status: 404, Message: "does not exist"}), false, false}, // Baton's own answer
		{errors.New("not a failure"), false, false},
	} {
		if AdapterGone(c.err) != c.gone || contextOverflow(c.err) != c.ctx {
			t.Errorf("%v: gone %v, context %v; want %v, %v", c.err, AdapterGone(c.err), contextOverflow(c.err), c.gone, c.ctx)
		}
	}
	p, d := runtimeWorker(config.RuntimeSGLang, "http://p"), runtimeWorker(config.RuntimeSGLang, "http://d")
	pair := worker.Pair{Prefill: p, Decode: d}
	leg := func(name, url string, status int, msg string) error {
		return &outcome.Failure{Leg: name, Worker: url, Status: status, Answer: &openai.Error{Status: status, Message: name + " worker " + url + " answered: " + msg}}
	}
	for _, c := range []struct {
		err  error
		want *worker.Worker
	}{
		{leg("decode", "http://d", 400, "The following requested LoRA adapters are not loaded: sql"), d},
		{leg("prefill", "http://p", 404, "The model `sql` does not exist."), p},
		{leg("decode", "http://d", 400, "invalid max_tokens"), nil},
		{leg("decode", "http://other", 404, "The model `sql` does not exist."), nil},
		{&outcome.Failure{Worker: "http://d", Status: 404, Body: []byte("does not exist")}, nil}, // not a leg's
	} {
		if got := LegAdapterGone(c.err, pair); got != c.want {
			t.Errorf("%v: %v, want %v", c.err, got, c.want)
		}
	}
}
