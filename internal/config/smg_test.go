package config

import (
	"io"
	"os"
	"strings"
	"testing"
	"time"
)

// smgFlags is smg's router command line (its configuration reference: the launch, routing,
// policy, resilience, health, discovery, metrics and worker flags).
var smgFlags = []string{
	"api-key", "assignment-mode", "backend", "balance-abs-threshold", "balance-rel-threshold", "balance-token-usage-threshold",
	"block-size", "bootstrap-port-annotation", "cache-boundaries", "cache-index", "cache-match-threshold", "cache-threshold", "cache-ttl-secs",
	"cb-failure-threshold", "cb-success-threshold", "cb-timeout-duration-secs", "cb-window-duration-secs", "cors-allowed-origins",
	"decode", "decode-policy", "decode-selector", "disable-circuit-breaker", "disable-health-check", "disable-retries", "dp-aware",
	"dp-minimum-tokens-scheduler", "drain-settle-secs", "enable-igw", "enable-trace", "eviction-interval", "grpc-mode",
	"health-check-endpoint", "health-check-interval-secs", "health-check-port", "health-check-timeout-secs", "health-failure-threshold",
	"health-success-threshold", "host", "least-load-default-throughput", "least-load-kv-pressure-weight", "least-load-max-waiting-requests",
	"least-load-mean-prefill-tokens", "load-monitor-interval", "log-dir", "log-json", "log-level", "max-concurrent-requests", "max-idle-secs",
	"max-payload-size", "max-tree-size", "model-id-from", "overlap-decay", "overload-token-usage-threshold", "pd-disaggregation", "policy",
	"port", "prefill", "prefill-policy", "prefill-selector", "prefix-hash-balance-abs-threshold", "prefix-hash-load-factor",
	"prefix-token-count", "prometheus-duration-buckets", "prometheus-host", "prometheus-port", "queue-size", "queue-timeout-secs",
	"rate-limit-tokens-per-second", "remove-unhealthy-workers", "request-id-headers", "request-timeout-secs", "retry-backoff-multiplier",
	"retry-initial-backoff-ms", "retry-jitter-factor", "retry-max-backoff-ms", "retry-max-retries", "routing-key-headers",
	"routing-key-override", "selection-temperature", "selector", "service-discovery", "service-discovery-namespace", "service-discovery-port",
	"sticky-key-idle-secs", "sticky-sessions", "upstream-http2", "upstream-pool-idle-timeout-secs", "worker-overload-protection",
	"worker-overload-token-usage", "worker-overload-waiting-requests", "worker-startup-check-interval", "worker-startup-delay",
	"worker-startup-timeout-secs", "worker-urls",
}

// Every smg flag works in Baton with the same meaning, or is refused with one line naming
// Baton's way: none is merely "unknown".
func TestEverySmgFlagWorksOrHints(t *testing.T) {
	for _, name := range smgFlags {
		_, err := Parse([]string{"--" + name + "=1"}, io.Discard)
		if err == nil {
			continue
		}
		msg := err.Error()
		if strings.Contains(msg, "unknown flag --"+name) && !strings.Contains(msg, "--"+name+" (smg's): ") {
			t.Errorf("--%s is refused without a hint: %v", name, err)
		}
	}
}

// smg's spellings that mean the same in Baton work as they do in smg.
func TestSmgSpellings(t *testing.T) {
	c, err := Parse([]string{"--prometheus-port", "9100", "--worker-urls", "http://a:1,http://b:1", "http://c:1", "--eviction-interval", "120",
		"--cache-match-threshold", "0.5"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.MetricsPort != 9100 || len(c.WorkerURLs) != 3 || c.EvictionInterval != 2*time.Minute || c.CacheThreshold != 0.5 {
		t.Errorf("config %d %v %v %v", c.MetricsPort, c.WorkerURLs, c.EvictionInterval, c.CacheThreshold)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-port", "8080"}, "did you mean --port?"},
		{[]string{"--prot", "8080"}, "did you mean --port?"},
		{[]string{"--policy", "consistent_hashing"}, "use prefix_hash"},
		{[]string{"--prometheus-host", "0.0.0.0"}, "the metrics listener binds --host"},
	} {
		if _, err := Parse(tc.args, io.Discard); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
	}
}

// The README's smg table names every smg flag.
func TestREADMEHasTheSmgTable(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i := strings.Index(s, "### Coming from smg")
	if i < 0 {
		t.Fatal("the README has no smg section")
	}
	section := s[i:]
	if j := strings.Index(section[1:], "\n## "); j >= 0 {
		section = section[:j]
	}
	for _, name := range smgFlags {
		if !strings.Contains(section, "`--"+name+"`") {
			t.Errorf("the README's smg table lacks --%s", name)
		}
	}
}

// A command line taken from smg is told, at startup, which of Baton's defaults in effect differ
// from smg's; a setting given its smg value, or unused, is not named.
func TestSmgDifferences(t *testing.T) {
	parse := func(args ...string) string {
		t.Helper()
		c, err := Parse(args, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(SmgDifferences(c), "; ")
	}
	got := parse("--worker-urls", "http://a:8000", "--api-key", "sk-1")
	for _, want := range []string{"policy=round_robin (smg: cache_aware)", "api_key is checked on clients", "--worker-api-key"} {
		if !strings.Contains(got, want) {
			t.Errorf("%q lacks %q", got, want)
		}
	}
	if strings.Contains(got, "max_tree_size") || strings.Contains(got, "service_discovery") {
		t.Errorf("names settings not in use: %q", got)
	}
	got = parse("--policy", "cache_aware", "--service-discovery", "--selector", "app=engine")
	for _, want := range []string{"max_tree_size=16777216", "service_discovery_port=8000 (smg: 80)", "service_discovery_namespace=Baton's own"} {
		if !strings.Contains(got, want) {
			t.Errorf("%q lacks %q", got, want)
		}
	}
	if strings.Contains(got, "policy=") {
		t.Errorf("names the policy given: %q", got)
	}
	if got := parse("--policy", "cache_aware", "--max-tree-size", "67108864", "--api-key", "k", "--worker-api-key", "w"); got != "" {
		t.Errorf("differences named with smg's values given: %q", got)
	}
}
