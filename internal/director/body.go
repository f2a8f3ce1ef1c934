package director

import (
	"encoding/json"
	"strconv"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/worker"
)

// ForWorkers is body as ws take it: its "model" the workers' name for the request's (not on
// SGLang's /generate, which takes none) and, on SGLang, its adapter in lora_path and Baton's
// own rid for the request id id (withRID).
func ForWorkers(body []byte, path, client, id string, sreq *policy.Request, ws ...*worker.Worker) []byte {
	if path != "/generate" {
		body = withModel(body, client, WorkerModel(sreq, ws...))
	}
	return withRID(withLoRAPath(body, sreq, ws...), path, id, ws...)
}

// withRID is body with SGLang's "rid" Baton's own when every worker of ws is SGLang's, on the
// routes SGLang names answers on: SGLang's request id, which names its answer ("id") and its
// stream's every event (serving_base.py _generate_request_id takes the request's rid;
// serving_chat.py and serving_completions.py write content["meta_info"]["id"]). A client's rid
// would let it name its answer as it likes — after another request's id, making a worker look as
// if it named answers after Baton's ids, whose every later answer would then be refused — or
// reuse an id another request has in flight. Baton sets it to the route's answer prefix and the
// request id it sends (openai.RIDFor), so that SGLang's answers are proven by their id as vLLM's are.
// A request of many samples (n > 1, a list of prompts) gets none: SGLang names each sample
// rid_<i> and the answer after the first (io_struct.py _normalize_rid), and mints its own ids
// without one; the client's is removed all the same. Other bytes are untouched.
func withRID(body []byte, path, id string, ws ...*worker.Worker) []byte {
	r := routes.Of(path)
	if len(ws) == 0 || r.AnswerID == "" && path != "/generate" {
		return body
	}
	for _, w := range ws {
		if w.Runtime() != config.RuntimeSGLang {
			return body
		}
	}
	var b []byte
	var err error
	if rid, ok := openai.RIDFor(body, path, id); ok {
		b, err = openai.Set(body, "rid", rid)
	} else {
		b, err = openai.Delete(body, "rid")
	}
	if err != nil {
		return body
	}
	return b
}

// withModel is body with its "model" the workers' name for it, when that differs from the
// client's; the other bytes untouched.
func withModel(body []byte, client, served string) []byte {
	if served == client || served == "" {
		return body
	}
	q, err := json.Marshal(served)
	if err != nil {
		return body
	}
	if b, err := openai.Set(body, "model", q); err == nil {
		return b
	}
	return body
}

// WorkerModel is the name the workers take for the request's model: an adapter in SGLang's
// form base:adapter when the workers are SGLang's (its OpenAI routes take an adapter's name that
// way; a bare adapter name would be served by the base model), the model itself otherwise.
func WorkerModel(sreq *policy.Request, ws ...*worker.Worker) string {
	if sreq.AdapterBase == "" {
		return sreq.Model
	}
	for _, w := range ws {
		if w.Runtime() != config.RuntimeSGLang {
			return sreq.Model
		}
	}
	return sreq.AdapterBase + ":" + sreq.Model
}

// withLoRAPath is body with SGLang's lora_path set to the adapter a request names, when every
// worker of ws is SGLang: SGLang releases that read no adapter from the model name
// (base:adapter) would run the base model and answer 200 — never an adapter request answered
// silently by its base. A client's own lora_path is replaced: SGLang runs lora_path before the
// model name, and the adapter Baton routed, loaded and counted is the one that must run.
func withLoRAPath(body []byte, sreq *policy.Request, ws ...*worker.Worker) []byte {
	if sreq.AdapterBase == "" || len(ws) == 0 {
		return body
	}
	for _, w := range ws {
		if w.Runtime() != config.RuntimeSGLang {
			return body
		}
	}
	q, _ := json.Marshal(sreq.Model) // a client's own lora_path (another adapter, null) replaced
	if b, err := openai.Set(body, "lora_path", q); err == nil {
		return b
	}
	return body
}

// WithPriority is body with the engine's "priority" field set for class when the worker is
// marked forward_priority (the client's own value replaced); body as it is otherwise.
func WithPriority(body []byte, class record.Class, ws ...*worker.Worker) []byte {
	v, ok := 0, len(ws) > 0
	for i, w := range ws {
		wv, marked := w.EnginePriority(string(class))
		if !marked || i > 0 && wv != v {
			return body // a worker not marked, or legs that read it differently: none is sent
		}
		v = wv
	}
	if !ok {
		return body
	}
	if b, err := openai.Set(body, "priority", []byte(strconv.Itoa(v))); err == nil {
		return b
	}
	return body
}
