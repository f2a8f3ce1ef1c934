// Package retry holds the one backoff schedule Baton waits by: between attempts of a request,
// and between registration attempts of an engine that is not up yet.
package retry

import (
	"context"
	"math/rand/v2"
	"time"
)

// Backoff is an exponential, jittered schedule: Initial before the first retry, multiplied by
// Multiplier after each, capped at Max, each wait randomised by ± Jitter of itself.
type Backoff struct {
	Initial    time.Duration
	Max        time.Duration // zero: no cap
	Multiplier float64       // below 1 counts as 1
	Jitter     float64       // fraction in [0, 1]; zero: exact waits
}

// Delay returns the wait before retry n (n = 1 is the wait after the first attempt).
func (b Backoff) Delay(n int) time.Duration {
	d := float64(b.Initial)
	for i := 1; i < n; i++ {
		d *= max(b.Multiplier, 1)
		if b.Max > 0 && d >= float64(b.Max) {
			break
		}
	}
	if b.Max > 0 {
		d = min(d, float64(b.Max))
	}
	if b.Jitter > 0 {
		d += d * b.Jitter * (2*rand.Float64() - 1)
	}
	return time.Duration(d)
}

// Sleep waits d, or until ctx ends; it reports whether the whole wait passed.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
