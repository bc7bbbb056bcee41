"""The fast path's steps of the launch (megagpt.launch.fast_path): a launch's layout and flags →
each choice and its reason; planning changes nothing; the writer writes exactly what the
launch says."""

from __future__ import annotations

import copy
import os

import pytest

from megatron_parts import fast_path_namespace

from megagpt.compat import Installed
from megagpt.errors import UserError
from megagpt.fast_spec.fp8 import Fp8Recipe
from megagpt.launch.attention_backend import ATTENTION, Attention
from megagpt.launch.cuda_graphs import NCCL_CHOICE
from megagpt.launch.fast_path import SECTION, STEPS, plan_fast_path
from megagpt.launch.fp8 import FP8, TeFp8
from megagpt.launch.plan import Label, Reason, Why
from megagpt.launch.planner import Planner
from megagpt.launch.resolution import run_steps
from megagpt.launch.writer import write

NO_TE = Installed(transformer_engine=False, apex=False, fused_layer_norm=False,
                  masked_softmax_kernels=False, gradient_accumulation_kernels=False)
TE = Installed(transformer_engine=True, apex=False, fused_layer_norm=False,
               masked_softmax_kernels=False, gradient_accumulation_kernels=False)

DP8 = dict(world_size=8, global_batch_size=512, use_distributed_optimizer=True)


def _given(argv, given):
    from megagpt.flags import explicit_flags

    return frozenset(explicit_flags(argv)) | set(given)


def launch(argv=(), installed=NO_TE, given=(), **attrs):
    """The namespace the fast path's steps see: the fast-path flags parsed, megatron's layout
    given (its flags on the command line: ``given``), and --transformer-impl as the launch's
    compat step chooses it (``launch.layers``)."""
    from megagpt.launch.layers import transformer_impl

    args = fast_path_namespace(argv, **attrs)
    args.transformer_impl = transformer_impl(args, _given(argv, given), installed)[0]
    return args


def plan_of(argv=(), installed=NO_TE, environ=None, given=(), **attrs):
    """The launch of the layers step and the fast path's steps, over one planner."""
    from megagpt.launch.layers import choose_transformer_impl

    args = fast_path_namespace(argv, **attrs)
    p = Planner(args, _given(argv, given), installed, {} if environ is None else environ)
    p.section = "compat"
    choose_transformer_impl(p)
    p.lines.clear()  # the layers' log line is the compat step's, not the fast path's
    return run_steps(p, [(SECTION, step) for step in STEPS])


def shown(choice):
    """(value, reason) of a choice: an enum's member as the plan prints it, the reason's
    text."""
    value = choice.value
    return (str(value) if isinstance(value, (Label, TeFp8, Attention)) else value), str(choice.reason)


def named(plan, name: str):
    """The plan's choice printed under ``name``."""
    return next(c for c in plan.choices if c.name == name)


# layout/flags → {choice: (value, a piece of its reason)}
TABLE = {
    "1 GPU": ([], NO_TE, {}, {
        "layers": ("fast", "Transformer Engine is not installed"),
        "CUDA graph": ("full iteration", "one GPU"),
        "compile": (True, "inside CUDA graphs"),
        "NaN check": ("gradient norm", "inside a CUDA graph"),
        "bf16 grad buffer": (True, "one micro-batch"),
        "grad write": (True, "nothing is accumulated"),
        "NCCL connect": ("unset", "no NCCL collective"),
        "LM loss": ("chunked", "logits never exist all at once"),
        "LM grad in forward": (True, "formed in forward"),
    }),
    "1 GPU, TE installed": ([], TE, {}, {
        "layers": ("fast", "measured faster than TE's"),
        "CUDA graph": ("full iteration", "one GPU"),
    }),
    "DP 8, 64 micro-batches": ([], NO_TE, DP8, {
        "CUDA graph": ("per layer", "more than one GPU"),
        "compile": (True, "inside CUDA graphs"),
        "NaN check": ("gradient norm", "per-layer graphs"),
        "bf16 grad buffer": (False, "more than one data-parallel rank"),
        "grad write": (False, "more than one data-parallel rank"),
    }),
    "DP 8, --fast-disable deferred-nan-checks": (["--fast-disable", "deferred-nan-checks"], NO_TE, DP8, {
        "CUDA graph": ("per layer", "more than one GPU"),
        "NaN check": ("in step", "megatron's checks"),
    }),
    "TP 2 of 4 GPUs": ([], NO_TE, dict(world_size=4, tensor_model_parallel_size=2), {
        "layers": ("fast", "not installed"),
        "CUDA graph": ("none", "per layer: tensor parallelism"),
        "compile": (False, "no CUDA graph"),
        "NaN check": ("in step", "megatron's checks"),
        "LM loss": ("megatron's", "tensor-parallel"),
    }),
    "TP 2, TE installed": ([], TE, dict(world_size=4, tensor_model_parallel_size=2), {
        "layers": ("transformer_engine", "tensor x pipeline parallel 2 x 1"),
        "CUDA graph": ("none", "not by default for Transformer Engine's layers"),
        "grad write": (False, "the fast spec is not used"),
        "LM loss": ("megatron's", "Transformer Engine's layers"),
    }),
    "PP 2 of 4 GPUs": ([], NO_TE, dict(world_size=4, pipeline_model_parallel_size=2), {
        "CUDA graph": ("none", "per layer: pipeline parallelism"),
        "LM loss": ("chunked", "logits never exist all at once"),
        "LM grad in forward": (False, "recomputed in backward: pipeline parallelism"),
    }),
    "PP 2, --fast-cuda-graphs layers": (["--fast-cuda-graphs", "layers"], NO_TE,
                                  dict(world_size=4, pipeline_model_parallel_size=2), {
        "CUDA graph": ("per layer", "--fast-cuda-graphs layers"),
        "compile": (True, "inside CUDA graphs"),
    }),
    "CPU": ([], NO_TE, dict(cpu=True), {
        "layers": ("fast", "not installed"),
        "CUDA graph": ("none", "full iteration: CPU mode; per layer: CPU mode"),
        "compile": (False, "CPU mode"),
        "bf16 grad buffer": (False, "CPU mode"),
    }),
    "CPU, TE installed": ([], TE, dict(cpu=True), {
        "layers": ("fast", "--cpu"),
    }),
    "TE layers, --fast-cuda-graphs iteration": (["--fast-cuda-graphs", "iteration"], TE, dict(
            given=["--transformer-impl"], transformer_impl="transformer_engine"), {
        "layers": ("transformer_engine", "as given"),
        "CUDA graph": ("full iteration", "--fast-cuda-graphs iteration"),
        "NaN check": ("gradient norm", "inside a CUDA graph"),
        "bf16 grad buffer": (False, "the fast spec is not used"),
    }),
    # megatron cannot replay a recomputed module's dropout from a graph of the whole step
    "1 GPU, selective recompute, attention dropout": (
        [], NO_TE, dict(recompute_granularity="selective", attention_dropout=0.1), {
            "CUDA graph": ("none", "full iteration: selective recompute of core attention "
                                   "with attention dropout"),
        }),
    # megatron's older flag, as the shipped configs spell it (resolved after the plan)
    "1 GPU, --recompute-activations, attention dropout": (
        [], NO_TE, dict(recompute_activations=True, attention_dropout=0.1), {
            "CUDA graph": ("none", "per layer: --recompute-granularity selective"),
        }),
    "1 GPU, selective recompute of the MLP, hidden dropout": (
        [], NO_TE, dict(recompute_granularity="selective", recompute_modules=["mlp"],
                        attention_dropout=0.1, hidden_dropout=0.1), {
            "CUDA graph": ("none", "selective recompute of the MLP with hidden dropout"),
        }),
    "1 GPU, selective recompute, no dropout": (
        [], NO_TE, dict(recompute_granularity="selective", attention_dropout=0.0,
                        hidden_dropout=0.0), {
            "CUDA graph": ("full iteration", "one GPU"),
        }),
    # --fp8-format: the fast spec's FP8 linears where they run, TE's FP8 layers elsewhere
    "1 GPU, FP8": ([], NO_TE, dict(fp8="hybrid", fp8_recipe="delayed"), {
        "layers": ("fast", "not installed"),
        "FP8": (Fp8Recipe(format="hybrid", scaling="delayed"), "not installed"),
        "CUDA graph": ("full iteration", "one GPU"),
    }),
    "1 GPU, FP8, TE installed": ([], TE, dict(fp8="e4m3", fp8_recipe="tensorwise"), {
        "layers": ("fast", "FP8 linears measured faster than TE's FP8 layers"),
        "FP8": (Fp8Recipe(format="e4m3", scaling="tensorwise"), "measured faster"),
    }),
    "TP 2, FP8, TE installed": ([], TE, dict(world_size=4, tensor_model_parallel_size=2,
                                             fp8="hybrid", fp8_recipe="delayed"), {
        "layers": ("transformer_engine", "FP8 under tensor or pipeline parallelism"),
        "FP8": ("hybrid, delayed scaling, Transformer Engine's layers", "FP8 under tensor"),
    }),
    "--no-fast-spec": (["--no-fast-spec"], NO_TE, {}, {
        "layers": ("local", "disabled by --no-fast-spec"),
        "fused layer": (False, "the fast spec is not used"),
        "CUDA graph": ("none", "the fast spec is not used"),
        "compile": (False, "no CUDA graph"),
    }),
    "--fast-cuda-graphs layers": (["--fast-cuda-graphs", "layers"], NO_TE, {}, {
        "CUDA graph": ("per layer", "--fast-cuda-graphs layers"),
        # read from the plan's per-layer graphs: args' cuda_graph_impl is not written yet
        "grad write": (False, "per-layer CUDA graphs"),
    }),
    "--cuda-graph-impl local": ([], NO_TE, dict(cuda_graph_impl="local"), {
        "CUDA graph": ("per layer", "--cuda-graph-impl local as given"),
    }),
    "--fast-cuda-graphs iteration on 2 GPUs": (
        ["--fast-cuda-graphs", "iteration"], NO_TE, dict(world_size=2), {
        "CUDA graph": ("full iteration", "--fast-cuda-graphs iteration"),
        "NCCL connect": ("0", "cannot connect a peer"),
    }),
    "--overlap-param-gather": ([], NO_TE, dict(overlap_param_gather=True, **DP8), {
        "fused layer": (False, "--overlap-param-gather"),
        "CUDA graph": ("none", "per layer: the fused layer is off"),
    }),
    "--fast-disable bf16-grad-buffer": (["--fast-disable", "bf16-grad-buffer"], NO_TE, {}, {
        "bf16 grad buffer": (False, "--fast-disable bf16-grad-buffer"),
        "grad write": (True, "nothing is accumulated"),
    }),
    "attention mask asked of the loader": ([], NO_TE,
                                           dict(create_attention_mask_in_dataloader=True), {
        "attention mask": (False, "causal"),
    }),
    "--attention-backend fused": ([], NO_TE, dict(attention_backend="fused"), {
        "attention": ("SDPA, cuDNN's fused attention only", "--attention-backend fused"),
    }),
    "--attention-backend flash, TP 2, TE installed": (
        [], TE, dict(world_size=2, tensor_model_parallel_size=2, attention_backend="flash"), {
            "layers": ("transformer_engine", "tensor x pipeline parallel 2 x 1"),
            "attention": ("TE's flash attention", "NVTE_*_ATTN switches"),
        }),
    "--attention-backend flash, --no-fast-spec": (
        ["--no-fast-spec"], NO_TE, dict(attention_backend="flash"), {
            "attention": ("megatron's DotProductAttention", "unfused"),
        }),
    "--no-check-for-nan-in-loss-and-grad, TP 2": (
        [], NO_TE, dict(world_size=2, tensor_model_parallel_size=2,
                        check_for_nan_in_loss_and_grad=False), {
            "NaN check": ("off", "--no-check-for-nan-in-loss-and-grad"),
        }),
}


@pytest.mark.parametrize("layout", list(TABLE))
def test_layout_gives_choices_and_reasons(layout):
    argv, installed, attrs, expected = TABLE[layout]
    plan = plan_of(argv, installed, **attrs)
    got = {name: shown(named(plan, name)) for name in expected}
    for name, (value, reason) in expected.items():
        assert got[name][0] == value and reason in got[name][1], (name, got[name])


@pytest.mark.parametrize("argv,attrs,match", [
    (["--fast-cuda-graphs", "iteration"], dict(world_size=2, pipeline_model_parallel_size=2),
     "--fast-cuda-graphs iteration with pipeline parallelism"),
    (["--fast-cuda-graphs", "iteration"], dict(world_size=2, overlap_param_gather=True),
     "--overlap-param-gather with the full-iteration"),
    (["--fast-cuda-graphs", "layers"], dict(recompute_granularity="full"),
     "--fast-cuda-graphs layers: "),
    (["--fast-cuda-graphs", "iteration"],
     dict(recompute_granularity="selective", attention_dropout=0.1),
     "--fast-cuda-graphs iteration with selective recompute of core attention"),
    ([], dict(cpu=True, attention_backend="fused"), "runs on NVIDIA GPUs only"),
    ([], dict(cpu=True, attention_backend="flash", attention_dropout=0.1),
     "flash attention kernel on the CPU has no dropout"),
    ([], dict(bf16=False, attention_backend="flash"), "runs in bf16 or fp16"),
    ([], dict(use_flash_attn=True, attention_backend="unfused"),
     "--use-flash-attn with --attention-backend unfused"),
    # asked for on the namespace (no option asks for it)
    (["--fast-cuda-graphs", "layers"], dict(fast_grad_write=True), "gradients written: per-layer"),
])
def test_switches_asked_for_where_they_cannot_run_are_refused_by_the_plan(argv, attrs, match):
    with pytest.raises(UserError, match=match):
        plan_of(argv, **attrs)


@pytest.mark.parametrize("layout", list(TABLE))
def test_planning_changes_neither_args_nor_the_environment(layout):
    argv, installed, attrs, _ = TABLE[layout]
    args = launch(argv, installed, **attrs)
    before, environ = copy.deepcopy(vars(args)), {"PATH": "/bin"}
    os_before = dict(os.environ)
    plan = plan_fast_path(args, installed, environ)
    assert vars(args) == before and environ == {"PATH": "/bin"}
    assert dict(os.environ) == os_before
    assert plan_fast_path(args, installed, environ) == plan  # the same question, the same plan


@pytest.mark.parametrize("layout", list(TABLE))
def test_the_writer_writes_exactly_what_the_launch_says(layout):
    argv, installed, attrs, _ = TABLE[layout]
    args = launch(argv, installed, **attrs)
    before, environ, lines = dict(vars(args)), {}, []
    plan = plan_fast_path(args, installed, environ)
    write(plan, args, environ, lines.append)
    changed = {k: v for k, v in vars(args).items() if k not in before or before[k] != v}
    assert set(changed) <= set(dict(plan.args))
    assert all(getattr(args, name) == value for name, value in plan.args)
    assert environ == dict(plan.environ) and lines == list(plan.log)


def test_the_plan_is_frozen_and_printed_one_line_per_choice():
    import dataclasses

    plan = plan_of()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.log = ()
    lines = plan.describe()
    assert lines[0] == "compat:" and lines[2] == "fast path:"
    assert len(lines) == len(plan.choices) + 2
    assert "  CUDA graph        full iteration — one GPU" in lines[lines.index(next(
        line for line in lines if "CUDA graph" in line))]


def test_the_users_nccl_setting_is_kept():
    plan = plan_of(["--fast-cuda-graphs", "iteration"], world_size=2, environ={"NCCL_RUNTIME_CONNECT": "1"})
    assert plan.environ == () and plan[NCCL_CHOICE] == "1"


def test_apply_fast_path_defaults_is_the_plan_applied():
    from megagpt.launch.fast_path import apply_fast_path_defaults

    args, lines = launch(world_size=8), []
    plan = plan_fast_path(copy.deepcopy(args), NO_TE, {})
    applied = apply_fast_path_defaults(args, lines.append, NO_TE)
    assert (applied.choices, applied.args, applied.environ) == (plan.choices, plan.args,
                                                                plan.environ)
    assert lines == list(plan.log) and args.cuda_graph_impl == "local"


def test_use_flash_attn_is_taken_as_attention_backend_flash():
    from megatron.core.transformer.enums import AttnBackend

    args = launch(use_flash_attn=True)
    plan = plan_fast_path(args, NO_TE, {})
    assert str(plan[ATTENTION]) == "SDPA, torch's flash attention kernel only"
    assert dict(plan.args)["attention_backend"] == AttnBackend.flash
    assert any("--use-flash-attn taken as --attention-backend flash" in line
               for line in plan.log)


@pytest.mark.parametrize("installed,attrs,match", [
    (NO_TE, {}, "NVTE_FUSED_ATTN=0 in the environment .*which this launch does not run"),
    (TE, dict(world_size=2, tensor_model_parallel_size=2),
     "NVTE_FUSED_ATTN=0 in the environment .*give --attention-backend flash instead"),
])
def test_tes_attention_switches_megatron_would_stop_on_are_refused(installed, attrs, match):
    # megatron's model constructor asserts that the switches agree with --attention-backend
    with pytest.raises(UserError, match=match):
        plan_of([], installed, environ={"NVTE_FUSED_ATTN": "0"}, **attrs)
    agreeing = {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}
    plan_of([], installed, environ=agreeing, attention_backend="flash", **attrs)


@pytest.mark.parametrize("backend", ["auto", "flash", "fused", "unfused", "local"])
def test_the_switches_are_the_ones_megatron_sets(monkeypatch, backend):
    """attention_backend.TE_SWITCHES against megatron's own LanguageModule code."""
    from types import SimpleNamespace

    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.enums import AttnBackend

    from megagpt.launch.attention_backend import TE_SWITCH_NAMES, TE_SWITCHES

    for name in TE_SWITCH_NAMES:
        monkeypatch.delenv(name, raising=False)
    config = SimpleNamespace(attention_backend=AttnBackend[backend],
                             flash_attention_version=None)
    LanguageModule._set_attention_backend(SimpleNamespace(config=config))
    assert tuple(os.environ.get(name) for name in TE_SWITCH_NAMES) == TE_SWITCHES[backend]


def test_fp8_on_the_fast_spec_leaves_megatrons_fp8_unset_and_reaches_the_layers():
    """megatron's FP8 path is Transformer Engine's: the launch writes megatron's fp8 off, and
    its FP8 decision is every fused layer's recipe (no other name carries the format)."""
    from megagpt.fast_spec.fp8 import Fp8Recipe
    from megagpt.gpt_model import fused_layer_options

    args = launch(fp8="hybrid", fp8_recipe="tensorwise", fp8_margin=1)
    plan = plan_fast_path(args, NO_TE, {})
    assert getattr(args, "fp8") == "hybrid"  # planning changes nothing
    write(plan, args, environ={})
    assert args.fp8 is None and "fast_fp8" not in vars(args)
    recipe = Fp8Recipe(format="hybrid", scaling="tensorwise", margin=1)
    assert plan[FP8] == recipe and fused_layer_options(plan).fp8 == recipe
    assert any("FP8 linears" in line for line in plan.log)
    assert "FP8               hybrid, tensorwise scaling, fast spec" in "\n".join(
        plan.describe())
    assert fused_layer_options(plan_fast_path(launch(), NO_TE, {})).fp8 is None


SHAPE_345M = dict(hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                  seq_length=1024, micro_batch_size=8)


@pytest.mark.parametrize("attrs, argv, linears, bf16", [
    # 345M: every GEMM at least 1024 wide (the narrowest measured to gain)
    (SHAPE_345M, [], (0, 1, 2, 3), ""),
    # at TP 4 each rank's QKV output is 768 wide, the projection's input 256: bf16
    (dict(SHAPE_345M, world_size=4, tensor_model_parallel_size=4), [], (2, 3),
     "qkv 8192x1024x768 (a dimension below 1024), proj 8192x256x1024 (a dimension below "
     "1024)"),
    # a width of 0 puts every linear in FP8
    (dict(SHAPE_345M, hidden_size=512, ffn_hidden_size=2048), ["--fast-fp8-min-width", "0"],
     (0, 1, 2, 3), ""),
])
def test_fp8_keeps_linears_too_narrow_to_gain_in_bf16(attrs, argv, linears, bf16):
    plan = plan_of(argv, fp8="hybrid", fp8_recipe="delayed", **attrs)
    recipe = plan[FP8]
    assert recipe.linears == linears
    (line,) = [x for x in plan.log if "FP8 linears" in x]
    assert (f"in bf16, too narrow to gain: {bf16}" in line) == bool(bf16), line


def test_fp8_where_every_linear_is_too_narrow_is_bf16_with_the_reason():
    plan = plan_of(fp8="hybrid", fp8_recipe="delayed", **dict(
        SHAPE_345M, hidden_size=512, ffn_hidden_size=2048))
    assert plan[FP8] is None
    assert plan.choice(FP8).reason == Reason(Why.SHAPE, "every linear too narrow to gain "
                                             "(--fast-fp8-min-width)")
    (line,) = [x for x in plan.log if "not taken" in x]
    assert "qkv 8192x512x1536 (a dimension below 1024)" in line
    assert "--fast-fp8-min-width 0 runs them in FP8" in line
    with pytest.raises(UserError, match="--fast-fp8-min-width -1: a width of 0 or more"):
        plan_of(["--fast-fp8-min-width", "-1"], fp8="hybrid", **SHAPE_345M)


def test_unit_first_scales_are_for_trainings_first_step_not_a_resume(tmp_path):
    """The amax history is not in the checkpoint: a resume's first forward scales by its own
    amaxes rather than by 1, which would cut the first step's gradients."""
    ckpt = tmp_path / "ckpt"
    shard = ckpt / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"saved")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    unit = ["--fast-fp8-first-scales", "unit"]
    fresh = plan_of(unit, fp8="hybrid", fp8_recipe="delayed", load=str(tmp_path / "none"),
                    **SHAPE_345M)
    assert fresh[FP8].first_scales == "unit"
    for flags in (unit, []):  # unit is the default
        resumed = plan_of(flags, fp8="hybrid", fp8_recipe="delayed", load=str(ckpt),
                          **SHAPE_345M)
        assert resumed[FP8].first_scales == "amax"
        (line,) = [x for x in resumed.log if "are for training's first step" in x]
        assert f"resuming {ckpt / 'iter_0000010'}, the first forward scales by its own " \
            "amaxes" in line


def test_delayed_fp8_under_a_graph_captured_at_the_first_iteration_is_refused():
    with pytest.raises(UserError, match="--cuda-graph-warmup-steps 0 with the fast spec's "
                       "delayed FP8 scaling: the CUDA graph would be captured at the first "
                       "iteration"):
        plan_of(fp8="hybrid", fp8_recipe="delayed", cuda_graph_warmup_steps=0, **SHAPE_345M)
    # current scaling holds no state across steps; and one warm-up step is enough
    plan_of(fp8="hybrid", fp8_recipe="tensorwise", cuda_graph_warmup_steps=0, **SHAPE_345M)
    assert plan_of(fp8="hybrid", fp8_recipe="delayed", cuda_graph_warmup_steps=1,
                   **SHAPE_345M)[FP8].delayed


def test_delayed_scaling_is_tes_unless_told_otherwise():
    """Delayed scaling starts from scales of 1 and scales gradients by the backward before,
    as TE's does (their losses matched TE's FP8 to 0.04 %: bench/notes/fp8.md)."""
    recipe = plan_of(fp8="hybrid", fp8_recipe="delayed", **SHAPE_345M)[FP8]
    assert (recipe.first_scales, recipe.grad_scaling) == ("unit", "delayed")
    assert "gradients by the backward before's; the first forward's scales 1" \
        in recipe.describe()
    own = plan_of(["--fast-fp8-first-scales", "amax", "--fast-fp8-grad-scaling", "current"],
                  fp8="hybrid", fp8_recipe="delayed", **SHAPE_345M)[FP8]
    assert (own.first_scales, own.grad_scaling) == ("amax", "current")
    assert "gradients by their own" in own.describe()
    # current scaling has no first step or gradient history to choose
    assert not plan_of(fp8="hybrid", fp8_recipe="tensorwise", **SHAPE_345M)[FP8].delayed_grads


def test_fp8_first_scales_and_grad_scaling_reach_the_recipe_under_delayed_scaling_only():
    plan = plan_of(["--fast-fp8-first-scales", "amax"], fp8="hybrid", fp8_recipe="delayed",
                   **SHAPE_345M)
    assert plan[FP8].first_scales == "amax"
    with pytest.raises(UserError, match="--fast-fp8-first-scales unit: .*--fp8-recipe "
                       "tensorwise scales every tensor by its own amax"):
        plan_of(["--fast-fp8-first-scales", "unit"], fp8="hybrid", fp8_recipe="tensorwise",
                **SHAPE_345M)
    plan = plan_of(["--fast-fp8-grad-scaling", "current"], fp8="hybrid",
                   fp8_recipe="delayed", **SHAPE_345M)
    assert plan[FP8].grad_scaling == "current"
    with pytest.raises(UserError, match="--fast-fp8-grad-scaling delayed: the gradients' "
                       "scaling is delayed scaling's"):
        plan_of(["--fast-fp8-grad-scaling", "delayed"], fp8="hybrid",
                fp8_recipe="tensorwise", **SHAPE_345M)


@pytest.mark.parametrize("attrs, needle", [
    (dict(spec=["local"]), "megatron's local modules have no FP8.*--spec local"),
    (dict(overlap_param_gather=True, use_distributed_optimizer=True),
     "cannot run here: .*--overlap-param-gather"),
])
def test_fp8_where_the_fused_layer_cannot_run_is_refused(attrs, needle):
    with pytest.raises(UserError, match=needle):
        plan_of(fp8="hybrid", **attrs)


# --fp8-format's weights: cast in each forward by default; with --fast-fp8-weight-writes
# written by the flat AdamW step where it owns them whole, else cast, the plan's FP8 line
# saying why (every case but the default's asks for the writes)
WRITTEN_OR_CAST = {
    "one GPU, delayed scaling": ([], {}, None),
    "the default": ([], {}, "the default; --fast-fp8-weight-writes has the optimizer write"),
    "current scaling": ([], dict(fp8_recipe="tensorwise"), "--fp8-recipe tensorwise: a "
                        "current scale is the weight's own amax"),
    "no flat step": (["--fast-disable", "flat-adam"], {}, "--fast-disable flat-adam"),
    # (the namespace's attributes are laid over the parsed flags: the same, given again)
    "no fast optimizer": (["--fast-disable", "optimizer"], dict(fast_optimizer=False),
                          "--fast-disable optimizer"),
    "fp16": ([], dict(bf16=False, fp16=True), "the flat AdamW step serves megatron's bf16 "
             "optimizer only"),
    "the distributed optimizer": ([], dict(world_size=8, global_batch_size=64,
                                           use_distributed_optimizer=True),
                                  "--use-distributed-optimizer (each rank steps a shard"),
    "TP 2": ([], dict(world_size=2, tensor_model_parallel_size=2), "tensor parallelism"),
    "two micro-batches": ([], dict(global_batch_size=16), "more than one micro-batch per step"),
    "DP 8, one micro-batch each": ([], dict(world_size=8, global_batch_size=64), None),
}


@pytest.mark.parametrize("case", list(WRITTEN_OR_CAST))
def test_fp8_weights_are_written_by_the_optimizer_where_its_flat_step_owns_them(case):
    from megagpt.launch.fp8 import weight_writes_unsupported_reason
    from megagpt.gpt_model import fused_layer_options

    argv, attrs, reason = WRITTEN_OR_CAST[case]
    if case != "the default":
        argv = ["--fast-fp8-weight-writes", *argv]
    attrs = dict(dict(fp8_recipe="delayed", fast_optimizer=True, **SHAPE_345M), **attrs)
    args = launch(argv, fp8="hybrid", **attrs)
    plan = plan_fast_path(args, NO_TE, {})
    recipe = plan[FP8]
    assert recipe.weights_written == (reason is None)
    assert fused_layer_options(plan).fp8 == recipe  # what every fused layer is given
    (line,) = [x for x in plan.log if "FP8 linears" in x]
    if reason is None:
        assert "their FP8 weights written by the flat AdamW step with the bf16 ones" in line
        assert "hybrid, delayed scaling, fast spec, weights written by the optimizer" \
            in "\n".join(plan.describe())
    else:
        assert f"their weights cast to FP8 in each forward ({reason}" in line, line
        assert reason in weight_writes_unsupported_reason(args)
