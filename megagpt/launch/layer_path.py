"""Which layers a run's model is built from: the fast spec, Transformer Engine's, megatron's
local ones (also ``--spec local``, as megatron's help spells them), its MoE block or a user's
``--spec MODULE FUNCTION``. ``layer_path`` is the one place that tells them apart; the
launch's resolution asks it once (its ``layers`` choice), and what builds the model
(``megagpt.gpt_model``) reads that choice.
"""

from __future__ import annotations

from megagpt.fast_spec.spec import fast_spec_unsupported_reason
from megagpt.flags import megatron_local_spec_asked

# layer paths (megagpt.gpt_model builds each)
TRANSFORMER_ENGINE = "transformer_engine"
MOE_BLOCK = "moe_block"
FAST = "fast"
LOCAL = "local"
USER_SPEC = "user_spec"


def layer_path(args, impl_reason: str | None = None) -> tuple[str, str]:
    """(path, reason): which layers the model is built from (``megagpt.gpt_model`` builds
    them). ``impl_reason``: why ``--transformer-impl`` is what it is (``layer_impl``'s choice),
    for the reason of the fast spec's and TE's paths."""
    spec = getattr(args, "spec", None)
    if megatron_local_spec_asked(args):
        if getattr(args, "num_experts", None) is not None:
            return MOE_BLOCK, f"--num-experts {args.num_experts}, local modules (--spec local)"
        return LOCAL, "megatron's local modules: --spec local"
    if spec:
        return USER_SPEC, f"--spec {' '.join(spec)}"
    use_te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    experts = getattr(args, "num_experts", None)
    if experts is not None:
        impl = "Transformer Engine" if use_te else "local"
        return MOE_BLOCK, f"--num-experts {experts}, {impl} modules"
    if use_te:
        return TRANSFORMER_ENGINE, impl_reason or "--transformer-impl transformer_engine"
    reason = fast_spec_unsupported_reason(args)
    if reason is None:
        why = impl_reason or "Transformer Engine is not installed"
        return FAST, f"{why}; SDPA attention and fused kernels"
    return LOCAL, f"megatron's local modules; fast spec off: {reason}"


def fast_path_selected(args) -> bool:
    """Whether this run builds layers from the fast spec."""
    return layer_path(args)[0] == FAST


def te_layers_selected(args) -> bool:
    """Whether this run builds Transformer Engine's dense layer spec (no --spec, no MoE
    block)."""
    return layer_path(args)[0] == TRANSFORMER_ENGINE


# whose modules a launch's layers are built from
TE_MODULES, FAST_MODULES, LOCAL_MODULES, SPEC_MODULES = "te", "fast", "local", "spec"


def layer_modules(path: str, args) -> str:
    """TE_MODULES, FAST_MODULES, LOCAL_MODULES (megatron's local modules: its norms, linears,
    attention) or SPEC_MODULES (a user's spec) for the layer path ``path``."""
    if path == FAST:
        return FAST_MODULES
    if path == TRANSFORMER_ENGINE or (
            path == MOE_BLOCK and getattr(args, "transformer_impl", None) == "transformer_engine"):
        return TE_MODULES
    return LOCAL_MODULES if path in (LOCAL, MOE_BLOCK) else SPEC_MODULES
