// Package domain is the node side of gang domains: the names of the
// multi-node domain pools and devices the gang controller publishes, and the
// preparing of a claim allocated to a domain device on a node (its channel
// device node and the gang's environment, through CDI).
package domain

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// Domain kinds.
const (
	// KindNVLink is a multi-node NVLink clique (GB200 NVL72 and the like):
	// its channels are IMEX channels with a device node on every node.
	KindNVLink = "nvlink"
	// KindTopology is the set of nodes sharing a value of the controller's
	// topology label (a rack, a network block): env only, no device node.
	KindTopology = "topology"
)

// PoolPrefix starts the name of every domain pool; node pools are named after
// their node, which never contains a slash.
const PoolPrefix = "domains/"

// Attributes of a domain device (in the driver's domain).
const (
	AttrType    = "type" // "domain"
	AttrKind    = "domainKind"
	AttrDomain  = "domain"
	AttrChannel = "channel"
	AttrNodes   = "nodes"
	AttrGPUs    = "gpus"
	// TypeDomain is the value of AttrType.
	TypeDomain = "domain"
)

// PoolName names the pool of a domain: "domains/<kind>/<value>", the value
// made a DNS subdomain (lower case; a value that cannot be, or that had to be
// changed, gets a hash suffix so two values never share a pool).
func PoolName(kind, value string) string {
	return PoolPrefix + kind + "/" + poolSegment(value)
}

func poolSegment(value string) string {
	s := strings.ToLower(strings.ReplaceAll(value, "_", "-"))
	if s == value && len(validation.IsDNS1123Subdomain(s)) == 0 && len(s) <= 200 {
		return s
	}
	sum := sha256.Sum256([]byte(value))
	h := hex.EncodeToString(sum[:4])
	if len(validation.IsDNS1123Subdomain(s+"-"+h)) == 0 && len(s) <= 200 {
		return s + "-" + h
	}
	return "h-" + h
}

// ParsePool splits a domain pool name into kind and (encoded) value; ok is
// false for any other pool.
func ParsePool(pool string) (kind, value string, ok bool) {
	rest, found := strings.CutPrefix(pool, PoolPrefix)
	if !found {
		return "", "", false
	}
	kind, value, found = strings.Cut(rest, "/")
	if !found || (kind != KindNVLink && kind != KindTopology) || value == "" {
		return "", "", false
	}
	return kind, value, true
}

// DeviceName names channel n of a domain: "channel-<n>".
func DeviceName(channel int) string { return "channel-" + strconv.Itoa(channel) }

// ParseDevice returns the channel number of a domain device name.
func ParseDevice(name string) (int, error) {
	n, err := strconv.Atoi(strings.TrimPrefix(name, "channel-"))
	if err != nil || !strings.HasPrefix(name, "channel-") || n < 0 {
		return 0, fmt.Errorf("domain device %q: want channel-<n>", name)
	}
	return n, nil
}
