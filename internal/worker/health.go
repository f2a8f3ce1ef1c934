package worker

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"
)

// HealthChecker probes every registered worker periodically (GET Endpoint): a worker leaves
// rotation after FailureThreshold failed probes in a row and rejoins after SuccessThreshold good
// ones, so an engine that restarts is routable again without restarting Baton.
type HealthChecker struct {
	Registry         *Registry
	Client           *http.Client
	Log              *slog.Logger
	Interval         time.Duration
	Timeout          time.Duration
	FailureThreshold int
	SuccessThreshold int
	Endpoint         string
	// OnProbe, when set, is called with every probe's result (for metrics).
	OnProbe func(w *Worker, ok bool)
	// OnBack, when set, is called when a worker that failed its health checks passes them
	// again, before it is back in rotation.
	OnBack func(w *Worker)

	wg sync.WaitGroup
}

// Start runs the probe loop until ctx ends; Wait waits for it.
func (h *HealthChecker) Start(ctx context.Context) {
	h.wg.Go(func() {
		t := time.NewTicker(h.Interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				h.CheckAll(ctx)
			}
		}
	})
}

// Wait waits for the probe loop to end.
func (h *HealthChecker) Wait() { h.wg.Wait() }

// CheckAll probes every registered worker once, concurrently, and applies the thresholds.
func (h *HealthChecker) CheckAll(ctx context.Context) {
	var wg sync.WaitGroup
	for _, w := range h.Registry.Snapshot().Workers {
		if !w.Registered() {
			continue // the registrar owns it until it first answers
		}
		wg.Go(func() { h.apply(w, h.probe(ctx, w)) })
	}
	wg.Wait()
}

func (h *HealthChecker) probe(ctx context.Context, w *Worker) bool {
	ctx, cancel := context.WithTimeout(ctx, h.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.URL+h.Endpoint, nil)
	if err != nil {
		return false
	}
	if w.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+w.APIKey)
	}
	resp, err := h.Client.Do(req)
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	return resp.StatusCode >= 200 && resp.StatusCode <= 299
}

func (h *HealthChecker) apply(w *Worker, ok bool) {
	if h.OnProbe != nil {
		h.OnProbe(w, ok)
	}
	if ok {
		w.healthFails.Store(0)
		if n := w.healthOKs.Add(1); !w.Ready() && int(n) >= h.SuccessThreshold {
			if h.OnBack != nil {
				h.OnBack(w) // before it takes traffic again
			}
			w.SetReady(true)
			h.Log.Info("worker healthy again; back in rotation", "worker", w.URL, "role", w.Role)
		}
		return
	}
	w.healthOKs.Store(0)
	if n := w.healthFails.Add(1); w.Ready() && int(n) >= h.FailureThreshold {
		w.SetReady(false)
		h.Log.Warn("worker failed its health checks; out of rotation", "worker", w.URL, "role", w.Role, "failures", n)
	}
}
