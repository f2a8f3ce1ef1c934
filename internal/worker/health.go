package worker

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"syscall"
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

// probe asks w's engine once; nil when it answered 2xx, else what the probe got.
func (h *HealthChecker) probe(ctx context.Context, w *Worker) *HealthFailure {
	ctx, cancel := context.WithTimeout(ctx, h.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.URL+h.Endpoint, nil)
	if err != nil {
		return &HealthFailure{Cause: HealthError, Detail: err.Error()}
	}
	if w.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+w.APIKey)
	}
	resp, err := h.Client.Do(req)
	if err != nil {
		return probeError(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 200 && resp.StatusCode <= 299 {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		return nil
	}
	said, _ := io.ReadAll(io.LimitReader(resp.Body, maxHealthDetail))
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	cause := HealthStatusOther
	switch {
	case resp.StatusCode >= 500:
		cause = HealthStatus5xx
	case resp.StatusCode >= 400:
		cause = HealthStatus4xx
	}
	return &HealthFailure{Cause: cause, Status: resp.StatusCode, Detail: strings.ToValidUTF8(strings.TrimSpace(string(said)), "?")}
}

func (h *HealthChecker) apply(w *Worker, failed *HealthFailure) {
	ok := failed == nil
	if h.OnProbe != nil {
		h.OnProbe(w, ok)
	}
	if !ok {
		failed.At = time.Now()
		w.noteHealthFailure(failed)
		h.Log.Debug("worker failed a health check", "worker", w.URL, "cause", failed.Cause, "status", failed.Status, "detail", failed.Detail)
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
		h.Log.Warn("worker failed its health checks; out of rotation", "worker", w.URL, "role", w.Role, "failures", n,
			"cause", failed.Cause, "status", failed.Status, "detail", failed.Detail)
	}
}

// Health check failure causes, a fixed set (a metric label): the engine answered a status
// outside 2xx (4xx, 5xx, or another), or no answer came — the probe's timeout passed, the
// connection was refused or reset (closed before an answer), the name did not resolve, TLS
// failed, or another error.
const (
	HealthStatus4xx   = "status_4xx"
	HealthStatus5xx   = "status_5xx"
	HealthStatusOther = "status_other"
	HealthTimeout     = "timeout"
	HealthRefused     = "refused"
	HealthReset       = "reset"
	HealthDNS         = "dns"
	HealthTLS         = "tls"
	HealthError       = "error"
)

// HealthCauses are every health check failure cause, in the order Worker.HealthFailures counts them.
var HealthCauses = [...]string{HealthStatus4xx, HealthStatus5xx, HealthStatusOther, HealthTimeout, HealthRefused, HealthReset, HealthDNS, HealthTLS, HealthError}

// maxHealthDetail bounds what is kept of a failed probe's answer.
const maxHealthDetail = 256

// HealthFailure is what a failed health probe got: its cause (one of HealthCauses), the status
// the engine answered (0 when none came), the start of its answer or the error, and when.
type HealthFailure struct {
	Cause  string    `json:"cause"`
	Status int       `json:"status,omitempty"`
	Detail string    `json:"detail,omitempty"`
	At     time.Time `json:"at"`
}

// probeError is the failure of a probe that got no answer, err its client's error. The detail
// is the error beneath the client's (which names the URL, and so any credentials in it).
func probeError(err error) *HealthFailure {
	f := &HealthFailure{Cause: HealthError, Detail: err.Error()}
	if ue := (*url.Error)(nil); errors.As(err, &ue) {
		f.Detail = ue.Err.Error()
	}
	var (
		ne   net.Error
		dns  *net.DNSError
		cert *tls.CertificateVerificationError
		rec  tls.RecordHeaderError
		alrt tls.AlertError
	)
	switch {
	case errors.As(err, &dns):
		f.Cause = HealthDNS
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		f.Cause = HealthTimeout
	case errors.Is(err, syscall.ECONNREFUSED):
		f.Cause = HealthRefused
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		f.Cause = HealthReset
	case errors.As(err, &cert), errors.As(err, &rec), errors.As(err, &alrt):
		f.Cause = HealthTLS
	}
	return f
}

// noteHealthFailure records a failed probe.
func (w *Worker) noteHealthFailure(f *HealthFailure) {
	w.lastHealth.Store(f)
	w.healthCauses[slices.Index(HealthCauses[:], f.Cause)].Add(1)
}

// HealthCheck is w's health checks as they stand: the probes failed in a row (0 while they
// pass) and the last failed probe (nil when none failed yet).
func (w *Worker) HealthCheck() (failing int, last *HealthFailure) {
	return int(w.healthFails.Load()), w.lastHealth.Load()
}

// HealthFailures are w's failed health probes so far, counted by cause (indexed as
// HealthCauses).
func (w *Worker) HealthFailures() (n [len(HealthCauses)]int64) {
	for i := range n {
		n[i] = w.healthCauses[i].Load()
	}
	return n
}
