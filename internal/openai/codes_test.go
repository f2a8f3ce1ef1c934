package openai

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// codeConstants reads the Code* constants of errors.go: every code Baton mints.
func codeConstants(t *testing.T) map[string]string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "errors.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	codes := map[string]string{}
	ast.Inspect(f, func(n ast.Node) bool {
		vs, ok := n.(*ast.ValueSpec)
		if !ok {
			return true
		}
		for i, name := range vs.Names {
			if i >= len(vs.Values) {
				break // var x T: no value
			}
			if lit, ok := vs.Values[i].(*ast.BasicLit); ok && strings.HasPrefix(name.Name, "Code") {
				codes[name.Name], _ = strconv.Unquote(lit.Value)
			}
		}
		return true
	})
	if len(codes) < 20 {
		t.Fatalf("read %d codes from errors.go", len(codes))
	}
	return codes
}

// The reference (docs/REFERENCE.md) lists every code a client can receive from Baton: a code added without its line
// fails here.
func TestReferenceListsEveryErrorCode(t *testing.T) {
	readme, err := os.ReadFile("../../docs/REFERENCE.md")
	if err != nil {
		t.Fatal(err)
	}
	for name, code := range codeConstants(t) {
		if !strings.Contains(string(readme), "`"+code+"`") {
			t.Errorf("docs/REFERENCE.md does not list %s (`%s`)", name, code)
		}
	}
}

// A client-visible code is an openai constant: no error elsewhere is minted with a literal code,
// and no package keeps a code table of its own.
func TestNoErrorCodeLiterals(t *testing.T) {
	values := map[string]bool{}
	for _, v := range codeConstants(t) {
		values[v] = true
	}
	err := filepath.WalkDir("../..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".")) && path != "../.." {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") || strings.Contains(path, "/internal/sim/") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.CallExpr:
				// A code's text passed to a function (an admin error, a refusal) is a literal code too.
				for _, arg := range n.Args {
					if lit, ok := arg.(*ast.BasicLit); ok && lit.Kind == token.STRING {
						if v, _ := strconv.Unquote(lit.Value); values[v] {
							t.Errorf("%s: the code %q passed as a literal; use its constant in internal/openai/errors.go", path, v)
						}
					}
				}
			case *ast.CompositeLit:
				if sel, ok := n.Type.(*ast.SelectorExpr); !ok || sel.Sel.Name != "Error" {
					return true
				}
				for _, el := range n.Elts {
					if kv, ok := el.(*ast.KeyValueExpr); ok && isIdent(kv.Key, "Code") {
						if _, lit := kv.Value.(*ast.BasicLit); lit {
							t.Errorf("%s: an error minted with a literal code; add it to internal/openai/errors.go", path)
						}
					}
				}
			case *ast.ValueSpec:
				for _, name := range n.Names {
					if strings.HasPrefix(name.Name, "code") && len(name.Name) > 4 && name.Name[4] >= 'A' && name.Name[4] <= 'Z' {
						t.Errorf("%s: %s is a code table of its own; codes live in internal/openai/errors.go", path, name.Name)
					}
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func isIdent(e ast.Expr, name string) bool {
	id, ok := e.(*ast.Ident)
	return ok && id.Name == name
}

// renderCodeDocs is the reference's error table, rendered from CodeDocs (indented: the table sits
// in a list item).
func renderCodeDocs() string {
	var b strings.Builder
	b.WriteString("  | status | code | when |\n  |---|---|---|\n")
	for _, d := range CodeDocs {
		quoted := make([]string, len(d.Codes))
		for i, c := range d.Codes {
			quoted[i] = "`" + c + "`"
		}
		codes := strings.Join(quoted, ", ")
		if d.Note != "" {
			codes += " " + d.Note
		}
		b.WriteString("  | " + d.Status + " | " + codes + " | " + d.When + " |\n")
	}
	return b.String()
}

// The reference's error table is generated from CodeDocs, which has a row for every code of
// errors.go: a code added without its row, or an edit of the table by hand, fails here.
// BATON_UPDATE_DOCS=1 writes the table from CodeDocs.
func TestErrorTableIsGenerated(t *testing.T) {
	documented := map[string]bool{}
	for _, d := range CodeDocs {
		for _, c := range d.Codes {
			documented[c] = true
		}
	}
	for name, code := range codeConstants(t) {
		if !documented[code] {
			t.Errorf("%s (%q) has no row in CodeDocs", name, code)
		}
	}
	const path = "../../docs/REFERENCE.md"
	const begin, end = "<!-- error codes: generated", "<!-- end of error codes -->"
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i := strings.Index(doc, begin)
	j := strings.Index(doc, end)
	if i < 0 || j < i {
		t.Fatalf("%s has no generated error table (%q … %q)", path, begin, end)
	}
	i += strings.IndexByte(doc[i:], '\n') + 1
	j = strings.LastIndexByte(doc[:j], '\n') + 1
	want := renderCodeDocs()
	if doc[i:j] == want {
		return
	}
	if os.Getenv("BATON_UPDATE_DOCS") == "1" {
		if err := os.WriteFile(path, []byte(doc[:i]+want+doc[j:]), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Errorf("%s's error table is not CodeDocs' (edit internal/openai/codedocs.go, then BATON_UPDATE_DOCS=1 go test ./internal/openai)", path)
}
