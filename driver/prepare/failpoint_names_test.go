package prepare

import (
	"go/ast"
	"go/parser"
	"go/token"
	"go/types"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// failpointFunc is the function whose calls mark the failure points
// (failpoint.go, failpoint_faultinject.go); pointFunc declares their names
// (failpoint_names.go).
const failpointFunc, pointFunc = "failpoint", "point"

// TestEveryFailpointIsDeclaredAndReached holds the registry (failpoints,
// filled by point) to the code: it parses every non-test Go file of the
// package, of every build, and requires every call of failpoint to pass a
// name declared with point, by its identifier, and every declared name to be
// passed by some call. With TestEveryFailpointIsTriedByTheCrashTests
// (-tags faultinject), which requires a crash table to try every registered
// name, a step given a failpoint cannot go untested, and a step taken away
// leaves no name behind.
func TestEveryFailpointIsDeclaredAndReached(t *testing.T) {
	src := parsePackage(t)
	decls := src.declaredPoints()
	declared := map[string]pointDecl{} // by identifier
	var names []string
	for _, d := range decls {
		declared[d.id] = d
		names = append(names, d.name)
	}
	if diff := cmp.Diff(failpoints, names); diff != "" {
		t.Errorf("the registry is not the names declared with %s(\"...\") at package level (-registry +declared):\n%s", pointFunc, diff)
	}

	// The calls, in function bodies: failpoint's, each with a declared
	// identifier; point's, none (a name made at run time is one this test
	// cannot see).
	called := map[string]bool{}
	funcs := map[string]bool{}
	for _, f := range src.files {
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok {
				continue
			}
			if fd.Recv == nil {
				funcs[fd.Name.Name] = true
			}
			ast.Inspect(fd, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				fn, ok := call.Fun.(*ast.Ident)
				if !ok {
					return true
				}
				at := src.fset.Position(call.Pos())
				switch fn.Name {
				case pointFunc:
					t.Errorf("%s: %s called in %s; declare failure points at package level, in failpoint_names.go", at, types.ExprString(call), fd.Name.Name)
				case failpointFunc:
					if id, ok := onlyArg(call).(*ast.Ident); ok {
						if d, known := declared[id.Name]; known {
							called[d.name] = true
							return true
						}
					}
					t.Errorf("%s: %s passes no failure point declared with %s; declare the step's name in failpoint_names.go and pass its identifier", at, types.ExprString(call), pointFunc)
				}
				return true
			})
		}
	}
	for _, fn := range []string{failpointFunc, pointFunc} {
		if !funcs[fn] {
			t.Fatalf("the package declares no function %s: rename it in this test too, or it checks nothing", fn)
		}
	}
	for _, d := range decls {
		if !called[d.name] {
			t.Errorf("%s: failure point %s (%q) is declared but no %s call passes it; a step was taken away or renamed: drop its name", d.pos, d.id, d.name, failpointFunc)
		}
	}
}

// pkgSource is the package's non-test Go files, parsed.
type pkgSource struct {
	fset  *token.FileSet
	files []*ast.File
}

// parsePackage parses the non-test Go files of the package's directory
// (the test's working directory), whatever their build constraints.
func parsePackage(t *testing.T) pkgSource {
	t.Helper()
	paths, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	src := pkgSource{fset: token.NewFileSet()}
	for _, p := range paths {
		if strings.HasSuffix(p, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(src.fset, p, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		src.files = append(src.files, f)
	}
	return src
}

// pointDecl is a package-level identifier given a failure point's name by
// point.
type pointDecl struct {
	id, name string
	pos      token.Position
}

// declaredPoints are the package's point declarations, in the order the
// compiler initializes them: files by name, then source order (none depends
// on another).
func (src pkgSource) declaredPoints() []pointDecl {
	var decls []pointDecl
	for _, f := range src.files {
		for _, d := range f.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok {
				continue
			}
			for _, spec := range gd.Specs {
				vs, ok := spec.(*ast.ValueSpec)
				if !ok {
					continue
				}
				for i, id := range vs.Names {
					if i >= len(vs.Values) {
						continue
					}
					if name, ok := pointName(vs.Values[i]); ok {
						decls = append(decls, pointDecl{id.Name, name, src.fset.Position(id.Pos())})
					}
				}
			}
		}
	}
	return decls
}

// pointName is the name e declares if e is point("..."), a string literal.
func pointName(e ast.Expr) (string, bool) {
	call, ok := e.(*ast.CallExpr)
	if !ok {
		return "", false
	}
	if fn, ok := call.Fun.(*ast.Ident); !ok || fn.Name != pointFunc {
		return "", false
	}
	lit, ok := onlyArg(call).(*ast.BasicLit)
	if !ok || lit.Kind != token.STRING {
		return "", false
	}
	name, err := strconv.Unquote(lit.Value)
	return name, err == nil
}

// onlyArg is a call's argument if it has exactly one.
func onlyArg(call *ast.CallExpr) ast.Expr {
	if len(call.Args) != 1 {
		return nil
	}
	return call.Args[0]
}
