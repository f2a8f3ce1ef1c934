package policy

import (
	"context"
	"slices"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// Every policy the configuration accepts is a registered kind that names itself, and every
// registered kind is accepted: the two lists cannot drift.
func TestEveryPolicyIsRegistered(t *testing.T) {
	for _, name := range config.Policies {
		p, err := New(name, config.Default())
		if err != nil || Name(p) != name {
			t.Errorf("%s: %v, named %q", name, err, Name(p))
		}
	}
	for name := range kinds {
		if !slices.Contains(config.Policies, name) {
			t.Errorf("registered %s is not accepted by the configuration", name)
		}
	}
	if _, err := New("bucket", config.Default()); err == nil {
		t.Error("an unknown policy was built")
	}
}

// lastWorker is the recipe of docs/ARCHITECTURE.md followed once: a policy in one file — its
// type and its registration — that the configuration then accepts, New builds from the
// configuration's settings, and decisions name with its reason.
type lastWorker struct{ weight float64 }

func (lastWorker) Pick(_ context.Context, ws []*worker.Worker, _ *Request) *worker.Worker {
	return ws[len(ws)-1]
}

func TestAPolicyRegistersItself(t *testing.T) {
	Register(Kind{Name: "last_worker", Reason: "last", New: func(cfg config.Config) Policy { return lastWorker{weight: cfg.CacheThreshold} }})
	cfg := config.Default()
	cfg.WorkerURLs = []string{"http://a:8000"}
	cfg.Policy = "last_worker"
	if err := cfg.Validate(); err != nil {
		t.Fatalf("the configuration refuses the registered policy: %v", err)
	}
	p, err := New("last_worker", cfg)
	if err != nil || p.(lastWorker).weight != cfg.CacheThreshold {
		t.Fatalf("New: %v %+v", err, p)
	}
	if Name(p) != "last_worker" || reasonOf(p) != "last" {
		t.Errorf("named %q with reason %q", Name(p), reasonOf(p))
	}
	ws := fleet(3)
	if got := p.Pick(context.Background(), ws, nil); got != ws[2] {
		t.Errorf("picked %v", got)
	}
	defer func() {
		if recover() == nil {
			t.Error("a second registration of the name was taken")
		}
	}()
	Register(Kind{Name: "last_worker", New: func(config.Config) Policy { return lastWorker{} }})
}
