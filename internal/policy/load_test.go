package policy

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/worker"
)

// busy puts n requests in flight on w, released at cleanup.
func busy(t *testing.T, w *worker.Worker, n int) {
	for i := 0; i < n; i++ {
		probe := w.Enter()
		t.Cleanup(func() { w.Leave(probe) })
	}
}

func TestLeastLoad(t *testing.T) {
	ws := fleet(3)
	busy(t, ws[0], 3)
	busy(t, ws[1], 1)
	busy(t, ws[2], 2)
	for i := 0; i < 20; i++ {
		if got := (LeastLoad{}).Pick(context.Background(), ws, nil); got != ws[1] {
			t.Fatalf("picked %s, want the least loaded %s", got, ws[1])
		}
	}
	// Ties are broken at random: both idle workers get traffic.
	idle := fleet(2)
	seen := map[*worker.Worker]bool{}
	for i := 0; i < 200; i++ {
		seen[(LeastLoad{}).Pick(context.Background(), idle, nil)] = true
	}
	if len(seen) != 2 {
		t.Errorf("ties went to %d of 2 idle workers", len(seen))
	}
}

func TestPowerOfTwo(t *testing.T) {
	ws := fleet(2)
	busy(t, ws[0], 5)
	for i := 0; i < 20; i++ {
		if got := (PowerOfTwo{}).Pick(context.Background(), ws, nil); got != ws[1] {
			t.Fatalf("of two, picked the busier %s", got)
		}
	}
	// Over many workers the busiest is never picked (it loses every comparison).
	many := fleet(5)
	busy(t, many[3], 9)
	for i := 0; i < 500; i++ {
		if got := (PowerOfTwo{}).Pick(context.Background(), many, nil); got == many[3] {
			t.Fatal("the busiest worker was picked")
		}
	}
	if got := (PowerOfTwo{}).Pick(context.Background(), many[:1], nil); got != many[0] {
		t.Error("one candidate")
	}
}

func chat(prompt string) *Request {
	return &Request{Model: "m", Path: "/v1/chat/completions", Body: []byte(`{"model":"m","messages":[{"role":"user","content":"` + prompt + `"}],"max_tokens":3}`)}
}

func TestPrefixHashIsStickyAndStable(t *testing.T) {
	p := &PrefixHash{PrefixBytes: 64, LoadFactor: 1.25}
	ws := fleet(5)
	// The same prefix always goes to the same worker, whatever follows it.
	long := "a long shared system prompt that every request of this group starts with"
	first := p.Pick(context.Background(), ws, chat(long+" and then question one"))
	for i := 0; i < 10; i++ {
		if got := p.Pick(context.Background(), ws, chat(fmt.Sprintf("%s and then question %d", long, i))); got != first {
			t.Fatalf("same prefix went to %s and %s", first, got)
		}
	}
	// Different prefixes spread over the workers.
	seen := map[*worker.Worker]int{}
	owner := map[string]*worker.Worker{}
	for i := 0; i < 200; i++ {
		pr := fmt.Sprintf("group %d asks", i)
		owner[pr] = p.Pick(context.Background(), ws, chat(pr))
		seen[owner[pr]]++
	}
	if len(seen) != 5 {
		t.Errorf("200 prefixes went to %d of 5 workers", len(seen))
	}
	// A worker leaving moves only the prefixes it held.
	gone := ws[2]
	rest := append(append([]*worker.Worker{}, ws[:2]...), ws[3:]...)
	for pr, w := range owner {
		if got := p.Pick(context.Background(), rest, chat(pr)); w != gone && got != w {
			t.Fatalf("prefix %q moved from %s to %s when %s left", pr, w, got, gone)
		}
	}
}

func TestPrefixHashSpillsFromAnOverloadedWorker(t *testing.T) {
	p := &PrefixHash{PrefixBytes: 64, LoadFactor: 1.25}
	ws := fleet(4)
	hot := chat("the hot prefix everyone sends")
	home := p.Pick(context.Background(), ws, hot)
	busy(t, home, 8) // mean 2: limit 1.25·2+1 = 3.5
	if got := p.Pick(context.Background(), ws, hot); got == home {
		t.Fatalf("the hot prefix stayed on its overloaded worker %s", home)
	}
	// Without a prompt: least loaded.
	if got := p.Pick(context.Background(), ws, &Request{Path: "/v1/chat/completions", Body: []byte(`{}`)}); got == home {
		t.Error("a request without a prompt went to the busiest worker")
	}
}

// An engine's own report counts (it sees every replica's requests), a queue twice; a stale
// report is ignored.
func TestLoadTrustsOnlyFreshEngineReports(t *testing.T) {
	ws := fleet(2)
	now := time.Now()
	ws[0].SetEngineLoad(worker.EngineLoad{Running: 4, Waiting: 3, At: now, Until: now.Add(time.Minute), HasRunning: true, HasWaiting: true})
	if got := load(ws[0]); got != 10 {
		t.Errorf("load %v, want running+waiting 7 plus waiting 3", got)
	}
	if got := (LeastLoad{}).Pick(context.Background(), ws, nil); got != ws[1] {
		t.Errorf("least_load picked %s, busy in its engine's own report", got)
	}
	ws[0].SetEngineLoad(worker.EngineLoad{Running: 40, Waiting: 30, At: now.Add(-time.Hour), Until: now.Add(-time.Minute)})
	busy(t, ws[1], 1)
	if got := load(ws[0]); got != 0 {
		t.Errorf("a stale report still counts: load %v", got)
	}
	if got := (LeastLoad{}).Pick(context.Background(), ws, nil); got != ws[0] {
		t.Errorf("least_load believed a stale report")
	}
}
