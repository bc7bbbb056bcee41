"""Chunked LM-head + cross-entropy: the [tokens, vocab] logits never exist all at once.

megatron's default path computes the full logits (bf16, tokens x vocab) and then
``vocab_parallel_cross_entropy`` in fp32, keeping an fp32 softmax of the same size for the
backward pass. At the 345M shape (8192 tokens x 50304) that is ~0.8 GB of bf16 logits plus
~1.6 GB fp32 per copy, several copies alive at the peak.

``chunked_linear_cross_entropy(hidden, weight, labels)`` computes per-token losses
chunk by chunk, saving only the log-sum-exp per token; the backward pass recomputes each
chunk's logits (one extra [chunk, h] x [h, vocab] matmul per chunk, ~1/3 of the LM head's
FLOPs) and accumulates the weight gradient in fp32. Same math as megatron's: fp32
softmax statistics over bf16 logits.

``chunked_linear_cross_entropy_grad_in_forward(hidden, weight, labels, loss_weights)`` forms
the LM head's gradients in the forward pass instead, while each chunk's logits are at hand
(no recompute), for losses whose upstream gradient is a scalar multiple of ``loss_weights``
(the entry's masked-sum loss); the launch picks it unless ``--fast-disable lm-grad-in-forward``
or pipeline parallelism (``lm_grad_in_forward_unsupported_reason``).

It plugs into ``GPTModel.forward(..., output_processor=...)`` through
``fused_lm_head_loss``, as the launch's ``LM loss`` choice gives it
(``megagpt.gpt_model.output_processor``). Where the
fused path does not apply (tensor/sequence parallel output layer, an output-layer bias,
MuP logit scaling, no labels) the processor runs megatron's own output layer and loss.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import torch
from torch import Tensor

from megagpt.torch_compile import is_compile_error

# elements of one chunk's logits (tokens x vocab) per 1024 of hidden size: 2**26 = 64 Mi =
# 128 MB in bf16 at the 345M shape. Scaled with the hidden size, the chunk keeps its share
# of the peak (activations grow with it), and wider models get chunks of more tokens: each
# chunk's weight-gradient GEMM reads and writes the whole fp32 [vocab, hidden] accumulator,
# so fewer, longer chunks move less memory per FLOP (1024-token chunks ran well below the
# layers' GEMMs at the 1.3B shape: bench/notes/fast-path.md, "Chunked LM-head loss").
_CHUNK_ELEMENTS = 2**26


def chunk_elements_for(hidden_size: int) -> int:
    """Logit elements per chunk for a model of this hidden size."""
    return _CHUNK_ELEMENTS * max(1, hidden_size // 1024)

# The compiled per-chunk kernels (one read of the bf16 logits forward, one fused pointwise
# pass backward), built once each; used on a GPU when the caller asks (``compile_kernels``),
# eager on the CPU. A kernel whose compile failed is its eager function from then on.
_compiled: dict = {}


def _chunks(n: int, vocab: int, chunk_elements: int):
    # a power-of-two number of equal chunks where possible: one compiled shape per run
    n_chunks = 2 ** max(0, math.ceil(math.log2(max(1.0, n * vocab / chunk_elements))))
    size = math.ceil(n / min(n_chunks, n))
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def _ce_forward_chunk(logits: Tensor, labels: Tensor, acc: torch.dtype):
    """(per-token loss, log-sum-exp), statistics in ``acc`` (fp32) over low-precision logits."""
    x = logits.to(acc)
    lse = torch.logsumexp(x, dim=-1)
    target = x.gather(1, labels.unsqueeze(1)).squeeze(1)
    return lse - target, lse


def _ce_backward_chunk(logits: Tensor, lse: Tensor, labels: Tensor, grad: Tensor):
    """d loss_i / d logits_ij = (softmax_ij - [j == label_i]) * grad_i, in logits' dtype."""
    x = logits.to(lse.dtype)
    probs = torch.exp(x - lse.unsqueeze(1))
    cols = torch.arange(x.size(1), device=x.device).unsqueeze(0)
    onehot = (cols == labels.unsqueeze(1)).to(x.dtype)
    return ((probs - onehot) * grad.unsqueeze(1)).to(logits.dtype)


def _ce_forward_grad_chunk(logits: Tensor, labels: Tensor, weights: Tensor, acc: torch.dtype):
    """(per-token loss, d(sum_i w_i loss_i)/d logits in logits' dtype) from one chunk."""
    loss, lse = _ce_forward_chunk(logits, labels, acc)
    return loss, _ce_backward_chunk(logits, lse, labels, weights)


def _scale_to(x: Tensor, c: Tensor, dtype: torch.dtype) -> Tensor:
    """``x * c`` in ``c``'s precision, returned in ``dtype``: one pass when compiled (eagerly:
    a widening copy, a multiply and a narrowing copy, three passes over the LM head's
    [vocab, hidden] gradient)."""
    return (x.to(c.dtype) * c).to(dtype)


def _chunk_input_grads(g: Tensor, hidden: Tensor, weight: Tensor, grad_hidden: Optional[Tensor],
                       grad_weight: Optional[Tensor], first: bool) -> None:
    """From one chunk's logit gradient ``g``: its hidden-state gradient into ``grad_hidden``
    (that chunk's rows), its weight gradient added onto ``grad_weight`` (``first``: written
    there; the accumulator starts uninitialised, not zeroed)."""
    if grad_hidden is not None:
        torch.matmul(g, weight, out=grad_hidden)
    if grad_weight is not None:
        accumulate_weight_grad(grad_weight, g, hidden, write=first)


def _kernel(name: str, fn, device: torch.device, compile_kernels: bool):
    if not (compile_kernels and device.type == "cuda"):
        return fn
    if name not in _compiled:
        compiled = torch.compile(fn, dynamic=False, fullgraph=True)

        def guarded(*args):
            try:
                return compiled(*args)
            except Exception as e:  # noqa: BLE001
                if not is_compile_error(e):
                    raise
                logging.getLogger(__name__).warning(
                    "chunked LM loss: torch.compile failed (%s); running eagerly", type(e).__name__)
                _compiled[name] = fn
                return fn(*args)

        _compiled[name] = guarded
    return _compiled[name]


_FUSED_FP32_ACCUMULATION: dict = {}  # device -> whether addmm(out_dtype=fp32, out=acc) adds


def fused_fp32_accumulation_works(device: torch.device) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` accumulates bf16
    products into an fp32 ``acc`` on this device: checked once per process on a small case
    (two calls onto a non-zero accumulator must give three times one product).

    ``bench/bench_kernels.py`` measures this form against fp32 and against a bf16 product
    followed by an fp32 add (bench/notes/fast-path.md, "Chunked LM-head loss"). The check stays
    so that a torch build or device where it does not accumulate falls back instead of training on a
    wrong gradient. Never checked during CUDA graph
    capture (it reads a value back).
    """
    key = str(device)
    if key in _FUSED_FP32_ACCUMULATION:
        return _FUSED_FP32_ACCUMULATION[key]
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(256, 64, device=device, dtype=torch.bfloat16, generator=g)
        b = torch.randn(256, 96, device=device, dtype=torch.bfloat16, generator=g)
        once = a.t().float() @ b.float()
        acc = once.clone()
        for _ in range(2):
            torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)
        works = bool(torch.allclose(acc, 3 * once, rtol=1e-3, atol=1e-3))
    except (RuntimeError, TypeError):  # no out_dtype on this build
        works = False
    _FUSED_FP32_ACCUMULATION[key] = works
    return works


def accumulate_weight_grad(acc: Tensor, grad_out: Tensor, inp: Tensor, write: bool = False) -> None:
    """``acc += grad_out.T @ inp`` where ``acc`` may be wider (fp32) than the operands (bf16);
    ``write``: ``acc = grad_out.T @ inp`` (whatever ``acc`` held is neither read nor kept).

    One GEMM accumulating in fp32 straight into ``acc`` where that form works (see
    ``fused_fp32_accumulation_works``): no separate add kernel over the [vocab, hidden] fp32
    accumulator per chunk, and the product is not rounded to bf16 first. Elsewhere the
    product is formed in the operands' dtype and added in fp32. (beta = 0 makes the GEMM
    ignore ``acc``'s old values, NaN included.)
    """
    beta = 0 if write else 1
    if grad_out.dtype == acc.dtype:
        acc.addmm_(grad_out.t(), inp, beta=beta)
    elif acc.dtype == torch.float32 and fused_fp32_accumulation_works(acc.device):
        torch.addmm(acc, grad_out.t(), inp, beta=beta, out_dtype=torch.float32, out=acc)
    elif write:
        acc.copy_(grad_out.t() @ inp)
    else:
        acc.add_(grad_out.t() @ inp)


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_elements: int,
                compile_kernels: bool):
        n = hidden.size(0)
        vocab = weight.size(0)
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 in gradcheck)
        losses = torch.empty(n, dtype=acc, device=hidden.device)
        lse_all = torch.empty(n, dtype=acc, device=hidden.device)
        fwd = _kernel("fwd", _ce_forward_chunk, hidden.device, compile_kernels)
        for a, b in _chunks(n, vocab, chunk_elements):
            loss, lse = fwd(hidden[a:b] @ weight.t(), labels[a:b], acc)
            losses[a:b] = loss
            lse_all[a:b] = lse
        ctx.save_for_backward(hidden, weight, labels, lse_all)
        ctx.chunk_elements = chunk_elements
        ctx.compile_kernels = compile_kernels
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        hidden, weight, labels, lse_all = ctx.saved_tensors
        n = hidden.size(0)
        vocab = weight.size(0)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse_all.dtype
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # fp32 accumulator over chunks; each chunk's product is added without an fp32 copy (the
        # first one's written: no zero fill)
        grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_losses = grad_losses.to(acc)
        bwd = _kernel("bwd", _ce_backward_chunk, hidden.device, ctx.compile_kernels)
        for a, b in _chunks(n, vocab, ctx.chunk_elements):
            g = bwd(hidden[a:b] @ weight.t(), lse_all[a:b], labels[a:b], grad_losses[a:b])
            _chunk_input_grads(g, hidden[a:b], weight,
                               grad_hidden[a:b] if need_h else None, grad_weight, a == 0)
            del g
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


class _ChunkedLinearCEGradInForward(torch.autograd.Function):
    """Per-token losses whose gradient is computed in the forward pass, Liger-style.

    While each chunk's logits are at hand, the forward pass also forms the gradient of
    ``sum_i w_i * loss_i`` (``w``: the loss weights, the loss mask) with respect to the
    hidden states and the output weight, so the backward pass recomputes no logits (the
    chunked loss's extra [tokens, h] x [h, vocab] GEMM, ~1/3 of the LM head's FLOPs).

    The contract: the gradient reaching these losses must be ``c * w`` for one scalar ``c``,
    which is what a masked sum (``pretrain_gpt.loss_func``) under megatron's normalisation
    (by the token count, the micro-batch count) gives. ``c`` is recovered in backward as
    ``<g, w> / <w, w>`` and scales the stored gradients.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, loss_weights: Tensor,
                chunk_elements: int, compile_kernels: bool):
        n, vocab = hidden.size(0), weight.size(0)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        losses = torch.empty(n, dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device) if need_w else None
        w = loss_weights.to(acc)
        step = _kernel("fwd_grad", _ce_forward_grad_chunk, hidden.device, compile_kernels)
        for a, b in _chunks(n, vocab, chunk_elements):
            loss, g = step(hidden[a:b] @ weight.t(), labels[a:b], w[a:b], acc)
            losses[a:b] = loss
            _chunk_input_grads(g, hidden[a:b], weight,
                               grad_hidden[a:b] if need_h else None, grad_weight, a == 0)
            del g
        ctx.save_for_backward(grad_hidden, grad_weight, w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.compile_kernels = compile_kernels
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        grad_hidden, grad_weight, w = ctx.saved_tensors
        g = grad_losses.to(w.dtype)
        # the scalar c of grad_losses = c * w (0-dim, stays on the device)
        c = (g * w).sum() / (w * w).sum().clamp_min(torch.finfo(w.dtype).tiny)
        scale = _kernel("scale_to", _scale_to, w.device, ctx.compile_kernels)
        if grad_hidden is not None:
            grad_hidden = scale(grad_hidden, c, ctx.dtypes[0])
        if grad_weight is not None:
            grad_weight = scale(grad_weight, c, ctx.dtypes[1])
        return grad_hidden, grad_weight, None, None, None, None


def chunked_linear_cross_entropy_grad_in_forward(
    hidden: Tensor, weight: Tensor, labels: Tensor, loss_weights: Tensor,
    chunk_elements: Optional[int] = None, compile_kernels: bool = True,
) -> Tensor:
    """``chunked_linear_cross_entropy`` whose gradients are formed in the forward pass.

    Only for losses whose upstream gradient is a scalar multiple of ``loss_weights`` (see
    ``_ChunkedLinearCEGradInForward``). hidden: [N, h]; weight: [V, h]; labels, loss_weights:
    [N]. Returns [N] float32.
    """
    if chunk_elements is None:
        chunk_elements = chunk_elements_for(hidden.size(-1))
    return _ChunkedLinearCEGradInForward.apply(hidden, weight, labels.long(), loss_weights,
                                               chunk_elements, bool(compile_kernels))


def chunked_linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_elements: Optional[int] = None,
    compile_kernels: bool = True,
) -> Tensor:
    """Per-token ``cross_entropy(hidden @ weight.T, labels)`` (no reduction), fp32.

    hidden: [N, h]; weight: [V, h]; labels: [N] int64. Returns [N] float32.
    ``compile_kernels``: the per-chunk kernels ``torch.compile``d (on a GPU).
    """
    if chunk_elements is None:
        chunk_elements = chunk_elements_for(hidden.size(-1))
    return _ChunkedLinearCE.apply(hidden, weight, labels.long(), chunk_elements,
                                  bool(compile_kernels))


def fused_lm_head_unsupported_reason(output_layer, config) -> Optional[str]:
    tp = getattr(output_layer, "tp_group", None)
    if tp is not None and tp.size() != 1:
        return "tensor-parallel output layer (vocab-parallel cross entropy)"
    if getattr(output_layer, "sequence_parallel", False):
        return "sequence parallelism"
    if getattr(output_layer, "bias", None) is not None:
        return "output layer bias"
    if getattr(config, "use_mup", False):
        return "MuP logit scaling"
    return None


def fused_lm_head_loss(
    *,
    hidden_states: Tensor,
    output_layer,
    output_weight: Optional[Tensor],
    labels: Optional[Tensor],
    compute_language_model_loss: Callable,
    scale_logits: Callable,
    config,
    runtime_gather_output=None,
    loss_mask: Optional[Tensor] = None,
    grad_in_forward: bool = False,
    compile_kernels: bool = True,
    **_unused,
) -> Tensor:
    """``GPTModel`` output processor: per-token LM losses [b, s] without full logits.

    ``grad_in_forward``: form the LM head's gradients in the forward pass (no logit
    recompute), for a caller whose loss is a masked sum of these losses with ``loss_mask``
    (``pretrain_gpt.loss_func``); used only when gradients are being recorded.
    ``compile_kernels``: the per-chunk kernels compiled (``--fast-compile``)."""
    reason = None if labels is not None else "no labels"
    if reason is None:
        reason = fused_lm_head_unsupported_reason(output_layer, config)
    if reason is not None:
        logits, _ = output_layer(
            hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output
        )
        logits = scale_logits(logits)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return compute_language_model_loss(labels, logits)
    weight = output_weight if output_weight is not None else output_layer.weight
    s, b, h = hidden_states.shape
    flat_labels = labels.transpose(0, 1).reshape(s * b)  # [b, s] -> [s*b] in hidden's order
    flat_hidden = hidden_states.reshape(s * b, h)
    if grad_in_forward and loss_mask is not None and torch.is_grad_enabled() and (
            hidden_states.requires_grad or weight.requires_grad):
        flat_mask = loss_mask.transpose(0, 1).reshape(s * b)
        losses = chunked_linear_cross_entropy_grad_in_forward(
            flat_hidden, weight, flat_labels, flat_mask, compile_kernels=compile_kernels)
    else:
        losses = chunked_linear_cross_entropy(flat_hidden, weight, flat_labels,
                                              compile_kernels=compile_kernels)
    return losses.view(s, b).transpose(0, 1).contiguous()


def lm_grad_in_forward_unsupported_reason(args) -> Optional[str]:
    """Why the LM head's gradient is not formed in the forward pass (None: it is).

    Off with ``--fast-disable lm-grad-in-forward`` and under pipeline parallelism, where several
    micro-batches' forward passes run before their backward passes and each would hold an
    fp32 [vocab, hidden] weight gradient until then."""
    if not getattr(args, "fast_lm_grad_in_forward", True):
        return "--fast-disable lm-grad-in-forward"
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) != 1:
        return "pipeline parallelism (micro-batches in flight would each hold a weight gradient)"
    return None
