package plugin_test

import (
	"context"
	"os"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/test/kubeletsim"
)

// domainClaim is a claim allocated channel 0 of a topology domain (no device
// node needed), as the gang controller allocates one.
func domainClaim(name string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, UID: types.UID("uid-" + name)}}
	c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
		Request: "domain", Driver: driverName, Pool: domain.PoolName(domain.KindTopology, "rack-1"), Device: domain.DeviceName(0),
	}}}}
	return c
}

// A gang domain claim's CDI spec is swept at start like a GPU claim's when
// no checkpointed claim owns it (its prepare died after writing the spec and
// before the kubelet heard of it), and kept while its claim is prepared.
func TestOrphanDomainSpecsAreRemovedAtStartAndPreparedOnesKept(t *testing.T) {
	h := start(t, "dgx-h100")
	prepared := domainClaim("gang")
	if _, err := h.client.ResourceV1().ResourceClaims("default").Create(h.ctx, prepared, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	gang := kubeletsim.Claim{Namespace: "default", Name: "gang", UID: prepared.UID}
	if resp, err := h.kubelet.Prepare(h.ctx, gang); err != nil || resp.Claims[string(gang.UID)].Error != "" {
		t.Fatalf("prepare of the domain claim: %v %+v", err, resp)
	}
	// A prepare that died after writing its spec: nothing but the file.
	store, err := cdi.NewStoreOfClass(h.opts.CDIRoot, domain.CDIClass)
	if err != nil {
		t.Fatal(err)
	}
	crashed := &domain.Preparer{Driver: driverName, CDI: store, BootID: "boot-1"}
	if _, err := crashed.Prepare(context.Background(), domainClaim("lost")); err != nil {
		t.Fatal(err)
	}

	h.restart()
	if _, err := os.Stat(store.Path("uid-lost")); !os.IsNotExist(err) {
		t.Errorf("the orphan domain spec is still there (stat: %v)", err)
	}
	if _, err := os.Stat(store.Path("uid-gang")); err != nil {
		t.Errorf("the prepared domain claim's spec was removed: %v", err)
	}
	// The prepared claim survives the restart, and is unprepared cleanly.
	if resp, err := h.kubelet.Prepare(h.ctx, gang); err != nil || resp.Claims[string(gang.UID)].Error != "" {
		t.Fatalf("prepare again after the restart: %v %+v", err, resp)
	}
	if _, err := h.kubelet.Unprepare(h.ctx, gang); err != nil {
		t.Fatal(err)
	}
	if specs, err := store.List(); err != nil || len(specs) != 0 {
		t.Errorf("domain specs left after unprepare: %+v %v", specs, err)
	}
}
