package policy

import (
	"fmt"
	"testing"

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
		if got, want := p.Pick(ws), ws[i%3]; got != want {
			t.Fatalf("pick %d: got %s, want %s", i, got, want)
		}
	}
}

func TestRandomCoversAll(t *testing.T) {
	ws := fleet(4)
	seen := map[*worker.Worker]int{}
	for i := 0; i < 400; i++ {
		seen[Random{}.Pick(ws)]++
	}
	if len(seen) != 4 {
		t.Fatalf("random picked %d distinct workers of 4 in 400 picks", len(seen))
	}
}

func TestNew(t *testing.T) {
	for _, name := range []string{"round_robin", "random"} {
		if _, err := New(name); err != nil {
			t.Errorf("New(%q): %v", name, err)
		}
	}
	if _, err := New("cache_aware"); err == nil {
		t.Error("New(cache_aware): want error")
	}
}

func BenchmarkPolicies(b *testing.B) {
	ws := fleet(16)
	for _, name := range []string{"round_robin", "random"} {
		p, _ := New(name)
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				p.Pick(ws)
			}
		})
	}
}
