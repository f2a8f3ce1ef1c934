package sim

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
)

const created = 1700000000

func (j *job) object() string {
	return map[route]string{routeChat: "chat.completion", routeCompletions: "text_completion", routeResponses: "response"}[j.route]
}

func usage(results []itemResult) (prompt, cached, completion int) {
	for _, r := range results {
		prompt += r.promptTokens
		cached += r.cached
		for _, c := range r.choices {
			completion += len(c.tokens)
		}
	}
	return
}

// openAIUsage is the usage of chat and completions answers. Without prompt-token details (vLLM
// started without --enable-prompt-tokens-details) prompt_tokens_details is null.
func (e *Engine) openAIUsage(results []itemResult) map[string]any {
	p, c, o := usage(results)
	return map[string]any{"prompt_tokens": p, "completion_tokens": o, "total_tokens": p + o,
		"prompt_tokens_details": e.tokenDetails(c)}
}

func (e *Engine) responsesUsage(results []itemResult) map[string]any {
	p, c, o := usage(results)
	return map[string]any{"input_tokens": p, "input_tokens_details": e.tokenDetails(c),
		"output_tokens": o, "output_tokens_details": map[string]any{"reasoning_tokens": 0}, "total_tokens": p + o}
}

func (e *Engine) tokenDetails(cached int) any {
	if e.cfg.NoPromptTokensDetails {
		return nil
	}
	return map[string]any{"cached_tokens": cached}
}

// kvTransferParams is vLLM's top-level response field: the first prompt's params, or null.
func kvTransferParams(results []itemResult) any {
	if len(results) > 0 && results[0].kvParams != nil {
		return results[0].kvParams
	}
	return nil
}

// writeFull writes a non-streamed response.
func (e *Engine) writeFull(w http.ResponseWriter, j *job, results []itemResult) {
	switch j.route {
	case routeChat, routeCompletions:
		var choices []any
		for i, res := range results {
			for c, ch := range res.choices {
				idx := i*j.n + c
				if j.route == routeChat {
					choices = append(choices, map[string]any{"index": idx, "message": map[string]any{"role": "assistant", "content": Detokenize(ch.tokens)},
						"logprobs": nil, "finish_reason": ch.finish})
				} else {
					choices = append(choices, map[string]any{"index": idx, "text": Detokenize(ch.tokens), "logprobs": nil, "finish_reason": ch.finish})
				}
			}
		}
		out := map[string]any{"id": j.id, "object": j.object(), "created": created, "model": e.cfg.Model,
			"choices": choices, "usage": e.openAIUsage(results)}
		if e.cfg.Engine == EngineVLLM {
			out["kv_transfer_params"] = kvTransferParams(results)
		}
		writeJSON(w, 200, out)
	case routeResponses:
		out := e.responseObject(j, results, "completed")
		if e.cfg.Engine == EngineVLLM {
			out["kv_transfer_params"] = kvTransferParams(results)
		}
		writeJSON(w, 200, out)
	case routeMessages:
		out := e.messageObject(j, results, true)
		out["kv_transfer_params"] = kvTransferParams(results)
		writeJSON(w, 200, out)
	case routeGenerate:
		var outs []any
		for i, res := range results {
			for c, ch := range res.choices {
				outs = append(outs, e.generateObject(j, res, ch, len(ch.tokens), true, i*j.n+c))
			}
		}
		if len(outs) == 1 {
			writeJSON(w, 200, outs[0])
		} else {
			writeJSON(w, 200, outs)
		}
	}
}

func (e *Engine) responseObject(j *job, results []itemResult, status string) map[string]any {
	text := ""
	if status == "completed" {
		text = Detokenize(results[0].choices[0].tokens)
	}
	out := map[string]any{"id": j.id, "object": "response", "created_at": created, "model": e.cfg.Model, "status": status,
		"output": []any{map[string]any{"type": "message", "id": "msg_" + j.id, "role": "assistant", "status": status,
			"content": []any{map[string]any{"type": "output_text", "text": text, "annotations": []any{}}}}}}
	if status == "completed" {
		out["usage"] = e.responsesUsage(results)
		if results[0].choices[0].finish == FinishLength {
			out["status"] = "incomplete"
			out["incomplete_details"] = map[string]any{"reason": "max_output_tokens"}
		}
	}
	return out
}

// messageObject is an Anthropic-style message: the whole answer when final, else the empty
// message a stream starts with.
func (e *Engine) messageObject(j *job, results []itemResult, final bool) map[string]any {
	p, c, o := usage(results)
	content := []any{}
	var stop any
	if final {
		ch := results[0].choices[0]
		content = append(content, map[string]any{"type": "text", "text": Detokenize(ch.tokens)})
		stop = map[bool]string{true: "max_tokens", false: "end_turn"}[ch.finish == FinishLength]
	} else {
		o = 0
	}
	return map[string]any{"id": j.id, "type": "message", "role": "assistant", "model": e.cfg.Model, "content": content,
		"stop_reason": stop, "stop_sequence": nil,
		"usage": map[string]any{"input_tokens": p, "output_tokens": o, "cache_read_input_tokens": c}}
}

// generateObject is SGLang's /generate answer after k tokens of choice ch.
func (e *Engine) generateObject(j *job, res itemResult, ch choice, k int, final bool, index int) generateOut {
	meta := map[string]any{"id": fmt.Sprintf("%s-%d", j.id, index), "prompt_tokens": res.promptTokens,
		"completion_tokens": k, "cached_tokens": res.cached, "finish_reason": nil, "e2e_latency": 0.0}
	if final {
		switch {
		case res.prefillLeg:
			meta["finish_reason"] = map[string]any{"type": "length", "length": 0}
		case ch.finish == FinishLength:
			meta["finish_reason"] = map[string]any{"type": "length", "length": len(ch.tokens)}
		default:
			meta["finish_reason"] = map[string]any{"type": "stop", "matched": nil}
		}
	}
	if j.returnLogprob {
		meta["input_token_logprobs"] = res.inputLogprobs
		out := make([][]any, k)
		for i, id := range ch.tokens[:k] {
			out[i] = []any{Logprob(id, res.promptTokens+i), id, nil}
		}
		meta["output_token_logprobs"] = out
	}
	o := generateOut{Text: Detokenize(ch.tokens[:k]), OutputIDs: ch.tokens[:k], MetaInfo: meta}
	if len(j.items) > 1 || j.n > 1 {
		o.Index = &index
	}
	return o
}

// generateOut is one /generate answer, its members in SGLang's order (the tokenizer manager
// builds text, output_ids, then meta_info): the usage comes last.
type generateOut struct {
	Text      string         `json:"text"`
	OutputIDs []uint32       `json:"output_ids"`
	MetaInfo  map[string]any `json:"meta_info"`
	Index     *int           `json:"index,omitempty"`
}

// sse writes events, flushing each; it drops the connection after dropAfter events, or holds
// it silent after hangAfter events until the client leaves (faults).
type sse struct {
	w         io.Writer
	rc        *http.ResponseController
	n         int
	dropAfter int
	hangAfter int
	ctx       context.Context
}

func (s *sse) event(name string, v any) error {
	if s.dropAfter > 0 && s.n >= s.dropAfter {
		return errDropped
	}
	if s.hangAfter > 0 && s.n >= s.hangAfter {
		<-s.ctx.Done()
		return s.ctx.Err()
	}
	s.n++
	b := marshalIDFirst(v)
	var err error
	if name != "" {
		_, err = fmt.Fprintf(s.w, "event: %s\ndata: %s\n\n", name, b)
	} else {
		_, err = fmt.Fprintf(s.w, "data: %s\n\n", b)
	}
	if err == nil {
		err = s.rc.Flush()
	}
	return err
}

func (s *sse) done() error {
	if _, err := io.WriteString(s.w, "data: [DONE]\n\n"); err != nil {
		return err
	}
	return s.rc.Flush()
}

// writeStream writes a streamed response, one event per token, paced by the decode cost.
func (e *Engine) writeStream(ctx context.Context, w http.ResponseWriter, j *job, results []itemResult, f Faults) error {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(200)
	s := &sse{w: w, rc: http.NewResponseController(w), hangAfter: f.HangAfter, ctx: ctx}
	if f.drops() {
		s.dropAfter = f.DropAfter
	}
	tick := func() error { // one token computed
		if j.seq != nil {
			j.ticks++
			if err := e.steps.await(ctx, j.seq, min(j.ticks, j.seq.wanted())); err != nil {
				return err
			}
			e.stats.generated.Add(1)
			return nil
		}
		if err := sleep(ctx, e.cfg.DecodePerToken); err != nil {
			return err
		}
		e.stats.generated.Add(1)
		return nil
	}
	// usageSoFar is what an event of a stream asking continuous_usage_stats carries: its choice's
	// prompt and the tokens generated for it so far (vLLM's previous_num_tokens[i], SGLang's
	// completion_tokens[index]); SGLang's events carry a null usage otherwise (its stream
	// responses are dumped with their unset fields), vLLM's none.
	usageSoFar := func(prompt, done int) (any, bool) {
		switch {
		case j.eachUsage:
			return map[string]any{"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}, true
		case e.cfg.Engine == EngineSGLang:
			return nil, true
		}
		return nil, false
	}
	chunk := func(idx int, delta map[string]any, finish any, prompt, done int) map[string]any {
		c := map[string]any{"index": idx, "logprobs": nil, "finish_reason": finish}
		if j.route == routeChat {
			c["delta"] = delta
		} else {
			c["text"] = delta["content"]
		}
		ev := map[string]any{"id": j.id, "object": j.object() + map[bool]string{true: ".chunk", false: ""}[j.route == routeChat],
			"created": created, "model": e.cfg.Model, "choices": []any{c}}
		if u, ok := usageSoFar(prompt, done); ok {
			ev["usage"] = u
		}
		return ev
	}
	per := max(1, e.cfg.StreamInterval)
	switch j.route {
	case routeChat, routeCompletions:
		for i, res := range results {
			for c, ch := range res.choices {
				idx := i*j.n + c
				if j.route == routeChat {
					if err := s.event("", chunk(idx, map[string]any{"role": "assistant", "content": ""}, nil, res.promptTokens, 0)); err != nil {
						return err
					}
				}
				for k := 0; k < len(ch.tokens); k += per {
					var text strings.Builder
					for _, tok := range ch.tokens[k:min(k+per, len(ch.tokens))] {
						if err := tick(); err != nil {
							return err
						}
						text.WriteString(TokenText(tok))
					}
					done := min(k+per, len(ch.tokens))
					if err := s.event("", chunk(idx, map[string]any{"content": text.String()}, nil, res.promptTokens, done)); err != nil {
						return err
					}
				}
				empty := map[string]any{"content": ""}
				if j.route == routeChat {
					empty = map[string]any{}
				}
				if err := s.event("", chunk(idx, empty, ch.finish, res.promptTokens, len(ch.tokens))); err != nil {
					return err
				}
			}
		}
		if j.includeUsage {
			u := map[string]any{"id": j.id, "object": j.object() + map[bool]string{true: ".chunk", false: ""}[j.route == routeChat],
				"created": created, "model": e.cfg.Model, "choices": []any{}, "usage": e.openAIUsage(results)}
			if err := s.event("", u); err != nil {
				return err
			}
		}
		return s.done()
	case routeResponses:
		if err := s.event("response.created", map[string]any{"type": "response.created", "response": e.responseObject(j, results, "in_progress")}); err != nil {
			return err
		}
		for _, tok := range results[0].choices[0].tokens {
			if err := tick(); err != nil {
				return err
			}
			if err := s.event("response.output_text.delta", map[string]any{"type": "response.output_text.delta", "item_id": "msg_" + j.id,
				"output_index": 0, "content_index": 0, "delta": TokenText(tok)}); err != nil {
				return err
			}
		}
		return s.event("response.completed", map[string]any{"type": "response.completed", "response": e.responseObject(j, results, "completed")})
	case routeMessages:
		return e.streamMessage(s, j, results, tick)
	default: // generate: cumulative text per chunk
		for i, res := range results {
			for c, ch := range res.choices {
				for k := 1; k <= len(ch.tokens); k++ {
					if err := tick(); err != nil {
						return err
					}
					if err := s.event("", e.generateObject(j, res, ch, k, k == len(ch.tokens), i*j.n+c)); err != nil {
						return err
					}
				}
				if len(ch.tokens) == 0 {
					if err := s.event("", e.generateObject(j, res, ch, 0, true, i*j.n+c)); err != nil {
						return err
					}
				}
			}
		}
		return s.done()
	}
}

// streamMessage streams an Anthropic-style message: message_start, one content block of text
// deltas, message_delta with the stop reason and usage, message_stop; no [DONE].
func (e *Engine) streamMessage(s *sse, j *job, results []itemResult, tick func() error) error {
	if err := s.event("message_start", map[string]any{"type": "message_start", "message": e.messageObject(j, results, false)}); err != nil {
		return err
	}
	if err := s.event("content_block_start", map[string]any{"type": "content_block_start", "index": 0,
		"content_block": map[string]any{"type": "text", "text": ""}}); err != nil {
		return err
	}
	ch := results[0].choices[0]
	for _, tok := range ch.tokens {
		if err := tick(); err != nil {
			return err
		}
		if err := s.event("content_block_delta", map[string]any{"type": "content_block_delta", "index": 0,
			"delta": map[string]any{"type": "text_delta", "text": TokenText(tok)}}); err != nil {
			return err
		}
	}
	if err := s.event("content_block_stop", map[string]any{"type": "content_block_stop", "index": 0}); err != nil {
		return err
	}
	final := e.messageObject(j, results, true)
	if err := s.event("message_delta", map[string]any{"type": "message_delta",
		"delta": map[string]any{"stop_reason": final["stop_reason"], "stop_sequence": nil}, "usage": final["usage"]}); err != nil {
		return err
	}
	return s.event("message_stop", map[string]any{"type": "message_stop"})
}

// writeStreamError answers a stream that failed after its 200 was sent, as the engines do: the
// error as an event, then [DONE]. vLLM and SGLang's OpenAI routes send {"error": {…}}; SGLang's
// /generate a last chunk whose finish_reason is an abort with its status.
func (e *Engine) writeStreamError(w http.ResponseWriter, j *job, ae *apiError) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(200)
	s := &sse{w: w, rc: http.NewResponseController(w)}
	var ev any
	if j.route == routeGenerate {
		ev = map[string]any{"text": "", "output_ids": []any{}, "meta_info": map[string]any{"id": j.id,
			"finish_reason": map[string]any{"type": "abort", "message": ae.msg, "status_code": ae.status}}}
	} else {
		ev = map[string]any{"error": e.errorBody(ae)["error"]}
		if e.cfg.Engine == EngineSGLang {
			ev = map[string]any{"error": e.errorBody(ae)}
		}
	}
	if s.event("", ev) == nil {
		_ = s.done()
	}
}

// writeStreamRefusal answers a streamed request SGLang refuses before it generates anything: its
// tokenizer manager's generate_request raises a ValueError (lora_registry.py's acquire of an
// adapter not loaded) once the stream's 200 is out, and the refusal is the stream's one event,
// then [DONE]. The OpenAI routes send {"error": {"object": "error", "message", "type":
// "BadRequestError", "param": null, "code": 400}} (serving_base.py,
// create_streaming_error_response, called by the stream generators of serving_completions.py and
// serving_chat.py); /generate sends {"error": {"message"}} (http_server.py, generate_request's
// stream_results), which names no status.
func (e *Engine) writeStreamRefusal(w http.ResponseWriter, rt route, ae *apiError) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(200)
	s := &sse{w: w, rc: http.NewResponseController(w)}
	in := map[string]any{"object": "error", "message": ae.msg, "type": "BadRequestError", "param": nil, "code": ae.status}
	if rt == routeGenerate {
		in = map[string]any{"message": ae.msg}
	}
	if s.event("", map[string]any{"error": in}) == nil {
		_ = s.done()
	}
}
