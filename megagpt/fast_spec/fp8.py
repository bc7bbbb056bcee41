"""FP8 linears for the fast spec's fused layer, through torch's ``_scaled_mm`` (no TE).

What one linear computes under megatron's ``--fp8-format`` (x: [M, K] input, w: [N, K]):

  forward  y  = (x8 / s_x) (w8 / s_w)^T + b     e4m3 x e4m3, cuBLAS's fast accumulation,
                                                the bias in the GEMM's epilogue
  dgrad    dx = (g8 / s_g) (w8 / s_w)           g8 e5m2 under ``hybrid``, e4m3 under ``e4m3``
  wgrad    dw = (g8 / s_g)^T (x8 / s_x)         written into ``main_grad`` where the layer
                                                writes its gradients (``grad_write``)

Every tensor has one scale, s = fp8_max / amax / 2^margin (megatron's ``--fp8-margin``),
so that its largest value lands at the format's largest. The two recipes differ in where
amax comes from:

- ``tensorwise`` (TE's current scaling): the amax of the tensor itself, a reduction over it
  before the cast can start;
- ``delayed`` (megatron's default, TE's delayed scaling): for inputs and weights, the amax
  recorded by the layer's earlier forwards (``--fp8-amax-history-len``,
  ``--fp8-amax-compute-algo``), so the cast needs no reduction before it and records this
  step's amax in the same pass. Output gradients are scaled, as TE's delayed scaling does,
  by the amax the earlier backwards recorded (``grad_scaling="delayed"``, the default), or
  by their own amax (``"current"``, ``--fast-fp8-grad-scaling``: a reduction over the
  gradient before its cast). A layer's first forward has no history: as TE's delayed
  scaling does, it scales its inputs, weights and output gradients by 1
  (``first_scales="unit"``, the default), or each tensor by its own amax (``"amax"``,
  ``--fast-fp8-first-scales``). At 345M on text TE's choices trained to TE's FP8 losses
  (0.04 % apart over two seeds), the own-amax ones 0.66 % above them (bench/notes/fp8.md).

The backward GEMMs read the FP8 operands transposed (cuBLAS's FP8 GEMM takes its first
operand row-major and its second column-major): each cast writes both layouts in one pass
(``fp8_cast``). Under delayed scaling the weights need not be cast by the forward at all:
a weight's scale comes from the history before the forward starts, so the flat AdamW step,
which writes the bf16 weight, can write its FP8 copies (both layouts) and amax in the same
pass (``weights_written``; ``fp8_weights`` holds the copies, ``train_step.flat_adam_fp8``
writes them), and the forward after it reads them instead (``Fp8Step.weights``). Each
forward leaves the weights' scales the next one will read (``next_weight_scales``) for the
optimizer to cast by.
Weights, biases, main gradients and the optimizer are untouched, so a checkpoint is the
bf16 model's. ``emulate`` runs the same quantisation with the products in float32
(dequantise, then matmul): for tests where ``_scaled_mm`` cannot run; a GPU test holds it
against the real kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import fp8_cast

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = fp8_cast.FP8_MAX

# The fused layer's linears, in the order it runs them; each owns three columns of the amax
# history: its input's (2 i) and its weight's (2 i + 1), e4m3, and its output gradient's
# (GRAD_COLUMNS + i), in the format's gradient type.
QKV, PROJ, FC1, FC2 = range(4)
LINEARS = 4
ALL_LINEARS = (QKV, PROJ, FC1, FC2)
LINEAR_NAMES = ("qkv", "proj", "fc1", "fc2")
GRAD_COLUMNS = 2 * LINEARS
HISTORY_COLUMNS = 3 * LINEARS

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed")
AMAX_ALGOS = ("most_recent", "max")
# a delayed-scaling layer's first forward, before any amax is recorded: scales of 1 (TE's
# delayed scaling starts its scales at 1), or each tensor's own amax
FIRST_SCALES = ("amax", "unit")
# delayed scaling's output gradients: the earlier backwards' amax (TE's), or their own
GRAD_SCALINGS = ("current", "delayed")


@dataclass(frozen=True)
class Fp8Recipe:
    """How the fused layer's linears run in FP8 (megatron's fp8 arguments)."""

    format: str = "hybrid"  # --fp8-format
    scaling: str = "delayed"  # --fp8-recipe
    margin: int = 0  # --fp8-margin
    history_len: int = 1  # --fp8-amax-history-len
    amax_algo: str = "most_recent"  # --fp8-amax-compute-algo
    wgrad: bool = True  # --no-fp8-wgrad: the weight gradient's GEMM in bf16
    first_scales: str = "unit"  # --fast-fp8-first-scales (delayed scaling's first forward)
    grad_scaling: str = "delayed"  # --fast-fp8-grad-scaling (delayed scaling's gradients)
    emulate: bool = False  # float32 products of the dequantised operands (tests)
    # the linears that run in FP8; the others in bf16 (too narrow to gain: megagpt.launch.fp8)
    linears: tuple = ALL_LINEARS
    # delayed scaling: the flat AdamW step writes the weights' FP8 copies for the forward
    # (megagpt.launch.fp8.weight_writes_unsupported_reason decides; False: each forward casts)
    weights_written: bool = False

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"FP8 format {self.format!r}: one of {FORMATS}")
        if self.scaling not in RECIPES:
            raise ValueError(f"FP8 recipe {self.scaling!r}: one of {RECIPES}")
        if self.amax_algo not in AMAX_ALGOS:
            raise ValueError(f"amax algorithm {self.amax_algo!r}: one of {AMAX_ALGOS}")
        if self.history_len < 1:
            raise ValueError("the amax history holds at least one step")
        if self.first_scales not in FIRST_SCALES:
            raise ValueError(f"first scales {self.first_scales!r}: one of {FIRST_SCALES}")
        if self.grad_scaling not in GRAD_SCALINGS:
            raise ValueError(f"gradient scaling {self.grad_scaling!r}: one of {GRAD_SCALINGS}")
        if not self.linears or not set(self.linears) <= set(ALL_LINEARS):
            raise ValueError(f"FP8 linears {self.linears!r}: some of {ALL_LINEARS}")
        if self.weights_written and self.scaling != "delayed":
            raise ValueError("FP8 weights written by the optimizer need delayed scaling (a "
                             "current scale is the weight's own amax, known once written)")

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" else E4M3

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"

    @property
    def delayed_grads(self) -> bool:
        return self.delayed and self.grad_scaling == "delayed"

    def __str__(self) -> str:  # the launch's FP8 choice, as --dry-run prints it
        written = ", weights written by the optimizer" if self.weights_written else ""
        return f"{self.format}, {self.scaling} scaling, fast spec{written}{self._bf16_part()}"

    def _bf16_part(self) -> str:
        kept = [LINEAR_NAMES[i] for i in range(LINEARS) if i not in self.linears]
        return f" ({', '.join(kept)} in bf16)" if kept else ""

    def describe(self) -> str:
        grads = "e5m2" if self.format == "hybrid" else "e4m3"
        history = ("the forward before's amax" if self.history_len == 1 else
                   f"the {self.amax_algo.replace('_', ' ')} amax of the last "
                   f"{self.history_len} forwards")
        grad_scales = ("gradients by the backward before's" if self.delayed_grads
                       else "gradients by their own")
        first = "; the first forward's scales 1" if self.first_scales == "unit" else ""
        scaling = (f"delayed scaling ({history}; {grad_scales}{first})"
                   if self.delayed else "current scaling")
        wgrad = "" if self.wgrad else "; weight gradients in bf16"
        return (f"{self.format}: e4m3 inputs and weights, {grads} gradients, {scaling}{wgrad}"
                f"{self._bf16_part()}")


# ---- scales -------------------------------------------------------------------------------

def scale_from_amax(amax: Tensor, dtype: torch.dtype, margin: int) -> Tensor:
    """fp8_max / amax / 2^margin in float32; 1 where amax is 0 (an all-zero tensor)."""
    amax = amax.float()
    scale = FP8_MAX[dtype] / torch.clamp(amax, min=1e-30) / (2.0 ** margin)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def new_history(recipe: Fp8Recipe, device) -> Tensor:
    """An empty amax history for one layer: [history_len, HISTORY_COLUMNS], float32."""
    return torch.zeros(recipe.history_len, HISTORY_COLUMNS, dtype=torch.float32, device=device)


def delayed_scales(history: Tensor, recipe: Fp8Recipe) -> Tensor:
    """The scale of every history column from the steps recorded so far: e4m3's for the
    inputs and weights, the gradient type's for the gradients."""
    amax = history[0] if recipe.amax_algo == "most_recent" else history.amax(dim=0)
    return torch.cat([scale_from_amax(amax[:GRAD_COLUMNS], E4M3, recipe.margin),
                      scale_from_amax(amax[GRAD_COLUMNS:], recipe.grad_dtype, recipe.margin)])


# the weights' history columns (2 i + 1), in the order of the linears
WEIGHT_COLUMNS = slice(1, GRAD_COLUMNS, 2)


def next_weight_scales(history: Tensor, recipe: Fp8Recipe) -> Tensor:
    """[LINEARS]: each weight's scale the next forward will read from ``history`` as it is
    after this forward's records (a backward records gradients' amaxes only). The same
    arithmetic as the next forward's ``delayed_scales``, so the same bits in a compiled
    layer as in an eager one."""
    return delayed_scales(history, recipe)[WEIGHT_COLUMNS]


def advance_history(history: Tensor) -> None:
    """Make room for this step's amaxes in row 0 (the oldest row drops out)."""
    if history.shape[0] > 1:
        history.copy_(torch.roll(history, 1, dims=0))
        history[0].zero_()


@dataclass(frozen=True)
class Fp8Step:
    """One layer forward's FP8 state: the recipe, the layer's amax history (delayed
    scaling; None for current scaling) and the scales read from it before this forward
    (None: scale each tensor by its own amax, as on a layer's first forward).
    ``first_unit``: a first forward under ``first_scales="unit"``, whose scales are all 1,
    its output gradients' too."""

    recipe: Fp8Recipe
    history: Optional[Tensor] = None
    scales: Optional[Tensor] = None
    first_unit: bool = False
    # the optimizer's FP8 copies of the weights, to read instead of casting them:
    # (w8 by linear, w8_t by linear, scales [LINEARS], amaxes [LINEARS]); None: cast
    weights: Optional[tuple] = None

    def weight_copy(self, linear: int) -> Optional[tuple]:
        """(w8, w8_t, scale, amax) of ``linear``'s weight as the optimizer wrote them (None:
        the forward casts it)."""
        if self.weights is None or self.weights[0][linear] is None:
            return None
        w8, w8_t, scales, amaxes = self.weights
        return w8[linear], w8_t[linear], scales[linear], amaxes[linear:linear + 1]

    def grad_scale(self, linear: int) -> Optional[Tensor]:
        """The scale of ``linear``'s output gradient, read before backward (None: the
        gradient's own amax, taken in backward)."""
        if self.scales is not None and (self.recipe.delayed_grads or self.first_unit):
            return self.scales[GRAD_COLUMNS + linear]
        return None

    def grad_history(self) -> Optional[Tensor]:
        """Where backward records the gradients' amaxes (delayed gradient scaling)."""
        return self.history if self.recipe.delayed_grads else None


def start_step(recipe: Fp8Recipe, history: Optional[Tensor], warm: bool,
               weights: Optional[tuple] = None) -> Fp8Step:
    """The FP8 state of a layer forward: under delayed scaling the scales from the
    history (``warm``: a forward has recorded it) and the history advanced to this step;
    ``weights``: the optimizer's copies of the weights (``Fp8Step.weights``), written with
    the scales this history gives (a warm forward's only)."""
    if not recipe.delayed or history is None:
        return Fp8Step(recipe)
    if weights is not None and not warm:
        raise ValueError("the optimizer's FP8 weights are for a forward after the first")
    unit = not warm and recipe.first_scales == "unit"
    if warm:
        scales = delayed_scales(history, recipe)
    else:
        scales = torch.ones(HISTORY_COLUMNS, device=history.device) if unit else None
    advance_history(history)
    return Fp8Step(recipe, history, scales, first_unit=unit, weights=weights)


def for_linear(step: Optional[Fp8Step], linear: int) -> Optional[Fp8Step]:
    """``step`` where ``linear`` runs in FP8 under its recipe, else None (bf16)."""
    return step if step is not None and linear in step.recipe.linears else None


def operand_scale(t: Tensor, column: int, step: Fp8Step) -> Tensor:
    """The e4m3 scale of ``t`` (an input or a weight): from the history where the step has
    read one, else from ``t``'s own amax (a reduction before the cast)."""
    if step.scales is not None:
        return step.scales[column]
    return scale_from_amax(t.detach().abs().amax(), E4M3, step.recipe.margin)


def record_amax(step: Fp8Step, column: int, amax: Tensor) -> None:
    """``amax`` (the cast's, of this step's tensor) into the history's newest row."""
    if step.history is not None:
        step.history[0, column] = amax[0]


def cast(t: Tensor, column: int, step: Fp8Step, transpose: bool):
    """(t8, t8 transposed or empty, scale) of ``t`` ([M, K]) in e4m3, its amax recorded."""
    scale = operand_scale(t, column, step)
    q, q_t, amax = fp8_cast.cast_transpose(t.detach(), scale.reshape(1), E4M3, transpose)
    record_amax(step, column, amax)
    return q, q_t, scale


# ---- the GEMMs ----------------------------------------------------------------------------

def scaled_mm(a8: Tensor, b8: Tensor, a_inv: Tensor, b_inv: Tensor, bias: Optional[Tensor],
              out_dtype: torch.dtype, fast_accum: bool, emulate: bool) -> Tensor:
    """(a8 * a_inv) @ (b8 * b_inv) + bias in ``out_dtype``; a8 row-major, b8 column-major."""
    if emulate:
        out = (a8.float() * a_inv) @ (b8.float() * b_inv)
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)
    return torch._scaled_mm(a8, b8, a_inv, b_inv, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


@torch.library.custom_op("megagpt::fp8_record_grad_amax", mutates_args=("history",))
def fp8_record_grad_amax(history: Tensor, column: int, amax: Tensor) -> None:
    """``amax`` (one element, an output gradient's) into the history's newest row at
    ``column``: an operator, so that backward's write to the layer's history survives the
    compiler's functionalisation as the weight gradients' writes into main_grad do."""
    history[0, column] = amax[0]


@torch.library.custom_op("megagpt::fp8_wgrad_into_main_grad", mutates_args=("main_grad",))
def fp8_wgrad_into_main_grad(g8_t: Tensor, x8_t: Tensor, g_inv: Tensor, x_inv: Tensor,
                             main_grad: Tensor, weight_dtype: torch.dtype,
                             emulate: bool) -> Tensor:
    """``main_grad = (g8_t * g_inv) @ (x8_t * x_inv)^T``, the GEMM's output written straight
    into the gradient buffer (g8_t: [N, M], x8_t: [K, M], both row-major); returns a
    placeholder weight gradient for autograd to hand on (as the bf16 path's)."""
    if emulate:
        main_grad.copy_((g8_t.float() * g_inv) @ (x8_t.float() * x_inv).t())
    else:
        torch._scaled_mm(g8_t, x8_t.t(), g_inv, x_inv, out_dtype=main_grad.dtype,
                         use_fast_accum=False, out=main_grad)
    return torch.empty(main_grad.shape, dtype=weight_dtype, device=main_grad.device)


@fp8_wgrad_into_main_grad.register_fake
def _(g8_t, x8_t, g_inv, x_inv, main_grad, weight_dtype, emulate):
    return main_grad.new_empty(main_grad.shape, dtype=weight_dtype)


class _Fp8Linear(torch.autograd.Function):
    """``x @ w^T + b`` from the FP8 casts of x and w (``fp8_linear``), all three GEMMs in
    FP8 (module docstring); x and w come in for autograd to route their gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Optional[Tensor], main_grad: Optional[Tensor],
                x8: Tensor, x8_t: Tensor, x_scale: Tensor, w8: Tensor, w8_t: Tensor,
                w_scale: Tensor, recipe: Fp8Recipe, g_scale: Optional[Tensor],
                grad_history: Optional[Tensor], grad_column: int) -> Tensor:
        lead = x.shape[:-1]
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        y = scaled_mm(x8, w8.t(), x_inv, w_inv, b, x.dtype, True, recipe.emulate)
        # backward reads w8 column-major (dgrad) and x8 column-major (wgrad): the casts'
        # transposed copies, row-major
        kept = x8_t if recipe.wgrad else x.reshape(-1, x.shape[-1])
        # the gradient's scale where it is read before backward (delayed or unit): this
        # step's, saved before the history moves on
        ctx.has_g_scale = g_scale is not None
        ctx.save_for_backward(kept, w8_t, x_inv, w_inv,
                              g_scale if g_scale is not None else x_inv.new_empty((0,)))
        # not a saved tensor: every view of the gradient buffer shares one version counter
        ctx.main_grad = main_grad
        ctx.recipe = recipe
        # not a saved tensor: a buffer backward writes into (as main_grad)
        ctx.grad_history = grad_history
        ctx.grad_column = grad_column
        ctx.has_bias = b is not None
        ctx.lead = lead
        ctx.weight_dtype = w.dtype
        return y.view(*lead, w.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        kept, w8_t, x_inv, w_inv, g_scale = ctx.saved_tensors
        recipe: Fp8Recipe = ctx.recipe
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if not ctx.has_g_scale:
            g_scale = scale_from_amax(g2.abs().amax(), recipe.grad_dtype, recipe.margin)
        wgrad = ctx.needs_input_grad[1] and recipe.wgrad
        g8, g8_t, g_amax = fp8_cast.cast_transpose(g2, g_scale.reshape(1), recipe.grad_dtype,
                                                   wgrad)
        if ctx.grad_history is not None:
            torch.ops.megagpt.fp8_record_grad_amax(ctx.grad_history, ctx.grad_column, g_amax)
        g_inv = g_scale.reciprocal()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(g8, w8_t.t(), g_inv, w_inv, None, grad_out.dtype, False,
                               recipe.emulate).view(*ctx.lead, w8_t.shape[0])
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = _weight_gradient(ctx, g2, g8_t, g_inv, kept, x_inv)
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (grad_x, grad_w, grad_b) + (None,) * 11


def _weight_gradient(ctx, g2: Tensor, g8_t: Tensor, g_inv: Tensor, kept: Tensor,
                     x_inv: Tensor) -> Tensor:
    recipe: Fp8Recipe = ctx.recipe
    if not recipe.wgrad:  # --no-fp8-wgrad: kept is the bf16 input
        if ctx.main_grad is not None:
            # the bf16 path's op (fast_spec.layer registers it; that module runs this one)
            return torch.ops.megagpt.wgrad_into_main_grad(g2, kept, ctx.main_grad)
        return g2.t() @ kept
    if ctx.main_grad is not None:
        return torch.ops.megagpt.fp8_wgrad_into_main_grad(
            g8_t, kept, g_inv, x_inv, ctx.main_grad, ctx.weight_dtype, recipe.emulate)
    return scaled_mm(g8_t, kept.t(), g_inv, x_inv, None, ctx.weight_dtype, False,
                     recipe.emulate)


def fp8_linear(x: Tensor, w: Tensor, b: Optional[Tensor], main_grad: Optional[Tensor],
               step: Fp8Step, linear: int) -> Tensor:
    """``x @ w^T + b`` (x: [..., K], w: [N, K]) in FP8 for the layer's ``linear``
    (QKV, PROJ, FC1, FC2); ``main_grad``: the weight's gradient buffer to write into."""
    x2 = x.reshape(-1, x.shape[-1])
    x8, x8_t, x_scale = cast(x2, 2 * linear, step, transpose=step.recipe.wgrad)
    written = step.weight_copy(linear)
    if written is None:
        w8, w8_t, w_scale = cast(w, 2 * linear + 1, step, transpose=True)
    else:
        # the optimizer's cast of this weight, by the scale this step read: its amax is
        # recorded as the forward's own cast records it
        w8, w8_t, w_scale, w_amax = written
        record_amax(step, 2 * linear + 1, w_amax)
    return _Fp8Linear.apply(x, w, b, main_grad, x8, x8_t, x_scale, w8, w8_t, w_scale,
                            step.recipe, step.grad_scale(linear), step.grad_history(),
                            GRAD_COLUMNS + linear)
