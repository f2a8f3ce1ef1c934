package director

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/baton-llm/baton/internal/admit"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/worker"
)

// Classify parses the body of an inference request to path: the default model set in it when
// it names none, an adapter named by SGLang's spellings read as the model, its batch bounded;
// bad input is the error to answer.
func (d *Director) Classify(body []byte, path string) (*openai.Request, *openai.Error) {
	req, err := openai.ParseRequest(body)
	if err != nil {
		e := &openai.Error{Status: statusBadRequest, Code: openai.CodeInvalidJSON, Message: err.Error()}
		if dk, ok := errors.AsType[*openai.DuplicateKeyError](err); ok {
			e.Code, e.Param = openai.CodeDuplicateKey, dk.Key
		}
		return nil, e
	}
	if len(req.Model) > MaxModelName {
		return nil, &openai.Error{Status: statusBadRequest, Code: openai.CodeInvalidModel, Param: "model",
			Message: fmt.Sprintf(`"model" is longer than %d bytes: no model Baton serves has such a name`, MaxModelName)}
	}
	if e := d.sglangAdapterModel(req, path); e != nil {
		return nil, e
	}
	if e := d.loraPathModel(req, path); e != nil {
		return nil, e
	}
	if _, def := d.Models(); req.Model == "" && path != "/generate" {
		if def == "" {
			return nil, &openai.Error{Status: statusBadRequest, Code: openai.CodeModelRequired, Param: "model",
				Message: `the request names no model: give "model"`}
		}
		q, _ := json.Marshal(def)
		if b, err := openai.Set(req.Body, "model", q); err == nil && req.SetBody(b) == nil {
			req.Model = def
		}
	}
	if req.N > d.o.MaxBatchSize {
		return nil, &openai.Error{Status: statusBadRequest, Code: openai.CodeBatchTooLarge, Param: "n",
			Message: fmt.Sprintf(`"n" is %d, above the limit of %d (max_batch_size)`, req.N, d.o.MaxBatchSize)}
	}
	return req, nil
}

// MaxModelName bounds a model's (or an adapter's) name read from a request: every message that
// names the model quotes at most this much of what the client sent.
const MaxModelName = 1024

// loraPathModel reads a client's own lora_path (SGLang's way to name an adapter, on /generate
// and its OpenAI routes) as the model the request asks for: the adapter it names is routed,
// loaded, counted and checked against the tenant's models like a "model" naming it — never
// passed to an engine unseen, where it would run any adapter loaded there. Outside /generate the
// body's "model" becomes the adapter too (vLLM runs the adapter its model names). A lora_path
// naming no adapter Baton knows, several adapters at once, or an adapter of another base than the
// model's is refused 400; null (or a list of nulls) is the base model.
func (d *Director) loraPathModel(req *openai.Request, path string) *openai.Error {
	raw, ok := req.Get("lora_path")
	if !ok {
		return nil
	}
	refuse := func(format string, a ...any) *openai.Error {
		return &openai.Error{Status: statusBadRequest, Code: openai.CodeInvalidLoRAPath, Param: "lora_path", Message: fmt.Sprintf(format, a...)}
	}
	var name string
	switch v := bytes.TrimSpace(raw); {
	case string(v) == "null":
		return nil
	case len(v) > 0 && v[0] == '"':
		if json.Unmarshal(v, &name) != nil || name == "" || len(name) > MaxModelName {
			return refuse(`"lora_path" must name an adapter (at most %d bytes)`, MaxModelName)
		}
	case len(v) > 0 && v[0] == '[':
		var names []*string
		if json.Unmarshal(v, &names) != nil {
			return refuse(`"lora_path" must be an adapter's name, null, or a list of them (one per prompt)`)
		}
		if len(names) > max(d.o.MaxBatchSize, 1) {
			return &openai.Error{Status: statusBadRequest, Code: openai.CodeBatchTooLarge, Param: "lora_path",
				Message: fmt.Sprintf(`"lora_path" lists %d entries, above the limit of %d prompts (max_batch_size)`, len(names), d.o.MaxBatchSize)}
		}
		nulls := 0
		for _, n := range names {
			switch {
			case n == nil:
				nulls++
			case *n == "" || len(*n) > MaxModelName || name != "" && *n != name:
				return refuse(`"lora_path" names more than one adapter in one batch: send one request per adapter`)
			default:
				name = *n
			}
		}
		if name == "" {
			return nil // the base model for every prompt
		}
		if nulls > 0 {
			return refuse(`"lora_path" names the base model beside an adapter in one batch: send one request per adapter`)
		}
	default:
		return refuse(`"lora_path" must be an adapter's name, null, or a list of them (one per prompt)`)
	}
	base := d.adapterBase(name)
	if base == "" {
		return refuse(`"lora_path" names %q, which is no adapter Baton serves (declared in adapters:, or listed by a worker)`, name)
	}
	if req.Model != "" && req.Model != name && req.Model != base && d.ModelChain(req.Model)[0] != base {
		return refuse(`"lora_path" names adapter %q of base model %q, but "model" is %q`, name, base, req.Model)
	}
	return setModel(req, name, path)
}

// adapterBase is the base model of adapter name, declared or listed by a worker; "" when name
// is no adapter Baton knows.
func (d *Director) adapterBase(name string) string {
	if d.o.Adapters != nil {
		return d.o.Adapters.Base(d.reg.Snapshot(), name)
	}
	return d.reg.Snapshot().Parent(name)
}

// sglangAdapterModel reads SGLang's own spelling of an adapter, "model": "base:adapter" (its
// OpenAI serving splits at the first colon and trims both parts, serving_base.py,
// _parse_model_parameter), as the adapter: a client moving from SGLang, or sending back the
// model an answer named, asks for the adapter, routed and tenant-checked as such. A model of
// that name that Baton or a worker knows keeps its name.
func (d *Director) sglangAdapterModel(req *openai.Request, path string) *openai.Error {
	base, a, ok := strings.Cut(req.Model, ":")
	if !ok {
		return nil
	}
	if models, _ := d.Models(); models != nil {
		if _, known := models[req.Model]; known {
			return nil
		}
	}
	if d.reg.Snapshot().Lists(req.Model) {
		return nil
	}
	base, a = strings.TrimSpace(base), strings.TrimSpace(a)
	if b := d.adapterBase(a); a == "" || b == "" || b != base && d.ModelChain(base)[0] != b {
		return nil // no adapter of that base: the name is left to be found, or not, as it is
	}
	return setModel(req, a, path)
}

// setModel makes name the model req asks for, and — but on SGLang's /generate, which takes no
// "model" — its body's "model".
func setModel(req *openai.Request, name, path string) *openai.Error {
	req.Model = name
	if path == "/generate" {
		return nil
	}
	q, _ := json.Marshal(name)
	b, err := openai.Set(req.Body, "model", q)
	if err == nil {
		err = req.SetBody(b)
	}
	if err != nil {
		return &openai.Error{Status: statusBadRequest, Code: openai.CodeInvalidJSON, Message: err.Error()}
	}
	return nil
}

// CountBatch counts the request's prompts and samples into req, and refuses a request past
// max_batch_size (on every route: the engine would run them all).
func (d *Director) CountBatch(req *pd.Request) *openai.Error {
	limit := d.o.MaxBatchSize
	if req.Batch = pd.BatchSize(req, limit+1); req.Batch > limit {
		return &openai.Error{Status: statusBadRequest, Code: openai.CodeBatchTooLarge,
			Message: fmt.Sprintf("the request holds more than %d prompts (max_batch_size)", limit)}
	}
	req.Samples = pd.SamplesOf(req)
	if req.Rec != nil {
		req.Rec.Samples, req.Rec.Prompts = req.Samples, req.Batch
	}
	if req.Samples > limit {
		return &openai.Error{Status: statusBadRequest, Code: openai.CodeBatchTooLarge,
			Message: fmt.Sprintf("the request asks %d samples per prompt (n, best_of or sampling_params.n), above the limit of %d (max_batch_size)", req.Samples, limit)}
	}
	return nil
}

// PriorityClass is the class a request's X-Baton-Priority (baton) or smg's X-Smg-Priority (smg)
// names, default without one; an unknown X-Baton-Priority is 400 naming the valid ones, an
// unknown X-Smg-Priority default, as smg reads its header.
func PriorityClass(baton, smg string) (admit.Class, *openai.Error) {
	for _, h := range [...]struct{ name, v string }{{openai.HeaderPriority, baton}, {openai.HeaderSmgPriority, smg}} {
		if h.v == "" {
			continue
		}
		c, ok := admit.ParseClass(strings.ToLower(strings.TrimSpace(h.v)))
		if !ok && h.name == openai.HeaderSmgPriority {
			return admit.Default, nil
		}
		if !ok {
			return 0, &openai.Error{Status: statusBadRequest, Code: openai.CodeInvalidPriority, Param: h.name,
				Message: fmt.Sprintf("%s %.40q is no priority class: want critical, interactive, default or batch (smg's system and bulk too)", h.name, h.v)}
		}
		return c, nil
	}
	return admit.Default, nil
}

// DecodeAloneServes reports whether a decode worker can serve a request alone: a vLLM one (its
// KV connector computes the prompt when no handoff comes); SGLang's decode mode refuses a
// request without a bootstrap, so a fleet of SGLang decodes picks a prefill instead.
func (d *Director) DecodeAloneServes() bool {
	for _, w := range worker.Available(d.reg.Snapshot().Workers) {
		if w.Role == config.RoleDecode && w.Runtime() != config.RuntimeSGLang {
			return true
		}
	}
	return false
}

// maxEndpointLen bounds a host:port header value; maxPrefillers the endpoints an
// x-prefiller-host-port header may list.
const (
	maxEndpointLen = 300
	maxPrefillers  = 16
)

// Prefiller reads an Endpoint Picker's x-prefiller-host-port (its values: comma-separated, or
// the header repeated, as llm-d's sidecar reads it) into the filter that holds the request to the
// first of them that is one of the available prefill workers: Baton is then the decode-side
// sidecar and runs the prefill leg where the picker chose. Values naming none of them are
// refused 503, a malformed list 400.
func (d *Director) Prefiller(values []string) (func(*worker.Worker) bool, *openai.Error) {
	var named []string
	for _, v := range values {
		for e := range strings.SplitSeq(v, ",") {
			if e = strings.TrimSpace(e); e != "" {
				named = append(named, e)
			}
		}
	}
	if len(named) == 0 || len(named) > maxPrefillers || slices.ContainsFunc(named, func(e string) bool { return len(e) > maxEndpointLen }) {
		return nil, &openai.Error{Status: statusBadRequest, Code: openai.CodeInvalidRequest, Param: openai.HeaderPrefiller,
			Message: fmt.Sprintf("%s must list 1 to %d host:port", openai.HeaderPrefiller, maxPrefillers)}
	}
	available := worker.Available(d.reg.Snapshot().Workers)
	for _, hp := range named {
		for _, p := range available {
			if p.Role == config.RolePrefill && p.Endpoint == hp {
				return func(w *worker.Worker) bool { return w.Role != config.RolePrefill || w.Endpoint == hp }, nil
			}
		}
	}
	return nil, &openai.Error{Status: statusUnavailable, Code: openai.CodeNoAvailableWorkers,
		Message: fmt.Sprintf("none of the prefills %s names (%.80q) is one of Baton's available prefill workers", openai.HeaderPrefiller, strings.Join(named, ","))}
}
