// Package gcpace paces Go's collector for a process whose live heap is small and whose
// allocation rate is high, as a gateway's is: each request allocates a few KiB that die with it,
// while the heap that survives a collection is a few MiB. At GOGC=100 the collector then runs
// whenever the heap has doubled — dozens of times a second under load, each cycle scanning
// stacks and globals for almost nothing. A heap floor lets garbage accumulate up to the floor
// before a cycle, and changes nothing once the live heap is large enough for GOGC to pace it.
// It works by the runtime's own knob: after each collection it sets the percent that puts the
// next cycle's goal at the floor, by the runtime's reckoning of a goal, never under GOGC and never
// over ten times it; a memory limit (GOMEMLIMIT) still caps every goal.
package gcpace

import (
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync"
)

var (
	mu    sync.Mutex
	refs  int
	floor uint64
	base  int    // the percent the process had before the first Floor (GOGC, 100 by default)
	set   int    // the percent last set
	epoch uint64 // bumped by the last stop, so that a cleanup armed before it does nothing
)

// Floor starts pacing the collector with a heap floor of bytes, process-wide, and returns a
// function that stops it (the last stop restores the percent the process had). With GOGC=off
// or GOGC=0 (the operator's) or floor 0 it does nothing. Calls may nest; the first one's floor
// holds until the last stop.
func Floor(bytes uint64) (stop func()) {
	mu.Lock()
	defer mu.Unlock()
	if bytes == 0 || (refs == 0 && Percent() <= 0) {
		return func() {}
	}
	refs++
	if refs == 1 {
		floor, base = bytes, Percent()
		set = base
		tune() // the first cycle too: at GOGC alone it would come at 4 MiB
		arm(epoch)
	}
	var once sync.Once
	return func() { once.Do(release) }
}

func release() {
	mu.Lock()
	defer mu.Unlock()
	if refs--; refs == 0 {
		epoch++
		debug.SetGCPercent(base)
	}
}

// sentinel holds a pointer so that it never comes from the tiny allocator, whose blocks are
// freed only when every object in them is: its cleanup runs after the first cycle that finds it
// unreachable, which is the next one.
type sentinel struct {
	_ *byte
	_ [8]byte
}

// arm sets the percent for the cycle to come after each collection.
func arm(e uint64) {
	runtime.AddCleanup(new(sentinel), collected, e)
}

func collected(e uint64) {
	mu.Lock()
	defer mu.Unlock()
	if e != epoch || refs == 0 {
		return
	}
	tune()
	arm(e)
}

// tune sets the percent for the heap the last collection left; mu is held.
func tune() {
	live, roots := heapNow()
	if p := percentFor(live, roots, floor, base); p != set {
		debug.SetGCPercent(p)
		set = p
	}
}

// HeapMinimum is the runtime's smallest goal at GOGC=100 (defaultHeapMinimum in
// runtime/mgcpacer.go): at GOGC=p it is HeapMinimum × p/100, so a floor under that is never
// used.
const HeapMinimum = 4 << 20

// maxRaise bounds the percent set to this many times GOGC. The percent is set after a cycle by a
// cleanup, which a busy CPU runs late: until it does, a live heap that jumped is paced by the
// percent set for the small one, so a cycle may come at up to (1 + maxRaise × GOGC/100) times it.
const maxRaise = 10

// percentFor is the GOGC that puts the next cycle's goal at floor, by the runtime's reckoning
// of a goal (runtime/mgcpacer.go, Go 1.21 and later): live + (live + roots) × GOGC/100, where
// roots are the stacks and globals it scans, and never under HeapMinimum × GOGC/100. It is never
// under base (where base already reaches the floor, or base is off) and never over maxRaise × base.
func percentFor(live, roots, floor uint64, base int) int {
	if base <= 0 {
		return base
	}
	l, f := float64(live), float64(floor)
	p := (f - l) * 100 / max(l+float64(roots), 1)
	p = min(p, f*100/HeapMinimum, maxRaise*float64(base))
	if p <= float64(base) {
		return base
	}
	return int(min(p, math.MaxInt32)) // SetGCPercent takes an int32: past it, it would read as off
}

// CgroupLimitFiles are where a container's memory limit is read: cgroup v2's memory.max, then
// v1's memory.limit_in_bytes.
var CgroupLimitFiles = []string{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}

// MemoryLimit is the process's memory limit: the smaller of GOMEMLIMIT (when set) and the
// container's, read from cgroupFiles (cgroup v1 says "no limit" with a number near 2^63, v2 with
// "max"). from names the one used, "" when none is known.
func MemoryLimit(cgroupFiles ...string) (limit int64, from string) {
	if l := debug.SetMemoryLimit(-1); l > 0 && l != math.MaxInt64 {
		limit, from = l, "GOMEMLIMIT"
	}
	for _, f := range cgroupFiles {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && n > 0 && n < 1<<62 && (from == "" || n < limit) {
			limit, from = n, "the cgroup memory limit"
		}
		break
	}
	return limit, from
}

// Bound is the floor Floor should be given for a wish of floor bytes under a memory limit of
// limit (0: none known): at most a quarter of the limit, so that garbage kept for the sake of
// fewer cycles never crowds what the process must hold.
func Bound(floor, limit int64) int64 {
	if limit > 0 {
		return min(floor, limit/4)
	}
	return floor
}

// Percent is the collector's percent now (GOGC as paced; GOGC=off reads as -1).
func Percent() int {
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	return int(s[0].Value.Uint64()) // GOGC=off is stored as the uint64 of -1
}

// heapNow reads what the last collection left: the live heap, and the stacks and globals the
// collector scans.
func heapNow() (live, roots uint64) {
	s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}, {Name: "/gc/scan/stack:bytes"}, {Name: "/gc/scan/globals:bytes"}}
	metrics.Read(s)
	for i, v := range s {
		if v.Value.Kind() != metrics.KindUint64 {
			continue
		}
		if i == 0 {
			live = v.Value.Uint64()
		} else {
			roots += v.Value.Uint64()
		}
	}
	return live, roots
}
