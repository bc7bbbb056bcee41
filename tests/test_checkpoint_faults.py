"""Crashes during a save, bad checkpoints, resharding and divergence, on real checkpoints.

A module fixture trains the tiny CPU model and saves at iterations 4 and 8; the fast
tests damage copies of it the way a crash or a bad disk would and check which checkpoint
``checkpoint_guard`` chooses; the slow ones run the entry as real processes.
"""

import os
import re
import shutil
import signal
import time
from argparse import Namespace

import pytest
import yaml

from helpers import (TINY_MODEL, overwrite_weight, parse_losses, run_entry, start_entry,
                     wait_for_log)
from megagpt.resilience import checkpoint_guard as guard
from megagpt.resilience import checksums
from megagpt.resilience.checkpoint_guard import CheckpointError, incompleteness, plan_load

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A --save directory with complete checkpoints at iterations 4 and 8."""
    work = tmp_path_factory.mktemp("faults")
    ckpt = work / "ckpt"
    proc = run_entry(TINY_MODEL + NO_DROPOUT + ["--train-iters", "8", "--save", str(ckpt),
                                                "--save-interval", "4"], cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert guard.saved_iterations(str(ckpt)) == [4, 8]
    return ckpt


@pytest.fixture
def ckpt(saved, tmp_path):
    """A private copy of the saved directory, to damage."""
    return str(shutil.copytree(saved, tmp_path / "ckpt"))


def it_dir(root, i):
    return os.path.join(root, f"iter_{i:07d}")


def shard(root, i):
    return os.path.join(it_dir(root, i), "__0_0.distcp")


# ---------------------------------------------------------------------------
# Which checkpoint is loaded (real checkpoints, damaged; no training)
# ---------------------------------------------------------------------------

def test_complete_checkpoints_load_as_tracked(ckpt):
    assert incompleteness(it_dir(ckpt, 4)) is None
    assert incompleteness(it_dir(ckpt, 8)) is None
    assert plan_load(ckpt, ckpt).iteration == 8


@pytest.mark.parametrize("damage, reason", [
    (lambda c: os.remove(os.path.join(it_dir(c, 8), "metadata.json")), "metadata.json is missing"),
    (lambda c: os.remove(os.path.join(it_dir(c, 8), ".metadata")), ".metadata is missing"),
    (lambda c: os.truncate(shard(c, 8), os.path.getsize(shard(c, 8)) // 2), "is truncated"),
    (lambda c: os.remove(shard(c, 8)), "shard __0_0.distcp is missing"),
], ids=["killed-before-metadata.json", "killed-before-.metadata", "truncated-shard",
        "missing-shard"])
def test_incomplete_newest_falls_back_to_previous_complete(ckpt, damage, reason):
    damage(ckpt)
    assert reason in incompleteness(it_dir(ckpt, 8))
    plan = plan_load(ckpt, ckpt)
    assert plan.iteration == 4
    assert reason in plan.reason and "iter_0000008" in plan.reason
    assert plan.set_aside == (8,)


def test_empty_tracker_resumes_from_newest_complete(ckpt):
    open(os.path.join(ckpt, guard.TRACKER), "w").close()  # killed while writing it
    plan = plan_load(ckpt, ckpt)
    assert plan.iteration == 8 and "unreadable" in plan.reason


def test_missing_tracker_resumes_from_newest_complete(ckpt):
    os.remove(os.path.join(ckpt, guard.TRACKER))
    os.remove(os.path.join(it_dir(ckpt, 8), "metadata.json"))
    plan = plan_load(ckpt, ckpt)
    assert plan.iteration == 4 and f"no {guard.TRACKER}" in plan.reason


def test_untracked_newer_checkpoint_is_set_aside(ckpt):
    guard.write_tracker(ckpt, 4)  # killed after iter_8 was complete, before the tracker moved
    args = _args_like(it_dir(ckpt, 4), load=ckpt, save=ckpt, ckpt_step=None)
    lines = []
    assert guard.prepare_load(args, frozenset(), lines.append) == {}  # the tracker's is loaded
    assert guard.saved_iterations(ckpt) == [4]
    assert os.listdir(os.path.join(ckpt, guard.SET_ASIDE))[0].startswith("iter_0000008-")
    assert any("moved iter_0000008" in line for line in lines)


def test_fallback_points_megatron_at_the_complete_one(ckpt):
    os.remove(os.path.join(it_dir(ckpt, 8), "metadata.json"))
    args = _args_like(it_dir(ckpt, 4), load=ckpt, save=ckpt, ckpt_step=None)
    assert guard.prepare_load(args, frozenset(), lambda line: None) == {"ckpt_step": 4}
    assert guard.read_tracker(ckpt) == 4


def test_no_complete_checkpoint_names_each_problem(ckpt):
    os.remove(os.path.join(it_dir(ckpt, 8), "metadata.json"))
    os.remove(shard(ckpt, 4))
    with pytest.raises(CheckpointError) as err:
        plan_load(ckpt, None)
    message = str(err.value)
    assert ckpt in message and "iter_0000008: metadata.json is missing" in message
    assert "iter_0000004: shard __0_0.distcp is missing" in message


# A weight of the tiny model, stored as float32 in the first shard
WEIGHT = "decoder.layers.mlp.linear_fc1.weight"


def test_every_saved_file_has_its_checksum(saved):
    for i in (4, 8):
        folder = it_dir(str(saved), i)
        recorded = checksums.read_manifest(folder)
        assert sorted(recorded) == checksums.checkpoint_files(folder)
        assert {"__0_0.distcp", ".metadata", "metadata.json", "megagpt_config.yaml"} <= \
            set(recorded)
        assert checksums.verify(folder)[0] is None


def test_bytes_overwritten_in_place_are_named_where_completeness_sees_nothing(ckpt):
    shard_name = overwrite_weight(it_dir(ckpt, 8), WEIGHT)
    assert incompleteness(it_dir(ckpt, 8)) is None  # the length is unchanged
    mismatch, _ = checksums.verify(it_dir(ckpt, 8))
    assert (mismatch.name, str(mismatch)) == (shard_name, (
        f"{it_dir(ckpt, 8)}/{shard_name} does not match the checksum recorded when it was "
        "saved (its bytes changed since)"))
    snapshot = os.path.join(it_dir(ckpt, 4), "megagpt_config.yaml")
    with open(snapshot, "a") as f:
        f.write("# edited\n")
    assert "megagpt_config.yaml is " in str(checksums.verify(it_dir(ckpt, 4))[0])
    with open(os.path.join(it_dir(ckpt, 4), checksums.MANIFEST), "w") as f:
        f.write("{")
    assert "megagpt_checksums.json is unreadable (JSONDecodeError" in str(
        checksums.verify(it_dir(ckpt, 4))[0])


def test_each_rank_hashes_its_own_shards_and_rank_0_the_rest():
    names = [".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "metadata.json",
             "mp_rank_00/model_optim_rng.pt"]
    assert checksums.written_by(names, 0) == [".metadata", "__0_0.distcp", "__0_1.distcp",
                                              "metadata.json", "mp_rank_00/model_optim_rng.pt"]
    assert checksums.written_by(names, 1) == ["__1_0.distcp"]
    shares = [checksums.share_of(names, r, 4) for r in range(4)]
    assert sorted(sum(shares, [])) == sorted(names)  # each file checked once


def test_the_tools_take_the_newest_intact_checkpoint_or_name_the_damaged_file(ckpt, capsys):
    from megagpt.inference.checkpoint import CheckpointError as ToolCheckpointError
    from megagpt.inference.checkpoint import checkpoint_folder

    shard_name = overwrite_weight(it_dir(ckpt, 8), WEIGHT)
    assert checkpoint_folder(ckpt) == it_dir(ckpt, 4)
    assert f"iter_0000008: damaged: {it_dir(ckpt, 8)}/{shard_name} does not match" in \
        capsys.readouterr().err
    assert os.path.isdir(it_dir(ckpt, 8))  # a tool moves nothing
    with pytest.raises(ToolCheckpointError, match=rf"--load {re.escape(it_dir(ckpt, 8))} is "
                                                  rf"damaged: .*{shard_name} does not match"):
        checkpoint_folder(it_dir(ckpt, 8))


def test_a_damaged_configuration_snapshot_is_named_not_taken_for_a_missing_one(ckpt):
    from megagpt.inference.checkpoint import CheckpointError as ToolCheckpointError
    from megagpt.inference.checkpoint import read_saved_config
    from megagpt.resilience import config_snapshot

    snapshot = os.path.join(it_dir(ckpt, 8), "megagpt_config.yaml")
    args = _args_like(it_dir(ckpt, 8), load=ckpt, save=ckpt, ckpt_step=None)
    with open(snapshot, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\xff: [ {")
    with pytest.raises(config_snapshot.SnapshotError, match=rf"{re.escape(snapshot)} is "
                                                            r"unreadable"):
        config_snapshot.read(it_dir(ckpt, 8))
    with pytest.raises(ToolCheckpointError, match=rf"{re.escape(snapshot)} is unreadable"):
        read_saved_config(it_dir(ckpt, 8))
    lines = []  # with checksums, loading names the damage and takes iteration 4
    guard.prepare_load(args, frozenset(), lines.append)
    assert any(f"{snapshot} is unreadable" in line for line in lines)
    os.remove(os.path.join(it_dir(ckpt, 8), checksums.MANIFEST))
    with pytest.raises(CheckpointError, match=rf"--load {re.escape(it_dir(ckpt, 8))}: "
                                              rf"{re.escape(snapshot)} is unreadable"):
        guard.prepare_load(args, frozenset(), lines.append)


def test_load_path_without_checkpoint(tmp_path):
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    with pytest.raises(CheckpointError, match=f"--load {re.escape(empty)} has no checkpoint"):
        plan_load(empty, str(tmp_path / "elsewhere"))
    with pytest.raises(CheckpointError, match="does not exist"):
        plan_load(str(tmp_path / "missing"), None)
    # The same command for the first launch and every resume: --load is also --save.
    assert plan_load(empty, empty).iteration is None
    assert plan_load(str(tmp_path / "new"), str(tmp_path / "new")).iteration is None


def _args_like(ckpt_dir, **changes):
    entry = yaml.safe_load(open(os.path.join(ckpt_dir, "megagpt_config.yaml")))["entry"]
    values = {**entry["model"], **entry["tokenizer"], **entry["layout"]}
    values.update(changes)
    return Namespace(ckpt_format="torch_dist", **values)


def test_another_model_or_vocabulary_is_refused_another_layout_is_not(ckpt):
    ckpt_dir = it_dir(ckpt, 8)
    blocking, layout = guard.compare_with_run(ckpt_dir, _args_like(ckpt_dir))
    assert blocking == [] and layout == []
    blocking, _ = guard.compare_with_run(ckpt_dir, _args_like(ckpt_dir, hidden_size=128))
    assert blocking == ["model --hidden-size 64 there, 128 here"]
    blocking, _ = guard.compare_with_run(ckpt_dir, _args_like(ckpt_dir, vocab_size=500))
    assert blocking == ["tokenizer --vocab-size 512 there, 500 here"]
    blocking, _ = guard.compare_with_run(
        ckpt_dir, _args_like(ckpt_dir, tokenizer_type="HuggingFaceTokenizer",
                             tokenizer_model="/data/tok"))
    assert len(blocking) == 2 and "--tokenizer-type NullTokenizer there" in blocking[0]
    blocking, layout = guard.compare_with_run(
        ckpt_dir, _args_like(ckpt_dir, tensor_model_parallel_size=2, world_size=2))
    assert blocking == [] and layout == ["tensor 1->2"]


def test_vocabulary_padded_under_another_tensor_parallel_size_says_what_resumes_it(
        ckpt, tmp_path):
    """megatron pads GPT-2's 50257 tokens to a multiple of 128 x TP (50432 rows under TP=2,
    50304 under TP=1) and loads only the same divisor and shape. Resuming a TP=2 checkpoint
    under TP=1 is refused with the TP sizes it loads under, and the divisor that a run meant
    to change TP needs from its first launch."""
    saved = yaml.safe_load(open(os.path.join(it_dir(ckpt, 8), "megagpt_config.yaml")))
    assert saved["entry"]["model"]["make_vocab_size_divisible_by"] == 128  # recorded
    saved["entry"]["model"]["padded_vocab_size"] = 50432
    saved["entry"]["tokenizer"]["vocab_size"] = 50257
    saved["entry"]["layout"]["tensor_model_parallel_size"] = 2
    ckpt_dir = tmp_path / "iter_0000025"
    ckpt_dir.mkdir()
    (ckpt_dir / "megagpt_config.yaml").write_text(yaml.safe_dump(saved))
    args = _args_like(str(ckpt_dir), padded_vocab_size=50304, tensor_model_parallel_size=1,
                      pipeline_model_parallel_size=2)
    blocking, layout = guard.compare_with_run(str(ckpt_dir), args)
    assert blocking == [
        "model --padded-vocab-size 50432 there, 50304 here (megatron pads the vocabulary to "
        "a multiple of --make-vocab-size-divisible-by x TP and loads only the same padding: "
        "this checkpoint, divisor 128, loads under TP 2; a run meant to move between TP 2 "
        "and 1 needs --make-vocab-size-divisible-by 64 from its first launch)"]
    assert "tensor 2->1" in layout
    # another divisor is refused as megatron's loader would, but first and in one line
    args = _args_like(str(ckpt_dir), make_vocab_size_divisible_by=64,
                      tensor_model_parallel_size=2)
    blocking, _ = guard.compare_with_run(str(ckpt_dir), args)
    assert blocking == ["model --make-vocab-size-divisible-by 128 there, 64 here"]


def test_vocabulary_padding_arithmetic():
    from megagpt import vocab_padding as vp

    assert [vp.padded_vocab_size(50257, 128, t) for t in (1, 2, 4, 8)] == [
        50304, 50432, 50688, 51200]  # megatron's log for GPT-2
    assert vp.divisor_for(50257, (1, 2)) == 64
    assert vp.padded_vocab_size(50257, 64, 1) == vp.padded_vocab_size(50257, 64, 2) == 50304
    assert vp.divisor_for(512, (1, 2, 4)) == 128  # already a multiple
    assert vp.tensor_parallel_sizes_with(50257, 128, 50432) == [2]
    assert vp.tensor_parallel_sizes_with(50257, 64, 50304) == [1, 2]


def _optimizer_run(**kw):
    """The attributes of a run that the optimizer check reads."""
    base = dict(use_distributed_optimizer=False, optimizer="adam", no_load_optim=False,
                finetune=False, ckpt_format="torch_dist")
    base.update(kw)
    return Namespace(**base)


def test_another_optimizer_is_named_before_megatron_loads(ckpt):
    """The checkpoint's optimizer state (plain adam) against the run's: the distributed
    optimizer or another algorithm is refused, unless the run loads no optimizer state."""
    where = it_dir(ckpt, 8)
    assert guard.optimizer_state_mismatch(where, _optimizer_run()) is None
    line = guard.optimizer_state_mismatch(where, _optimizer_run(use_distributed_optimizer=True))
    assert line == (f"--load {where}: its optimizer state does not load into this run's "
                    "optimizer (saved without --use-distributed-optimizer, and this run is with "
                    "it): launch with the optimizer flags it was saved with, or pass "
                    "--no-load-optim to resume its weights with a fresh optimizer")
    assert "--optimizer adam there, sgd here" in guard.optimizer_state_mismatch(
        where, _optimizer_run(optimizer="sgd"))
    for loads_no_optimizer in (dict(no_load_optim=True), dict(finetune=True)):
        assert guard.optimizer_state_mismatch(where, _optimizer_run(
            use_distributed_optimizer=True, **loads_no_optimizer)) is None
    # the distributed optimizer's default format reloads only under the TP x PP it was saved with
    snapshot = os.path.join(where, "megagpt_config.yaml")
    data = yaml.safe_load(open(snapshot))
    data["entry"]["optimizer"].update(use_distributed_optimizer=True,
                                      dist_ckpt_optim_fully_reshardable=False)
    with open(snapshot, "w") as f:
        yaml.safe_dump(data, f)
    distributed = dict(use_distributed_optimizer=True)
    assert guard.optimizer_state_mismatch(where, _optimizer_run(**distributed)) is None
    line = guard.optimizer_state_mismatch(where, _optimizer_run(
        tensor_model_parallel_size=2, **distributed))
    assert "loads only under the TP x PP it was saved with (1 x 1 there, 2 x 1 here)" in line
    assert "--dist-ckpt-optim-fully-reshardable" in line
    data["entry"]["optimizer"]["dist_ckpt_optim_fully_reshardable"] = True
    with open(snapshot, "w") as f:
        yaml.safe_dump(data, f)
    assert guard.optimizer_state_mismatch(where, _optimizer_run(
        tensor_model_parallel_size=2, **distributed)) is None
    # a snapshot written before it recorded the optimizer: megatron's loader decides
    with open(snapshot, "w") as f:
        yaml.safe_dump(data, f)
    assert guard.optimizer_state_mismatch(
        where, _optimizer_run(use_distributed_optimizer=True)) is None


# ---------------------------------------------------------------------------
# The entry, end to end
# ---------------------------------------------------------------------------

def _one_line_error(proc):
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stdout[-3000:]
    return errors[0]


@pytest.mark.slow
def test_bad_checkpoints_stop_with_one_line(ckpt, tmp_path):
    base = TINY_MODEL + NO_DROPOUT + ["--train-iters", "10"]
    line = _one_line_error(run_entry(base + ["--hidden-size", "128", "--load", ckpt],
                                     cwd=tmp_path))
    assert f"--load {it_dir(ckpt, 8)} was saved for another model" in line
    assert "--hidden-size 64 there, 128 here" in line
    empty = tmp_path / "nothing"
    empty.mkdir()
    line = _one_line_error(run_entry(base + ["--load", str(empty)], cwd=tmp_path))
    assert f"--load {empty} has no checkpoint" in line
    # the plain optimizer's state into the distributed optimizer: refused, or weights only
    line = _one_line_error(run_entry(base + ["--load", ckpt, "--use-distributed-optimizer"],
                                     cwd=tmp_path))
    assert f"--load {it_dir(ckpt, 8)}: its optimizer state does not load" in line
    proc = run_entry(base + ["--load", ckpt, "--use-distributed-optimizer", "--no-load-optim"],
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert sorted(parse_losses(proc.stdout)) == [9, 10]


def _saved_by_bucket(ckpt, gradient_buffer):
    """The snapshot of iteration 8 rewritten as a distributed optimizer's in megatron's default
    format whose gradient buffers were ``gradient_buffer``; its folder."""
    where = it_dir(ckpt, 8)
    snapshot = os.path.join(where, "megagpt_config.yaml")
    data = yaml.safe_load(open(snapshot))
    data["entry"]["optimizer"].update(use_distributed_optimizer=True,
                                      dist_ckpt_optim_fully_reshardable=False,
                                      gradient_buffer=gradient_buffer)
    with open(snapshot, "w") as f:
        yaml.safe_dump(data, f)
    return where


def test_the_snapshot_names_the_gradient_buffers_and_the_cpu_run_keeps_float32(ckpt):
    """The tiny CPU run trains in float32: its snapshot says so, as megatron's buffers are
    named; a bf16 run's buffers are bf16 weights with float32 gradients unless the gradients
    are reduced in bf16 (the fast path's bf16 buffer)."""
    from megagpt.resilience import config_snapshot

    import torch

    saved = config_snapshot.read(it_dir(ckpt, 8))["optimizer"]
    assert saved["gradient_buffer"] == "float32/float32"
    bf16 = Namespace(params_dtype=torch.bfloat16, accumulate_allreduce_grads_in_fp32=True)
    assert config_snapshot.gradient_buffer_dtypes(bf16) == "bfloat16/float32"
    bf16.accumulate_allreduce_grads_in_fp32 = False
    assert config_snapshot.gradient_buffer_dtypes(bf16) == "bfloat16/bfloat16"
    assert config_snapshot.gradient_buffer_dtypes(Namespace()) is None


def test_the_distributed_optimizers_buckets_of_other_gradients_are_named_before_loading(ckpt):
    """megatron's default format names the distributed optimizer's buckets by their
    parameter and gradient dtypes (on one H100 a KeyError or a bare AssertionError after the
    model was built): other buckets are one line before it, with the ways out; the same
    buckets, a format kept by parameter, or no optimizer state loaded pass."""
    import torch

    where = _saved_by_bucket(ckpt, "bfloat16/bfloat16")
    run = dict(use_distributed_optimizer=True, params_dtype=torch.bfloat16,
               accumulate_allreduce_grads_in_fp32=True)
    line = guard.optimizer_state_mismatch(where, _optimizer_run(**run))
    assert line == (
        f"--load {where}: the distributed optimizer saved its state by gradient bucket "
        "(megatron's default format), its buckets bfloat16/bfloat16 (parameters/gradients) "
        "there and bfloat16/float32 here (--grad-reduce-in-bf16 keeps bf16 gradients; TE's "
        "and megatron's layers, several GPUs and the fast path saving this format float32 "
        "ones): resume it with the layers and gradients that "
        "saved it, or pass --no-load-optim to resume its weights with a fresh optimizer (a run "
        "that saves with --dist-ckpt-optim-fully-reshardable keeps the state by parameter, "
        "which loads under other layers too)")
    same = dict(run, accumulate_allreduce_grads_in_fp32=False)
    assert guard.optimizer_state_mismatch(where, _optimizer_run(**same)) is None
    assert guard.optimizer_state_mismatch(where, _optimizer_run(no_load_optim=True, **run)) is None
    data = yaml.safe_load(open(os.path.join(where, "megagpt_config.yaml")))
    data["entry"]["optimizer"]["dist_ckpt_optim_fully_reshardable"] = True
    with open(os.path.join(where, "megagpt_config.yaml"), "w") as f:
        yaml.safe_dump(data, f)
    assert guard.optimizer_state_mismatch(where, _optimizer_run(**run)) is None


def test_the_distributed_optimizers_buckets_keep_float32_gradients_on_the_fast_path(ckpt):
    """The fast path's bf16 gradient buffer (one GPU, one micro-batch) is left off where the
    run resumes a distributed optimizer saved by bucket with float32 gradients (TE's layers,
    several GPUs, megatron's default): its buckets are then found, and the numbers are the
    same; bf16 buckets, the plain optimizer or --no-load-optim leave the choice as it was.
    A run that saves the distributed optimizer by bucket keeps float32 gradients, so that
    its checkpoint resumes on several GPUs and under TE's layers; saved by parameter it need
    not."""
    from megatron_parts import fast_path_namespace

    from megagpt.launch.fast_path_reasons import bf16_grad_buffer_unsupported_reason
    from megagpt.launch.layers import layer_path

    def reason(**attrs):
        run = dict(load=ckpt, save=None, ckpt_step=None, ckpt_format="torch_dist",
                   use_distributed_optimizer=True)
        args = fast_path_namespace([], **{**run, **attrs})
        return bf16_grad_buffer_unsupported_reason(args, layer_path(args)[0])

    assert reason() is None  # the CPU run's own snapshot: the plain optimizer
    where = _saved_by_bucket(ckpt, "bfloat16/float32")
    assert guard.bucketed_gradient_buffer(Namespace(
        load=ckpt, save=None, ckpt_step=None, use_distributed_optimizer=True)) == (
        where, "bfloat16/float32")
    assert reason() == (f"resuming {where}, whose distributed optimizer keeps its state in "
                        "buckets of float32 gradients (megatron's default format names the "
                        "buckets by dtype)")
    assert reason(no_load_optim=True) is None
    assert reason(use_distributed_optimizer=False) is None
    assert reason(ckpt_step=4) is None  # iteration 4's snapshot is the plain optimizer's
    _saved_by_bucket(ckpt, "bfloat16/bfloat16")
    assert reason() is None
    assert reason(save=ckpt) is None  # bf16 buckets resumed as they were saved

    saving = "the distributed optimizer saves by gradient bucket"
    assert saving in reason(load=None, save=ckpt)
    assert reason(load=None, save=ckpt, dist_ckpt_optim_fully_reshardable=True) is None
    assert reason(load=None, save=ckpt, use_distributed_optimizer=False) is None
    assert reason(load=None, save=None) is None


def test_a_damaged_checkpoint_gives_way_to_the_previous_intact_one_unless_asked_for(ckpt):
    """What loading does (checkpoint_integrity.choose_intact, one process): in the run's own
    --save the damaged newest checkpoint is moved aside and the tracker and --ckpt-step point
    at the previous one; elsewhere nothing moves; asked for by --ckpt-step, or with nothing
    earlier, it is one error naming the file."""
    from megagpt.launch.writer import load_earlier
    from megagpt.resilience.checkpoint_integrity import choose_intact

    shard_name = overwrite_weight(it_dir(ckpt, 8), WEIGHT)
    mismatch = (f"{it_dir(ckpt, 8)}/{shard_name} does not match the checksum recorded when it "
                "was saved (its bytes changed since)")
    elsewhere = Namespace(ckpt_format="torch_dist", save=None, ckpt_step=None, entry_argv=[])
    lines = []
    assert choose_intact(elsewhere, ckpt, lines.append, load_earlier) == it_dir(ckpt, 4)
    assert elsewhere.ckpt_step == 4 and guard.saved_iterations(ckpt) == [4, 8]
    assert f"{mismatch}; left where it is (not this run's --save)" in lines[0]
    asked = Namespace(ckpt_format="torch_dist", save=ckpt, ckpt_step=8,
                      entry_argv=["--ckpt-step", "8"])
    with pytest.raises(CheckpointError) as caught:
        choose_intact(asked, ckpt, lines.append, load_earlier, ckpt_step_given=True)
    assert str(caught.value) == (f"--load {it_dir(ckpt, 8)} is damaged: {mismatch}; "
                                 "--ckpt-step asked for it")
    own = Namespace(ckpt_format="torch_dist", save=ckpt, ckpt_step=None, entry_argv=[])
    assert choose_intact(own, ckpt, lines.append, load_earlier) == it_dir(ckpt, 4)
    assert guard.saved_iterations(ckpt) == [4] and guard.read_tracker(ckpt) == 4
    assert own.ckpt_step == 4 and "moved to" in lines[-2]
    overwrite_weight(it_dir(ckpt, 4), WEIGHT)
    with pytest.raises(CheckpointError, match="no earlier complete checkpoint is there"):
        choose_intact(own, ckpt, lines.append, load_earlier)


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_resumes(ckpt, tmp_path):
    """A shard of iteration 8 overwritten in place: the same command resumes from 4, names
    the file and moves iteration 8 aside."""
    shard_name = overwrite_weight(it_dir(ckpt, 8), WEIGHT)
    base = TINY_MODEL + NO_DROPOUT + ["--train-iters", "8", "--save", ckpt, "--load", ckpt,
                                      "--save-interval", "4"]
    resumed = run_entry(base, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert (f"resume: {it_dir(ckpt, 8)} is damaged: {it_dir(ckpt, 8)}/{shard_name} does not "
            "match") in resumed.stdout
    assert f"checksums: {it_dir(ckpt, 4)} matches them" in resumed.stdout
    assert sorted(parse_losses(resumed.stdout)) == [5, 6, 7, 8]
    assert os.listdir(os.path.join(ckpt, guard.SET_ASIDE))[0].startswith("iter_0000008-")
    assert checksums.verify(it_dir(ckpt, 8))[0] is None  # saved again, whole


@pytest.mark.slow
def test_weights_that_are_not_finite_are_the_checkpoints_fault_before_any_step(ckpt, tmp_path):
    """Without checksums to catch it (an upstream checkpoint), a NaN in the weights is named
    at load, as the checkpoint's, not 'divergence at iteration N' after the first step."""
    os.remove(os.path.join(it_dir(ckpt, 8), checksums.MANIFEST))
    overwrite_weight(it_dir(ckpt, 8), WEIGHT)
    proc = run_entry(TINY_MODEL + NO_DROPOUT + ["--train-iters", "10", "--load", ckpt,
                                                "--override-opt_param-scheduler"], cwd=tmp_path)
    line = _one_line_error(proc)
    assert line == (f"error: --load {it_dir(ckpt, 8)} holds weights that are not finite "
                    f"({WEIGHT.replace('layers.', 'layers.0.')} holds 1,000 NaN): the "
                    "checkpoint is damaged, or was saved by a run that had diverged; relaunch "
                    "with --ckpt-step 4 to resume from the newest earlier one")
    assert "has none (megagpt_checksums.json" in proc.stdout
    assert parse_losses(proc.stdout) == {}


@pytest.mark.slow
def test_mismatch_found_by_megatrons_loader_is_one_line_too(ckpt, tmp_path):
    """Without our snapshot (a checkpoint from upstream's entry) megatron finds the shape
    mismatch itself, deep in torch.distributed; the entry still says it in one line."""
    for i in (4, 8):
        for name in ("megagpt_config.yaml", checksums.MANIFEST):
            os.remove(os.path.join(it_dir(ckpt, i), name))
    proc = run_entry(TINY_MODEL + NO_DROPOUT + ["--train-iters", "10", "--hidden-size", "128",
                                                "--load", ckpt], cwd=tmp_path)
    line = _one_line_error(proc)
    assert f"cannot load checkpoint {it_dir(ckpt, 8)}" in line
    assert "shape" in line.lower()


def _kill_during_second_save(work, extra=()):
    """Train with saves every 2 iterations; SIGKILL the run as soon as the save of
    iteration 4 has created its directory. The command, and whether the kill was in time."""
    ckpt = work / "ckpt"
    command = TINY_MODEL + NO_DROPOUT + ["--train-iters", "100", "--save", str(ckpt),
                                         "--load", str(ckpt), "--save-interval", "2", *extra]
    log = work / "killed.log"
    proc = start_entry(command, work, log)
    try:
        wait_for_log(log, r"successfully saved checkpoint from iteration\s+2 ", proc)
        deadline = time.monotonic() + 120
        while not os.path.isdir(it_dir(ckpt, 4)) and time.monotonic() < deadline:
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return command, incompleteness(it_dir(ckpt, 4)) is not None


@pytest.mark.slow
@pytest.mark.parametrize("saving", [[], ["--async-save"]], ids=["sync", "async"])
def test_kill_during_save_resumes_from_previous_complete(tmp_path, saving):
    """With --async-save the writer process writes the shards and the trainer finalizes
    later (metadata.json, then the tracker): a kill in between is the same partial save."""
    for attempt in range(3):  # the save takes a fraction of a second: the kill may be late
        work = tmp_path / f"attempt{attempt}"
        work.mkdir()
        command, in_time = _kill_during_second_save(work, saving)
        if in_time:
            break
    assert in_time, "the kill never landed during the save"
    ckpt = str(work / "ckpt")
    assert guard.read_tracker(ckpt) == 2  # megatron moves the tracker only after the data

    resumed = run_entry(command + ["--exit-interval", "3"], cwd=work)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"loading {it_dir(ckpt, 2)} (iteration 2)" in resumed.stdout
    assert "moved iter_0000004" in resumed.stdout  # the partial one, out of the way
    assert sorted(parse_losses(resumed.stdout)) == [3]
    assert guard.read_tracker(ckpt) == 3 and incompleteness(it_dir(ckpt, 3)) is None


@pytest.mark.slow
def test_divergence_stops_at_its_iteration_and_keeps_the_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    # An absurd learning rate: the weights blow up after the first step, the loss is NaN.
    proc = run_entry(TINY_MODEL + NO_DROPOUT + [
        "--train-iters", "10", "--lr", "1e30", "--min-lr", "1e30", "--lr-warmup-iters", "0",
        "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1"], cwd=tmp_path)
    line = _one_line_error(proc)
    assert line.startswith("error: divergence at iteration 2: nan")
    assert "NaN in local forward loss" in line
    assert f"{it_dir(ckpt, 1)}, is untouched" in line
    assert "--iterations-to-skip 2" in line
    assert guard.saved_iterations(str(ckpt)) == [1] and guard.read_tracker(str(ckpt)) == 1
    assert incompleteness(it_dir(ckpt, 1)) is None


@pytest.mark.slow
def test_checkpoint_saved_under_tp2_loads_under_pp2_and_tp1(tmp_path):
    base = TINY_MODEL + NO_DROPOUT + ["--train-iters", "6"]
    ckpt = str(tmp_path / "ckpt")
    reference = parse_losses(run_entry(base + ["--exit-interval", "4"], cwd=tmp_path).stdout)
    saved = run_entry(base + ["--tensor-model-parallel-size", "2", "--save", ckpt,
                              "--save-interval", "3", "--exit-interval", "3"],
                      cwd=tmp_path, nproc=2)
    assert saved.returncode == 0, saved.stdout[-3000:]
    for layout, nproc, change in ((["--pipeline-model-parallel-size", "2"], 2,
                                   "tensor 2->1, pipeline 1->2"), ([], 1, "tensor 2->1")):
        resumed = run_entry(base + layout + ["--load", ckpt, "--exit-interval", "4"],
                            cwd=tmp_path, nproc=nproc)
        assert resumed.returncode == 0, resumed.stdout[-3000:]
        assert f"parallel layout changed ({change})" in resumed.stdout
        losses = parse_losses(resumed.stdout)
        assert sorted(losses) == [4]
        # Another layout sums in another order: equal to float32 rounding, not bit for bit.
        assert losses[4] == pytest.approx(reference[4], rel=1e-5)


@pytest.mark.slow
def test_gpt2_sized_vocabulary_moves_between_tp_sizes_when_padded_alike(tmp_path):
    """GPT-2's vocabulary pads to 50432 rows under TP=2 and 50304 under TP=1 with megatron's
    default divisor: that checkpoint is refused under TP=1 in one line that names the
    divisor to launch with; saved with --make-vocab-size-divisible-by 64 it resumes."""
    base = [a if a != "512" else "50256" for a in TINY_MODEL] + NO_DROPOUT + [
        "--train-iters", "6"]  # the NullTokenizer adds one token: 50257, as GPT-2
    for divisor, ckpt in (([], tmp_path / "default"), (["--make-vocab-size-divisible-by",
                                                        "64"], tmp_path / "aligned")):
        saved = run_entry(base + divisor + ["--tensor-model-parallel-size", "2", "--save",
                                            str(ckpt), "--save-interval", "3",
                                            "--exit-interval", "3"], cwd=tmp_path, nproc=2)
        assert saved.returncode == 0, saved.stdout[-3000:]
    line = _one_line_error(run_entry(base + ["--load", str(tmp_path / "default"),
                                             "--exit-interval", "4"], cwd=tmp_path))
    assert "--padded-vocab-size 50432 there, 50304 here" in line
    assert "--make-vocab-size-divisible-by 64 from its first launch" in line
    resumed = run_entry(base + ["--make-vocab-size-divisible-by", "64", "--load",
                                str(tmp_path / "aligned"), "--exit-interval", "4"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "parallel layout changed (tensor 2->1)" in resumed.stdout
    assert sorted(parse_losses(resumed.stdout)) == [4]


def test_divergence_default_and_message():
    from megagpt.resilience import divergence

    from megagpt.launch import resilience
    from megagpt.launch.planner import Planner

    def rerun_mode(check_for_nan, given):
        p = Planner(Namespace(check_for_nan_in_loss_and_grad=check_for_nan,
                              rerun_mode="validate_results"), frozenset(given), None)
        resilience.choose_rerun_mode(p)
        return p.v.rerun_mode

    assert rerun_mode(True, ["--cpu"]) == "disabled"
    assert rerun_mode(True, ["--rerun-mode"]) == "validate_results"  # asked for: kept
    # in-step checks off (the fast path's CUDA graph): nothing to validate, and a state
    # machine not disabled would all-reduce a flag before every step
    assert rerun_mode(False, ["--bf16"]) == "disabled"

    # megatron's text (rerun_state_machine.validate_result, reruns disabled)
    fault = RuntimeError("Rank 0, node vm, device 0, iteration 8: Unexpected result inf "
                         "(message='found Inf in local forward loss calculation')")
    error = divergence.divergence_error(fault, Namespace(curr_iteration=6), "Hint.")
    assert str(error).startswith("divergence at iteration 7: inf "
                                 "(found Inf in local forward loss calculation)")
    # found while evaluating: the weights of the iteration evaluated, no batch to skip; a
    # launch that trained nothing (its run had finished) evaluates the loaded checkpoint's
    fault = RuntimeError("Rank 0, node vm, device 0, iteration 1: Unexpected result nan "
                         "(message='found NaN in local forward loss calculation"
                         f"{divergence.EVALUATION_FAULT}')")
    for done, loaded, at in ((0, 40, 40), (49, 40, 50), (99, 0, 100)):
        error = str(divergence.divergence_error(
            fault, Namespace(curr_iteration=done, iteration=loaded), "Hint."))
        assert error.startswith(f"the validation loss is nan at iteration {at} (found NaN in "
                                "local forward loss calculation during evaluation)"), error
        assert "--iterations-to-skip" not in error
    assert divergence.divergence_error(RuntimeError("CUDA out of memory"),
                                       Namespace(curr_iteration=6), "") is None


def test_grad_norm_guard_stops_a_run_whose_in_step_checks_are_off():
    """The fast path's CUDA graph turns megatron's in-step NaN checks off; the guard checks
    the gradient norm train_step returns (megatron's 8-tuple: grad norm is 6th)."""
    from megagpt.resilience import divergence

    def train_step(*args, iteration=None, **kwargs):
        return ({}, False, False, False, 0, grad_norms[iteration], 0, None)

    grad_norms = {0: 1.5, 1: float("nan"), 2: float("inf")}
    guarded = divergence.grad_norm_guard(train_step, lambda: "The newest checkpoint, X, is untouched.")
    assert guarded(iteration=0)[5] == 1.5
    for it in (1, 2):
        with pytest.raises(divergence.DivergenceError,
                           match=rf"divergence at iteration {it + 1}: gradient norm .*X, is "
                                 rf"untouched.*--iterations-to-skip {it + 1}"):
            guarded(iteration=it)



@pytest.mark.slow
def test_a_distributed_optimizer_checkpoint_resumes_without_te_or_apex(tmp_path):
    """megatron's distributed optimizer on torch's optimizer could not load its own
    checkpoints (megagpt.compat's workarounds): saved at iteration 2 and resumed, the run
    continues bit for bit: iteration 3's loss (the saved weights) and those after it (the
    optimizer's moments and step; a step shared by every parameter ran Adam's bias
    correction ahead) are the uninterrupted run's."""
    base = TINY_MODEL + NO_DROPOUT + ["--train-iters", "5", "--use-distributed-optimizer"]
    uninterrupted = run_entry(base, cwd=tmp_path)
    assert uninterrupted.returncode == 0, uninterrupted.stdout[-3000:]
    ckpt = str(tmp_path / "ckpt")
    saved = run_entry(base + ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2"],
                      cwd=tmp_path)
    assert saved.returncode == 0, saved.stdout[-3000:]
    resumed = run_entry(base + ["--load", ckpt, "--save", ckpt, "--save-interval", "10"],
                        cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "the distributed optimizer's state loads through workarounds" in resumed.stdout
    before, after = parse_losses(uninterrupted.stdout), parse_losses(resumed.stdout)
    assert sorted(after) == [3, 4, 5]
    assert after == {i: before[i] for i in (3, 4, 5)}


def test_resume_under_te_layers_of_a_checkpoint_saved_without_them(ckpt):
    """A checkpoint of the fast spec holds no TE attention state, which TE's attention asks
    for: resumed under TE's layers, megatron is told to drop what the checkpoint lacks
    (--dist-ckpt-strictness log_unexpected), unless the launch chose a strictness itself or
    builds no TE layers."""
    ckpt_dir = it_dir(ckpt, 8)
    assert guard.saved_without_te_attention(ckpt_dir)
    default = dict(dist_ckpt_strictness="assume_ok_unexpected")
    args, lines = _args_like(ckpt_dir, transformer_impl="transformer_engine", **default), []
    assert guard.load_into_te_layers(ckpt_dir, args, frozenset(), lines.append) == {
        "dist_ckpt_strictness": "log_unexpected"}
    assert len(lines) == 1 and "saved without Transformer Engine's layers" in lines[0]
    for impl, given in (("local", frozenset()),
                        ("transformer_engine", frozenset({"--dist-ckpt-strictness"}))):
        args = _args_like(ckpt_dir, transformer_impl=impl, **default)
        assert guard.load_into_te_layers(ckpt_dir, args, given, lines.append) == {}
        assert len(lines) == 1


def _transformer_engine_source(root, refuses):
    """A transformer_engine package folder as far as the guard reads it: the file where TE
    2.20+ names the variable it unpickles its FP8 state under (TE itself needs a GPU build)."""
    package = root / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "_extra_state.py").write_text(
        'UNSAFE_PICKLE_EXTRA_STATE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"\n' if refuses
        else "")
    return root


@pytest.mark.parametrize("refuses", [True, False], ids=["te-2.20", "older-te"])
def test_te_layers_pickled_fp8_state_is_named_before_the_model_is_built(
        ckpt, tmp_path, monkeypatch, refuses):
    """TE's layers save delayed-scaling FP8's state as a pickle and TE (2.20 on) refuses to
    unpickle it unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1: on the GPU every resume of a TE
    FP8 run stopped in megatron's loader, its line cut before the variable's name. The
    snapshot says what the checkpoint holds; the guard says it in one line before loading."""
    import sys

    from megagpt.resilience.config_snapshot import te_pickles_fp8_state

    te = dict(transformer_impl="transformer_engine", fp8="hybrid")
    assert te_pickles_fp8_state(Namespace(**te, fp8_recipe="delayed"))
    assert not te_pickles_fp8_state(Namespace(**te, fp8_recipe="tensorwise"))
    assert not te_pickles_fp8_state(Namespace(transformer_impl="local", fp8="hybrid",
                                              fp8_recipe="delayed"))  # the fast spec's FP8
    where = it_dir(ckpt, 8)
    snapshot = os.path.join(where, "megagpt_config.yaml")
    data = yaml.safe_load(open(snapshot))
    assert data["entry"]["te_pickled_fp8_state"] is False  # the real tiny run: bf16, no TE
    data["entry"]["te_pickled_fp8_state"] = True  # as a TE FP8 run writes it
    with open(snapshot, "w") as f:
        yaml.safe_dump(data, f)
    monkeypatch.syspath_prepend(str(_transformer_engine_source(tmp_path / "te", refuses)))
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delenv(guard.TE_UNSAFE_PICKLE_ENV, raising=False)
    run = _optimizer_run(load=ckpt, save=ckpt, ckpt_step=None, transformer_impl="local",
                         dist_ckpt_strictness="assume_ok_unexpected",
                         **{k: v for k, v in data["entry"]["model"].items()},
                         **data["entry"]["tokenizer"], **data["entry"]["layout"])
    assert guard.prepare_load(run, frozenset(), lambda line: None) == {}  # fast spec, bf16
    run.transformer_impl = "transformer_engine"
    if not refuses:  # a TE that unpickles it without asking
        assert guard.te_pickled_state_refusal(where, run) is None
        return
    with pytest.raises(CheckpointError) as refused:
        guard.prepare_load(run, frozenset(), lambda line: None)
    line = str(refused.value)
    assert line.startswith(f"--load {where} holds Transformer Engine's delayed-scaling FP8 "
                           "state") and "\n" not in line
    assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1" in line
    assert "drop --transformer-impl transformer_engine" in line
    monkeypatch.setenv(guard.TE_UNSAFE_PICKLE_ENV, "1")
    assert guard.te_pickled_state_refusal(where, run) is None


def test_te_refusing_its_pickled_state_inside_megatrons_loader_is_one_whole_line(ckpt):
    """A checkpoint without the snapshot's word (saved elsewhere) meets TE's refusal inside
    megatron's loader: the line names the variable, which TE's own text has last."""
    te_text = ("Refusing to load pickled Transformer Engine extra state for "
               "TERowParallelLinear. Delayed-scaling FP8 metadata can be stored as a Python "
               "pickle, and loading it can execute arbitrary code. Only enable unsafe loading "
               "if this checkpoint is from a trusted source. To load it anyway, set "
               "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1.")

    def megatrons_load(*a, **kw):
        raise RuntimeError(te_text)

    run = Namespace(load=ckpt, ckpt_step=None)
    with pytest.raises(CheckpointError) as refused:
        guard.one_line_load_errors(megatrons_load, run)()
    line = str(refused.value)
    assert line.startswith(f"cannot load checkpoint: {it_dir(ckpt, 8)} holds Transformer "
                           "Engine's delayed-scaling FP8 state")
    assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 in the environment" in line


def test_a_distributed_optimizer_saved_under_other_layers_is_named_with_what_to_do():
    """The texts megatron's loader gave on one H100 (2026-12-06) for a checkpoint of TE's layers
    with the distributed optimizer resumed under the fast spec, and the other way: the line
    says why and the ways out; another KeyError or AssertionError gets no such hint."""
    from megagpt.resilience.checkpoint_guard import _hint

    seen = KeyError("optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, "
                    "torch.bfloat16).bucket_idx_0.param from model not in state dict: "
                    "['common_state/shard_0_1', 'decoder.final_layernorm.bias']")
    hint = _hint(seen)
    assert "saved its state by gradient bucket" in hint
    assert "add --no-load-optim to load the weights alone" in hint
    assert "--dist-ckpt-optim-fully-reshardable" in hint
    assert _hint(KeyError("decoder.layers.0.mlp.linear_fc1.weight")) == ""
    # the fast spec's checkpoint (bf16 gradient buffer) resumed under TE's layers (float32
    # gradients), as megatron said it on one H100 (2026-12-06): as many elements, other dtype
    seen = AssertionError("Number of unpadded elements in each bucket need to be the same in "
                          "current run ([{(torch.bfloat16, torch.float32): [136960]}]) and "
                          "checkpoint ([{(torch.bfloat16, torch.bfloat16): [136960]}])")
    assert _hint(seen) == hint
    assert _hint(AssertionError("loss is NaN")) == ""
