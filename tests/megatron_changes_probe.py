"""Run every installer of the project in a fresh process and print, as JSON, which megatron
attributes each step changed (tests/test_megatron_ledger.py holds them against the ledger).

    python tests/megatron_changes_probe.py

Prints ``{"launch": [...], "launch on the CPU": [...], "validation": [...], "preflight": [...],
"left": [...]}``: the dotted names changed inside the launch's one context of megatron changes
(``megagpt.launch.megatron_changes.launched``, with every choice that turns a change on; once
as on a GPU, once with ``--cpu``), inside the validation without a GPU, inside the preflight's
``schedule_check.global_args``, and still changed after the contexts exit (nothing should
be); and under ``"registered"`` the same steps' names that ``megagpt.megatron_wrappers`` holds
installed.
"""

from __future__ import annotations

import importlib
import inspect
import json
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
    import copy

    from megagpt import launch, run_log
    from megagpt.command_line import arguments
    from megagpt.launch.megatron_changes import launched
    from megagpt.preflight import schedule_check
    from megatron_parts import with_every_change

    from megagpt import megatron_wrappers

    def registered() -> list[str]:
        return sorted(megatron_wrappers._CHAINS)

    report = {"registered": {}}
    before = megatron_attributes()
    resolved = launch.resolve(
        ["--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
         "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--vocab-size", "512",
         "--save", "/nonexistent", "--save-interval", "1"])
    args = launch.write(resolved, environ={})
    everything = with_every_change(resolved)  # every change a launch can make
    on_a_gpu = copy.copy(args)
    on_a_gpu.cpu = False  # the capture deadline, which CPU mode leaves out
    for step, launch_args in (("launch", on_a_gpu), ("launch on the CPU", args)):
        with launched(everything, launch_args):
            report[step] = changed(before, megatron_attributes())
            report["registered"][step] = registered()
    launched_attributes = megatron_attributes()
    with arguments._device_arch_for_validation(9), run_log.argument_table_kept():
        report["validation"] = changed(launched_attributes, megatron_attributes())
        report["registered"]["validation"] = registered()
    with schedule_check.global_args(args):
        report["preflight"] = changed(launched_attributes, megatron_attributes())
        report["registered"]["preflight"] = registered()
    report["left"] = changed(before, megatron_attributes())
    report["registered"]["left"] = registered()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
