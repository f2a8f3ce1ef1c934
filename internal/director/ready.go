package director

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// Readiness returns the models the fleet serves — those its workers list or their
// configuration names, and those Baton's configuration names (a models: entry, an alias's
// target, the default model) — and, per model it cannot serve now, why.
func (d *Director) Readiness() (models []string, missing []string) {
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
	for _, m := range models {
		why := d.unservable(snap, m)
		switch {
		case why == "":
			continue
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
		missing = append(missing, why)
	}
	if models[0] == "" {
		models = []string{}
	}
	return models, missing
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
	return "no available prefill and decode can hand KV to each other (their runtimes or KV connectors differ)"
}
