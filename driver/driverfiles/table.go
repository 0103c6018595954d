package driverfiles

// What Find looks for, after the lists NVIDIA's container toolkit documents
// for its driver capabilities (utility, compute, video, graphics): the
// libraries by the name the driver installs them under,
// <name>.so.<driver version>, with the soname link programs open; the tools;
// the GSP firmware of the driver version; the daemons' IPC sockets.

// group is what a file serves; a claim's containers get the groups its
// devices call for (Need).
type group int

const (
	// utility: management (NVML, nvidia-smi); every container with a GPU.
	utility group = iota
	// compute: CUDA and OpenCL; every container with a GPU.
	compute
	// decode, encode, opticalFlow: the video libraries, where the devices
	// have the engine (NVDEC, NVENC, OFA).
	decode
	encode
	opticalFlow
	// graphics: OpenGL, EGL, Vulkan, only when a claim asks for it.
	graphics
	groups // how many
)

var groupNames = [groups]string{"utility", "compute", "video (decoders)", "video (encoders)", "video (optical flow)", "graphics"}

func (g group) String() string { return groupNames[g] }

// library is one user-space driver library.
type library struct {
	// name is the file name before the driver version: libcuda.so for
	// libcuda.so.<version>.
	name string
	// soname is what programs open (libcuda.so.1); empty when it is the
	// versioned name itself (libnvidia-gpucomp.so.<version>).
	soname string
	// devLink is created in the container when set: the unversioned name
	// (libcuda.so) build tools and some programs open.
	devLink bool
	group   group
	// required fails a prepare when missing: nothing CUDA does works
	// without it.
	required bool
}

var libraries = []library{
	{name: "libnvidia-ml.so", soname: "libnvidia-ml.so.1", devLink: true, group: utility, required: true},
	{name: "libnvidia-cfg.so", soname: "libnvidia-cfg.so.1", group: utility},

	{name: "libcuda.so", soname: "libcuda.so.1", devLink: true, group: compute, required: true},
	{name: "libcudadebugger.so", soname: "libcudadebugger.so.1", group: compute},
	{name: "libnvidia-ptxjitcompiler.so", soname: "libnvidia-ptxjitcompiler.so.1", group: compute},
	{name: "libnvidia-nvvm.so", soname: "libnvidia-nvvm.so.4", group: compute},
	{name: "libnvidia-gpucomp.so", group: compute},
	{name: "libnvidia-allocator.so", soname: "libnvidia-allocator.so.1", group: compute},
	{name: "libnvidia-opencl.so", soname: "libnvidia-opencl.so.1", group: compute},
	{name: "libnvidia-pkcs11.so", group: compute},
	{name: "libnvidia-pkcs11-openssl3.so", group: compute},

	{name: "libnvcuvid.so", soname: "libnvcuvid.so.1", devLink: true, group: decode},
	{name: "libnvidia-encode.so", soname: "libnvidia-encode.so.1", devLink: true, group: encode},
	{name: "libnvidia-opticalflow.so", soname: "libnvidia-opticalflow.so.1", devLink: true, group: opticalFlow},

	{name: "libnvidia-eglcore.so", group: graphics},
	{name: "libnvidia-glcore.so", group: graphics},
	{name: "libnvidia-tls.so", group: graphics},
	{name: "libnvidia-glsi.so", group: graphics},
	{name: "libnvidia-glvkspirv.so", group: graphics},
	{name: "libnvidia-rtcore.so", group: graphics},
	{name: "libnvidia-fbc.so", soname: "libnvidia-fbc.so.1", group: graphics},
	{name: "libnvoptix.so", soname: "libnvoptix.so.1", group: graphics},
	{name: "libGLX_nvidia.so", soname: "libGLX_nvidia.so.0", group: graphics},
	{name: "libEGL_nvidia.so", soname: "libEGL_nvidia.so.0", group: graphics},
	{name: "libGLESv2_nvidia.so", soname: "libGLESv2_nvidia.so.2", group: graphics},
	{name: "libGLESv1_CM_nvidia.so", soname: "libGLESv1_CM_nvidia.so.1", group: graphics},
}

// LibDirs are where distributions install the driver's libraries, relative
// to the driver root, in the order searched: Debian and Ubuntu multiarch
// (x86_64, then aarch64 as on Grace), then Red Hat and SUSE lib64, then the
// rest. The first directory holding a library is the one used.
var LibDirs = []string{
	"usr/lib/x86_64-linux-gnu",
	"usr/lib/aarch64-linux-gnu",
	"usr/lib64",
	"lib64",
	"lib/x86_64-linux-gnu",
	"lib/aarch64-linux-gnu",
	"usr/lib",
}

var binDirs = []string{"usr/bin", "bin", "usr/sbin", "sbin"}

// binary is a driver tool mounted at its path inside the driver root.
type binary struct {
	name  string
	group group
}

var binaries = []binary{
	{"nvidia-smi", utility},
	{"nvidia-debugdump", utility},
	{"nvidia-persistenced", utility},
	{"nvidia-cuda-mps-control", compute},
	{"nvidia-cuda-mps-server", compute},
}

// firmwareDirs hold one directory of GSP firmware per driver version.
var firmwareDirs = []string{"lib/firmware/nvidia", "usr/lib/firmware/nvidia"}

// socket is a daemon's IPC socket, found under any of its dirs.
type socket struct {
	dirs  []string
	name  string
	group group
}

var sockets = []socket{
	// nvidia-persistenced keeps the driver loaded; NVML asks it.
	{dirs: []string{"run/nvidia-persistenced", "var/run/nvidia-persistenced"}, name: "socket", group: utility},
	// The fabric manager of NVSwitch systems; NVML's fabric queries.
	{dirs: []string{"run/nvidia-fabricmanager", "var/run/nvidia-fabricmanager"}, name: "socket", group: utility},
}
