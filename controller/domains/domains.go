// Package domains finds the gang domains of a cluster (each multi-node
// NVLink clique the nodes' slices show, and each value of a topology node
// label) and publishes each as a pool of channel devices whose node
// selection is exactly the domain's nodes.
package domains

import (
	"slices"
	"sort"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/domain"
	gpuslices "github.com/tessera-dev/tessera/driver/slices"
)

// Domain is a set of nodes a gang can be confined to.
type Domain struct {
	// Kind is domain.KindNVLink or domain.KindTopology.
	Kind string
	// Value is the clique ("<clusterUUID>.<cliqueID>") or the label value.
	Value string
	// Nodes are the domain's nodes, sorted.
	Nodes []string
	// Hosts are the nodes' kubernetes.io/hostname labels (the name where
	// a node has none), sorted: the pool's node selector matches them.
	Hosts []string
	// GPUs is how many whole GPUs the domain's nodes publish.
	GPUs int
}

// Pool is the name of the domain's pool.
func (d Domain) Pool() string { return domain.PoolName(d.Kind, d.Value) }

// Compute finds the domains: every nvlinkClique attribute value on the GPUs
// of the driver's per-node slices, with the nodes publishing it, and every
// value of the node label topologyKey (if set) among the nodes that publish
// the driver's slices. Only nodes that exist and are not being deleted
// count, so domains follow nodes joining and leaving. The result is sorted
// by pool name.
func Compute(nodes []*v1.Node, resourceSlices []*resourceapi.ResourceSlice, driver, topologyKey string) []Domain {
	live := map[string]*v1.Node{}
	for _, n := range nodes {
		if n.DeletionTimestamp == nil {
			live[n.Name] = n
		}
	}
	type acc struct {
		nodes map[string]bool
		gpus  map[string]bool // node/device
	}
	found := map[[2]string]*acc{}
	add := func(kind, value, node, device string) {
		k := [2]string{kind, value}
		a := found[k]
		if a == nil {
			a = &acc{nodes: map[string]bool{}, gpus: map[string]bool{}}
			found[k] = a
		}
		a.nodes[node] = true
		if device != "" {
			a.gpus[node+"/"+device] = true
		}
	}
	for _, s := range resourceSlices {
		if s.Spec.Driver != driver || s.Spec.NodeName == nil {
			continue
		}
		node, ok := live[*s.Spec.NodeName]
		if !ok {
			continue
		}
		for _, d := range s.Spec.Devices {
			if attr(d, gpuslices.AttrType) != gpuslices.TypeGPU {
				continue
			}
			if clique := attr(d, gpuslices.AttrNVLinkClique); clique != "" {
				add(domain.KindNVLink, clique, node.Name, d.Name)
			}
			if topologyKey != "" {
				if v := node.Labels[topologyKey]; v != "" {
					add(domain.KindTopology, v, node.Name, d.Name)
				}
			}
		}
	}
	out := make([]Domain, 0, len(found))
	for k, a := range found {
		d := Domain{Kind: k[0], Value: k[1], GPUs: len(a.gpus)}
		for n := range a.nodes {
			d.Nodes = append(d.Nodes, n)
			d.Hosts = append(d.Hosts, hostname(live[n]))
		}
		sort.Strings(d.Nodes)
		sort.Strings(d.Hosts)
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Pool() < out[j].Pool() })
	return out
}

func attr(d resourceapi.Device, name string) string {
	a, ok := d.Attributes[resourceapi.QualifiedName(name)]
	if !ok || a.StringValue == nil {
		return ""
	}
	return *a.StringValue
}

// Resources is what to publish for the domains: a pool per domain, selecting
// exactly its nodes by name, with channels devices channel-0 ... each
// carrying the domain's kind, value, node and GPU count, and tainted so
// that only the gang controller allocates them (domain.TaintKey).
func Resources(ds []Domain, channels int) *resourceslice.DriverResources {
	out := &resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{}}
	for _, d := range ds {
		devs := make([]resourceapi.Device, 0, channels)
		for ch := range channels {
			devs = append(devs, resourceapi.Device{
				Name: domain.DeviceName(ch),
				Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
					domain.AttrType:    {StringValue: ptr.To(domain.TypeDomain)},
					domain.AttrKind:    {StringValue: ptr.To(d.Kind)},
					domain.AttrDomain:  {StringValue: ptr.To(d.Value)},
					domain.AttrChannel: {IntValue: ptr.To(int64(ch))},
					domain.AttrNodes:   {IntValue: ptr.To(int64(len(d.Nodes)))},
					domain.AttrGPUs:    {IntValue: ptr.To(int64(d.GPUs))},
				},
				// The controller alone allocates channels.
				Taints: []resourceapi.DeviceTaint{domain.Taint()},
			})
		}
		out.Pools[d.Pool()] = resourceslice.Pool{
			NodeSelector: NodeSelector(d.Hosts),
			Slices:       []resourceslice.Slice{{Devices: devs}},
		}
	}
	return out
}

// hostnameLabel names a node in a selector: a slice's node selector has one
// term, and a metadata.name field requirement takes one value only.
const hostnameLabel = "kubernetes.io/hostname"

func hostname(n *v1.Node) string {
	if h := n.Labels[hostnameLabel]; h != "" {
		return h
	}
	return n.Name
}

// NodeSelector selects exactly the nodes with these hostname labels.
func NodeSelector(hosts []string) *v1.NodeSelector {
	return &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
		MatchExpressions: []v1.NodeSelectorRequirement{{Key: hostnameLabel, Operator: v1.NodeSelectorOpIn, Values: slices.Clone(hosts)}},
	}}}
}

// HostsOf reads the hostnames back from a domain pool's node selector (as
// NodeSelector writes it); nil for any other selector.
func HostsOf(sel *v1.NodeSelector) []string {
	if sel == nil || len(sel.NodeSelectorTerms) != 1 {
		return nil
	}
	t := sel.NodeSelectorTerms[0]
	if len(t.MatchFields) != 0 || len(t.MatchExpressions) != 1 {
		return nil
	}
	e := t.MatchExpressions[0]
	if e.Key != hostnameLabel || e.Operator != v1.NodeSelectorOpIn {
		return nil
	}
	return slices.Clone(e.Values)
}
