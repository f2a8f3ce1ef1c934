package director

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/admit"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/worker"
)

// The queue: a slot, a wait past its timeout, a full queue, a client that left, a drain; no
// bound at all.
func TestAdmission(t *testing.T) {
	m := metrics.New(worker.NewRegistry())
	a := newAdmission(queueSettings{Max: 1, QueueSize: 1, QueueTimeout: 50 * time.Millisecond}, m, nil)
	ctx := context.Background()
	release, _, ok := a.acquire(ctx, &record.Record{}, admit.Default, admit.Default, 10, 10)
	if !ok {
		t.Fatal("the first request was not admitted")
	}
	// One may wait; it times out with 504 queue_timeout and Retry-After.
	if _, e, ok := a.acquire(ctx, &record.Record{}, admit.Default, admit.Default, 10, 10); ok || e == nil || e.Status != 504 || e.RetryAfter == "" || e.Code != openai.CodeQueueTimeout {
		t.Errorf("queued past its timeout: admitted %v, %+v", ok, e)
	}
	// While one waits, the next finds the queue full.
	waiting := make(chan bool)
	go func() {
		_, _, ok := a.acquire(ctx, &record.Record{}, admit.Default, admit.Default, 10, 10)
		waiting <- ok
	}()
	for a.s.Waiting(admit.Default) == 0 {
		time.Sleep(time.Millisecond)
	}
	if _, e, ok := a.acquire(ctx, &record.Record{}, admit.Default, admit.Default, 10, 10); ok || e == nil || e.Status != 503 || e.Code != openai.CodeQueueFull {
		t.Errorf("queue full: admitted %v, %+v", ok, e)
	}
	release()
	if !<-waiting {
		t.Error("the waiting request did not get the released slot")
	}
	// A client that leaves while waiting is answered nothing and takes no slot.
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	if _, e, ok := a.acquire(gone, &record.Record{}, admit.Default, admit.Default, 10, 10); ok || e != nil {
		t.Errorf("a gone client: admitted %v, answered %+v", ok, e)
	}
	// Drain: a waiting request gets 503 server_draining at once.
	done := make(chan *openai.Error)
	go func() {
		_, e, _ := a.acquire(ctx, &record.Record{}, admit.Batch, admit.Batch, 1, 1)
		done <- e
	}()
	for a.s.Waiting(admit.Batch) == 0 {
		time.Sleep(time.Millisecond)
	}
	a.drain()
	if e := <-done; e == nil || e.Status != 503 || e.Code != openai.CodeDraining {
		t.Errorf("drained: %+v", e)
	}
	if release, _, ok := (*admission)(nil).acquire(ctx, &record.Record{}, admit.Default, admit.Default, 0, 0); !ok || release == nil {
		t.Error("no admission limit refused a request")
	}
}

// The configuration's per-class settings reach the scheduler by class.
func TestClassSettings(t *testing.T) {
	size := 1000
	reserved, depth, timeout, promote := ClassSettings(config.Admission{ReservedSlots: map[string]int{"critical": 2},
		Classes: map[string]config.QueueClass{"batch": {Size: &size, Timeout: 10 * time.Minute, PromoteAfter: 2 * time.Minute}}})
	if reserved[admit.Critical] != 2 || reserved[admit.Batch] != 0 || depth[admit.Batch] == nil || *depth[admit.Batch] != 1000 ||
		depth[admit.Default] != nil || timeout[admit.Batch] != 10*time.Minute || timeout[admit.Default] != 0 ||
		promote[admit.Batch] != 2*time.Minute || promote[admit.Default] != 0 {
		t.Errorf("reserved %v, depth %v, timeout %v, promote %v", reserved, depth, timeout, promote)
	}
}

// queue_retry_after is the Retry-After of every refusal of the queue, rounded up to seconds;
// without it, a tenth of the timeout (at least a second).
func TestQueueRetryAfter(t *testing.T) {
	m := metrics.New(worker.NewRegistry())
	ctx := context.Background()
	for _, c := range []struct {
		after, timeout time.Duration
		want           string
	}{
		{0, time.Minute, "6"},
		{0, 50 * time.Millisecond, "1"},
		{1500 * time.Millisecond, time.Minute, "2"},
		{2 * time.Minute, time.Minute, "120"},
	} {
		a := newAdmission(admissionOf(config.Admission{MaxConcurrentRequests: 1, QueueSize: 0, QueueTimeout: c.timeout, QueueRetryAfter: c.after}), m, nil)
		release, _, ok := a.acquire(ctx, &record.Record{}, admit.Default, admit.Default, 1, 1)
		if !ok {
			t.Fatal("the first request was not admitted")
		}
		if _, e, ok := a.acquire(ctx, &record.Record{}, admit.Default, admit.Default, 1, 1); ok || e == nil || e.Code != openai.CodeQueueFull || e.RetryAfter != c.want {
			t.Errorf("queue_retry_after %v, timeout %v: %+v; want Retry-After %s", c.after, c.timeout, e, c.want)
		}
		release()
	}
}

// Load shed is in the log as well as in the metric: the first refusal for want of a slot logs a
// WARN at once, the next ones within the minute none (a burst is not a line per refusal), and
// the first after the minute one that counts every refusal since — the soak found a burst far
// over capacity refused thousands of requests without a line.
func TestShedLoadIsLoggedOnceAMinute(t *testing.T) {
	var logs gwtest.SyncBuffer
	a := newAdmission(queueSettings{Max: 1, QueueSize: 0}, metrics.New(worker.NewRegistry()), slog.New(slog.NewTextHandler(&logs, nil)))
	ctx := context.Background()
	release, _, ok := a.acquire(ctx, &record.Record{}, admit.Default, admit.Default, 1, 1)
	if !ok {
		t.Fatal("the first request was not admitted")
	}
	defer release()
	refuse := func(n int) {
		for range n {
			if _, e, ok := a.acquire(ctx, &record.Record{}, admit.Default, admit.Default, 1, 1); ok || e == nil || e.Code != openai.CodeQueueFull {
				t.Fatalf("admitted %v, %+v", ok, e)
			}
		}
	}
	refuse(50)
	if got := strings.Count(logs.String(), "shedding load"); got != 1 || !strings.Contains(logs.String(), "refused=1 ") {
		t.Fatalf("50 refusals in a burst: %d WARN lines, want 1 for the first:\n%s", got, logs.String())
	}
	a.shed.mu.Lock()
	a.shed.last = a.shed.last.Add(-shedEvery) // a minute on
	a.shed.mu.Unlock()
	refuse(1)
	if got := strings.Count(logs.String(), "shedding load"); got != 2 || !strings.Contains(logs.String(), "refused=50 ") {
		t.Errorf("a minute on: %d WARN lines, want a second counting the 50 refused since:\n%s", got, logs.String())
	}
}

// An episode's end is in the log: a burst's refusals after its first are told a minute after
// the first WARN even when no refusal comes after, and nothing more is said once none came (a
// hostile review found the rest of a burst logged only by the next burst, or never).
func TestTheEndOfALoadShedIsLogged(t *testing.T) {
	var logs gwtest.SyncBuffer
	a := newAdmission(queueSettings{Max: 1, QueueSize: 0}, metrics.New(worker.NewRegistry()), slog.New(slog.NewTextHandler(&logs, nil)))
	a.shed.every = 100 * time.Millisecond // the minute, shortened
	ctx := context.Background()
	release, _, ok := a.acquire(ctx, &record.Record{}, admit.Default, admit.Default, 1, 1)
	if !ok {
		t.Fatal("the first request was not admitted")
	}
	defer release()
	for range 30 {
		if _, e, ok := a.acquire(ctx, &record.Record{}, admit.Default, admit.Default, 1, 1); ok || e == nil {
			t.Fatalf("admitted %v, %+v", ok, e)
		}
	}
	poll.Until(t, "the burst's rest logged", func() bool { return strings.Contains(logs.String(), "refused=29 ") })
	time.Sleep(300 * time.Millisecond) // three more periods without a refusal
	if got := strings.Count(logs.String(), "shedding load"); got != 2 {
		t.Errorf("%d WARN lines for one burst, want the first and its summary:\n%s", got, logs.String())
	}
}
