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
	"runtime"
	"runtime/debug"
	"runtime/metrics"
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
