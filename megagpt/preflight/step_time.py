"""How long one training step takes: a model of the step from its shapes, not a lookup table.

One micro-batch on one pipeline stage is a list of kernels and collectives, each timed from
its size:
  - matrix products by a roofline that adds the operands' memory traffic to the arithmetic
    (a thin GEMM spends a larger share on moving its operands, so its efficiency falls);
  - core attention as flash attention (FLOPs at the kernel's utilisation) or, unfused, as two
    batched GEMMs plus the traffic of the [heads, s, s] scores;
  - norms, activations, dropout and residual adds as bytes over memory bandwidth;
  - tensor-parallel all-reduce / reduce-scatter / all-gather per layer over NVLink (inside a
    node) or the network, exposed as far as the launch does not overlap them.
The step is then the pipeline schedule over those micro-batches (1F1B, or interleaved with
its smaller bubble), the data-parallel gradient reduce (exposed, or hidden behind the last
backward), and the optimizer step as bytes over bandwidth. Recompute adds forward work to the
backward. Every constant is below (the GPUs' own figures in ``megagpt.gpus``), named, with
where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megagpt.gpus import GpuSpec

# --- constants, each with its source -----------------------------------------------------

# Share of the HBM datasheet bandwidth a streaming kernel reaches: 0.87 (4.2 of 4.8 TB/s,
# the fast path's fused Adam kernel on H200, bench/benchmarks.md).
HBM_EFFICIENCY = 0.87
# Flash attention's forward+backward utilisation of the dense peak, counted as the
# FlashAttention papers count (backward = 2.5 × forward FLOPs): FlashAttention-2 reaches
# 50–73 % on A100 (Dao 2023, arXiv 2307.08691); Hopper's warp-specialised kernels
# (FlashAttention-3, cuDNN's fused attention) ~55 % forward+backward (Shah et al. 2024, arXiv
# 2407.08608: up to 75 % forward, the backward lower).
FLASH_EFFICIENCY_AMPERE = 0.5
FLASH_EFFICIENCY_HOPPER_CUDNN = 0.55
# Bytes moved per element of the [b, heads, s, s] scores by unfused attention, forward +
# backward. Megatron's fused scale-mask-softmax kernel (16-bit): forward writes the scores
# (2), softmax reads and writes (4), dropout reads, writes and stores its mask (5), PV reads
# (2) = 13; backward 19 (dropout and softmax gradients, both score GEMMs reading dS) = 32.
# Megatron-core's torch fallback (no compiled softmax kernel): the mask applied by
# masked_fill (read, mask byte, write), softmax, dropout, each its own pass: forward 18,
# backward 22 (counted from FusedScaleMaskSoftmax.forward_torch_softmax and autograd's
# backward of each op).
SCORE_BYTES_FUSED = (13, 19)
SCORE_BYTES_TORCH = (18, 22)
# The torch fallback with the softmax in fp32 (--attention-softmax-in-fp32, or forced by
# --apply-query-key-layer-scaling) casts the scores up and the probabilities back: forward
# the cast (read 2, write 4), the in-place mask and the softmax on 4-byte elements, the cast
# back (read 4, write 2): 38, +20; backward the two casts' gradients and the softmax and mask
# gradients on 4-byte elements: 44, +22. The fused kernel computes in fp32 in registers and
# moves 16-bit elements either way.
SCORE_BYTES_TORCH_FP32_EXTRA = (20, 22)
# Attention dropout inside a flash kernel: one Philox draw per kept score, forward and again
# backward; 2.65 ms for 3.2e9 draws (24 layers × 8 × 16 heads × 1024² / 2, twice) at 345M on
# H200 (bench/notes/dropout.md: cuDNN with and without dropout) = 0.82 ps per score element. Taken
# the same on Ampere.
FLASH_DROPOUT_S_PER_ELEMENT = 0.82e-12
# Element passes (a read or a write of one activation element) of the memory-bound work
# per token per layer, forward + backward, counted from megatron's fused kernels: layer
# norms (read, write; backward read dy and x, write dx), bias-dropout-add (read x and the
# residual, write; backward read dy, write), residual gradient adds: 26 passes over
# h-sized rows; the MLP activation: forward read + write, backward read dy and x, write dx:
# 5 passes over ffn-sized rows (8 for GLU's two inputs). The two residual dropouts' masks:
# 1 byte per element each, written forward and read backward (4 bytes per h-wide element).
HIDDEN_PASSES = 26
FFN_PASSES = 5
GLU_PASSES = 8
# FP8 linears (the fast spec's, TE's): each of the four GEMM inputs is cast once forward (read
# 2 bytes, write the row-major and the transposed copies, 1 byte each: 4), each output
# gradient has its amax read and is cast backward (2 + 4: 6), and every weight is cast once per
# micro-batch (4 bytes per parameter). FP8 GEMMs: the measured rate against bf16's, the
# layers' GEMM kernels of one wide layer (8 x 4096, sequence 4096) on one H200, 3.16 ms in
# FP8 against 5.99 in bf16 (bench/bench_layer.py, 2026-12-04): 1.90x the 16-bit rate, where
# the datasheet gives 2x.
FP8_CAST_BYTES_FORWARD = 4
FP8_CAST_BYTES_BACKWARD = 6
FP8_WEIGHT_CAST_BYTES = 4
FP8_RATE_OVER_16BIT = 1.90
# Bytes per element of the [tokens, vocab/TP] logits beyond the GEMM: megatron's
# vocab_parallel_cross_entropy (fp32 cast, max, exp, sum, gradient, cast back): 44; the fast
# path's chunked, compiled loss reads the 16-bit logits and writes their gradient: 6.
CROSS_ENTROPY_BYTES_MEGATRON = 44
CROSS_ENTROPY_BYTES_FAST = 6
# Optimizer step, bytes per parameter: Adam with fp32 master weights reads the gradient, reads
# and writes master weights and both moments and writes the 16-bit copy (30), plus the norm
# read and the zeroing of the gradient buffer (8): 38 (megatron with TE/apex fused Adam). The
# fast path's flat step: 28 (bench/benchmarks.md). Megatron without TE/apex: five passes, 52
# (bench/notes/fast-path.md). fp16's loss-scale unscale and inf check: +8.
OPTIMIZER_BYTES_FUSED = 38
OPTIMIZER_BYTES_FAST = 28
OPTIMIZER_BYTES_FALLBACK = 52
OPTIMIZER_BYTES_FP16_EXTRA = 8
# NCCL's bus bandwidth as a share of the link's, at the sizes of TP activations and gradient
# buckets. Over NVLink: 232 of 300 GB/s per direction on one DGX A100 (nccl-tests
# all_reduce_perf, 8 GPUs; github.com/NVIDIA/nccl/issues/1048), ~360 of 450 GB/s on H100
# without NVLink SHARP: 0.78. Over InfiniBand a ring keeps the NIC almost saturated: NCCL's
# maintainers give ~24 GB/s per 200 Gb/s HDR NIC between nodes (25 GB/s line rate;
# github.com/NVIDIA/nccl/issues/412) and 46-48 GB/s per 400 Gb/s NDR NIC (50 GB/s;
# github.com/NVIDIA/nccl-tests/issues/290): 0.94. A fixed cost per collective of ~10 µs
# (nccl-tests small-message latency over NVLink).
NVLINK_BUS_EFFICIENCY = 0.78
NETWORK_BUS_EFFICIENCY = 0.94
NCCL_LATENCY_S = 10e-6
# Host time per kernel launch through megatron's local modules, eager (Python module calls,
# autograd, host synchronisations and the launch): ~1,700 launches per 345M step with the GPU
# idle half of its ~170 ms (bench/notes/fast-path.md's profile) = 100 µs. Without a CUDA graph
# the step takes at least its launches times this. This constant is fitted to that one profile.
EAGER_HOST_S_PER_KERNEL = 100e-6
# Launches per layer per micro-batch (forward + backward) of megatron's local layer, and per
# parameter tensor per step (gradient cast, norm, Adam, copy back) of its non-fused
# optimizer: ~1,700 per 345M step (24 layers, ~290 tensors) in the same profile.
EAGER_KERNELS_PER_LAYER = 60
EAGER_KERNELS_PER_PARAMETER_TENSOR = 1


# --- the launch, as the model sees it ----------------------------------------------------

@dataclass(frozen=True)
class StepShape:
    """A launch reduced to what its step time depends on."""

    hidden: int
    heads: int
    query_groups: int
    head_dim: int
    ffn: int
    layers: int
    vocab: int  # padded
    seq: int
    glu: bool
    micro_batch: int
    global_batch: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule when > 1)
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full
    recompute_layers: int | None = None  # full, block method: layers per stage recomputed
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    precision: str = "bf16"  # bf16 | fp16 | fp32
    fp8: bool = False
    # which of the layer's linears run in FP8 where ``fp8`` (qkv, proj, fc1, fc2: the fast
    # spec keeps those too narrow to gain in bf16)
    fp8_linears: tuple = (0, 1, 2, 3)
    path: str = "te"  # te | fast | local
    flash_attention: bool = True
    fused_softmax: bool = True  # unfused attention: megatron's compiled scale-mask-softmax
    softmax_in_fp32: bool = False  # unfused attention: the softmax computed in fp32
    cuda_graph: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    grad_bytes: int = 4  # gradient buffer element: fp32, or 16-bit
    parameter_tensors_per_layer: int = 12  # weights and biases (the host's launches)
    causal: bool = True

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def element_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclass
class StepEstimate:
    """Seconds per iteration and what they are made of (the parts add up to ``seconds``)."""

    seconds: float
    parts: dict[str, float] = field(default_factory=dict)
    microbatch_seconds: float = 0.0  # the slowest stage's forward + backward of one micro-batch

    def share(self, name: str) -> float:
        return self.parts.get(name, 0.0) / self.seconds if self.seconds else 0.0


PART_NAMES = ("matmuls", "attention", "memory-bound", "TP communication", "pipeline bubble",
              "PP send/receive", "DP reduce", "optimizer", "recompute", "host launches")


def bus_bandwidth(gpu: GpuSpec, inside_node: bool) -> float:
    """Bytes per second one GPU's collectives reach: NVLink inside a node, else its own NIC."""
    if inside_node:
        return gpu.nvlink_gb_s * 1e9 * NVLINK_BUS_EFFICIENCY
    return gpu.network_gb_s * 1e9 * NETWORK_BUS_EFFICIENCY


# --- kernels -------------------------------------------------------------------------------

def _score_bytes(shape: StepShape) -> tuple[int, int]:
    """(forward, backward) bytes per score element of unfused attention with dropout."""
    if shape.fused_softmax:
        return SCORE_BYTES_FUSED
    if not shape.softmax_in_fp32:
        return SCORE_BYTES_TORCH
    return (SCORE_BYTES_TORCH[0] + SCORE_BYTES_TORCH_FP32_EXTRA[0],
            SCORE_BYTES_TORCH[1] + SCORE_BYTES_TORCH_FP32_EXTRA[1])


class _Kernels:
    """Times of the pieces of one layer for one micro-batch on one GPU."""

    def __init__(self, shape: StepShape, gpu: GpuSpec):
        self.shape, self.gpu = shape, gpu
        self.peak = gpu.dense_16bit_tflops * 1e12 if shape.precision != "fp32" else \
            gpu.dense_16bit_tflops * 1e12 / 2  # fp32 runs on TF32 tensor cores: half the rate
        self.gemm_peak = self.peak
        self.fp8_gemm_peak = (self.peak * FP8_RATE_OVER_16BIT if shape.fp8 and gpu.fp8_tflops
                              else self.peak)
        self.hbm = gpu.hbm_gb_s * 1e9 * HBM_EFFICIENCY
        self.tokens = shape.micro_batch * shape.seq // shape.cp  # per GPU of a TP group

    # matrix products
    def gemm(self, m: int, n: int, k: int, count: int = 1, fp8: bool = False) -> float:
        """One [m, k] × [k, n] product (``count`` of them): arithmetic plus operand traffic;
        ``fp8``: a layer linear's product where the launch runs them in FP8."""
        fp8 = fp8 and self.shape.fp8
        operand = 1 if fp8 else self.shape.element_bytes
        flops = 2 * m * n * k * count
        traffic = (operand * (m * k + k * n) + self.shape.element_bytes * m * n) * count
        peak = self.fp8_gemm_peak if fp8 else self.gemm_peak
        return flops / (peak * self.gpu.gemm_efficiency) + traffic / self.hbm

    def layer_gemms_forward(self) -> float:
        s, t = self.shape, self.shape.tp
        qkv_out = (s.heads + 2 * s.query_groups) * s.head_dim // t
        fc1_out = s.ffn * (2 if s.glu else 1) // t
        n = self.tokens
        on = [i in s.fp8_linears for i in range(4)]
        return (self.gemm(n, qkv_out, s.hidden, fp8=on[0])
                + self.gemm(n, s.hidden, s.heads * s.head_dim // t, fp8=on[1])
                + self.gemm(n, fc1_out, s.hidden, fp8=on[2])
                + self.gemm(n, s.hidden, s.ffn // t, fp8=on[3]))

    def fp8_casts(self) -> tuple[float, float]:
        """(forward, backward) seconds of one layer's FP8 casts (0 without FP8)."""
        s, t = self.shape, self.shape.tp
        if not s.fp8:
            return 0.0, 0.0
        qkv_out = (s.heads + 2 * s.query_groups) * s.head_dim // t
        fc1_out = s.ffn * (2 if s.glu else 1) // t
        inputs = self.tokens * (2 * s.hidden + s.heads * s.head_dim // t + s.ffn // t)
        gradients = self.tokens * (qkv_out + 2 * s.hidden + fc1_out)
        weights = s.hidden * (qkv_out + s.heads * s.head_dim // t + fc1_out) \
            + s.ffn // t * s.hidden
        forward = (inputs * FP8_CAST_BYTES_FORWARD + weights * FP8_WEIGHT_CAST_BYTES) / self.hbm
        return forward, gradients * FP8_CAST_BYTES_BACKWARD / self.hbm

    def logits_forward(self) -> float:
        # the output layer stays in 16-bit under FP8, as megatron's and TE's defaults keep it
        return self.gemm(self.tokens, self.shape.vocab // self.shape.tp, self.shape.hidden)

    # core attention
    def score_elements(self) -> float:
        s = self.shape
        return s.micro_batch * (s.heads // s.tp) * s.seq * s.seq / s.cp

    def attention(self) -> tuple[float, float]:
        """(forward, backward) seconds of core attention for one layer."""
        s = self.shape
        scores = self.score_elements()
        if s.flash_attention:
            causal = 0.5 if s.causal else 1.0
            forward_flops = 4 * scores * s.head_dim * causal
            efficiency = self._flash_efficiency()
            forward = forward_flops / (self.peak * efficiency)
            backward = 2.5 * forward
            if s.attention_dropout > 0:
                forward += scores * causal * FLASH_DROPOUT_S_PER_ELEMENT
                backward += scores * causal * FLASH_DROPOUT_S_PER_ELEMENT
            return forward, backward
        # unfused: QK^T and PV as batched GEMMs over every (micro-batch, head), all s × s
        # scores computed (the causal half is masked, not skipped), plus the scores' traffic
        batch = s.micro_batch * (s.heads // s.tp)
        seq = s.seq // s.cp
        products = (self.gemm(seq, s.seq, s.head_dim, batch)  # QK^T
                    + self.gemm(seq, s.head_dim, s.seq, batch))  # PV
        fwd_bytes, bwd_bytes = _score_bytes(s)
        if s.attention_dropout == 0:  # no dropout pass: read, write and mask byte saved
            fwd_bytes, bwd_bytes = fwd_bytes - 5, bwd_bytes - 5
        return (products + scores * fwd_bytes / self.hbm,
                2 * products + scores * bwd_bytes / self.hbm)

    def _flash_efficiency(self) -> float:
        # Hopper: TE calls cuDNN's fused attention, and torch's SDPA picks cuDNN's too (the
        # fast path; bench/notes/fast-path.md)
        return FLASH_EFFICIENCY_AMPERE if self.gpu.fp8_tflops is None else \
            FLASH_EFFICIENCY_HOPPER_CUDNN

    # memory-bound work
    def elementwise(self) -> tuple[float, float]:
        """(forward, backward) seconds of norms, activation, dropout and residual adds."""
        s = self.shape
        rows = self.tokens / (s.tp if s.sequence_parallel else 1)  # h-wide rows on this GPU
        e = s.element_bytes
        hidden = rows * s.hidden * (HIDDEN_PASSES * e + (4 if s.hidden_dropout > 0 else 0))
        ffn = self.tokens * s.ffn / s.tp * (GLU_PASSES if s.glu else FFN_PASSES) * e
        total = (hidden + ffn) / self.hbm
        return total / 3, 2 * total / 3  # the backward reads and writes about twice as much

    def cross_entropy(self) -> float:
        s = self.shape
        per_element = CROSS_ENTROPY_BYTES_FAST if s.path == "fast" else CROSS_ENTROPY_BYTES_MEGATRON
        return self.tokens * s.vocab / s.tp * per_element / self.hbm

    # communication
    def collective(self, volume_bytes: float, ranks: int, inside_node: bool, kind: str) -> float:
        """Ring all-reduce ('ar'), reduce-scatter or all-gather ('rs', 'ag') of a buffer."""
        if ranks <= 1:
            return 0.0
        bandwidth = bus_bandwidth(self.gpu, inside_node)
        factor = 2 if kind == "ar" else 1
        return factor * (ranks - 1) / ranks * volume_bytes / bandwidth + NCCL_LATENCY_S

    def tp_communication(self) -> tuple[float, float]:
        """(forward, backward) exposed seconds of one layer's TP collectives."""
        s = self.shape
        if s.tp == 1:
            return 0.0, 0.0
        inside = s.tp <= self.gpu.gpus_per_node  # megatron puts TP ranks next to each other
        activation = self.tokens * s.hidden * 2  # exchanged in 16-bit
        if s.sequence_parallel:  # all-gather before, reduce-scatter after each block
            one = self.collective(activation, s.tp, inside, "ag") + \
                self.collective(activation, s.tp, inside, "rs")
        else:
            one = self.collective(activation, s.tp, inside, "ar")
        forward = 2 * one
        # backward: the same exchanges (and with SP, the input gathered again for the weight
        # gradients); megatron overlaps the column-parallel input-gradient reduce with the
        # weight-gradient GEMM, so about half is exposed
        backward = (2.5 if s.sequence_parallel else 2) * one / 2
        if s.tp_comm_overlap:
            # userbuffers split each GEMM into TP chunks and exchange one while computing the
            # next: only the first chunk's exchange is exposed
            forward, backward = forward / s.tp, backward / s.tp
        return forward, backward


# --- the step ------------------------------------------------------------------------------

def _stage_layers(shape: StepShape) -> int:
    return shape.layers // shape.pp


def estimate_step(shape: StepShape, gpu: GpuSpec, params_per_gpu: float,
                  parameter_tensors_per_gpu: int | None = None) -> StepEstimate:
    """Seconds per iteration of ``shape`` on ``gpu`` (``params_per_gpu``: the most loaded
    GPU's parameters, for the gradient reduce and the optimizer step)."""
    k = _Kernels(shape, gpu)
    layers = _stage_layers(shape)

    gemm_f = k.layer_gemms_forward()
    attn_f, attn_b = k.attention()
    elem_f, elem_b = k.elementwise()
    cast_f, cast_b = k.fp8_casts()
    elem_f, elem_b = elem_f + cast_f, elem_b + cast_b
    tp_f, tp_b = k.tp_communication()

    # one layer, one micro-batch: forward and backward (the backward's GEMMs are the
    # input-gradient and weight-gradient products, each the forward's size)
    matmul = 3 * gemm_f
    attention = attn_f + attn_b
    memory = elem_f + elem_b
    tp_comm = tp_f + tp_b
    recompute_per_layer = 0.0
    if shape.recompute == "full":
        recompute_per_layer = gemm_f + attn_f + elem_f + tp_f
    elif shape.recompute == "selective":
        recompute_per_layer = attn_f  # the core attention's forward again
    recomputed = layers
    if shape.recompute == "full" and shape.recompute_layers is not None:
        recomputed = min(layers, shape.recompute_layers)

    per_mb = {
        "matmuls": layers * matmul,
        "attention": layers * attention,
        "memory-bound": layers * memory,
        "TP communication": layers * tp_comm,
        "recompute": recomputed * recompute_per_layer,
    }
    # the heaviest stage: the first holds the embedding (small), the last the logits; the
    # logits' GEMMs and loss are on the last, which is the slowest when PP > 1
    logits = 3 * k.logits_forward()
    per_mb["matmuls"] += logits
    per_mb["memory-bound"] += k.cross_entropy()
    mb_time = sum(per_mb.values())
    mean_stage_mb = mb_time - (logits + k.cross_entropy()) * (1 - 1 / shape.pp)

    m = shape.microbatches
    parts = {name: m * value for name, value in per_mb.items()}

    # pipeline: 1F1B fills and drains over (PP - 1) micro-batch slots, the interleaved
    # schedule over (PP - 1) / v (Narayanan et al. 2021, §2.2)
    bubble = (shape.pp - 1) / shape.virtual_stages * mean_stage_mb if shape.pp > 1 else 0.0
    parts["pipeline bubble"] = bubble
    if shape.pp > 1:
        inside = shape.gpus <= gpu.gpus_per_node  # neighbouring stages are TP·CP·DP ranks apart
        link = bus_bandwidth(gpu, inside)
        # each stage sends its activations forward and its input gradient back per micro-batch
        # (and per model chunk when interleaved); each TP rank sends 1/TP of it over its own
        # link (megatron's scatter-gather across TP ranks, or the sequence-parallel shard)
        message = k.tokens * shape.hidden * 2 / shape.tp
        exchanges = 2 * m * shape.virtual_stages
        parts["PP send/receive"] = exchanges * (message / link + NCCL_LATENCY_S)

    # data-parallel gradient reduce and parameter gather
    parts["DP reduce"] = _dp_exposed(shape, gpu, k, params_per_gpu, per_mb)

    # optimizer
    parts["optimizer"] = _optimizer_seconds(shape, k, params_per_gpu)

    # host launches: without a CUDA graph, megatron's eager modules can issue kernels no
    # faster than the host runs them; the step is then the host's time
    if not shape.cuda_graph and shape.path == "local":
        tensors = parameter_tensors_per_gpu or layers * shape.parameter_tensors_per_layer
        host = EAGER_HOST_S_PER_KERNEL * (m * layers * EAGER_KERNELS_PER_LAYER
                                          + tensors * EAGER_KERNELS_PER_PARAMETER_TENSOR)
        device = sum(parts.values())
        if host > device:
            parts["host launches"] = host - device
    seconds = sum(parts.values())
    return StepEstimate(seconds, parts, mb_time)


def _dp_exposed(shape: StepShape, gpu: GpuSpec, k: _Kernels, params: float,
                per_mb: dict[str, float]) -> float:
    dp = shape.dp
    if dp == 1:
        return 0.0
    peers_in_node = _dp_peers_in_node(shape, gpu.gpus_per_node)
    inside = dp <= peers_in_node
    grads = params * shape.grad_bytes
    # Every GPU has its own NIC, so the node's DP groups (one per TP·CP rank of the node) reduce
    # side by side, none waiting for another's NIC. A group with several peers in a node
    # reduces among them over NVLink and sends only their distinct share across nodes, each
    # peer its 1/peers over its own NIC (NCCL's rings, one channel per NIC): the network part
    # runs peers times faster, never faster than NVLink.
    link_scale = 1.0 if inside else \
        min(peers_in_node, bus_bandwidth(gpu, True) / bus_bandwidth(gpu, False))
    if shape.distributed_optimizer:
        reduce = k.collective(grads, dp, inside, "rs") / link_scale
        gather = k.collective(params * 2, dp, inside, "ag") / link_scale
    else:
        reduce, gather = k.collective(grads, dp, inside, "ar") / link_scale, 0.0
    # --overlap-grad-reduce: the buckets are reduced as the last micro-batch's backward makes
    # them; --overlap-param-gather: gathered as the first forward needs them
    layers_time = per_mb["matmuls"] + per_mb["attention"] + per_mb["memory-bound"]
    backward, forward = layers_time * 2 / 3, layers_time / 3
    if shape.overlap_grad_reduce:
        reduce = max(reduce - backward, reduce / max(1, _stage_layers(shape)))
    if shape.overlap_param_gather:
        gather = max(gather - forward, gather / max(1, _stage_layers(shape)))
    return reduce + gather


def _dp_peers_in_node(shape: StepShape, gpus_per_node: int) -> int:
    """Ranks of one DP group on one node: megatron orders ranks TP, CP, DP, PP, so DP peers
    are TP·CP apart and a node holds gpus_per_node / (TP·CP) of them."""
    stride = shape.tp * shape.cp
    if stride >= gpus_per_node:
        return 1
    return max(1, min(shape.dp, gpus_per_node // stride))


def _optimizer_seconds(shape: StepShape, k: _Kernels, params: float) -> float:
    if shape.path == "fast":
        per_param = OPTIMIZER_BYTES_FAST
    elif shape.path == "te":
        per_param = OPTIMIZER_BYTES_FUSED
    else:
        per_param = OPTIMIZER_BYTES_FALLBACK
    if shape.precision == "fp16":
        per_param += OPTIMIZER_BYTES_FP16_EXTRA
    if shape.distributed_optimizer:  # each rank steps its 1/DP shard; the buffers are whole
        sharded = per_param - 8
        per_param = sharded / shape.dp + 8
    return params * per_param / k.hbm
