package bench

import (
	"bytes"
	"strings"
	"testing"
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
