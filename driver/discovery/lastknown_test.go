package discovery_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"k8s.io/klog/v2/ktesting"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/fakenode"
)

func lastKnownNode(t *testing.T, profile string) (*fakenode.Node, string, context.Context) {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	n, err := fakenode.New(profile, fakenode.Options{Dir: t.TempDir(), NodeName: "node-a"})
	if err != nil {
		t.Fatal(err)
	}
	return n, filepath.Join(t.TempDir(), "gpus.json"), ctx
}

func names(gpus []discovery.GPU) []string {
	var out []string
	for _, g := range gpus {
		out = append(out, g.Name())
	}
	return out
}

func TestLostGPUIsDescribedFromItsLastKnownDescription(t *testing.T) {
	for _, profile := range []string{"pcie-l4x4", "dgx-h100"} {
		t.Run(profile, func(t *testing.T) {
			n, path, ctx := lastKnownNode(t, profile)
			before, err := discovery.DiscoverWith(ctx, &n.Node, discovery.Options{LastKnownPath: path})
			if err != nil {
				t.Fatal(err)
			}
			if err := n.LoseGPU(2); err != nil {
				t.Fatal(err)
			}
			after, err := discovery.DiscoverWith(ctx, &n.Node, discovery.Options{LastKnownPath: path})
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(names(before), names(after)); diff != "" {
				t.Fatalf("GPUs (-before +after):\n%s", diff)
			}
			if !strings.Contains(strings.ToLower(after[2].Lost), "lost") {
				t.Errorf("gpu-2 Lost = %q, want NVML's lost error", after[2].Lost)
			}
			if diff := cmp.Diff(before[2], after[2], cmpopts.IgnoreFields(discovery.GPU{}, "Lost")); diff != "" {
				t.Errorf("gpu-2 description (-last known +now):\n%s", diff)
			}
			for _, i := range []int{0, 1, 3} {
				if after[i].Lost != "" {
					t.Errorf("%s marked lost: %q", after[i].Name(), after[i].Lost)
				}
			}
			// Without the file the lost GPU is left out, as before.
			plain, err := discovery.Discover(ctx, &n.Node)
			if err != nil {
				t.Fatal(err)
			}
			if got := len(plain); got != len(before)-1 {
				t.Errorf("Discover without last-known file: %d GPUs, want %d", got, len(before)-1)
			}
		})
	}
}

func TestGPULostBeforeItWasEverDescribedIsLeftOut(t *testing.T) {
	n, path, ctx := lastKnownNode(t, "pcie-l4x4")
	if err := n.LoseGPU(1); err != nil {
		t.Fatal(err)
	}
	gpus, err := discovery.DiscoverWith(ctx, &n.Node, discovery.Options{LastKnownPath: path})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"gpu-0", "gpu-2", "gpu-3"}, names(gpus)); diff != "" {
		t.Errorf("GPUs (-want +got):\n%s", diff)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatalf("last-known file not written: %v", err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("last-known file mode %v, want 0600", fi.Mode().Perm())
	}
}

func TestUnreadableLastKnownFileIsIgnoredAndReplaced(t *testing.T) {
	n, path, ctx := lastKnownNode(t, "pcie-l4x4")
	if err := os.WriteFile(path, []byte(`{"version":1,"gpus":[{"Index":`), 0o600); err != nil {
		t.Fatal(err)
	}
	gpus, err := discovery.DiscoverWith(ctx, &n.Node, discovery.Options{LastKnownPath: path})
	if err != nil || len(gpus) != 4 {
		t.Fatalf("discovery with a corrupted file: %d GPUs, %v", len(gpus), err)
	}
	if err := n.LoseGPU(3); err != nil {
		t.Fatal(err)
	}
	gpus, err = discovery.DiscoverWith(ctx, &n.Node, discovery.Options{LastKnownPath: path})
	if err != nil {
		t.Fatal(err)
	}
	if len(gpus) != 4 || gpus[3].Lost == "" {
		t.Errorf("after the file was replaced: GPUs %v, want gpu-3 described as lost", names(gpus))
	}
}

func TestLastKnownFileIsWrittenOnlyWhenADescriptionChanges(t *testing.T) {
	n, path, ctx := lastKnownNode(t, "pcie-l4x4")
	for range 2 {
		if _, err := discovery.DiscoverWith(ctx, &n.Node, discovery.Options{LastKnownPath: path}); err != nil {
			t.Fatal(err)
		}
	}
	before, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := discovery.DiscoverWith(ctx, &n.Node, discovery.Options{LastKnownPath: path}); err != nil {
		t.Fatal(err)
	}
	after, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(before, after) {
		t.Error("last-known file rewritten though no GPU changed")
	}
}
