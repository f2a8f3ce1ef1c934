package retry

import (
	"context"
	"testing"
	"time"
)

func TestDelay(t *testing.T) {
	b := Backoff{Initial: 50 * time.Millisecond, Max: 200 * time.Millisecond, Multiplier: 2}
	for n, want := range map[int]time.Duration{1: 50 * time.Millisecond, 2: 100 * time.Millisecond, 3: 200 * time.Millisecond, 4: 200 * time.Millisecond, 60: 200 * time.Millisecond} {
		if got := b.Delay(n); got != want {
			t.Errorf("Delay(%d) = %s, want %s", n, got, want)
		}
	}
	b.Jitter = 0.2
	for i := 0; i < 1000; i++ {
		if d := b.Delay(1); d < 40*time.Millisecond || d > 60*time.Millisecond {
			t.Fatalf("jittered Delay(1) = %s, want within ±20%% of 50ms", d)
		}
	}
}

func TestSleepEndsWithTheContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if Sleep(ctx, time.Hour) {
		t.Error("Sleep on a cancelled context reported a full wait")
	}
	if !Sleep(context.Background(), time.Millisecond) {
		t.Error("Sleep did not report a full wait")
	}
}
