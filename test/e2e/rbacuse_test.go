package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"sort"
	"strings"
	"testing"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/test/cluster"
)

// Every local cluster this package starts writes an audit log of the
// requests of the tessera-system service accounts (cluster.
// AuditServiceAccounts, set up in TestMain). After a run of the whole package
// TestMain holds each rule of the shipped roles to those requests: a verb on
// a resource that no component was ever allowed to make fails the suite, so
// that "nothing in a role is unused" is checked, not claimed.

// grant is one verb on one resource that a role allows a service account.
type grant struct {
	role      string // "ClusterRole name" or "Role namespace/name"
	account   string // system:serviceaccount:<ns>:<name>
	namespace string // for a Role: the only namespace it grants in
	apiGroup  string
	resource  string // "pods" or "pods/eviction"
	verb      string
}

func (g grant) String() string {
	group := g.apiGroup
	if group == "" {
		group = "core"
	}
	return fmt.Sprintf("%s: %s %s (%s) for %s", g.role, g.verb, g.resource, group, g.account)
}

// shippedGrants expands every rule of the given RBAC manifests into grants,
// one per bound service account, API group, resource and verb.
func shippedGrants(manifests ...[]byte) ([]grant, error) {
	type role struct {
		namespace string // empty for a ClusterRole
		rules     []rbacv1.PolicyRule
	}
	roles := map[string]role{}
	bound := map[string][]rbacv1.Subject{}
	key := func(kind, namespace, name string) string {
		if kind == "ClusterRole" {
			return "ClusterRole " + name
		}
		return "Role " + namespace + "/" + name
	}
	for _, m := range manifests {
		d := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(m), 4096)
		for {
			// The fields of roles and bindings alike.
			var doc struct {
				Kind     string              `json:"kind"`
				Metadata metav1.ObjectMeta   `json:"metadata"`
				Rules    []rbacv1.PolicyRule `json:"rules"`
				RoleRef  rbacv1.RoleRef      `json:"roleRef"`
				Subjects []rbacv1.Subject    `json:"subjects"`
			}
			if err := d.Decode(&doc); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				return nil, err
			}
			switch doc.Kind {
			case "ClusterRole", "Role":
				roles[key(doc.Kind, doc.Metadata.Namespace, doc.Metadata.Name)] = role{namespace: doc.Metadata.Namespace, rules: doc.Rules}
			case "ClusterRoleBinding", "RoleBinding":
				k := key(doc.RoleRef.Kind, doc.Metadata.Namespace, doc.RoleRef.Name)
				bound[k] = append(bound[k], doc.Subjects...)
			}
		}
	}
	var grants []grant
	for k, r := range roles {
		if len(bound[k]) == 0 {
			return nil, fmt.Errorf("%s is bound to nobody", k)
		}
		for _, s := range bound[k] {
			if s.Kind != rbacv1.ServiceAccountKind {
				return nil, fmt.Errorf("%s is bound to %s %s, not a service account", k, s.Kind, s.Name)
			}
			for _, rule := range r.rules {
				// Names are allowed only on the synthetic
				// resourceclaims/driver, where they name the driver: the
				// audit log of the status update that uses it does not.
				named := len(rule.ResourceNames) > 0 && !slices.Equal(rule.Resources, []string{"resourceclaims/driver"})
				if len(rule.NonResourceURLs) > 0 || named {
					return nil, fmt.Errorf("%s: rule %v: only resource rules without names (but resourceclaims/driver's) are checked", k, rule)
				}
				for _, group := range rule.APIGroups {
					for _, res := range rule.Resources {
						for _, verb := range rule.Verbs {
							grants = append(grants, grant{
								role: k, account: "system:serviceaccount:" + s.Namespace + ":" + s.Name, namespace: r.namespace,
								apiGroup: group, resource: res, verb: verb,
							})
						}
					}
				}
			}
		}
	}
	sort.Slice(grants, func(i, j int) bool { return grants[i].String() < grants[j].String() })
	return grants, nil
}

// used reports whether an allowed request in events exercised the grant.
//
// A watch with sendInitialEvents is an informer's list: client-go
// (WatchListClient, on by default) lists through such a watch where the API
// server supports it, authorized as a watch, and falls back to a plain list
// where it does not. It counts as a use of list too, which the role keeps for
// the fallback.
func (g grant) used(events []cluster.AuditEvent) bool {
	for _, e := range events {
		verbs := []string{e.Verb}
		if e.Verb == "watch" && strings.Contains(e.RequestURI, "sendInitialEvents=true") {
			verbs = append(verbs, "list")
		}
		if e.Verb == "update" && e.ObjectRef != nil && e.ObjectRef.Resource == "resourceclaims" && e.ObjectRef.Subresource == "status" {
			// The API server authorizes status.devices of a claim allocated
			// on no node of the writer as the verb arbitrary-node:update on
			// the synthetic resourceclaims/driver, within the update.
			verbs = append(verbs, "arbitrary-node:update")
		}
		if e.User.Username != g.account || !slices.Contains(verbs, g.verb) || e.ObjectRef == nil ||
			e.Annotations["authorization.k8s.io/decision"] != "allow" {
			continue
		}
		res := e.ObjectRef.Resource
		if e.ObjectRef.Subresource != "" {
			res += "/" + e.ObjectRef.Subresource
		}
		if e.ObjectRef.APIGroup != g.apiGroup || (g.namespace != "" && e.ObjectRef.Namespace != g.namespace) {
			continue
		}
		// The API server authorizes resourceclaims/binding and
		// resourceclaims/driver itself, within an update of
		// resourceclaims/status that changes the allocation or reservedFor,
		// or status.devices (DRAResourceClaimGranularStatusAuthorization);
		// neither is ever a request of its own. The audit log does not say
		// which fields an update changed: any status update counts.
		synthetic := (g.resource == "resourceclaims/binding" && g.verb == "update") ||
			(g.resource == "resourceclaims/driver" && g.verb == "arbitrary-node:update")
		if res == g.resource || (synthetic && res == "resourceclaims/status") {
			return true
		}
	}
	return false
}

// unprovoked are grants the code calls only on paths the suite cannot
// provoke on purpose, with where and why; they are reported, not failed.
// Keep the list short: a grant belongs here only after checking the code.
var unprovoked = map[string]string{
	// controller/gang/write.go, release: a fresh read after a conflicting
	// update of a gated member.
	"ClusterRole tessera-controller: get pods": "re-read of a member after an update conflict",
	// client-go's event correlator patches the count of an event that
	// repeats within its window instead of creating another.
	"ClusterRole tessera-controller: patch events": "count of a repeated event",
}

// unusedGrants lists the grants of the shipped roles no request used, less
// the unprovoked ones, and those of the unprovoked ones that no role grants
// any more.
func unusedGrants(events []cluster.AuditEvent) (unused []grant, stale []string, total int, err error) {
	grants, err := shippedGrants(rbac.KubeletPlugin, rbac.Controller)
	if err != nil {
		return nil, nil, 0, err
	}
	granted := map[string]bool{}
	for _, g := range grants {
		granted[g.short()] = true
		if _, ok := unprovoked[g.short()]; !ok && !g.used(events) {
			unused = append(unused, g)
		}
	}
	for k := range unprovoked {
		if !granted[k] {
			stale = append(stale, k)
		}
	}
	sort.Strings(stale)
	return unused, stale, len(grants), nil
}

// short names a grant without its API group and account.
func (g grant) short() string { return g.role + ": " + g.verb + " " + g.resource }

// checkRoleUse runs after the whole package: it reports every unused grant
// and says whether there was any.
func checkRoleUse(w io.Writer, auditDir string) bool {
	events, err := cluster.ReadAuditEvents(auditDir)
	if err != nil {
		fmt.Fprintf(w, "FAIL: e2e: read the API audit logs: %v\n", err)
		return false
	}
	unused, stale, total, err := unusedGrants(events)
	if err != nil {
		fmt.Fprintf(w, "FAIL: e2e: read the shipped RBAC roles: %v\n", err)
		return false
	}
	if len(stale) > 0 {
		fmt.Fprintf(w, "FAIL: e2e: the roles no longer grant %s; remove them from unprovoked in rbacuse_test.go\n", strings.Join(stale, ", "))
		return false
	}
	for _, k := range slices.Sorted(maps.Keys(unprovoked)) {
		fmt.Fprintf(w, "e2e: %s is not checked: the code uses it only for the %s\n", k, unprovoked[k])
	}
	if len(unused) == 0 {
		fmt.Fprintf(w, "e2e: every one of the %d verbs the plugin's and controller's roles grant was used (%d audited requests)\n", total, len(events))
		return true
	}
	var lines []string
	for _, g := range unused {
		lines = append(lines, "  "+g.String())
	}
	fmt.Fprintf(w, "FAIL: e2e: %d of the %d verbs the shipped roles grant were never used by any test (%d audited requests); remove them from deployments/rbac and the Helm chart, or cover the code that needs them:\n%s\n",
		len(unused), total, len(events), strings.Join(lines, "\n"))
	return false
}

// TestUnusedGrantsAreReported: the check names a verb no request used, and
// does not count a refused request, a request of another account or one in
// another namespace than the Role's.
func TestUnusedGrantsAreReported(t *testing.T) {
	grants, err := shippedGrants(rbac.KubeletPlugin)
	if err != nil {
		t.Fatal(err)
	}
	var mpsCreate grant
	for _, g := range grants {
		if strings.HasPrefix(g.role, "Role ") && g.resource == "pods" && g.verb == "create" {
			mpsCreate = g
		}
	}
	if mpsCreate.role == "" {
		t.Fatalf("no Role grants the plugin pod creation; grants: %v", grants)
	}
	var sliceList grant
	for _, g := range grants {
		if g.resource == "resourceslices" && g.verb == "list" {
			sliceList = g
		}
	}
	watch := func(uri string) []cluster.AuditEvent {
		var e cluster.AuditEvent
		e.User.Username, e.Verb, e.RequestURI = sliceList.account, "watch", uri
		e.ObjectRef = &cluster.AuditObjectRef{APIGroup: "resource.k8s.io", Resource: "resourceslices"}
		e.Annotations = map[string]string{"authorization.k8s.io/decision": "allow"}
		return []cluster.AuditEvent{e}
	}
	if !sliceList.used(watch("/apis/resource.k8s.io/v1/resourceslices?allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&sendInitialEvents=true&watch=true")) {
		t.Errorf("%s: a watch-list does not count as its use", sliceList)
	}
	if sliceList.used(watch("/apis/resource.k8s.io/v1/resourceslices?resourceVersion=5&watch=true")) {
		t.Errorf("%s: a plain watch counts as its use", sliceList)
	}
	controllerGrants, err := shippedGrants(rbac.Controller)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range controllerGrants {
		if g.resource != "resourceclaims/binding" && g.resource != "resourceclaims/driver" {
			continue
		}
		var e cluster.AuditEvent
		e.User.Username, e.Verb = g.account, "update"
		e.ObjectRef = &cluster.AuditObjectRef{APIGroup: "resource.k8s.io", Resource: "resourceclaims", Subresource: "status", Namespace: "ml"}
		e.Annotations = map[string]string{"authorization.k8s.io/decision": "allow"}
		if !g.used([]cluster.AuditEvent{e}) {
			t.Errorf("%s: an update of resourceclaims/status does not count as its use", g)
		}
		e.ObjectRef.Subresource = ""
		if g.used([]cluster.AuditEvent{e}) {
			t.Errorf("%s: an update of the claim itself counts as its use", g)
		}
	}
	event := func(user, ns, decision string) cluster.AuditEvent {
		var e cluster.AuditEvent
		e.User.Username, e.Verb = user, "create"
		e.ObjectRef = &cluster.AuditObjectRef{Resource: "pods", Namespace: ns}
		e.Annotations = map[string]string{"authorization.k8s.io/decision": decision}
		return e
	}
	for name, tc := range map[string]struct {
		events []cluster.AuditEvent
		used   bool
	}{
		"allowed":           {[]cluster.AuditEvent{event(mpsCreate.account, mpsCreate.namespace, "allow")}, true},
		"none":              {nil, false},
		"forbidden":         {[]cluster.AuditEvent{event(mpsCreate.account, mpsCreate.namespace, "forbid")}, false},
		"another account":   {[]cluster.AuditEvent{event("system:serviceaccount:x:y", mpsCreate.namespace, "allow")}, false},
		"another namespace": {[]cluster.AuditEvent{event(mpsCreate.account, "default", "allow")}, false},
	} {
		if got := mpsCreate.used(tc.events); got != tc.used {
			t.Errorf("%s: %s used = %v, want %v", name, mpsCreate, got, tc.used)
		}
	}
}
