package bench

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// A CPU figure measured over fewer ticks than give ±5 % is marked, and the table gets the note
// explaining the mark once; a figure measured over enough is printed as it is.
func TestCPUFiguresBelowResolutionAreMarked(t *testing.T) {
	var out bytes.Buffer
	r := &runner{out: &out}
	if got := r.cpuCell(measured{cpu: 0.05}, "%.1f", 12.34); got != "12.3 †" {
		t.Errorf("5 ticks: %q", got)
	}
	if got := r.cpuCell(measured{cpu: 0}, "%.1f", 0); got != "0.0 †" {
		t.Errorf("under one tick: %q", got)
	}
	r.cpuNote()
	if n := strings.Count(out.String(), "† below the measuring resolution"); n != 1 {
		t.Errorf("%d notes: %q", n, out.String())
	}
	out.Reset()
	if got := r.cpuCell(measured{cpu: 0.2}, "%.3f", 1.5); got != "1.500" {
		t.Errorf("20 ticks: %q", got)
	}
	r.cpuNote()
	if out.Len() != 0 {
		t.Errorf("a note without a marked figure: %q", out.String())
	}
}

// TestRoundSpreadSaysEachRoundsRatio: the spread is of each round's ratio against the reference's
// share in the same round, not of the sums; one round has no spread.
func TestRoundSpreadSaysEachRoundsRatio(t *testing.T) {
	share := func(n int, secs, cpu float64) measured {
		return measured{s: Stats{N: n, Elapsed: time.Duration(secs * float64(time.Second))}, cpu: cpu}
	}
	ref := measured{name: "nginx", rounds: []measured{share(1000, 1, 0.1), share(1000, 2, 0.2)}}
	b := measured{name: "Baton", rounds: []measured{share(1000, 0.5, 0.15), share(2000, 2, 0.8)}}
	got := roundSpread([]measured{ref, b}, "nginx")
	// round 1: CPU 150/100 µs = 1.50×, throughput 2000/1000 = 2.00×; round 2: 400/200 = 2.00×, 1000/500 = 2.00×
	if want := "Baton CPU 1.50 – 2.00×, throughput 2.00 – 2.00×"; !strings.Contains(got, want) {
		t.Fatalf("spread %q lacks %q", got, want)
	}
	ref.rounds, b.rounds = ref.rounds[:1], b.rounds[:1]
	if got := roundSpread([]measured{ref, b}, "nginx"); got != "" {
		t.Fatalf("one round gave a spread: %q", got)
	}
}
