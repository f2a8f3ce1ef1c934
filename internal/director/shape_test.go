package director

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// sources are the non-test Go files of the packages under dir (relative to the repository),
// by path, with their text.
func sources(t *testing.T, dirs ...string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, dir := range dirs {
		err := filepath.WalkDir(filepath.Join("../..", dir), func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			b, err := os.ReadFile(path)
			out[path] = string(b)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// The shape the request's middle keeps (issue 40's checks), so that it does not drift back:
// the director speaks no HTTP; the HTTP door stays small and depends on few packages; no door
// builds a fake request; the record is handed on, not fished from contexts; and the request
// path's errors are read at one boundary, not everywhere.
func TestTheHouseKeepsItsShape(t *testing.T) {
	fset := token.NewFileSet()
	for path, src := range sources(t, "internal/director") {
		f, err := parser.ParseFile(fset, path, src, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, im := range f.Imports {
			if p, _ := strconv.Unquote(im.Path.Value); p == "net/http" {
				t.Errorf("%s imports net/http: the director speaks no HTTP", path)
			}
		}
	}

	lines, internal := 0, map[string]bool{}
	for path, src := range sources(t, "internal/server") {
		if filepath.Dir(path) != filepath.Join("../..", "internal/server") {
			continue
		}
		lines += strings.Count(src, "\n")
		f, err := parser.ParseFile(fset, path, src, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, im := range f.Imports {
			if p, _ := strconv.Unquote(im.Path.Value); strings.HasPrefix(p, "github.com/baton-llm/baton/internal/") {
				internal[p] = true
			}
		}
	}
	if lines >= 2000 || len(internal) > 9 {
		t.Errorf("internal/server is %d lines with %d internal imports: the HTTP door keeps under 2,000 and 9", lines, len(internal))
	}

	from := regexp.MustCompile(`\brecord\.From\(`)
	checks := regexp.MustCompile(`errors\.(Is|As|AsType)\b`)
	froms, errorChecks := 0, 0
	for path, src := range sources(t, "internal", "cmd") {
		if strings.Contains(src, `"http://epp"`) {
			t.Errorf("%s builds a fake request (http://epp)", path)
		}
		froms += len(from.FindAllString(src, -1))
		for _, pkg := range []string{"server", "pd", "proxy"} {
			if filepath.Dir(path) == filepath.Join("../..", "internal", pkg) {
				for _, line := range strings.Split(src, "\n") {
					if checks.MatchString(line) {
						errorChecks++
					}
				}
			}
		}
	}
	if froms > 3 {
		t.Errorf("%d record.From sites: the record is handed on, read from a context at 3 places at most", froms)
	}
	if errorChecks > 15 {
		t.Errorf("%d lines of errors.Is/As in server, pd and proxy: the request path's errors are read at the attempt boundary (outcome.FailureOf), 15 at most", errorChecks)
	}
}

// Behaviour is tested at its seam: the whole gateway's package keeps the cases that need all
// of it, under a quarter of the test lines.
func TestTheWholeGatewayKeepsAQuarterOfTheTests(t *testing.T) {
	var app, all int
	for _, dir := range []string{"cmd", "internal", "test"} {
		err := filepath.WalkDir(filepath.Join("../..", dir), func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, "_test.go") {
				return err
			}
			b, err := os.ReadFile(path)
			n := strings.Count(string(b), "\n")
			all += n
			if filepath.Dir(path) == filepath.Join("../..", "internal", "app") {
				app += n
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if all == 0 || 4*app >= all {
		t.Errorf("internal/app holds %d of %d test lines (%.1f %%): test behaviour in the package that owns it, under 25 %%", app, all, 100*float64(app)/float64(max(all, 1)))
	}
	t.Logf("internal/app: %d of %d test lines (%.1f %%)", app, all, 100*float64(app)/float64(all))
}
