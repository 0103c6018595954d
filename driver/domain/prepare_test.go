package domain_test

import (
	"context"
	"slices"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2/ktesting"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/domain"
)

const driver = "gpu.tessera.dev"

// topologyClaim is a claim allocated channel 0 of a topology domain, which
// needs no device node, so no host tree is needed to prepare it.
func topologyClaim(uid string) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ml", Name: "gang-" + uid, UID: types.UID(uid)},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
				Request: "domain", Driver: driver, Pool: domain.PoolName(domain.KindTopology, "rack-1"), Device: domain.DeviceName(0),
			}}},
		}},
	}
}

func TestRestartAfterARebootRemovesOnlyTheEarlierBootsDomainSpecs(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	dir := t.TempDir()
	preparer := func(bootID string) *domain.Preparer {
		store, err := cdi.NewStoreOfClass(dir, domain.CDIClass)
		if err != nil {
			t.Fatal(err)
		}
		return &domain.Preparer{Driver: driver, CDI: store, BootID: bootID}
	}
	prepare := func(p *domain.Preparer, uid string) {
		if _, err := p.Prepare(context.Background(), topologyClaim(uid)); err != nil {
			t.Fatalf("prepare %s: %v", uid, err)
		}
	}
	prepare(preparer("boot-1"), "uid-earlier-boot")
	prepare(preparer(""), "uid-no-boot-id") // written before specs carried one
	now := preparer("boot-2")
	prepare(now, "uid-this-boot")

	if err := now.RemoveEarlierBoots(ctx); err != nil {
		t.Fatal(err)
	}
	specs, err := now.CDI.List()
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for _, s := range specs {
		left = append(left, s.ClaimUID)
	}
	slices.Sort(left)
	if want := []string{"uid-no-boot-id", "uid-this-boot"}; !slices.Equal(left, want) {
		t.Errorf("specs left %v, want %v", left, want)
	}
	// A spec written now carries this boot's ID, so the next reboot's
	// restart removes it.
	for _, s := range specs {
		if s.ClaimUID == "uid-this-boot" && s.BootID != "boot-2" {
			t.Errorf("spec of this boot carries boot ID %q", s.BootID)
		}
	}
}
