"""Where the fast spec's FP8 linears (``fp8.py``) can run, decided once from the arguments.

``fast_fp8_unsupported_reason(args)`` says what of a ``--fp8-format`` launch the fast spec
cannot run in FP8 (None: it can); ``fp8_hardware_reason(args)`` what of the GPU cannot (no
FP8 tensor cores, or ``--cpu``) and ``fp8_shape_reason(args)`` which GEMM dimension, for
TE's layers as for the fast spec. ``megagpt.compat``
refuses with them where nothing else could run the launch, ``megagpt.layer_impl`` picks the
layers with them where Transformer Engine is installed, and the fast path's plan turns the
launch into the fast spec's ``Fp8Recipe`` (``recipe_from_args``), whose weights the flat
AdamW step writes in FP8 unless ``weight_writes_unsupported_reason(args)`` says why not.
"""

from __future__ import annotations

from typing import Optional

from .fp8 import ALL_LINEARS, AMAX_ALGOS, FC1, FC2, FORMATS, LINEAR_NAMES, PROJ, QKV, Fp8Recipe

# cuBLAS's FP8 GEMM: every dimension of both operands a multiple of 16
FP8_GEMM_MULTIPLE = 16
# FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
FP8_COMPUTE_CAPABILITY = (8, 9)
FAST_RECIPES = ("tensorwise", "delayed")
# The narrowest GEMM measured to gain in FP8 (--fast-fp8-min-width's default): at 345M
# (hidden 1024, 8192 tokens per micro-batch, the attention projection 8192 x 1024 x 1024)
# the step took 41.7 ms in FP8 against 44.5 in bf16 (1.067x; 1.3B: 1.262x; one H200,
# 2026-12-04, bench_throughput.py). Narrower GEMMs are not measured to gain: each linear's
# own FP8 advantage shrinks with its width (bench/bench_fp8_gemm.py --shapes 345M,1.3B:
# the projection 0.55x and 0.93x, fc2 0.97x and 1.36x, scales computed eagerly there),
# so a linear with a dimension below this stays in bf16, and the plan says which.
FP8_MIN_WIDTH = 1024


def recipe_from_args(args, emulate: bool = False) -> Fp8Recipe:
    """The fast spec's FP8 recipe for megatron's fp8 arguments (``fast_fp8``: the format,
    once the plan has taken ``--fp8-format`` off megatron's own ``fp8``), on the linears
    wide enough to gain (``linears_in_fp8``; all four where none is)."""
    fmt = getattr(args, "fast_fp8", None) or getattr(args, "fp8", None)
    linears = tuple(i for i, _ in linears_in_fp8(args)[0]) or ALL_LINEARS
    return Fp8Recipe(
        linears=linears,
        format=fmt, scaling=getattr(args, "fp8_recipe", None) or "delayed",
        margin=int(getattr(args, "fp8_margin", 0) or 0),
        history_len=int(getattr(args, "fp8_amax_history_len", 1) or 1),
        amax_algo=getattr(args, "fp8_amax_compute_algo", None) or "most_recent",
        wgrad=bool(getattr(args, "fp8_wgrad", True)),
        # the entry's own options: unset, the recipe's defaults (TE's delayed scaling)
        first_scales=getattr(args, "fast_fp8_first_scales", None) or Fp8Recipe.first_scales,
        grad_scaling=getattr(args, "fast_fp8_grad_scaling", None) or Fp8Recipe.grad_scaling,
        emulate=emulate)


def _size(args, name: str) -> int:
    return int(getattr(args, name, 1) or 1)


def gemm_dimensions(args) -> dict[str, int]:
    """The dimensions of the fused layer's GEMMs on one tensor-parallel rank, by name (those
    the arguments give: megatron's validation names a missing size itself)."""
    tp = _size(args, "tensor_model_parallel_size")
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    dims = {}
    if hidden and heads:
        head_dim = int(getattr(args, "kv_channels", None) or hidden // heads)
        groups = (int(args.num_query_groups) if getattr(args, "group_query_attention", False)
                  and getattr(args, "num_query_groups", None) else heads)
        ffn = int(getattr(args, "ffn_hidden_size", None) or 4 * hidden)
        glu = bool(getattr(args, "swiglu", False))
        dims.update({
            "--hidden-size": int(hidden),
            "the QKV output per tensor-parallel rank": (heads + 2 * groups) * head_dim // tp,
            "the attention heads' width per tensor-parallel rank": heads * head_dim // tp,
            "--ffn-hidden-size per tensor-parallel rank": ffn // tp,
            "fc1's output per tensor-parallel rank": ffn * (2 if glu else 1) // tp,
        })
    seq, micro = getattr(args, "seq_length", None), getattr(args, "micro_batch_size", None)
    if seq and micro:
        dims["tokens per micro-batch (--seq-length x --micro-batch-size)"] = int(seq) * int(micro)
    return dims


def linear_gemms(args) -> dict[int, tuple[int, int, int]]:
    """Each fused-layer linear's GEMM on one tensor-parallel rank: (tokens, in, out)."""
    dims = gemm_dimensions(args)
    tokens = next((v for k, v in dims.items() if k.startswith("tokens")), None)
    if "--hidden-size" not in dims or tokens is None:
        return {}
    hidden = dims["--hidden-size"]
    return {QKV: (tokens, hidden, dims["the QKV output per tensor-parallel rank"]),
            PROJ: (tokens, dims["the attention heads' width per tensor-parallel rank"], hidden),
            FC1: (tokens, hidden, dims["fc1's output per tensor-parallel rank"]),
            FC2: (tokens, dims["--ffn-hidden-size per tensor-parallel rank"], hidden)}


def linears_in_fp8(args) -> tuple[list[tuple[int, str]], list[str]]:
    """(the linears that run in FP8, with their GEMM; what stays in bf16, and why) under
    ``--fast-fp8-min-width`` (default ``FP8_MIN_WIDTH``; 0: every linear)."""
    floor = getattr(args, "fast_fp8_min_width", None)
    floor = FP8_MIN_WIDTH if floor is None else int(floor)
    gemms = linear_gemms(args)
    if not gemms:  # sizes not given (megatron's validation names them): nothing to judge
        return [(i, LINEAR_NAMES[i]) for i in ALL_LINEARS], []
    fp8, bf16 = [], []
    for linear, (m, k, n) in gemms.items():
        gemm = f"{LINEAR_NAMES[linear]} {m}x{k}x{n}"
        if min(m, k, n) >= floor:
            fp8.append((linear, gemm))
        else:
            bf16.append(f"{gemm} (a dimension below {floor})")
    return fp8, bf16


def fast_fp8_unsupported_reason(args) -> Optional[str]:
    """What of this ``--fp8-format`` launch the fast spec's FP8 cannot run (None: it can).

    The hardware is ``fp8_hardware_reason``'s; this is the launch: the recipe, the layer
    path (FP8 runs in the fused layer's four linears), the GEMM shapes. The fast spec's own
    limits (``spec.fast_spec_unsupported_reason``, which asks this) come on top."""
    fmt = getattr(args, "fp8", None) or getattr(args, "fast_fp8", None)
    if fmt not in FORMATS:
        return f"--fp8-format {fmt}"
    recipe = getattr(args, "fp8_recipe", None) or "delayed"
    if recipe not in FAST_RECIPES:
        return f"--fp8-recipe {recipe} (the fast spec runs tensorwise and delayed scaling)"
    if (getattr(args, "fp8_amax_compute_algo", None) or "most_recent") not in AMAX_ALGOS:
        return f"--fp8-amax-compute-algo {args.fp8_amax_compute_algo}"
    for flag, attr in (("--fp8-param-gather", "fp8_param_gather"),
                       ("--fp8-dot-product-attention", "fp8_dot_product_attention"),
                       ("--fp8-multi-head-attention", "fp8_multi_head_attention"),
                       ("--first-last-layers-bf16", "first_last_layers_bf16"),
                       ("--fp4-format", "fp4")):
        if getattr(args, attr, None):
            return f"{flag} (Transformer Engine's FP8 modules)"
    if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        return "FP8 linears with fp32 parameters (add --bf16)"
    if getattr(args, "num_experts", None):
        return "MoE experts (the fast spec's FP8 runs in its dense fused layer)"
    if getattr(args, "recompute_granularity", None) or getattr(args, "recompute_activations",
                                                                 False):
        return "activation recompute (the fused layer, where FP8 runs, does not recompute)"
    if not getattr(args, "fast_spec_fused_layer", True):
        return "--fast-disable fused-layer (FP8 runs in the fused layer)"
    if getattr(args, "overlap_param_gather", False):
        return "--overlap-param-gather (it keeps megatron's layer, which has no FP8 without TE)"
    return None


def fp8_shape_reason(args) -> Optional[str]:
    """A GEMM dimension FP8 cannot take (None: every one is a multiple of 16, as cuBLAS's FP8
    GEMM, which Transformer Engine calls too, needs)."""
    for what, size in gemm_dimensions(args).items():
        if size % FP8_GEMM_MULTIPLE:
            return (f"{what} is {size}, not a multiple of {FP8_GEMM_MULTIPLE} (FP8 GEMMs, "
                    "Transformer Engine's too, need multiples of 16)")
    return None


def fp8_hardware_reason(args) -> Optional[str]:
    """Why this launch's GPU cannot run FP8 (None: it can, or there is no GPU to ask).

    ``--cpu`` has none; a dry run plans for ``--gpu-type`` (else this machine's GPU, else
    megagpt.gpus's default, an A100); a launch asks CUDA for its GPU's compute capability."""
    if getattr(args, "cpu", False):
        return ("FP8 needs a GPU with FP8 tensor cores (compute capability 8.9 or later); "
                "--cpu trains in fp32")
    if getattr(args, "dry_run", False) or getattr(args, "gpu_type", None):
        from megagpt.gpus import resolve_gpu

        gpu = resolve_gpu(getattr(args, "gpu_type", None), None)
        if gpu.spec is not None and gpu.spec.fp8_tflops is None:
            return (f"the {gpu.name} ({gpu.source}) has no FP8 tensor cores (compute "
                    "capability 8.9 or later: H100, H200, L40S); train it in bf16")
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    capability = torch.cuda.get_device_capability()
    if tuple(capability) < FP8_COMPUTE_CAPABILITY:
        name = torch.cuda.get_device_name()
        return (f"this GPU ({name}, compute capability {capability[0]}.{capability[1]}) has "
                "no FP8 tensor cores (8.9 or later: H100, H200, L40S); train it in bf16")
    return None


def weight_writes_unsupported_reason(args) -> Optional[str]:
    """Why the flat AdamW step cannot write the FP8 linears' weights for their forwards
    (None: it writes them; ``Fp8Recipe.weights_written``); where it cannot, each forward
    casts them. A pure function of the arguments as the plan has decided them so far."""
    from megagpt.launch.fast_path_reasons import _planned_data_parallel_size

    if not getattr(args, "fast_fp8_weight_writes", True):
        return "--fast-disable fp8-weight-writes"
    recipe = getattr(args, "fp8_recipe", None) or "delayed"
    if recipe != "delayed":
        return (f"--fp8-recipe {recipe}: a current scale is the weight's own amax, known only "
                "once the weight is written")
    if not getattr(args, "fast_optimizer", True):
        return "--fast-disable optimizer (the flat AdamW step writes them)"
    if not getattr(args, "fast_flat_adam", True):
        return "--fast-disable flat-adam (the flat AdamW step writes them)"
    if not getattr(args, "bf16", False):
        return "the flat AdamW step serves megatron's bf16 optimizer only (add --bf16)"
    optimizer = getattr(args, "optimizer", "adam") or "adam"
    if optimizer != "adam":
        return f"--optimizer {optimizer} (the flat step is AdamW's)"
    for flag, attr in (("--use-distributed-optimizer", "use_distributed_optimizer"),
                       ("--use-megatron-fsdp", "use_megatron_fsdp"),
                       ("--use-torch-fsdp2", "use_torch_fsdp2")):
        if getattr(args, attr, False):
            return f"{flag} (each rank steps a shard of every weight)"
    for flag, attr in (("--use-precision-aware-optimizer", "use_precision_aware_optimizer"),
                       ("--optimizer-cpu-offload", "optimizer_cpu_offload"),
                       ("--log-num-zeros-in-grad", "log_num_zeros_in_grad")):
        if getattr(args, attr, False):
            return f"{flag} (the flat AdamW step does not run)"
    if _size(args, "tensor_model_parallel_size") > 1:
        return "tensor parallelism (each rank's shards are cast in its forward)"
    micro = _size(args, "micro_batch_size")
    per_step = _size(args, "global_batch_size") // (micro * _planned_data_parallel_size(args))
    if per_step > 1 or getattr(args, "rampup_batch_size", None):
        # each forward after the first scales by the history the one before it recorded
        return ("more than one micro-batch per step (the optimizer's copies serve the "
                "step's first forward only)")
    return None
