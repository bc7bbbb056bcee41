"""NVIDIA apex in a launch: what megatron-core takes from it where it imports, the kernels the
launch leaves having measured them slower, and the one line that says what it takes.


megatron-core 0.19 imports apex in six places, each inside ``try``/``except ImportError``
with a fallback of its own (the sites below name the files, under ``megatron/``):

- ``fused_weight_gradient_mlp_cuda``: gradient-accumulation fusion in megatron's own linear
  layers (``tensor_parallel/layers.py``): their weight-gradient GEMM adds into the fp32 or
  bf16 gradient buffer. Without it megatron refuses ``--gradient-accumulation-fusion`` for
  them (``megagpt.compat`` turns it off);
- ``apex.optimizers.FusedAdam`` / ``FusedSGD`` (over ``amp_C``'s kernels) as
  megatron's Adam and SGD, and ``amp_C`` with ``apex.multi_tensor_apply`` for the gradient
  norm, clipping and parameter copies, where Transformer Engine's (imported first) are
  missing;
- ``import apex`` makes megatron's local spec build ``FusedLayerNorm``
  (``fusions/fused_layer_norm.py``) for its LayerNorms: apex's ``fused_layer_norm_cuda``, or
  the persistent kernel of ``apex.contrib.layer_norm`` (``fast_layer_norm``) for the hidden
  sizes it has kernels for, unless ``--no-persist-layer-norm`` (which the entry gives where
  apex has that kernel, measured slower: below);
- the scaled-softmax kernels (``fusions/fused_softmax.py``) in megatron's local attention,
  with ``--masked-softmax-fusion`` (its default) in fp16/bf16 for the shapes they take.

Not taken by megatron 0.19, though apex's ``--cuda_ext`` builds them: fused rotary embeddings
(megatron's fused RoPE is Transformer Engine's), ``generic_scaled_masked_softmax_cuda``,
``syncbn``, ``mlp_cuda``, ``fused_dense_cuda``, ``apex_C``; ``apex.contrib.nccl_allocator``
only where ``megatron.core.nccl_allocator`` does not import (megatron FSDP's buffers).

``log_launch_line`` writes one line per launch, where apex is importable, naming what this
launch takes from it and why the rest is left: which of these a launch reaches depends on
its layers (the fast spec's norms, attention, fused layers and LM loss are its own), on
Transformer Engine (whose optimizer kernels megatron takes first) and on the fast path's
optimizer. Detection imports each module for real: a built library that does not load is
missing, as megatron's own ``except ImportError`` sees it.

What the launch leaves (``choose_persistent_layer_norm``, a step of its resolution):

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

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

from megagpt.compat import MissingDependencyError
from megagpt.errors import UserError

from .fast_path import LM_LOSS, LmLoss
from .fast_path_reasons import wgrad_fusion_unused_reason
from .layers import LAYERS, LayerPath, Modules, layer_modules
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


@dataclass(frozen=True)
class Part:
    """One thing megatron takes from apex: the modules that must import for it."""

    key: str
    label: str  # as the launch line names it
    modules: tuple[str, ...]
    sites: tuple[str, ...]  # where megatron imports it, under megatron/
    use: str


SOFTMAX_KERNELS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
                   "scaled_softmax_cuda")

PARTS: tuple[Part, ...] = (
    Part("wgrad", "fused_weight_gradient_mlp_cuda", ("fused_weight_gradient_mlp_cuda",),
         ("core/tensor_parallel/layers.py", "core/utils.py"),
         "gradient-accumulation fusion in megatron's own linear layers"),
    Part("optimizer", "FusedAdam", ("apex.optimizers", "amp_C"),
         ("core/optimizer/__init__.py", "core/optimizer/distrib_optimizer.py"),
         "megatron's Adam and SGD where Transformer Engine's are missing"),
    Part("multi_tensor", "amp_C multi-tensor kernels", ("amp_C", "apex.multi_tensor_apply"),
         ("core/optimizer/optimizer.py", "core/optimizer/clip_grads.py",
          "training/utils/common_utils.py"),
         "the gradient norm, clipping and parameter copies where Transformer Engine's are "
         "missing"),
    Part("layer_norm", "FusedLayerNorm (fused_layer_norm_cuda)",
         ("apex", "apex.normalization.fused_layer_norm", "fused_layer_norm_cuda"),
         ("core/fusions/fused_layer_norm.py", "core/models/backends.py",
          "core/models/gpt/gpt_layer_specs.py"),
         "megatron's local spec's LayerNorm once `import apex` works"),
    Part("persistent_layer_norm", "persistent layer norm (fast_layer_norm)",
         ("apex.contrib.layer_norm.layer_norm", "fast_layer_norm"),
         ("core/fusions/fused_layer_norm.py",),
         "FusedLayerNorm's kernel for the hidden sizes it has"),
    Part("softmax", "scaled-softmax kernels", SOFTMAX_KERNELS,
         ("core/fusions/fused_softmax.py",),
         "the fused scale-mask-softmax of megatron's local attention"),
)
BY_KEY = {part.key: part for part in PARTS}

# what apex offers that megatron 0.19 leaves, and why (its --cuda_ext builds all but the last)
NOT_TAKEN = {
    "apex.contrib.nccl_allocator": "megatron FSDP's NCCL buffers take "
                                   "megatron.core.nccl_allocator first, which the wheel has",
    "fused_rotary_positional_embedding": "megatron's fused RoPE is Transformer Engine's",
    "generic_scaled_masked_softmax_cuda": "megatron's softmax does not import it",
    "syncbn": "batch norm", "mlp_cuda": "apex's own MLP module",
    "fused_dense_cuda": "apex's own dense module", "apex_C": "apex's DDP flattening",
}

# the compiled extensions of PARTS: what bench/apex_build.py builds
EXTENSIONS = tuple(dict.fromkeys(m for part in PARTS for m in part.modules
                                 if "." not in m and m != "apex"))


def imports(module: str) -> bool:
    """Whether ``module`` imports here (a real import, as megatron's try/except does it)."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - ImportError, or a broken install megatron cannot take
        return False
    return True


def found_parts(importable: Callable[[str], bool] = imports) -> frozenset[str]:
    """The keys of the parts whose every module imports."""
    # first: the compiled extensions link against torch's libraries, which its import loads
    import torch  # noqa: F401

    known: dict[str, bool] = {}

    def ok(module: str) -> bool:
        if module not in known:
            known[module] = importable(module)
        return known[module]

    return frozenset(part.key for part in PARTS if all(ok(m) for m in part.modules))


def _origin(obj: object) -> str:
    """The top-level package an object of megatron's module namespace came from."""
    module = getattr(obj, "__module__", None) or type(obj).__module__ or ""
    root = module.split(".")[0]
    return "apex" if root in ("apex", *EXTENSIONS) else root


def megatron_bindings() -> dict[str, object]:
    """What megatron took from apex when its modules were imported, and what the fast path
    has put over it since: the Adam/SGD megatron's optimizer builds and the one megatron
    bound, the gradient-norm kernel, whether its linears found the weight-gradient kernel,
    whether its local spec builds FusedLayerNorm and has the persistent kernel."""
    import megatron.core.optimizer as mopt
    from megatron.core.fusions import fused_layer_norm
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import layers

    from megagpt import megatron_wrappers

    return {
        "adam": _origin(mopt.Adam),
        "adam_bound": _origin(megatron_wrappers.original(mopt, "Adam")),
        "sgd": _origin(mopt.SGD),
        "grad_norm": _origin(clip_grads.l2_norm_impl),
        "wgrad_kernel": bool(layers._grad_accum_fusion_available),
        "fused_layer_norm": bool(gpt_layer_specs.HAVE_APEX),
        "persistent_kernel": bool(fused_layer_norm.HAVE_PERSIST_LAYER_NORM),
    }


@dataclass(frozen=True)
class Use:
    """One part as this launch has it: taken (where) or left (why)."""

    label: str
    taken: bool
    detail: str

    def __str__(self) -> str:
        return f"{self.label} ({self.detail})"


def _get(args, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def _wgrad_scope(modules: Modules, args) -> str:
    """Which of megatron's linear layers run their own backward in this launch (where the
    fast spec's fused layers and chunked LM loss leave none, ``wgrad_fusion_unused_reason``
    says so first): Transformer Engine's layers fuse theirs."""
    if modules is Modules.TE:
        return "the output layer; Transformer Engine's layers fuse their own"
    if modules is not Modules.FAST:
        return "megatron's linear layers"
    if not _get(args, "fast_spec_fused_layer", True):
        return "the layers' linears (--fast-disable fused-layer) and the output layer"
    return "the output layer"


def launch_uses(modules: Modules, args, found: frozenset[str], bound: Mapping[str, object],
                te_installed: bool, chunked_loss: bool = False,
                persistent_left: Optional[str] = None) -> list[Use]:
    """For each part found, whether this launch takes it. ``modules``: ``layer_modules``;
    ``bound``: ``megatron_bindings()``; ``chunked_loss``: the launch's LM loss is the fast
    spec's chunked one (megatron's output layer runs no backward of its own);
    ``persistent_left``: why the launch turned the persistent layer norm off itself
    (``megagpt.launch.apex_kernels``; None: it did not)."""
    uses: list[Use] = []
    cpu = bool(_get(args, "cpu", False))

    def add(key: str, taken: bool, detail: str) -> None:
        if key in found:
            uses.append(Use(BY_KEY[key].label, taken, detail))

    # the optimizer
    sgd = _get(args, "optimizer", "adam") == "sgd"
    label_optimizer = "FusedSGD" if sgd else "FusedAdam"
    current = bound.get("sgd" if sgd else "adam")  # what megatron's optimizer builds
    first = bound.get("sgd" if sgd else "adam_bound")  # what megatron bound at import
    if "optimizer" in found:
        if cpu:
            detail, taken = "CPU mode runs megatron's torch optimizer", False
        elif current == "apex":
            which = ("the distributed optimizer's" if _get(args, "use_distributed_optimizer",
                                                            False) else "megatron's")
            detail, taken = f"{which} {'SGD' if sgd else 'Adam'}", True
        elif first == "apex":
            detail, taken = "the fast optimizer's torch fused AdamW replaces it", False
        elif first == "transformer_engine":
            detail, taken = "megatron takes Transformer Engine's first", False
        else:
            detail, taken = f"megatron's optimizer is {current}'s", False
        uses.append(Use(label_optimizer, taken, detail))
    # the multi-tensor kernels
    if cpu:
        add("multi_tensor", False, "CPU mode runs megatron's torch fallbacks")
    elif bound.get("grad_norm") == "apex":
        add("multi_tensor", True, "megatron's gradient norm and clipping")
    else:
        add("multi_tensor", False, f"the gradient norm is {bound.get('grad_norm')}'s"
            + (": megatron takes Transformer Engine's first" if te_installed else ""))
    # gradient-accumulation fusion
    if "wgrad" in found:
        unused = (wgrad_fusion_unused_reason(args, LayerPath.FAST, chunked_loss)
                  if modules is Modules.FAST else None)
        if unused is not None:
            uses.append(Use(BY_KEY["wgrad"].label, False, unused))
        elif not _get(args, "gradient_accumulation_fusion", False):
            uses.append(Use(BY_KEY["wgrad"].label, False, "--no-gradient-accumulation-fusion"))
        elif not bound.get("wgrad_kernel"):
            uses.append(Use(BY_KEY["wgrad"].label, False, "megatron's linears did not find it"))
        else:
            uses.append(Use(BY_KEY["wgrad"].label, True,
                            f"gradient-accumulation fusion in {_wgrad_scope(modules, args)}"))
    # norms
    uses.extend(_norm_uses(modules, args, found, bound, persistent_left))
    # softmax
    if modules is Modules.LOCAL:
        fp = _get(args, "bf16", False) or _get(args, "fp16", False)
        if not _get(args, "masked_softmax_fusion", False):
            add("softmax", False, "--no-masked-softmax-fusion")
        elif not fp:
            add("softmax", False, "they take fp16/bf16 scores; this run is fp32")
        else:
            add("softmax", True, "megatron's local attention, for the shapes they take")
    else:
        add("softmax", False, {Modules.TE: "attention is Transformer Engine's",
                               Modules.FAST: "attention is the fast spec's torch SDPA"}.get(
                                   modules, "attention is the spec's own"))
    return uses


def _norm_uses(modules: Modules, args, found: frozenset[str], bound: Mapping[str, object],
               persistent_left: Optional[str] = None) -> list[Use]:
    keys = [k for k in ("layer_norm", "persistent_layer_norm") if k in found]
    if not keys and not bound.get("fused_layer_norm"):
        return []
    layer_norm = _get(args, "normalization", "LayerNorm") == "LayerNorm"
    if _get(args, "cpu", False):
        # gpt_model.with_torch_norms: apex's kernels take CUDA tensors only
        return [Use(BY_KEY[k].label, False, "CPU mode builds torch's norms") for k in keys]
    if modules is Modules.FAST:
        if (_get(args, "qk_layernorm", False) and layer_norm and "layer_norm" in found
                and bound.get("fused_layer_norm")):
            # the fast spec replaces the layers' norms, not megatron's q/k norms
            return [Use(BY_KEY["layer_norm"].label, True, "the q/k norms of --qk-layernorm; "
                        "the layers' own norms are the fast spec's torch ones")]
        return [Use(BY_KEY[k].label, False, "the fast spec's norms are torch's") for k in keys]
    if modules is Modules.TE:
        return [Use(BY_KEY[k].label, False, "Transformer Engine's layers have their own")
                for k in keys]
    if modules is not Modules.LOCAL:
        return [Use(BY_KEY[k].label, False, "the spec picks its own norms") for k in keys]
    if not layer_norm:
        return [Use(BY_KEY[k].label, False, f"{args.normalization} is megatron's torch norm")
                for k in keys]
    if "layer_norm" not in found:
        # megatron's local spec builds FusedLayerNorm on `import apex` alone; its forward
        # imports the kernel
        return [Use("FusedLayerNorm", True, "megatron's local spec builds it, but "
                    "fused_layer_norm_cuda does not import: its first forward will fail")]
    persistent = ("persistent_layer_norm" in found and bound.get("persistent_kernel")
                  and not _get(args, "no_persist_layer_norm", False)
                  and _get(args, "hidden_size", 0) in PERSISTENT_HIDDEN_SIZES)
    if persistent:
        return [Use(BY_KEY["persistent_layer_norm"].label, True, "megatron's local spec's "
                    "LayerNorms")]
    why = ((persistent_left or "--no-persist-layer-norm")
           if _get(args, "no_persist_layer_norm", False)
           else "not built" if "persistent_layer_norm" not in found
           else f"no kernel for hidden size {_get(args, 'hidden_size', 0)}")
    return [Use(BY_KEY["layer_norm"].label, True,
                f"megatron's local spec's LayerNorms; persistent kernel: {why}")]


def launch_line(uses: Iterable[Use]) -> str:
    """The one log line: what is taken, then what is left and why."""
    uses = list(uses)
    taken = "; ".join(str(u) for u in uses if u.taken) or "nothing"
    left = "; ".join(str(u) for u in uses if not u.taken)
    return f"apex: what this launch takes from it: {taken}" + (
        f". Installed, not taken: {left}" if left else "")


def log_launch_line(launch, args, log: Callable[[str], None]) -> Optional[str]:
    """Log what ``launch`` takes from apex (nothing where apex is not importable): once the
    launch's megatron changes are in place (they replace some of it), before the model is
    built."""
    found = found_parts()
    if not found:
        return None
    te = importlib.util.find_spec("transformer_engine") is not None
    modules = layer_modules(launch[LAYERS], args)
    chunked = launch[LM_LOSS] is LmLoss.CHUNKED
    persistent = launch.get(PERSISTENT_LAYER_NORM)
    left = str(persistent.reason) if persistent is not None and not persistent.value else None
    line = launch_line(launch_uses(modules, args, found, megatron_bindings(), te, chunked,
                                   left))
    log(line)
    return line
