package policy

import (
	"context"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
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
	Register(Kind{Name: "last_worker", Reason: "last", New: func(cfg config.Config) Policy { return lastWorker{weight: cfg.CacheThreshold} },
		Chooses: "the last worker", GoodFor: "a test"})
	t.Cleanup(func() { // the process's registry is the reference's table: the test's policy leaves it
		delete(kinds, "last_worker")
		delete(byType, reflect.TypeOf(lastWorker{}))
		config.Policies = slices.DeleteFunc(config.Policies, func(n string) bool { return n == "last_worker" })
	})
	if !strings.Contains(renderPolicyTable(), "| `last_worker` | the last worker | a test |") {
		t.Errorf("the reference's table of policies lacks the registered one:\n%s", renderPolicyTable())
	}
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
	Register(Kind{Name: "last_worker", New: func(config.Config) Policy { return lastWorker{} }, Chooses: "again", GoodFor: "nothing"})
}

// The table of policies in docs/REFERENCE.md is the registry's: a policy's row comes from its
// registration. A table edited by hand fails here; BATON_UPDATE_DOCS=1 writes it.
func TestPolicyTableIsGenerated(t *testing.T) {
	const path = "../../docs/REFERENCE.md"
	const begin, end = "<!-- policies table: generated", "<!-- end of policies table -->"
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i, j := strings.Index(doc, begin), strings.Index(doc, end)
	if i < 0 || j < i {
		t.Fatalf("%s has no generated table of policies (%q … %q)", path, begin, end)
	}
	i += strings.IndexByte(doc[i:], '\n') + 1
	want := renderPolicyTable()
	if doc[i:j] == want {
		return
	}
	if os.Getenv("BATON_UPDATE_DOCS") != "1" {
		t.Fatalf("%s's table of policies is not the registry's (edit the policy's registration, then BATON_UPDATE_DOCS=1 go test ./internal/policy)", path)
	}
	if err := os.WriteFile(path, []byte(doc[:i]+want+doc[j:]), 0o644); err != nil {
		t.Fatal(err)
	}
}

// renderPolicyTable is the reference's table of policies: each registered kind, in the order
// the configuration lists them.
func renderPolicyTable() string {
	var b strings.Builder
	b.WriteString("| policy | chooses | good for |\n|---|---|---|\n")
	for _, name := range config.Policies {
		if k, ok := kinds[name]; ok {
			fmt.Fprintf(&b, "| `%s` | %s | %s |\n", k.Name, k.Chooses, k.GoodFor)
		}
	}
	return b.String()
}
