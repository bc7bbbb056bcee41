"""A checkpoint of megatron's bf16/fp16 optimizer resumed by its fp32 optimizer (a GPU bf16
checkpoint resumed with --cpu): megatron.resilience.precision_change, against megatron's own
FP32Optimizer.

The state dict is the one megatron's checkpoint loading hands to the fp32 optimizer when the
checkpoint was saved by ``Float16OptimizerWithFloat16Params``: the Adam moments (sharded
tensors, the same keys in both layouts) loaded where the fp32 optimizer asked for them, its
groups' parameter ids supplied by the launch (megatron's non-persistent objects), and the
saved groups' settings and common step one level down, under "optimizer", where they were
saved (``dist_checkpointing.load`` returns the saved common objects merged with what the
launch asked for). The whole move runs where there is a GPU: the last test here (the fast
path's checkpoint) and tests/test_transformer_engine_gpu.py (TE's layers').
"""

import shutil

import pytest
import torch

from helpers import parse_losses, run_entry
from megagpt.cpu_mode import CudaToCpu
from megagpt.resilience import precision_change

GROUP_SETTINGS = [  # megatron's per-group settings (its identifier keys), as saved
    {"max_lr": 1e-3, "min_lr": 0.0, "wd_mult": 1.0, "lr_mult": 1.0,
     "is_expert_parallel": False, "is_decoupled_lr": False, "lr": 5e-4, "weight_decay": 0.1},
    {"max_lr": 1e-3, "min_lr": 0.0, "wd_mult": 0.0, "lr_mult": 1.0,
     "is_expert_parallel": False, "is_decoupled_lr": False, "lr": 5e-4, "weight_decay": 0.0},
]


def fp32_optimizer():
    """megatron's FP32Optimizer over a weight and a bias in two groups, as megatron builds
    them for a fresh launch (settings from the launch, state empty)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer

    weight = torch.nn.Parameter(torch.zeros(4, 3))
    bias = torch.nn.Parameter(torch.zeros(4))
    groups = [{**settings, "params": [p], "lr": 1e-3, "weight_decay": 0.1 * settings["wd_mult"]}
              for settings, p in zip(GROUP_SETTINGS, (weight, bias))]
    inner = torch.optim.AdamW(groups, lr=1e-3)
    with CudaToCpu():
        return FP32Optimizer(inner, OptimizerConfig(lr=1e-3), lambda opt, config=None: None)


def loaded_from_mixed_precision_checkpoint(step=3):
    """What megatron hands FP32Optimizer.load_state_dict for a bf16 optimizer's checkpoint."""
    moments = {0: {"exp_avg": torch.full((4, 3), 0.5), "exp_avg_sq": torch.full((4, 3), 0.25)},
               1: {"exp_avg": torch.full((4,), -0.5), "exp_avg_sq": torch.full((4,), 0.75)}}
    return {
        "state": moments,                                  # the sharded moments, as asked
        "param_groups": [{"params": [0]}, {"params": [1]}],  # the launch's ids
        "optimizer": {                                     # saved, one level down
            "param_groups": [dict(g) for g in GROUP_SETTINGS],
            "state": {"common_step": torch.tensor(float(step))},
        },
    }


def test_megatron_alone_stops_on_such_a_checkpoint():
    """The failure seen on the GPU machine: megatron matches groups by their settings and
    finds none among the ids it was given."""
    with pytest.raises(ValueError, match="Could not find parameter group"):
        fp32_optimizer().load_state_dict(loaded_from_mixed_precision_checkpoint())


def test_the_fp32_optimizer_resumes_the_saved_moments_step_and_group_settings():
    from megatron.core.optimizer.optimizer import FP32Optimizer

    optimizer = fp32_optimizer()
    load = precision_change.reading_mixed_precision_checkpoints(FP32Optimizer.load_state_dict)
    load(optimizer, loaded_from_mixed_precision_checkpoint(step=3))
    weight, bias = optimizer.get_parameters()
    state = optimizer.optimizer.state
    assert torch.equal(state[weight]["exp_avg"], torch.full((4, 3), 0.5))
    assert torch.equal(state[bias]["exp_avg_sq"], torch.full((4,), 0.75))
    assert float(state[weight]["step"]) == float(state[bias]["step"]) == 3.0
    # the settings the checkpoint's schedule had reached (lr 5e-4), not the launch's 1e-3
    groups = optimizer.optimizer.param_groups
    assert [g["lr"] for g in groups] == [5e-4, 5e-4]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0] and groups[1]["params"] == [bias]


def test_an_fp32_checkpoint_goes_to_megatron_as_it_came():
    seen = []
    load = precision_change.reading_mixed_precision_checkpoints(
        lambda self, state_dict: seen.append(state_dict))
    fp32_saved = {"state": {}, "param_groups": [dict(g, params=[i])
                                                for i, g in enumerate(GROUP_SETTINGS)]}
    load(None, fp32_saved)
    assert seen == [fp32_saved] and seen[0] is fp32_saved
    assert not precision_change.saved_by_mixed_precision_optimizer(fp32_saved)


def test_a_different_number_of_groups_is_refused_with_the_counts():
    loaded = loaded_from_mixed_precision_checkpoint()
    loaded["param_groups"] = loaded["param_groups"][:1]
    with pytest.raises(ValueError, match="2 parameter groups and this fp32 launch's 1"):
        precision_change.fp32_layout(loaded)


def test_resilience_installs_the_wrapper_for_pretrain_and_takes_it_off_after():
    from types import SimpleNamespace

    from megatron.core.optimizer.optimizer import FP32Optimizer

    from megagpt import megatron_wrappers, resilience
    from megagpt.launch.writer import load_earlier

    args = SimpleNamespace(entry_argv=[], train_iters=10, save=None, load=None,
                           check_for_nan_in_loss_and_grad=True)
    original = FP32Optimizer.load_state_dict
    with resilience.active(args, load_earlier):
        assert precision_change.__name__ in megatron_wrappers.installed(
            FP32Optimizer, "load_state_dict")
    assert FP32Optimizer.load_state_dict is original


TINY = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
        "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--train-iters", "6"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_bf16_gpu_checkpoint_of_the_default_resumes_with_cpu(tmp_path):
    """The default launch in bf16 on the GPU, saved at iteration 3 of 6, resumed with --cpu
    (fp32): iterations 4-6 within 5 % of the uninterrupted GPU run (fp32 against bf16
    arithmetic; the figure is printed)."""
    whole = run_entry([*TINY, "--bf16"], cwd=tmp_path, timeout=600)
    assert whole.returncode == 0, whole.stdout[-3000:]
    saved = tmp_path / "saved"
    out = run_entry([*TINY, "--bf16", "--exit-interval", "3", "--save", str(saved),
                     "--save-interval", "3"], cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    moved = tmp_path / "moved"
    shutil.copytree(saved, moved)
    out = run_entry([*TINY, "--cpu", "--load", str(moved), "--save", str(moved),
                     "--save-interval", "3"], cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    resumed, reference = parse_losses(out.stdout), parse_losses(whole.stdout)
    assert sorted(resumed) == [4, 5, 6], resumed
    worst = max(abs(resumed[i] - reference[i]) / reference[i] for i in (4, 5, 6))
    print(f"bf16 GPU -> --cpu: largest relative loss difference {worst:.2e}")
    assert worst < 5e-2
