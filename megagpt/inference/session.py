"""This process as a megatron world: a process group, megatron's parallel state, the device.

``python tools/generate.py`` is one process on one device (gloo on the CPU, NCCL on a GPU);
under ``torchrun`` the same code runs one rank of a TP x PP layout (the parsed arguments
carry the sizes). On the CPU megatron's CUDA calls go through ``cpu_mode.generating``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch

from megagpt import cpu_mode
from megagpt.rendezvous import default_single_process_env


def quiet_megatron() -> None:
    """Keep megatron's per-module notices (deprecations, missing TE/apex, INFO logs) off the
    console of a tool whose output is its results."""
    from megagpt.compat import quiet_fallback_warnings

    quiet_fallback_warnings()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*(deprecated|DEPRECATED).*")
    for module in (r"megatron\..*", r"torch\.distributed\.checkpoint\..*"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
    for name in ("megatron", "megatron.core", "megatron.training"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def megatron_world(args, seed: int = 1234):
    """Yield this rank's device with megatron's parallel state set up for ``args``' layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    default_single_process_env()
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    device_context = cpu_mode.generating() if args.cpu else contextlib.nullcontext()
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size)
        with device_context:
            model_parallel_cuda_manual_seed(seed)
            yield device
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
