package sim

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// Perf is the step-level performance model of an engine's continuous batching, after vLLM's
// V1 scheduler (vllm/v1/core/sched/scheduler.py, Scheduler.schedule): every step has a budget
// of MaxBatchedTokens tokens; the running requests are served first — a decoding request one
// token, a prefilling one the next chunk of its prompt (at most LongPrefill tokens when set) —
// then waiting requests are admitted first come, first served while budget, MaxSeqs and KV
// blocks last. A running request that cannot get the KV blocks it needs preempts the
// latest-admitted running request, which frees its blocks and goes back to the front of the
// queue to compute its whole context again. Prefill chunks and decodes share a step: the step
// lasts as long as its compute or its memory traffic needs, whichever is longer, so a
// prefill-heavy step slows every decode in it.
//
// A step costs StepOverhead + max(tokens × ComputePerToken, WeightRead + context × KVReadPerToken):
// the roofline of a dense model, its matrix products compute-bound in the tokens of the step
// and its decode memory-bound in the weights read once per step and the KV read per decoding
// token of context. DefaultPerf gives the figures and where they come from (docs/ENGINES.md).
type Perf struct {
	MaxBatchedTokens int // vLLM --max-num-batched-tokens: the token budget of a step
	MaxSeqs          int // vLLM --max-num-seqs: requests running at once
	LongPrefill      int // vLLM --long-prefill-token-threshold: a prefill chunk's bound; 0 none
	BlockSize        int // tokens per KV block (vLLM --block-size)
	KVBlocks         int // the KV cache's capacity in blocks

	StepOverhead    time.Duration // a step's fixed cost (scheduling, launches, sampling)
	ComputePerToken time.Duration // the compute of one token in a step (2 × parameters FLOPs)
	WeightRead      time.Duration // reading the weights once: a step's memory floor
	KVReadPerToken  time.Duration // reading one token of a decoding request's context
}

// DefaultPerf models Llama-3.1-8B in BF16 on one H100 SXM with vLLM's defaults for an API
// server on that GPU (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults: 8,192 batched
// tokens, 1,024 sequences; block size 16). The costs come from the published figures of the
// model and the GPU, at stated efficiencies (docs/ENGINES.md, "The step model"):
//   - compute: 2 × 8.03 B parameters = 16.1 GFLOP per token at 55 % of 989 TFLOPS → 29.5 µs;
//   - weights: 16.1 GB read at 80 % of 3.35 TB/s → 6.0 ms per step;
//   - KV: 32 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes = 128 KiB per token → 49 ns;
//   - KV capacity: 90 % of 80 GB less the weights and 4 GB of activations ≈ 52 GB → 25,000
//     blocks of 16 tokens (400,000 tokens);
//   - 1 ms of fixed cost per step.
func DefaultPerf() Perf {
	return Perf{MaxBatchedTokens: 8192, MaxSeqs: 1024, BlockSize: 16, KVBlocks: 25_000,
		StepOverhead: time.Millisecond, ComputePerToken: 29500 * time.Nanosecond,
		WeightRead: 6 * time.Millisecond, KVReadPerToken: 49 * time.Nanosecond}
}

func (p Perf) validate() error {
	switch {
	case p.MaxBatchedTokens < 1 || p.MaxSeqs < 1 || p.BlockSize < 1 || p.KVBlocks < 1:
		return fmt.Errorf("the step model needs a positive token budget, sequence bound, block size and KV capacity: %+v", p)
	case p.LongPrefill < 0 || p.StepOverhead < 0 || p.ComputePerToken < 0 || p.WeightRead < 0 || p.KVReadPerToken < 0:
		return fmt.Errorf("the step model's costs and chunk bound cannot be negative: %+v", p)
	}
	return nil
}

// stepTime is how long a step of prefill+decode scheduled tokens and ctx tokens of decoding
// context lasts.
func (p Perf) stepTime(tokens, ctx int) time.Duration {
	compute := time.Duration(tokens) * p.ComputePerToken
	memory := p.WeightRead + time.Duration(ctx)*p.KVReadPerToken
	return p.StepOverhead + max(compute, memory)
}

// stepper runs the step model: its queue, its running batch and its KV blocks.
type stepper struct {
	p     Perf
	mu    sync.Mutex
	work  chan struct{} // a request arrived while idle
	wait  []*seq        // waiting, first come first served (preempted ones at the front)
	run   []*seq        // running, in the order admitted
	used  int           // KV blocks held
	wake  chan struct{} // closed after every step
	stop  chan struct{}
	steps int64
	// preempted counts requests preempted for KV blocks.
	preempted int64
	// clock is the model's time: the sum of its steps' durations.
	clock time.Duration
}

// seq is one request in the step model. Its prompt is computed in chunks (pending: tokens left
// to compute; held: context tokens whose KV it holds); the end of a prefill produces a token
// (vLLM samples the prompt's last position), every decode step one more.
type seq struct {
	pending  int // prompt (or, after a preemption, context) tokens left to compute
	held     int // context tokens in the KV cache
	blocks   int // KV blocks held
	produced int // tokens produced
	want     int // tokens to produce; -1 while unknown (the request is still prefilling)
	done     bool
	trace    []time.Duration // when (model time) each token came, when traced (tests)
}

func newStepper(p Perf) *stepper {
	s := &stepper{p: p, work: make(chan struct{}, 1), wake: make(chan struct{}), stop: make(chan struct{})}
	go s.loop()
	return s
}

func (s *stepper) close() { close(s.stop) }

// counts returns the running and waiting requests and the KV cache's usage (0..1).
func (s *stepper) counts() (running, waiting int, usage float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.run), len(s.wait), float64(s.used) / float64(s.p.KVBlocks)
}

// prefill queues compute tokens of prompt to compute, with cached tokens of it already in the
// KV cache (a prefix cache hit or a KV transfer), and waits until the prefill produced its
// token. A nil seq starts the request; later calls add a prompt to it (a batch of prompts).
func (s *stepper) prefill(ctx context.Context, q *seq, compute, cached int) (*seq, error) {
	compute = max(1, compute) // the prompt's last position is always computed
	s.mu.Lock()
	if q == nil {
		q = &seq{want: -1}
	}
	if (q.held+q.pending+cached+compute+s.p.BlockSize-1)/s.p.BlockSize > s.p.KVBlocks {
		s.mu.Unlock()
		return q, errorf(400, "This model's KV cache holds %d tokens; the request needs %d.", s.p.KVBlocks*s.p.BlockSize, q.held+q.pending+cached+compute)
	}
	if q.held == 0 && q.pending == 0 && q.produced == 0 {
		s.wait = append(s.wait, q)
	}
	q.held += cached
	q.pending += compute
	target := q.produced + 1
	s.mu.Unlock()
	s.poke()
	if err := s.await(ctx, q, target); err != nil {
		return q, err
	}
	return q, nil
}

// poke wakes the loop if it sleeps for want of work.
func (s *stepper) poke() {
	select {
	case s.work <- struct{}{}:
	default:
	}
}

// decode sets how many tokens the request produces in all (the prefills' included).
func (s *stepper) decode(q *seq, total int) {
	s.mu.Lock()
	q.want = max(total, q.produced)
	s.mu.Unlock()
	s.poke()
}

// wanted is how many tokens q produces in all.
func (q *seq) wanted() int { return max(q.want, 1) }

// await waits until q produced n tokens.
func (s *stepper) await(ctx context.Context, q *seq, n int) error {
	for {
		s.mu.Lock()
		got, wake := q.produced, s.wake
		s.mu.Unlock()
		if got >= n {
			return nil
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return ctx.Err()
		case <-s.stop:
			return context.Canceled
		}
	}
}

// end takes q out of the model, freeing its KV blocks.
func (s *stepper) end(q *seq) {
	if q == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	q.done = true
	s.used -= q.blocks
	q.blocks = 0
	s.run = remove(s.run, q)
	s.wait = remove(s.wait, q)
	s.poke() // its blocks may admit a waiting request
}

func remove(l []*seq, q *seq) []*seq {
	for i, x := range l {
		if x == q {
			return append(l[:i], l[i+1:]...)
		}
	}
	return l
}

// need is how many tokens q would compute in a step with budget tokens left.
func (s *stepper) need(q *seq, budget int) int {
	switch {
	case q.pending > 0:
		n := min(q.pending, budget)
		if s.p.LongPrefill > 0 {
			n = min(n, s.p.LongPrefill)
		}
		return n
	case q.want > q.produced:
		return min(1, budget)
	}
	return 0
}

// blocksFor is the KV blocks q needs to hold n more tokens of context.
func (s *stepper) blocksFor(q *seq, n int) int {
	return (q.held+n+s.p.BlockSize-1)/s.p.BlockSize - q.blocks
}

// preemptLast frees the latest-admitted running request's blocks and queues it again at the
// front, to compute its whole context anew (vLLM's recompute preemption).
func (s *stepper) preemptLast() *seq {
	v := s.run[len(s.run)-1]
	s.run = s.run[:len(s.run)-1]
	s.used -= v.blocks
	v.blocks = 0
	v.pending = v.held + v.pending
	v.held = 0
	s.wait = append([]*seq{v}, s.wait...)
	s.preempted++
	return v
}

type scheduled struct {
	q      *seq
	tokens int
}

// schedule picks a step's work: the running requests, then the waiting ones.
func (s *stepper) schedule() (out []scheduled, tokens, ctx int) {
	budget := s.p.MaxBatchedTokens
	preempted := false
	for i := 0; i < len(s.run) && budget > 0; i++ {
		q := s.run[i]
		n := s.need(q, budget)
		if n == 0 {
			continue
		}
		for s.blocksFor(q, n) > s.p.KVBlocks-s.used {
			preempted = true
			if s.preemptLast() == q {
				n = 0
				break
			}
		}
		if n == 0 {
			break
		}
		s.used += s.blocksFor(q, n)
		q.blocks += s.blocksFor(q, n)
		out = append(out, scheduled{q, n})
		budget -= n
		if q.pending == 0 {
			ctx += q.held
		}
	}
	// A step that preempted admits no one (vLLM schedules the waiting only without preemptions).
	for !preempted && len(s.wait) > 0 && budget > 0 && len(s.run) < s.p.MaxSeqs {
		q := s.wait[0]
		n := s.need(q, budget)
		b := s.blocksFor(q, n)
		if b > s.p.KVBlocks-s.used {
			break // vLLM stops admitting when the next request's blocks cannot be had
		}
		s.wait = s.wait[1:]
		s.run = append(s.run, q)
		s.used += b
		q.blocks += b
		if n > 0 {
			out = append(out, scheduled{q, n})
			budget -= n
		}
	}
	for _, x := range out {
		tokens += x.tokens
	}
	return out, tokens, ctx
}

// loop runs steps while there is work, and sleeps while there is none.
func (s *stepper) loop() {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		batch, d := s.next()
		if len(batch) == 0 {
			select {
			case <-s.work:
				continue
			case <-s.stop:
				return
			}
		}
		timer.Reset(d)
		select {
		case <-timer.C:
		case <-s.stop:
			return
		}
		s.apply(batch, d)
	}
}

// next schedules a step: its work and how long it lasts.
func (s *stepper) next() ([]scheduled, time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	batch, tokens, ctx := s.schedule()
	return batch, s.p.stepTime(tokens, ctx)
}

// apply ends a step of duration d: its prompts' chunks computed, its tokens produced.
func (s *stepper) apply(batch []scheduled, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.clock += d
	for _, x := range batch {
		q := x.q
		if q.done {
			continue // ended while the step ran
		}
		q.held += x.tokens
		if q.pending > 0 {
			q.pending -= x.tokens
			if q.pending > 0 {
				continue
			}
		}
		q.produced++ // a decode's token, or the one at a prefill's end
		if q.trace != nil {
			q.trace = append(q.trace, s.clock)
		}
	}
	s.steps++
	close(s.wake)
	s.wake = make(chan struct{})
}

// Offered is a request offered to the step model in model time: it arrives At, computes
// Compute prompt tokens (Cached more of its context already held: a prefix cache hit or a KV
// transfer) and produces Want tokens in all (a prefill leg: one).
type Offered struct {
	At                    time.Duration
	Compute, Cached, Want int
}

// Replay runs offered (in arrival order) through the step model with no clock, in model time
// only, and returns each request's time from its arrival to its first and to its last token:
// what a single engine of these costs would give that load, for whoever predicts it.
func Replay(p Perf, offered []Offered) (first, last []time.Duration, err error) {
	if err := p.validate(); err != nil {
		return nil, nil, err
	}
	s := &stepper{p: p, work: make(chan struct{}, 1), wake: make(chan struct{}), stop: make(chan struct{})}
	first, last = make([]time.Duration, len(offered)), make([]time.Duration, len(offered))
	at := make(map[*seq]int, 64)
	next := 0
	for next < len(offered) || len(s.run)+len(s.wait) > 0 {
		for next < len(offered) && offered[next].At <= s.clock {
			o := offered[next]
			if o.Compute+o.Cached+1 > p.KVBlocks*p.BlockSize {
				return nil, nil, fmt.Errorf("request %d needs %d tokens of KV; the model holds %d", next, o.Compute+o.Cached+1, p.KVBlocks*p.BlockSize)
			}
			q := &seq{pending: max(1, o.Compute), held: o.Cached, want: max(1, o.Want)}
			s.wait = append(s.wait, q)
			at[q] = next
			next++
		}
		batch, d := s.next()
		if len(batch) == 0 {
			if next >= len(offered) {
				return nil, nil, fmt.Errorf("the step model stalled with %d running and %d waiting", len(s.run), len(s.wait))
			}
			s.clock = offered[next].At // idle until the next arrival
			continue
		}
		s.apply(batch, d)
		for _, x := range batch {
			q, i := x.q, at[x.q]
			if q.produced == 1 && first[i] == 0 {
				first[i] = s.clock - offered[i].At
			}
			if q.produced >= q.want && !q.done {
				last[i] = s.clock - offered[i].At
				s.end(q)
				delete(at, q)
			}
		}
	}
	return first, last, nil
}
