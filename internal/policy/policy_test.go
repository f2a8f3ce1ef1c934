package policy

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

func fleet(n int) []*worker.Worker {
	ws := make([]*worker.Worker, n)
	for i := range ws {
		ws[i] = worker.New(config.Worker{URL: fmt.Sprintf("http://w%d", i)})
	}
	return ws
}

func TestRoundRobinCycles(t *testing.T) {
	ws := fleet(3)
	p := &RoundRobin{}
	for i := 0; i < 7; i++ {
		if got, want := p.Pick(context.Background(), ws, nil), ws[i%3]; got != want {
			t.Fatalf("pick %d: got %s, want %s", i, got, want)
		}
	}
}

func TestRandomCoversAll(t *testing.T) {
	ws := fleet(4)
	seen := map[*worker.Worker]int{}
	for i := 0; i < 400; i++ {
		seen[Random{}.Pick(context.Background(), ws, nil)]++
	}
	if len(seen) != 4 {
		t.Fatalf("random picked %d distinct workers of 4 in 400 picks", len(seen))
	}
}

func TestNew(t *testing.T) {
	for _, name := range config.Policies {
		if _, err := New(name, config.Default()); err != nil {
			t.Errorf("New(%q): %v", name, err)
		}
	}
	if _, err := New("bucket", config.Default()); err == nil {
		t.Error("New(bucket): want error")
	}
}

func BenchmarkPolicies(b *testing.B) {
	ws := fleet(16)
	req := chat("a system prompt of some length that many requests share, followed by the user's question")
	for _, name := range config.Policies {
		p, _ := New(name, config.Default())
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				p.Pick(context.Background(), ws, req)
			}
		})
	}
}

func selectorFleet(specs ...config.Worker) (*Selector, []*worker.Worker) {
	var ws []*worker.Worker
	for _, c := range specs {
		w := worker.New(c)
		in := &worker.Info{Runtime: config.RuntimeVLLM}
		for _, m := range c.Models {
			in.Models = append(in.Models, worker.Model{ID: m})
		}
		w.SetInfo(in)
		w.SetReady(true)
		ws = append(ws, w)
	}
	reg := worker.NewRegistry(ws...)
	return &Selector{Registry: reg, Policies: map[string]Policy{
		config.RoleRegular: &RoundRobin{}, config.RolePrefill: &RoundRobin{}, config.RoleDecode: &RoundRobin{},
	}, Pairs: &worker.PairHealth{Threshold: 1, Quarantine: time.Hour}}, ws
}

func TestSelectorWorker(t *testing.T) {
	sel, ws := selectorFleet(
		config.Worker{URL: "http://a", Models: []string{"m"}},
		config.Worker{URL: "http://b", Models: []string{"m"}},
		config.Worker{URL: "http://c", Models: []string{"other"}},
	)
	req := &Request{Model: "m"}
	seen := map[*worker.Worker]bool{}
	for i := 0; i < 4; i++ {
		w, err := sel.Worker(context.Background(), config.RoleRegular, req, nil)
		if err != nil {
			t.Fatal(err)
		}
		seen[w] = true
	}
	if len(seen) != 2 || seen[ws[2]] {
		t.Errorf("chose %v, want a and b only", seen)
	}
	// The workers to avoid are avoided while others remain, and chosen when none do.
	for i := 0; i < 4; i++ {
		if w, _ := sel.Worker(context.Background(), config.RoleRegular, req, map[string]bool{"http://a": true}); w != ws[1] {
			t.Errorf("avoiding a chose %s", w)
		}
	}
	if w, _ := sel.Worker(context.Background(), config.RoleRegular, req, map[string]bool{"http://a": true, "http://b": true}); w == nil {
		t.Error("avoiding every candidate chose none")
	}
	// Unhealthy workers are filtered; none left is a 503-kind error, an unknown model a 404-kind.
	ws[0].SetReady(false)
	ws[1].SetReady(false)
	var nw *NoWorkerError
	if _, err := sel.Worker(context.Background(), config.RoleRegular, req, nil); !errors.As(err, &nw) || nw.Unserved {
		t.Errorf("no ready worker: %v", err)
	}
	if _, err := sel.Worker(context.Background(), config.RoleRegular, &Request{Model: "nobody"}, nil); !errors.As(err, &nw) || !nw.Unserved {
		t.Errorf("unknown model: %v", err)
	}
}

func TestSelectorPairAvoidsQuarantine(t *testing.T) {
	sel, ws := selectorFleet(
		config.Worker{URL: "http://p", Role: config.RolePrefill},
		config.Worker{URL: "http://d1", Role: config.RoleDecode},
		config.Worker{URL: "http://d2", Role: config.RoleDecode},
	)
	sel.Pairs.Record(ws[0], ws[1], false) // threshold 1: p+d1 quarantined
	for i := 0; i < 4; i++ {
		p, err := sel.Pair(context.Background(), &Request{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if p.Prefill != ws[0] || p.Decode != ws[2] {
			t.Fatalf("pair %s+%s, want p+d2 while p+d1 is quarantined", p.Prefill, p.Decode)
		}
	}
	ws[2].SetReady(false) // every other decode gone: the quarantined pair is better than none
	if p, err := sel.Pair(context.Background(), &Request{}, nil); err != nil || p.Decode != ws[1] {
		t.Fatalf("pair %v, %v", p, err)
	}
	ws[1].SetReady(false)
	var nw *NoWorkerError
	if _, err := sel.Pair(context.Background(), &Request{}, nil); !errors.As(err, &nw) || nw.Role != config.RoleDecode {
		t.Errorf("no decode: %v", err)
	}
}
