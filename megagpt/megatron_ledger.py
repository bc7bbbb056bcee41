"""Everything in megatron-core that the project wraps, replaces, stands in for or relies on:
every record (``megagpt.megatron_change.Change``) in one list, each checked against the
installed megatron.

One record per megatron name and owner: what is done to it (``how``), which megagpt module
does it (``owner``), what it does, why, when it is in place, and a fingerprint of megatron's
source of it at the version it was checked against (``megagpt.megatron_source``). Three
kinds, in this order:

``ENTERED``
    the changes the launch's table enters around megatron's ``pretrain``
    (``megagpt.launch.megatron_changes``), in the order it installs them; each record is
    declared beside the code that makes it (its owner's ``MEGATRON_CHANGES``);
``AROUND_A_CALL``
    the changes made around one call outside that context (megatron's ``validate_args``
    where no GPU answers, the preflight's schedule check, an asynchronous save's
    scheduling, megatron's global tokenizer), declared likewise;
``DEPENDS_ON``
    what the project stands in for, covers or relies on: nothing of megatron's is changed,
    so the records stand here.

``tests/test_megatron_ledger.py`` fails when an installed megatron's source of any record
differs from its fingerprint (a new signature, a changed body, a renamed or removed name) and
when a needle the record depends on is gone: that record's workaround must then be re-read
against the new code, and either updated (new fingerprint, ``checked`` raised) or removed. It
also fails when the project's installers change a megatron attribute that no record lists,
or change one other than through ``megagpt.megatron_wrappers`` (which installs only what an
owner declares); ``tests/test_step_table.py`` when what the launch's context installs, or its
order, differs from the table.

``python -m megagpt.megatron_ledger`` prints the ledger with each record's state against the
installed megatron (and the fingerprint to record after re-checking a record).
"""

from __future__ import annotations

from megagpt.command_line import arguments
from megagpt.launch import megatron_changes
from megagpt.megatron_change import (CHECKED_AGAINST, COVERS, RELIES_ON, REPLACES, STANDS_IN,
                                     TRAINING, WRAPS, Change)
from megagpt.preflight import schedule_check
from megagpt.resilience import async_save
from megagpt.run_log import run_folder

__all__ = ["AROUND_A_CALL", "CHECKED_AGAINST", "COVERS", "DEPENDS_ON", "ENTERED", "LEDGER",
           "RELIES_ON", "REPLACES", "STANDS_IN", "WRAPS", "Change", "entries_for", "state"]

# When each record of DEPENDS_ON is in place.
LAUNCHED = "around megatron.training.pretrain (launch.megatron_changes), undone after"
PRETRAIN = LAUNCHED + ": resilience.active"
CPU_PRETRAIN = LAUNCHED + ", with --cpu: cpu_mode.active"
DIAGNOSTICS = LAUNCHED + ": diagnostics.active"
CPU_GENERATING = ("with --cpu, around megatron.core.inference's generation in the tools "
                  "(cpu_mode.generating), undone after")
MODEL = "when the fast spec builds the model (gpt_model -> fast_spec.spec)"
LAUNCH = LAUNCHED + ": the wheel's needs (compat)"
TOKENIZER = "whenever a tokenizer is built (data.tokenizers.build_tokenizer)"
PARSE = "at parse time (data.tokenizers, megagpt.data.preprocess's parser)"
ADAPT = "while a launch is resolved (megagpt.compat's steps, the fast path's)"

ENTERED: tuple[Change, ...] = megatron_changes.CHANGES

AROUND_A_CALL: tuple[Change, ...] = (
    *arguments.MEGATRON_CHANGES,  # validate_args without a GPU; megatron's global tokenizer
    *run_folder.MEGATRON_CHANGES,  # megatron's argument table, kept for the run folder
    *schedule_check.MEGATRON_CHANGES,  # the preflight's schedule check
    *async_save.MEGATRON_CHANGES,  # inside an asynchronous save
)

DEPENDS_ON: tuple[Change, ...] = (
    # --- megatron's training loop: resilience, diagnostics, the run log ---------------------------
    Change("megatron.training.dist_signal_handler.DistributedSignalHandler.__enter__",
           RELIES_ON, "megagpt.resilience.preemption",
           "a process forked while SIGTERM's handler is this method's local function (its "
           "qualified name) is a data-loader worker of a run that saves on SIGTERM, and keeps "
           "SIGTERM blocked: torch's worker loop installs a SIGTERM handler that ends the "
           "worker before megatron's worker_init_fn installs this one", PRETRAIN,
           "60098ea61fd9", needle="def handler(signum, frame):"),
    Change(TRAINING + "training_log", RELIES_ON, "megagpt.run_log.iteration_line",
           "the entry's iteration line is read from the one training_log builds: its fields "
           "are named and formatted there", PRETRAIN, "7e7ebec01bcf",
           needle="log_string += ' iteration {:8d}/{:8d} |'.format(iteration, args.train_iters)"),
    Change(TRAINING + "train", RELIES_ON, "megagpt.diagnostics.stragglers",
           "train() hands the schedule this module's finalize_model_grads when no other is "
           "set: its wrapper (stragglers.FINALIZE_MODEL_GRADS) is what the schedule calls",
           DIAGNOSTICS, "c8da3b7e0943",
           needle="config.finalize_model_grads_func = finalize_model_grads"),
    Change("megatron.core.parallel_state.update_pg_timeout", RELIES_ON,
           "megagpt.diagnostics.timeouts",
           "sets the timeout of every process group megatron made (after a barrier)",
           DIAGNOSTICS, "6d470006602b", needle="_set_pg_timeout(timeout, group)"),
    Change("megatron.training.initialize._initialize_distributed", RELIES_ON,
           "megagpt.diagnostics.settings",
           "turns torch's flight recorder on from --flight-recorder-dump-path (dump path, "
           "buffer, dump on timeout, stack traces) before it creates the process groups; a "
           "directory gets the prefix _dump_, anything else is the prefix",
           "by the launch's writer (launch.diagnostics.choose_diagnostics), read by megatron at "
           "its process-group set-up", "e01f2e4468d6", needle="'TORCH_NCCL_DUMP_ON_TIMEOUT'"),
    Change("megatron.training.utils.utils.start_memory_history_recording", RELIES_ON,
           "megagpt.diagnostics.out_of_memory",
           "with --record-memory-history its out-of-memory observer writes "
           "<--memory-snapshot-path>_oom_rank-<rank>: the out-of-memory line names that file",
           DIAGNOSTICS, "72c39fbbc438", needle='filename = f"{base}_oom_rank-{rank}{ext}"'),
    Change("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
           "_init_optimizer_states_with_dummy_values", RELIES_ON, "megagpt.compat",
           "called before loading into a fresh distributed optimizer without TE/apex "
           "(compat.SHARDED_STATE_DICT): "
           "one step on zero gradients, so that the state the load overwrites exists",
           LAUNCH, "f19e040b13b0"),
    # --- the fast layer spec: the project's modules in megatron's places ------------------------
    Change("megatron.core.transformer.transformer_layer.TransformerLayer.forward", STANDS_IN,
           "megagpt.fast_spec.layer",
           "FastTransformerLayer overrides it: a dense pre-norm layer runs as one fused "
           "function, anything else through megatron's forward", MODEL, "5ad3ff5e567a"),
    Change("megatron.core.transformer.transformer_layer.TransformerLayer._forward_attention",
           STANDS_IN, "megagpt.fast_spec.layer",
           "the fused function computes what it computes (norm, QKV, attention, projection, "
           "bias-dropout-add) for the layers it takes", MODEL, "3440a7d507a5"),
    Change("megatron.core.transformer.transformer_layer.TransformerLayer._forward_mlp",
           STANDS_IN, "megagpt.fast_spec.layer",
           "the fused function computes what it computes (norm, fc1, activation, fc2, "
           "bias-dropout-add) for the layers it takes", MODEL, "58ffada488fd"),
    Change("megatron.core.transformer.transformer_layer.TransformerLayer."
           "_should_call_local_cudagraph", STANDS_IN, "megagpt.fast_spec.layer",
           "FastTransformerLayer sends only training calls with gradients through megatron's "
           "per-layer graphs: for evaluation megatron's graph manager would replay the graph "
           "captured in training (dropout on, activations saved for a backward that never "
           "comes)", MODEL + ", with per-layer graphs (--fast-cuda-graphs layers)", "abb8c1b2916c"),
    Change("megatron.core.transformer.cuda_graphs._CudaGraphRunner.create_bwd_graph",
           RELIES_ON, "megagpt.fast_spec.layer",
           "its captured backward adds each weight gradient into main_grad itself (decided at "
           "capture), so under per-layer graphs the fused layer's GEMMs hand their gradients "
           "to autograd and gradients are not written "
           "(launch.fast_path_reasons.grad_write_unsupported_reason)",
           MODEL + ", with per-layer graphs (--fast-cuda-graphs layers)",
           "ff66d92c732c", needle="param.main_grad.add_(wgrad)"),
    Change("megatron.core.transformer.dot_product_attention.DotProductAttention", STANDS_IN,
           "megagpt.fast_spec.attention",
           "SDPADotProductAttention takes its place in the spec with the same constructor and "
           "forward signature (torch's SDPA kernels: no [b, heads, s, s] scores)", MODEL,
           "ec3200d0b962"),
    Change("megatron.core.models.common.language_module.language_module.LanguageModule."
           "_set_attention_backend", RELIES_ON, "megagpt.launch.attention_backend",
           "every GPT model's constructor sets TE's NVTE_*_ATTN switches from "
           "--attention-backend and asserts on other values already in the environment; "
           "TE_SWITCHES holds the same values, so the plan refuses such an environment in one "
           "line at parse time", ADAPT, "8f2e8f1beefd",
           needle='check_and_set_env_variable("NVTE_FUSED_ATTN", 1, AttnBackend.fused)'),
    Change("megatron.core.models.backends.LocalSpecProvider.grouped_mlp_modules", RELIES_ON,
           "megagpt.launch.megatron_quirks",
           "megatron's local modules build sequential experts whatever --moe-grouped-gemm "
           "says; adapt_megatron_quirks logs it", ADAPT, "c624a2454eca",
           needle="SequentialMLP"),
    Change("megatron.core.transformer.torch_norm.WrappedTorchNorm", STANDS_IN,
           "megagpt.fast_spec.norm",
           "it refuses --sequence-parallel and apex's persist_layer_norm; TorchNorm builds "
           "the same torch module with both cleared and marks its parameters for megatron's "
           "sequence-parallel sum", MODEL,
           "88f52fb285c2", needle="assert not config.sequence_parallel"),
    Change("megatron.core.models.gpt.gpt_model.GPTModel._postprocess", STANDS_IN,
           "megagpt.fast_spec.lm_loss",
           "the chunked LM-head loss is GPTModel's output_processor, called here with the "
           "keyword arguments it reads", "every forward step (pretrain_gpt.forward_step)",
           "c37e8b2b23e1", needle="return output_processor("),
    # --- CPU mode (megagpt.cpu_mode) ------------------------------------------------------------
    Change("megatron.core.tensor_parallel.random.CudaRNGStatesTracker", STANDS_IN,
           "megagpt.cpu_mode", "CpuRngTracker has its interface (reset, get_states, "
           "set_states, add, fork)", CPU_PRETRAIN, "d30430fec1ac"),
    Change("megatron.training.initialize._initialize_distributed", COVERS, "megagpt.cpu_mode",
           "torch.cuda.device_count() reports one device, so model-parallel groups are built",
           CPU_PRETRAIN, "e01f2e4468d6",
           needle="if device_count > 0 and not skip_model_parallel_init:"),
    Change("megatron.training.initialize._set_random_seed", COVERS, "megagpt.cpu_mode",
           "the CUDA RNG tracker is CpuRngTracker, which forks CPU generator states",
           CPU_PRETRAIN, "75b21960887c", needle="if torch.cuda.device_count() > 0:"),
    Change("megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add", COVERS,
           "megagpt.cpu_mode", "CpuRngTracker.add keeps a CPU generator state", CPU_PRETRAIN,
           "024f740e9cbf", needle="torch.cuda.get_rng_state()"),
    Change("megatron.training.checkpointing.load_checkpoint", COVERS, "megagpt.cpu_mode",
           "CpuRngTracker has real states, so a checkpoint's RNG state loads", CPU_PRETRAIN,
           "ee0f61114e6f", needle="if not rng_state['rng_tracker_states']:"),
    Change(TRAINING + "pretrain", COVERS, "megagpt.cpu_mode",
           "CudaToCpu rewrites the device of the start-time all-reduce; set_jit_fusion_options "
           "is skipped", CPU_PRETRAIN, "7b60d7fc0dd9", needle="device='cuda'"),
    Change("megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining", COVERS,
           "megagpt.cpu_mode", "CudaToCpu rewrites the device of the token counter",
           CPU_PRETRAIN, "06a0bda080db", needle='device="cuda"'),
    Change("megatron.core.utils.GlobalMemoryBuffer.get_tensor", COVERS, "megagpt.cpu_mode",
           "CudaToCpu maps the current device (0) to the CPU", CPU_PRETRAIN, "56723e8ca2fc",
           needle="torch.cuda.current_device()"),
    Change("megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__",
           COVERS, "megagpt.cpu_mode", "CudaToCpu places the gradient buffers on the CPU",
           CPU_PRETRAIN, "0701b0e6dbdf", needle="torch.cuda.current_device()"),
    Change("megatron.core.optimizer.clip_grads.get_grad_norm_fp32", COVERS, "megagpt.cpu_mode",
           "CudaToCpu rewrites the device of the norm reduction", CPU_PRETRAIN, "c086cd323174",
           needle="device='cuda'"),
    Change("megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32", COVERS,
           "megagpt.cpu_mode", "Tensor.type() of a CPU float tensor reports the CUDA type name",
           CPU_PRETRAIN, "19d15a603c4a",
           needle="assert param.grad.type() == 'torch.cuda.FloatTensor'"),
    Change("megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication"
           ".backward", COVERS, "megagpt.cpu_mode",
           "in backward (run with the mode off) torch.cuda.current_device() names the CPU",
           CPU_PRETRAIN, "39c28cf2be6c", needle="device=torch.cuda.current_device()"),
    Change("megatron.training.checkpointing.get_rng_state", COVERS, "megagpt.cpu_mode",
           "torch.cuda.get_rng_state returns the CPU-mode stand-in", CPU_PRETRAIN,
           "2ba966939c46", needle="torch.cuda.get_rng_state()"),
    Change("megatron.core.parallel_state.update_pg_timeout", COVERS, "megagpt.cpu_mode",
           "the collective timeout tightened after the warm-up (megagpt.diagnostics.timeouts) "
           "synchronises CUDA first: CPU mode's stand-in", CPU_PRETRAIN, "6d470006602b",
           needle="torch.cuda.synchronize()"),
    Change(TRAINING + "training_log", COVERS, "megagpt.cpu_mode",
           "--log-memory-to-tensorboard: torch.cuda.memory_stats reports zeros for the "
           "counters megatron logs", CPU_PRETRAIN, "7e7ebec01bcf",
           needle='mem_stats["reserved_bytes.all.current"]'),
    Change("megatron.training.initialize.initialize_megatron", COVERS, "megagpt.cpu_mode",
           "--async-save: the persistent checkpoint writer is forked, so it inherits CPU "
           "mode's stand-ins (a fork server's fresh interpreter has none)", CPU_PRETRAIN,
           "1894d53ca729", needle="init_persistent_async_worker(args.rank, 'forkserver')"),
    Change("megatron.core.dist_checkpointing.strategies.async_utils.PersistentAsyncCaller.schedule_async_call", COVERS, "megagpt.cpu_mode",
           "the writer restarted for the final save (megatron closes it when train() returns) "
           "is forked too, not spawned", CPU_PRETRAIN, "efde49dd9b99",
           needle="PersistentAsyncCaller._get_process(torch.distributed.get_rank())"),
    Change("megatron.core.dist_checkpointing.strategies.async_utils.PersistentAsyncCaller.async_loop", COVERS, "megagpt.cpu_mode",
           "the forked writer sees torch.cuda.device_count() == 1 (0 without CPU mode: a "
           "division by zero, after which the trainer waits for the writer forever)",
           CPU_PRETRAIN, "79e2ad6d3941",
           needle="torch.cuda.set_device(rank % torch.cuda.device_count())"),
    Change("megatron.core.inference.text_generation_controllers.text_generation_controller."
           "TextGenerationController.__init__", COVERS, "megagpt.cpu_mode",
           "generating(): the current device is named 'cpu', which torch.Generator takes",
           CPU_GENERATING, "451889528edc",
           needle="torch.Generator(device=torch.cuda.current_device())"),
    Change("megatron.core.inference.text_generation_controllers.text_generation_controller."
           "TextGenerationController.generate_all_output_tokens_static_batch", COVERS,
           "megagpt.cpu_mode",
           "the stand-in Event records nothing and times every token at 0 s; its tensors go "
           "to the current device, the CPU inside generating()", CPU_GENERATING,
           "46abdde928be", needle="torch.cuda.Event(enable_timing=True)"),
    # --- tokenizers and signals -----------------------------------------------------------------
    Change("megatron.core.tokenizers.utils.build_tokenizer.build_tokenizer", STANDS_IN,
           "megagpt.data.tokenizers",
           "GPT2BPETokenizer is built from a local HuggingFace folder made of the vocab and "
           "merge files; every other type goes to megatron's function unchanged", TOKENIZER,
           "1a31134d3294"),
    Change("megatron.core.tokenizers.utils.build_tokenizer._set_padded_vocab_size", RELIES_ON,
           "megagpt.data.tokenizers", "pads the vocabulary exactly as megatron does",
           TOKENIZER, "15e18791be99"),
    Change("megatron.training.arguments._add_tokenizer_args", RELIES_ON,
           "megagpt.data.tokenizers", "the preprocessing tool takes megatron's own tokenizer "
           "flags", PARSE, "f63941a6c5da"),
    Change("megatron.training.dist_signal_handler.DistributedSignalHandler", RELIES_ON,
           "megagpt.resilience.interrupt",
           "Ctrl-C sets the handler's _signal_received, as its own SIGTERM handler does, so that "
           "megatron's loop saves and exits after the iteration", LAUNCH, "bd8e98c3239d",
           needle="self._signal_received = True"),
)

LEDGER: tuple[Change, ...] = (*ENTERED, *AROUND_A_CALL, *DEPENDS_ON)


def entries_for(target: str) -> list[Change]:
    """The ledger's records for ``target``, in ledger order."""
    return [c for c in LEDGER if c.target == target]


def state(change: Change) -> str:
    """``ok``, or what differs in the installed megatron's source of ``change.target``."""
    from megagpt import megatron_source

    try:
        source = megatron_source.definition_source(change.target)
    except megatron_source.DefinitionNotFound as exc:
        return f"gone: {exc}"
    if change.needle and change.needle not in source:
        return f"needle gone: no longer contains {change.needle!r}"
    now = megatron_source.fingerprint(change.target)
    if now != change.fingerprint:
        signature = megatron_source.signature_text(change.target)
        return (f"changed: fingerprint {now} (checked {change.fingerprint} at megatron-core "
                f"{change.checked})" + (f"; signature now {signature}" if signature else ""))
    return "ok"


def main() -> int:
    """Print every entry and its state against the installed megatron; 1 if any differs."""
    from importlib.metadata import version

    print(f"megatron-core {version('megatron-core')} installed; ledger checked against "
          f"{CHECKED_AGAINST}")
    bad = 0
    for change in LEDGER:
        now = state(change)
        bad += now != "ok"
        print(f"{now:<4} {change.how:<13} {change.target}  <- {change.owner}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
