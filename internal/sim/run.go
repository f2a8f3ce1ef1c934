package sim

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"
)

// itemResult is the outcome of one prompt of a request.
type itemResult struct {
	digest        uint64
	promptTokens  int
	cached        int
	source        string
	prefillLeg    bool     // SGLang prefill leg: one token, finish length 0
	firsts        []uint32 // SGLang decode leg: each sample's prefill token, where generation continues
	inputLogprobs [][]any  // the part of the prompt's logprobs this engine reports
	choices       []choice
	kvParams      map[string]any // vLLM NIXL prefill: handoff params for the decode
}

type choice struct {
	tokens []uint32
	finish string
}

// inference is the handler of every generation route.
func (e *Engine) inference(rt route) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		e.stats.received.Add(1)
		body, err := io.ReadAll(r.Body)
		if err != nil {
			e.stats.cancelled.Add(1)
			return
		}
		f := e.faults(r)
		if f.Hang {
			<-ctx.Done()
			e.stats.cancelled.Add(1)
			return
		}
		if sleep(ctx, f.Latency) != nil {
			e.stats.cancelled.Add(1)
			return
		}
		// Refusals before the engine takes the request free the prefill's KV it names.
		if f.fails() {
			e.stats.failed.Add(1)
			e.refuseKV(body)
			e.writeError(w, errorf(f.Status, "injected fault: status %d", f.Status))
			return
		}
		j, aerr := e.parse(rt, r, body)
		if aerr != nil {
			e.stats.failed.Add(1)
			e.refuseKV(body)
			if aerr.inBand {
				e.writeStreamRefusal(w, rt, aerr)
				return
			}
			e.writeError(w, aerr)
			return
		}
		batch := 0
		if e.cfg.Engine == EngineVLLM {
			batch = e.cfg.MaxLoRAs
		}
		running, done := e.lora.queued(ctx, j.lora, batch)
		defer done()
		release, ok, err := e.admit(ctx)
		if ok && err == nil {
			var ran bool
			if ran, err = running(false); !ran && err == nil {
				// Its adapter may not run yet (the batch runs max_loras others): vLLM's scheduler
				// leaves it waiting and runs another request in the slot meanwhile.
				release()
				e.waiting.Add(1)
				_, err = running(true)
				e.waiting.Add(-1)
				if err == nil {
					release, err = e.slot(ctx)
				}
			} else if err != nil {
				release()
			}
		}
		if !ok {
			e.stats.rejected.Add(1)
			e.refuseKV(body)
			full := errorf(503, "The request queue is full.")
			if j.stream && e.cfg.Engine == EngineSGLang {
				e.writeStreamError(w, j, full) // SGLang aborts a queued stream in-band
				return
			}
			e.writeError(w, full)
			return
		}
		if err != nil {
			e.stats.cancelled.Add(1)
			return
		}
		defer release()
		results, aerr := e.run(ctx, j)
		if j.seq != nil {
			defer e.steps.end(j.seq)
			e.steps.decode(j.seq, decodeTokens(results))
		}
		if aerr != nil {
			if aerr.status == 499 {
				e.stats.cancelled.Add(1)
				return
			}
			e.stats.failed.Add(1)
			if j.stream {
				e.writeStreamError(w, j, aerr) // the stream's 200 went out before the engine failed
				return
			}
			e.writeError(w, aerr)
			return
		}
		if !e.cfg.EngineHeadersOnly {
			h := w.Header()
			h.Set(HeaderKVSource, results[0].source)
			h.Set(HeaderEngineID, e.engineIDs[j.rank])
			h.Set(HeaderDPRank, fmt.Sprint(j.rank))
		}
		if j.stream {
			err = e.writeStream(ctx, w, j, results, f)
		} else {
			if err = e.decode(ctx, j, results); err == nil {
				e.writeFull(w, j, results)
			}
		}
		if err != nil {
			e.stats.cancelled.Add(1)
			if err == errDropped {
				panic(http.ErrAbortHandler)
			}
			return
		}
		e.stats.ok.Add(1)
	}
}

// decode spends the decode cost of a whole answer's tokens, counting those computed: all of
// them, or as many as the time before the client left allowed.
func (e *Engine) decode(ctx context.Context, j *job, results []itemResult) error {
	n := 0
	for _, res := range results {
		for _, c := range res.choices {
			n += len(c.tokens)
		}
	}
	if j.seq != nil {
		err := e.steps.await(ctx, j.seq, j.seq.wanted())
		if err != nil {
			n = 0
		}
		e.stats.generated.Add(int64(n))
		return err
	}
	start := time.Now()
	err := sleep(ctx, time.Duration(n)*e.cfg.DecodePerToken)
	if err != nil && e.cfg.DecodePerToken > 0 {
		n = min(n, int(time.Since(start)/e.cfg.DecodePerToken))
	}
	e.stats.generated.Add(int64(n))
	return err
}

// stepPrefill computes a prompt in the step model: compute tokens of it, cached tokens of it
// already in the KV cache.
func (e *Engine) stepPrefill(ctx context.Context, j *job, compute, cached int) error {
	q, err := e.steps.prefill(ctx, j.seq, compute, cached)
	j.seq = q
	return err
}

// decodeTokens is how many tokens a request produces in the step model: each prompt's longest
// choice (n choices of a prompt decode side by side, one sequence each in an engine; the model
// runs them as one).
func decodeTokens(results []itemResult) int {
	total := 0
	for _, res := range results {
		longest := 0
		for _, c := range res.choices {
			longest = max(longest, len(c.tokens))
		}
		total += max(1, longest)
	}
	return total
}

// run does the prefill phase of every item (local compute, KV load, or rendezvous) and the
// generation, and pins handoff KV on a prefill engine.
func (e *Engine) run(ctx context.Context, j *job) ([]itemResult, *apiError) {
	results := make([]itemResult, len(j.items))
	for i, it := range j.items {
		res := &results[i]
		res.digest = Digest(it.prompt)
		res.promptTokens = len(it.prompt)
		if aerr := e.prefill(ctx, j, it, res); aerr != nil {
			return nil, aerr
		}
		for c := 0; c < j.n; c++ {
			s := j.s
			s.Seed += uint64(c)
			var ch choice
			switch {
			case res.prefillLeg:
				ch = choice{tokens: []uint32{Token(res.digest, s.Seed, 0)}, finish: FinishLength}
			default:
				ch.tokens, ch.finish = Generate(res.digest, s)
				if c < len(res.firsts) && len(ch.tokens) > 0 {
					ch.tokens[0] = res.firsts[c]
				}
			}
			res.choices = append(res.choices, ch)
		}
		e.maybePin(j, i, it, res) // vLLM pins every prompt of a batch (and answers the first's params)
	}
	return results, nil
}

// prefill fills res with where the item's KV came from, doing transfers and compute cost.
func (e *Engine) prefill(ctx context.Context, j *job, it item, res *itemResult) *apiError {
	n := len(it.prompt)
	local := func() error {
		cached := 0
		if e.prefix != nil {
			cached = e.prefixOf(j.rank).compute(it.prompt, j.lora)
			e.stats.cacheQueries.Add(int64(n))
			e.stats.cacheHits.Add(int64(cached))
		}
		res.source, res.cached = SourceRecompute, cached
		if cached > 0 {
			res.source = SourceLocalCache
		}
		e.stats.local.Add(int64(cached))
		e.stats.recompute.Add(int64(n - cached))
		if e.steps != nil {
			return e.stepPrefill(ctx, j, n-cached, cached)
		}
		return sleep(ctx, time.Duration(n-cached)*e.cfg.PrefillPerToken) // only the uncached tokens cost
	}
	remote := func(cached int) error {
		res.source, res.cached = SourceRemote, cached
		e.stats.remote.Add(int64(n - 1))
		e.stats.recompute.Add(1)
		if e.steps != nil {
			return e.stepPrefill(ctx, j, 1, n-1) // the transferred KV is held; the last token computed
		}
		return sleep(ctx, e.cfg.PrefillPerToken)
	}
	cancelled := func(err error) *apiError {
		if aerr, ok := err.(*apiError); ok {
			return aerr
		}
		if err != nil {
			return errorf(499, "cancelled")
		}
		return nil
	}
	if e.cfg.Engine == EngineVLLM {
		if j.kv != nil && j.kv.DoRemotePrefill && e.cfg.Role != RolePrefill {
			loaded, stale, aerr := e.loadRemote(ctx, j.kv, it.prompt)
			if aerr != nil {
				return aerr
			}
			if stale {
				res.digest ^= staleKV // the answer is built on whatever the freed blocks held
			}
			if loaded {
				return cancelled(remote(n - 1))
			}
		}
		return cancelled(local())
	}
	// SGLang.
	if j.returnLogprob {
		res.inputLogprobs = inputLogprobs(it.prompt, 0, n)
	}
	b := it.boot
	boots := it.samples
	if boots == nil {
		boots = []*bootstrap{b}
	}
	switch {
	case e.cfg.Role == RolePrefill:
		res.prefillLeg = true
		if b.fake() {
			return cancelled(local())
		}
		if j.returnLogprob { // the prefill reports the prompt but its last token; decode has that one
			res.inputLogprobs = inputLogprobs(it.prompt, 0, n-1)
		}
		for c, sb := range boots { // each sample is a request of its own, in its own room
			rank := j.rank
			if !j.routed && len(boots) > 1 {
				rank = int(sb.room % uint64(e.cfg.DPSize)) // follow_bootstrap_room
			}
			if aerr := e.prefillRendezvous(ctx, rank, sb.room, func() (roomKV, error) {
				err := local()
				return roomKV{Digest: fmt.Sprintf("%016x", res.digest), FirstToken: Token(res.digest, j.s.Seed+uint64(c), 0),
					PromptTokens: n, CachedTokens: 0, InputLogprobs: inputLogprobs(it.prompt, 0, n-1)}, err
			}); aerr != nil {
				return aerr
			}
		}
		return nil
	case e.cfg.Role == RoleDecode && b.fake():
		// SGLang's warm-up path: the decode skips the transfer and decodes on KV pages nothing
		// filled (python/sglang/srt/disaggregation/decode.py, _is_fake_transfer; fake/conn.py).
		res.digest ^= staleKV
		return cancelled(remote(0))
	case e.cfg.Role == RoleDecode:
		cached := 0
		for _, sb := range boots {
			port := e.cfg.BootstrapPort
			if sb.port != nil {
				port = *sb.port
			}
			kv, aerr := e.joinRoom(ctx, sb.host, port, sb.room, j.prefillRank)
			if aerr != nil {
				return aerr
			}
			if kv.Digest != fmt.Sprintf("%016x", res.digest) {
				e.stats.loadFail.Add(1)
				return errorf(500, "KV received for room %d is for a different prompt", sb.room)
			}
			res.firsts = append(res.firsts, kv.FirstToken)
			cached = kv.CachedTokens
		}
		if j.returnLogprob {
			res.inputLogprobs = inputLogprobs(it.prompt, n-1, n)
		}
		return cancelled(remote(cached))
	}
	return cancelled(local())
}

// staleKV changes the digest of a prompt whose KV was read from freed blocks: its answer
// differs from the one the prompt's own KV gives.
const staleKV = 0x5d1e_57a1_e0ff_ba5e

// inputLogprobs are SGLang's input_token_logprobs for prompt positions [from, to).
func inputLogprobs(prompt []uint32, from, to int) [][]any {
	out := make([][]any, 0, to-from)
	for i := from; i < to; i++ {
		var lp any
		if i > 0 {
			lp = Logprob(prompt[i], i)
		}
		out = append(out, []any{lp, prompt[i], nil})
	}
	return out
}

// maybePin pins the KV of a vLLM prefill request for a decode engine, the way the connectors
// do: only when the request asked for a remote decode, was not streamed, and ended by length.
func (e *Engine) maybePin(j *job, i int, it item, res *itemResult) {
	if e.cfg.Engine != EngineVLLM || e.cfg.Role == RoleDecode || e.cfg.KVConnector == ConnectorNone ||
		j.kv == nil || !j.kv.DoRemoteDecode || j.stream || res.choices[0].finish != FinishLength {
		return
	}
	p := &pinnedKV{Connector: e.cfg.KVConnector, EngineID: e.engineIDs[j.rank], PromptTokens: len(it.prompt),
		Digest: fmt.Sprintf("%016x", res.digest)}
	switch e.cfg.KVConnector {
	case ConnectorNixl:
		p.ID = j.reqID
		if i > 0 {
			p.ID = fmt.Sprintf("%s-%d", j.reqID, i) // per-prompt request ids, as vLLM's completions
		}
		e.kv.pin(p)
		blocks := make([]int, (len(it.prompt)+blockSize-1)/blockSize)
		for i := range blocks {
			blocks[i] = i
		}
		res.kvParams = map[string]any{
			"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": p.EngineID,
			"remote_block_ids": blocks, "remote_request_id": p.ID, "remote_host": e.cfg.Host,
			"remote_port": e.sidePorts[j.rank], "tp_size": 1,
		}
	case ConnectorMooncake:
		if j.kv.TransferID == nil || i > 0 { // "Missing transfer_id in kv_transfer_params from router!"
			return
		}
		p.ID = *j.kv.TransferID
		e.kv.pin(p)
	}
}
