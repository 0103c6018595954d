// Package policy_test checks rules of the code base itself that no unit test
// of a single package would notice.
package policy_test

import (
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestNodeAgentExecutesNoHostBinaries: Tessera talks to GPUs through NVML
// only; no production package may import os/exec (nvidia-smi and friends
// are never run). Test files and the local-cluster harness are exempt.
func TestNodeAgentExecutesNoHostBinaries(t *testing.T) {
	checked := 0
	for _, root := range []string{"../../driver", "../../cdi", "../../api", "../../cmd", "../../deviceclass", "../../deployments"} {
		err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
			if err != nil {
				return err
			}
			checked++
			for _, imp := range f.Imports {
				if p, _ := strconv.Unquote(imp.Path.Value); p == "os/exec" {
					t.Errorf("%s imports %s: the driver must not run host binaries; use NVML", path, p)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if checked < 30 {
		t.Fatalf("only %d files checked: the walk is looking in the wrong place", checked)
	}
}
