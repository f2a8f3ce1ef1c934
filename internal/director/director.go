// Package director is the middle of a request, whatever door it came in by: what the body asks
// for (Classify), the model chain (aliases, fallbacks, context-window fallbacks, the waiting
// room), the selection of a worker or pair and the readiness of its adapter (Choose), and the
// body as the chosen workers take it (ForWorkers, WithPriority). Its doors — the HTTP server
// and the Endpoint Picker — hand it the request's record explicitly; it speaks no HTTP: its
// refusals are openai errors and outcome failures that each door renders its own way.
package director

import (
	"log/slog"
	"sync"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/lora"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/tenant"
	"github.com/baton-llm/baton/internal/worker"
)

// Options are a Director's settings and the parts it drives.
type Options struct {
	// PD: the generation routes go through a prefill/decode pair where no regular worker is.
	PD bool
	// Models returns the names clients use (aliases, fallbacks) and the model of a request
	// naming none, now (a reload swaps them); nil: none.
	Models func() (map[string]config.ModelConfig, string)
	// Adapters, when set, loads a declared LoRA adapter on the chosen workers before a request
	// for it is sent, and counts its requests in flight (for least-recently-used unloading).
	Adapters *lora.Manager
	// MaxBatchSize bounds "n", the prompts and the samples of one request.
	MaxBatchSize int
	// NoWorkerWait holds a request for a known model without a ready worker this long for one
	// (the waiting room); 0: refused at once.
	NoWorkerWait time.Duration
	// RouteHeader writes each choice's reasons on the record (X-Baton-Route).
	RouteHeader bool
	// Tenancy is who may call and how much; zero: APIKey's tenant alone, unlimited.
	Tenancy Tenancy
	APIKey  string
	// Admission bounds the inference requests served at once.
	Admission Admission

	Registry *worker.Registry
	Selector *policy.Selector
	Metrics  *metrics.Metrics
	Log      *slog.Logger
}

// Director runs the middle of every request.
type Director struct {
	o        Options
	reg      *worker.Registry
	sel      *policy.Selector
	metrics  *metrics.Metrics
	log      *slog.Logger
	admit    *admission     // nil: requests are not bounded
	settling sync.WaitGroup // tenants' settlements waiting on a worker's count of a prompt
}

// New returns a director with o.
func New(o Options) *Director {
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.Tenancy.Set == nil {
		o.Tenancy = DefaultTenancy(o.APIKey)
	}
	if o.Tenancy.Limiter == nil {
		o.Tenancy.Limiter = tenant.NewLimiter(o.Log)
	}
	return &Director{o: o, reg: o.Registry, sel: o.Selector, metrics: o.Metrics, log: o.Log, admit: newAdmission(o.Admission, o.Metrics)}
}

// Registry is the fleet the director chooses from.
func (d *Director) Registry() *worker.Registry { return d.reg }

// Selector is the director's selection.
func (d *Director) Selector() *policy.Selector { return d.sel }

// Adapters is the LoRA adapter manager, nil when none is declared.
func (d *Director) Adapters() *lora.Manager { return d.o.Adapters }

// Disaggregated reports whether a generation request on a PD route goes through a pair: PD is
// on and no regular worker serves.
func (d *Director) Disaggregated() bool {
	return d.o.PD && !d.sel.HasRole(config.RoleRegular)
}

// PD reports whether the fleet runs prefill/decode disaggregation.
func (d *Director) PD() bool { return d.o.PD }

// Models are the configuration's model names and default model now.
func (d *Director) Models() (map[string]config.ModelConfig, string) {
	if d.o.Models == nil {
		return nil, ""
	}
	return d.o.Models()
}

// ModelChain is the models a request for name may be served by, in order: the workers' name
// for it (an alias's target), then its fallbacks' (those allow lets the request use; nil: all).
func (d *Director) ModelChain(name string, allow ...func(string) bool) []string {
	models, _ := d.Models()
	served := func(n string) string {
		if m, ok := models[n]; ok && m.Serve != "" {
			return m.Serve
		}
		return n
	}
	chain := []string{served(name)}
	if m, ok := models[name]; ok {
		for _, f := range m.Fallbacks {
			if len(allow) == 0 || allow[0](f) {
				chain = append(chain, served(f))
			}
		}
	}
	return chain
}

// Candidates are the workers of role that may serve model: the selector's (a declared
// adapter's are those of its base model).
func (d *Director) Candidates(snap *worker.Snapshot, role, model string) ([]*worker.Worker, bool) {
	if d.sel == nil {
		return snap.Candidates(role, model)
	}
	return d.sel.Candidates(snap, role, model)
}

// HTTP statuses of the director's refusals: the doors render them (the director speaks no HTTP).
const (
	statusBadRequest      = 400
	statusNotFound        = 404
	statusTooManyRequests = 429
	statusNotImplemented  = 501
	statusUnavailable     = 503
)
