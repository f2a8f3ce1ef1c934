// Package tenant knows who is calling: the tenants of the configuration, the keys that name
// them, the models each may use, and their limits — requests and tokens per minute and requests
// at once — counted in this replica or in a Redis shared by replicas (limiter.go).
package tenant

import (
	"cmp"
	"crypto/sha256"
	"slices"
	"strings"

	"github.com/baton-llm/baton/internal/config"
)

// A Tenant is one team sharing the fleet.
type Tenant struct {
	Name        string
	Weight      float64
	MaxPriority string
	models      []string // exact names and prefixes ending in *; none: every model
	rules       []*Rule  // most specific first; the tenant-wide rule, if any, last
}

// A Rule is one set of limits of a tenant: for every model, or for a model or prefix. Its ID
// keys its counts ("team-a", "team-a/llama-*").
type Rule struct {
	ID, Tenant, Model string
	// RPM and TPM are requests and tokens per minute, Concurrent requests at once; 0: no limit.
	RPM, TPM, Concurrent int
}

// Set is the tenants of one configuration, with their keys: built once, swapped whole on a
// reload.
type Set struct {
	byKey   map[[32]byte]*Tenant
	tenants []*Tenant
	// open: no tenant has a key, so every request is tenant default (which may have limits).
	open *Tenant
}

// Build makes the tenants of cfg.
func Build(cfg config.Config, getenv func(string) string) (*Set, error) {
	ts, err := cfg.ResolvedTenants(getenv)
	if err != nil {
		return nil, err
	}
	s := &Set{byKey: map[[32]byte]*Tenant{}}
	for _, c := range ts {
		t := &Tenant{Name: c.Name, Weight: 1, MaxPriority: cmp.Or(cfg.DefaultMaxPriority, config.PriorityInteractive), models: c.Models}
		if c.Weight != nil {
			t.Weight = *c.Weight
		}
		if c.MaxPriority != "" {
			t.MaxPriority = c.MaxPriority
		}
		for _, l := range c.ModelLimits {
			t.rules = append(t.rules, ruleOf(t.Name, l))
		}
		// Most specific first: exact names, then longer prefixes.
		slices.SortStableFunc(t.rules, func(a, b *Rule) int { return specificity(b.Model) - specificity(a.Model) })
		if c.Limits != nil {
			t.rules = append(t.rules, ruleOf(t.Name, *c.Limits))
		}
		for _, h := range c.Hashes {
			s.byKey[h] = t
		}
		s.tenants = append(s.tenants, t)
	}
	if len(s.byKey) == 0 {
		s.open = &Tenant{Name: config.DefaultTenant, Weight: 1, MaxPriority: cmp.Or(cfg.DefaultMaxPriority, config.PriorityInteractive)}
		for _, t := range s.tenants {
			if t.Name == config.DefaultTenant {
				s.open = t
			}
		}
		if !slices.Contains(s.tenants, s.open) {
			s.tenants = append(s.tenants, s.open)
		}
	}
	return s, nil
}

func ruleOf(tenant string, l config.Limits) *Rule {
	r := &Rule{ID: tenant, Tenant: tenant, Model: l.Model}
	if l.Model != "" {
		r.ID = tenant + "/" + l.Model
	}
	for _, f := range []struct {
		dst *int
		src *int
	}{{&r.RPM, l.RequestsPerMinute}, {&r.TPM, l.TokensPerMinute}, {&r.Concurrent, l.MaxConcurrent}} {
		if f.src != nil {
			*f.dst = *f.src
		}
	}
	return r
}

// specificity orders model patterns: an exact name above every prefix, a longer prefix above
// a shorter one.
func specificity(pattern string) int {
	if p, ok := strings.CutSuffix(pattern, "*"); ok {
		return len(p)
	}
	return 1 << 20
}

func matches(pattern, model string) bool {
	if p, ok := strings.CutSuffix(pattern, "*"); ok {
		return strings.HasPrefix(model, p)
	}
	return pattern == model
}

// Open reports whether requests need no key (no tenant has one); they are all tenant default.
func (s *Set) Open() bool { return s.open != nil }

// Identify returns the tenant a bearer key names, or the open tenant when no tenant has a key;
// nil for a key no tenant has. The key is hashed once and looked up: the time taken does not
// depend on which tenants exist.
func (s *Set) Identify(key string) *Tenant {
	if s.open != nil {
		return s.open
	}
	return s.byKey[sha256.Sum256([]byte(key))]
}

// ByName returns the tenant named name, nil for none.
func (s *Set) ByName(name string) *Tenant {
	for _, t := range s.tenants {
		if t.Name == name {
			return t
		}
	}
	return nil
}

// Tenants are every tenant, in the configuration's order.
func (s *Set) Tenants() []*Tenant { return s.tenants }

// Names are the tenants' names: the values the tenant metric label may take.
func (s *Set) Names() []string {
	out := make([]string, len(s.tenants))
	for i, t := range s.tenants {
		out[i] = t.Name
	}
	return out
}

// Allows reports whether t may use model.
func (t *Tenant) Allows(model string) bool {
	if len(t.models) == 0 {
		return true
	}
	for _, p := range t.models {
		if matches(p, model) {
			return true
		}
	}
	return false
}

// RulesFor returns the limits that hold for t's requests for model: the most specific of its
// model rules that matches, then its tenant-wide rule — nil where t has none. A request is
// admitted only within every one. (An array: the request path allocates nothing for it.)
func (t *Tenant) RulesFor(model string) (rules [2]*Rule) {
	for _, r := range t.rules {
		switch {
		case r.Model == "":
			rules[1] = r
			return rules
		case rules[0] == nil && matches(r.Model, model):
			rules[0] = r
		}
	}
	return rules
}

// Rules are t's rules, most specific first.
func (t *Tenant) Rules() []*Rule { return t.rules }

// Models are the model patterns t may use; none: every model.
func (t *Tenant) Models() []string { return t.models }
