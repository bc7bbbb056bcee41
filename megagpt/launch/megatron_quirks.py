"""Settings megatron's parser accepts that its own code then rejects: each written as megatron
can run it, with one log line (a step of the launch's resolution, ``adapt_megatron_quirks``)."""

from __future__ import annotations

from .installed import experts_add_bias_out_of_place
from .plan import Decision, Reason, Why

RERUN_MODE: Decision[str] = Decision("--rerun-mode", str)
NO_BIAS_GELU_FUSION: Decision[bool] = Decision("--no-bias-gelu-fusion", bool)
NO_BIAS_DROPOUT_FUSION: Decision[bool] = Decision("--no-bias-dropout-fusion", bool)

# megatron 0.19's parser offers --rerun-mode report_stats (RerunStateMachineConfig), but its
# RerunMode enum names that mode "report_determinism_stats": initialize_megatron's
# RerunMode(args.rerun_mode) raises ValueError for the parser's spelling.
RERUN_MODE_SPELLINGS = {"report_stats": "report_determinism_stats"}


def bias_activation_fusion_conflict(args) -> str | None:
    """Why megatron's default fusion of the MLP's bias into its activation cannot run with
    this launch's activation (None: it can). The fusion is on unless ``--no-bias-gelu-fusion``
    is given (no flag asks for it), and megatron turns it off itself only where the linears
    have no bias. Otherwise megatron refuses a squared ReLU with it when the model's config is
    built, and MoE experts with GeLU stop on it at the first step."""
    if args.swiglu or not args.bias_gelu_fusion or not args.add_bias_linear:
        return None
    if args.squared_relu:
        return "megatron fuses a bias only into GeLU, SwiGLU and quick-GeGLU (--squared-relu)"
    if args.num_experts and not args.quick_geglu:
        # SequentialMLP and TEGroupedMLP hand every expert the router's probabilities, and
        # megatron fuses those with a bias only for SwiGLU and quick-GeGLU
        return ("megatron's MoE experts fuse the bias and the router's probabilities only into "
                "SwiGLU and quick-GeGLU; the MLP applies the exact GeLU instead of the fused "
                "tanh approximation")
    return None


def adapt_megatron_quirks(p) -> None:
    """Settings megatron's parser accepts that its own code then rejects (a step of the
    launch's resolution, over its planner ``p``)."""
    args = p.v
    mode = getattr(args, "rerun_mode", None)
    if mode in RERUN_MODE_SPELLINGS:
        p.set("rerun_mode", RERUN_MODE_SPELLINGS[mode])
        p.choose(RERUN_MODE, args.rerun_mode, Reason(
            Why.MEGATRON, "megatron's parser and its RerunMode enum spell it differently"))
        p.log(f"compat: --rerun-mode {mode} is megatron's RerunMode {args.rerun_mode!r} (its "
              "parser and its enum spell it differently)")
    conflict = bias_activation_fusion_conflict(args)
    if conflict:
        p.set("bias_gelu_fusion", False)
        p.choose(NO_BIAS_GELU_FUSION, True, Reason(Why.MEGATRON, conflict))
        p.log(f"compat: --no-bias-gelu-fusion: {conflict}")
    if (args.num_experts and getattr(args, "moe_grouped_gemm", False)
            and args.transformer_impl != "transformer_engine"):
        # megatron's local backend (LocalSpecProvider.grouped_mlp_modules) builds its
        # sequential experts whatever the flag says
        p.log("compat: --moe-grouped-gemm under megatron's local modules: megatron runs the "
              "experts one after another (SequentialMLP, a GEMM per expert); only Transformer "
              "Engine's layers group them")
    if (args.num_experts and args.add_bias_linear and args.bias_dropout_fusion
            and experts_add_bias_out_of_place(args)):
        # megatron's TEGroupedMLP asserts on it while the model is built
        p.set("bias_dropout_fusion", False)
        p.choose(NO_BIAS_DROPOUT_FUSION, True, Reason(
            Why.MEGATRON, "Transformer Engine's grouped experts with linear biases add the bias "
            "themselves"))
        p.log("compat: --no-bias-dropout-fusion: Transformer Engine's grouped experts with "
              "linear biases add the bias themselves, and megatron builds them only without "
              "its bias-dropout fusion")
