package gcpace

import (
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"testing"

	"github.com/baton-llm/baton/internal/poll"
)

func TestPercentFor(t *testing.T) {
	const mib = 1 << 20
	for _, c := range []struct {
		live, floor uint64
		base, want  int
	}{
		{3 * mib, 64 * mib, 100, 2033},  // next cycle at 64 MiB, not 6
		{0, 64 * mib, 100, 6300},        // an empty heap counts as 1 MiB
		{32 * mib, 64 * mib, 100, 100},  // GOGC already reaches the floor
		{200 * mib, 64 * mib, 100, 100}, // a large heap is GOGC's
		{20 * mib, 64 * mib, 400, 400},  // the operator's GOGC, when it reaches further
		{20 * mib, 64 * mib, 50, 220},   // … and the floor above a low one
		{1, 1 << 62, 100, 1 << 20},      // bounded
	} {
		if got := percentFor(c.live, c.floor, c.base); got != c.want {
			t.Errorf("percentFor(%d, %d, %d) = %d, want %d", c.live, c.floor, c.base, got, c.want)
		}
	}
}

func cycles() uint64 {
	s := []metrics.Sample{{Name: "/gc/cycles/total:gc-cycles"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

var sink []byte

// churn allocates n bytes of garbage in 8 KiB pieces, as requests do, and returns how many
// collections ran meanwhile.
func churn(n int) uint64 {
	c0 := cycles()
	for i := 0; i < n/8192; i++ {
		sink = make([]byte, 8192)
	}
	sink = nil
	return cycles() - c0
}

func paced(t *testing.T) {
	t.Helper()
	runtime.GC() // the first cycle arms the pacing; its cleanup sets the percent
	poll.Until(t, "the pacer set the percent", func() bool { return Percent() > 100 })
}

// With a floor, garbage well under it runs no collection; after the last stop the process is
// back at GOGC and the same garbage runs several.
func TestFloorSparesCyclesAndStopRestores(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	stop := Floor(256 << 20)
	paced(t)
	if n := churn(48 << 20); n > 1 {
		t.Errorf("48 MiB of garbage under a 256 MiB floor ran %d collections", n)
	}
	// Nested: an inner stop leaves the pacing on.
	inner := Floor(1 << 20)
	inner()
	inner()
	if p := Percent(); p <= 100 {
		t.Errorf("an inner stop restored the percent: %d", p)
	}
	stop()
	if p := Percent(); p != 100 {
		t.Fatalf("after the last stop the percent is %d, want 100", p)
	}
	runtime.GC()
	runtime.GC() // a cleanup armed before the stop must not set it again
	if p := Percent(); p != 100 {
		t.Fatalf("a cleanup after the stop set the percent to %d", p)
	}
	if n := churn(48 << 20); n < 3 {
		t.Errorf("48 MiB of garbage at GOGC=100 ran only %d collections: the test cannot tell pacing from none", n)
	}
}

// A live heap that GOGC already paces past the floor is left at GOGC.
func TestLargeLiveHeapKeepsGOGC(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	stop := Floor(16 << 20)
	defer stop()
	paced(t)
	live := make([][]byte, 0, 3000)
	for range 3000 {
		live = append(live, make([]byte, 8192)) // 24 MiB live: × 2 is past the floor
	}
	poll.Until(t, "the percent back at GOGC", func() bool { runtime.GC(); return Percent() == 100 })
	runtime.KeepAlive(live)
}

// GOGC=off is the operator's: Floor leaves it alone.
func TestGOGCOffIsLeftAlone(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	stop := Floor(64 << 20)
	defer stop()
	runtime.GC()
	runtime.GC()
	if p := Percent(); p != -1 {
		t.Errorf("GOGC=off became %d", p)
	}
}

// A floor is bounded by a quarter of the memory limit, which comes from GOMEMLIMIT, else the
// cgroup's memory.max.
func TestBoundAndMemoryLimit(t *testing.T) {
	if b := Bound(16<<20, 0); b != 16<<20 {
		t.Errorf("no limit: %d", b)
	}
	if b := Bound(1<<40, 1<<30); b != 1<<28 {
		t.Errorf("a 1 TiB floor under a 1 GiB limit: %d", b)
	}
	if b := Bound(16<<20, 1<<30); b != 16<<20 {
		t.Errorf("a 16 MiB floor under a 1 GiB limit: %d", b)
	}
	dir := t.TempDir()
	cg := func(v string) string {
		p := filepath.Join(dir, "memory.max")
		if err := os.WriteFile(p, []byte(v+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if l, from := MemoryLimit(cg("max")); from != "" || l != 0 {
		t.Errorf("memory.max \"max\": %d %q", l, from)
	}
	if l, from := MemoryLimit(cg("536870912")); from != "the cgroup memory limit" || l != 512<<20 {
		t.Errorf("memory.max 512 MiB: %d %q", l, from)
	}
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(300 << 20))
	if l, from := MemoryLimit(cg("536870912")); from != "GOMEMLIMIT" || l != 300<<20 {
		t.Errorf("GOMEMLIMIT over the cgroup: %d %q", l, from)
	}
}
