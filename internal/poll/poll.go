// Package poll is how Baton's tests wait for what happens on its own time (a worker registered,
// a counter moved, a goroutine ended): one helper, one bound, instead of sleeping and hoping.
package poll

import (
	"testing"
	"time"
)

// Timeout bounds every wait: far above what a slow CI machine needs, so that a failure means
// the condition never came.
const Timeout = 15 * time.Second

// Until checks cond every few milliseconds until it holds, and fails t, naming what it waited
// for, when it has not within Timeout.
func Until(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(Timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", Timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
