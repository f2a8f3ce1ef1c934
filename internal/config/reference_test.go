package config

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// The settings tables of docs/REFERENCE.md are generated: their flag, YAML key and default cells
// from the settings' tags, their meanings from referenceTables (or a setting's help). A table
// edited by hand fails here; BATON_UPDATE_DOCS=1 writes the tables.
func TestReferenceTablesAreGenerated(t *testing.T) {
	for _, table := range referenceTables {
		for _, r := range table {
			for _, k := range r.Keys {
				if settingByKey(k) == nil {
					t.Errorf("referenceTables names %s, which is no setting", k)
				}
			}
		}
	}
	const path = "../../docs/REFERENCE.md"
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	for n := range referenceTables {
		begin, end := fmt.Sprintf("<!-- settings table %d: generated", n+1), fmt.Sprintf("<!-- end of settings table %d -->", n+1)
		i, j := strings.Index(doc, begin), strings.Index(doc, end)
		if i < 0 || j < i {
			t.Fatalf("%s has no generated settings table %d (%q … %q)", path, n+1, begin, end)
		}
		i += strings.IndexByte(doc[i:], '\n') + 1
		want := renderReferenceTable(n)
		if doc[i:j] == want {
			continue
		}
		if os.Getenv("BATON_UPDATE_DOCS") != "1" {
			t.Errorf("%s's settings table %d is not referenceTables' (edit internal/config/reference.go or the setting's tags, then BATON_UPDATE_DOCS=1 go test ./internal/config)", path, n+1)
			continue
		}
		doc = doc[:i] + want + doc[j:]
		if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// A setting added with its tags alone (no row in referenceTables) still gets its row: at the end
// of its section's table, its help as its meaning — the recipe of docs/ARCHITECTURE.md needs no
// edit of the reference's declaration.
func TestASettingWithoutARowIsRenderedFromItsTags(t *testing.T) {
	saved := referenceTables
	t.Cleanup(func() { referenceTables = saved })
	s := settingByKey("admission.queue_retry_after")
	var kept []refRow
	for _, r := range referenceTables[1] {
		if len(r.Keys) != 1 || r.Keys[0] != s.key {
			kept = append(kept, r)
		}
	}
	if len(kept) != len(referenceTables[1])-1 {
		t.Fatalf("no row of its own to take away for %s", s.key)
	}
	referenceTables[1] = kept
	lines := strings.Split(strings.TrimSuffix(renderReferenceTable(1), "\n"), "\n")
	want := "| `--queue-retry-after` | `admission.queue_retry_after` | `0s` | " + s.help + " |"
	if last := lines[len(lines)-1]; last != want {
		t.Errorf("last row %q, want %q", last, want)
	}
	if strings.Contains(renderReferenceTable(0), "queue-retry-after") {
		t.Error("a section's setting rendered in the top-level table")
	}
}
