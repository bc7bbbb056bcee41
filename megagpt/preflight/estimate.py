"""What a launch costs: parameters, memory per GPU and FLOPs, from validated megatron args.

Parameters are counted exactly for megatron's dense GPT (the local, fast and TE specs hold
the same tensors); ``tests/test_preflight.py`` checks the count against a built GPTModel.
Activations follow Korthikanti et al. 2022 for each recompute setting; FLOPs are megatron's
own count (``training.num_floating_point_operations``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from megagpt.fast_spec.fp8 import FC1, FC2, PROJ, QKV
from megagpt.preflight.launch_path import LOCAL, TE, WhatRuns, fused_softmax, softmax_in_fp32

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

    weights: float  # with the FP8 copies the optimizer writes (fp8_weight_store_bytes)
    gradients: float
    optimizer: float
    activations: float
    activation_formula: str
    reserve: float = RUNTIME_RESERVE_GIB * GIB
    # what the optimizer step allocates after the backward has freed the activations (fp32
    # copies of 16-bit gradients, Adam's temporaries): the peak is the larger of the two
    gradient_copies: float = 0.0
    optimizer_temporaries: float = 0.0

    @property
    def optimizer_step(self) -> float:
        return self.gradient_copies + self.optimizer_temporaries

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer
                + max(self.activations, self.optimizer_step) + self.reserve)


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
    if mixed and getattr(args, "grad_reduce_in_bf16", False):
        grad = 2
    master = _dtype_bytes(getattr(args, "main_params_dtype", None), 4) if mixed else 0
    if args.optimizer.startswith("adam"):
        moments = (_dtype_bytes(getattr(args, "exp_avg_dtype", None), 4)
                   + _dtype_bytes(getattr(args, "exp_avg_sq_dtype", None), 4))
    else:  # sgd: momentum
        moments = 4
    optimizer = master + moments
    if args.use_distributed_optimizer:
        optimizer /= args.data_parallel_size
    if getattr(args, "optimizer_cpu_offload", False):  # that share of the state in host memory
        optimizer *= 1 - getattr(args, "optimizer_offload_fraction", 1.0)
    return weight, grad, optimizer


# Bytes per [b, heads/TP, s, s] element unfused attention keeps for its backward: the
# softmax's output (2, kept by the softmax for its gradient), the dropout mask (1) and the
# dropout's output (2, kept by the PV product): Korthikanti et al. 2022's 5·a·s/h. Torch's
# fallback with an fp32 softmax keeps the softmax's output in fp32: 2 more. The compiled
# kernel computes in fp32 but keeps a 16-bit output.
SCORE_BYTES_KEPT = 5
SCORE_BYTES_FP32_SOFTMAX_EXTRA = 2


def score_bytes_per_element(args) -> int:
    fp32_copy = not fused_softmax(args) and softmax_in_fp32(args)
    return SCORE_BYTES_KEPT + (SCORE_BYTES_FP32_SOFTMAX_EXTRA if fp32_copy else 0)


def layer_activation_bytes(args, recompute: str, runs: WhatRuns) -> float:
    """Bytes one transformer layer keeps for its backward, one micro-batch, 16-bit.

    Korthikanti et al. 2022 (arXiv 2205.05198), §4 and Table 2, per token and per hidden
    element: attention 11 (input of QKV 2, Q, K, V 6, input of the projection 2, dropout mask
    1) + MLP 19 (fc1 input 2, activation input 8, fc2 input 8, mask 1) + norms 4 = 34, plus
    5·heads·s/h for unfused attention's softmax output, dropout mask and dropout output
    (``SCORE_BYTES_KEPT``; 7 with torch's fp32 softmax). Flash attention keeps
    only its output and softmax statistics, and selective recompute drops that term too.
    Without sequence parallelism the norms' and dropouts' inputs (10 of the 34) sit whole on
    every TP rank; with it, everything is split over TP. Grouped-query attention, GLU and
    other FFN widths change the QKV and MLP terms. Under full recompute a layer keeps its input
    alone (2). ``runs``: the launch's layers and FP8 linears.
    """
    h, heads, tp = args.hidden_size, args.num_attention_heads, args.tensor_model_parallel_size
    groups = args.num_query_groups if args.group_query_attention else heads
    seq = args.seq_length // args.context_parallel_size
    sbh = seq * args.micro_batch_size * h
    sp = bool(args.sequence_parallel) and tp > 1
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    fc1_out = args.ffn_hidden_size * (2 if args.swiglu else 1)
    replicated = 10.0
    split = (4 + 4 * groups / heads  # Q, K, V
             + 2  # projection input
             + 2 * fc1_out / h + 2 * args.ffn_hidden_size / h)  # activation and fc2 inputs
    unfused = runs.path == LOCAL  # megatron's DotProductAttention: the scores in memory
    scores = score_bytes_per_element(args) * heads * seq / h \
        if unfused and recompute != "selective" else 0.0
    if runs.fp8:
        # the GEMMs keep their inputs in FP8 for the weight gradients: the QKV and fc1 inputs
        # (norm outputs) and the fc2 input in 1 byte instead of 2; the projection's input is
        # also attention's output, which attention's backward keeps in 16-bit beside it
        replicated -= 2
        split += 1 - args.ffn_hidden_size / h
    # the copies the optimizer writes are held between steps instead (fp8_weight_store_bytes)
    weights = _fp8_weight_copy_bytes(args) if runs.fp8 and not runs.fp8_weights_written \
        else 0.0
    if sp:
        return sbh * (replicated + split + scores) / tp + weights
    return sbh * (replicated + (split + scores) / tp) + weights


def _fp8_weight_copy_bytes(args) -> float:
    """Under FP8, the transposed FP8 copy of each linear weight that a layer's forward keeps
    for its input-gradient GEMM: 1 byte per weight of the layer on this TP rank."""
    return float(sum(_linear_weights(args).values())) / args.tensor_model_parallel_size


def _linear_weights(args) -> dict[int, int]:
    """The elements of each fused-layer linear's weight (``fast_spec.fp8``'s QKV, PROJ, FC1,
    FC2), all TP ranks together."""
    h, heads = args.hidden_size, args.num_attention_heads
    head_dim = args.kv_channels or h // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    fc1_out = args.ffn_hidden_size * (2 if args.swiglu else 1)
    return {QKV: h * (heads + 2 * groups) * head_dim, PROJ: heads * head_dim * h,
            FC1: h * fc1_out, FC2: args.ffn_hidden_size * h}


def fp8_weight_store_bytes(args, runs: WhatRuns) -> float:
    """The FP8 weights the optimizer writes for the fast spec's FP8 linears (delayed
    scaling): both layouts, 2 bytes per weight of the FP8 linears of the most loaded
    stage's layers, held between steps."""
    if not (runs.fp8 and runs.fp8_weights_written):
        return 0.0
    per_layer = sum(n for linear, n in _linear_weights(args).items()
                    if linear in runs.fp8_linears)
    return 2.0 * per_layer * layers_per_stage(args)[0] / args.tensor_model_parallel_size


def in_flight_microbatches(args, num_microbatches: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak: 1F1B warms
    up with PP of them; the interleaved schedule holds (1 + (PP − 1)/(PP·v)) times as many
    layers' worth (Narayanan et al. 2021, §2.2; Korthikanti et al. 2022, §4.2.3)."""
    pp = args.pipeline_model_parallel_size
    if pp == 1:
        return 1.0
    v = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    held = min(num_microbatches, pp)
    return held * (1 + (pp - 1) / (pp * v)) if v > 1 else held


def _logits_bytes(args, runs: WhatRuns) -> float:
    """The loss's buffers on the last stage: megatron keeps the [tokens, vocab/TP] logits in
    16-bit and the fp32 softmax for the backward (6 bytes per element); the launch's chunked
    loss keeps none of that size."""
    if runs.chunked_loss:
        return 0.0
    tokens = args.seq_length // args.context_parallel_size * args.micro_batch_size
    return tokens * args.padded_vocab_size / args.tensor_model_parallel_size * 6


def activation_bytes(args, num_microbatches: int, runs: WhatRuns) -> tuple[float, str]:
    """Activation bytes on the most loaded GPU, and how they were counted.

    Per layer ``layer_activation_bytes``; times the layers of a stage and the micro-batches
    the first stage holds; under full recompute one layer's whole activations on top (the
    layer being recomputed), or, with ``--recompute-method block``, the layers not recomputed
    whole. The last stage's loss buffers where they are larger. fp32 doubles everything.
    ``runs``: what the launch runs (its layers, FP8 linears and loss).
    """
    recompute = args.recompute_granularity or "none"
    layers = layers_per_stage(args)[0]
    held = in_flight_microbatches(args, num_microbatches)
    whole = layer_activation_bytes(args, "none" if recompute == "full" else recompute, runs)
    if recompute == "full":
        saved = layer_activation_bytes(args, "full", runs)
        method = getattr(args, "recompute_method", None) or "uniform"
        n = max(1, args.recompute_num_layers or 1)
        if method == "block":
            recomputed = min(n, layers)
            per_mb = recomputed * saved + (layers - recomputed) * whole
        else:  # uniform: the input of each group of n layers is kept
            per_mb = -(-layers // n) * saved
        first = per_mb * held + n * whole  # plus the group being recomputed
        formula = f"full recompute ({method}): inputs kept, one group recomputed at a time"
    else:
        first = layers * whole * held
        formula = ("selective recompute" if recompute == "selective" else "no recompute")
    formula += (f"; {held:g} micro-batch{'es' if held != 1 else ''} in flight; "
                "Korthikanti et al. 2022")
    pp = args.pipeline_model_parallel_size
    last_layers = layers_per_stage(args)[-1]
    last = (last_layers * (saved if recompute == "full" else whole)
            + (whole if recompute == "full" else 0)) + _logits_bytes(args, runs)
    value = max(first, last) if pp > 1 else first + _logits_bytes(args, runs)
    if not (args.bf16 or args.fp16):
        value *= 2
        formula += ", ×2 for fp32"
    return value, formula


def estimate_memory(args, params: ParameterCount, num_microbatches: int,
                    runs: WhatRuns) -> MemoryEstimate:
    """Bytes per GPU of validated ``args`` as the launch runs them (``runs``)."""
    weight, grad, optimizer = bytes_per_parameter(args)
    n = params.most_per_gpu
    activations, formula = activation_bytes(args, num_microbatches, runs)
    return MemoryEstimate(n * weight + fp8_weight_store_bytes(args, runs), n * grad,
                          n * optimizer, activations, formula,
                          gradient_copies=n * gradient_copy_bytes(args, runs),
                          optimizer_temporaries=n * adam_temporary_bytes(args, runs))


def gradient_copy_bytes(args, runs: WhatRuns) -> float:
    """Bytes per parameter of fp32 gradients made for the step from 16-bit gradient buffers.

    Megatron's mixed-precision optimizer hands Adam ``main_grad.float()``: a copy when the
    buffer is 16-bit (fp16 without --accumulate-allreduce-grads-in-fp32, --grad-reduce-in-bf16),
    of the rank's shard under the distributed optimizer. The launch's flat AdamW step reads
    the 16-bit buffer in place.
    """
    mixed = args.bf16 or args.fp16
    if not mixed or bytes_per_parameter(args)[1] != 2 or runs.flat_step:
        return 0.0
    return 4 / (args.data_parallel_size if args.use_distributed_optimizer else 1)


# Bytes per parameter that torch's AdamW allocates inside its step in the default
# multi-tensor (foreach) form: sqrt of the second moment for every parameter of a group at
# once (``exp_avg_sq_sqrt`` in torch.optim.adam._multi_tensor_adam), fp32; the fused form
# keeps none (the measurement is in bench/notes/cost-model.md).
FOREACH_ADAM_TEMPORARY_BYTES = 4


def adam_temporary_bytes(args, runs: WhatRuns) -> float:
    """Bytes per parameter of Adam's temporaries at the step, on top of its resident state.

    Megatron steps with torch's AdamW (foreach) where neither Transformer Engine nor apex is
    installed, which the step-time model takes to be the case off Transformer Engine's path
    (its optimizer bytes do the same); where the launch chose torch's fused AdamW in its
    place it allocates nothing, and TE's and apex's FusedAdam allocate nothing either. The
    distributed optimizer steps the rank's shard only; an offloaded share steps on the host.
    """
    if not args.optimizer.startswith("adam") or runs.path == TE or runs.fused_adamw:
        return 0.0
    per_param = FOREACH_ADAM_TEMPORARY_BYTES / (args.data_parallel_size
                                                if args.use_distributed_optimizer else 1)
    if getattr(args, "optimizer_cpu_offload", False):
        per_param *= 1 - getattr(args, "optimizer_offload_fraction", 1.0)
    return per_param


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
