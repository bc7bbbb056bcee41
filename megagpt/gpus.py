"""GPUs known by name: memory, compute arch, and the figures the step-time model needs.

``--gpu-type`` (the entry's option) takes these names; the preflight plans for the chosen GPU.
Performance figures are the vendor's datasheet numbers (dense, i.e. without 2:4 sparsity);
the bandwidths are per GPU and per direction, as NCCL's bus bandwidth counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megagpt.errors import UserError


@dataclass(frozen=True)
class GpuSpec:
    """What one GPU of a known part can do, and where each figure comes from."""

    dense_16bit_tflops: float  # bf16/fp16 tensor cores, dense
    fp8_tflops: float | None  # dense; None where the part has no FP8 tensor cores
    hbm_gb_s: float  # memory bandwidth
    nvlink_gb_s: float  # NVLink, per direction (half the datasheet's bidirectional figure)
    network_gb_s: float  # line rate of the GPU's own inter-node NIC, per direction
    gemm_efficiency: float  # share of the dense peak a large 16-bit GEMM sustains
    sources: str
    gpus_per_node: int = 8  # DGX / HGX boards

    def tensor_tflops(self, fp8: bool) -> float:
        return self.fp8_tflops if fp8 and self.fp8_tflops else self.dense_16bit_tflops


# Sustained large-GEMM rates, as a share of the dense peak. A100: cuBLAS holds 250-280 of
# 312 TFLOP/s on large 16-bit products; 0.8 for training shapes. Hopper: the datasheet's 989
# TFLOP/s assume the 1.83 GHz boost clock (132 SMs x 4 tensor cores x 1024 FLOP per clock),
# which power limits pull down under dense tensor-core load (the clock HPL peaks are quoted
# at); 0.65 (~640 TFLOP/s) sits at the low end of what cuBLAS reaches on H100 training shapes,
# and is the one constant the H100 and H200 validation rows pin (bench/notes/cost-model.md).
AMPERE_GEMM_EFFICIENCY = 0.8
HOPPER_GEMM_EFFICIENCY = 0.65

# The network: DGX nodes give every GPU its own compute NIC on the PCIe switch it shares with
# it (GPUDirect RDMA), so the 8 GPUs of a node send and receive side by side, each at its NIC's
# line rate, whatever the layout. DGX A100 (Selene, the Narayanan et al. 2021 runs): 8
# single-port ConnectX-6 HDR InfiniBand, 200 Gb/s = 25 GB/s each, 1,600 Gb/s per node (DGX A100
# User Guide, "Network Connections"; the two further ports are for storage). DGX H100 and DGX
# H200: 8 ConnectX-7 NDR, 400 Gb/s = 50 GB/s each, 3,200 Gb/s per node (DGX H100/H200 User
# Guide); HGX H200 servers built to NVIDIA's reference design carry the same 8 × 400 Gb/s.
A100_NIC_GB_S = 200 / 8
HOPPER_NIC_GB_S = 400 / 8

_A100_SOURCES = ("NVIDIA A100 datasheet (312 TFLOP/s dense bf16/fp16; HBM2e 1,555 GB/s at 40 GB, "
                 "2,039 GB/s at 80 GB; NVLink 3 600 GB/s bidirectional); DGX A100 / Selene: 8 "
                 "compute NICs, one 200 Gb/s HDR InfiniBand port per GPU")
_H100_SOURCES = ("NVIDIA H100 datasheet, SXM5 (989 TFLOP/s dense bf16, 1,979 FP8; HBM3 3.35 TB/s; "
                 "NVLink 4 900 GB/s bidirectional); DGX H100: 8 compute NICs, one 400 Gb/s NDR "
                 "port per GPU")
_H200_SOURCES = ("NVIDIA H200 datasheet, SXM (989 TFLOP/s dense bf16, 1,979 FP8; HBM3e 4.8 TB/s; "
                 "NVLink 4 900 GB/s bidirectional); DGX H200 / HGX H200: 8 compute NICs, one "
                 "400 Gb/s NDR port per GPU")


@dataclass(frozen=True)
class KnownGpu:
    memory_gib: float  # nvidia-smi "Total" memory, MiB / 1024
    arch: int  # compute-capability major: megatron's get_device_arch_version()
    spec: GpuSpec


KNOWN_GPUS = {
    "A100-40GB": KnownGpu(40960 / 1024, 8, GpuSpec(312, None, 1555, 300, A100_NIC_GB_S,
                                                   AMPERE_GEMM_EFFICIENCY, _A100_SOURCES)),
    "A100-80GB": KnownGpu(81920 / 1024, 8, GpuSpec(312, None, 2039, 300, A100_NIC_GB_S,
                                                   AMPERE_GEMM_EFFICIENCY, _A100_SOURCES)),
    "H100-SXM": KnownGpu(81559 / 1024, 9, GpuSpec(989, 1979, 3350, 450, HOPPER_NIC_GB_S,
                                                  HOPPER_GEMM_EFFICIENCY, _H100_SOURCES)),
    "H200": KnownGpu(143771 / 1024, 9, GpuSpec(989, 1979, 4800, 450, HOPPER_NIC_GB_S,
                                               HOPPER_GEMM_EFFICIENCY, _H200_SOURCES)),
}
ALIASES = {"H100": "H100-SXM"}  # the name this option took before H100 PCIe/NVL were told apart
DEFAULT_GPU = "A100-80GB"


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # total device memory, nvidia-smi's MiB / 1024
    arch: int  # compute-capability major: megatron's get_device_arch_version()
    source: str  # how it was chosen, for the report
    spec: GpuSpec | None = None  # None: no performance figures (a CPU, an unknown part)


def gpu_type_names() -> list[str]:
    return sorted(KNOWN_GPUS) + sorted(ALIASES)


def fp8_gpu_names() -> str:
    """The known GPUs with FP8 tensor cores, for a message: "H100-SXM and H200"."""
    names = [name for name, gpu in sorted(KNOWN_GPUS.items()) if gpu.spec.fp8_tflops]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]


def known_gpu(name: str, source: str) -> Gpu:
    """The named part; UserError naming the known ones for any other name."""
    canonical = ALIASES.get(name, name)
    if canonical not in KNOWN_GPUS:
        raise UserError(f"--gpu-type {name}: unknown GPU; known: {', '.join(gpu_type_names())}")
    known = KNOWN_GPUS[canonical]
    return Gpu(canonical, known.memory_gib, known.arch, source, known.spec)


def resolve_gpu(gpu_type: str | None, memory_gib: float | None, cpu: bool = False) -> Gpu:
    """The GPU to plan for: --gpu-type, else this machine's GPU, else the default A100-80GB.

    --gpu-memory-gb overrides the memory of whichever GPU was chosen. With --cpu the "GPU"
    is this machine's CPU and its memory.
    """
    if cpu:
        import psutil

        gpu = Gpu("CPU", psutil.virtual_memory().total / 2**30, 0, "--cpu: this machine's memory")
    elif gpu_type is not None:
        gpu = known_gpu(gpu_type, "--gpu-type")
    else:
        gpu = _local_gpu() or known_gpu(DEFAULT_GPU, "assumed: no GPU here; set --gpu-type")
    if memory_gib is not None:
        gpu = Gpu(gpu.name, float(memory_gib), gpu.arch, gpu.source + ", --gpu-memory-gb",
                  gpu.spec)
    return gpu


def _local_gpu() -> Gpu | None:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return Gpu(props.name, props.total_memory / 2**30, props.major, "this machine's GPU 0",
               _spec_by_device_name(props.name, props.total_memory / 2**30))


def _spec_by_device_name(device_name: str, memory_gib: float) -> GpuSpec | None:
    """The figures of a known part from CUDA's device name (e.g. 'NVIDIA H100 80GB HBM3')."""
    name = device_name.upper()
    if "H200" in name:
        return KNOWN_GPUS["H200"].spec
    if "H100" in name and "PCIE" not in name and "NVL" not in name:
        return KNOWN_GPUS["H100-SXM"].spec
    if "A100" in name and "PCIE" not in name:
        return KNOWN_GPUS["A100-80GB" if memory_gib > 60 else "A100-40GB"].spec
    return None
