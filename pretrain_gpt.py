"""Pretrain a GPT model with ``megatron.training.pretrain``.

    python pretrain_gpt.py [megatron flags] [--config FILE.yaml] [--cpu] [--dry-run]
    torchrun --nproc-per-node 8 pretrain_gpt.py [megatron flags]

The hooks megatron's training loop calls:
  ``train_valid_test_datasets_provider``  datasets for the ranks that read data
  ``get_batch``                           one micro-batch on this rank (TP broadcast, CP slice)
  ``forward_step``                        model output and the loss closure for the schedule
  ``loss_func``                           masked next-token loss, its token count, the report
``main`` resolves the launch once (``megagpt.launch``: every choice with its reason), writes
megatron's arguments from it, validates them, builds a ``GPTModelConfig`` and a
``PretrainConfigContainer`` from them and the launch, and hands everything to
``megatron.training.pretrain`` inside the launch's one context of megatron changes.
"""

import sys
import time

_PROGRAM_START = time.time()  # before the heavy imports, for megatron's start-up report

if __name__ == "__main__":
    from megagpt.project_env import use_project_environment

    use_project_environment(__file__)  # .venv's Python where this one lacks megatron
    from megagpt.command_line.option_errors import check_early

    check_early(sys.argv[1:])  # a misspelled option is named in a fraction of a second

import copy
from dataclasses import dataclass
from functools import partial

import torch

from megagpt.compat import quiet_fallback_warnings

quiet_fallback_warnings()  # before megatron's imports, which warn once per module

from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank

import gpt_builders
from megagpt.command_line import arguments as entry_arguments
from megagpt.gpt_model import describe as describe_model
from megagpt.launch import after_validation, resolve, write
from megagpt.launch.megatron_changes import launched
from megagpt import run_log
from megagpt.launch import apex_kernels
from megagpt.log import log
from megagpt.megatron_errors import INPUT_ERRORS
from megagpt.preflight.launch_path import WhatRuns
from megagpt.preflight.memory_knobs import memory_knobs
from megagpt.resilience.divergence import EVALUATION_FAULT
from megagpt.launch.rendezvous import store_for

# A loss ten times the largest seen so far counts as a spike (--check-for-spiky-loss).
SPIKY_LOSS_FACTOR = 10

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------

def dataset_config_from_args(args, tokenizer) -> GPTDatasetConfig:
    """The GPTDatasetConfig for --data-path blends, per-split paths or mock data."""
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
    )


def is_dataset_built_on_rank(vp_stage=None) -> bool:
    """Only TP rank 0 of the first and last pipeline stages reads data; it broadcasts."""
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return (is_first_or_last_pipeline_stage(vp_stage)
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None, *,
                                       dataset_config: GPTDatasetConfig, mock_data: bool):
    """Train, validation and test datasets of at least the requested sample counts.

    A split of ``--split`` asked for no samples (``--eval-iters 0``) is not built: megatron
    would build its index all the same, and for a share that rounds to no document (the
    1/1000 test share of a small corpus) it loops forever. A split that holds no whole
    sample where none was asked of it is left out, with a log line, rather than handed to
    megatron's sampler, which stops on an assertion.
    """
    from megagpt.megatron_errors import explain, raised_by_megatron
    from megagpt.preflight import DataError

    dataset_type = MockGPTDataset if mock_data else GPTDataset
    if not mock_data:
        dataset_config = without_unrequested_splits(dataset_config, train_val_test_num_samples)
    try:
        datasets = BlendedMegatronDatasetBuilder(
            dataset_type, train_val_test_num_samples,
            partial(is_dataset_built_on_rank, vp_stage=vp_stage), dataset_config,
        ).build()
    except (AssertionError, ValueError) as exc:  # what the data check did not foresee
        if not raised_by_megatron(exc):
            raise
        raise DataError(explain(exc, what="cannot build the datasets")) from None
    return drop_empty_unrequested_splits(datasets, train_val_test_num_samples,
                                         dataset_config.sequence_length)


def without_unrequested_splits(config: GPTDatasetConfig, requested) -> GPTDatasetConfig:
    """``config`` with no share of ``--split`` for the splits asked for 0 samples."""
    matrix = config.split_matrix
    unbuilt = [name for name, n, bookends in zip(("train", "validation", "test"), requested,
                                                 matrix or ()) if n == 0 and bookends is not None]
    if not unbuilt:
        return config
    config = copy.copy(config)
    config.split_matrix = [None if n == 0 else bookends for n, bookends in zip(requested, matrix)]
    log(f"data: no samples asked of the {' and '.join(unbuilt)} split"
        f"{'s' if len(unbuilt) > 1 else ''}: not built")
    return config


def drop_empty_unrequested_splits(datasets, requested, seq_length: int):
    """``datasets`` with each split that has no sample, and had none requested, as None."""
    out = list(datasets)
    for i, (name, dataset) in enumerate(zip(("train", "validation", "test"), datasets)):
        # a split asked for samples gets them: megatron's index repeats epochs until it has
        if dataset is None or isinstance(dataset, list) or len(dataset) > 0 or requested[i]:
            continue
        log(f"data: the {name} split holds no whole sample of {seq_length + 1} tokens and "
            f"none is asked of it; left out (a larger share in --split gives it samples)")
        out[i] = None
    return type(datasets)(out) if isinstance(datasets, tuple) else out



# ---------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchLayout:
    """What get_batch needs to know about the run; fixed for the whole run."""

    micro_batch_size: int
    seq_length: int
    create_attention_mask: bool
    mtp_num_layers: int | None

    @classmethod
    def from_args(cls, args) -> "BatchLayout":
        return cls(args.micro_batch_size, args.seq_length,
                   args.create_attention_mask_in_dataloader, args.mtp_num_layers)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def get_batch(data_iterator, layout: BatchLayout, vp_stage=None):
    """(tokens, labels, loss_mask, attention_mask, position_ids) for this rank.

    TP rank 0 reads the micro-batch and broadcasts it to the other TP ranks; each CP rank
    keeps its slice of the sequence; middle pipeline stages get nothing (they receive
    activations instead).
    """
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    batch = None
    if tp_rank == 0:
        raw = next(data_iterator)
        device = _device()
        batch = {key: (raw[key].to(device, non_blocking=True) if raw.get(key) is not None else None)
                 for key in BATCH_KEYS}
        batch["cu_seqlens"] = None
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=layout.create_attention_mask,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(),
        cp_size=parallel_state.get_context_parallel_world_size(),
        tp_rank=tp_rank,
        micro_batch_size=layout.micro_batch_size,
        seq_length=layout.seq_length,
        mtp_on_this_rank=bool(layout.mtp_num_layers)
        and parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        pipeline_model_parallel_size=pp_size,
        is_pipeline_first_stage=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        is_pipeline_last_stage=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
    )
    batch.setdefault("cu_seqlens", None)
    if parallel_state.get_context_parallel_world_size() > 1:
        batch = get_batch_on_this_cp_rank(
            batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())
    return tuple(batch.get(key) for key in BATCH_KEYS)


# ---------------------------------------------------------------------------
# Loss and forward step
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LossChecks:
    """Which result checks loss_func runs through megatron's rerun state machine."""

    nan_and_inf: bool
    spiky_loss: bool

    @classmethod
    def from_args(cls, args) -> "LossChecks":
        return cls(args.check_for_nan_in_loss_and_grad, args.check_for_spiky_loss)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, checks: LossChecks,
              evaluating: bool = False):
    """Sum of per-token losses where loss_mask is 1, the number of such tokens, and the
    ``lm loss`` report; the schedule divides the sum by the token count across ranks.
    ``evaluating``: the model is in eval mode, and a NaN/Inf is the evaluation's (its
    message says so, for ``resilience.divergence``)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    rerun_state_machine = get_rerun_state_machine()
    during = EVALUATION_FAULT if evaluating else ""
    if checks.nan_and_inf:
        # The forward pass is deterministic: any NaN/Inf is a fault, not noise (tolerance 0).
        rerun_state_machine.validate_result(
            result=loss, rejection_func=torch.isnan,
            message="found NaN in local forward loss calculation" + during, tolerance=0.0,
            fatal=True)
        rerun_state_machine.validate_result(
            result=loss, rejection_func=torch.isinf,
            message="found Inf in local forward loss calculation" + during, tolerance=0.0,
            fatal=True)
    if checks.spiky_loss:
        rerun_state_machine.validate_result(
            result=loss,
            rejection_func=partial(rerun_state_machine.is_unexpectedly_large,
                                   threshold=SPIKY_LOSS_FACTOR, context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)
    return loss, num_tokens, report


def forward_step(data_iterator, model, checkpoint_activations_microbatch=None, *,
                 layout: BatchLayout, checks: LossChecks, output_processor=None):
    """Run the model on the next micro-batch; return its per-token losses and the closure
    the pipeline schedule calls to reduce them.

    ``output_processor`` replaces GPTModel's LM head + cross entropy on the last stage
    (the fast path's chunked loss, which never holds the full [tokens, vocab] logits);
    None keeps megatron's.
    """
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, layout, vp_stage)
    timers("batch-generator").stop()

    extra = {"output_processor": output_processor} if output_processor is not None else {}
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels,
                          loss_mask=loss_mask, **extra)
    return output_tensor, partial(loss_func, loss_mask, checks=checks,
                                  evaluating=not model.training)


def get_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Word embeddings live on the first and the last pipeline stage (tied weights)."""
    if len(pp_ranks) == 1:
        return list(pp_ranks)
    return [pp_ranks[0], pp_ranks[-1]]


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def build_configs(args, launch):
    """(GPTModelConfig, PretrainConfigContainer, LayerSpecChoice) from validated args and the
    launch's choices."""
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    model_config, choice = gpt_builders.gpt_model_config(args, launch)
    container = pretrain_cfg_container_from_args(args, model_config)
    return model_config, container, choice


def run(args, launch, store=None) -> None:
    """Train with validated, global args as ``launch`` decided them (see main); ``store``:
    the rendezvous of a launcher-free single process (the launch's ``rendezvous`` choice,
    ``rendezvous.store_for``)."""
    from megatron.training import get_tokenizer, pretrain, set_startup_timestamps

    set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    try:
        model_config, container, choice = build_configs(args, launch)
    except INPUT_ERRORS as exc:  # megatron's config dataclasses check here
        raise entry_arguments.argument_error(exc, args, within=False) from None
    log(describe_model(launch))
    dataset_config = dataset_config_from_args(args, get_tokenizer())
    datasets_provider = partial(train_valid_test_datasets_provider,
                                dataset_config=dataset_config, mock_data=args.mock_data)
    # Every rank that needs data builds it (megatron's core datasets are distributed-aware),
    # rather than TP rank 0 building it and broadcasting the whole dataset.
    datasets_provider.is_distributed = True
    step = partial(forward_step, layout=BatchLayout.from_args(args),
                   checks=LossChecks.from_args(args),
                   output_processor=gpt_builders.output_processor(launch))
    # every change this launch makes inside megatron and torch, undone when pretrain returns
    # the out-of-memory line's estimate, of what this launch runs
    knobs = partial(memory_knobs, runs=WhatRuns.of(launch))
    with launched(launch, args, container, log, memory_knobs=knobs):
        apex_kernels.log_launch_line(launch, args, log)  # what the launch's changes left to apex
        pretrain(container, datasets_provider, ModelType.encoder_or_decoder, step,
                 get_embedding_ranks=get_embedding_ranks, store=store)


def stopped_before_training(args, tensorboard) -> None:
    """No empty TensorBoard event file from a launch that trained nothing."""
    if tensorboard is not None and not hasattr(args, "curr_iteration"):
        run_log.run_folder.discard_empty_tensorboard(args, tensorboard)


def main(argv: list[str] | None = None) -> int:
    """Resolve and check the launch, then train (or, with --dry-run, print the plan); the
    process groups ended on the way out, however it leaves (``process_exit``)."""
    import traceback

    from megagpt.diagnostics import process_exit

    # groups a caller made before are the caller's to end
    ours = process_exit.LaunchProcessGroups()
    try:
        status = train_or_plan(argv)
    except SystemExit as exc:  # megatron's exit after --exit-interval or a signal's save
        ours.end_or_leave(process_exit.status_of(exc), log)
        raise
    except BaseException:
        ours.end_or_leave(1, log, before_leaving=traceback.print_exc)
        raise
    ours.end_or_leave(status, log)
    return status


def train_or_plan(argv: list[str] | None) -> int:
    """``main``'s launch: the exit status, or megatron's SystemExit."""
    from megagpt.errors import UserError
    from megagpt.resilience import interrupt

    args = tensorboard = None
    try:
        launch = resolve(argv)  # what the command line comes to here; changes nothing
        args = write(launch, log=log)  # megatron's arguments and the environment
        if args.dry_run:
            from megagpt.preflight import run_dry_run
            return run_dry_run(launch, args)
        from megagpt import preflight

        # the dry run's checks, with their numbers, then megatron's; all before any model
        preflight.check_layout(args, args.world_size)
        preflight.check_outputs(args)
        with run_log.argument_table_kept():  # for the run folder, not the log
            entry_arguments.validate_arguments(args, device_arch=0 if args.cpu else None)
        tensorboard = run_log.run_folder.tensorboard_before(args)
        entry_arguments.set_megatron_globals(args)  # megatron pads the vocabulary here
        from megatron.training import get_tokenizer

        preflight.check_inputs(args, get_tokenizer().vocab_size, log)
        after_validation(launch, args, log)  # the checkpoint to resume (one-line errors)
        run(args, launch, store_for(launch))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        stopped_before_training(args, tensorboard)
        return 2
    except KeyboardInterrupt:  # Ctrl-C where nothing is to be saved
        print(f"[megagpt] {interrupt.interrupted_line(args)}", file=sys.stderr, flush=True)
        stopped_before_training(args, tensorboard)
        return interrupt.EXIT_STATUS
    except SystemExit:  # megatron leaves after its exit signal's save
        if not interrupt.pressed():
            raise
    if interrupt.pressed():
        log("stopped by Ctrl-C after saving a checkpoint; the same command resumes from it")
        return interrupt.EXIT_STATUS
    return 0


if __name__ == "__main__":
    sys.exit(main())
