package config

import (
	"crypto/sha256"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Every problem of the tenants: section is named at once, with its tenant and field; unknown
// fields are named with their line; keys are never accepted in plain text.
func TestTenantErrorsAllAtOnce(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "baton.yaml")
	y := `tenants:
  - name: team-a
    keys: ["sk-plain-text-key"]
  - name: team-a
    keys: ["` + HashKey("shared") + `"]
  - name: team-b
    keys: ["` + HashKey("shared") + `"]
    max_priority: urgent
    weight: 0
    limits: {tokens_per_minute: 0, requests_per_minute: -1}
  - name: Team C
    key_env: BATON_TEST_UNSET_KEY
  - name: team-d
    limits: {max_concurrent: 4}
  - name: team-e
    keys: ["` + HashKey("e") + `"]
    modles: [m]
`
	if err := os.WriteFile(file, []byte(y), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Parse([]string{"--config", file}, io.Discard)
	if err == nil {
		t.Fatal("accepted")
	}
	// The unknown field stops the file before the rest is read: it alone is named, with its line.
	if !strings.Contains(err.Error(), "tenants[5].modles (line 17): unknown key (did you mean models?)") {
		t.Fatalf("unknown field: %v", err)
	}
	y = strings.Replace(y, "    modles: [m]\n", "", 1)
	if err := os.WriteFile(file, []byte(y), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = Parse([]string{"--config", file}, io.Discard)
	for _, want := range []string{
		`tenant "team-a": keys[0]: want sha256:<64 hex digits>`,
		`tenant "team-a": the name is used twice`,
		`tenants "team-a" and "team-b" share a key`,
		`tenant "team-b": max_priority "urgent"`,
		`tenant "team-b": weight must be above 0`,
		`tenant "team-b": limits: requests_per_minute must be above 0`,
		`tenant "team-b": limits: tokens_per_minute must be above 0`,
		`tenant "Team C": name must be`,
		`tenant "Team C": key_env: the variable BATON_TEST_UNSET_KEY is not set`,
		`tenant "team-d": no key`,
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("the errors lack %q:\n%v", want, err)
		}
	}
	if strings.Contains(err.Error(), "sk-plain-text-key") {
		t.Error("an error repeats a key")
	}
}

// --api-key is tenant default's key; smg's --tenant-api-key adds tenants; a default tenant
// with limits and no key holds for everyone.
func TestTenantsFromFlags(t *testing.T) {
	c, err := Parse([]string{"--client-api-key", "sk-1", "--tenant-api-key", "team:sk-2", "--tenant-api-key", "team:sk-3"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ts, err := c.ResolvedTenants(os.Getenv)
	if err != nil || len(ts) != 2 || ts[0].Name != DefaultTenant || ts[1].Name != "team" || len(ts[1].Hashes) != 2 {
		t.Fatalf("%+v %v", ts, err)
	}
	if _, err := Parse([]string{"--tenant-api-key", "no-colon"}, io.Discard); err == nil || !strings.Contains(err.Error(), "want TENANT:KEY") {
		t.Errorf("a key without its tenant: %v", err)
	}
}

// reserved_slots and queue_classes name priority classes; reservations leave a slot to share.
func TestAdmissionClassSettings(t *testing.T) {
	file := filepath.Join(t.TempDir(), "baton.yaml")
	write := func(y string) error {
		if err := os.WriteFile(file, []byte(y), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := Parse([]string{"--config", file}, io.Discard)
		return err
	}
	if err := write("admission:\n  max_concurrent_requests: 4\n  reserved_slots: {critical: 2}\n  queue_classes: {batch: {size: 1000, timeout: 10m}}\n"); err != nil {
		t.Fatal(err)
	}
	err := write("admission:\n  max_concurrent_requests: 2\n  reserved_slots: {urgent: 1, critical: 2}\n  queue_classes: {batch: {size: -1}}\n")
	for _, want := range []string{`reserved_slots: "urgent" is no priority class`, "2 slots reserved need max_concurrent_requests above them", "queue_classes.batch.size: -1 is below 0"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("errors lack %q: %v", want, err)
		}
	}
}

// No client's key is an admin key: a tenant's key equal to the admin key, the control plane's or
// smg's --api-key acting as the admin key is refused; smg's bare --api-key, both the clients' and
// the admin API's as in smg, is not.
func TestClientKeysAreNeverAdminKeys(t *testing.T) {
	for _, args := range [][]string{
		{"--api-key", "EKEY", "--client-api-key", "CKEY", "--tenant-api-key", "t1:EKEY"},
		{"--admin-api-key", "ADMK", "--tenant-api-key", "t1:ADMK"},
		{"--control-plane-api-keys", "a:b:admin:ADMK", "--tenant-api-key", "t1:ADMK"},
		{"--api-key", "K", "--client-api-key", "K"},
	} {
		if _, err := Parse(args, io.Discard); err == nil || !strings.Contains(err.Error(), "is an admin key") {
			t.Errorf("%v: %v", args, err)
		}
	}
	if _, err := Parse([]string{"--api-key", "K"}, io.Discard); err != nil {
		t.Errorf("smg's bare --api-key: %v", err)
	}
}

// --tenant-api-key's two parts are read trimmed, as smg reads them: a key pasted with a trailing
// newline or space still names its tenant.
func TestTenantAPIKeyTrimmed(t *testing.T) {
	c, err := Parse([]string{"--tenant-api-key", " team : sk-team \n"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ts, err := c.ResolvedTenants(func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	for _, tn := range ts {
		if tn.Name == "team" && len(tn.Hashes) == 1 && tn.Hashes[0] == sha256.Sum256([]byte("sk-team")) {
			return
		}
	}
	t.Errorf("tenants %+v: want team with sk-team's hash", ts)
}
