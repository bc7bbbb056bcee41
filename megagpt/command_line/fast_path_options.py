"""The fast path's command line: ten options added to megatron's parser.

  --no-fast-spec                  megatron's layers instead of the fast spec
  --fast-cuda-graphs {auto,none,iteration,layers}
                                  one CUDA graph per iteration, graphs per layer, or none
  --fast-compile {auto,on,off}    torch.compile the fused layer and the chunked loss
  --fast-disable PIECE[,PIECE]    turn named pieces off, to measure what each is worth
  --fast-cuda-graph-capture-timeout SECONDS
  --fast-fp8-min-width N          with --fp8-format, linears narrower than N in bf16
  --fast-fp8-first-scales {amax,unit}
                                  delayed scaling's first forward: TE's 1, or own amax
  --fast-fp8-grad-scaling {current,delayed}
                                  delayed scaling's gradients: TE's history, or own amax
  --fast-fp8-weight-writes        delayed scaling's FP8 weights written by the optimizer
  --fast-multi-gpu-path           on one GPU, the path of a launch on several GPUs

They set the namespace attributes the launch's resolution reads (``fast_cuda_graph``,
``fast_layer_graphs``, ``fast_spec_compile`` and one per piece, ``PIECES``); "auto" leaves
an attribute None for the resolution to decide (``megagpt.launch.fast_path``). What each
piece does and what it measured: bench/notes/fast-path.md.
"""

from __future__ import annotations

import argparse

from megagpt.errors import UserError

# --fast-disable's pieces: name -> (namespace attribute, its value when disabled)
PIECES = {
    "fused-layer": ("fast_spec_fused_layer", False),
    "hash-dropout": ("fast_hash_dropout", False),
    "optimizer": ("fast_optimizer", False),
    "flat-adam": ("fast_flat_adam", False),
    "async-step": ("fast_async_step", False),
    "lm-loss": ("fast_lm_loss", False),
    "lm-grad-in-forward": ("fast_lm_grad_in_forward", False),
    "bf16-grad-buffer": ("fast_bf16_grad_buffer", False),
    "grad-write": ("fast_grad_write", False),
    "deferred-nan-checks": ("fast_step_nan_checks", True),
}

# every namespace attribute the options set, with its value when none is given (None: the
# plan decides); for namespaces that did not go through this parser too
SWITCH_DEFAULTS = (
    ("fast_spec", True),
    ("fast_spec_fused_layer", True),
    ("fast_spec_compile", None),
    ("fast_hash_dropout", True),
    ("fast_cuda_graph", None),
    ("fast_layer_graphs", None),
    ("fast_cuda_graph_capture_timeout", 300.0),
    ("fast_multi_gpu_path", False),
    ("fast_fp8_min_width", None),
    ("fast_fp8_first_scales", None),
    ("fast_fp8_grad_scaling", None),
    ("fast_fp8_weight_writes", False),
    ("fast_step_nan_checks", False),
    ("fast_optimizer", True),
    ("fast_lm_loss", True),
    ("fast_lm_grad_in_forward", True),
    ("fast_async_step", True),
    ("fast_flat_adam", True),
    ("fast_bf16_grad_buffer", None),
    ("fast_grad_write", None),
)

# --fast-cuda-graphs -> (fast_cuda_graph, fast_layer_graphs); None: the plan decides
CUDA_GRAPHS = {
    "auto": (None, None),
    "none": (False, False),
    "iteration": (True, False),
    "layers": (False, True),
}
COMPILE = {"auto": None, "on": True, "off": False}

# options of earlier versions, and what says the same now
REPLACED_FLAGS = {
    "--fast-cuda-graph": "--fast-cuda-graphs iteration",
    "--no-fast-cuda-graph": "--fast-cuda-graphs none (or layers)",
    "--fast-layer-graphs": "--fast-cuda-graphs layers",
    "--no-fast-layer-graphs": "--fast-cuda-graphs none",
    "--fast-spec-compile": "--fast-compile on",
    "--no-fast-spec-compile": "--fast-compile off",
    "--fast-step-nan-checks": "--fast-disable deferred-nan-checks",
    "--fast-bf16-grad-buffer": "--grad-reduce-in-bf16 (megatron's)",
    "--fast-grad-write": "nothing: it is on wherever it applies",
    "--fast-wgrad-fusion": "nothing: it measured within run-to-run noise and was removed",
    "--no-fast-one-block-rows": "nothing: it measured under 1 % and was removed",
    **{f"--no-fast-{piece}": f"--fast-disable {piece}" for piece in PIECES},
    "--no-fast-spec-fused-layer": "--fast-disable fused-layer",
}


def check_replaced_flags(argv: list[str]) -> None:
    """One line naming the option that replaced an earlier version's, before parsing."""
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag in REPLACED_FLAGS:
            raise UserError(f"{flag} is no longer an option: use {REPLACED_FLAGS[flag]}")


def _pieces(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PIECES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown piece(s) {', '.join(unknown)}; known: {', '.join(PIECES)}")
    return names


class _SetAttributes(argparse.Action):
    """Stores a choice as the namespace attributes it stands for."""

    def __init__(self, option_strings, dest, table, **kwargs):
        self.table = table
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(values, list):  # --fast-disable given more than once: all of them
            values = [*(getattr(namespace, self.dest, None) or []), *values]
        setattr(namespace, self.dest, values)
        for name, value in self.table(values):
            setattr(namespace, name, value)


def _graph_attributes(choice):
    return zip(("fast_cuda_graph", "fast_layer_graphs"), CUDA_GRAPHS[choice])


def _compile_attributes(choice):
    return [("fast_spec_compile", COMPILE[choice])]


def _disabled_attributes(names):
    return [PIECES[name] for name in names]


def add_fast_path_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the fast path's options to ``parser`` (an ArgumentParser or an argument group)."""
    if isinstance(parser, argparse.ArgumentParser):
        group = parser.add_argument_group(title="fast path (megagpt.fast_spec)")
    else:  # already an argument group: argparse deprecates nesting groups
        group = parser
    group.add_argument(
        "--no-fast-spec", action="store_false", dest="fast_spec",
        help="Build megatron's layers (TE's where installed, else its local spec) instead of "
        "the fast spec.")
    group.add_argument(
        "--fast-cuda-graphs", choices=tuple(CUDA_GRAPHS), default="auto",
        action=_SetAttributes, table=_graph_attributes,
        help="CUDA graphs: one per iteration, per layer, or none. auto: per iteration on "
        "one GPU, per layer on several without model parallelism.")
    group.add_argument(
        "--fast-compile", choices=tuple(COMPILE), default="auto",
        action=_SetAttributes, table=_compile_attributes,
        help="torch.compile the fused layer and the chunked loss. auto: where CUDA graphs "
        "hold the layers.")
    group.add_argument(
        "--fast-disable", type=_pieces, default=[], metavar="PIECE[,PIECE]",
        action=_SetAttributes, table=_disabled_attributes,
        help=f"Turn pieces of the fast path off, to measure them: {', '.join(PIECES)}.")
    group.add_argument(
        "--fast-cuda-graph-capture-timeout", type=float, default=300.0, metavar="SECONDS",
        help="Stop, naming the rank, when the full-iteration graph's capture has not "
        "finished after this long (default 300).")
    group.add_argument(
        "--fast-fp8-min-width", type=int, default=None, metavar="N",
        help="With --fp8-format, a fused-layer linear whose GEMM has a dimension (tokens, "
        "in or out features) below N stays in bf16 (default 1024, the narrowest measured to "
        "gain; 0: every linear in FP8).")
    group.add_argument(
        "--fast-fp8-first-scales", choices=("amax", "unit"), default=None,
        help="With --fp8-format under delayed scaling, what a layer's first forward scales "
        "by before any amax is recorded: 1 for inputs, weights and gradients, as Transformer "
        "Engine's delayed scaling (unit, the default; a resume takes amax) or each tensor's "
        "own amax (amax).")
    group.add_argument(
        "--fast-fp8-grad-scaling", choices=("current", "delayed"), default=None,
        help="With --fp8-format under delayed scaling, what output gradients scale by: the "
        "amax the backwards before recorded, as Transformer Engine's delayed scaling "
        "(delayed, the default) or their own amax (current).")
    group.add_argument(
        "--fast-fp8-weight-writes", action="store_true",
        help="With --fp8-format under delayed scaling, the flat AdamW step writes the FP8 "
        "linears' weights (both layouts, with their amax) instead of each forward casting "
        "them. Not the default: measured slower on an H100 (bench/notes/fp8.md).")
    group.add_argument(
        "--fast-multi-gpu-path", action="store_true",
        help="On one GPU, take the path of a launch on several data-parallel GPUs, to "
        "measure it.")
    group.set_defaults(**dict(SWITCH_DEFAULTS))
    return parser
