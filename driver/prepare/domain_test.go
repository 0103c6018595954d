package prepare_test

import (
	"context"
	"os"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// domainClaim is a claim allocated channel 0 of a topology domain, which
// needs no device node.
func domainClaim(name string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, UID: types.UID("uid-" + name)}}
	c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
		Request: "domain", Driver: driverName, Pool: domain.PoolName(domain.KindTopology, "rack-1"), Device: domain.DeviceName(0),
	}}}}
	return c
}

// domainPreparer writes domain claims' specs into the env's CDI directory,
// as the plugin's does.
func (e *env) domainPreparer() *domain.Preparer {
	e.t.Helper()
	store, err := cdi.NewStoreOfClass(e.cdiDir, domain.CDIClass)
	if err != nil {
		e.t.Fatal(err)
	}
	return &domain.Preparer{Driver: driverName, CDI: store, BootID: e.bootID}
}

func (e *env) prepareDomain(m *prepare.Manager, c *resourceapi.ResourceClaim) {
	e.t.Helper()
	if _, err := m.PrepareDomain(context.Background(), c, e.domainPreparer().Prepare); err != nil {
		e.t.Fatalf("prepare domain claim %s: %v", c.Name, err)
	}
}

func (e *env) domainSpecExists(uid types.UID) bool {
	e.t.Helper()
	_, err := os.Stat(e.domainPreparer().CDI.Path(string(uid)))
	return err == nil
}

func TestDomainClaimsAreRecordedAndTheirOrphanSpecsRemovedAtStart(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	m := e.start()
	gang, lost := domainClaim("gang"), domainClaim("lost")
	e.prepareDomain(m, gang)
	if rec := load(t, e.dataDir).Claims[string(gang.UID)]; !rec.Domain || rec.Phase != checkpoint.PrepareCompleted {
		t.Fatalf("checkpoint records the domain claim as %+v, want a completed domain claim", rec)
	}
	// A prepare that died after writing the spec, before the record.
	if _, err := e.domainPreparer().Prepare(context.Background(), lost); err != nil {
		t.Fatal(err)
	}

	m = e.start()
	if !e.domainSpecExists(gang.UID) {
		t.Error("the prepared domain claim's spec was removed")
	}
	if e.domainSpecExists(lost.UID) {
		t.Error("the orphan domain spec was kept")
	}
	if err := m.Unprepare(context.Background(), gang.UID); err != nil {
		t.Fatal(err)
	}
	if e.domainSpecExists(gang.UID) || len(load(t, e.dataDir).Claims) != 0 {
		t.Errorf("unprepare left the spec (%v) or the record %+v", e.domainSpecExists(gang.UID), load(t, e.dataDir).Claims)
	}
}

// The first start over a checkpoint that did not record domain claims (an
// upgrade) keeps their specs, whose pods may be running, and records them.
func TestDomainSpecsOfACheckpointThatPredatesTheirRecordsAreKept(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	gang := domainClaim("gang")
	if _, err := e.domainPreparer().Prepare(context.Background(), gang); err != nil {
		t.Fatal(err)
	}
	save(t, e.dataDir, checkpoint.Data{BootID: e.bootID})

	e.start()
	if !e.domainSpecExists(gang.UID) {
		t.Fatal("an upgrade removed the spec of a running domain claim")
	}
	if rec := load(t, e.dataDir); !rec.DomainClaims || !rec.Claims[string(gang.UID)].Domain {
		t.Errorf("checkpoint %+v, want the domain claim recorded", rec)
	}
	// Recorded: it survives the next start, and is unprepared cleanly.
	m := e.start()
	if !e.domainSpecExists(gang.UID) {
		t.Fatal("the recorded domain claim's spec was removed at the next start")
	}
	if err := m.Unprepare(context.Background(), gang.UID); err != nil {
		t.Fatal(err)
	}
	if e.domainSpecExists(gang.UID) {
		t.Error("unprepare left the domain spec")
	}
}

func TestCorruptCheckpointIsRebuiltWithItsDomainClaims(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	m := e.start()
	e.prepareDomain(m, domainClaim("gang"))
	writeJunk(t, e.dataDir)

	m = e.start()
	if c, ok := m.PreparedClaims()["uid-gang"]; !ok || !c.Domain {
		t.Fatalf("rebuilt claims %+v, want the domain claim", m.PreparedClaims())
	}
	if !e.domainSpecExists("uid-gang") {
		t.Error("the rebuild removed the domain claim's spec")
	}
}

func TestDomainClaimOnAGPUClaimsUIDIsRefused(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	m := e.start()
	c := claim("mixed", "gpu-0")
	if _, err := m.Prepare(context.Background(), c); err != nil {
		t.Fatal(err)
	}
	d := domainClaim("mixed")
	if _, err := m.PrepareDomain(context.Background(), d, e.domainPreparer().Prepare); err == nil {
		t.Fatal("a domain prepare replaced the record of a prepared GPU claim")
	}
	if e.domainSpecExists(d.UID) {
		t.Error("the refused domain prepare wrote a spec")
	}
}
