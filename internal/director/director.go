// Package director is the middle of a request, whatever door it came in by: what the body asks
// for (Classify), the model chain (aliases, fallbacks, context-window fallbacks, the waiting
// room), the selection of a worker or pair and the readiness of its adapter (Choose), and the
// body as the chosen workers take it (ForWorkers, WithPriority). Its doors — the HTTP server
// and the Endpoint Picker — hand it the request's record explicitly; it speaks no HTTP: its
// refusals are openai errors and outcome failures that each door renders its own way.
package director

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/baton-llm/baton/internal/advisor"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/lora"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/retry"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/tenant"
	"github.com/baton-llm/baton/internal/worker"
)

// Options are a Director's settings and the parts it drives.
type Options struct {
	// PD: the generation routes go through a prefill/decode pair where no regular worker is.
	PD bool
	// LocalRule is conditional disaggregation's decision (nil: off), whose Decide the
	// selector's LocalPrefill is; the director keeps it fed from the advisor.
	LocalRule *LocalRule
	// Advisor, when set, sees every PD request that ended whole and sizes the fleet (Advice,
	// AdviceCollector) for AdviceSLO unless asked for others.
	Advisor   *advisor.Advisor
	AdviceSLO advisor.SLO
	// Models returns the names clients use (aliases, fallbacks) and the model of a request
	// naming none, now (a reload swaps them); nil: none.
	Models func() (map[string]config.ModelConfig, string)
	// Adapters, when set, loads a declared LoRA adapter on the chosen workers before a request
	// for it is sent, and counts its requests in flight (for least-recently-used unloading).
	Adapters *lora.Manager
	// MaxBatchSize bounds "n", the prompts and the samples of one request.
	MaxBatchSize int
	// RouteHeader writes each choice's reasons on the record (X-Baton-Route).
	RouteHeader bool
	// Tenancy is who may call and how much; zero: APIKey's tenant alone, unlimited.
	Tenancy Tenancy
	APIKey  string
	// Admission bounds the inference requests served at once and holds those for a model
	// without a ready worker (no_worker_wait); Retry is how a failed attempt is tried again.
	// Both are the configuration's sections, read here.
	Admission config.Admission
	Retry     config.Retry

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
	admit    *admission // nil: requests are not bounded
	attempts int        // tries in total, the first included
	backoff  retry.Backoff
	settling sync.WaitGroup // tenants' settlements waiting on a worker's count of a prompt
	bg       sync.WaitGroup // what Start began
	// localPrefills counts the PD requests a decode served alone by pd_local_prefill_threshold.
	localPrefills atomic.Int64
	// prefillWholes counts the PD requests an idle prefill served whole (the mirror case).
	prefillWholes atomic.Int64
	// advice is the advisor's last answer for the fleet as it stands (Advice(0, 0, 0): what
	// /metrics and the status page show), reused for AdviceTTL; adviceMu makes it one answer at
	// a time (a flood of scrapes takes at most one core). A what-if never takes it: whatIfs
	// bounds those instead (AdviceFor).
	adviceMu sync.Mutex
	advice   cachedAdvice
	whatIfs  whatIfs
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
	d := &Director{o: o, reg: o.Registry, sel: o.Selector, metrics: o.Metrics, log: o.Log, admit: newAdmission(admissionOf(o.Admission), o.Metrics, o.Log)}
	rc := o.Retry
	d.attempts = rc.MaxRetries
	if rc.Disable {
		d.attempts = 1
	}
	d.backoff = retry.Backoff{Initial: rc.InitialBackoff, Max: rc.MaxBackoff, Multiplier: rc.BackoffMultiplier, Jitter: rc.JitterFactor}
	if o.Metrics != nil {
		o.Metrics.Servable = d.ModelStates // baton_model_servable
	}
	return d
}

// TriesLeft reports whether attempt n may be followed by another.
func (d *Director) TriesLeft(n int) bool { return n < d.attempts }

// Backoff waits the jittered exponential backoff after attempt n; false when ctx ended first.
func (d *Director) Backoff(ctx context.Context, n int) bool {
	return retry.Sleep(ctx, d.backoff.Delay(n))
}

// Log is the director's logger.
func (d *Director) Log() *slog.Logger { return d.log }

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

// Route is an inference route and how it is served: through a prefill/decode pair (PD), or
// by one worker.
type Route struct {
	Path string
	PD   bool
}

// Routes are the inference routes, each as the director serves it.
func (d *Director) Routes() []Route {
	var out []Route
	for _, r := range routes.Inference() {
		out = append(out, Route{Path: r.Path, PD: d.o.PD && r.PD})
	}
	return out
}

// LocalPrefillThreshold is the pd_local_prefill_threshold in force (the advisor's in auto mode):
// 0 when every PD request is split by length.
func (d *Director) LocalPrefillThreshold() int {
	if d.o.LocalRule == nil {
		return 0
	}
	return d.o.LocalRule.Current()
}

// PrefillServesWhole reports whether an idle prefill may serve a request whole when its decode
// is saturated (pd_prefill_serves_whole).
func (d *Director) PrefillServesWhole() bool { return d.o.LocalRule != nil && d.o.LocalRule.Whole }

// LocalPrefillAuto reports whether the threshold follows the advisor (pd_local_prefill_auto).
func (d *Director) LocalPrefillAuto() bool { return d.o.LocalRule != nil && d.o.LocalRule.Auto }

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
	statusUnauthorized    = 401
	statusNotFound        = 404
	statusTooManyRequests = 429
	statusNotImplemented  = 501
	statusUnavailable     = 503
)
