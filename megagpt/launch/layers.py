"""Which layers a launch builds: megatron's ``--transformer-impl`` and the layer path.

The paths (``LayerPath``): the fast spec, Transformer Engine's spec, megatron's local modules
(also ``--spec local``, as megatron's help spells them), its MoE block or a user's
``--spec MODULE FUNCTION``. ``layer_path`` is the one place that tells them apart; the
resolution asks it once (the ``LAYERS`` decision) and what builds the model
(``megagpt.gpt_model``) reads that decision.

megatron's ``--transformer-impl`` defaults to ``transformer_engine``. Where TE is installed and
the flag is not given, the launch picks instead, by what ran faster for the layout
(bench/notes/transformer-engine.md has the measurements):

- without tensor and pipeline parallelism the fast spec (``local`` modules; its fused layer
  is compiled and runs under CUDA graphs there) was faster than TE's layers on one GPU, with
  and without megatron's CUDA graphs around TE's, at every shape measured;
- under tensor or pipeline parallelism the fast spec's layer runs eagerly and outside
  graphs, while TE's layers fuse their norms into the linears and can overlap the
  tensor-parallel collectives (``--tp-comm-overlap``): TE's spec (not measured: it needs
  several GPUs);
- whatever only TE's layers can run (FP4, context parallelism, multi-latent attention, the
  FP8 the fast spec does not run: ``launch.fp8``) gets TE's spec, and so does a launch that
  asks for it by name;
- ``--spec local`` (megatron's spelling of its local spec) gets megatron's local modules.
"""

from __future__ import annotations

from megagpt.compat import MissingDependencyError
from megagpt.errors import UserError
from megagpt.fast_spec.spec import fast_spec_uncovered_reason, fast_spec_unsupported_reason
from megagpt.flags import megatron_local_spec_asked

from . import fp8
from .installed import sequence_parallel_norms_missing
from .plan import Decision, Label, Reason, Why

# megatron's --transformer-impl values
TRANSFORMER_ENGINE_IMPL, LOCAL_IMPL = "transformer_engine", "local"
FLAG = "--transformer-impl"


class LayerPath(Label):
    """The layers a model is built from (``megagpt.gpt_model`` builds each)."""

    TRANSFORMER_ENGINE = "transformer_engine"
    MOE_BLOCK = "moe_block"
    FAST = "fast"
    LOCAL = "local"
    USER_SPEC = "user_spec"


class Modules(Label):
    """Whose modules a launch's layers are built from."""

    TE = "te"
    FAST = "fast"
    LOCAL = "local"  # megatron's local modules: its norms, linears, attention
    SPEC = "spec"  # a user's spec


TRANSFORMER_IMPL: Decision[str] = Decision("transformer impl", str)
LAYERS: Decision[LayerPath] = Decision("layers", LayerPath)


def _size(args, name: str) -> int:
    return int(getattr(args, name, 1) or 1)


def _parallel(args) -> tuple[int, int]:
    return _size(args, "tensor_model_parallel_size"), _size(args, "pipeline_model_parallel_size")


def fast_spec_off_reason(args) -> str | None:
    """Why the fast spec's layers cannot build this launch (None: they can): its own limits
    (``fast_spec.spec``) and the FP8 it cannot run (``fp8.fast_spec_refusal``)."""
    return fast_spec_unsupported_reason(args) or fp8.fast_spec_refusal(args)


def needs_transformer_engine(args, installed) -> str | None:
    """What in this launch only Transformer Engine's layers run (None: the fast spec runs
    it as well)."""
    if getattr(args, "fp4", None):
        return "FP4 training runs in TE's linears"
    te_fp8 = fp8.needs_te_layers(args)
    if te_fp8 is not None:
        return te_fp8
    if _size(args, "context_parallel_size") > 1:
        return "context parallelism needs TE's attention"
    if getattr(args, "multi_latent_attention", False):
        return "multi-latent attention needs TE's attention"
    if getattr(args, "num_experts", None):
        return "MoE: megatron's MoE block is built from TE's modules where TE is installed"
    if getattr(args, "layernorm_zero_centered_gamma", False) and not installed.apex:
        return "--apply-layernorm-1p needs TE's (or apex's) norms"
    # what the fast spec could cover, whether or not --no-fast-spec is given
    reason = fast_spec_uncovered_reason(args) or fp8.fast_spec_refusal(args)
    if reason is not None:
        return f"the fast spec does not cover it: {reason}"
    return None


def transformer_impl(args, given: set[str] | frozenset[str], installed) -> tuple[str, Reason]:
    """megatron's ``--transformer-impl`` for this launch, and why.

    ``given``: the option strings on the command line (config file expanded), so that an
    explicit request is honoured. An explicit ``transformer_engine`` without TE is refused
    (``choose_transformer_impl``) before this is asked.
    """
    if megatron_local_spec_asked(args):
        if FLAG in given and args.transformer_impl != LOCAL_IMPL:
            raise UserError(f"--spec local asks for megatron's local modules and {FLAG} "
                            f"{args.transformer_impl} for other layers; give one of the two")
        return LOCAL_IMPL, Reason(Why.GIVEN, "--spec local: megatron's local spec")
    if FLAG in given:
        return args.transformer_impl, Reason(Why.GIVEN, f"{FLAG} {args.transformer_impl} "
                                             "as given")
    if not installed.transformer_engine:
        return LOCAL_IMPL, Reason(Why.INSTALLED, "Transformer Engine is not installed")
    if getattr(args, "cpu", False):
        return LOCAL_IMPL, Reason(Why.CPU, "--cpu (Transformer Engine's layers need a GPU)")
    if getattr(args, "spec", None):
        return TRANSFORMER_ENGINE_IMPL, Reason(Why.GIVEN, "--spec given: megatron's default "
                                               "for it")
    te_only = needs_transformer_engine(args, installed)
    if te_only is not None:
        return TRANSFORMER_ENGINE_IMPL, Reason(Why.CONFLICT, te_only)
    if not getattr(args, "fast_spec", True):
        return TRANSFORMER_ENGINE_IMPL, Reason(Why.GIVEN, "--no-fast-spec: megatron's "
                                               "default layers")
    tp, pp = _parallel(args)
    if tp > 1 or pp > 1:
        return TRANSFORMER_ENGINE_IMPL, Reason(
            Why.LAYOUT, f"tensor x pipeline parallel {tp} x {pp}: the fast spec's layer would "
            f"run eagerly, outside CUDA graphs; {FLAG} local asks for it")
    fp8_fast = fp8.fast_spec_faster_reason(args)
    if fp8_fast is not None:
        return LOCAL_IMPL, Reason(Why.DEFAULT, f"{fp8_fast}; {FLAG} transformer_engine asks "
                                  "for TE's")
    return LOCAL_IMPL, Reason(
        Why.DEFAULT, "no tensor or pipeline parallelism: the fast spec measured faster than "
        f"TE's layers here (docs/transformer-engine-and-apex.md); {FLAG} transformer_engine asks "
        "for TE's")


def describe_impl(impl: str, reason: Reason) -> str:
    layers = ("Transformer Engine's layers" if impl == TRANSFORMER_ENGINE_IMPL
              else "megatron's local modules (the fast spec where it applies)")
    return f"layers: {layers}: {reason}"


def layer_path(args, impl_reason: Reason | None = None) -> tuple[LayerPath, Reason]:
    """(path, reason): which layers the model is built from (``megagpt.gpt_model`` builds
    them). ``impl_reason``: why ``--transformer-impl`` is what it is (the
    ``TRANSFORMER_IMPL`` decision), the reason of the fast spec's and TE's paths."""
    spec = getattr(args, "spec", None)
    if megatron_local_spec_asked(args):
        if getattr(args, "num_experts", None) is not None:
            return LayerPath.MOE_BLOCK, Reason(Why.GIVEN, f"--num-experts {args.num_experts}, "
                                               "local modules (--spec local)")
        return LayerPath.LOCAL, Reason(Why.GIVEN, "megatron's local modules: --spec local")
    if spec:
        return LayerPath.USER_SPEC, Reason(Why.GIVEN, f"--spec {' '.join(spec)}")
    use_te = getattr(args, "transformer_impl", LOCAL_IMPL) == TRANSFORMER_ENGINE_IMPL
    experts = getattr(args, "num_experts", None)
    if experts is not None:
        impl = "Transformer Engine" if use_te else "local"
        return LayerPath.MOE_BLOCK, Reason(Why.GIVEN, f"--num-experts {experts}, {impl} "
                                           "modules")
    if use_te:
        return LayerPath.TRANSFORMER_ENGINE, impl_reason or Reason(
            Why.GIVEN, "--transformer-impl transformer_engine")
    off = fast_spec_off_reason(args)
    if off is None:
        why = impl_reason or Reason(Why.INSTALLED, "Transformer Engine is not installed")
        return LayerPath.FAST, Reason(why.why, f"{why}; SDPA attention and fused kernels")
    return LayerPath.LOCAL, Reason(Why.CONFLICT, "megatron's local modules; fast spec off",
                                   cause=Reason(Why.CONFLICT, off))


def layer_modules(path: LayerPath, args) -> Modules:
    """Whose modules the layer path ``path`` builds."""
    if path is LayerPath.FAST:
        return Modules.FAST
    if path is LayerPath.TRANSFORMER_ENGINE or (
            path is LayerPath.MOE_BLOCK
            and getattr(args, "transformer_impl", None) == TRANSFORMER_ENGINE_IMPL):
        return Modules.TE
    return Modules.LOCAL if path in (LayerPath.LOCAL, LayerPath.MOE_BLOCK) else Modules.SPEC


# --- the steps of the resolution -----------------------------------------------------------

def choose_transformer_impl(p) -> None:
    """megatron's ``--transformer-impl`` for what is installed and the layout; an explicit
    request that cannot be honoured is refused (``MissingDependencyError``), never changed."""
    if (FLAG in p.given and p.v.transformer_impl == TRANSFORMER_ENGINE_IMPL
            and not p.installed.transformer_engine):
        raise MissingDependencyError(
            "--transformer-impl transformer_engine was given, but Transformer Engine is "
            "not installed. Install it (pip install 'megagpt[te]') or drop the flag: "
            "without it the entry uses its own fast path.")
    impl, reason = transformer_impl(p.v, p.given, p.installed)
    p.set("transformer_impl", impl)
    p.choose(TRANSFORMER_IMPL, impl, reason)
    p.log(f"compat: {describe_impl(impl, reason)}")


def choose_layers(p) -> None:
    """The layer path, decided once; ``--sequence-parallel`` refused where no norm of it
    serves."""
    path, reason = p.layers()
    p.choose(LAYERS, path, reason)
    refusal = sequence_parallel_norms_missing(p.v, p.installed, path is LayerPath.FAST)
    if refusal is not None:
        raise refusal
