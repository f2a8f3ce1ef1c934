package config

import (
	"io"
	"os"
	"slices"
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
		// smg's encode workers (E/P/D), named like its --prefill and --decode, which its
		// argument list parses apart and smg-flags.txt therefore lacks.
		{[]string{"--encode", "http://e:8000"}, "--encode (smg's): encode/prefill/decode (multimodal encoders) is out of Baton's scope"},
		{[]string{"--pd-disaggregation", "--encode", "http://e:8000", "9000"}, "--encode (smg's): "},
	} {
		if _, err := Parse(tc.args, io.Discard); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
	}
}

// The reference's smg table (docs/REFERENCE.md) names every smg flag.
func TestReferenceHasTheSmgTable(t *testing.T) {
	b, err := os.ReadFile("../../docs/REFERENCE.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i := strings.Index(s, "### Coming from smg")
	if i < 0 {
		t.Fatal("docs/REFERENCE.md has no smg section")
	}
	section := s[i:]
	if j := strings.Index(section[1:], "\n## "); j >= 0 {
		section = section[:j]
	}
	for _, name := range smgFlags {
		if !strings.Contains(section, "`--"+name+"`") {
			t.Errorf("the smg table of docs/REFERENCE.md lacks --%s", name)
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

// A refused command line never echoes a value: it may be a password (an smg flag Baton does not
// have, a mistyped key flag, a URL with credentials); a flag's value that is another flag is
// refused, not taken.
func TestRefusalsEchoNoSecret(t *testing.T) {
	for _, args := range [][]string{
		{"--oracle-password", "SECRETPW"},
		{"--postgres-db-url", "postgres://u:SECRETPG@h/db"},
		{"--redis-url", "redis://:SECRETREDIS@h:6379/0"},
		{"--api-keys", "SECRETK"},
		{"--api-key", "--client-api-key", "SECRETX"},
		{"SECRETPOS"},
	} {
		_, err := Parse(args, io.Discard)
		if err == nil {
			t.Errorf("%q: accepted", args[0])
			continue
		}
		if strings.Contains(err.Error(), "SECRET") {
			t.Errorf("%q: the refusal shows the value: %v", args[0], err)
		}
	}
	if _, err := Parse([]string{"--api-key", "--client-api-key", "x"}, io.Discard); err == nil || !strings.Contains(err.Error(), "--api-key needs a value") {
		t.Errorf("a flag as a flag's value: %v", err)
	}
}

// smg reads --control-plane-api-keys from CONTROL_PLANE_API_KEYS too (entries separated by
// commas); so does Baton, with the flag's rules.
func TestControlPlaneKeysFromTheEnvironment(t *testing.T) {
	t.Setenv("CONTROL_PLANE_API_KEYS", "a1:Admin:admin:k1, a2:Ops:admin:k2")
	c, err := Parse(nil, io.Discard)
	if err != nil || !slices.Equal(c.AdminKeys(), []string{"k1", "k2"}) {
		t.Errorf("%v, admin keys %d", err, len(c.AdminKeys()))
	}
	t.Setenv("CONTROL_PLANE_API_KEYS", "u1:Reader:user:k3")
	if _, err := Parse(nil, io.Discard); err == nil || !strings.Contains(err.Error(), "CONTROL_PLANE_API_KEYS") || strings.Contains(err.Error(), "k3") {
		t.Errorf("a user key in the environment: %v", err)
	}
}

// An alias names a model the workers serve: an alias of an alias, and one alias given twice for
// two models, are refused instead of answering 404 (or the last one) silently.
func TestAliasMistakesAreRefused(t *testing.T) {
	for _, args := range [][]string{
		{"--model-alias", "a=b", "--model-alias", "b=m1"},
		{"--model-alias", "foo=m1", "--model-alias", "foo=m2"},
	} {
		if _, err := Parse(args, io.Discard); err == nil {
			t.Errorf("%v: accepted", args)
		}
	}
	if _, err := Parse([]string{"--model-alias", "a=m1", "--model-alias", "b=m1", "--model-alias", "a=m1"}, io.Discard); err != nil {
		t.Errorf("two aliases of one model: %v", err)
	}
}
