package kvevents

import (
	"fmt"
	"runtime"
	"testing"
)

func seq(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

func stored(hashes []uint64, parent uint64, tokens []uint32, bs int) Event {
	return Event{Kind: KindStored, Hashes: hashes, Parent: parent, HasParent: parent != 0, Tokens: tokens, BlockSize: bs}
}

func TestIndexFollowsTheEngine(t *testing.T) {
	x := NewIndex(1000)
	prompt := seq(100, 16) // four blocks of 4
	keys := Keys("m", "", prompt, 4)
	// The engine stores the first two blocks, then the next two chained to them.
	a := x.Apply("w1", "m", Batch{Events: []Event{stored([]uint64{901, 902}, 0, prompt[:8], 4)}})
	a2 := x.Apply("w1", "m", Batch{Events: []Event{stored([]uint64{903, 904}, 902, prompt[8:], 4)}})
	if a.Stored != 2 || a2.Stored != 2 {
		t.Fatalf("applied %+v %+v", a, a2)
	}
	if got := x.Match(keys); got["w1"] != 4 || len(got) != 1 {
		t.Fatalf("match %v, want w1 holding all 4 blocks", got)
	}
	// Another model, or another LoRA adapter, shares nothing with it.
	if got := x.Match(Keys("other", "", prompt, 4)); len(got) != 0 {
		t.Fatalf("another model matched %v", got)
	}
	if got := x.Match(Keys("m", "adapter", prompt, 4)); len(got) != 0 {
		t.Fatalf("a LoRA adapter matched %v", got)
	}
	// A request that diverges after block 2 matches 2.
	other := append(append([]uint32{}, prompt[:8]...), seq(500, 8)...)
	if got := x.Match(Keys("m", "", other, 4)); got["w1"] != 2 {
		t.Fatalf("diverging prompt matched %v, want 2", got)
	}
	// The engine evicts block 2: only block 1 still leads.
	x.Apply("w1", "m", Batch{Events: []Event{{Kind: KindRemoved, Hashes: []uint64{902}}}})
	if got := x.Match(keys); got["w1"] != 1 {
		t.Fatalf("after removing block 2 matched %v, want 1", got)
	}
	// All cleared (or a restart): nothing.
	x.Apply("w1", "m", Batch{Events: []Event{{Kind: KindCleared}}})
	if got := x.Match(keys); len(got) != 0 {
		t.Fatalf("after AllBlocksCleared matched %v", got)
	}
	if n, _ := x.Size(); n != 0 {
		t.Fatalf("size %d after clearing, want 0", n)
	}
}

func TestIndexRefusesOrphansAndBounds(t *testing.T) {
	x := NewIndex(3)
	prompt := seq(1, 8)
	// A chain whose parent the index never saw is not recorded as a root.
	a := x.Apply("w", "m", Batch{Events: []Event{stored([]uint64{7}, 6, prompt[4:], 4)}})
	if a.Orphans != 1 || a.Stored != 0 {
		t.Fatalf("orphan applied %+v", a)
	}
	// Tokens missing (a CPU-tier announcement): dropped, not guessed.
	a = x.Apply("w", "m", Batch{Events: []Event{{Kind: KindStored, Hashes: []uint64{1}, BlockSize: 4}}})
	if a.Dropped != 1 {
		t.Fatalf("tokenless block applied %+v", a)
	}
	// The bound holds; blocks past it are dropped and counted.
	a = x.Apply("w", "m", Batch{Events: []Event{stored([]uint64{1, 2, 3, 4, 5}, 0, seq(1, 10), 2)}})
	if n, dropped := x.Size(); n != 3 || dropped != 2 || a.Stored != 3 || a.Dropped != 2 {
		t.Fatalf("size %d dropped %d applied %+v, want 3 and 2", n, dropped, a)
	}
	// Removing a hash the index does not hold is harmless.
	if a := x.Apply("w", "m", Batch{Events: []Event{{Kind: KindRemoved, Hashes: []uint64{99}}}}); a.Removed != 0 {
		t.Fatalf("removing an unknown block: %+v", a)
	}
}

func TestIndexRanksAndWorkers(t *testing.T) {
	x := NewIndex(100)
	prompt := seq(1, 8)
	keys := Keys("m", "", prompt, 4)
	x.Apply("w", "m", Batch{DPRank: 0, HasDPRank: true, Events: []Event{stored([]uint64{1}, 0, prompt[:4], 4)}})
	x.Apply("w", "m", Batch{DPRank: 1, HasDPRank: true, Events: []Event{stored([]uint64{1, 2}, 0, prompt, 4)}})
	x.Apply("v", "m", Batch{Events: []Event{stored([]uint64{1}, 0, prompt[:4], 4)}})
	if got := x.Match(keys); got["w"] != 2 || got["v"] != 1 {
		t.Fatalf("match %v, want w 2 (its rank 1) and v 1", got)
	}
	// Rank 1's eviction leaves rank 0's block.
	x.Apply("w", "m", Batch{DPRank: 1, HasDPRank: true, Events: []Event{{Kind: KindRemoved, Hashes: []uint64{1, 2}}}})
	if got := x.Match(keys); got["w"] != 1 {
		t.Fatalf("after rank 1 evicted, match %v", got)
	}
	x.ClearWorker("w")
	if got := x.Match(keys); got["w"] != 0 || got["v"] != 1 {
		t.Fatalf("after clearing w, match %v", got)
	}
	// The same engine hash announced again with other tokens replaces the old block.
	x.Apply("v", "m", Batch{Events: []Event{stored([]uint64{1}, 0, seq(50, 4), 4)}})
	if got := x.Match(keys); len(got) != 0 {
		t.Fatalf("a reused engine hash still matched the old tokens: %v", got)
	}
	if n, _ := x.Size(); n != 1 {
		t.Fatalf("size %d, want 1", n)
	}
}

// BenchmarkApply: block events ingested per second on one core, and the index's memory per
// block held.
func BenchmarkApply(b *testing.B) {
	const perEvent, bs = 16, 16
	batches := make([]Batch, 1024)
	for i := range batches {
		hashes := make([]uint64, perEvent)
		for j := range hashes {
			hashes[j] = uint64(i*perEvent + j + 1)
		}
		batches[i] = Batch{Events: []Event{stored(hashes, 0, seq(i*perEvent*bs, perEvent*bs), bs)}}
	}
	remove := func(i int) Batch {
		return Batch{Events: []Event{{Kind: KindRemoved, Hashes: batches[i].Events[0].Hashes}}}
	}
	x := NewIndex(1 << 30)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		k := i % len(batches)
		x.Apply("w", "m", batches[k])
		x.Apply("w", "m", remove(k))
		i++
	}
	b.ReportMetric(float64(2*perEvent*i)/b.Elapsed().Seconds(), "block-events/s")

	// Memory: about a million distinct blocks held, over 16 workers.
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	y := NewIndex(1 << 30)
	for c := 0; c < 1_000_000/perEvent; c++ {
		hashes := make([]uint64, perEvent)
		for j := range hashes {
			hashes[j] = uint64(c*perEvent + j + 1)
		}
		y.Apply(fmt.Sprint("w", c%16), "m", Batch{Events: []Event{stored(hashes, 0, seq(c*perEvent*bs, perEvent*bs), bs)}})
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	n, _ := y.Size()
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(n)*1e6/(1<<20), "MiB/M-blocks")
	runtime.KeepAlive(y)
}
