package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/features"
	"github.com/tessera-dev/tessera/driver/nodeopen"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

func inspect(t *testing.T, profile, output string) []byte {
	t.Helper()
	var buf bytes.Buffer
	opts := nodeopen.Options{NodeName: "node-a", FakeNode: profile, FakeRoot: t.TempDir()}
	if err := Inspect(context.Background(), &buf, opts, output, features.New()); err != nil {
		t.Fatalf("inspect %s: %v", profile, err)
	}
	return buf.Bytes()
}

// TestInspectMatchesGoldenFiles pins the exact devices and attributes each
// profile publishes. testdata/<profile>.yaml is made by
// `go test ./driver/cli -run TestInspectMatchesGoldenFiles -update`.
func TestInspectMatchesGoldenFiles(t *testing.T) {
	for _, profile := range fakenode.Profiles() {
		t.Run(profile, func(t *testing.T) {
			got := inspect(t, profile, "yaml")
			again := inspect(t, profile, "yaml")
			if !bytes.Equal(got, again) {
				t.Fatalf("two runs differ:\n%s", cmp.Diff(string(got), string(again)))
			}
			golden := filepath.Join("testdata", profile+".yaml")
			if *update {
				if err := os.WriteFile(golden, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run with -update to create it)", err)
			}
			if diff := cmp.Diff(string(want), string(got)); diff != "" {
				t.Errorf("inspect output differs from %s (-want +got):\n%s", golden, diff)
			}
		})
	}
}

func TestInspectJSONIsAList(t *testing.T) {
	out := inspect(t, "pcie-l4x4", "json")
	var list struct {
		Kind  string `json:"kind"`
		Items []struct {
			Spec struct {
				Devices []struct{ Name string } `json:"devices"`
			} `json:"spec"`
		} `json:"items"`
	}
	if err := json.Unmarshal(out, &list); err != nil {
		t.Fatal(err)
	}
	if list.Kind != "List" || len(list.Items) != 1 || len(list.Items[0].Spec.Devices) != 4 {
		t.Fatalf("unexpected JSON: %s", out)
	}
}

func TestInspectCommandRejectsBadInput(t *testing.T) {
	for _, args := range [][]string{
		{"inspect", "--fake-node", "dgx-z900"},
		{"inspect", "--fake-node", "dgx-h100", "-o", "xml"},
	} {
		cmd := NewCommand()
		cmd.SetArgs(args)
		cmd.SetOut(&bytes.Buffer{})
		cmd.SetErr(&bytes.Buffer{})
		if err := cmd.Execute(); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
}
