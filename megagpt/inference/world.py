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
    # torch's extension builder warns at import that no CUDA toolkit is found, on a CPU
    for name in ("megatron", "megatron.core", "megatron.training", "torch.utils.cpp_extension"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_tool(build_parser, run, argv=None) -> int:
    """A tool's ``main``: megatron kept quiet, the tool's options parsed (megatron flags after
    them are handed to ``run`` as overrides), a ``UserError`` printed as one ``error:`` line
    with exit status 2."""
    import sys

    from megagpt.errors import UserError

    from megagpt.command_line import option_errors

    quiet_megatron()
    parser = build_parser()
    option_errors.raise_one_line(parser, list(sys.argv[1:] if argv is None else argv), None, [])
    try:
        opts, overrides = parser.parse_known_args(argv)
        unknown_overrides(overrides, parser)
        return run(opts, overrides)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def unknown_overrides(overrides: list[str], parser) -> None:
    """An option neither the tool nor megatron knows, as one line with the closest ones."""
    from megagpt.command_line import option_errors
    from megagpt.inference import model_flags

    unknown = model_flags.unknown_flags(overrides)
    if unknown:
        known = [*parser._option_string_actions, *model_flags.known_flags()]
        raise option_errors.OptionError("; ".join(option_errors.unknown_option_message(
            flag, known, {}, program=parser.prog) for flag in unknown))


@contextlib.contextmanager
def megatron_world(args, seed: int = 1234):
    """Yield this rank's device with megatron's parallel state set up for ``args``' layout
    (in the caller's process group when one is running, else in one started here)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    started_here = not dist.is_initialized()  # else the caller's group (kept on exit)
    if args.cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if started_here:
        # one process needs no rendezvous: an in-memory store, no port (none to collide with
        # a launcher's or a test's); under torchrun its environment
        one = int(os.environ.get("WORLD_SIZE", "1")) == 1
        group = dict(store=dist.HashStore(), rank=0, world_size=1) if one else {}
        if args.cpu:
            dist.init_process_group("gloo", **group)
        else:
            dist.init_process_group("nccl", device_id=device, **group)
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
        if started_here:
            dist.destroy_process_group()
