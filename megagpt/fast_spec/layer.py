"""A TransformerLayer whose common case runs as one (optionally torch.compile'd) function.

``FastTransformerLayer`` is megatron's ``TransformerLayer`` (same submodules, same
parameters, same state dict and checkpoint layout). Its ``forward`` takes a fused path when
the layer is a plain dense pre-norm GPT block:

    x = x + dropout(proj(sdpa(qkv(norm1(x)))) + b_proj)
    x = x + dropout(fc2(act(fc1(norm2(x)))) + b_fc2)

written with plain torch ops over the layer's own parameters, so that ``torch.compile``
can fuse the norms, bias + activation and bias + dropout + residual, and so that the
~25 Python-level module calls per layer of megatron's path collapse into one call (at the
345M shape the step is bound by per-op CPU overhead, not arithmetic). Under tensor
parallelism the same function runs on each rank's shards, eagerly, with megatron's
collectives where its parallel linears have them: the gradient of the QKV and fc1 inputs
all-reduced, the projection and fc2 outputs all-reduced (with sequence parallelism: the
inputs gathered along the sequence, the outputs reduce-scattered). Anything else (MoE,
cross attention, recompute, offloading, inference contexts, packed sequences, q/k norms,
FP8, ...) goes through ``TransformerLayer.forward`` unchanged, with the SDPA core attention
of the fast spec.

Gradients reach the parameters through ordinary autograd, and megatron's DDP hooks add them
into ``main_grad`` — except for the four weight matrices where megatron's DDP writes this
step's gradients instead of zeroing its buffer and adding (``train_step.grad_write``: one
micro-batch per step) and the buffer has the weights' dtype: there each weight GEMM writes its
product straight into the buffer, and autograd receives a placeholder gradient. Without
megatron's DDP (no ``main_grad``) this does not apply.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from megagpt import model_math
from megagpt.torch_compile import is_compile_error

from . import fp8 as fp8_linears
from . import fp8_weights, grad_marks
from . import hash_dropout
from .attention import SDPADotProductAttention, sdpa_kernels_only

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class FusedLayerOptions:
    """How a model's fused layers run, chosen once by the fast spec (``spec.py``) and handed
    to every ``FastTransformerLayer`` through the layer spec's ``params``.

    ``compile``: ``torch.compile`` the fused function (``compile_options``: its keyword
    arguments, as ``(name, value)`` pairs); ``hash_dropout``: a compiled layer's residual
    dropouts take their masks from ``hash_dropout`` rather than ``F.dropout``
    (``--fast-disable hash-dropout``); ``fp8``: the four linears in FP8 (``fp8.py``; None:
    in the parameters' dtype).
    """

    compile: bool = False
    compile_options: tuple = ()
    hash_dropout: bool = True
    fp8: Optional[fp8_linears.Fp8Recipe] = None

    @classmethod
    def make(cls, compile: bool = False, options: Optional[dict] = None,
             hash_dropout: bool = True,
             fp8: Optional[fp8_linears.Fp8Recipe] = None) -> "FusedLayerOptions":
        return cls(bool(compile), tuple(sorted((options or {}).items())), bool(hash_dropout),
                   fp8)


# One compiled function per compile setting, shared by every layer that runs under it
# (dynamo compiles it once for all of them); the settings whose compile failed run eagerly.
_COMPILED: dict = {}
_COMPILE_FAILED: set = set()
# megatron's fused bias-dropout-add (``_bias_dropout_add``) failed to compile: not tried again
_megatron_bda_failed = False


@torch.library.custom_op("megagpt::wgrad_into_main_grad", mutates_args=("main_grad",))
def wgrad_into_main_grad(grad_out: Tensor, inp: Tensor, main_grad: Tensor) -> Tensor:
    """``main_grad = grad_out^T @ inp`` over all leading dims, the GEMM's output written
    straight into the buffer (of the same dtype: ``wgrad_mode`` checked it); returns a
    placeholder weight gradient (uninitialised, as megatron's own fusion returns) for
    autograd to hand on."""
    g = grad_out.reshape(-1, grad_out.shape[-1])
    x = inp.reshape(-1, inp.shape[-1])
    torch.mm(g.t(), x, out=main_grad)
    return torch.empty(main_grad.shape, dtype=grad_out.dtype, device=grad_out.device)


@wgrad_into_main_grad.register_fake
def _(grad_out: Tensor, inp: Tensor, main_grad: Tensor) -> Tensor:
    return grad_out.new_empty(main_grad.shape)


class _LinearIntoMainGrad(torch.autograd.Function):
    """``x @ w^T + b`` whose weight gradient is written into ``main_grad`` in backward.
    The bias stays inside the GEMM (cuBLAS's bias epilogue), as in
    ``F.linear``: added afterwards, in front of SDPA it would cost a pass over the QKV
    output of its own."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Optional[Tensor], main_grad: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        # not a saved tensor: every view of the gradient buffer shares one version counter,
        # which the other weights' writes bump before this backward runs
        ctx.main_grad = main_grad
        ctx.has_bias = b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, w = ctx.saved_tensors
        grad_x = grad_out @ w if ctx.needs_input_grad[0] else None
        grad_w = torch.ops.megagpt.wgrad_into_main_grad(grad_out, x, ctx.main_grad)
        grad_b = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None


def _linear(x: Tensor, w: Tensor, b: Optional[Tensor], main_grad: Optional[Tensor],
            fp8_step: Optional[fp8_linears.Fp8Step] = None, linear: int = 0) -> Tensor:
    fp8_step = fp8_linears.for_linear(fp8_step, linear)
    if fp8_step is not None:
        return fp8_linears.fp8_linear(x, w, b, main_grad, fp8_step, linear)
    if main_grad is None:
        return F.linear(x, w, b)
    return _LinearIntoMainGrad.apply(x, w, b, main_grad)


def _column_linear(x: Tensor, w: Tensor, b: Optional[Tensor], main_grad: Optional[Tensor],
                   tp_group, sequence_parallel: bool,
                   fp8_step: Optional[fp8_linears.Fp8Step] = None, linear: int = 0) -> Tensor:
    """A column-parallel linear. Under tensor parallelism megatron's own linear function
    does what its ColumnParallelLinear does: the input's gradient all-reduced across the
    ranks in backward, overlapped with the weight-gradient GEMM; with sequence parallelism
    the input gathered along the sequence first (its gradient reduce-scattered back).
    Weight-gradient fusion is not used under tensor parallelism. In FP8 the same
    collectives are megatron's mappings around the FP8 linear of this rank's shard."""
    if tp_group is None:
        return _linear(x, w, b, main_grad, fp8_step, linear)
    fp8_step = fp8_linears.for_linear(fp8_step, linear)
    if fp8_step is not None:
        if sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True,
                                                     group=tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(x, group=tp_group)
        return fp8_linears.fp8_linear(x, w, b, None, fp8_step, linear)
    return linear_with_grad_accumulation_and_async_allreduce(
        x, w, b, gradient_accumulation_fusion=False, allreduce_dgrad=not sequence_parallel,
        sequence_parallel=sequence_parallel, tp_group=tp_group)


def _row_parallel_output(x: Tensor, tp_group, sequence_parallel: bool) -> Tensor:
    """A row-parallel linear's partial products, summed across the ranks (with sequence
    parallelism: summed and scattered along the sequence)."""
    if tp_group is None:
        return x
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(x, group=tp_group)
    return reduce_from_tensor_model_parallel_region(x, group=tp_group)


def _attention(q, k, v, p: float, scale: float, tp_group, sequence_parallel: bool,
               kernels: Optional[tuple] = None) -> Tensor:
    with sdpa_kernels_only(kernels):
        if p > 0.0 and tp_group is not None and not sequence_parallel:
            # each rank holds other heads: their dropout masks come from the model-parallel
            # RNG stream, which differs across tensor-parallel ranks, as in megatron's
            # attention (which, under sequence parallelism, draws from the default stream)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                      scale=scale)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                              scale=scale)


def fused_layer_forward(
    x: Tensor,
    ln1_w: Tensor,
    ln1_b: Optional[Tensor],
    qkv_w: Tensor,
    qkv_b: Optional[Tensor],
    proj_w: Tensor,
    proj_b: Optional[Tensor],
    ln2_w: Tensor,
    ln2_b: Optional[Tensor],
    fc1_w: Tensor,
    fc1_b: Optional[Tensor],
    fc2_w: Tensor,
    fc2_b: Optional[Tensor],
    rope: Optional[Tensor],
    eps: float,
    rms: bool,
    groups: int,
    q_per_group: int,
    head_dim: int,
    scale: float,
    attn_p: float,
    hidden_p: float,
    act: str,
    rotary_interleaved: bool,
    rope_mscale: float,
    training: bool,
    qkv_main_grad: Optional[Tensor] = None,
    proj_main_grad: Optional[Tensor] = None,
    fc1_main_grad: Optional[Tensor] = None,
    fc2_main_grad: Optional[Tensor] = None,
    tp_group=None,
    sequence_parallel: bool = False,
    dropout_seeds: Optional[Tensor] = None,
    attention_kernels: Optional[tuple] = None,
    fp8: Optional[fp8_linears.Fp8Recipe] = None,
    fp8_history: Optional[Tensor] = None,
    fp8_warm: bool = False,
    fp8_weights: Optional[tuple] = None,
    fp8_next_scales: Optional[Tensor] = None,
) -> Tensor:
    """One dense pre-norm GPT layer on ``x`` of shape [s, b, h]; megatron's layouts.

    ``*_main_grad``: megatron's gradient-buffer views of the four weights, to write their
    gradients into directly (the buffer holds nothing of this step to add to; None:
    ordinary autograd gradients).
    ``tp_group``: the tensor-parallel group when the weights are this rank's shards
    (megatron's column-parallel QKV and fc1, row-parallel projection and fc2);
    ``groups`` then counts this rank's query groups. ``sequence_parallel``: ``x`` is this
    rank's slice of the sequence, gathered before QKV and fc1 and scattered after the
    projection and fc2, as megatron's parallel linears do. ``dropout_seeds``: two int32
    seeds, one per residual dropout, whose masks then come from ``hash_dropout`` (None:
    ``F.dropout``). ``attention_kernels``: the SDPA kernels attention may use
    (``--attention-backend``; None: torch picks). ``fp8``: the four linears in FP8
    (``fp8.py``), ``fp8_history`` the layer's amax history under delayed scaling (updated in
    place) and ``fp8_warm`` whether an earlier forward has recorded it; ``fp8_weights`` the
    optimizer's FP8 copies of the weights to read instead of casting them
    (``fp8_weights.LayerCopies``), and ``fp8_next_scales`` where to leave the weights'
    scales the next forward will read, for the optimizer to cast them by."""
    step = None if fp8 is None else fp8_linears.start_step(fp8, fp8_history, fp8_warm,
                                                           fp8_weights)
    y = model_math.norm(x, ln1_w, ln1_b, eps, rms)
    qkv = _column_linear(y, qkv_w, qkv_b, qkv_main_grad, tp_group, sequence_parallel,
                         step, fp8_linears.QKV)
    s, b = qkv.shape[0], qkv.shape[1]  # the whole sequence, also under sequence parallelism
    q, k, v = model_math.split_qkv(qkv, groups, q_per_group, head_dim)
    if rope is not None:
        q = model_math.rotary_from_freqs(q, rope, rotary_interleaved, rope_mscale)
        k = model_math.rotary_from_freqs(k, rope, rotary_interleaved, rope_mscale)
    q = q.permute(1, 2, 0, 3)
    k = k.permute(1, 2, 0, 3)
    v = v.permute(1, 2, 0, 3)
    if q_per_group > 1:
        k = k.repeat_interleave(q_per_group, dim=1)
        v = v.repeat_interleave(q_per_group, dim=1)
    o = _attention(q, k, v, attn_p if training else 0.0, scale, tp_group, sequence_parallel,
                   attention_kernels)
    o = o.permute(2, 0, 1, 3).reshape(s, b, groups * q_per_group * head_dim)
    a = _row_parallel_output(_linear(o, proj_w, None, proj_main_grad, step, fp8_linears.PROJ),
                             tp_group, sequence_parallel)
    x = _bias_dropout_add(a, proj_b, x, hidden_p, training, dropout_seeds, 0)
    y = model_math.norm(x, ln2_w, ln2_b, eps, rms)
    f = model_math.activation(_column_linear(y, fc1_w, fc1_b, fc1_main_grad, tp_group,
                                             sequence_parallel, step, fp8_linears.FC1), act)
    m = _row_parallel_output(_linear(f, fc2_w, None, fc2_main_grad, step, fp8_linears.FC2),
                             tp_group, sequence_parallel)
    if fp8_next_scales is not None and step is not None and step.history is not None:
        fp8_next_scales.copy_(fp8_linears.next_weight_scales(step.history, fp8))
    return _bias_dropout_add(m, fc2_b, x, hidden_p, training, dropout_seeds, 1)


def _bias_dropout_add(out: Tensor, bias: Optional[Tensor], residual: Tensor, p: float,
                      training: bool, seeds: Optional[Tensor], which: int) -> Tensor:
    """``residual + dropout(out + bias)`` rounded once, as megatron's fused bias-dropout-add
    computes it. Rounded after each addition in bf16, a bias smaller than half a unit in the
    last place of ``out`` is lost in ``out + bias`` before it reaches the residual stream,
    where summed in fp32 it shifts the rounding; early in training every bias is that small
    (Adam moves each by the learning rate, 1e-5 in the warm-up), and an eager layer that
    added step by step trained as if it had none (its loss parted from megatron's layers' at
    the third iteration). Compiled, inductor fuses the three into one kernel in fp32; eager,
    megatron's own fused function (compiled by megatron's ``jit_fuser``) does it.
    ``seeds``: the compiled layer's hash-dropout seeds (None: ``F.dropout``'s masks)."""
    if seeds is not None and training:
        y = out if bias is None else out + bias
        return residual + hash_dropout.dropout(y, p, seeds[which])
    if torch.compiler.is_compiling():
        y = out if bias is None else out + bias
        return residual + F.dropout(y, p, training)
    global _megatron_bda_failed
    if not _megatron_bda_failed:
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

        try:
            return get_bias_dropout_add(training, fused=True)((out, bias), residual, p)
        except Exception as e:  # noqa: BLE001
            if not is_compile_error(e):
                raise
            logger.warning("fast spec: megatron's fused bias-dropout-add did not compile "
                           "(%s: %s); the eager layer adds in fp32 instead", type(e).__name__,
                           str(e)[:300])
            _megatron_bda_failed = True
    # the same sum in fp32, rounded once (more memory traffic than the fused kernel)
    y = out.float() if bias is None else out.float() + bias.float()
    return (residual.float() + F.dropout(y, p, training)).to(residual.dtype)


def _refresh_fp8_copies(layer: "FastTransformerLayer", incompatible_keys) -> None:
    """A state dict loaded into ``layer`` changed its weights: their FP8 copies follow."""
    layer._fp8_copies.refresh(layer._fp8_weight_tensors())


def layer_function(options: FusedLayerOptions) -> Callable:
    """The fused layer function ``options`` ask for: ``fused_layer_forward`` itself, or its
    compiled form (built once per compile setting)."""
    key = options.compile_options
    if not options.compile or key in _COMPILE_FAILED:
        return fused_layer_forward
    if key not in _COMPILED:
        opts = dict(options.compile_options)
        opts.setdefault("dynamic", False)
        opts.setdefault("fullgraph", True)
        _COMPILED[key] = torch.compile(fused_layer_forward, **opts)
    return _COMPILED[key]


def compile_failed(options: FusedLayerOptions) -> None:
    """The compiler failed under ``options``: their layers run eagerly from now on."""
    _COMPILE_FAILED.add(options.compile_options)


def _mlp_activation_name(mlp: MLP) -> Optional[str]:
    """The fused layer's activation for ``mlp`` (``model_math``'s names), None where megatron's
    MLP computes something it does not: an activation module of TE's, a clamp or offset, a
    gate other than SiLU's, or a bias fusion megatron itself would refuse."""
    cfg = mlp.config
    if getattr(cfg, "use_te_activation_func", False):
        return None
    if getattr(cfg, "activation_func_clamp_value", None) is not None:
        return None
    if getattr(cfg, "glu_linear_offset", 0.0) not in (0, 0.0, None):
        return None
    name = model_math.activation_name(cfg)  # the MLP's activation_func is its config's
    if cfg.gated_linear_unit:
        return model_math.SWIGLU if name == model_math.SILU else None
    if name == model_math.GELU_TANH:
        # megatron's bias-GeLU fusion (the tanh approximation) needs the bias
        return name if cfg.add_bias_linear else None
    if name == model_math.GELU:
        return name
    if name in (model_math.SILU, model_math.RELU):
        # megatron fuses only GeLU and gated SiLU with their bias
        return None if cfg.bias_activation_fusion else name
    return None


class FastTransformerLayer(TransformerLayer):
    """megatron ``TransformerLayer`` with a fused single-function path for the common case."""

    def __init__(self, *args, fused_options: Optional[FusedLayerOptions] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_options = fused_options or FusedLayerOptions()
        self.fused_unsupported_reason = self._static_fused_check()
        if self.fused_unsupported_reason is not None and self.fused_options.fp8 is not None:
            # FP8 runs in the fused function's linears only: megatron's layer would train
            # this layer in bf16 while the launch asked for FP8
            from megagpt.errors import UserError

            raise UserError(f"--fp8-format on the fast spec: layer {self.layer_number} cannot "
                            f"run the fused layer ({self.fused_unsupported_reason}), where "
                            "FP8 runs; Transformer Engine's layers run FP8 there "
                            "(--transformer-impl transformer_engine)")
        if self.fused_unsupported_reason is not None and self.layer_number == 1:
            logger.info("fast spec: fused layer off: %s", self.fused_unsupported_reason)
        # delayed FP8 scaling: this layer's amax history (fp8.py), made on its first forward
        # on the input's device; not a buffer, so the state dict is the bf16 model's
        self._fp8_history: Optional[Tensor] = None
        self._fp8_warm = False
        self._fp8_fallback_logged = False
        # the weights' FP8 copies the optimizer writes (fp8_weights), where the recipe asks
        self._fp8_copies: Optional[fp8_weights.LayerCopies] = None
        recipe = self.fused_options.fp8
        if self.fused_unsupported_reason is None and recipe is not None \
                and recipe.weights_written:
            self._fp8_copies = fp8_weights.LayerCopies(recipe.linears)
            for linear, weight in self._fp8_weight_tensors().items():
                fp8_weights.mark(weight, self._fp8_copies, linear)
            self.register_load_state_dict_post_hook(_refresh_fp8_copies)

    # ---- when the fused path applies -------------------------------------------------
    def _static_fused_check(self) -> Optional[str]:
        cfg = self.config
        att = self.self_attention
        if type(att) is not SelfAttention:
            return f"attention module {type(att).__name__}"
        if not isinstance(att.core_attention, SDPADotProductAttention):
            return "core attention is not SDPA"
        if att.core_attention.honour_attention_mask:
            return "attention mask must be honoured (--reset-attention-mask)"
        if att.attn_mask_type != AttnMaskType.causal:
            return "attention mask type is not causal"
        for linear, parallel_input in ((att.linear_qkv, False), (att.linear_proj, True),
                                       (self.mlp.linear_fc1, False),
                                       (self.mlp.linear_fc2, True)):
            # megatron's dense-layer wiring: column-parallel outputs stay split, row-parallel
            # inputs arrive split, gradients are all-reduced across the tensor-parallel ranks
            if parallel_input and not getattr(linear, "input_is_parallel", True):
                return "a row-parallel linear whose input is not split"
            if not parallel_input and getattr(linear, "gather_output", False):
                return "a column-parallel linear that gathers its output"
            if getattr(linear, "disable_grad_reduce", False) or getattr(
                    linear, "explicit_expert_comm", False):
                return "a linear with its own gradient communication"
            if bool(getattr(linear, "sequence_parallel", False)) != bool(cfg.sequence_parallel):
                return "a linear whose sequence parallelism differs from the layer's"
        if getattr(cfg, "context_parallel_size", 1) != 1:
            return "context parallelism"
        if not isinstance(att.q_layernorm, (IdentityOp, type(None))) or not isinstance(
            att.k_layernorm, (IdentityOp, type(None))
        ):
            return "q/k norms"
        if getattr(cfg, "attention_output_gate", False):
            return "attention output gate"
        if type(att.linear_qkv) is not ColumnParallelLinear:
            return "linear_qkv is not megatron's ColumnParallelLinear"
        if type(att.linear_proj) is not RowParallelLinear:
            return "linear_proj is not megatron's RowParallelLinear"
        if getattr(att, "_yarn_concentration_factor", 1.0) is None:
            return "yarn"
        if type(self.mlp) is not MLP:
            return f"mlp module {type(self.mlp).__name__}"
        if type(self.mlp.linear_fc1) is not ColumnParallelLinear or type(
            self.mlp.linear_fc2
        ) is not RowParallelLinear:
            return "mlp linears are not megatron's parallel linears"
        if _mlp_activation_name(self.mlp) is None:
            return "activation function has no fused equivalent"
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            norm = getattr(self, name)
            if type(norm) not in (torch.nn.LayerNorm, torch.nn.RMSNorm):
                return f"{name} is {type(norm).__name__}"
        if type(self.input_layernorm) is not type(self.pre_mlp_layernorm):
            return "different norm types"
        if not isinstance(self.pre_cross_attn_layernorm, IdentityOp) or not isinstance(
            self.cross_attention, IdentityOp
        ):
            return "cross attention"
        if cfg.recompute_granularity is not None:
            return f"recompute granularity {cfg.recompute_granularity}"
        for flag in (
            "fine_grained_activation_offloading",
            "cpu_offloading",
            "apply_residual_connection_post_layernorm",
            "fp32_residual_connection",
            "test_mode",
            "multi_latent_attention",
            "delay_wgrad_compute",
            "layernorm_zero_centered_gamma",
            "use_mup",
        ):
            if getattr(cfg, flag, False):
                return flag
        if getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None):
            return "fp8/fp4"
        if getattr(cfg, "no_rope_freq", None):
            return "no_rope_freq"
        # megatron's per-layer graphs (local) capture this module's forward, the fused
        # function included; a full-iteration graph records it; TE's graphs replace the
        # module's call with TE's own capture
        if getattr(cfg, "cuda_graph_impl", "none") not in ("none", None, "full_iteration",
                                                            "local"):
            return f"cuda_graph_impl={cfg.cuda_graph_impl}"
        if getattr(cfg, "softmax_type", "vanilla") != "vanilla":
            return "softmax type"
        if getattr(cfg, "window_size", None) is not None:
            return "sliding window"
        return None

    @staticmethod
    def _rope_ok(rotary_pos_emb) -> bool:
        return rotary_pos_emb is None or (
            isinstance(rotary_pos_emb, Tensor)
            and rotary_pos_emb.size(-1) > 0
        )

    # ---- the weights' FP8 copies ---------------------------------------------------------
    def _fp8_weight_tensors(self) -> dict:
        """The weights whose FP8 copies the optimizer writes, by linear (``fp8.QKV``, ...)."""
        att, mlp = self.self_attention, self.mlp
        weights = (att.linear_qkv.weight, att.linear_proj.weight, mlp.linear_fc1.weight,
                   mlp.linear_fc2.weight)  # in the order of fp8.ALL_LINEARS
        return {i: weights[i] for i in self._fp8_copies.linears}

    def train(self, mode: bool = True):
        """Evaluation's forwards moved the amax history on: back in training the copies are
        cast afresh by the scales the next forward will read (a replayed training graph
        reads them without asking)."""
        evaluating = not self.training
        result = super().train(mode)
        if mode and evaluating and getattr(self, "_fp8_copies", None) is not None:
            self._fp8_copies.refresh(self._fp8_weight_tensors())
        return result

    # ---- megatron's per-layer CUDA graphs -----------------------------------------------
    def _should_call_local_cudagraph(self, *args, **kwargs):
        """Training calls go through megatron's per-layer graphs; evaluation and other
        calls without gradients run the layer itself. megatron's graph manager would
        replay the graph captured in training for them too: dropout on, and activations
        saved for a backward pass that never comes."""
        if not (self.training and torch.is_grad_enabled()):
            return False
        return super()._should_call_local_cudagraph(*args, **kwargs)

    # ---- forward -----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.fused_unsupported_reason is None and not args:
            hidden_states = kwargs.get("hidden_states")
            rope = kwargs.get("rotary_pos_emb")
            dynamic_ok = (
                hidden_states is not None
                and kwargs.get("context") is None
                and kwargs.get("inference_context") is None
                and kwargs.get("inference_params") is None
                and kwargs.get("packed_seq_params") is None
                and kwargs.get("attention_bias") is None
                and kwargs.get("rotary_pos_cos") is None
                and kwargs.get("rotary_pos_sin") is None
                and kwargs.get("rotary_pos_cos_sin") is None
                and self._rope_ok(rope)
                and hidden_states.dim() == 3
            )
            if dynamic_ok:
                return self._fused_forward(hidden_states, rope), kwargs.get("context")
        if (self.fused_options.fp8 is not None and self.training
                and not self._fp8_fallback_logged):
            self._fp8_fallback_logged = True
            logger.warning("fast spec: layer %d: a training forward with inputs the fused layer "
                           "does not take (packed sequences, an attention bias, ...) runs "
                           "megatron's layer, in bf16, not FP8", self.layer_number)
        return super().forward(*args, **kwargs)

    def fused_arguments(self, rope: Optional[Tensor]):
        """The tensors and constants ``fused_layer_forward`` takes for this layer."""
        att, mlp, cfg = self.self_attention, self.mlp, self.config
        core = att.core_attention
        heads = core.num_attention_heads_per_partition
        groups = core.num_query_groups_per_partition
        ln1, ln2 = self.input_layernorm, self.pre_mlp_layernorm
        rms = isinstance(ln1, torch.nn.RMSNorm)
        eps = ln1.eps if ln1.eps is not None else torch.finfo(torch.float32).eps
        mscale = getattr(att, "_yarn_concentration_factor", 1.0)
        tensors = (
            ln1.weight,
            getattr(ln1, "bias", None),
            att.linear_qkv.weight,
            att.linear_qkv.bias,
            att.linear_proj.weight,
            att.linear_proj.bias,
            ln2.weight,
            getattr(ln2, "bias", None),
            mlp.linear_fc1.weight,
            mlp.linear_fc1.bias,
            mlp.linear_fc2.weight,
            mlp.linear_fc2.bias,
            rope,
        )
        consts = dict(
            eps=float(eps),
            rms=rms,
            groups=groups,
            q_per_group=heads // groups,
            head_dim=core.hidden_size_per_attention_head,
            scale=float(core.softmax_scale),
            attn_p=float(core.attention_dropout_p),
            hidden_p=float(self.hidden_dropout),
            act=_mlp_activation_name(mlp),
            rotary_interleaved=bool(cfg.rotary_interleaved),
            rope_mscale=float(mscale if mscale is not None else 1.0),
            training=bool(self.training),
            attention_kernels=core.sdpa_kernels,
        )
        weights = dict(qkv_main_grad=att.linear_qkv.weight, proj_main_grad=att.linear_proj.weight,
                       fc1_main_grad=mlp.linear_fc1.weight, fc2_main_grad=mlp.linear_fc2.weight)
        if self.wgrad_mode(weights.values()) == "write":
            for name, w in weights.items():
                consts[name] = w.main_grad
                grad_marks.mark_written_by_gemm(w)
        recipe = self.fused_options.fp8
        if recipe is not None:
            consts["fp8"] = recipe
            if recipe.delayed:
                if self._fp8_history is None:
                    self._fp8_history = fp8_linears.new_history(recipe, att.linear_qkv.weight.device)
                consts["fp8_history"] = self._fp8_history
                consts["fp8_warm"] = self._fp8_warm
                copies = self._fp8_copies
                if copies is not None and copies.bound:
                    consts["fp8_next_scales"] = copies.next_scales
                    training = self.training and torch.is_grad_enabled()
                    if copies.readable(self._fp8_warm, training):
                        consts["fp8_weights"] = copies.forward_inputs()
        return tensors, consts

    def wgrad_mode(self, weights) -> Optional[str]:
        """How this forward's weight GEMMs deliver their gradients in backward: ``"write"``
        them into megatron's buffer (gradients written, ``grad_write``: nothing of this step
        is there to add to), or None (autograd and megatron's DDP hook)."""
        weights = list(weights)
        if getattr(self.config, "cuda_graph_impl", "none") == "local":
            # megatron's captured backward adds each weight's gradient into main_grad
            # itself (decided when it captures), so the GEMMs must hand theirs to autograd
            return None
        if not (self.training and torch.is_grad_enabled()
                and self.self_attention.pg_collection.tp.size() == 1
                and all(w.requires_grad and getattr(w, "main_grad", None) is not None
                        and hasattr(w, "grad_added_to_main_grad")
                        and not getattr(w, "zero_out_wgrad", False)
                        and w.main_grad.shape == w.shape for w in weights)):
            return None
        if all(grad_marks.gemm_may_write(w) and w.main_grad.dtype == w.dtype
               for w in weights):
            return "write"
        return None

    def _fused_forward(self, hidden_states: Tensor, rope: Optional[Tensor]) -> Tensor:
        tensors, consts = self.fused_arguments(rope)
        tp_group = self.self_attention.pg_collection.tp
        if tp_group.size() > 1:
            # eager: the tensor-parallel collectives are megatron's autograd functions, and
            # without a full-iteration graph (one GPU only) the step is host-bound, where
            # one Python function in place of ~25 module calls per layer is what counts
            consts["tp_group"] = tp_group
            consts["sequence_parallel"] = bool(self.config.sequence_parallel)
            fn = fused_layer_forward
        else:
            fn = layer_function(self.fused_options)
            if (self.fused_options.hash_dropout and fn is not fused_layer_forward
                    and consts["training"] and consts["hidden_p"] > 0.0
                    and hash_dropout.usable(hidden_states.shape)):
                # drawn here, outside the compiled function: the seeds are its inputs
                consts["dropout_seeds"] = hash_dropout.draw_seeds(2, hidden_states.device)
        try:
            out = fn(hidden_states, *tensors, **consts)
        except Exception as e:  # noqa: BLE001
            if fn is fused_layer_forward or not is_compile_error(e):
                raise
            # a compiler failure must not stop training: run this function eagerly from now on
            logger.warning("fast spec: torch.compile of the fused layer failed (%s: %s); "
                           "running it eagerly", type(e).__name__, str(e)[:300])
            compile_failed(self.fused_options)
            out = fused_layer_forward(hidden_states, *tensors, **consts)
        if consts.get("fp8_history") is not None and consts["training"] \
                and torch.is_grad_enabled():
            self._fp8_warm = True  # this forward recorded the amaxes the next one scales by
        if consts.get("fp8_next_scales") is not None:
            self._fp8_copies.forward_done()
        return make_viewless_tensor(inp=out, requires_grad=out.requires_grad, keep_graph=True)
