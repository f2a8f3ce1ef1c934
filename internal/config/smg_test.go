package config

import (
	"io"
	"os"
	"strings"
	"testing"
	"time"
)

// smgFlags is smg's router command line, every long flag and alias, as its source at a named
// commit declares them (testdata/smg-flags.txt).
var smgFlags = func() []string {
	b, err := os.ReadFile("testdata/smg-flags.txt")
	if err != nil {
		panic(err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			out = append(out, line)
		}
	}
	return out
}()

// Every flag of smg's command line works in Baton with the same meaning, or is refused with one
// line naming Baton's way: none is merely "unknown".
func TestEverySmgFlagIsAccountedFor(t *testing.T) {
	if len(smgFlags) < 150 {
		t.Fatalf("testdata/smg-flags.txt lists %d flags: not smg's whole command line", len(smgFlags))
	}
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
		"--cache-match-threshold", "0.5", "--spill-abs-threshold", "7", "--spill-rel-threshold", "2.5"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.MetricsPort != 9100 || len(c.WorkerURLs) != 3 || c.EvictionInterval != 2*time.Minute || c.CacheThreshold != 0.5 ||
		c.BalanceAbsThreshold != 7 || c.BalanceRelThreshold != 2.5 {
		t.Errorf("config %d %v %v %v %v %v", c.MetricsPort, c.WorkerURLs, c.EvictionInterval, c.CacheThreshold, c.BalanceAbsThreshold, c.BalanceRelThreshold)
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
	got := parse("--worker-urls", "http://a:8000", "--api-key", "sk-1", "--max-concurrent-requests", "8")
	for _, want := range []string{"policy=round_robin (smg: cache_aware)", "503 queue_full", "504 queue_timeout", "(smg: 429 and 408; --queue-answers smg)"} {
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
	if got := parse("--policy", "cache_aware", "--max-tree-size", "67108864", "--api-key", "k", "--worker-api-key", "k"); got != "" {
		t.Errorf("differences named with smg's values given: %q", got)
	}
}

// smg's --api-key is the key sent to the engines (smg's docs/configuration/authentication.md:
// the gateway adds it to requests to workers): a command line copied from smg sends it on and
// checks no client with it; --client-api-key is the clients' key. It may not disagree with
// --worker-api-key.
func TestSmgAPIKeyIsTheEnginesKey(t *testing.T) {
	c, err := Parse([]string{"--worker-urls", "http://a:8000", "--api-key", "worker-secret"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if ws := c.AllWorkers(); len(ws) != 1 || ws[0].APIKey != "worker-secret" || c.ClientAPIKey != "" {
		t.Errorf("workers %+v, client key %q", ws, c.ClientAPIKey)
	}
	if _, err := Parse([]string{"--api-key", "a", "--worker-api-key", "b"}, io.Discard); err == nil || !strings.Contains(err.Error(), "differ") {
		t.Errorf("two engine keys that differ: %v", err)
	}
}

// smg's selectors are key=value pairs separated by spaces; the comma form (Kubernetes', in
// smg's guides too) names the same pairs instead of one label whose value holds commas.
func TestSelectorsSpaceOrComma(t *testing.T) {
	for _, args := range [][]string{
		{"--service-discovery", "--selector", "app=sglang", "role=prefill"},
		{"--service-discovery", "--selector", "app=sglang,role=prefill"},
		{"--service-discovery", "--selector", "app=sglang, role=prefill"},
	} {
		c, err := Parse(args, io.Discard)
		if err != nil || len(c.Selector) != 2 || c.Selector["app"] != "sglang" || c.Selector["role"] != "prefill" {
			t.Errorf("%v: %v %v", args, c.Selector, err)
		}
	}
	if _, err := Parse([]string{"--service-discovery", "--selector", "app=sglang,role"}, io.Discard); err == nil || !strings.Contains(err.Error(), "separated by spaces or commas") {
		t.Errorf("a pair without =: %v", err)
	}
}
