"""Run every installer of the project in a fresh process and print, as JSON, which megatron
attributes each step changed (tests/test_megatron_ledger.py holds them against the ledger).

    python tests/megatron_changes_probe.py

Prints ``{"launch": [...], "pretrain": [...], "validation": [...], "preflight": [...],
"left": [...]}``: the dotted names changed by the fast path's launch-time installers and
compat, inside ``resilience.active`` + ``cpu_mode.active`` + ``diagnostics.active``, inside
the validation without a
GPU, inside the preflight's ``schedule_check.global_args``, and still
changed after the context managers exit (the launch-time changes only); and under
``"registered"`` the same steps' names that ``megagpt.megatron_wrappers`` holds installed.
"""

from __future__ import annotations

import importlib
import inspect
import json
from types import SimpleNamespace
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megagpt.compat import quiet_fallback_warnings  # noqa: E402

quiet_fallback_warnings()


def megatron_attributes() -> dict[str, object]:
    """Every attribute of every loaded megatron module, and of the classes defined there."""
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron") or not isinstance(module, types.ModuleType):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, types.ModuleType):
                continue  # a submodule imported meanwhile is not a change
            found[f"{name}.{attr}"] = value
            if inspect.isclass(value) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    found[f"{name}.{attr}.{cattr}"] = cvalue
    return found


def changed(before: dict, after: dict) -> list[str]:
    return sorted(k for k in before.keys() & after.keys() if before[k] is not after[k])


def main() -> int:
    from megagpt.megatron_ledger import LEDGER
    from megagpt.megatron_source import split_target

    for change in LEDGER:  # every module the installers reach is loaded before the snapshot
        importlib.import_module(split_target(change.target)[0])
    from megagpt import arguments, compat, cpu_mode, diagnostics, resilience, run_log
    from megagpt.preflight import schedule_check
    from megagpt.fast_spec import async_step, capture_watchdog, flat_adam, grad_write, optim

    from megagpt import megatron_wrappers

    def registered() -> list[str]:
        return sorted(megatron_wrappers._CHAINS)

    report = {"registered": {}}
    before = megatron_attributes()
    optim.install_fast_optimizer(tensor_clip=True)
    flat_adam.install()
    async_step.install()
    grad_write.install()
    capture_watchdog.install(300.0)
    compat.skip_dataset_helper_compilation()
    compat.distributed_optimizer_resumes_without_apex()
    # as under TE's layers without apex (no TE here: the decision is given its inputs)
    te_without_apex = compat.Installed(transformer_engine=True, apex=False,
                                       fused_layer_norm=False, masked_softmax_kernels=False,
                                       gradient_accumulation_kernels=False)
    assert compat.megatron_linears_without_wgrad_fusion(
        SimpleNamespace(transformer_impl="transformer_engine", gradient_accumulation_fusion=True),
        te_without_apex)
    launched = megatron_attributes()
    report["launch"] = changed(before, launched)
    report["registered"]["launch"] = registered()

    args = arguments.parse_arguments(
        ["--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
         "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--vocab-size", "512",
         "--no-check-for-nan-in-loss-and-grad", "--save", "/nonexistent", "--save-interval",
         "1"])
    args.check_for_nan_in_loss_and_grad = False  # as the CUDA graph leaves it: the guard on
    args.entry_argv = []
    with cpu_mode.active(), resilience.active(args), diagnostics.active(args), \
            run_log.active(args, lambda line: None):
        report["pretrain"] = changed(launched, megatron_attributes())
        report["registered"]["pretrain"] = registered()
    with arguments._device_arch_for_validation(9), run_log.argument_table_kept():
        report["validation"] = changed(launched, megatron_attributes())
        report["registered"]["validation"] = registered()
    with schedule_check.global_args(args):
        report["preflight"] = changed(launched, megatron_attributes())
        report["registered"]["preflight"] = registered()
    report["left"] = changed(before, megatron_attributes())
    report["registered"]["left"] = registered()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
