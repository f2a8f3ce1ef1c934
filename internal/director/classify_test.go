package director

import (
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/lora"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/worker"
)

// classifier is a director whose registry holds one SGLang worker of "base" with the adapter
// "listed" loaded, with "sql" declared and "alias" naming the base.
func classifier(t *testing.T) *Director {
	t.Helper()
	w := worker.New(config.Worker{URL: "http://engine:30000"})
	w.SetInfo(&worker.Info{Runtime: config.RuntimeSGLang, Models: []worker.Model{{ID: "base"}, {ID: "listed", Parent: "base"}, {ID: "org:model"}}})
	reg := worker.NewRegistry(w)
	m := metrics.New(reg)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	adapters := lora.New(reg, http.DefaultClient, log, lora.Settings{Adapters: []config.Adapter{{Name: "sql", Path: "/a/sql", Base: "base"}}, Timeout: time.Second})
	models := map[string]config.ModelConfig{"alias": {Serve: "base"}}
	return New(Options{Registry: reg, Metrics: m, Log: log, MaxBatchSize: 4, Adapters: adapters,
		Models: func() (map[string]config.ModelConfig, string) { return models, "" }})
}

// What a request asks for, read once at classification: its model, an adapter named SGLang's
// ways (lora_path, base:adapter) as that adapter, the body's "model" set to match where the
// route takes one; and each refusal with its status, code and param.
func TestClassification(t *testing.T) {
	d := classifier(t)
	for _, c := range []struct {
		path, body string
		model      string // the model asked for; "" with code set: refused
		bodyModel  string // the body's "model" after, "-" for none
		code       string
	}{
		{"/v1/completions", `{"model":"base","prompt":"x"}`, "base", "base", ""},
		{"/v1/completions", `{"model":"base","prompt":"x","lora_path":"sql"}`, "sql", "sql", ""},
		{"/v1/completions", `{"model":"alias","prompt":"x","lora_path":"sql"}`, "sql", "sql", ""},
		{"/v1/completions", `{"prompt":"x","lora_path":"listed"}`, "listed", "listed", ""},
		{"/v1/completions", `{"model":"base","prompt":"x","lora_path":null}`, "base", "base", ""},
		{"/v1/completions", `{"model":"base","prompt":["x","y"],"lora_path":[null,null]}`, "base", "base", ""},
		{"/v1/completions", `{"model":"base:sql","prompt":"x"}`, "sql", "sql", ""},
		{"/v1/completions", `{"model":" base : listed ","prompt":"x"}`, "listed", "listed", ""},
		{"/v1/completions", `{"model":"org:model","prompt":"x"}`, "org:model", "org:model", ""}, // a worker's own name with a colon
		{"/v1/completions", `{"model":"other:sql","prompt":"x"}`, "other:sql", "other:sql", ""}, // no adapter of that base
		{"/generate", `{"text":"x","lora_path":["sql","sql"]}`, "sql", "-", ""},
		{"/generate", `{"text":"x"}`, "", "-", ""},
		{"/v1/completions", `{"model":"base","prompt":"x","lora_path":"nope"}`, "", "", openai.CodeInvalidLoRAPath},
		{"/v1/completions", `{"model":"base","prompt":"x","lora_path":""}`, "", "", openai.CodeInvalidLoRAPath},
		{"/v1/completions", `{"model":"base","prompt":"x","lora_path":{"n":1}}`, "", "", openai.CodeInvalidLoRAPath},
		{"/v1/completions", `{"model":"base","prompt":["x","y"],"lora_path":["sql","listed"]}`, "", "", openai.CodeInvalidLoRAPath},
		{"/v1/completions", `{"model":"base","prompt":["x","y"],"lora_path":["sql",null]}`, "", "", openai.CodeInvalidLoRAPath},
		{"/v1/completions", `{"model":"listed","prompt":"x","lora_path":"sql"}`, "", "", openai.CodeInvalidLoRAPath},
		{"/v1/completions", `{"model":"base","prompt":"x","lora_path":["sql","sql","sql","sql","sql"]}`, "", "", openai.CodeBatchTooLarge},
		{"/v1/completions", `{"model":"` + strings.Repeat("m", 1025) + `","prompt":"x"}`, "", "", openai.CodeInvalidModel},
		{"/v1/completions", `{"model":"base","prompt":"x","lora_path":"` + strings.Repeat("a", 1025) + `"}`, "", "", openai.CodeInvalidLoRAPath},
		{"/v1/completions", `{"prompt":"x"}`, "", "", openai.CodeModelRequired},
		{"/v1/completions", `{"model":"base","prompt":"x","n":5}`, "", "", openai.CodeBatchTooLarge},
	} {
		req, e := d.Classify([]byte(c.body), c.path)
		if c.code != "" {
			if e == nil || e.Code != c.code || e.Status != http.StatusBadRequest || len(e.Message) > 2048 {
				t.Errorf("%s %.80s: %+v, want 400 %s", c.path, c.body, e, c.code)
			}
			continue
		}
		if e != nil {
			t.Errorf("%s %s: refused %+v", c.path, c.body, e)
			continue
		}
		got, ok := req.Get("model")
		bodyModel := "-"
		if ok {
			bodyModel = strings.Trim(string(got), `"`)
		}
		if req.Model != c.model || bodyModel != c.bodyModel {
			t.Errorf("%s %s: model %q, body's model %q; want %q, %q", c.path, c.body, req.Model, bodyModel, c.model, c.bodyModel)
		}
	}
}
