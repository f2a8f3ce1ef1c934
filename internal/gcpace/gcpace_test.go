package gcpace

import (
	"math"
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
		name               string
		live, roots, floor uint64
		base, want         int
	}{
		{"the goal at the floor", 3 * mib, mib / 2, 16 * mib, 100, 371},
		{"an empty heap: the runtime's minimum is the bound", 0, mib / 2, 16 * mib, 100, 400},
		{"a tiny heap under a large floor: ten times GOGC", mib, mib / 2, 256 * mib, 100, 1000},
		{"GOGC already reaches the floor", 8 * mib, mib / 2, 16 * mib, 100, 100},
		{"a large heap is GOGC's", 200 * mib, mib, 16 * mib, 100, 100},
		{"the operator's GOGC, when it reaches further", 3 * mib, mib / 2, 16 * mib, 500, 500},
		{"the floor above a low GOGC", 3 * mib, mib / 2, 16 * mib, 50, 371},
		{"GOGC=off", 3 * mib, 0, 16 * mib, -1, -1},
		{"GOGC=0", 3 * mib, 0, 16 * mib, 0, 0},
		{"no overflow at the flag's largest floor and a huge GOGC", 1 << 40, 1 << 30, 1 << 30, math.MaxInt32, math.MaxInt32},
		{"no overflow at the largest floor", 0, 0, math.MaxUint64, 100, 1000},
		{"never past what SetGCPercent takes", 0, 0, 1 << 50, 300_000_000, math.MaxInt32},
	} {
		if got := percentFor(c.live, c.roots, c.floor, c.base); got != c.want {
			t.Errorf("%s: percentFor(%d, %d, %d, %d) = %d, want %d", c.name, c.live, c.roots, c.floor, c.base, got, c.want)
		}
	}
}

// Goal is the heap size at which the next collection is due, as the runtime reckons it now.
func Goal() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/goal:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// near says whether the runtime's goal is within 10 % of want.
func near(goal, want uint64) bool { return goal > want*9/10 && goal < want*11/10 }

// With a floor, the next collection is due at the floor, by the runtime's own goal — from the
// start, before any collection — and not past it; nested stops leave it on; after the last stop
// the process is back at its GOGC and its goal.
func TestFloorSetsTheGoalAndStopRestores(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(math.MaxInt64)) // a GOMEMLIMIT would cap the goal
	runtime.GC()
	plain := Goal()
	const floor = 32 << 20
	if plain > floor/4 {
		t.Fatalf("the test process's goal at GOGC=100 is already %d", plain)
	}
	stop := Floor(floor)
	defer stop() // once: also stopped below
	if g := Goal(); !near(g, floor) {
		t.Errorf("goal as Floor returns: %d, want about %d", g, floor)
	}
	runtime.GC()
	poll.Until(t, "the goal at the floor after a collection", func() bool { return near(Goal(), floor) })
	inner := Floor(1 << 20)
	inner()
	inner()
	if g := Goal(); !near(g, floor) {
		t.Errorf("an inner stop moved the goal to %d", g)
	}
	stop()
	if p := Percent(); p != 100 {
		t.Fatalf("after the last stop the percent is %d, want 100", p)
	}
	runtime.GC()
	runtime.GC() // a cleanup armed before the stop must not set the percent again
	if p, g := Percent(), Goal(); p != 100 || g > floor/4 {
		t.Fatalf("after the stop and two collections: percent %d, goal %d", p, g)
	}
}

// A live heap that GOGC already paces past the floor is left at GOGC; one that jumped is paced
// at most at ten times GOGC until the next collection's cleanup.
func TestALargeLiveHeapIsGOGCs(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(math.MaxInt64))
	stop := Floor(16 << 20)
	defer stop()
	if p := Percent(); p <= 100 || p > 1000 {
		t.Fatalf("a small heap under a 16 MiB floor: percent %d", p)
	}
	live := make([][]byte, 0, 3000)
	for range 3000 {
		live = append(live, make([]byte, 8192)) // 24 MiB live: GOGC alone reaches past the floor
	}
	poll.Until(t, "the percent back at GOGC", func() bool { runtime.GC(); return Percent() == 100 })
	runtime.KeepAlive(live)
}

// GOGC=off and GOGC=0 are the operator's: Floor leaves them alone.
func TestGOGCOffOrZeroIsLeftAlone(t *testing.T) {
	for _, p := range []int{-1, 0} {
		old := debug.SetGCPercent(p)
		stop := Floor(64 << 20)
		runtime.GC()
		runtime.GC()
		if got := Percent(); got != p {
			t.Errorf("GOGC=%d became %d", p, got)
		}
		stop()
		debug.SetGCPercent(old)
	}
}

// A floor is bounded by a quarter of the memory limit: the smaller of GOMEMLIMIT and the
// container's (cgroup v2's memory.max, else v1's memory.limit_in_bytes).
func TestBoundAndMemoryLimit(t *testing.T) {
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(math.MaxInt64)) // whatever the environment set
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
	file := func(name, v string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(v+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	absent := filepath.Join(dir, "absent")
	v1 := file("v1", "536870912")
	for _, c := range []struct {
		name  string
		files []string
		gomem int64
		want  int64
		from  string
	}{
		{"none", []string{absent}, math.MaxInt64, 0, ""},
		{"v2 says max", []string{file("v2max", "max"), v1}, math.MaxInt64, 0, ""},
		{"v2", []string{file("v2", "268435456"), v1}, math.MaxInt64, 256 << 20, "the cgroup memory limit"},
		{"v1, where there is no v2", []string{absent, v1}, math.MaxInt64, 512 << 20, "the cgroup memory limit"},
		{"v1 unlimited", []string{absent, file("v1max", "9223372036854771712")}, math.MaxInt64, 0, ""},
		{"GOMEMLIMIT under the container's", []string{v1}, 300 << 20, 300 << 20, "GOMEMLIMIT"},
		{"the container's under GOMEMLIMIT", []string{v1}, 10 << 30, 512 << 20, "the cgroup memory limit"},
	} {
		debug.SetMemoryLimit(c.gomem)
		if l, from := MemoryLimit(c.files...); l != c.want || from != c.from {
			t.Errorf("%s: %d %q, want %d %q", c.name, l, from, c.want, c.from)
		}
	}
}
