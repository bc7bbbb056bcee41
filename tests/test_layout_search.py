"""--search-layouts: the published layouts of Narayanan et al. 2021 against the model's ranking,
and the 530B launch that trained on 80 GB GPUs no longer refused."""

import contextlib
import dataclasses
import io

import pytest

from megagpt.launch import resolve
from megagpt.preflight import make_plan
from megagpt.preflight import estimate as est
from megagpt.preflight.cost import shape_of
from megagpt.preflight.launch_path import FAST
from megagpt.preflight.layout_search import (Layout, args_for, candidate_layouts, launch_layout,
                                              search)
from test_step_time import NARAYANAN

# Where the model ranks layouts with less tensor and more pipeline parallelism clearly faster
# than the published one, each holding the published layout's parameters per GPU (so memory
# rules none of them out): at TP 8 every layer pays five NVLink all-reduces per micro-batch
# (two forward, two recomputed, one exposed backward) and every TP rank repeats the norms',
# dropouts' and residuals' memory-bound work (no sequence parallelism). Its gradient all-reduce
# also moves 4 times the bytes across nodes: every GPU has its own NIC in both layouts, but a
# TP 8 node holds one replica of the model, all distinct, where a TP 2 × PP 4 node holds four
# DP replicas of one stage, which reduce over NVLink before a quarter of the bytes leaves the
# node. At TP 2 × PP 4 (18.4B) or TP 2 × PP 8 (39.1B) those shrink more than the interleaved
# pipeline's bubble and InfiniBand sends add. Unfused attention, the paper's, does not change
# that: its [b, heads/TP, s, s] scores are counted in memory, but the fastest layouts use
# micro-batch 1 or 2, where they are 1 GB at TP 2, and their time is the same for every
# layout of a row. bench/notes/cost-model.md has the breakdowns; the table grew
# TP with model size as a weak-scaling study, not as a search for the fastest layout of each
# model.
LOWER_TP_FASTER = {"18.4B", "39.1B"}


def narayanan_plan(heads, hidden, layers, tp, pp, gpus, batch):
    """The row as a launch through megatron's own layer modules (the paper's code path: its
    attention is ``DotProductAttention``, unfused, wherever Transformer Engine is installed)."""
    argv = ["--mock-data", "--vocab-size", "51200", "--num-layers", str(layers),
            "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "2048", "--max-position-embeddings", "2048",
            "--micro-batch-size", "1", "--global-batch-size", str(batch),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--fp16", "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1", "--lr", "1e-4", "--train-iters", "10",
            "--transformer-impl", "local", "--no-fast-spec", "--fast-disable",
            "optimizer,lm-loss",
            "--dry-run", "--dry-run-world-size", str(gpus), "--gpu-type", "A100-80GB"]
    with contextlib.redirect_stdout(io.StringIO()):
        return make_plan(resolve(argv))


@pytest.fixture(scope="module")
def narayanan_plans():
    return {row[0]: narayanan_plan(*row[1:8]) for row in NARAYANAN}


def _published_place(plan):
    """(rank of the published TP × PP among the fitting layouts, its best time / the best)."""
    ranked = search(plan.args, plan.runs, plan.gpu, recompute=("full",))  # as the runs were
    own = launch_layout(plan.args)
    place = next(i for i, r in enumerate(ranked, 1)
                 if (r.layout.tp, r.layout.pp) == (own.tp, own.pp))
    return place, ranked[place - 1].step.seconds / ranked[0].step.seconds - 1


@pytest.mark.parametrize("name", [
    pytest.param(row[0], marks=pytest.mark.xfail(
        strict=True, reason="a lower TP with more PP fits and the model ranks it faster"))
    if row[0] in LOWER_TP_FASTER else row[0] for row in NARAYANAN])
def test_published_layout_is_in_the_top_three_or_within_5_percent(name, narayanan_plans):
    place, slower = _published_place(narayanan_plans[name])
    assert place <= 3 or slower <= 0.05, (place, slower)


def test_the_7_5b_model_without_pp_at_tp_2_does_not_fit_its_optimizer_step(narayanan_plans):
    """3.7B parameters per GPU: 16 bytes each resident (fp16 weights and gradients, fp32 master
    weights and moments) and 8 more at the step (fp32 gradient copies, torch AdamW's sqrt of
    the second moment) are above 90 % of 80 GiB, so the search ranks it out."""
    plan = narayanan_plans["7.5B"]
    ranked = search(plan.args, plan.runs, plan.gpu, recompute=("full",))
    assert ranked and all((r.layout.tp, r.layout.pp) != (2, 1) for r in ranked)


def test_every_published_launch_fits_its_80_gb_gpus(narayanan_plans):
    for name, plan in narayanan_plans.items():
        assert plan.fits, (name, plan.memory)


def test_the_530b_full_recompute_launch_fits_with_room(narayanan_plans):
    memory = narayanan_plans["529.6B"].memory
    assert "full recompute" in memory.activation_formula
    assert memory.total / 2**30 < 60  # 90.1 GiB, refused, without full recompute's savings


def test_candidates_respect_megatron_divisibility(narayanan_plans):
    args = narayanan_plans["145.6B"].args
    for layout in candidate_layouts(args, 8):
        assert 96 % layout.tp == 0 and 80 % layout.pp == 0 and layout.tp <= 8
        assert layout.tp * layout.pp * layout.dp == 1536
        assert 2304 % (layout.micro_batch * layout.dp) == 0
        assert (80 // layout.pp) % layout.virtual_stages == 0


def test_unfused_attention_scores_cost_memory_and_the_same_time_in_every_layout(narayanan_plans):
    """The 2021 code had no flash attention: megatron's local ``DotProductAttention`` writes the
    [b, heads/TP, s, s] scores, and the layer being recomputed keeps 5 bytes per element of
    them (softmax output, dropout mask and output). Their time per GPU and step is
    B·heads·s²·layers / GPUs elements in every layout, so it ranks none above another."""
    plan = narayanan_plans["18.4B"]
    assert not shape_of(plan.args, plan.runs).flash_attention
    layout = Layout(tp=2, pp=4, dp=32, micro_batch=8, virtual_stages=1, recompute="none")
    unfused = est.layer_activation_bytes(args_for(plan.args, layout), "none", plan.runs)
    flash = est.layer_activation_bytes(args_for(plan.args, layout), "none",
                                       dataclasses.replace(plan.runs, path=FAST))
    assert unfused - flash == pytest.approx(5 * 8 * (48 // 2) * 2048**2)
    ranked = search(plan.args, plan.runs, plan.gpu, recompute=("full",))
    attention = {round(r.step.parts["attention"], 6) for r in ranked}
    assert len(attention) == 1
