"""Which of NVIDIA apex's kernels a launch leaves where megatron would take them, having
measured them slower (a step of the launch's resolution, over its planner ``p``).

apex's persistent layer norm (``fast_layer_norm``): megatron's local modules build apex's
FusedLayerNorm wherever apex imports, with the persistent kernel for the hidden sizes it has
(``PERSISTENT_HIDDEN_SIZES``) unless ``--no-persist-layer-norm``. Against apex's other
LayerNorm kernel (``fused_layer_norm_cuda``, what ``--no-persist-layer-norm`` leaves) it was
slower: 345M (hidden 1024, bf16) under megatron's local spec on one H100, 113.5 against 105.9
ms per iteration in one invocation (2026-12-07, d893954; bench/benchmarks.md "With NVIDIA apex
installed"). Other hidden sizes are not measured. So the launch leaves it unless
``--persist-layer-norm`` asks for it; the fast spec's and Transformer Engine's norms are their
own either way.
"""

from __future__ import annotations

from megagpt.compat import MissingDependencyError
from megagpt.errors import UserError

from .layers import Modules, layer_modules
from .plan import Decision, Reason, Why

# megatron's FusedLayerNorm.__init__: the hidden sizes its persistent kernel takes (others
# get fused_layer_norm_cuda's kernel)
PERSISTENT_HIDDEN_SIZES = frozenset({
    1024, 1536, 2048, 2304, 3072, 3840, 4096, 5120, 6144, 8192, 10240, 12288, 12800, 15360,
    16384, 18432, 20480, 24576, 25600, 30720, 32768, 40960, 49152, 65536})

# apex's persistent layer norm kernel for megatron's local modules (made only where the
# launch decides something: asked for, or left)
PERSISTENT_LAYER_NORM: Decision[bool] = Decision("persistent layer norm", bool)

PERSISTENT_LAYER_NORM_SLOWER = (
    "apex's persistent kernel measured slower than its fused_layer_norm_cuda kernel (345M on "
    "an H100: 113.5 against 105.9 ms per iteration); --persist-layer-norm takes it")


def _local_layer_norms_take_the_persistent_kernel(p) -> bool:
    """Whether megatron's local LayerNorms are built, at a hidden size the kernel has."""
    return (layer_modules(p.layers()[0], p.v) is Modules.LOCAL
            and p.v.normalization == "LayerNorm" and p.v.hidden_size in PERSISTENT_HIDDEN_SIZES)


def choose_persistent_layer_norm(p) -> None:
    """Leave apex's persistent layer norm where megatron's local LayerNorms would take it,
    unless ``--persist-layer-norm``; said (in the plan and the log) only where it decides
    something."""
    asked = bool(p.get("persist_layer_norm_kernel", False))
    if asked and "--no-persist-layer-norm" in p.given:
        raise UserError("--persist-layer-norm and --no-persist-layer-norm ask for opposite "
                        "kernels: give one of them")
    if asked:
        if not p.installed.fused_layer_norm:
            raise MissingDependencyError(
                "--persist-layer-norm needs NVIDIA apex built with its persistent layer norm "
                "(apex.contrib's fast_layer_norm extension), which does not import here. "
                "Drop the flag, or build apex (bench/apex_build.py).")
        p.choose(PERSISTENT_LAYER_NORM, True, Reason(Why.GIVEN, "--persist-layer-norm"))
        return
    if p.v.no_persist_layer_norm or not p.installed.fused_layer_norm or p.get("cpu", False):
        return  # asked off, the kernel missing (compat's adaptation said so), or torch's norms
    if not _local_layer_norms_take_the_persistent_kernel(p):
        return
    p.set("no_persist_layer_norm", True)
    p.choose(PERSISTENT_LAYER_NORM, False, Reason(Why.DEFAULT, PERSISTENT_LAYER_NORM_SLOWER))
    p.log(f"compat: {PERSISTENT_LAYER_NORM_SLOWER}; --no-persist-layer-norm")
