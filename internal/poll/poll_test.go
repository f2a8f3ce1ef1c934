package poll

import (
	"sync/atomic"
	"testing"
	"time"
)

// Until returns once the condition holds, having checked it until then.
func TestUntilWaitsForTheCondition(t *testing.T) {
	var n atomic.Int32
	done := make(chan struct{})
	go func() {
		time.Sleep(30 * time.Millisecond)
		n.Store(1)
		close(done)
	}()
	checks := 0
	Until(t, "the flag", func() bool { checks++; return n.Load() == 1 })
	<-done
	if checks < 2 {
		t.Errorf("checked %d times: it did not wait", checks)
	}
}
