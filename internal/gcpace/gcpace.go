// Package gcpace paces Go's collector for a process whose live heap is small and whose
// allocation rate is high, as a gateway's is: each request allocates a few KiB that die with it,
// while the heap that survives a collection is a few MiB. At GOGC=100 the collector then runs
// whenever the heap has doubled — dozens of times a second under load, each cycle scanning
// stacks and globals for almost nothing. A heap floor lets garbage accumulate up to floor bytes
// before a cycle, and changes nothing once the live heap is large enough for GOGC to pace it:
// the goal of each cycle is max(live × (1 + GOGC/100), floor), and a memory limit (GOMEMLIMIT)
// still caps it.
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
// or floor 0 it does nothing. Calls may nest; the first one's floor holds until the last stop.
func Floor(bytes uint64) (stop func()) {
	mu.Lock()
	defer mu.Unlock()
	if bytes == 0 || (refs == 0 && percent() < 0) {
		return func() {}
	}
	refs++
	if refs == 1 {
		floor, base = bytes, percent()
		set = base
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
	if p := percentFor(liveHeap(), floor, base); p != set {
		debug.SetGCPercent(p)
		set = p
	}
	arm(e)
}

// percentFor is the GOGC that puts the next cycle's goal at max(live × (1 + base/100), floor).
func percentFor(live, floor uint64, base int) int {
	live = max(live, 1<<20)
	if live*uint64(100+base)/100 >= floor {
		return base
	}
	p := (floor - live) * 100 / live
	return int(min(p, 1<<20))
}

// CgroupMemoryMax is where a container's memory limit is read (cgroup v2).
const CgroupMemoryMax = "/sys/fs/cgroup/memory.max"

// MemoryLimit is the process's memory limit: GOMEMLIMIT when set, else the cgroup's memory.max
// read from cgroupMax. from names the one used, "" when none is known.
func MemoryLimit(cgroupMax string) (limit int64, from string) {
	if l := debug.SetMemoryLimit(-1); l > 0 && l != math.MaxInt64 {
		return l, "GOMEMLIMIT"
	}
	if b, err := os.ReadFile(cgroupMax); err == nil {
		if n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && n > 0 {
			return n, "the cgroup memory limit"
		}
	}
	return 0, ""
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

// Percent is the collector's percent now (GOGC as paced), for tests and reports.
func Percent() int { return percent() }

func percent() int {
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	return int(s[0].Value.Uint64()) // GOGC=off reads as the uint64 of -1
}

func liveHeap() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return s[0].Value.Uint64()
}
