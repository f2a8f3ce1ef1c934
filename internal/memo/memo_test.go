package memo

import (
	"sync"
	"sync/atomic"
	"testing"
)

// TestMapRemembersWithinItsBound: racing goroutines get one value per key while under the
// bound (made once unless two raced on the same new key), keys past the bound are made each
// time and never kept.
func TestMapRemembersWithinItsBound(t *testing.T) {
	m := Map[int, int]{Max: 100}
	var made atomic.Int64
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 3 {
				for k := range 150 {
					if v := m.Get(k, func() int { made.Add(1); return k * 2 }); v != k*2 {
						t.Errorf("Get(%d) = %d, want %d", k, v, k*2)
					}
				}
			}
		})
	}
	wg.Wait()
	if m.Len() != 100 {
		t.Fatalf("%d remembered, bound 100", m.Len())
	}
	if !m.Has(0) || m.Has(149) {
		t.Fatalf("Has(0) = %v, Has(149) = %v: want the first keys kept, the last not", m.Has(0), m.Has(149))
	}
	// Past the bound every Get makes it: 50 keys × 3 passes × 4 goroutines at least.
	if n := made.Load(); n < 600 || n > 600+4*100 {
		t.Fatalf("made %d times, want 600 past the bound and at most one per goroutine per kept key", n)
	}
}
