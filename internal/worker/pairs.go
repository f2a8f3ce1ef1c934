package worker

import (
	"sync"
	"time"
)

// Pair is the prefill and decode workers chosen for one PD request.
type Pair struct {
	Prefill, Decode *Worker
}

// Both are the pair's workers, its prefill first.
func (p Pair) Both() []*Worker { return []*Worker{p.Prefill, p.Decode} }

// PairHealth quarantines a prefill/decode pair whose requests keep failing at the seam (the KV
// handoff) while each worker may look healthy on its own. Selection then prefers other decode
// workers for that prefill until the quarantine ends.
type PairHealth struct {
	Threshold  int           // consecutive seam failures that quarantine a pair
	Quarantine time.Duration // how long
	Now        func() time.Time

	mu sync.Mutex
	m  map[[2]*Worker]*pairState
}

type pairState struct {
	fails int
	until time.Time
}

func (p *PairHealth) now() time.Time {
	if p.Now != nil {
		return p.Now()
	}
	return time.Now()
}

// Record takes the outcome of one request on the pair at the seam.
func (p *PairHealth) Record(prefill, decode *Worker, ok bool) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	key := [2]*Worker{prefill, decode}
	st := p.m[key]
	if ok {
		if st != nil {
			delete(p.m, key)
		}
		return
	}
	if p.m == nil {
		p.m = map[[2]*Worker]*pairState{}
	}
	if st == nil {
		st = &pairState{}
		p.m[key] = st
	}
	st.fails++
	if st.fails >= p.Threshold {
		st.until = p.now().Add(p.Quarantine)
		st.fails = 0
	}
}

// Quarantined reports whether the pair is quarantined now.
func (p *PairHealth) Quarantined(prefill, decode *Worker) bool {
	if p == nil {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	st := p.m[[2]*Worker{prefill, decode}]
	return st != nil && p.now().Before(st.until)
}

// Forget drops the pairs w is part of: it left the fleet (or was replaced by an update).
func (p *PairHealth) Forget(w *Worker) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for k := range p.m {
		if k[0] == w || k[1] == w {
			delete(p.m, k)
		}
	}
}

// Len is the number of pairs with a failure on record.
func (p *PairHealth) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.m)
}
