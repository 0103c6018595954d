package domain

import (
	"context"
	"fmt"
	"strconv"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/devnodes"
	"github.com/tessera-dev/tessera/driver/hostnodes"
)

// CDIClass is the CDI class of domain claims' specs: their files
// ("gpu.tessera.dev-domain_<uid>.json") are apart from the GPU claims'. The
// state machine (prepare.Manager.PrepareDomain) records each domain claim it
// prepares through this Preparer, and at start removes the domain specs no
// recorded claim owns, as it does the GPU claims'.
const CDIClass = "domain"

// Preparer prepares claims allocated to domain devices. It keeps no state
// besides the CDI spec file of each claim: preparing writes it (again, with
// the same content), unpreparing removes it, both idempotent. Nothing on the
// node is held exclusively: every pod of a gang on a node shares the claim.
type Preparer struct {
	// Driver is the driver name whose results are prepared.
	Driver string
	// CDI stores the specs (class CDIClass).
	CDI *cdi.Store
	// DevNodes resolves the IMEX channel device nodes.
	DevNodes *devnodes.Resolver
	// HostNodes makes the IMEX channel nodes on the host once the spec is
	// written (the driver makes none until asked); the state machine
	// releases them with the spec. Nil makes none.
	HostNodes *hostnodes.Nodes
	// BootID is the current boot's, written into every spec so that a
	// restart after a reboot can tell the earlier boot's specs apart
	// (RemoveEarlierBoots).
	BootID string
}

// Has says whether any of the claim's results for driver lies in a domain
// pool: such a claim is the Preparer's.
func Has(driver string, claim *resourceapi.ResourceClaim) bool {
	if claim.Status.Allocation == nil {
		return false
	}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if _, _, ok := ParsePool(r.Pool); ok && r.Driver == driver {
			return true
		}
	}
	return false
}

// Prepare writes the claim's CDI spec: per domain device its channel (an
// IMEX channel device node on an NVLink domain) and environment naming the
// domain and channel; for every container the gang and its size, from the
// annotations the gang controller writes on the claim.
func (p *Preparer) Prepare(ctx context.Context, claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	ref := claim.Namespace + "/" + claim.Name
	spec := cdi.ClaimSpec{ClaimUID: string(claim.UID), ClaimNamespace: claim.Namespace, ClaimName: claim.Name, BootID: p.BootID}
	var out []kubeletplugin.Device
	cdiName := map[string]string{} // pool/device -> CDI device name
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != p.Driver {
			continue
		}
		kind, value, ok := ParsePool(r.Pool)
		if !ok {
			return nil, fmt.Errorf("claim %s: device %s of pool %s is not a gang domain, yet the claim also has domain devices: a claim cannot mix GPUs and domains; ask for the domain in a claim of its own", ref, r.Device, r.Pool)
		}
		out = append(out, kubeletplugin.Device{Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device})
		key := r.Pool + "/" + r.Device
		if _, done := cdiName[key]; done {
			continue // one device serving several requests
		}
		channel, err := ParseDevice(r.Device)
		if err != nil {
			return nil, fmt.Errorf("claim %s: %w", ref, err)
		}
		name := fmt.Sprintf("%s-%d", r.Device, len(cdiName))
		cdiName[key] = name
		dev := cdi.Device{Name: name, Env: []string{
			gangv1.EnvDomain + "=" + value,
			gangv1.EnvChannel + "=" + strconv.Itoa(channel),
		}}
		if kind == KindNVLink {
			node, err := p.DevNodes.IMEXChannel(channel)
			if err != nil {
				return nil, fmt.Errorf("claim %s: domain %s: %w", ref, value, err)
			}
			dev.DeviceNodes = []cdi.DeviceNode{node}
		}
		spec.Devices = append(spec.Devices, dev)
	}
	m, err := ReadMember(claim)
	if err != nil {
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	spec.Common.Env = gangEnv(m)
	ids, err := p.CDI.Write(spec)
	if err != nil {
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	var nodes []cdi.DeviceNode
	for _, d := range spec.Devices {
		nodes = append(nodes, d.DeviceNodes...)
	}
	if err := p.HostNodes.Ensure(ctx, string(claim.UID), nodes); err != nil {
		return nil, fmt.Errorf("claim %s: make IMEX channel nodes on the host: %w", ref, err)
	}
	for i := range out {
		out[i].CDIDeviceIDs = []string{ids[cdiName[out[i].PoolName+"/"+out[i].DeviceName]]}
	}
	klog.FromContext(ctx).V(2).Info("Domain claim prepared", "claim", ref, "devices", len(out))
	return out, nil
}

// Unprepare removes the claim's CDI spec; a claim never prepared here
// succeeds.
func (p *Preparer) Unprepare(uid types.UID) error {
	return p.CDI.Remove(string(uid))
}

// RemoveEarlierBoots removes the specs an earlier boot wrote. Their claims'
// pods died with that boot, and a CDI directory that is not tmpfs would keep
// them forever. Specs without a boot ID (written before specs carried one)
// are kept: they may serve pods running now, whose containers need the spec
// again when they restart. Unreadable files are reported, not removed.
func (p *Preparer) RemoveEarlierBoots(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	specs, listErr := p.CDI.List()
	for _, s := range specs {
		if s.BootID == "" || s.BootID == p.BootID {
			continue
		}
		if err := p.CDI.Remove(s.ClaimUID); err != nil {
			return fmt.Errorf("remove the domain claim spec of an earlier boot: %w", err)
		}
		logger.Info("Removed the domain claim spec of an earlier boot", "claim", klog.KRef(s.ClaimNamespace, s.ClaimName), "uid", s.ClaimUID, "bootID", s.BootID)
	}
	if listErr != nil {
		logger.Error(listErr, "Some domain claim specs are unreadable; left in place")
	}
	return nil
}

// Member is what the gang controller wrote on a claim of a gang's (its
// annotations): the gang and its size on every such claim, the member's
// rank and role on a member's own GPU claims.
type Member struct {
	// Gang is "<namespace>/<name>"; empty for a claim no gang placed.
	Gang string
	Size int
	// Rank is the member's, 0 to Size-1; -1 on a domain claim (the
	// gang's, not one member's).
	Rank int
	// Role, RoleRank and RoleSize are set in a gang with roles.
	Role               string
	RoleRank, RoleSize int
}

// ReadMember reads a claim's gang annotations (Gang empty and Rank -1 on a
// claim no gang placed), and names the annotation that does not parse.
func ReadMember(claim *resourceapi.ResourceClaim) (Member, error) {
	m := Member{Gang: claim.Annotations[gangv1.AnnotationGang], Rank: -1}
	var err error
	if m.Gang != "" {
		if m.Size, err = strconv.Atoi(claim.Annotations[gangv1.AnnotationSize]); err != nil || m.Size < 1 {
			return Member{}, fmt.Errorf("annotation %s=%q: want a positive number (written by the gang controller; do not edit it)", gangv1.AnnotationSize, claim.Annotations[gangv1.AnnotationSize])
		}
	}
	rank, ok := claim.Annotations[gangv1.AnnotationRank]
	if !ok {
		return m, nil
	}
	if m.Rank, err = strconv.Atoi(rank); err != nil || m.Rank < 0 {
		return Member{}, fmt.Errorf("annotation %s=%q: want a number of 0 or more (written by the gang controller; do not edit it)", gangv1.AnnotationRank, rank)
	}
	role, ok := claim.Annotations[gangv1.AnnotationRole]
	if !ok {
		return m, nil
	}
	m.Role = role
	if m.RoleRank, err = strconv.Atoi(claim.Annotations[gangv1.AnnotationRoleRank]); err != nil || m.RoleRank < 0 {
		return Member{}, fmt.Errorf("annotation %s=%q: want a number of 0 or more (written by the gang controller; do not edit it)", gangv1.AnnotationRoleRank, claim.Annotations[gangv1.AnnotationRoleRank])
	}
	if m.RoleSize, err = strconv.Atoi(claim.Annotations[gangv1.AnnotationRoleSize]); err != nil || m.RoleSize <= m.RoleRank {
		return Member{}, fmt.Errorf("annotation %s=%q: want a number above the role rank %d (written by the gang controller; do not edit it)", gangv1.AnnotationRoleSize, claim.Annotations[gangv1.AnnotationRoleSize], m.RoleRank)
	}
	return m, nil
}

// gangEnv is TESSERA_GANG and TESSERA_GANG_SIZE from a claim's gang
// annotations; nothing for a claim no gang placed.
func gangEnv(m Member) []string {
	if m.Gang == "" {
		return nil
	}
	return []string{gangv1.EnvGang + "=" + m.Gang, gangv1.EnvGangSize + "=" + strconv.Itoa(m.Size)}
}

// MemberEnv is the prepare.Config.ClaimEnv hook for a member's GPU claim: the
// gang, its size and the member's rank, and in a gang with roles the
// member's role, its rank within the role and the role's size, from the
// annotations the gang controller writes on the claim before allocating it;
// nothing for a claim of no gang.
func MemberEnv(claim *resourceapi.ResourceClaim) ([]string, error) {
	if _, ok := claim.Annotations[gangv1.AnnotationRank]; !ok {
		return nil, nil
	}
	m, err := ReadMember(claim)
	if err != nil {
		return nil, fmt.Errorf("claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	env := append(gangEnv(m), gangv1.EnvGangRank+"="+strconv.Itoa(m.Rank))
	if m.Role == "" {
		return env, nil
	}
	return append(env, gangv1.EnvRole+"="+m.Role, gangv1.EnvRoleRank+"="+strconv.Itoa(m.RoleRank), gangv1.EnvRoleSize+"="+strconv.Itoa(m.RoleSize)), nil
}
