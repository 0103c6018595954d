// Package discovery reads a node's GPUs through NVML and the host's sysfs into
// Tessera's device model: one GPU value per physical GPU with everything the
// slices, prepare and health code need, in NVML index order.
package discovery

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/uuid"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/driver/gpulib"
	"github.com/tessera-dev/tessera/driver/mig"
)

// GPU is one physical GPU as Tessera models it.
type GPU struct {
	Index int
	Minor int
	UUID  string

	ProductName  string
	Brand        string
	Architecture string
	// CUDAComputeCapability and CUDADriverVersion are semantic versions
	// (x.y.z) so CEL can compare them.
	CUDAComputeCapability string
	CUDADriverVersion     string
	// DriverVersion is the version exactly as the driver reports it
	// (570.124.06): the driver's files are named by it. The driverVersion
	// attribute is its semantic form (SemanticVersion).
	DriverVersion string

	MemoryBytes int64

	PCIBusID string // extended BDF, lower case: 0000:18:00.0
	PCIeRoot string // e.g. pci0000:15; empty when sysfs could not tell
	NUMANode *int   // nil when the GPU has no NUMA affinity

	MIGCapable bool
	MIGEnabled bool
	// MIGSwitchable GPUs (Hopper and newer) change MIG mode without a reset.
	MIGSwitchable bool
	// MIG holds the profiles, placements and existing instances of a
	// MIG-capable GPU; nil otherwise.
	MIG *mig.Info

	// NVLinkDomain is shared by GPUs joined by NVLink inside this node; a GPU
	// without NVLink peers has one of its own.
	NVLinkDomain string
	// NVLinkClique is "<clusterUUID>.<cliqueID>" for GPUs in a multi-node
	// NVLink fabric (GB200 NVL72); empty otherwise.
	NVLinkClique string

	// Power limits in watts as the board reports them; zero when unknown.
	PowerMinWatts, PowerMaxWatts, PowerDefaultWatts int64

	// Lost says why NVML could not read the GPU at discovery; the other
	// fields are then its last-known description (lastknown.go). Empty for a
	// GPU read just now.
	Lost string `json:",omitempty"`
}

// Name is the GPU's device name in ResourceSlices and the checkpoint.
func (g GPU) Name() string { return "gpu-" + strconv.Itoa(g.Index) }

// Options tune discovery.
type Options struct {
	// LastKnownPath is a file that keeps each GPU's description from its last
	// successful discovery (contract in lastknown.go). A GPU NVML reports
	// lost is then returned from it, with Lost set, rather than left out.
	// Empty means no such file: a lost GPU is left out. Its directory must
	// exist.
	LastKnownPath string
}

// Discover returns the node's GPUs sorted by index, leaving out a GPU NVML
// reports lost.
func Discover(ctx context.Context, node *gpulib.Node) ([]GPU, error) {
	return DiscoverWith(ctx, node, Options{})
}

// DiscoverWith returns the node's GPUs sorted by index; a lost GPU is
// described from opts.LastKnownPath when the file knows it.
func DiscoverWith(ctx context.Context, node *gpulib.Node, opts Options) ([]GPU, error) {
	logger := klog.FromContext(ctx)
	lib := node.NVML
	driver, ret := lib.SystemGetDriverVersion()
	if err := gpulib.Error(ret); err != nil {
		return nil, fmt.Errorf("read driver version: %w", err)
	}
	cudaInt, ret := lib.SystemGetCudaDriverVersion()
	if err := gpulib.Error(ret); err != nil {
		return nil, fmt.Errorf("read CUDA driver version: %w", err)
	}
	count, ret := lib.DeviceGetCount()
	if err := gpulib.Error(ret); err != nil {
		return nil, fmt.Errorf("count GPUs: %w", err)
	}
	driverVersion := strings.TrimSpace(driver)
	cudaVersion := fmt.Sprintf("%d.%d.0", cudaInt/1000, (cudaInt%1000)/10)
	handles := make([]nvml.Device, 0, count)
	gpus := make([]GPU, 0, count)
	var lost []lostGPU
	for i := 0; i < count; i++ {
		d, ret := lib.DeviceGetHandleByIndex(i)
		if err := gpulib.Error(ret); err != nil {
			if gpulib.IsGPULost(err) {
				lost = append(lost, lostGPU{index: i, err: err})
				continue
			}
			return nil, fmt.Errorf("GPU %d: get handle: %w", i, err)
		}
		g, err := readGPU(logger, node, d, i)
		if err != nil {
			if gpulib.IsGPULost(err) {
				lost = append(lost, lostGPU{index: i, handle: d, err: err})
				continue
			}
			return nil, fmt.Errorf("GPU %d: %w", i, err)
		}
		g.DriverVersion, g.CUDADriverVersion = driverVersion, cudaVersion
		handles = append(handles, d)
		gpus = append(gpus, g)
	}
	if err := assignNVLinkDomains(gpus, handles); err != nil {
		return nil, err
	}
	gpus = append(gpus, describeLost(logger, opts.LastKnownPath, count, gpus, lost, driverVersion, cudaVersion)...)
	sort.Slice(gpus, func(a, b int) bool { return gpus[a].Index < gpus[b].Index })
	return gpus, nil
}

func readGPU(logger klog.Logger, node *gpulib.Node, d nvml.Device, i int) (GPU, error) {
	g := GPU{Index: i}
	var ret nvml.Return
	if g.UUID, ret = d.GetUUID(); ret != nvml.SUCCESS {
		return g, fmt.Errorf("read UUID: %w", gpulib.Error(ret))
	}
	if idx, ret := d.GetIndex(); ret == nvml.SUCCESS {
		g.Index = idx
	}
	if g.Minor, ret = d.GetMinorNumber(); ret != nvml.SUCCESS {
		return g, fmt.Errorf("read minor number: %w", gpulib.Error(ret))
	}
	if g.ProductName, ret = d.GetName(); ret != nvml.SUCCESS {
		return g, fmt.Errorf("read product name: %w", gpulib.Error(ret))
	}
	if b, ret := d.GetBrand(); ret == nvml.SUCCESS {
		g.Brand = brandName(b)
	}
	if a, ret := d.GetArchitecture(); ret == nvml.SUCCESS {
		g.Architecture = archName(a)
	}
	major, minor, ret := d.GetCudaComputeCapability()
	if ret != nvml.SUCCESS {
		return g, fmt.Errorf("read compute capability: %w", gpulib.Error(ret))
	}
	g.CUDAComputeCapability = fmt.Sprintf("%d.%d.0", major, minor)
	mem, ret := d.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return g, fmt.Errorf("read memory size: %w", gpulib.Error(ret))
	}
	g.MemoryBytes = int64(mem.Total)
	pci, ret := d.GetPciInfo()
	if ret != nvml.SUCCESS {
		return g, fmt.Errorf("read PCI info: %w", gpulib.Error(ret))
	}
	g.PCIBusID = normalizeBusID(pci)
	if g.PCIBusID == "" {
		return g, errors.New("NVML reported no PCI bus ID")
	}
	if attr, err := deviceattribute.GetPCIeRootAttributeByPCIBusID(g.PCIBusID, deviceattribute.WithFSFromRoot(node.SysfsRoot())); err == nil && attr.Value.StringValue != nil {
		g.PCIeRoot = *attr.Value.StringValue
	} else {
		logger.Info("Cannot tell the GPU's PCIe root; publishing it without one", "gpu", g.UUID, "pciBusID", g.PCIBusID, "err", err)
	}
	g.NUMANode = numaNode(node, d, g.PCIBusID)
	switch cur, _, ret := d.GetMigMode(); ret {
	case nvml.SUCCESS:
		g.MIGCapable = true
		g.MIGEnabled = cur == nvml.DEVICE_MIG_ENABLE
		if a, ret := d.GetArchitecture(); ret == nvml.SUCCESS {
			g.MIGSwitchable = a >= nvml.DEVICE_ARCH_HOPPER
		}
		info, err := mig.Read(d)
		if err != nil {
			return g, err
		}
		g.MIG = info
	case nvml.ERROR_NOT_SUPPORTED:
	default:
		return g, fmt.Errorf("read MIG mode: %w", gpulib.Error(ret))
	}
	if fi, ret := d.GetGpuFabricInfo(); ret == nvml.SUCCESS && fi.State == nvml.GPU_FABRIC_STATE_COMPLETED && nvml.Return(fi.Status) == nvml.SUCCESS {
		var zero [16]uint8
		if fi.ClusterUuid != zero {
			g.NVLinkClique = fmt.Sprintf("%s.%d", uuid.UUID(fi.ClusterUuid).String(), fi.CliqueId)
		}
	}
	if lo, hi, ret := d.GetPowerManagementLimitConstraints(); ret == nvml.SUCCESS {
		g.PowerMinWatts, g.PowerMaxWatts = int64(lo/1000), int64(hi/1000)
	}
	if def, ret := d.GetPowerManagementDefaultLimit(); ret == nvml.SUCCESS {
		g.PowerDefaultWatts = int64(def / 1000)
	}
	return g, nil
}

// normalizeBusID turns NVML's 8-digit-domain bus ID into sysfs's form.
func normalizeBusID(pci nvml.PciInfo) string {
	var b strings.Builder
	for _, c := range pci.BusId {
		if c == 0 {
			break
		}
		b.WriteByte(byte(c))
	}
	id := strings.ToLower(b.String())
	if len(id) > 12 {
		id = id[len(id)-12:]
	}
	return id
}

func numaNode(node *gpulib.Node, d nvml.Device, busID string) *int {
	if n, ret := d.GetNumaNodeId(); ret == nvml.SUCCESS && n >= 0 {
		return &n
	}
	data, err := os.ReadFile(filepath.Join(node.SysfsRoot(), "bus", "pci", "devices", busID, "numa_node"))
	if err != nil {
		return nil
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || n < 0 {
		return nil
	}
	return &n
}

// assignNVLinkDomains groups GPUs that NVML says are NVLink peers. Each group
// is named after its smallest GPU UUID: stable across restarts and reboots and
// unique across nodes.
func assignNVLinkDomains(gpus []GPU, handles []nvml.Device) error {
	parent := make([]int, len(gpus))
	for i := range parent {
		parent[i] = i
	}
	find := func(i int) int {
		for parent[i] != i {
			parent[i] = parent[parent[i]]
			i = parent[i]
		}
		return i
	}
	for i := range handles {
		for j := i + 1; j < len(handles); j++ {
			st, ret := handles[i].GetP2PStatus(handles[j], nvml.P2P_CAPS_INDEX_NVLINK)
			if ret == nvml.ERROR_NOT_SUPPORTED {
				continue
			}
			if ret != nvml.SUCCESS {
				return fmt.Errorf("GPU %d and %d: read NVLink P2P status: %w", i, j, gpulib.Error(ret))
			}
			if st == nvml.P2P_STATUS_OK {
				parent[find(i)] = find(j)
			}
		}
	}
	name := map[int]string{}
	for i, g := range gpus {
		r := find(i)
		if cur, ok := name[r]; !ok || g.UUID < cur {
			name[r] = g.UUID
		}
	}
	for i := range gpus {
		gpus[i].NVLinkDomain = name[find(i)]
	}
	return nil
}

// SemanticVersion turns NVIDIA's dotted versions (570.124.06) into semantic
// versions (570.124.6), as CEL compares them: leading zeros are not allowed
// there, and missing parts are 0. Only attributes take this form; files are
// named by the version as the driver reports it.
func SemanticVersion(v string) string {
	parts := strings.Split(strings.TrimSpace(v), ".")
	out := []string{"0", "0", "0"}
	for i := 0; i < len(parts) && i < 3; i++ {
		if n, err := strconv.Atoi(parts[i]); err == nil {
			out[i] = strconv.Itoa(n)
		}
	}
	return strings.Join(out, ".")
}

func brandName(b nvml.BrandType) string {
	switch b {
	case nvml.BRAND_QUADRO:
		return "Quadro"
	case nvml.BRAND_TESLA:
		return "Tesla"
	case nvml.BRAND_NVS:
		return "NVS"
	case nvml.BRAND_GRID:
		return "GRID"
	case nvml.BRAND_GEFORCE:
		return "GeForce"
	case nvml.BRAND_TITAN:
		return "Titan"
	case nvml.BRAND_NVIDIA_RTX:
		return "NvidiaRTX"
	case nvml.BRAND_NVIDIA:
		return "Nvidia"
	case nvml.BRAND_GEFORCE_RTX:
		return "GeForceRTX"
	case nvml.BRAND_QUADRO_RTX:
		return "QuadroRTX"
	}
	return "Unknown"
}

func archName(a nvml.DeviceArchitecture) string {
	switch a {
	case nvml.DEVICE_ARCH_KEPLER:
		return "Kepler"
	case nvml.DEVICE_ARCH_MAXWELL:
		return "Maxwell"
	case nvml.DEVICE_ARCH_PASCAL:
		return "Pascal"
	case nvml.DEVICE_ARCH_VOLTA:
		return "Volta"
	case nvml.DEVICE_ARCH_TURING:
		return "Turing"
	case nvml.DEVICE_ARCH_AMPERE:
		return "Ampere"
	case nvml.DEVICE_ARCH_ADA:
		return "Ada Lovelace"
	case nvml.DEVICE_ARCH_HOPPER:
		return "Hopper"
	case nvml.DEVICE_ARCH_BLACKWELL:
		return "Blackwell"
	}
	return "Unknown"
}
