package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// loraSet is the LoRA adapters an engine has loaded and the requests of each it has in flight.
// Adapters load and unload at run time through the engines' endpoints (vLLM
// /v1/load_lora_adapter with VLLM_ALLOW_RUNTIME_LORA_UPDATING, SGLang /load_lora_adapter); at
// most MaxLoRAs are loaded at once, and a load beyond that is refused, as SGLang refuses one
// beyond --max-loaded-loras (a gateway must unload one first).
type loraSet struct {
	max int // 0: no limit

	mu      sync.Mutex
	loaded  []loraAdapter  // in load order
	running map[string]int // requests of each adapter running
	waiting map[string]int // requests of each adapter waiting for a run slot
	// prev is the label set lora_requests_info last exported before the current one, with its
	// time: vLLM's gauge keeps every label set it ever set, so a reader must take the latest.
	prev     [3]string
	prevAt   float64
	loads    int64
	unloads  int64
	served   map[string]int64 // requests taken for each adapter
	inflight map[string]bool  // adapters being loaded now
	update   sync.Mutex       // SGLang's lora_update_lock: one load or unload at a time
	names    map[string]*sync.Mutex
}

// nameLock holds vLLM's per-name load lock until the returned func is called.
func (s *loraSet) nameLock(name string) func() {
	s.mu.Lock()
	if s.names == nil {
		s.names = map[string]*sync.Mutex{}
	}
	l := s.names[name]
	if l == nil {
		l = &sync.Mutex{}
		s.names[name] = l
	}
	s.mu.Unlock()
	l.Lock()
	return l.Unlock
}

type loraAdapter struct{ name, path string }

func newLoRASet(c Config) *loraSet {
	s := &loraSet{max: c.MaxLoRAs, running: map[string]int{}, waiting: map[string]int{}, inflight: map[string]bool{}, served: map[string]int64{}}
	for _, a := range c.LoRAAdapters {
		s.loaded = append(s.loaded, loraAdapter{name: a, path: "/adapters/" + a})
	}
	return s
}

// list returns the loaded adapters, in load order.
func (s *loraSet) list() []loraAdapter {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.loaded)
}

// has reports whether name is loaded.
func (s *loraSet) has(name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.ContainsFunc(s.loaded, func(a loraAdapter) bool { return a.name == name })
}

// keys is the loaded adapters' names as SGLang's messages print its registry's keys
// (Python's dict_keys of the names).
func (s *loraSet) keys() string {
	var q []string
	for _, a := range s.list() {
		q = append(q, "'"+a.name+"'")
	}
	return "dict_keys([" + strings.Join(q, ", ") + "])"
}

// queued counts a request of adapter waiting for a run slot: run moves it to running (false
// when it may not run yet and block is false), done ends it wherever it is. With batch set (vLLM's --max-loras), run waits while batch other adapters
// run: vLLM's scheduler runs at most max_loras adapters in a batch and leaves the requests of
// another waiting (vllm/v1/core/sched/scheduler.py, the max_loras check when scheduling).
func (s *loraSet) queued(ctx context.Context, adapter string, batch int) (run func(block bool) (bool, error), done func()) {
	if adapter == "" {
		return func(bool) (bool, error) { return true, nil }, func() {}
	}
	s.mu.Lock()
	s.waiting[adapter]++
	s.served[adapter]++
	s.mu.Unlock()
	state := &s.waiting // where the request is counted; nil once it ended
	dec := func(m map[string]int) {
		if m[adapter]--; m[adapter] <= 0 {
			delete(m, adapter)
		}
	}
	run = func(block bool) (bool, error) {
		for {
			s.mu.Lock()
			if state != &s.waiting {
				s.mu.Unlock()
				return true, nil
			}
			if batch <= 0 || s.running[adapter] > 0 || len(s.running) < batch {
				dec(s.waiting)
				s.running[adapter]++
				state = &s.running
				s.mu.Unlock()
				return true, nil
			}
			s.mu.Unlock()
			if !block {
				return false, nil
			}
			if err := sleep(ctx, time.Millisecond); err != nil {
				return false, err
			}
		}
	}
	done = func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if state != nil {
			dec(*state)
			state = nil
		}
	}
	return run, done
}

// infoLabels are vLLM's lora_requests_info labels now: max_lora, running and waiting adapters
// (comma separated, sorted).
func (s *loraSet) infoLabels() [3]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	names := func(m map[string]int) string {
		var out []string
		for n := range m {
			out = append(out, n)
		}
		slices.Sort(out)
		return strings.Join(out, ",")
	}
	return [3]string{strconv.Itoa(s.max), names(s.running), names(s.waiting)}
}

// writeInfo writes vLLM's vllm:lora_requests_info gauge: the current label set with the time
// as its value, and the one before it with its older time, as vLLM's gauge keeps it.
func (s *loraSet) writeInfo(b *strings.Builder) {
	cur := s.infoLabels()
	now := float64(time.Now().UnixNano()) / 1e9
	s.mu.Lock()
	prev, prevAt := s.prev, s.prevAt
	if cur != s.prev {
		s.prev, s.prevAt = cur, now
	}
	s.mu.Unlock()
	b.WriteString("# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n")
	line := func(l [3]string, v float64) {
		fmt.Fprintf(b, "vllm:lora_requests_info{max_lora=%q,running_lora_adapters=%q,waiting_lora_adapters=%q} %.6f\n", l[0], l[1], l[2], v)
	}
	if prevAt != 0 && prev != cur {
		line(prev, prevAt)
	}
	line(cur, now)
}

// loadRequest is the body of both engines' load and unload endpoints.
type loadRequest struct {
	Name string `json:"lora_name"`
	Path string `json:"lora_path"`
}

// readLoRARequest reads a load or unload request's body; false when it answered it refused.
func (e *Engine) readLoRARequest(w http.ResponseWriter, r *http.Request) (loadRequest, bool) {
	var req loadRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil {
		e.loraAnswer(w, errorf(400, "invalid request body: %v", err), "")
		return req, false
	}
	return req, true
}

// serveLoad loads an adapter, taking LoRALoadTime. Its refusals are vLLM's (and SGLang's
// success:false answer on SGLang).
func (e *Engine) serveLoad(w http.ResponseWriter, r *http.Request) {
	req, ok := e.readLoRARequest(w, r)
	if !ok {
		return
	}
	s := e.lora
	if req.Name == "" || req.Path == "" {
		e.loraAnswer(w, errorf(400, "Both 'lora_name' and 'lora_path' must be provided."), "")
		return
	}
	if e.cfg.Engine == EngineSGLang {
		// SGLang loads and unloads one at a time, under the tokenizer manager's
		// lora_update_lock: a load waits for the one before it, then sees what it did.
		s.update.Lock()
		defer s.update.Unlock()
	}
	if e.cfg.Engine == EngineVLLM {
		// vLLM loads one name at a time ("ensure atomicity based on the lora name",
		// vllm/entrypoints/openai/serving_models.py, load_lora_adapter, under
		// lora_resolver_lock[name]); a second load of the name waits, then is refused as loaded.
		unlock := s.nameLock(req.Name)
		defer unlock()
	}
	s.mu.Lock()
	loaded := slices.ContainsFunc(s.loaded, func(a loraAdapter) bool { return a.name == req.Name })
	switch {
	case e.cfg.Engine == EngineSGLang && s.max > 0 && len(s.loaded)+len(s.inflight) >= s.max:
		// SGLang's tokenizer manager refuses past --max-loaded-loras before anything else — an
		// adapter it has already included (python/sglang/srt/managers/tokenizer_manager.py,
		// load_lora_adapter); vLLM checks no capacity on a load
		// (vllm/entrypoints/openai/serving_models.py).
		s.mu.Unlock()
		e.loraAnswer(w, errorf(400, "Cannot load LoRA adapter %s at path %s. Maximum number of loaded LoRA adapters is %d. Please unload some LoRA adapters before loading new ones.", req.Name, req.Path, s.max), "")
		return
	case loaded && e.cfg.Engine == EngineSGLang:
		// python/sglang/srt/lora/lora_manager.py, validate_new_adapter.
		s.mu.Unlock()
		e.loraAnswer(w, errorf(400, "Failed to load LoRA adapter %s because it is already loaded", req.Name), "")
		return
	case loaded:
		s.mu.Unlock()
		e.loraAnswer(w, errorf(400, "The lora adapter '%s' has already been loaded.", req.Name), "")
		return
	}
	s.inflight[req.Name] = true
	s.mu.Unlock()
	err := sleep(r.Context(), e.cfg.LoRALoadTime)
	s.mu.Lock()
	delete(s.inflight, req.Name)
	missing := slices.Contains(e.cfg.LoRAMissingPaths, req.Path)
	if err == nil && !missing {
		s.loaded = append(s.loaded, loraAdapter{name: req.Name, path: req.Path})
		s.loads++
	}
	s.mu.Unlock()
	switch {
	case err != nil:
		return // the client left
	case missing:
		e.loraAnswer(w, errorf(404, "No adapter found for %s", req.Path), "")
		return
	}
	e.loraAnswer(w, nil, fmt.Sprintf("Success: LoRA adapter '%s' added successfully.", req.Name))
}

// serveUnload unloads an adapter; requests of it already running finish.
func (e *Engine) serveUnload(w http.ResponseWriter, r *http.Request) {
	req, ok := e.readLoRARequest(w, r)
	if !ok {
		return
	}
	s := e.lora
	if e.cfg.Engine == EngineSGLang {
		s.update.Lock()
		defer s.update.Unlock()
	}
	s.mu.Lock()
	i := slices.IndexFunc(s.loaded, func(a loraAdapter) bool { return a.name == req.Name })
	if i >= 0 {
		s.loaded = slices.Delete(s.loaded, i, i+1)
		s.unloads++
	}
	s.mu.Unlock()
	switch {
	case i < 0 && e.cfg.Engine == EngineSGLang:
		// The registry's unregister refuses a name it lacks; the endpoint answers 400
		// (python/sglang/srt/lora/lora_registry.py; http_server.py, unload_lora_adapter).
		e.loraAnswer(w, errorf(400, "LoRA with name %s does not exist. Loaded LoRAs: %s", req.Name, s.keys()), "")
		return
	case i < 0:
		e.loraAnswer(w, errorf(404, "The lora adapter '%s' cannot be found.", req.Name), "")
		return
	}
	e.loraAnswer(w, nil, fmt.Sprintf("Success: LoRA adapter '%s' removed successfully.", req.Name))
}

// loraAnswer answers a load or unload: vLLM's plain-text success or error envelope, SGLang's
// {success, error_message, loaded_adapters}.
func (e *Engine) loraAnswer(w http.ResponseWriter, ae *apiError, ok string) {
	if e.cfg.Engine == EngineSGLang {
		loaded := map[string]string{}
		for _, a := range e.lora.list() {
			loaded[a.name] = a.path
		}
		status, msg := 200, ""
		if ae != nil {
			status, msg = ae.status, ae.msg
		}
		writeJSON(w, status, map[string]any{"success": ae == nil, "error_message": msg, "loaded_adapters": loaded})
		return
	}
	if ae != nil {
		e.writeError(w, ae)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = io.WriteString(w, ok)
}

// LoRAStats are the adapter loads and unloads the engine performed.
func (e *Engine) LoRAStats() (loads, unloads int64) {
	e.lora.mu.Lock()
	defer e.lora.mu.Unlock()
	return e.lora.loads, e.lora.unloads
}

// AdapterRequests is how many requests the engine took for adapter (served by it).
func (e *Engine) AdapterRequests(adapter string) int64 {
	e.lora.mu.Lock()
	defer e.lora.mu.Unlock()
	return e.lora.served[adapter]
}

// LoadedAdapters are the adapters loaded now, in load order.
func (e *Engine) LoadedAdapters() []string {
	var out []string
	for _, a := range e.lora.list() {
		out = append(out, a.name)
	}
	return out
}
