"""What a launch costs: parameters, memory per GPU and FLOPs, from validated megatron args.

Parameters are counted exactly for megatron's dense GPT (the local, fast and TE specs hold
the same tensors); ``tests/test_preflight.py`` checks the count against a built GPTModel.
Activations and FLOPs reuse megatron's own formulas
(``megatron.training.theoretical_memory_usage``, ``training.num_floating_point_operations``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

GIB = 2**30


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerParams:
    """One transformer layer, split by how tensor parallelism holds it."""

    sharded: int  # split over TP ranks: QKV, projection, fc1, fc2 weights; column-parallel biases
    replicated: int  # on every TP rank: layer norms, row-parallel biases

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def _norm_params(args, width: int) -> int:
    return width if args.normalization == "RMSNorm" else 2 * width  # RMSNorm has no bias


def layer_params(args) -> LayerParams:
    h, heads = args.hidden_size, args.num_attention_heads
    head_dim = args.kv_channels or h // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    bias = args.add_bias_linear
    qkv_bias = bias or getattr(args, "add_qkv_bias", False)
    fc1_out = args.ffn_hidden_size * (2 if args.swiglu else 1)

    qkv_out = (heads + 2 * groups) * head_dim
    sharded = (h * qkv_out + (qkv_out if qkv_bias else 0)  # linear_qkv (column parallel)
               + heads * head_dim * h  # linear_proj (row parallel)
               + h * fc1_out + (fc1_out if bias else 0)  # linear_fc1 (column parallel)
               + args.ffn_hidden_size * h)  # linear_fc2 (row parallel)
    replicated = 2 * _norm_params(args, h) + (2 * h if bias else 0)  # norms; proj, fc2 biases
    if getattr(args, "qk_layernorm", False):
        replicated += 2 * _norm_params(args, head_dim)
    return LayerParams(sharded, replicated)


@dataclass(frozen=True)
class StageParams:
    """Parameters one pipeline stage holds (whole, and on one of its TP ranks)."""

    index: int
    layers: int
    total: int
    per_tp_rank: int
    tied_copy: int  # the last stage's copy of the tied word embedding (PP > 1)


@dataclass(frozen=True)
class ParameterCount:
    total: int  # unique parameters of the model
    embedding: int  # word + position embeddings (output layer too when untied)
    stages: tuple[StageParams, ...]

    @property
    def most_per_gpu(self) -> int:
        return max(s.per_tp_rank for s in self.stages)


def layers_per_stage(args) -> list[int]:
    """Transformer layers on each pipeline stage (even split, or the first/last overrides)."""
    pp, n = args.pipeline_model_parallel_size, args.num_layers
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is None and last is None:
        return [n // pp] * pp
    fixed = {0: first, pp - 1: last}
    middle_stages = pp - sum(v is not None for v in fixed.values())
    middle = (n - (first or 0) - (last or 0)) // max(middle_stages, 1)
    return [fixed.get(i) if fixed.get(i) is not None else middle for i in range(pp)]


def count_parameters(args) -> ParameterCount:
    """Exact parameter counts for a dense GPT from validated args (padded_vocab_size set)."""
    if args.num_experts is not None or args.multi_latent_attention:
        raise NotImplementedError("the parameter breakdown covers dense GPT (no MoE, no MLA)")
    h, tp = args.hidden_size, args.tensor_model_parallel_size
    word = args.padded_vocab_size * h  # vocab-parallel: split over TP
    position = args.max_position_embeddings * h \
        if args.position_embedding_type == "learned_absolute" else 0  # replicated
    output = word if args.untie_embeddings_and_output_weights else 0
    final_norm = _norm_params(args, h)
    layer = layer_params(args)
    counts = layers_per_stage(args)
    pp = len(counts)

    stages = []
    for i, n in enumerate(counts):
        sharded, replicated = n * layer.sharded, n * layer.replicated
        tied_copy = 0
        if i == 0:
            sharded += word
            replicated += position
        if i == pp - 1:
            replicated += final_norm
            if output:
                sharded += output
            elif pp > 1:
                tied_copy = word  # the last stage keeps its own copy of the tied embedding
                sharded += word
        stages.append(StageParams(i, n, sharded + replicated, sharded // tp + replicated,
                                  tied_copy))
    total = sum(s.total - s.tied_copy for s in stages)
    return ParameterCount(total, word + position + output, tuple(stages))


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------

# CUDA context, NCCL buffers, cuBLAS workspaces and allocator slack: not in any formula.
RUNTIME_RESERVE_GIB = 2.0


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the most loaded rank."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    activation_formula: str
    reserve: float = RUNTIME_RESERVE_GIB * GIB

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.reserve


def _dtype_bytes(dtype, default: int) -> int:
    import torch

    if not isinstance(dtype, torch.dtype):
        return default
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_parameter(args) -> tuple[int, int, float]:
    """(weight, gradient, optimizer-state) bytes per parameter on one GPU.

    Mixed precision (bf16/fp16) keeps 16-bit weights, fp32 main gradients, and an fp32
    master copy plus Adam's two moments (4 + 4 + 4 bytes); the distributed optimizer
    splits the optimizer state over the data-parallel ranks.
    """
    mixed = args.bf16 or args.fp16
    weight = 2 if mixed else 4
    grad = 4 if (args.accumulate_allreduce_grads_in_fp32 or not mixed) else 2
    master = _dtype_bytes(getattr(args, "main_params_dtype", None), 4) if mixed else 0
    if args.optimizer.startswith("adam"):
        moments = (_dtype_bytes(getattr(args, "exp_avg_dtype", None), 4)
                   + _dtype_bytes(getattr(args, "exp_avg_sq_dtype", None), 4))
    else:  # sgd: momentum
        moments = 4
    optimizer = master + moments
    if args.use_distributed_optimizer:
        optimizer /= args.data_parallel_size
    return weight, grad, optimizer


def activation_bytes(args, num_microbatches: int) -> tuple[float, str]:
    """Activation memory of the first pipeline stage, by megatron's formulas.

    Megatron picks the formula the way ``report_theoretical_memory`` does: Korthikanti et
    al. (sequence parallel with selective recomputation) or its estimate without sequence
    parallelism. Both assume 16-bit activations; fp32 doubles them. Full recomputation is
    not modelled by either, so the figure is then an upper bound.
    """
    from megatron.training import theoretical_memory_usage as tmu

    a = copy.copy(args)
    if a.sequence_parallel and a.recompute_granularity == "selective":
        value = tmu.compute_activation_memory(a, num_microbatches=num_microbatches)
        formula = "megatron compute_activation_memory (sequence parallel, selective recompute)"
    else:
        value = tmu.compute_activation_memory_without_sp(a, num_microbatches=num_microbatches)
        formula = "megatron compute_activation_memory_without_sp"
    if not (args.bf16 or args.fp16):
        value *= 2
        formula += ", ×2 for fp32"
    if args.recompute_granularity == "full":
        formula += "; upper bound: full recomputation is not modelled"
    return value, formula


def estimate_memory(args, params: ParameterCount, num_microbatches: int) -> MemoryEstimate:
    weight, grad, optimizer = bytes_per_parameter(args)
    n = params.most_per_gpu
    activations, formula = activation_bytes(args, num_microbatches)
    return MemoryEstimate(n * weight, n * grad, n * optimizer, activations, formula)


def megatron_weight_and_optimizer_bytes(args) -> float:
    """Megatron's own weight + optimizer figure (bf16 rule of 18 bytes per parameter)."""
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    return compute_weight_and_optimizer_memory(copy.copy(args))  # it writes num_query_groups


# ---------------------------------------------------------------------------
# FLOPs and batch
# ---------------------------------------------------------------------------

def flops_per_iteration(args) -> float:
    """Model FLOPs of one global batch (forward + backward), as --log-throughput counts them."""
    from megatron.training.training import num_floating_point_operations

    return float(num_floating_point_operations(copy.copy(args), args.global_batch_size))


def microbatches_per_step(args) -> int:
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def human(n: float, unit: str = "") -> str:
    """1.75e11 -> '175.0B'."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def gib(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"
