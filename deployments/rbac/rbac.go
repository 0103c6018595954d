// Package rbac embeds the components' RBAC manifests, so that tests install
// exactly what operators install.
package rbac

import _ "embed"

// KubeletPlugin is the kubelet plugin's namespace, service account and role.
//
//go:embed kubelet-plugin.yaml
var KubeletPlugin []byte

// NodeLock is the ValidatingAdmissionPolicy that confines the kubelet
// plugin's ResourceSlice writes to its own node.
//
//go:embed node-lock.yaml
var NodeLock []byte

// MPSLock is the ValidatingAdmissionPolicy that lets the kubelet plugin's
// pod rights run nothing but its node's MPS control daemons (driver/mps),
// with the chart's default image, data directory and driver root.
//
//go:embed mps-lock.yaml
var MPSLock []byte

// IMEXLock is the ValidatingAdmissionPolicy that lets the kubelet plugin's
// pod rights run, besides MPS daemons, nothing but its node's IMEX daemons
// (driver/imex), with the chart's default image, data directory, driver
// root and port.
//
//go:embed imex-lock.yaml
var IMEXLock []byte

// Namespace and ServiceAccount the kubelet plugin runs as.
const (
	Namespace            = "tessera-system"
	KubeletPluginAccount = "tessera-kubelet-plugin"
)

// Controller is tessera-controller's service account and roles, and the
// ValidatingAdmissionPolicies that narrow its writes (apply after
// KubeletPlugin, which creates the namespace).
//
//go:embed controller.yaml
var Controller []byte

// ControllerAccount is the service account tessera-controller runs as.
const ControllerAccount = "tessera-controller"
