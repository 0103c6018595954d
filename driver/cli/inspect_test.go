package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"

	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/features"
	"github.com/tessera-dev/tessera/driver/nodeopen"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

// inspect runs Inspect with every partition published (LazyMIG off), so
// that the golden files pin every device; gates, if given, are set after.
func inspect(t *testing.T, profile, output string, gates ...string) []byte {
	t.Helper()
	var buf bytes.Buffer
	opts := nodeopen.Options{NodeName: "node-a", FakeNode: profile, FakeRoot: t.TempDir()}
	fg := features.New()
	for _, g := range append([]string{"LazyMIG=false"}, gates...) {
		if err := fg.Set(g); err != nil {
			t.Fatal(err)
		}
	}
	if err := Inspect(context.Background(), &buf, opts, output, fg); err != nil {
		t.Fatalf("inspect %s: %v", profile, err)
	}
	return buf.Bytes()
}

// TestInspectMatchesGoldenFiles pins the exact devices and attributes each
// profile publishes with every partition (LazyMIG off). testdata/<profile>.yaml is made by
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

// TestInspectShowsWhatAnEmptyNodePublishesLazily: with LazyMIG on (its
// default) inspect shows what the plugin publishes before any claim: every
// whole GPU, of which only the spare draws on its counter set, the spare's
// partitions, and every counter set.
func TestInspectShowsWhatAnEmptyNodePublishesLazily(t *testing.T) {
	out := inspect(t, "dgx-h100", "json", "LazyMIG=true")
	var list struct {
		Items []struct {
			Spec struct {
				Devices []struct {
					Name             string
					ConsumesCounters []struct{ CounterSet string } `json:"consumesCounters"`
				} `json:"devices"`
				SharedCounters []struct{ Name string } `json:"sharedCounters"`
			} `json:"spec"`
		} `json:"items"`
	}
	if err := json.Unmarshal(out, &list); err != nil {
		t.Fatal(err)
	}
	var devices, sets, counted []string
	for _, it := range list.Items {
		for _, d := range it.Spec.Devices {
			devices = append(devices, d.Name)
			if !strings.Contains(d.Name, "-mig-") && len(d.ConsumesCounters) > 0 {
				counted = append(counted, d.Name)
			}
		}
		for _, c := range it.Spec.SharedCounters {
			sets = append(sets, c.Name)
		}
	}
	partitions := 0
	for _, d := range devices {
		if strings.HasPrefix(d, "gpu-7-mig-") {
			partitions++
		}
	}
	if len(devices) != 8+25 || partitions != 25 || len(sets) != 8 || len(counted) != 1 || counted[0] != "gpu-7" {
		t.Fatalf("inspect shows %d devices (%d of gpu-7's partitions), whole GPUs drawing on counters %v, counter sets %v: want 8 whole GPUs (gpu-7 alone drawing on counters), gpu-7's 25 partitions and 8 counter sets", len(devices), partitions, counted, sets)
	}
}

func TestInspectCommandRejectsBadInput(t *testing.T) {
	for _, args := range [][]string{
		{"inspect", "--fake-node", "dgx-z900"},
		{"inspect", "--fake-node", "dgx-h100", "-o", "xml"},
	} {
		cmd := NewCommand("tessera")
		cmd.SetArgs(args)
		cmd.SetOut(&bytes.Buffer{})
		cmd.SetErr(&bytes.Buffer{})
		if err := cmd.Execute(); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
}

// TestInspectDependsOnNoEarlierRun: the README's commands in order (a DGX
// H100, then a PCIe L4 node, under one node name) each print their own node
// and leave nothing behind; and a simulated node that a plugin process left
// with a MIG device under the same name changes nothing inspect prints,
// even where it would show one (DynamicMIG off publishes the MIG devices it
// finds). A command that only prints reads no state an earlier process kept.
func TestInspectDependsOnNoEarlierRun(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	run := func(args ...string) string {
		t.Helper()
		var out, errOut bytes.Buffer
		cmd := NewCommand("tessera")
		cmd.SetArgs(append([]string{"inspect", "--node-name", "node-a"}, args...))
		cmd.SetOut(&out)
		cmd.SetErr(&errOut)
		if err := cmd.Execute(); err != nil {
			t.Fatalf("tessera inspect %s: %v", strings.Join(args, " "), err)
		}
		return out.String()
	}
	run("--fake-node", "dgx-h100")
	var l4 struct {
		Items []struct {
			Spec struct {
				Devices []struct{ Name string } `json:"devices"`
			} `json:"spec"`
		} `json:"items"`
	}
	if err := json.Unmarshal([]byte(run("--fake-node", "pcie-l4x4", "-o", "json")), &l4); err != nil {
		t.Fatal(err)
	}
	if len(l4.Items) != 1 || len(l4.Items[0].Spec.Devices) != 4 {
		t.Errorf("pcie-l4x4 after dgx-h100: %+v, want one slice of 4 GPUs", l4.Items)
	}
	static := run("--fake-node", "dgx-h100", "--feature-gates=DynamicMIG=false")
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Errorf("inspect left %v in the temp dir", left)
	}

	// A plugin process's node, under the same name: it makes a MIG device
	// on gpu-0.
	n, err := (&nodeopen.Options{NodeName: "node-a", FakeNode: "dgx-h100"}).Open()
	if err != nil {
		t.Fatal(err)
	}
	d, _ := n.NVML.DeviceGetHandleByIndex(0)
	if ret, _ := d.SetMigMode(nvml.DEVICE_MIG_ENABLE); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	p, _ := d.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	gi, ret := d.CreateGpuInstance(&p)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	cp, _ := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	if _, ret := gi.CreateComputeInstance(&cp); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	if again := run("--fake-node", "dgx-h100", "--feature-gates=DynamicMIG=false"); again != static {
		t.Errorf("inspect after a plugin made a MIG device differs from a first run (-first +after):\n%s", cmp.Diff(static, again))
	}
}
