package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"

	"github.com/baton-llm/baton/internal/sim"
)

// workload is the shape of the requests of a run: completions of a prompt of about
// promptBytes, maxTokens tokens each (ignore_eos, so the length is exact), streamed or not.
type workload struct {
	promptBytes int
	maxTokens   int
	stream      bool
}

// prompt returns request i's prompt: distinct per request, about promptBytes long.
func (w workload) prompt(i int) string {
	head := fmt.Sprintf("request %d of the baton benchmark", i)
	if w.promptBytes <= len(head) {
		return head
	}
	var sb strings.Builder
	sb.Grow(w.promptBytes)
	sb.WriteString(head)
	words := []string{" relay", " baton", " prefill", " decode", " handoff", " engine", " stream", " token"}
	for j := 0; sb.Len() < w.promptBytes; j++ {
		sb.WriteString(words[j%len(words)])
	}
	return sb.String()
}

func (w workload) body(prompt string) []byte {
	p, _ := json.Marshal(prompt)
	return []byte(fmt.Sprintf(`{"model":%q,"prompt":%s,"max_tokens":%d,"ignore_eos":true,"stream":%v}`, benchModel, p, w.maxTokens, w.stream))
}

// expected is the simulator's answer to prompt.
func (w workload) expected(prompt string) string {
	toks, _ := sim.Generate(sim.Digest(sim.Tokenize(prompt)), sim.Sampling{MaxTokens: w.maxTokens, IgnoreEOS: true})
	return sim.Detokenize(toks)
}

// check verifies an answer: status 200, a complete stream, the exact text.
func (w workload) check(status int, body []byte, prompt string, r Result) Result {
	if r.Err != nil {
		return r
	}
	if status != http.StatusOK {
		r.Err = fmt.Errorf("status %d: %.200s", status, body)
		return r
	}
	text, err := completionText(body, w.stream)
	if err != nil {
		r.Err = err
	} else if want := w.expected(prompt); text != want {
		r.Err = fmt.Errorf("text %q, want %q", text, want)
	}
	return r
}

const benchModel = "bench-model"

// completion sends the workload to an OpenAI endpoint (an engine, nginx, or Baton).
func completion(client *http.Client, base string, w workload) Request {
	return completionWith(client, base, w, nil)
}

// completionWith is completion with hdr added to every request.
func completionWith(client *http.Client, base string, w workload, hdr http.Header) Request {
	return func(ctx context.Context, i int) Result {
		prompt := w.prompt(i)
		status, body, r := post(ctx, client, base+"/v1/completions", w.body(prompt), hdr)
		return w.check(status, body, prompt, r)
	}
}

// sglangLegs is the PD baseline for SGLang: the client sends both legs itself, with bootstrap
// fields, at once.
func sglangLegs(client *http.Client, p, d *sim.Engine, w workload) Request {
	return func(ctx context.Context, i int) Result {
		prompt := w.prompt(i)
		body := w.body(prompt)
		leg := append(body[:len(body)-1:len(body)-1], fmt.Sprintf(`,"bootstrap_host":"127.0.0.1","bootstrap_port":%d,"bootstrap_room":%d}`, p.BootstrapPort(), rand.Uint64()>>1)...)
		var wg sync.WaitGroup
		var perr error
		wg.Go(func() {
			status, b, r := post(ctx, client, p.URL()+"/v1/completions", leg, nil)
			if r.Err == nil && status != 200 {
				r.Err = fmt.Errorf("prefill status %d: %.200s", status, b)
			}
			perr = r.Err
		})
		status, b, r := post(ctx, client, d.URL()+"/v1/completions", leg, nil)
		wg.Wait()
		if r.Err == nil {
			r.Err = perr
		}
		return w.check(status, b, prompt, r)
	}
}

// nixlLegs is the PD baseline for vLLM NIXL: the client sends the one-token prefill, takes its
// kv_transfer_params, and sends the decode with them.
func nixlLegs(client *http.Client, p, d *sim.Engine, w workload) Request {
	return func(ctx context.Context, i int) Result {
		prompt := w.prompt(i)
		pb, _ := json.Marshal(prompt)
		probe := []byte(fmt.Sprintf(`{"model":%q,"prompt":%s,"max_tokens":1,"ignore_eos":true,"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}`, benchModel, pb))
		status, pbody, pr := post(ctx, client, p.URL()+"/v1/completions", probe, nil)
		if pr.Err == nil && status != 200 {
			pr.Err = fmt.Errorf("prefill status %d: %.200s", status, pbody)
		}
		if pr.Err != nil {
			return pr
		}
		var v struct {
			KV json.RawMessage `json:"kv_transfer_params"`
		}
		if err := json.Unmarshal(pbody, &v); err != nil || len(v.KV) == 0 || bytes.Equal(v.KV, []byte("null")) {
			return Result{Err: fmt.Errorf("prefill returned no kv_transfer_params")}
		}
		body := w.body(prompt)
		leg := append(append(body[:len(body)-1:len(body)-1], `,"kv_transfer_params":`...), v.KV...)
		status, b, r := post(ctx, client, d.URL()+"/v1/completions", append(leg, '}'), nil)
		r.Latency += pr.Latency
		r.TTFT += pr.Latency
		return w.check(status, b, prompt, r)
	}
}
