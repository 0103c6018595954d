package gpumodel

import "github.com/NVIDIA/go-nvml/pkg/nvml"

// Sources. Every table below cites the documents its numbers come from;
// testdata/<key>.lgip holds the MIG facts as the source prints them
// (nvidia-smi mig -lgip and -lgipp), and TestTablesMatchTheirSources checks
// each table against it.
const (
	srcMIGProfiles = "NVIDIA Multi-Instance GPU User Guide, Supported MIG Profiles: https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html"
	srcMIGGetting  = "NVIDIA Multi-Instance GPU User Guide, Getting Started with MIG (nvidia-smi mig -lgip / -lgipp examples): https://docs.nvidia.com/datacenter/tesla/mig-user-guide/getting-started-with-mig.html"
	srcDGXA100     = "NVIDIA DGX A100 User Guide (GPU PCI bus IDs 07, 0f, 47, 4e, 87, 90, b7, bd): https://docs.nvidia.com/dgx/dgxa100-user-guide/"
	srcDGXH100     = "NVIDIA DGX H100/H200 User Guide: https://docs.nvidia.com/dgx/dgxh100-user-guide/"
	srcDGXB200     = "NVIDIA DGX B200 User Guide: https://docs.nvidia.com/dgx/dgxb200-user-guide/"
	srcGB200       = "GB200 nvidia-smi mig -lgip on production boards (NVIDIA/mig-parted issue 227, fixed in PR 228); 189471 MiB and 1200 W in published nvidia-smi outputs (facebookexperimental/triton PR 2023); MIG user guide for the 93/186 GB profile names"
	srcL4          = "NVIDIA L4 Tensor Core GPU product brief (72 W, 24 GB; no MIG): https://www.nvidia.com/en-us/data-center/l4/"
	srcH100Lgip    = "H100 80GB HBM3 nvidia-smi mig -lgip (https://jbarrow.ai/field_notes/nvidia-mig/), 81559 MiB on driver 550.54.15 (NVIDIA/nccl issue 1264), power 200/700/700 W (stackhpc/ansible-slurm-appliance issue 975)"
	srcH200Lgip    = "H200 nvidia-smi mig -lgip (NVIDIA/mig-parted issue 120, 2024-09-04); 143771 MiB and 700 W in published nvidia-smi outputs; device 10de:2335 (NVIDIA/mig-parted issue 120)"
	srcB200Lgip    = "B200 nvidia-smi mig -lgip (NVIDIA/mig-parted PR 187 and NVIDIA/gpu-operator PR 1351, March 2025); 183359 MiB and 1000 W (NVIDIA/TensorRT-LLM issue 10278, driver 580.95.05)"
)

// Library directories of the user-space driver.
const (
	LibDirX86   = "usr/lib/x86_64-linux-gnu"
	LibDirARM64 = "usr/lib/aarch64-linux-gnu"
)

// eightSlices lays a Hopper/Blackwell/A100-style 8-memory-slice MIG table out:
// the seven usual profiles with their documented placements
// (nvidia-smi mig -lgipp: 1g at {0..6}:1, 1g "double memory" at {0,2,4,6}:2,
// 2g at {0,2,4}:2, 3g at {0,4}:4, 4g at {0}:4, 7g at {0}:8).
func eightSlices(reset bool, ps [7]Profile) *MIG {
	shape := [7]struct {
		index, id, instances, slices int
		starts                       []int
		size                         int
	}{
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 19, 7, 1, []int{0, 1, 2, 3, 4, 5, 6}, 1},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, 1, 1, []int{0, 1, 2, 3, 4, 5, 6}, 1},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, 4, 1, []int{0, 2, 4, 6}, 2},
		{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 14, 3, 2, []int{0, 2, 4}, 2},
		{nvml.GPU_INSTANCE_PROFILE_3_SLICE, 9, 2, 3, []int{0, 4}, 4},
		{nvml.GPU_INSTANCE_PROFILE_4_SLICE, 5, 1, 4, []int{0}, 4},
		{nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0, 1, 7, []int{0}, 8},
	}
	m := &MIG{MemorySlices: 8, ResetToSwitch: reset}
	for i, s := range shape {
		p := ps[i]
		p.Index, p.ID, p.Instances, p.Slices, p.Starts, p.Size = s.index, s.id, s.instances, s.slices, s.starts, s.size
		m.Profiles = append(m.Profiles, p)
	}
	return m
}

// prof is one profile's name, memory and engines, in nvidia-smi mig -lgip's
// column order: SM, DEC, ENC, CE, JPEG, OFA.
func prof(name string, memMiB uint64, sm, dec, enc, ce, jpeg, ofa int) Profile {
	return Profile{Name: name, MemoryMiB: memMiB, SMs: sm, Decoders: dec, Encoders: enc, CopyEngines: ce, JPEGs: jpeg, OFAs: ofa}
}

var (
	A100SXM40GB = register(Model{
		Key: "a100-sxm4-40gb", Product: "NVIDIA A100-SXM4-40GB", Architecture: nvml.DEVICE_ARCH_AMPERE, Brand: nvml.BRAND_NVIDIA,
		MemoryMiB: 40960, CUDAMajor: 8, CUDAMinor: 0, PCIDeviceID: 0x20B010DE,
		PowerMinW: 100, PowerMaxW: 400, PowerDefaultW: 400, LibDir: LibDirX86,
		MIG: eightSlices(true, [7]Profile{
			prof("1g.5gb", 4864, 14, 0, 0, 1, 0, 0),
			prof("1g.5gb+me", 4864, 14, 1, 0, 1, 1, 1),
			prof("1g.10gb", 9856, 14, 1, 0, 1, 0, 0),
			prof("2g.10gb", 9856, 28, 1, 0, 2, 0, 0),
			prof("3g.20gb", 19968, 42, 2, 0, 3, 0, 0),
			prof("4g.20gb", 19968, 56, 2, 0, 4, 0, 0),
			prof("7g.40gb", 40192, 98, 5, 0, 7, 1, 1),
		}),
		Sources: []string{srcMIGProfiles, srcMIGGetting, srcDGXA100},
	})
	A100SXM80GB = register(Model{
		Key: "a100-sxm4-80gb", Product: "NVIDIA A100-SXM4-80GB", Architecture: nvml.DEVICE_ARCH_AMPERE, Brand: nvml.BRAND_NVIDIA,
		MemoryMiB: 81920, CUDAMajor: 8, CUDAMinor: 0, PCIDeviceID: 0x20B210DE,
		PowerMinW: 100, PowerMaxW: 400, PowerDefaultW: 400, LibDir: LibDirX86,
		MIG: eightSlices(true, [7]Profile{
			prof("1g.10gb", 9984, 14, 0, 0, 1, 0, 0),
			prof("1g.10gb+me", 9984, 14, 1, 0, 1, 1, 1),
			prof("1g.20gb", 20096, 14, 1, 0, 1, 0, 0),
			prof("2g.20gb", 20096, 28, 1, 0, 2, 0, 0),
			prof("3g.40gb", 40448, 42, 2, 0, 3, 0, 0),
			prof("4g.40gb", 40448, 56, 2, 0, 4, 0, 0),
			prof("7g.80gb", 81152, 98, 5, 0, 7, 1, 1),
		}),
		Sources: []string{srcMIGProfiles, srcMIGGetting},
	})
	H100SXM80GB = register(Model{
		Key: "h100-sxm5-80gb", Product: "NVIDIA H100 80GB HBM3", Architecture: nvml.DEVICE_ARCH_HOPPER, Brand: nvml.BRAND_NVIDIA,
		MemoryMiB: 81559, CUDAMajor: 9, CUDAMinor: 0, PCIDeviceID: 0x233010DE,
		PowerMinW: 200, PowerMaxW: 700, PowerDefaultW: 700, LibDir: LibDirX86,
		MIG: eightSlices(false, [7]Profile{
			prof("1g.10gb", 9984, 16, 1, 0, 1, 1, 0),
			prof("1g.10gb+me", 9984, 16, 1, 0, 1, 1, 1),
			prof("1g.20gb", 20096, 26, 1, 0, 1, 1, 0),
			prof("2g.20gb", 20096, 32, 2, 0, 2, 2, 0),
			prof("3g.40gb", 40448, 60, 3, 0, 3, 3, 0),
			prof("4g.40gb", 40448, 64, 4, 0, 4, 4, 0),
			prof("7g.80gb", 81152, 132, 7, 0, 8, 7, 1),
		}),
		Sources: []string{srcMIGProfiles, srcMIGGetting, srcH100Lgip, srcDGXH100},
	})
	H200SXM141GB = register(Model{
		Key: "h200-sxm5-141gb", Product: "NVIDIA H200", Architecture: nvml.DEVICE_ARCH_HOPPER, Brand: nvml.BRAND_NVIDIA,
		MemoryMiB: 143771, CUDAMajor: 9, CUDAMinor: 0, PCIDeviceID: 0x233510DE,
		PowerMinW: 200, PowerMaxW: 700, PowerDefaultW: 700, LibDir: LibDirX86,
		MIG: eightSlices(false, [7]Profile{
			prof("1g.18gb", 16384, 16, 1, 0, 1, 1, 0),
			prof("1g.18gb+me", 16384, 16, 1, 0, 1, 1, 1),
			prof("1g.35gb", 33024, 26, 1, 0, 1, 1, 0),
			prof("2g.35gb", 33024, 32, 2, 0, 2, 2, 0),
			prof("3g.71gb", 71168, 60, 3, 0, 3, 3, 0),
			prof("4g.71gb", 71168, 64, 4, 0, 4, 4, 0),
			prof("7g.141gb", 143104, 132, 7, 0, 8, 7, 1),
		}),
		Sources: []string{srcMIGProfiles, srcH200Lgip},
	})
	B200 = register(Model{
		Key: "b200-sxm-180gb", Product: "NVIDIA B200", Architecture: nvml.DEVICE_ARCH_BLACKWELL, Brand: nvml.BRAND_NVIDIA,
		MemoryMiB: 183359, CUDAMajor: 10, CUDAMinor: 0, PCIDeviceID: 0x290110DE,
		PowerMinW: 200, PowerMaxW: 1000, PowerDefaultW: 1000, LibDir: LibDirX86,
		MIG: eightSlices(false, [7]Profile{
			prof("1g.23gb", 20992, 18, 1, 0, 2, 1, 0),
			prof("1g.23gb+me", 20992, 18, 1, 0, 2, 1, 1),
			prof("1g.45gb", 45312, 30, 1, 0, 2, 1, 0),
			prof("2g.45gb", 45312, 36, 2, 0, 4, 2, 0),
			// 3g, 4g and 7g: copy engines and OFA from the MIG user guide's
			// B200 table; memory, SMs, decoders and JPEG inferred (Hopper's
			// pattern on B200's 148 SMs), no published -lgip row found.
			prof("3g.90gb", 90624, 60, 3, 0, 6, 3, 0),
			prof("4g.90gb", 90624, 72, 4, 0, 8, 4, 0),
			prof("7g.180gb", 181248, 148, 7, 0, 16, 7, 1),
		}),
		Sources: []string{srcMIGProfiles, srcB200Lgip, srcDGXB200},
	})
	GB200 = register(Model{
		Key: "gb200", Product: "NVIDIA GB200", Architecture: nvml.DEVICE_ARCH_BLACKWELL, Brand: nvml.BRAND_NVIDIA,
		MemoryMiB: 189471, CUDAMajor: 10, CUDAMinor: 0, PCIDeviceID: 0x294110DE,
		PowerMinW: 200, PowerMaxW: 1200, PowerDefaultW: 1200, LibDir: LibDirARM64,
		MIG: eightSlices(false, [7]Profile{
			prof("1g.23gb", 22528, 18, 1, 0, 2, 1, 0),
			prof("1g.23gb+me", 22528, 18, 1, 0, 2, 1, 1),
			prof("1g.47gb", 46592, 32, 1, 0, 2, 1, 0),
			prof("2g.47gb", 46592, 38, 2, 0, 4, 2, 0),
			// 3g, 4g and 7g inferred from B200's pattern: no published -lgip
			// row found for them.
			prof("3g.93gb", 93184, 60, 3, 0, 6, 3, 0),
			prof("4g.93gb", 93184, 72, 4, 0, 8, 4, 0),
			prof("7g.186gb", 186368, 152, 7, 0, 16, 7, 1),
		}),
		Sources: []string{srcGB200},
	})
	L4 = register(Model{
		Key: "l4", Product: "NVIDIA L4", Architecture: nvml.DEVICE_ARCH_ADA, Brand: nvml.BRAND_NVIDIA,
		MemoryMiB: 23034, CUDAMajor: 8, CUDAMinor: 9, PCIDeviceID: 0x27B810DE,
		PowerMinW: 40, PowerMaxW: 72, PowerDefaultW: 72, LibDir: LibDirX86,
		Sources: []string{srcL4},
	})
)
