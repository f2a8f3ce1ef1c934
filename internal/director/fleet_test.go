package director

import (
	"errors"
	"os"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/tenant"
	"github.com/baton-llm/baton/internal/worker"
)

// A fleet is a director over real workers in a real registry, chosen by round robin in every
// role, with the registry's metrics.
type fleet struct {
	reg *worker.Registry
	m   *metrics.Metrics
	d   *Director
}

// engineWorker is a registered, ready worker of role whose engine (of runtime) lists models.
func engineWorker(url, role, runtime string, models ...string) *worker.Worker {
	w := worker.New(config.Worker{URL: url, Role: role, Runtime: runtime})
	var ms []worker.Model
	for _, m := range models {
		ms = append(ms, worker.Model{ID: m})
	}
	w.SetInfo(&worker.Info{Runtime: runtime, Models: ms})
	w.SetReady(true)
	return w
}

// regular is a ready vLLM worker serving models alone.
func regular(url string, models ...string) *worker.Worker {
	return engineWorker(url, config.RoleRegular, config.RuntimeVLLM, models...)
}

// newFleet is a director over ws; tune changes its options (the registry, metrics and selector
// set) before it is made.
func newFleet(t *testing.T, ws []*worker.Worker, tune ...func(*Options)) *fleet {
	t.Helper()
	reg := worker.NewRegistry(ws...)
	m := metrics.New(reg)
	pols := map[string]policy.Policy{}
	for _, role := range []string{config.RoleRegular, config.RolePrefill, config.RoleDecode} {
		p, err := policy.New(config.PolicyRoundRobin, config.Default())
		if err != nil {
			t.Fatal(err)
		}
		pols[role] = p
	}
	o := Options{Registry: reg, Metrics: m, MaxBatchSize: 8,
		Selector: &policy.Selector{Registry: reg, Policies: pols},
		Retry:    config.Retry{MaxRetries: 3, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond, BackoffMultiplier: 1}}
	for _, f := range tune {
		f(&o)
	}
	return &fleet{reg: reg, m: m, d: New(o)}
}

// withModels gives the director models (aliases, fallbacks) and a default model.
func withModels(models map[string]config.ModelConfig, def string) func(*Options) {
	return func(o *Options) {
		o.Models = func() (map[string]config.ModelConfig, string) { return models, def }
	}
}

// parsed is body parsed as a client's request.
func parsed(t *testing.T, body string) *openai.Request {
	t.Helper()
	req, err := openai.ParseRequest([]byte(body))
	if err != nil {
		t.Fatalf("%s: %v", body, err)
	}
	return req
}

// answerOf is the answer Baton renders for err, a failure of its own; it fails the test when
// err is none.
func answerOf(t *testing.T, err error) (*outcome.Failure, *openai.Error) {
	t.Helper()
	f, ok := errors.AsType[*outcome.Failure](err)
	if !ok || f.Answer == nil {
		t.Fatalf("want a failure with Baton's answer, got %v", err)
	}
	return f, f.Answer
}

// intp is a pointer to n (a limit in the configuration).
func intp(n int) *int { return &n }

// tenancyOf is the tenancy of cfg's tenants, counted in memory, with maxTokens the completion
// reserved for a request without a cap.
func tenancyOf(t *testing.T, cfg config.Config, maxTokens int) Tenancy {
	t.Helper()
	set, err := tenant.Build(cfg, os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	return Tenancy{Set: func() *tenant.Set { return set }, Limiter: tenant.NewLimiter(nil), MaxTokens: maxTokens}
}

// withTenants gives the director cfg's tenants.
func withTenants(t *testing.T, cfg config.Config, maxTokens int) func(*Options) {
	ten := tenancyOf(t, cfg, maxTokens)
	return func(o *Options) { o.Tenancy = ten }
}

// waitFor polls cond (a state another goroutine reaches) until it holds; the test fails after
// a generous bound, so that a bug hangs nothing.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("never: %s", what)
		}
	}
}
