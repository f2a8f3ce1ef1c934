package config

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

func resolved(t *testing.T, args ...string) (Config, map[string]Tenant) {
	t.Helper()
	c, err := Parse(args, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ts, err := c.ResolvedTenants(os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]Tenant{}
	for _, tn := range ts {
		byName[tn.Name] = tn
	}
	return c, byName
}

func limit(v *int) int {
	if v == nil {
		return -1
	}
	return *v
}

// smg's priority scheduler file becomes the admission section and the tenants' ceilings: each
// class's depth, timeout and starvation threshold its queue class, its floor and share of the
// slots its reservation, each tenant_policies entry the max_priority of the tenant its key names.
func TestSmgPrioritySchedulerFile(t *testing.T) {
	c, ts := resolved(t, "--worker-urls", "http://w:8000", "--max-concurrent-requests", "20",
		"--priority-scheduler-enabled", "--priority-scheduler-config", "testdata/smg-priority.yaml",
		"--tenant-api-key", "web:k-web", "--tenant-api-key", "cron:k-cron", "--tenant-api-key", "batch-jobs:k-batch")
	in := c.Admission.Classes[PriorityInteractive]
	if in.Size == nil || *in.Size != 20 || in.Timeout != 15*time.Second || in.PromoteAfter != 3*time.Second {
		t.Errorf("interactive: %+v", in)
	}
	if b := c.Admission.Classes[PriorityBatch]; b.Size == nil || *b.Size != 500 || b.Timeout != 10*time.Minute || b.PromoteAfter != 90*time.Second {
		t.Errorf("bulk: %+v", b)
	}
	// max(4, ceil(0.5 × 20)) = 10.
	if c.Admission.ReservedSlots[PriorityInteractive] != 10 || len(c.Admission.ReservedSlots) != 1 {
		t.Errorf("reserved %v", c.Admission.ReservedSlots)
	}
	for name, want := range map[string]string{"web": PriorityInteractive, "cron": PriorityCritical, "batch-jobs": PriorityBatch} {
		if ts[name].MaxPriority != want {
			t.Errorf("tenant %s: max_priority %q, want %q", name, ts[name].MaxPriority, want)
		}
	}
	if d := strings.Join(SmgDifferences(c), "; "); !strings.Contains(d, "can_preempt") {
		t.Errorf("differences %q do not name can_preempt", d)
	}

	// Reservations past the slots are clamped, highest classes first, one slot left shared.
	c, _ = resolved(t, "--worker-urls", "http://w:8000", "--max-concurrent-requests", "3",
		"--priority-scheduler-enabled", "--priority-scheduler-config", "testdata/smg-priority.yaml",
		"--tenant-api-key", "web:k-web", "--tenant-api-key", "cron:k-cron", "--tenant-api-key", "batch-jobs:k-batch")
	if c.Admission.ReservedSlots[PriorityInteractive] != 2 {
		t.Errorf("reserved %v, want interactive's clamped to 2", c.Admission.ReservedSlots)
	}
	if d := strings.Join(SmgDifferences(c), "; "); !strings.Contains(d, "interactive's 4 reserved slots are 2") {
		t.Errorf("differences %q do not name the clamp", d)
	}

	// Without --priority-scheduler-enabled smg does not read the file: neither does Baton, and
	// it says so.
	c, err := Parse([]string{"--worker-urls", "http://w:8000", "--priority-scheduler-config", "testdata/smg-priority.yaml"}, io.Discard)
	if err != nil || len(c.Admission.Classes) != 0 || !strings.Contains(strings.Join(c.Warnings(), "; "), "--priority-scheduler-config is ignored") {
		t.Errorf("%v, classes %v, warnings %q", err, c.Admission.Classes, c.Warnings())
	}
}

// smg's tenant rate-limit file becomes the tenants' limits: a listed tenant's own, with its model
// rules as model_limits (both hold, as in smg); anonymous is tenant
// default; default_policy every other tenant's, each its own.
func TestSmgTenantRateLimitFile(t *testing.T) {
	_, ts := resolved(t, "--worker-urls", "http://w:8000", "--tenant-rate-limit-enabled", "--tenant-rate-limit-config", "testdata/smg-tenant-rate-limit.yaml",
		"--tenant-api-key", "web:k-web", "--tenant-api-key", "other:k-other")
	web := ts["web"]
	if web.Limits == nil || limit(web.Limits.TokensPerMinute) != 90000 || limit(web.Limits.RequestsPerMinute) != 900 || len(web.Hashes) != 1 {
		t.Fatalf("web: %+v", web)
	}
	rules := map[string]Limits{}
	for _, l := range web.ModelLimits {
		rules[l.Model] = l
	}
	if r := rules["llama-70b"]; limit(r.TokensPerMinute) != 30000 || limit(r.RequestsPerMinute) != 2000 {
		t.Errorf("exact rule: tpm %d rpm %d, want the rule's 30000 and 2000 (the tenant's 900 holds beside it)", limit(r.TokensPerMinute), limit(r.RequestsPerMinute))
	}
	if r := rules["qwen-*"]; limit(r.TokensPerMinute) != 5000 || limit(r.RequestsPerMinute) != 50 {
		t.Errorf("prefix rule: %+v", r)
	}
	if _, ok := ts[DefaultTenant]; ok {
		t.Errorf("tenant default made although every request carries a key")
	}
	if o := ts["other"]; o.Limits == nil || limit(o.Limits.TokensPerMinute) != 20000 || limit(o.Limits.RequestsPerMinute) != 120 || len(o.Hashes) != 1 {
		t.Errorf("other (default_policy): %+v", o)
	}
	c, _ := resolved(t, "--worker-urls", "http://w:8000", "--tenant-rate-limit-enabled", "--tenant-rate-limit-config", "testdata/smg-tenant-rate-limit.yaml",
		"--tenant-api-key", "web:k-web")
	if d := strings.Join(SmgDifferences(c), "; "); !strings.Contains(d, "(anonymous): every request names its tenant by a key here") {
		t.Errorf("differences %q do not say anonymous applies to no request", d)
	}

	// Without keys every request is tenant default: anonymous's policy is its.
	path := filepath.Join(t.TempDir(), "rl.yaml")
	os.WriteFile(path, []byte("default_policy: {tokens_per_minute: 100, requests_per_minute: 5}\ntenants: [{tenant_key: anonymous, tokens_per_minute: 50, requests_per_minute: 2}]\n"), 0o600)
	c, ts = resolved(t, "--worker-urls", "http://w:8000", "--tenant-rate-limit-enabled", "--tenant-rate-limit-config", path)
	if d := ts[DefaultTenant]; d.Limits == nil || limit(d.Limits.RequestsPerMinute) != 2 {
		t.Errorf("anonymous (tenant default): %+v", d.Limits)
	}
	if d := strings.Join(SmgDifferences(c), "; "); !strings.Contains(d, "each client address is a tenant") {
		t.Errorf("differences %q do not name the shared bucket", d)
	}
}

// smg names the tenant of a bare --api-key by its key's SHA-256: here that key is the clients'
// (--client-api-key, tenant default).
func TestSmgTenantKeyByHash(t *testing.T) {
	h := sha256.Sum256([]byte("sk-client"))
	path := filepath.Join(t.TempDir(), "rl.yaml")
	os.WriteFile(path, []byte("default_policy: {tokens_per_minute: 100, requests_per_minute: 5}\ntenants:\n  - {tenant_key: \"auth:"+hex.EncodeToString(h[:])+"\", tokens_per_minute: 7, requests_per_minute: 3}\n"), 0o600)
	_, ts := resolved(t, "--worker-urls", "http://w:8000", "--client-api-key", "sk-client", "--tenant-rate-limit-enabled", "--tenant-rate-limit-config", path)
	if d := ts[DefaultTenant]; d.Limits == nil || limit(d.Limits.RequestsPerMinute) != 3 {
		t.Errorf("default: %+v", d.Limits)
	}
}

// Whatever smg refuses Baton refuses, and what Baton cannot mean the same way it refuses with
// its way; a limit is never given twice.
func TestSmgPolicyFilesRefused(t *testing.T) {
	dir := t.TempDir()
	n := 0
	write := func(body string) string {
		n++
		p := filepath.Join(dir, strconv.Itoa(n)+".yaml")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	const def = "default_policy: {tokens_per_minute: 100, requests_per_minute: 5}\n"
	rl := func(body string, extra ...string) []string {
		return append([]string{"--worker-urls", "http://w:8000", "--tenant-rate-limit-enabled", "--tenant-rate-limit-config", write(body), "--tenant-api-key", "web:k"}, extra...)
	}
	ps := func(body string) []string {
		return []string{"--worker-urls", "http://w:8000", "--max-concurrent-requests", "8", "--priority-scheduler-enabled", "--priority-scheduler-config", write(body), "--tenant-api-key", "web:k"}
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"enabled without file", []string{"--worker-urls", "http://w:8000", "--tenant-rate-limit-enabled"}, "needs --tenant-rate-limit-config"},
		{"no default policy", rl("tenants: []\n"), "default_policy is missing"},
		{"unknown key", rl(def + "tenant: []\n"), `unknown field "tenant"`},
		{"by address", rl(def + "tenants: [{tenant_key: \"ip:10.0.0.1\", tokens_per_minute: 1, requests_per_minute: 1}]\n"), "not tell tenants apart by client address"},
		{"header without trust", rl(def + "tenants: [{tenant_key: \"header:web\", tokens_per_minute: 1, requests_per_minute: 1}]\n"), "needs --trust-tenant-header"},
		{"no such tenant", rl(def + "tenants: [{tenant_key: \"auth:nobody\", tokens_per_minute: 1, requests_per_minute: 1}]\n"), "no tenant nobody"},
		{"bare id", rl(def + "tenants: [{tenant_key: \"web\", tokens_per_minute: 1, requests_per_minute: 1}]\n"), "want auth:<tenant>"},
		{"zero", rl("default_policy: {tokens_per_minute: 0, requests_per_minute: 5}\n"), "tokens_per_minute must be 1 to"},
		{"missing rpm", rl("default_policy: {tokens_per_minute: 10}\n"), "requests_per_minute is missing"},
		{"listed twice", rl(def + "tenants: [{tenant_key: \"auth:web\", tokens_per_minute: 1, requests_per_minute: 1}, {tenant_key: \"auth:web\", tokens_per_minute: 2, requests_per_minute: 2}]\n"), "listed twice"},
		{"rule twice", rl(def + "tenants: [{tenant_key: \"auth:web\", tokens_per_minute: 9, requests_per_minute: 9, model_rules: [" +
			"{rule_id: a, matcher: {type: prefix, value: q}, tokens_per_minute: 1, requests_per_minute: 1}, " +
			"{rule_id: b, matcher: {type: prefix, value: q}, tokens_per_minute: 1, requests_per_minute: 1}]}]\n"), "matcher duplicates rule a"},
		{"padded matcher", rl("default_policy: {tokens_per_minute: 9, requests_per_minute: 9, model_rules: [{rule_id: a, matcher: {type: exact, value: \"m \"}, tokens_per_minute: 1, requests_per_minute: 1}]}\n"), "padded"},
		{"bad rule id", rl("default_policy: {tokens_per_minute: 9, requests_per_minute: 9, model_rules: [{rule_id: \"a b\", matcher: {type: exact, value: m}, tokens_per_minute: 1, requests_per_minute: 1}]}\n"), "rule_id"},
		{"unknown hash", rl(def + "tenants: [{tenant_key: \"auth:" + strings.Repeat("ab", 32) + "\", tokens_per_minute: 1, requests_per_minute: 1}]\n"), "no key of Baton's hashes to it"},
		{"unknown class", ps("classes: {urgent: {reserved_floor: 0, queue_size: 1, queue_timeout_secs: 1, starvation_threshold_secs: 1, can_preempt: false}}\n"), "classes.urgent"},
		{"class field missing", ps("classes: {bulk: {queue_size: 1}}\n"), "queue_timeout_secs is missing"},
		{"zero timeout", ps("classes: {bulk: {reserved_floor: 0, queue_size: 1, queue_timeout_secs: 0, starvation_threshold_secs: 1, can_preempt: false}}\n"), "queue_timeout_secs must be above 0"},
		{"bad share", ps("classes: {bulk: {reserved_floor: 0, reserved_per_slot: -1, queue_size: 1, queue_timeout_secs: 1, starvation_threshold_secs: 1, can_preempt: false}}\n"), "reserved_per_slot"},
		{"unknown max class", ps("tenant_policies: {\"auth:web\": {max_class: urgent}}\n"), "max_class \"urgent\""},
		{"no file", []string{"--worker-urls", "http://w:8000", "--max-concurrent-requests", "8", "--priority-scheduler-enabled", "--priority-scheduler-config", filepath.Join(dir, "absent.yaml")}, "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Parse(tc.args, io.Discard); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%v, want an error containing %q", err, tc.want)
			}
		})
	}

	// A limit in tenants: and in the file: refused, naming both.
	cfg := filepath.Join(dir, "baton.yaml")
	os.WriteFile(cfg, []byte("tenants:\n  - name: web\n    keys: [\""+HashKey("k2")+"\"]\n    limits: {requests_per_minute: 3}\n"), 0o600)
	args := []string{"--config", cfg, "--worker-urls", "http://w:8000", "--tenant-rate-limit-enabled", "--tenant-rate-limit-config",
		write(def + "tenants: [{tenant_key: \"auth:web\", tokens_per_minute: 1, requests_per_minute: 1}]\n")}
	if _, err := Parse(args, io.Discard); err == nil || !strings.Contains(err.Error(), "limits in tenants: too") {
		t.Errorf("%v, want the limit given twice refused", err)
	}
}

// A stream stall timeout under a second is loud at startup: it would cut streams of an engine
// under load and open its circuit (a typo of 60ms for 60s takes the fleet out).
func TestATinyStallTimeoutIsLoud(t *testing.T) {
	for _, c := range []struct {
		v    time.Duration
		loud bool
	}{{60 * time.Millisecond, true}, {time.Nanosecond, true}, {0, false}, {time.Second, false}, {time.Minute, false}} {
		cfg := Default()
		cfg.WorkerURLs = []string{"http://127.0.0.1:1"}
		cfg.StreamStallTimeout = c.v
		if loud := strings.Contains(strings.Join(cfg.Warnings(), "; "), "--stream-stall-timeout"); loud != c.loud {
			t.Errorf("--stream-stall-timeout %s: warned %v, want %v (%q)", c.v, loud, c.loud, cfg.Warnings())
		}
	}
}
