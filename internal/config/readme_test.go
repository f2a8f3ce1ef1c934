package config

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// referenceFlagRows reads the reference's configuration tables (docs/REFERENCE.md): per row, the flags its first column
// names and the values its default column shows in backticks.
func referenceFlagRows(t *testing.T) (rows [][2][]string) {
	t.Helper()
	b, err := os.ReadFile("../../docs/REFERENCE.md")
	if err != nil {
		t.Fatal(err)
	}
	flagName := regexp.MustCompile("`--([a-z0-9-]+)")
	literal := regexp.MustCompile("`([^`]*)`")
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(line, "| `--") {
			continue
		}
		cells := strings.Split(line, " | ")
		if len(cells) < 4 {
			continue
		}
		var names, defs []string
		for _, m := range flagName.FindAllStringSubmatch(cells[0], -1) {
			names = append(names, m[1])
		}
		// Only a cell of literals alone ("`30`", "`127.0.0.1`, `-1`") is compared; words around
		// them ("`OTEL_*`, else off") describe a default the flag cannot show.
		if strings.Trim(literal.ReplaceAllString(cells[2], ""), ", ") == "" {
			for _, m := range literal.FindAllStringSubmatch(cells[2], -1) {
				defs = append(defs, m[1])
			}
		}
		rows = append(rows, [2][]string{names, defs})
	}
	if len(rows) < 40 {
		t.Fatalf("read %d flag rows from docs/REFERENCE.md", len(rows))
	}
	return rows
}

// The reference's flag tables (docs/REFERENCE.md) and the flags agree: every flag has a row, every row names real
// flags, a duration's integer alias sits in its flag's row, and a literal default in a row is
// the flag's default.
func TestReferenceListsEveryFlagWithItsDefault(t *testing.T) {
	flags := map[string]*flag{}
	for i := range serveFlags {
		flags[serveFlags[i].name] = &serveFlags[i]
	}
	documented := map[string]bool{}
	def := Default()
	for _, row := range referenceFlagRows(t) {
		var main []string
		for _, name := range row[0] {
			documented[name] = true
			f := flags[name]
			switch {
			case f == nil:
				t.Errorf("docs/REFERENCE.md documents --%s, which is no flag", name)
			case f.alias:
				if len(main) == 0 || !strings.HasPrefix(name, main[len(main)-1]+"-") {
					t.Errorf("--%s, an alias, is not in the row of the flag it spells", name)
				}
			default:
				main = append(main, name)
			}
		}
		defs := row[1]
		if len(defs) != len(main) {
			continue // no literal default to compare (or not one per flag)
		}
		for i, name := range main {
			if f := flags[name]; f.def != nil {
				if got := f.def(&def); got != defs[i] {
					t.Errorf("--%s: docs/REFERENCE.md says the default is %q, the flag's is %q", name, defs[i], got)
				}
			}
		}
	}
	for name := range flags {
		if !documented[name] {
			t.Errorf("--%s has no row in the configuration tables of docs/REFERENCE.md", name)
		}
	}
}
