package director

import (
	"context"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/worker"
)

// The mirror case picks an idle vLLM prefill only, only for a decode past the TPOT SLO at the
// batch it holds, and only once fitted.
func TestServeWholeOnlyAnIdleVLLMPrefill(t *testing.T) {
	r := NewLocalRule(0, false, nil)
	r.Whole, r.TPOTSLO = true, 50*time.Millisecond
	dec := worker.New(config.Worker{URL: "http://d:1", Role: config.RoleDecode, Runtime: config.RuntimeVLLM})
	sgl := worker.New(config.Worker{URL: "http://s:1", Role: config.RolePrefill, Runtime: config.RuntimeSGLang})
	busy := worker.New(config.Worker{URL: "http://b:1", Role: config.RolePrefill, Runtime: config.RuntimeVLLM})
	idle := worker.New(config.Worker{URL: "http://i:1", Role: config.RolePrefill, Runtime: config.RuntimeVLLM})
	busy.Enter()
	req := &policy.Request{Model: "m"}
	all := []*worker.Worker{sgl, busy, idle}
	if w := r.ServeWhole(context.Background(), dec, req, all); w != nil {
		t.Errorf("unfitted: served whole on %s", w.URL)
	}
	r.fit.Store(&localFit{step: 0.030, perRequest: 0.005}) // 30 ms + 5 ms per request decoding
	for range 3 {
		dec.Enter() // 30 + 5 × 4 = 50 ms: at the SLO, not past it
	}
	if w := r.ServeWhole(context.Background(), dec, req, all); w != nil {
		t.Errorf("a decode at its SLO: served whole on %s", w.URL)
	}
	dec.Enter() // 55 ms
	if w := r.ServeWhole(context.Background(), dec, req, all); w != idle {
		t.Errorf("a saturated decode: %v, want the idle vLLM prefill", w)
	}
	if w := r.ServeWhole(context.Background(), dec, req, []*worker.Worker{sgl, busy}); w != nil {
		t.Errorf("no idle vLLM prefill: served whole on %s", w.URL)
	}
	r.Whole = false
	if w := r.ServeWhole(context.Background(), dec, req, all); w != nil {
		t.Errorf("off: served whole on %s", w.URL)
	}
}
