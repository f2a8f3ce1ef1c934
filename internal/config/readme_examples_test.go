package config

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The README's examples work as written: each `baton` command line in its shell blocks (a
// serve, check or epp command, continued over lines ending in a backslash) parses and
// validates, and so does each YAML block it names a file for ("# baton --config FILE").
func TestREADMEExamplesParse(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var commands, yamls int
	lines := strings.Split(string(b), "\n")
	for i := 0; i < len(lines); i++ {
		if lines[i] != "```sh" && lines[i] != "```yaml" {
			continue
		}
		lang := strings.TrimPrefix(lines[i], "```")
		var block []string
		for i++; i < len(lines) && lines[i] != "```"; i++ {
			block = append(block, lines[i])
		}
		if lang == "yaml" {
			if len(block) == 0 || !strings.HasPrefix(block[0], "# baton --config ") {
				continue
			}
			yamls++
			path := filepath.Join(t.TempDir(), strings.TrimPrefix(block[0], "# baton --config "))
			if err := os.WriteFile(path, []byte(strings.Join(block, "\n")), 0o600); err != nil {
				t.Fatal(err)
			}
			if _, err := Parse([]string{"--config", path}, io.Discard); err != nil {
				t.Errorf("the README's %s: %v", block[0], err)
			}
			continue
		}
		for j := 0; j < len(block); j++ {
			line := block[j]
			for strings.HasSuffix(line, `\`) && j+1 < len(block) {
				j++
				line = strings.TrimSuffix(line, `\`) + " " + strings.TrimSpace(block[j])
			}
			line, _, _ = strings.Cut(line, "#")
			fields := strings.Fields(line)
			if len(fields) > 2 && fields[0] == "go" && fields[1] == "run" {
				fields = append([]string{"baton"}, fields[3:]...)
			}
			if len(fields) < 2 || fields[0] != "baton" {
				continue
			}
			args := fields[1:]
			switch args[0] {
			case "check", "epp":
				args = args[1:]
			case "demo":
				continue
			}
			commands++
			if _, err := Parse(args, io.Discard); err != nil {
				t.Errorf("the README's %q: %v", strings.Join(fields, " "), err)
			}
		}
	}
	if commands < 5 || yamls < 1 {
		t.Fatalf("read %d commands and %d YAML files from the README", commands, yamls)
	}
}

// Every link from the README into the reference, and within the reference, names a heading
// there (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens); every file the
// README links to exists.
func TestREADMELinksResolve(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	ref, err := os.ReadFile("../../docs/REFERENCE.md")
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	for _, line := range strings.Split(string(ref), "\n") {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		title := strings.ToLower(strings.TrimSpace(strings.TrimLeft(line, "#")))
		var slug strings.Builder
		for _, r := range title {
			switch {
			case r == ' ':
				slug.WriteRune('-')
			case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
				slug.WriteRune(r)
			}
		}
		anchors[slug.String()] = true
	}
	check := func(doc, dir, text string) {
		for _, part := range strings.Split(text, "](")[1:] {
			target, _, _ := strings.Cut(part, ")")
			file, a, _ := strings.Cut(target, "#")
			switch {
			case strings.HasPrefix(target, "http"):
				continue
			case file != "":
				if _, err := os.Stat(filepath.Join(dir, file)); err != nil {
					t.Errorf("%s links to %s: %v", doc, file, err)
				}
				if !strings.HasSuffix(file, "REFERENCE.md") {
					continue
				}
			}
			if a != "" && !anchors[a] {
				t.Errorf("%s links to %s, which names no heading of docs/REFERENCE.md", doc, target)
			}
		}
	}
	check("README.md", "../..", string(readme))
	check("docs/REFERENCE.md", "../../docs", string(ref))
}
