package config

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// A Tenant is a team sharing the fleet: the keys that name it, the models it may use, its limits
// and its share under contention (YAML tenants:).
type Tenant struct {
	// Name is a label-safe identifier, unique: it appears in metrics, logs and GET /tenants.
	Name string `json:"name"`
	// Keys are the SHA-256 of its keys, "sha256:<64 hex digits>" (baton hash-key prints one);
	// KeyFile holds keys one per line (a mounted Secret); KeyEnv names a variable holding one.
	// A key is never written in plain text in the file.
	Keys    []string `json:"keys"`
	KeyFile string   `json:"key_file"`
	KeyEnv  string   `json:"key_env"`
	// Models are the models it may use: exact names or prefixes ending in *; none: every model.
	Models []string `json:"models"`
	// Weight is its share of the fleet under contention (default 1); MaxPriority the highest
	// priority class it may ask for (default interactive).
	Weight      *float64 `json:"weight"`
	MaxPriority string   `json:"max_priority"`
	// Limits hold for all its models; ModelLimits for some (the most specific rule wins).
	Limits      *Limits  `json:"limits"`
	ModelLimits []Limits `json:"model_limits"`

	// Hashes are the SHA-256 of every key, from Keys, KeyFile and KeyEnv (resolved by
	// ResolveTenants).
	Hashes [][32]byte `json:"-"`
	// fromFlag: added by smg's policy files for a tenant whose keys are flags'; byHeader: for
	// one the trusted header names, which needs no key.
	fromFlag, byHeader bool
}

// Limits bound a tenant's use, per minute and at once. A limit left out is no limit.
type Limits struct {
	// Model is what a model_limits rule applies to: an exact name or a prefix ending in *.
	Model             string `json:"model"`
	RequestsPerMinute *int   `json:"requests_per_minute"`
	// TokensPerMinute counts prompt and completion tokens, as the engines report them.
	TokensPerMinute *int `json:"tokens_per_minute"`
	MaxConcurrent   *int `json:"max_concurrent"`
}

// How an engine orders its "priority" field.
const (
	PriorityLowerFirst  = "lower_first"
	PriorityHigherFirst = "higher_first"
)

// Priority classes, highest first.
const (
	PriorityCritical    = "critical"
	PriorityInteractive = "interactive"
	PriorityDefault     = "default"
	PriorityBatch       = "batch"
)

// PriorityClasses are the priority classes, highest first.
var PriorityClasses = []string{PriorityCritical, PriorityInteractive, PriorityDefault, PriorityBatch}

// DefaultTenant is the tenant of --api-key, and of every request when no tenant has a key.
const DefaultTenant = "default"

var tenantName = regexp.MustCompile(`^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$`)

// HashKey is the form a tenant key is written in: "sha256:<hex of its SHA-256>".
func HashKey(key string) string {
	s := sha256.Sum256([]byte(key))
	return "sha256:" + hex.EncodeToString(s[:])
}

// ResolvedTenants returns the tenants with every key read (files, environment) into Hashes,
// --api-key's (tenant default) and --tenant-api-key's added, and reports every problem at once,
// naming the tenant and the field: a bad name, a name used twice, a tenant without a key (but
// default, the tenant of requests without one when no tenant has a key), a key of two tenants,
// an unknown priority, a limit that is not positive. c is not changed.
func (c *Config) ResolvedTenants(getenv func(string) string) ([]Tenant, error) {
	tenants := slices.Clone(c.Tenants)
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	byName := map[string]int{}
	for i := range tenants {
		t := &tenants[i]
		at := fmt.Sprintf("tenants[%d]", i)
		if t.Name != "" {
			at = fmt.Sprintf("tenant %q", t.Name)
		}
		switch _, dup := byName[t.Name]; {
		case !tenantName.MatchString(t.Name):
			bad("%s: name must be 1 to 63 lower-case letters, digits, '_', '.' or '-', starting and ending with a letter or digit", at)
		case dup:
			bad("%s: the name is used twice", at)
		}
		byName[t.Name] = i
		t.Hashes = nil
		t.Models = slices.Clone(t.Models)
		for j, k := range t.Keys {
			h, ok := strings.CutPrefix(k, "sha256:")
			b, err := hex.DecodeString(h)
			if !ok || err != nil || len(b) != sha256.Size {
				bad("%s: keys[%d]: want sha256:<64 hex digits> (baton hash-key prints it), never the key itself", at, j)
				continue
			}
			t.Hashes = append(t.Hashes, [32]byte(b))
		}
		if t.KeyFile != "" {
			b, err := ReadFile(t.KeyFile, MaxSmallFile)
			if err != nil {
				bad("%s: key_file: %v", at, err)
			}
			n := 0
			for _, line := range strings.Split(string(b), "\n") {
				if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
					t.Hashes = append(t.Hashes, sha256.Sum256([]byte(line)))
					n++
				}
			}
			if err == nil && n == 0 {
				bad("%s: key_file %s holds no key", at, t.KeyFile)
			}
		}
		if t.KeyEnv != "" {
			if v := getenv(t.KeyEnv); v != "" {
				t.Hashes = append(t.Hashes, sha256.Sum256([]byte(v)))
			} else {
				bad("%s: key_env: the variable %s is not set", at, t.KeyEnv)
			}
		}
		if len(t.Keys) == 0 && t.KeyFile == "" && t.KeyEnv == "" && t.Name != DefaultTenant && !t.fromFlag && !t.byHeader && !c.TrustTenantHeader {
			bad("%s: no key (keys, key_file or key_env)", at)
		}
		for j, m := range t.Models {
			if m == "" || m == "*" || strings.Contains(strings.TrimSuffix(m, "*"), "*") {
				bad("%s: models[%d] %q: want a model name or a prefix ending in *", at, j, m)
			}
		}
		if t.Weight != nil && !(*t.Weight > 0) {
			bad("%s: weight must be above 0", at)
		}
		if t.MaxPriority != "" && !slices.Contains(PriorityClasses, t.MaxPriority) {
			bad("%s: max_priority %q: want one of %s", at, t.MaxPriority, strings.Join(PriorityClasses, ", "))
		}
		if t.Limits != nil {
			if t.Limits.Model != "" {
				bad("%s: limits.model: a model's limits go in model_limits", at)
			}
			checkLimits(*t.Limits, at+": limits", bad)
		}
		seen := map[string]bool{}
		for j, l := range t.ModelLimits {
			where := fmt.Sprintf("%s: model_limits[%d]", at, j)
			switch {
			case l.Model == "" || strings.Contains(strings.TrimSuffix(l.Model, "*"), "*"):
				bad("%s: model: want a model name or a prefix ending in *", where)
			case seen[l.Model]:
				bad("%s: model %q has two rules", where, l.Model)
			}
			seen[l.Model] = true
			checkLimits(l, where, bad)
		}
	}
	if c.ClientKey() != "" {
		h := sha256.Sum256([]byte(c.ClientKey()))
		if i, ok := byName[DefaultTenant]; ok {
			tenants[i].Hashes = append(tenants[i].Hashes, h) // --api-key names the tenant default
		} else {
			tenants = append(tenants, Tenant{Name: DefaultTenant, Hashes: [][32]byte{h}})
			byName[DefaultTenant] = len(tenants) - 1
		}
	}
	for _, tk := range c.TenantAPIKeys {
		name, key, ok := strings.Cut(tk, ":")
		name, key = strings.TrimSpace(name), strings.TrimSpace(key) // as smg reads it
		if !ok || key == "" {
			bad("--tenant-api-key: want TENANT:KEY")
			continue
		}
		i, found := byName[name]
		if !found {
			if !tenantName.MatchString(name) {
				bad("--tenant-api-key: tenant name %q must be 1 to 63 lower-case letters, digits, '_', '.' or '-'", name)
				continue
			}
			tenants = append(tenants, Tenant{Name: name})
			i = len(tenants) - 1
			byName[name] = i
		}
		tenants[i].Hashes = append(tenants[i].Hashes, sha256.Sum256([]byte(key)))
	}
	owner := map[[32]byte]string{}
	for _, t := range tenants {
		for _, h := range t.Hashes {
			if o, ok := owner[h]; ok && o != t.Name {
				bad("tenants %q and %q share a key: a key names one tenant", o, t.Name)
			} else if ok {
				bad("tenant %q: a key is given twice", t.Name)
			}
			owner[h] = t.Name
		}
	}
	// A client's key is never an admin key: a client with it would control the fleet. The one
	// exception is smg's bare --api-key, which is both (smg's admin routes take its shared key).
	implicit := len(c.explicitAdminKeys()) == 0 && c.ClientAPIKey == ""
	for _, k := range c.AdminKeys() {
		h := sha256.Sum256([]byte(k))
		for _, t := range tenants {
			if slices.Contains(t.Hashes, h) && !(implicit && k == c.APIKey && t.Name == DefaultTenant) {
				bad("tenant %q: one of its keys is an admin key (--admin-api-key, --control-plane-api-keys, or --api-key where no other admin key is given): a client holding it would control the fleet; give the admin API a key of its own", t.Name)
			}
		}
	}
	if c.TrustTenantHeader && slices.ContainsFunc(tenants, func(t Tenant) bool { return len(t.Hashes) > 0 }) {
		for _, t := range tenants {
			if len(t.Hashes) == 0 && t.Name != DefaultTenant {
				bad("tenant %q has no key: with --trust-tenant-header the header names tenants only when no tenant has a key (a key names its tenant first, as in smg); give it a key, or give no tenant one", t.Name)
			}
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return tenants, nil
}

func checkLimits(l Limits, where string, bad func(string, ...any)) {
	for _, f := range []struct {
		name string
		v    *int
	}{{"requests_per_minute", l.RequestsPerMinute}, {"tokens_per_minute", l.TokensPerMinute}, {"max_concurrent", l.MaxConcurrent}} {
		if f.v != nil && *f.v <= 0 {
			bad("%s: %s must be above 0 (leave it out for no limit)", where, f.name)
		}
	}
}

// TenantsLimited reports whether some tenant has a limit.
func (c *Config) TenantsLimited() bool {
	for _, t := range c.Tenants {
		if t.Limits != nil || len(t.ModelLimits) > 0 {
			return true
		}
	}
	return false
}
