package cli

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/spf13/cobra"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/tessera-dev/tessera/driver/simulate"
)

func newExplainCommand() *cobra.Command {
	var namespace, kubeconfig string
	cmd := &cobra.Command{
		Use:   "explain CLAIM",
		Short: "Say why a ResourceClaim is not allocated, node by node",
		Long: "Runs the scheduler's own allocator against the live ResourceSlices, tainted by the\n" +
			"DeviceTaintRules as the scheduler taints them, and every allocated claim, and reports\n" +
			"for each node whether the claim fits and, if not, what the closest node lacks: devices\n" +
			"matching a request, ones whose taints it tolerates, free ones, or a constraint.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg, err := clientConfig(kubeconfig)
			if err != nil {
				return err
			}
			client, err := kubernetes.NewForConfig(cfg)
			if err != nil {
				return err
			}
			return Explain(cmd.Context(), cmd.OutOrStdout(), client, namespace, args[0])
		},
	}
	cmd.Flags().StringVarP(&namespace, "namespace", "n", "default", "Namespace of the claim.")
	cmd.Flags().StringVar(&kubeconfig, "kubeconfig", "", "Path to a kubeconfig. Default: the files KUBECONFIG lists, else ~/.kube/config, else the pod's service account.")
	return cmd
}

// nodeVerdict is what one node offers a claim.
type nodeVerdict struct {
	node      string
	fits      bool
	shortfall int      // devices missing, summed over requests
	lacks     []string // what is missing, in words
}

// Explain writes, per node, whether the claim fits now and what the closest
// nodes lack.
func Explain(ctx context.Context, w io.Writer, client kubernetes.Interface, namespace, name string) error {
	claim, err := client.ResourceV1().ResourceClaims(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("get claim %s/%s: %w", namespace, name, err)
	}
	if a := claim.Status.Allocation; a != nil {
		fmt.Fprintf(w, "claim %s/%s is allocated:\n", namespace, name)
		for _, r := range a.Devices.Results {
			fmt.Fprintf(w, "  request %s: %s/%s/%s\n", r.Request, r.Driver, r.Pool, r.Device)
		}
		return nil
	}
	// Every DeviceTaintRule applies, the gang controller's reservations
	// included: this is the scheduler's view.
	snap, err := simulate.List(ctx, client, nil)
	if err != nil {
		return err
	}
	nodes := map[string][]*resourceapi.ResourceSlice{}
	for _, s := range snap.Slices {
		if s.Spec.NodeName != nil {
			nodes[*s.Spec.NodeName] = append(nodes[*s.Spec.NodeName], s)
		}
	}
	live := snap.Cluster(nil, func(c *resourceapi.ResourceClaim) bool { return c.UID == claim.UID })
	views := explainViews{live: live, empty: simulate.New(snap.Classes, snap.Slices), bare: simulate.New(snap.Classes, untainted(snap.Slices)), rules: snap.Rules}
	var verdicts []nodeVerdict
	for node, slices := range nodes {
		v, err := explainNode(ctx, views, node, slices, claim)
		if err != nil {
			return err
		}
		verdicts = append(verdicts, v)
	}
	sort.Slice(verdicts, func(i, j int) bool {
		if verdicts[i].fits != verdicts[j].fits {
			return verdicts[i].fits
		}
		if verdicts[i].shortfall != verdicts[j].shortfall {
			return verdicts[i].shortfall < verdicts[j].shortfall
		}
		return verdicts[i].node < verdicts[j].node
	})
	fmt.Fprintf(w, "claim %s/%s is not allocated; %d nodes publish devices\n", namespace, name, len(verdicts))
	for _, v := range verdicts {
		if v.fits {
			fmt.Fprintf(w, "  %s: fits now (the scheduler can place it here)\n", v.node)
			continue
		}
		fmt.Fprintf(w, "  %s: does not fit: %s\n", v.node, strings.Join(v.lacks, "; "))
	}
	return nil
}

// explainViews are the allocator's views an explanation compares.
type explainViews struct {
	// live is the cluster as the scheduler sees it: tainted slices, every
	// other allocated claim taken.
	live *simulate.Cluster
	// empty is the tainted slices with nothing allocated.
	empty *simulate.Cluster
	// bare is the slices without any taint, nothing allocated.
	bare *simulate.Cluster
	// rules tainted the slices.
	rules []*resourceapi.DeviceTaintRule
}

// untainted copies slices without their devices' taints.
func untainted(slices []*resourceapi.ResourceSlice) []*resourceapi.ResourceSlice {
	out := make([]*resourceapi.ResourceSlice, len(slices))
	for i, s := range slices {
		out[i] = s
		for _, d := range s.Spec.Devices {
			if len(d.Taints) > 0 {
				out[i] = s.DeepCopy()
				for j := range out[i].Spec.Devices {
					out[i].Spec.Devices[j].Taints = nil
				}
				break
			}
		}
	}
	return out
}

// explainNode checks the claim on one node (whose own slices are slices),
// then each request alone: how many devices match it at all (on an empty
// node, taints aside), how many of those carry a taint it does not
// tolerate, and how many are free.
func explainNode(ctx context.Context, views explainViews, node string, slices []*resourceapi.ResourceSlice, claim *resourceapi.ResourceClaim) (nodeVerdict, error) {
	v := nodeVerdict{node: node}
	res, err := views.live.Allocate(ctx, node, claim)
	if err != nil {
		return v, fmt.Errorf("node %s: %w", node, err)
	}
	if res != nil {
		v.fits = true
		return v, nil
	}
	allRequestsFree := true
	for _, r := range claim.Spec.Devices.Requests {
		if r.Exactly == nil {
			v.lacks = append(v.lacks, fmt.Sprintf("request %s (with alternatives) has no alternative that fits", r.Name))
			v.shortfall++
			allRequestsFree = false
			continue
		}
		need := int(r.Exactly.Count)
		if r.Exactly.AllocationMode == resourceapi.DeviceAllocationModeAll {
			need = 1
		}
		matching, err := maxFitting(ctx, views.bare, node, claim, r, resourceapi.AllocationResultsMaxSize)
		if err != nil {
			return v, err
		}
		tolerated, err := maxFitting(ctx, views.empty, node, claim, r, matching)
		if err != nil {
			return v, err
		}
		free, err := maxFitting(ctx, views.live, node, claim, r, tolerated)
		if err != nil {
			return v, err
		}
		if free < need {
			allRequestsFree = false
			v.shortfall += need - free
			if tolerated < matching {
				v.lacks = append(v.lacks, fmt.Sprintf("request %s needs %d, %d devices match its class and selectors, %d of them carry taints it does not tolerate (%s), %d of the others free",
					r.Name, need, matching, matching-tolerated, strings.Join(simulate.Untolerated(slices, views.rules, r.Exactly.Tolerations), ", "), free))
			} else {
				v.lacks = append(v.lacks, fmt.Sprintf("request %s needs %d, %d devices match its class and selectors, %d of them free", r.Name, need, matching, free))
			}
		}
	}
	if allRequestsFree {
		v.shortfall++
		v.lacks = append(v.lacks, "enough free devices match each request, but not together: a constraint (matchAttribute, distinctAttribute) or devices shared between requests rule it out")
	}
	return v, nil
}

// maxFitting is the largest count (up to limit) of devices the request
// alone can get on the node, found by bisection with the allocator.
func maxFitting(ctx context.Context, c *simulate.Cluster, node string, claim *resourceapi.ResourceClaim, r resourceapi.DeviceRequest, limit int) (int, error) {
	fits := func(k int) (bool, error) {
		probe := claim.DeepCopy()
		req := r.DeepCopy()
		req.Exactly.AllocationMode = resourceapi.DeviceAllocationModeExactCount
		req.Exactly.Count = int64(k)
		probe.Spec.Devices.Requests = []resourceapi.DeviceRequest{*req}
		probe.Spec.Devices.Constraints = nil
		res, err := c.Allocate(ctx, node, probe)
		return res != nil, err
	}
	lo, hi := 0, limit
	for lo < hi {
		mid := (lo + hi + 1) / 2
		ok, err := fits(mid)
		if err != nil {
			return 0, err
		}
		if ok {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	return lo, nil
}
