// Package policy_test checks rules of the code base itself that no unit test
// of a single package would notice.
package policy_test

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestNoProductionPackageRunsHostBinaries: Tessera talks to GPUs through
// NVML only; no production package may import os/exec (nvidia-smi and
// friends are never run). Test files and the test-only tree test/ are
// exempt.
func TestNoProductionPackageRunsHostBinaries(t *testing.T) {
	found, dirs, err := execImports("../..")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range found {
		t.Errorf("%s imports os/exec: Tessera must not run host binaries; use NVML", f)
	}
	for _, dir := range []string{"driver/plugin", "controller", "webhook", "cmd/tessera-kubelet-plugin"} {
		if !dirs[dir] {
			t.Errorf("%s was not checked (%d directories were): the walk is looking in the wrong place", dir, len(dirs))
		}
	}
}

// execImports returns the production Go files of the module at root that
// import os/exec, and the directories it read. Production is every .go file
// the go command would build for some platform: the package list comes
// from the tree, as ./... finds it (no testdata, no names starting with .
// or _, no nested modules), less test files and the test-only tree test/.
// Build constraints are not evaluated, so a file for another platform or
// tag is read too.
func execImports(root string) (found []string, dirs map[string]bool, err error) {
	dirs = map[string]bool{}
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		name := d.Name()
		if d.IsDir() {
			if rel == "." {
				return nil
			}
			if rel == "test" || rel == "vendor" || name == "testdata" || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") {
				return filepath.SkipDir
			}
			if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil {
				return filepath.SkipDir // another module
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		dirs[filepath.ToSlash(filepath.Dir(rel))] = true
		for _, imp := range f.Imports {
			if p, _ := strconv.Unquote(imp.Path.Value); p == "os/exec" {
				found = append(found, rel)
			}
		}
		return nil
	})
	return found, dirs, err
}

// TestTheCheckFindsExecAnywhereInProduction: the walk behind
// TestNoProductionPackageRunsHostBinaries, on a made-up module, reports an
// os/exec import in any production package, however imported, and none in
// test files, test/, testdata or a nested module.
func TestTheCheckFindsExecAnywhereInProduction(t *testing.T) {
	root := t.TempDir()
	for path, src := range map[string]string{
		"go.mod":                     "module example.com/m\n",
		"controller/run.go":          "package controller\n\nimport \"os/exec\"\n\nvar _ = exec.Command\n",
		"webhook/serve.go":           "package webhook\n\nimport (\n\t\"fmt\"\n\trun \"os/exec\"\n)\n\nvar _, _ = fmt.Sprint, run.Command\n",
		"newpkg/deep/tool.go":        "//go:build linux\n\npackage deep\n\nimport _ \"os/exec\"\n",
		"main.go":                    "package main\n\nimport \"os/exec\"\n\nfunc main() { _ = exec.Command }\n",
		"driver/clean.go":            "package driver\n\nimport \"os\"\n\nvar _ = os.Getpid\n",
		"controller/run_test.go":     "package controller\n\nimport \"os/exec\"\n\nvar _ = exec.Command\n",
		"test/cluster/process.go":    "package cluster\n\nimport \"os/exec\"\n\nvar _ = exec.Command\n",
		"driver/testdata/fixture.go": "package fixture\n\nimport \"os/exec\"\n\nvar _ = exec.Command\n",
		"tools/go.mod":               "module example.com/tools\n",
		"tools/gen.go":               "package tools\n\nimport \"os/exec\"\n\nvar _ = exec.Command\n",
		"controller/.cache/x.go":     "package x\n\nimport \"os/exec\"\n\nvar _ = exec.Command\n",
		"webhook/_scratch/x.go":      "package x\n\nimport \"os/exec\"\n\nvar _ = exec.Command\n",
	} {
		p := filepath.Join(root, filepath.FromSlash(path))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	found, _, err := execImports(root)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(found)
	want := []string{"controller/run.go", "main.go", "newpkg/deep/tool.go", "webhook/serve.go"}
	if !slices.Equal(found, want) {
		t.Errorf("found os/exec in %q, want %q", found, want)
	}
}
