package worker

import (
	"fmt"
	"sync"
	"testing"

	"github.com/baton-llm/baton/internal/config"
)

// A worker keeps the parsed URL of at most maxTargets paths, however many distinct paths
// requests name and however many race to name them first; every path past the bound still gets
// its own URL.
func TestTargetKeepsABoundedNumberOfPaths(t *testing.T) {
	w := New(config.Worker{URL: "http://engine:8000"})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 500 {
				p := fmt.Sprintf("/v1/r%d-%d", g, i)
				u, err := w.Target(p)
				if err != nil || u.String() != "http://engine:8000"+p {
					t.Errorf("Target(%q) = %v, %v", p, u, err)
					return
				}
			}
		})
	}
	wg.Wait()
	kept := 0
	w.targets.Range(func(any, any) bool { kept++; return true })
	if kept > maxTargets {
		t.Fatalf("%d paths kept, the bound is %d", kept, maxTargets)
	}
}
