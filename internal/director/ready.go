package director

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// Readiness returns the models the fleet serves — those its workers list or their
// configuration names, and those Baton's configuration names (a models: entry, an alias's
// target, the default model) — and, per model it cannot serve now, why. A model none of whose
// workers is available, every name of which has a fallback that is, is served (through its
// fallbacks, as its requests are).
func (d *Director) Readiness() (models []string, missing []string) {
	models, whys := d.modelStates()
	for _, why := range whys {
		if why != "" {
			missing = append(missing, why)
		}
	}
	return models, missing
}

// ModelStates returns the models Readiness names and, for each, whether it can be served now.
func (d *Director) ModelStates() (models []string, servable []bool) {
	models, whys := d.modelStates()
	if len(models) == 0 {
		return nil, nil
	}
	servable = make([]bool, len(whys))
	for i, why := range whys {
		servable[i] = why == ""
	}
	return models, servable
}

// modelStates is Readiness's models and, aligned with them, why each cannot be served now (""
// where it can); with no model known, the one why of the workers that take any model.
func (d *Director) modelStates() (models []string, whys []string) {
	snap := d.reg.Snapshot()
	models = snap.Models()
	aliases := map[string][]string{} // a target -> the names clients use for it
	if cfg, def := d.Models(); len(cfg) > 0 || def != "" {
		for name, m := range cfg {
			models = append(models, cmp.Or(m.Serve, name))
			if m.Serve != "" {
				aliases[m.Serve] = append(aliases[m.Serve], name)
			}
		}
		if def != "" {
			models = append(models, d.ModelChain(def)[0])
		}
		slices.Sort(models)
		models = slices.Compact(models)
	}
	if len(models) == 0 {
		models = []string{""} // workers that take any model, or none registered yet
	}
	unserved := snap.Unserved()
	whys = make([]string, len(models))
	for i, m := range models {
		why := d.unservable(snap, m)
		switch {
		case why == "":
			continue
		case d.fallsBack(snap, m, aliases[m]):
			continue // served through its fallbacks, as its requests are
		case slices.Contains(unserved, m):
			why = "named in the configuration of workers whose engines do not serve it"
		}
		switch names := aliases[m]; {
		case m == "":
			why = "no model is known yet: " + why
		case len(names) > 0:
			slices.Sort(names)
			why = fmt.Sprintf("model %q (served for %s): %s", m, strings.Join(names, ", "), why)
		default:
			why = fmt.Sprintf("model %q: %s", m, why)
		}
		whys[i] = why
	}
	if models[0] == "" {
		return []string{}, whys // the one why of the workers that take any model, not aligned
	}
	return models, whys
}

// ServableEvery is how often the director looks whether each model can be served, to say in a
// WARN the one that no longer can (the gateway staying ready while any model can).
var ServableEvery = 5 * time.Second

// noteServable compares each model's state now with last (model -> why it cannot be served,
// "" where it can; nil before the workers' first registrations settled, when it only takes
// note): a WARN for a model that can no longer be served, an INFO for one that can again. It
// returns the states now.
func (d *Director) noteServable(last map[string]string) map[string]string {
	if last == nil && d.reg.Snapshot().Pending() > 0 {
		return nil
	}
	models, whys := d.modelStates()
	now := make(map[string]string, len(models))
	for i, m := range models {
		now[m] = whys[i]
	}
	some := false // a model can still be served: the gateway stays ready
	for _, why := range now {
		some = some || why == ""
	}
	for m, why := range now {
		was, known := last[m]
		switch {
		case last == nil:
		case why != "" && was == "" && some:
			d.log.Warn("a model can no longer be served; the gateway stays ready while any model can", "model", m, "why", why)
		case why != "" && was == "":
			d.log.Warn("a model can no longer be served, and no model can: readiness answers 503", "model", m, "why", why)
		case why == "" && known && was != "":
			d.log.Info("a model can be served again", "model", m)
		}
	}
	return now
}

// fallsBack reports whether every name clients use for the model m (its aliases, and m itself
// where the configuration names it) has a fallback that can be served now; a model the
// configuration does not name has none.
func (d *Director) fallsBack(snap *worker.Snapshot, m string, aliases []string) bool {
	cfg, _ := d.Models()
	names := aliases
	if _, ok := cfg[m]; ok {
		names = append(slices.Clip(names), m)
	}
	if len(names) == 0 {
		return false
	}
	for _, name := range names {
		served := false
		for _, f := range d.ModelChain(name)[1:] {
			if d.unservable(snap, f) == "" {
				served = true
				break
			}
		}
		if !served {
			return false
		}
	}
	return true
}

// Servable reports whether the fleet can serve now: at least one of the models Readiness found
// (of models, missing) can be — a gateway that serves some models is ready for their clients,
// and says which it cannot serve — or, with none known, none is missing.
func Servable(models, missing []string) bool {
	if len(models) == 0 {
		return len(missing) == 0
	}
	return len(missing) < len(models)
}

// Unregistered are the workers that have not registered, with why: each by its URL (credentials
// redacted), and their count by cause.
func (d *Director) Unregistered() (named []map[string]string, byCause map[string]int) {
	pending := d.reg.Snapshot().PendingWorkers()
	if len(pending) == 0 {
		return nil, nil
	}
	byCause = map[string]int{}
	for _, wk := range pending {
		cause := "pending"
		if e := wk.LastRegistrationError(); e != nil {
			cause = e.Cause
		}
		byCause[cause]++
		named = append(named, map[string]string{"url": config.RedactURL(wk.URL), "cause": cause})
	}
	return named, byCause
}

// unservable says why no request for model could be dispatched now ("" when one could): a
// worker of it ready with its circuit not open — with PD, a prefill and a decode that are, and
// can hand KV to each other.
func (d *Director) unservable(snap *worker.Snapshot, model string) string {
	open := false   // a ready worker of the role asked was left out for its open circuit
	serves := false // some worker of the role asked serves the model at all
	available := func(role string) []*worker.Worker {
		ws, _ := d.Candidates(snap, role, model)
		serves, open = len(ws) > 0, false // what is said is of this role's workers alone
		var out []*worker.Worker
		for _, w := range ws {
			switch {
			case w.Available():
				out = append(out, w)
			case w.Ready():
				open = true
			}
		}
		return out
	}
	why := func(what string) string {
		if open {
			return fmt.Sprintf("no available %s (the circuit of every ready one is open: its engine failed requests)", what)
		}
		if !serves && !d.o.PD {
			return "no worker serves it"
		}
		return fmt.Sprintf("no ready %s (unreachable, still registering, unhealthy or drained)", what)
	}
	if !d.o.PD {
		if len(available(config.RoleRegular)) == 0 {
			return why("worker")
		}
		return ""
	}
	prefills := available(config.RolePrefill)
	if len(prefills) == 0 {
		return why("prefill worker")
	}
	decodes := available(config.RoleDecode)
	if len(decodes) == 0 {
		return why("decode worker")
	}
	for _, p := range prefills {
		for _, dc := range decodes {
			if d.sel == nil || d.sel.Compatible == nil || d.sel.Compatible(p, dc) {
				return ""
			}
		}
	}
	return "no available prefill and decode can hand KV to each other (their runtimes or KV connectors differ, or a prefill's bootstrap port is not its engine's: GET /workers)"
}
