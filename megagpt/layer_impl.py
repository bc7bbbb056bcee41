"""Which layers a launch builds where Transformer Engine is installed: TE's or the fast spec's.

megatron's ``--transformer-impl`` defaults to ``transformer_engine``. Where TE is installed and
the flag is not given, the entry picks instead, by what ran faster for the layout
(bench/notes/transformer-engine.md has the measurements):

- without tensor and pipeline parallelism the fast spec (``local`` modules; its fused layer
  is compiled and runs under CUDA graphs there) was faster than TE's layers on one GPU, with
  and without megatron's CUDA graphs around TE's, at every shape measured;
- under tensor or pipeline parallelism the fast spec's layer runs eagerly and outside
  graphs, while TE's layers fuse their norms into the linears and can overlap the
  tensor-parallel collectives (``--tp-comm-overlap``): TE's spec (not measured: it needs
  several GPUs);
- whatever only TE's layers can run (FP4, FP8 recipes other than tensorwise and delayed
  scaling, context parallelism, multi-latent attention, ...) gets TE's spec, and so does a
  launch that asks for it by name;
- FP8 (``--fp8-format``) without tensor and pipeline parallelism runs in the fast spec's
  FP8 linears (``fast_spec.fp8``), which measured faster than TE's FP8 layers on one GPU
  (bench/notes/fp8.md); under tensor or pipeline parallelism in TE's;
- ``--spec local`` (megatron's spelling of its local spec) gets megatron's local modules.

``choose_transformer_impl`` decides from the arguments and what is installed, without touching
megatron; ``megagpt.compat``'s step of the launch's resolution records the choice with its
reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from megagpt.errors import UserError
from megagpt.flags import megatron_local_spec_asked

TRANSFORMER_ENGINE = "transformer_engine"
LOCAL = "local"
FLAG = "--transformer-impl"


@dataclass(frozen=True)
class ImplChoice:
    impl: str  # megatron's --transformer-impl value
    reason: str  # one line for the log

    def describe(self) -> str:
        layers = ("Transformer Engine's layers" if self.impl == TRANSFORMER_ENGINE
                  else "megatron's local modules (the fast spec where it applies)")
        return f"layers: {layers}: {self.reason}"


def _size(args, name: str) -> int:
    return int(getattr(args, name, 1) or 1)


def needs_transformer_engine(args, installed) -> str | None:
    """What in this launch only Transformer Engine's layers run (None: the fast spec runs
    it as well)."""
    from megagpt.fast_spec.spec import fast_spec_uncovered_reason

    if getattr(args, "fp4", None):
        return "FP4 training runs in TE's linears"
    if getattr(args, "fp8", None) and (_size(args, "tensor_model_parallel_size") > 1
                                       or _size(args, "pipeline_model_parallel_size") > 1):
        # the fast spec's FP8 layer runs eagerly there, as its bf16 layer does (below)
        return "FP8 under tensor or pipeline parallelism: TE's FP8 layers"
    if _size(args, "context_parallel_size") > 1:
        return "context parallelism needs TE's attention"
    if getattr(args, "multi_latent_attention", False):
        return "multi-latent attention needs TE's attention"
    if getattr(args, "num_experts", None):
        return "MoE: megatron's MoE block is built from TE's modules where TE is installed"
    if getattr(args, "layernorm_zero_centered_gamma", False) and not installed.apex:
        return "--apply-layernorm-1p needs TE's (or apex's) norms"
    # what the fast spec could cover, whether or not --no-fast-spec is given
    reason = fast_spec_uncovered_reason(args)
    if reason is not None:
        return f"the fast spec does not cover it: {reason}"
    return None


def choose_transformer_impl(args, given: set[str], installed) -> ImplChoice:
    """megatron's ``--transformer-impl`` for this launch, and why.

    ``given``: the option strings on the command line (config file expanded), so that an
    explicit request is honoured. With TE missing, ``megagpt.compat`` refuses an explicit
    ``transformer_engine`` before this is asked.
    """
    if megatron_local_spec_asked(args):
        if FLAG in given and args.transformer_impl != LOCAL:
            raise UserError(f"--spec local asks for megatron's local modules and {FLAG} "
                            f"{args.transformer_impl} for other layers; give one of the two")
        return ImplChoice(LOCAL, "--spec local: megatron's local spec")
    if FLAG in given:
        return ImplChoice(args.transformer_impl, f"{FLAG} {args.transformer_impl} as given")
    if not installed.transformer_engine:
        return ImplChoice(LOCAL, "Transformer Engine is not installed")
    if getattr(args, "cpu", False):
        return ImplChoice(LOCAL, "--cpu (Transformer Engine's layers need a GPU)")
    if getattr(args, "spec", None):
        return ImplChoice(TRANSFORMER_ENGINE, "--spec given: megatron's default for it")
    te_only = needs_transformer_engine(args, installed)
    if te_only is not None:
        return ImplChoice(TRANSFORMER_ENGINE, te_only)
    if not getattr(args, "fast_spec", True):
        return ImplChoice(TRANSFORMER_ENGINE, "--no-fast-spec: megatron's default layers")
    tp, pp = _size(args, "tensor_model_parallel_size"), _size(args, "pipeline_model_parallel_size")
    if tp > 1 or pp > 1:
        return ImplChoice(
            TRANSFORMER_ENGINE,
            f"tensor x pipeline parallel {tp} x {pp}: the fast spec's layer would run "
            f"eagerly, outside CUDA graphs; {FLAG} local asks for it")
    if getattr(args, "fp8", None):
        return ImplChoice(
            LOCAL, "FP8 without tensor or pipeline parallelism: the fast spec's FP8 linears "
            "measured faster than TE's FP8 layers here (docs/fp8.md); "
            f"{FLAG} transformer_engine asks for TE's")
    return ImplChoice(
        LOCAL, "no tensor or pipeline parallelism: the fast spec measured faster than TE's "
        f"layers here (docs/transformer-engine-and-apex.md); {FLAG} transformer_engine asks "
        "for TE's")
