package pd

import (
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// An SGLang prefill whose engine reports another bootstrap port than the one configured pairs
// with no decode: each request would wait out its bootstrap timeout on a port where no
// bootstrap server listens (then fail), while readiness called the pair servable.
func TestAPrefillWithAWrongBootstrapPortPairsWithNone(t *testing.T) {
	port := func(n int) *int { return &n }
	decode := worker.New(config.Worker{URL: "http://d:1", Role: config.RoleDecode})
	decode.SetInfo(&worker.Info{Runtime: config.RuntimeSGLang})
	for _, c := range []struct {
		name       string
		configured *int
		reported   int
		want       bool
	}{
		{"the engine's port", port(8998), 8998, true},
		{"none configured", nil, 8998, true},
		{"the engine reports none", port(9000), 0, true},
		{"another port", port(9000), 8998, false},
	} {
		p := worker.New(config.Worker{URL: "http://p:1", Role: config.RolePrefill, BootstrapPort: c.configured})
		p.SetInfo(&worker.Info{Runtime: config.RuntimeSGLang, BootstrapPort: c.reported})
		if got := Compatible(p, decode, ""); got != c.want {
			t.Errorf("%s: compatible %v, want %v", c.name, got, c.want)
		}
	}
}
