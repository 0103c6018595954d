// Package v1alpha1 is the Gang API (gang.tessera.dev/v1alpha1): a group of
// pods that must be placed together, all or nothing, inside one domain (an
// NVLink clique or a node-label topology domain), and the annotations through
// which the gang controller and the kubelet plugin share its placement. It
// imports nothing of Tessera's.
package v1alpha1

import (
	"fmt"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// Group, Version and Resource of the API.
const (
	Group    = "gang.tessera.dev"
	Version  = "v1alpha1"
	Kind     = "Gang"
	Resource = "gangs"
)

// GroupVersionResource is the gangs resource.
var GroupVersionResource = schema.GroupVersionResource{Group: Group, Version: Version, Resource: Resource}

// SchedulingGate is the pod scheduling gate that holds a member until the
// controller has placed the whole gang. Members must be created with it (in
// a Job's pod template): a member without it is scheduled alone.
const SchedulingGate = Group + "/placement"

// Annotations the controller writes. On the gang: the committed placement. On
// member pods and their claims (the per-pod GPU claims and the shared domain
// claim): which gang and placement they belong to, the gang's size and the
// member's rank. The kubelet plugin reads the claims' annotations to tell
// each container its gang, size and rank.
const (
	// AnnotationPlacement names the placement (an ID) a claim or pod was
	// written for.
	AnnotationPlacement = Group + "/placement"
	// AnnotationCommitted, on the gang, names the placement whose claims
	// were all written: only its members' gates are released. A placement
	// without it is rolled back.
	AnnotationCommitted = Group + "/committed-placement"
	// AnnotationUncommitted, on the gang, records a placement while its
	// claims are written (JSON of UncommittedPlacement): set before the
	// first claim is written, removed by the commit or the rollback. A
	// controller that finds it clears those claims, whatever the gang's
	// spec says by then.
	AnnotationUncommitted = Group + "/uncommitted-placement"
	// AnnotationGang is "<namespace>/<name>" of the gang.
	AnnotationGang = Group + "/gang"
	// AnnotationSize is the gang's size; in an elastic gang its most
	// (spec.maxSize, or the sum of the roles' sizes), which its ranks stay
	// under: how many members live now is for the workload's own
	// rendezvous to tell.
	AnnotationSize = Group + "/size"
	// AnnotationRank is the member's rank, 0 to size-1.
	AnnotationRank = Group + "/rank"
	// AnnotationRole is the member's role (spec.roles[].name); absent in a
	// gang without roles.
	AnnotationRole = Group + "/role"
	// AnnotationRoleRank is the member's rank within its role, 0 to the
	// role's size-1.
	AnnotationRoleRank = Group + "/role-rank"
	// AnnotationRoleSize is the size of the member's role.
	AnnotationRoleSize = Group + "/role-size"
	// AnnotationPrepareRetry, on a released member, is when the controller
	// last asked its kubelet to prepare it again (RFC 3339): a member whose
	// prepare was refused for a device another claim held is retried by the
	// kubelet only at its next resync (its sync frequency, 1m by default,
	// plus up to half that), and an annotation change makes the kubelet sync
	// the pod at once.
	AnnotationPrepareRetry = Group + "/prepare-retry"
	// AnnotationNodes, on the domain claim, lists the placement's nodes
	// and their InternalIP addresses (FormatNodes), sorted by name and
	// written with the allocation: the kubelet plugin configures each
	// node's IMEX daemon with exactly these addresses.
	AnnotationNodes = Group + "/nodes"
	// AnnotationNode, on a member's own claims, is the node the placement
	// chose for the member: the controller pins the member there when it
	// releases it, and the scheduler allocates the claims on it. A
	// controller that resumes a committed placement after a crash releases
	// the members still gated to these nodes.
	AnnotationNode = Group + "/node"
)

// Node is one node of a placement: its name and the address (InternalIP)
// its IMEX daemon serves on; "" when the Node has none.
type Node struct {
	Name    string
	Address string
}

// FormatNodes renders nodes as AnnotationNodes' value:
// "<name>=<address>,..." in the order given.
func FormatNodes(nodes []Node) string {
	parts := make([]string, len(nodes))
	for i, n := range nodes {
		parts[i] = n.Name + "=" + n.Address
	}
	return strings.Join(parts, ",")
}

// ParseNodes reads AnnotationNodes' value; an entry without "=" or without
// a name is an error.
func ParseNodes(value string) ([]Node, error) {
	if value == "" {
		return nil, nil
	}
	var out []Node
	for _, part := range strings.Split(value, ",") {
		name, addr, ok := strings.Cut(part, "=")
		if !ok || name == "" {
			return nil, fmt.Errorf("annotation %s: entry %q is not <node>=<address> (written by the gang controller; do not edit it)", AnnotationNodes, part)
		}
		out = append(out, Node{Name: name, Address: addr})
	}
	return out, nil
}

// UncommittedPlacement is the value of AnnotationUncommitted: a placement's
// ID and the claims (of the gang's namespace) it writes.
type UncommittedPlacement struct {
	Placement string   `json:"placement"`
	Claims    []string `json:"claims"`
	// Growth says the claims are new members' of the committed placement
	// Placement (an elastic gang growing), not a placement of their own: a
	// rollback clears only those of them that carry AnnotationGrowth of
	// this Attempt and whose pod is still gated, and the placement stays
	// committed.
	Growth  bool   `json:"growth,omitempty"`
	Attempt string `json:"attempt,omitempty"`
}

// AnnotationGrowth, on a claim a growth of an elastic gang wrote, names the
// growth (UncommittedPlacement.Attempt).
const AnnotationGrowth = Group + "/growth"

// Finalizer keeps a gang until an uncommitted placement of it is rolled back.
const Finalizer = Group + "/rollback"

// DomainClass is the DeviceClass of domain claims: one claim of it, shared
// by every member, confines a gang to one domain.
const DomainClass = "domain.gpu.tessera.dev"

// AnnotationMaxSize on a PodGroup with a gang policy makes its gang elastic:
// from the policy's minCount to this many members (a number, at least
// minCount). Without it the gang has exactly minCount members.
const AnnotationMaxSize = Group + "/max-size"

// AnnotationManaged, set to "true" on a PodGroup with a gang policy, has the
// controller place it although none of its claims is a domain claim (a gang
// confined to one domain, without a channel).
const AnnotationManaged = Group + "/managed"

// Environment the kubelet plugin gives each container of a member.
const (
	EnvGang     = "TESSERA_GANG"
	EnvGangSize = "TESSERA_GANG_SIZE"
	EnvGangRank = "TESSERA_GANG_RANK"
	// EnvRole, EnvRoleRank and EnvRoleSize: the member's role, its rank
	// within the role and the role's size, in gangs with roles.
	EnvRole     = "TESSERA_GANG_ROLE"
	EnvRoleRank = "TESSERA_GANG_ROLE_RANK"
	EnvRoleSize = "TESSERA_GANG_ROLE_SIZE"
	EnvDomain   = "TESSERA_DOMAIN"
	EnvChannel  = "TESSERA_DOMAIN_CHANNEL"
)

// MaxSizeWithDomainClaim is the largest gang that can share one domain claim:
// a claim is reserved for at most 256 pods (resource.k8s.io/v1).
const MaxSizeWithDomainClaim = 256

// MaxRoles is the most roles a gang has (the CRD's spec.roles maxItems).
const MaxRoles = 16

// Gang is a group of pods placed together, all or nothing, in one domain.
type Gang struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   GangSpec   `json:"spec"`
	Status GangStatus `json:"status,omitempty"`
}

// GangSpec says which pods form the gang.
type GangSpec struct {
	// Size is how many members the gang needs; none is placed before all
	// exist and fit. Unset (0) in an elastic gang, which sets MinSize and
	// MaxSize instead.
	Size int32 `json:"size,omitempty"`
	// MinSize and MaxSize make the gang elastic: it is placed once MinSize
	// members exist and fit, with as many of its members (up to MaxSize)
	// as fit in the domain; members that did not fit, and members created
	// later (a failed member's replacement), join it in the same domain
	// when room appears there. A member that fails or is evicted is let
	// go alone while MinSize members live; below that the gang is placed
	// again, as a fixed gang is on any loss. Each member keeps its rank
	// for its lifetime, and a new member takes the lowest free rank (an
	// indexed Job's replacement pod takes its predecessor's), so ranks
	// stay in 0..MaxSize-1. Set both, or neither (and Size); not with
	// roles, whose elasticity is spec.roles[].minSize.
	MinSize int32 `json:"minSize,omitempty"`
	MaxSize int32 `json:"maxSize,omitempty"`
	// Selector picks the members among the namespace's pods (e.g. the
	// job-name label of an indexed Job, or a label of your own). Exactly
	// one of Selector and PodGroupName is set.
	Selector metav1.LabelSelector `json:"selector,omitempty"`
	// PodGroupName makes the members the pods of this PodGroup
	// (scheduling.k8s.io; the pods' spec.schedulingGroup.podGroupName). The
	// controller writes such gangs itself, one per PodGroup it places.
	PodGroupName string `json:"podGroupName,omitempty"`
	// CompositePodGroupName says the gang is this CompositePodGroup
	// (scheduling.k8s.io/v1alpha3): its members are the pods of its child
	// PodGroups, each child one role (spec.roles[].podGroupName). The
	// controller writes such gangs itself, one per CompositePodGroup with
	// a gang policy it places. Exactly one of Selector, PodGroupName and
	// CompositePodGroupName is set.
	CompositePodGroupName string `json:"compositePodGroupName,omitempty"`
	// DomainClaimName names the ResourceClaim (class domain.gpu.tessera.dev)
	// every member shares; the controller allocates it to a domain device,
	// which confines the gang to that domain and gives each container the
	// domain's channel. Optional: without it the gang is still placed inside
	// one domain, without a channel. At most 256 members can share it.
	DomainClaimName string `json:"domainClaimName,omitempty"`
	// Placement says how the members are laid out over the domain's nodes.
	// Optional: pack.
	Placement *Placement `json:"placement,omitempty"`
	// Roles divide the members into named groups (a launcher and its
	// workers; prefill and decode), each picked by its own selector among
	// the gang's members, with its own size and so its own claims. All
	// roles are placed together, all or nothing, in one domain. Size is
	// the sum of the roles' sizes. Ranks follow the roles' order (the
	// first role's members get the lowest ranks), and so does eviction:
	// the last role's members are evicted first, the first role's last.
	// Optional; not with podGroupName.
	Roles []Role `json:"roles,omitempty"`
}

// PlacementPolicy is how members are laid out inside a domain.
type PlacementPolicy string

const (
	// PolicyPack places members on as few nodes as possible, in the
	// smallest domain that fits (the default).
	PolicyPack PlacementPolicy = "Pack"
	// PolicySpread places at most MaxPerValue members on the nodes of any
	// one value of TopologyKey (a node label): a failure of one value's
	// nodes (a rack, a power domain, a host) takes at most MaxPerValue
	// members.
	PolicySpread PlacementPolicy = "Spread"
)

// Strength says whether a placement policy may be given up.
type Strength string

const (
	// StrengthRequired: a gang the policy cannot be met for waits
	// (Waiting/NoDomainFits), as one that does not fit.
	StrengthRequired Strength = "Required"
	// StrengthPreferred: the policy is met where any domain allows it;
	// else the gang is placed anyway, as evenly as the nodes allow, and
	// the Placed condition says the policy was not met.
	StrengthPreferred Strength = "Preferred"
)

// Placement is a gang's placement policy.
type Placement struct {
	// Policy: Pack (default) or Spread.
	Policy PlacementPolicy `json:"policy,omitempty"`
	// TopologyKey is the node label whose values Spread spreads over (e.g.
	// a rack label, or kubernetes.io/hostname for one member per node).
	// Required with Spread. With Required strength, nodes without the
	// label are not used.
	TopologyKey string `json:"topologyKey,omitempty"`
	// MaxPerValue is the most members on the nodes of one value of
	// TopologyKey. Required with Spread, at least 1.
	MaxPerValue int32 `json:"maxPerValue,omitempty"`
	// Strength: Required (default) or Preferred.
	Strength Strength `json:"strength,omitempty"`
}

// Role is a named group of a gang's members.
type Role struct {
	// Name names the role (a DNS label): members see it in
	// TESSERA_GANG_ROLE.
	Name string `json:"name"`
	// Size is how many members the role has (the most, in an elastic
	// role).
	Size int32 `json:"size"`
	// MinSize makes the role elastic: the gang is placed with at least
	// MinSize of the role's members and grows to Size as room appears;
	// the role's members above MinSize may be lost (evicted, preempted,
	// failed) without the gang being placed again. Optional: Size.
	MinSize int32 `json:"minSize,omitempty"`
	// Selector picks the role's members among the gang's (e.g. the
	// job-name of the role's Job). Every member matches exactly one role.
	// Empty in a CompositePodGroup's gang, whose roles are PodGroups.
	Selector metav1.LabelSelector `json:"selector"`
	// PodGroupName makes the role's members the pods of this PodGroup, a
	// child of the gang's CompositePodGroup (spec.compositePodGroupName);
	// set instead of Selector there, and only there.
	PodGroupName string `json:"podGroupName,omitempty"`
}

// GangStatus is what the controller last observed and did.
type GangStatus struct {
	// ObservedGeneration is the spec generation the status describes.
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// Members is how many member pods exist (not finished).
	Members int32 `json:"members,omitempty"`
	// Domain is the domain the gang is placed in ("<pool>/<device>" of the
	// domain device, or the domain's pool when there is no domain claim).
	Domain string `json:"domain,omitempty"`
	// Nodes are the nodes the members were placed on.
	Nodes []string `json:"nodes,omitempty"`
	// PlacedMembers is how many members the committed placement held at
	// the controller's last look (live or succeeded): an elastic gang's
	// follows its growth and its losses, which is how a member that is
	// simply gone is noticed. 0 while the gang is not placed.
	PlacedMembers int32 `json:"placedMembers,omitempty"`
	// Conditions: Waiting, Placed, Running, Failed, and IMEXReady on a gang
	// placed in an NVLink domain when the kubelet plugins run IMEX daemons
	// (tessera-controller --imex-daemons).
	Conditions []metav1.Condition `json:"conditions,omitempty"`
	// Preemption is set while the gang waits for pods it preempted to end:
	// the domain it freed, its priority and the pods it evicted. Gangs of
	// lower priority are not placed in that domain meanwhile. Only the
	// controller writes it; it is recomputed on every look and cleared once
	// the gang is placed or no longer preempts.
	Preemption *Preemption `json:"preemption,omitempty"`
	// Reservation is set while the gang waits for pods expected to end
	// (their activeDeadlineSeconds or AnnotationExpectedRuntime) on nodes
	// it reserved: new pods without a toleration of TaintReserved are kept
	// off their devices (DeviceTaintRules), and gangs of no higher
	// priority out of the domain. Only the controller writes it.
	Reservation *Reservation `json:"reservation,omitempty"`
	// BackfillRefusals are the backfill pods whose eviction at the start
	// of the gang's reservation a PodDisruptionBudget refused, and since
	// when (the first refusal); at most MaxBackfillRefusals, kept while
	// the pod runs and the gang is not placed. A pod refused for longer
	// than the controller's grace is counted as staying: the gang's
	// reservations no longer count on it freeing its devices.
	BackfillRefusals []BackfillRefusal `json:"backfillRefusals,omitempty"`
}

// BackfillRefusal is a backfill pod whose eviction a PodDisruptionBudget
// refused.
type BackfillRefusal struct {
	// Pod is the pod (namespace/name).
	Pod string `json:"pod"`
	// Since is when its eviction was first refused.
	Since metav1.Time `json:"since"`
}

// MaxBackfillRefusals bounds the backfill pods a gang's status lists as
// refused eviction.
const MaxBackfillRefusals = 32

// Reservation is a waiting gang's hold on the nodes of a domain that are
// expected to free up first.
type Reservation struct {
	// Domain is the domain's pool.
	Domain string `json:"domain"`
	// Priority is the gang's priority.
	Priority int32 `json:"priority"`
	// Since is when the gang first reserved this domain: backfill pods
	// whose claims were allocated (or, without an allocation time, that
	// were bound) after it came onto reserved devices and are evicted at
	// the start whatever end they declare.
	Since metav1.Time `json:"since"`
	// Start is when the pods it waits for are expected to have ended;
	// backfill pods still running then are evicted.
	Start metav1.Time `json:"start"`
	// Nodes are the nodes whose devices are reserved.
	Nodes []string `json:"nodes,omitempty"`
	// WaitingFor are the pods expected to end by Start (namespace/name); at
	// most MaxPreemptionVictims are listed.
	WaitingFor []string `json:"waitingFor,omitempty"`
	// Yields are the pending pods of higher priority the reservation has
	// left a node to, the first given first: at most
	// MaxReservationYields over the reservation's life (the next ones
	// wait for the gang's placement, as pods of its own priority do), each
	// for at most a minute while its pod is not placed.
	Yields []ReservationYield `json:"yields,omitempty"`
}

// ReservationYield is a node a reservation left to a pending pod of higher
// priority.
type ReservationYield struct {
	// Pod is the pod (namespace/name).
	Pod string `json:"pod"`
	// Node is the node first left to it.
	Node string `json:"node"`
	// At is when the node was first left to it.
	At metav1.Time `json:"at"`
}

// MaxReservationYields bounds the pods one reservation leaves nodes to.
// Each may push the gang's start back by its runtime (or, declaring none,
// move the reservation elsewhere): four let the odd urgent pod through and
// bound what a stream of pods of higher priority costs the gang to four
// such runtimes, where without a bound it could wait for ever.
const MaxReservationYields = 4

// Reservation keys.
const (
	// AnnotationExpectedRuntime on a pod declares how long it runs from its
	// start (a Go duration such as "45m"); reservations count on it ending
	// then, as on its activeDeadlineSeconds (the earlier of the two). Pods
	// with neither are not expected to end.
	AnnotationExpectedRuntime = Group + "/expected-runtime"
	// TaintReserved is the device taint of a reservation (effect
	// NoSchedule, value the gang's UID). A pod whose claims tolerate it
	// (operator Exists) is a backfill pod: it may run on reserved devices
	// and is evicted when the reservation starts.
	TaintReserved = Group + "/reserved"
	// TaintReservationStarted replaces TaintReserved on a reservation's
	// devices once it starts: no pod tolerates it, so that backfill pods
	// no longer take what frees up.
	TaintReservationStarted = Group + "/reservation-started"
	// LabelReservation marks the DeviceTaintRules of a reservation with
	// the reserving gang's UID.
	LabelReservation = Group + "/reservation"
)

// Preemption is a waiting gang's claim on a domain whose lower-priority
// pods it evicted.
type Preemption struct {
	// Domain is the domain's pool (domains/nvlink/... or domains/topology/...).
	Domain string `json:"domain"`
	// Priority is the gang's priority: the lowest of its members' pods.
	Priority int32 `json:"priority"`
	// Victims are the pods evicted for the gang (namespace/name), whose
	// ending it waits for; at most MaxPreemptionVictims are listed.
	Victims []string `json:"victims,omitempty"`
}

// MaxPreemptionVictims bounds Preemption.Victims (the rest are counted in
// the Waiting condition's message).
const MaxPreemptionVictims = 32

// Condition types.
const (
	// ConditionWaiting is true while the gang's members are held: the reason
	// and message say why (members missing, no domain fits and what the
	// closest one lacks).
	ConditionWaiting = "Waiting"
	// ConditionPlaced is true once every member's claims are allocated in one
	// domain and the members are released to the scheduler.
	ConditionPlaced = "Placed"
	// ConditionRunning is true while every member runs (or has succeeded).
	ConditionRunning = "Running"
	// ConditionFailed is true when a placed gang lost a member (failed,
	// deleted, its node gone); the remaining members are evicted and the gang
	// placed again once its workload recreates them.
	ConditionFailed = "Failed"
	// ConditionIMEXReady is true while every node of an NVLink placement
	// runs its IMEX daemon and the daemon is ready (listening); false,
	// with the nodes that lack one, otherwise. Absent for other domains.
	ConditionIMEXReady = "IMEXReady"
)

// Reasons of the conditions.
const (
	ReasonMembersMissing = "MembersMissing"
	ReasonTooManyMembers = "TooManyMembers"
	ReasonClaimsPending  = "ClaimsPending"
	ReasonInvalid        = "InvalidGang"
	ReasonNoDomainFits   = "NoDomainFits"
	ReasonPlaced         = "Placed"
	ReasonRunning        = "Running"
	ReasonNotRunning     = "MembersNotRunning"
	ReasonMemberLost     = "MemberLost"
	// ReasonShrunk: an elastic gang lost members and goes on with the
	// rest (at least its minimum). Also the event on the gang.
	ReasonShrunk = "Shrunk"
	// ReasonGrown is the event on an elastic gang that added members to
	// its placement.
	ReasonGrown            = "Grown"
	ReasonRolledBack       = "RolledBack"
	ReasonConflict         = "AllocationConflict"
	ReasonNone             = "None"
	ReasonPlacementPending = "PlacementPending"
	// ReasonPreempting: waiting for the lower-priority pods the gang
	// evicted (status.preemption) to end. Also the event on the gang.
	ReasonPreempting = "Preempting"
	// ReasonPreempted is the event on each pod a gang evicts.
	ReasonPreempted = "Preempted"
	// ReasonReserved: waiting on reserved nodes (status.reservation) for
	// pods expected to end. Also the event on the gang.
	ReasonReserved = "Reserved"
	// ReasonBackfillEvicted is the event on each backfill pod evicted when
	// a reservation starts.
	ReasonBackfillEvicted = "BackfillEvicted"
	// ReasonBackfillEvictionRefused is the warning event on a backfill pod
	// whose eviction at a reservation's start was refused (a
	// PodDisruptionBudget) or failed: it keeps its devices, the
	// reservation waits for it and tries again.
	ReasonBackfillEvictionRefused = "BackfillEvictionRefused"
	// ReasonPolicyNotMet: placed, but a Preferred placement policy could
	// not be met (the Placed condition's message says where).
	ReasonPolicyNotMet = "PlacementPolicyNotMet"
	// ReasonIMEXReady and ReasonIMEXNotReady: the IMEXReady condition.
	ReasonIMEXReady    = "DaemonsReady"
	ReasonIMEXNotReady = "DaemonsNotReady"
)

// GangList is a list of gangs.
type GangList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []Gang `json:"items"`
}
