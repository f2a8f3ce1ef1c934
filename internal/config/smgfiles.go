package config

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"math"
	"regexp"
	"slices"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
)

// smg's two policy files, read into Baton's own settings so that an smg command line keeps its
// meaning: --priority-scheduler-config (smg model_gateway/src/middleware/scheduler/config.rs:
// classes and tenant_policies) becomes admission's queue_classes and reserved_slots and the
// tenants' max_priority; --tenant-rate-limit-config (smg model_gateway/src/rate_limit/config.rs:
// default_policy and tenants with model_rules) becomes the tenants' limits and model_limits.
// Each tenant_key names a Baton tenant: auth:NAME one with a key (--tenant-api-key NAME:KEY or
// tenants:), auth:<SHA-256 hex> the tenant of that key (smg's identity of a bare --api-key),
// header:NAME one named by the trusted header, anonymous tenant default.

// smgClass is one class of smg's priority scheduler file; smg requires every field but
// reserved_per_slot.
type smgClass struct {
	ReservedFloor           *int     `json:"reserved_floor"`
	ReservedPerSlot         *float64 `json:"reserved_per_slot"`
	QueueSize               *int     `json:"queue_size"`
	QueueTimeoutSecs        *int     `json:"queue_timeout_secs"`
	StarvationThresholdSecs *int     `json:"starvation_threshold_secs"`
	CanPreempt              *bool    `json:"can_preempt"`
}

type smgSchedulerFile struct {
	Classes        map[string]smgClass `json:"classes"`
	TenantPolicies map[string]struct {
		MaxClass string `json:"max_class"`
	} `json:"tenant_policies"`
}

type smgRatePolicy struct {
	TenantKey         *string `json:"tenant_key"`
	TokensPerMinute   *int64  `json:"tokens_per_minute"`
	RequestsPerMinute *int64  `json:"requests_per_minute"`
	ModelRules        []struct {
		RuleID  string `json:"rule_id"`
		Matcher struct {
			Type  string `json:"type"`
			Value string `json:"value"`
		} `json:"matcher"`
		TokensPerMinute   *int64 `json:"tokens_per_minute"`
		RequestsPerMinute *int64 `json:"requests_per_minute"`
	} `json:"model_rules"`
}

type smgRateFile struct {
	DefaultPolicy *smgRatePolicy  `json:"default_policy"`
	Tenants       []smgRatePolicy `json:"tenants"`
}

// smgClassNames are smg's class names, highest first, as Baton's classes.
var smgClassNames = map[string]string{"system": PriorityCritical, "interactive": PriorityInteractive, "default": PriorityDefault, "bulk": PriorityBatch}

var smgRuleID = regexp.MustCompile(`^[A-Za-z0-9._-]+$`)

// readSmgFile reads one of smg's files strictly: a key smg does not define is refused (smg's
// scheduler file would ignore it silently), and so is a file above 1 MiB.
func readSmgFile(flag, path string, into any) error {
	data, err := ReadFile(path, MaxSmallFile)
	if err != nil {
		return fmt.Errorf("--%s: %w", flag, err)
	}
	if err := yaml.UnmarshalStrict(data, into); err != nil {
		return fmt.Errorf("--%s %s: %w", flag, path, err)
	}
	return nil
}

// applySmgFiles reads smg's policy files named by c into c's admission and tenants. What it
// could not carry over exactly is kept for SmgDifferences.
func (c *Config) applySmgFiles() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	c.smgNotes = nil
	switch {
	case c.PrioritySchedulerConfig != "" && c.PrioritySchedulerEnabled:
		var f smgSchedulerFile
		if err := readSmgFile("priority-scheduler-config", c.PrioritySchedulerConfig, &f); err != nil {
			return err
		}
		c.applySmgScheduler(f, bad)
	}
	switch {
	case c.TenantRateLimitEnabled && c.TenantRateLimitConfig == "":
		bad("--tenant-rate-limit-enabled needs --tenant-rate-limit-config (smg's YAML: default_policy, tenants), or give the tenants' limits in --config's tenants:")
	case c.TenantRateLimitConfig != "" && c.TenantRateLimitEnabled:
		var f smgRateFile
		if err := readSmgFile("tenant-rate-limit-config", c.TenantRateLimitConfig, &f); err != nil {
			return err
		}
		c.applySmgRateLimits(f, bad)
	}
	return errors.Join(errs...)
}

func (c *Config) applySmgScheduler(f smgSchedulerFile, bad func(string, ...any)) {
	const at = "--priority-scheduler-config"
	capacity := c.Admission.MaxConcurrentRequests
	reserved := map[string]int{}
	for _, name := range slices.Sorted(maps.Keys(f.Classes)) {
		class, ok := smgClassNames[name]
		where := at + ": classes." + name
		if !ok {
			bad("%s: smg's classes are system, interactive, default and bulk", where)
			continue
		}
		k := f.Classes[name]
		for _, req := range []struct {
			field string
			set   bool
		}{{"reserved_floor", k.ReservedFloor != nil}, {"queue_size", k.QueueSize != nil}, {"queue_timeout_secs", k.QueueTimeoutSecs != nil},
			{"starvation_threshold_secs", k.StarvationThresholdSecs != nil}, {"can_preempt", k.CanPreempt != nil}} {
			if !req.set {
				bad("%s: %s is missing (smg requires it)", where, req.field)
			}
		}
		if k.ReservedFloor == nil || k.QueueSize == nil || k.QueueTimeoutSecs == nil || k.StarvationThresholdSecs == nil || k.CanPreempt == nil {
			continue
		}
		switch {
		case *k.ReservedFloor < 0 || *k.ReservedFloor > math.MaxUint16:
			bad("%s: reserved_floor %d: want 0 to 65535", where, *k.ReservedFloor)
		case *k.QueueSize < 0:
			bad("%s: queue_size %d is below 0", where, *k.QueueSize)
		case *k.QueueTimeoutSecs <= 0 || *k.QueueTimeoutSecs > 86400:
			bad("%s: queue_timeout_secs must be above 0 (at most a day)", where)
		case *k.StarvationThresholdSecs <= 0 || *k.StarvationThresholdSecs > 86400:
			bad("%s: starvation_threshold_secs must be above 0 (at most a day)", where)
		case k.ReservedPerSlot != nil && (math.IsNaN(*k.ReservedPerSlot) || math.IsInf(*k.ReservedPerSlot, 0) || *k.ReservedPerSlot < 0 || *k.ReservedPerSlot > 1):
			bad("%s: reserved_per_slot must be a share of the slots, 0 to 1", where)
		}
		if _, set := c.Admission.Classes[class]; set {
			bad("%s: admission.queue_classes.%s is set too: give the class once", where, class)
			continue
		}
		if c.Admission.Classes == nil {
			c.Admission.Classes = map[string]QueueClass{}
		}
		size := *k.QueueSize
		c.Admission.Classes[class] = QueueClass{Size: &size, Timeout: time.Duration(*k.QueueTimeoutSecs) * time.Second,
			PromoteAfter: time.Duration(*k.StarvationThresholdSecs) * time.Second}
		r := *k.ReservedFloor
		if k.ReservedPerSlot != nil && capacity > 0 {
			r = max(r, int(math.Ceil(*k.ReservedPerSlot*float64(capacity))))
		}
		if r > 0 {
			reserved[class] = r
		}
		if *k.CanPreempt {
			c.smgNotes = append(c.smgNotes, "classes."+name+".can_preempt: Baton never stops a request it started; reserved_slots keep room for the classes above instead")
		}
	}
	if len(reserved) > 0 {
		if len(c.Admission.ReservedSlots) > 0 {
			bad("%s: reservations are in admission.reserved_slots too: give them once", at)
		} else {
			c.Admission.ReservedSlots = clampReserved(reserved, capacity, &c.smgNotes)
		}
	}
	for _, key := range slices.Sorted(maps.Keys(f.TenantPolicies)) {
		where := at + ": tenant_policies." + key
		class, ok := smgClassNames[f.TenantPolicies[key].MaxClass]
		if !ok {
			bad("%s: max_class %q: want system, interactive, default or bulk", where, f.TenantPolicies[key].MaxClass)
			continue
		}
		t := c.smgTenant(key, where, bad)
		if t == nil {
			continue
		}
		if t.MaxPriority != "" && t.MaxPriority != class {
			bad("%s: tenant %q has max_priority %s in tenants: too: give it once", where, t.Name, t.MaxPriority)
			continue
		}
		t.MaxPriority = class
	}
}

// clampReserved fits smg's reservations into Baton's slots as smg's scheduler does (the highest
// classes first), leaving one slot every class may take: Baton's slots bound all classes.
func clampReserved(reserved map[string]int, capacity int, notes *[]string) map[string]int {
	left := capacity - 1
	out := map[string]int{}
	for _, class := range PriorityClasses {
		n, ok := reserved[class]
		if !ok {
			continue
		}
		if n > left {
			*notes = append(*notes, fmt.Sprintf("%s's %d reserved slots are %d: --max-concurrent-requests is %d and one slot stays shared (smg clamps reservations to capacity too)",
				class, n, max(left, 0), capacity))
			n = max(left, 0)
		}
		if n > 0 {
			out[class] = n
			left -= n
		}
	}
	return out
}

func (c *Config) applySmgRateLimits(f smgRateFile, bad func(string, ...any)) {
	const at = "--tenant-rate-limit-config"
	if f.DefaultPolicy == nil {
		bad("%s: default_policy is missing (smg requires it)", at)
		return
	}
	if f.DefaultPolicy.TenantKey != nil {
		bad("%s: default_policy must not set tenant_key", at)
	}
	def, defRules := smgLimits(*f.DefaultPolicy, at+": default_policy", bad)
	listed := map[string]bool{}
	for i, p := range f.Tenants {
		where := fmt.Sprintf("%s: tenants[%d]", at, i)
		if p.TenantKey == nil || strings.TrimSpace(*p.TenantKey) == "" {
			bad("%s: tenant_key is missing", where)
			continue
		}
		key := *p.TenantKey
		where += " (" + key + ")"
		if strings.HasPrefix(key, "header:") && !c.TrustTenantHeader {
			bad("%s: a header: tenant needs --trust-tenant-header (smg refuses it too: it could never match)", where)
			continue
		}
		limits, rules := smgLimits(p, where, bad)
		t := c.smgTenant(key, where, bad)
		if t == nil {
			continue
		}
		if listed[t.Name] {
			bad("%s: tenant %q is listed twice", where, t.Name)
			continue
		}
		listed[t.Name] = true
		if t.Limits != nil || len(t.ModelLimits) > 0 {
			bad("%s: tenant %q has limits in tenants: too: give them once", where, t.Name)
			continue
		}
		t.Limits, t.ModelLimits = limits, rules
	}
	// default_policy is every other tenant's, each counted on its own as smg counts each
	// tenant key on its own.
	names := c.smgTenantNames()
	if c.ClientKey() == "" && len(c.TenantAPIKeys) == 0 && !slices.ContainsFunc(c.Tenants, func(t Tenant) bool { return len(t.Keys) > 0 || t.KeyFile != "" || t.KeyEnv != "" }) {
		c.smgNotes = append(c.smgNotes, "default_policy: without client keys every request is tenant default and shares its limits (smg: each client address is a tenant with its own)")
	}
	for _, name := range names {
		if listed[name] {
			continue
		}
		t := c.tenantNamed(name)
		if t.Limits != nil || len(t.ModelLimits) > 0 {
			continue // its own limits, from tenants:
		}
		l := *def
		t.Limits, t.ModelLimits = &l, slices.Clone(defRules)
	}
}

// smgLimits are one smg policy's limits as Baton's: the tenant's, and its model rules (exact
// names, prefixes as name*); as in smg, a rule holds beside the tenant's limits.
func smgLimits(p smgRatePolicy, where string, bad func(string, ...any)) (*Limits, []Limits) {
	positive := func(field string, v *int64) *int {
		switch {
		case v == nil:
			bad("%s: %s is missing (smg requires it)", where, field)
		case *v <= 0 || *v > math.MaxUint32:
			bad("%s: %s must be 1 to 4294967295", where, field)
		default:
			n := int(*v)
			return &n
		}
		return nil
	}
	tpm, rpm := positive("tokens_per_minute", p.TokensPerMinute), positive("requests_per_minute", p.RequestsPerMinute)
	if tpm == nil || rpm == nil {
		return &Limits{}, nil
	}
	out := &Limits{TokensPerMinute: tpm, RequestsPerMinute: rpm}
	var rules []Limits
	ids, models := map[string]bool{}, map[string]string{}
	for j, r := range p.ModelRules {
		w := fmt.Sprintf("%s: model_rules[%d]", where, j)
		if !smgRuleID.MatchString(r.RuleID) {
			bad("%s: rule_id %.80q must be letters, digits, '.', '_' or '-'", w, r.RuleID)
		} else if ids[r.RuleID] {
			bad("%s: rule_id %s is used twice", w, r.RuleID)
		}
		ids[r.RuleID] = true
		v := r.Matcher.Value
		var model string
		switch {
		case strings.TrimSpace(v) == "" || strings.TrimSpace(v) != v:
			bad("%s: matcher value must not be empty or padded", w)
			continue
		case strings.Contains(v, "*"):
			bad("%s: matcher value %.80q: a model name has no '*'", w, v)
			continue
		case r.Matcher.Type == "exact":
			model = v
		case r.Matcher.Type == "prefix":
			model = v + "*"
		default:
			bad("%s: matcher type %.40q: want exact or prefix", w, r.Matcher.Type)
			continue
		}
		if other, dup := models[model]; dup {
			bad("%s: matcher duplicates rule %s", w, other)
			continue
		}
		models[model] = r.RuleID
		rt, rr := positive("tokens_per_minute", r.TokensPerMinute), positive("requests_per_minute", r.RequestsPerMinute)
		if rt == nil || rr == nil {
			continue
		}
		rules = append(rules, Limits{Model: model, TokensPerMinute: rt, RequestsPerMinute: rr})
	}
	return out, rules
}

// smgTenant is the tenant an smg tenant_key names, added to c.Tenants when it comes from a flag
// (--tenant-api-key, --client-api-key) or the trusted header; nil (with the problem reported)
// for a key Baton cannot name a tenant by.
func (c *Config) smgTenant(key, where string, bad func(string, ...any)) *Tenant {
	var name string
	switch {
	case key == "anonymous" && !slices.Contains(c.smgTenantNames(), DefaultTenant):
		c.smgNotes = append(c.smgNotes, where+": every request names its tenant by a key here, so this policy applies to none (as in smg with keys)")
		return nil
	case key == "anonymous":
		name = DefaultTenant
	case strings.HasPrefix(key, "ip:"):
		bad("%s: Baton does not tell tenants apart by client address: give each client a key (--tenant-api-key NAME:KEY) and write auth:NAME", where)
		return nil
	case strings.HasPrefix(key, "header:"):
		name = strings.TrimPrefix(key, "header:")
	case strings.HasPrefix(key, "auth:"):
		name = strings.TrimPrefix(key, "auth:")
		if b, err := hex.DecodeString(name); err == nil && len(b) == sha256.Size {
			if n := c.tenantOfHash([32]byte(b)); n != "" {
				name = n
			} else {
				bad("%s: no key of Baton's hashes to it (smg's identity of a bare --api-key is its hash: here that key is --client-api-key)", where)
				return nil
			}
		}
	default:
		bad("%s: want auth:<tenant>, header:<tenant>, ip:<address> or anonymous", where)
		return nil
	}
	if !tenantName.MatchString(name) {
		bad("%s: tenant name %.80q must be 1 to 63 lower-case letters, digits, '_', '.' or '-'", where, name)
		return nil
	}
	if !slices.Contains(c.smgTenantNames(), name) {
		if !strings.HasPrefix(key, "header:") {
			bad("%s: no tenant %s: give it a key (--tenant-api-key %s:KEY, or tenants: in --config)", where, name, name)
			return nil
		}
		c.Tenants = append(c.Tenants, Tenant{Name: name, byHeader: true})
	}
	return c.tenantNamed(name)
}

// smgTenantNames are the tenants' names: tenants:, --tenant-api-key's, and default where a
// request can be it (--client-api-key's tenant, or every request's when no tenant has a key).
func (c *Config) smgTenantNames() []string {
	var out []string
	keyed := c.ClientKey() != ""
	for _, t := range c.Tenants {
		out = append(out, t.Name)
		keyed = keyed || len(t.Keys) > 0 || t.KeyFile != "" || t.KeyEnv != ""
	}
	for _, tk := range c.TenantAPIKeys {
		if name, _, ok := strings.Cut(tk, ":"); ok {
			out = append(out, strings.TrimSpace(name))
			keyed = true
		}
	}
	if !keyed || c.ClientKey() != "" {
		out = append(out, DefaultTenant)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// tenantNamed returns c's tenant named name, added (no keys: ResolvedTenants gives it the
// flags' keys) when only a flag names it.
func (c *Config) tenantNamed(name string) *Tenant {
	for i := range c.Tenants {
		if c.Tenants[i].Name == name {
			return &c.Tenants[i]
		}
	}
	c.Tenants = append(c.Tenants, Tenant{Name: name, fromFlag: true})
	return &c.Tenants[len(c.Tenants)-1]
}

// tenantOfHash names the tenant whose key has SHA-256 h, among the keys known before the files
// are read (flags, environment and keys: of the configuration); "" for none.
func (c *Config) tenantOfHash(h [32]byte) string {
	if c.ClientKey() != "" && sha256.Sum256([]byte(c.ClientKey())) == h {
		return DefaultTenant
	}
	for _, tk := range c.TenantAPIKeys {
		if name, key, ok := strings.Cut(tk, ":"); ok && sha256.Sum256([]byte(strings.TrimSpace(key))) == h {
			return strings.TrimSpace(name)
		}
	}
	want := "sha256:" + hex.EncodeToString(h[:])
	for _, t := range c.Tenants {
		if slices.Contains(t.Keys, want) {
			return t.Name
		}
	}
	return ""
}
