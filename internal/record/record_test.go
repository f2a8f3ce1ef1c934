package record

import (
	"context"
	"testing"

	"github.com/baton-llm/baton/internal/tenant"
)

// A record rides on its context; a context without one gives a fresh record each time (writes
// to it reach nobody, and two such requests share nothing); NextAttempt forgets only what one
// attempt learned.
func TestRecord(t *testing.T) {
	rec := &Record{Model: "m", Mode: "pd_vllm", Attempts: 2, Worker: "w", Prefill: "p", Decode: "d", Handoff: "nixl", Code: "c", Who: &tenant.Tenant{Name: "t"}}
	ctx := With(context.Background(), rec)
	if From(ctx) != rec {
		t.Fatal("the context does not carry its record")
	}
	rec.NextAttempt()
	if rec.Worker != "" || rec.Prefill != "" || rec.Decode != "" || rec.Handoff != "" || rec.Model != "m" || rec.Mode != "pd_vllm" || rec.Attempts != 2 || rec.Code != "c" || rec.TenantName() != "t" {
		t.Errorf("after NextAttempt: %+v", rec)
	}
	if (&Record{}).TenantName() != "" {
		t.Error("a record with no tenant names one")
	}
	a, b := From(context.Background()), From(context.Background())
	a.Model = "x"
	if a == b || b.Model != "" {
		t.Error("requests without a record share one")
	}
}
