"""GPUs known by name: memory (GiB, as nvidia-smi reports it) and compute arch.

``--gpu-type`` (the entry's option) takes these names; the preflight plans for the chosen GPU.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # total device memory, nvidia-smi's MiB / 1024
    arch: int  # compute-capability major: megatron's get_device_arch_version()
    source: str  # how it was chosen, for the report


# nvidia-smi "Total" memory of each part, in MiB / 1024.
KNOWN_GPUS = {
    "A100-40GB": (40960 / 1024, 8),
    "A100-80GB": (81920 / 1024, 8),
    "H100": (81559 / 1024, 9),
    "H200": (143771 / 1024, 9),
}
DEFAULT_GPU = "A100-80GB"


def resolve_gpu(gpu_type: str | None, memory_gib: float | None, cpu: bool = False) -> Gpu:
    """The GPU to plan for: --gpu-type, else this machine's GPU, else the default A100-80GB.

    --gpu-memory-gb overrides the memory of whichever GPU was chosen. With --cpu the "GPU"
    is this machine's CPU and its memory.
    """
    if cpu:
        import psutil

        gpu = Gpu("CPU", psutil.virtual_memory().total / 2**30, 0, "--cpu: this machine's memory")
    elif gpu_type is not None:
        mem, arch = KNOWN_GPUS[gpu_type]
        gpu = Gpu(gpu_type, mem, arch, "--gpu-type")
    else:
        gpu = _local_gpu() or Gpu(DEFAULT_GPU, *KNOWN_GPUS[DEFAULT_GPU],
                                  "assumed: no GPU here; set --gpu-type")
    if memory_gib is not None:
        gpu = Gpu(gpu.name, float(memory_gib), gpu.arch, gpu.source + ", --gpu-memory-gb")
    return gpu


def _local_gpu() -> Gpu | None:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return Gpu(props.name, props.total_memory / 2**30, props.major, "this machine's GPU 0")
