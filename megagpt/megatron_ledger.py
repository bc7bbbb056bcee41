"""Everything in megatron-core that the project wraps, replaces, stands in for or relies on.

One entry per megatron name: what is done to it (``how``), which megagpt module does it
(``owner``), why, when it is in place, and a fingerprint of megatron's source of it at the
version it was checked against (``megagpt.megatron_source``). ``tests/test_megatron_ledger.py``
fails when an installed megatron's source of any entry differs from its fingerprint (a new
signature, a changed body, a renamed or removed name) and when a needle the entry depends on
is gone: that entry's workaround must then be re-read against the new code, and either
updated (new fingerprint, ``checked`` raised) or removed. It also fails when the project's
installers change a megatron attribute that no entry lists, or change one other than through
``megagpt.megatron_wrappers`` (which installs every ``wraps`` and ``replaces`` entry).

How (``how``):

``wraps``
    the module attribute becomes a function that calls megatron's. Where several owners
    wrap one function, ``megagpt.megatron_wrappers`` composes them in the order they are
    installed, the first innermost (next to megatron's function); the launch's one context
    states that order (``megagpt.launch.megatron_changes``). The order of the entries here
    means nothing.
``replaces``
    the attribute is set to the project's own object; megatron's is not called.
``stands in for``
    a class or function of the project takes the place of megatron's with the same interface
    (through the layer spec, or handed to megatron); nothing inside megatron is changed, but
    the project's version must keep computing what megatron's does.
``covers``
    megatron code that CPU mode makes run on a CPU; ``needle`` is the CUDA use the
    workaround exists for.
``relies on``
    a private megatron name the project calls or sets.

``python -m megagpt.megatron_ledger`` prints the ledger with each entry's state against the
installed megatron (and the fingerprint to record after re-checking an entry).
"""

from __future__ import annotations

from dataclasses import dataclass

CHECKED_AGAINST = "0.19.2"

WRAPS, REPLACES, STANDS_IN, COVERS, RELIES_ON = (
    "wraps", "replaces", "stands in for", "covers", "relies on")

# When each change is in place. The launch's changes are all entered by one context around
# megatron.training.pretrain and undone after it (launch.megatron_changes.launched).
LAUNCHED = "around megatron.training.pretrain (launch.megatron_changes), undone after"
FAST_LAUNCH = LAUNCHED + ": the fast path's step, as the launch chose it (train_step)"
PRETRAIN = LAUNCHED + ": resilience.active"
CPU_PRETRAIN = LAUNCHED + ", with --cpu: cpu_mode.active"
DIAGNOSTICS = LAUNCHED + ": diagnostics.active"
CPU_TE_KERNELS = CPU_PRETRAIN + ", where megatron bound TE's or apex's kernels"
CPU_GENERATING = ("with --cpu, around megatron.core.inference's generation in the tools "
                  "(cpu_mode.generating), undone after")
VALIDATION = ("around megatron's validate_args where no GPU answers "
              "(arguments.validate_arguments), undone after")
MODEL = "when the fast spec builds the model (gpt_model -> fast_spec.spec)"
LAUNCH = LAUNCHED + ": the wheel's needs (compat)"
GLOBALS = "at launch, after megatron's globals are set (arguments.set_megatron_globals)"
TOKENIZER = "whenever a tokenizer is built (data.tokenizers.build_tokenizer)"
PREFLIGHT = ("around the preflight's schedule and sample-count checks "
             "(preflight.schedule_check.global_args), undone after")
PARSE = "at parse time (data.tokenizers, megagpt.data.preprocess's parser)"
ADAPT = "while a launch is resolved (megagpt.compat's steps, the fast path's)"


@dataclass(frozen=True)
class Change:
    """One megatron name the project changes or depends on (see the module docstring)."""

    target: str  # package.module[.Class].name, where the project reaches it
    how: str
    owner: str  # the megagpt module that does it
    why: str
    when: str
    fingerprint: str  # megatron_source.fingerprint(target) at ``checked``
    needle: str = ""  # text in megatron's source the change exists for
    checked: str = CHECKED_AGAINST


T = "megatron.training.training."
DDP = "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel."

LEDGER: tuple[Change, ...] = (
    # --- megatron's training loop (module-level functions of megatron.training.training) ------
    Change(T + "training_log", WRAPS, "megagpt.train_step.async_step",
           "it builds torch.tensor([0.0], device='cuda') per loss key each iteration, a copy "
           "from pageable memory that waits for the GPU; built in pinned memory it does not",
           FAST_LAUNCH + ", with the asynchronous step", "7e7ebec01bcf",
           needle="torch.tensor([0.0], dtype=torch.float, device='cuda')"),
    Change(T + "training_log", WRAPS, "megagpt.resilience.fidelity",
           "a first iteration after a (re)start that falls on a log boundary does not reset "
           "the loss accumulators, so the next logged loss is the mean of two iterations "
           "(upstream Megatron-LM#6237); outside the asynchronous step's wrapper, so that it "
           "rebinds the arguments megatron's function receives", PRETRAIN, "7e7ebec01bcf",
           needle="should_reset = not is_first_iteration"),
    Change(T + "setup_model_and_optimizer", WRAPS, "megagpt.train_step.flat_adam",
           "the optimizer it returns gets the flat AdamW step where it applies (one pass over "
           "flat buffers instead of megatron's five)", FAST_LAUNCH + ", with fused AdamW",
           "e564c0eccd76"),
    Change(T + "setup_model_and_optimizer", WRAPS, "megagpt.train_step.async_step",
           "a bf16 optimizer's constant loss scale of one becomes a host tensor, so the "
           "loop's optimizer.get_loss_scale().item() does not wait for the GPU; outside the "
           "flat step's wrapper (it reads the optimizer that one has finished)",
           FAST_LAUNCH + ", with the asynchronous step", "e564c0eccd76"),
    Change(T + "reduce_max_stat_across_model_parallel_group", WRAPS,
           "megagpt.train_step.async_step",
           "an all-reduce followed by .item() each iteration; over a model-parallel group of "
           "one rank it is the identity, and the gradient norm stays on the GPU",
           FAST_LAUNCH + ", with the asynchronous step", "7189f9a94723"),
    Change(T + "logical_and_across_model_parallel_group", WRAPS, "megagpt.train_step.async_step",
           "an all-reduce followed by .item() after every step; the identity over one rank",
           FAST_LAUNCH + ", with the asynchronous step", "aaa17a1cbd04"),
    Change("megatron.training.dist_signal_handler.all_gather_item", WRAPS,
           "megagpt.train_step.async_step",
           "with --exit-signal-handler it all-gathers a flag every iteration; over one "
           "process that is the local flag", FAST_LAUNCH + ", with the asynchronous step",
           "6554fa85bd11"),
    Change(T + "build_train_valid_test_data_iterators", WRAPS, "megagpt.resilience.fidelity",
           "DataLoader draws its worker seed from torch's CPU generator after the checkpoint "
           "is loaded, so a resumed CPU run's dropout masks differ; the wrapper leaves the "
           "host generators as it found them", PRETRAIN, "bd84366cbf26"),
    Change(T + "build_train_valid_test_data_iterators", WRAPS, "megagpt.resilience.worker_deaths",
           "the iterators it makes install torch's SIGCHLD handler, which raises a dead "
           "data-loader worker's error once for each loader, on SIGCHLDs after the first; the "
           "wrapper makes it raise once", PRETRAIN, "bd84366cbf26"),
    Change("megatron.training.dist_signal_handler.DistributedSignalHandler.__enter__",
           RELIES_ON, "megagpt.resilience.preemption",
           "a process forked while SIGTERM's handler is this method's local function (its "
           "qualified name) is a data-loader worker of a run that saves on SIGTERM, and keeps "
           "SIGTERM blocked: torch's worker loop installs a SIGTERM handler that ends the "
           "worker before megatron's worker_init_fn installs this one", PRETRAIN,
           "60098ea61fd9", needle="def handler(signum, frame):"),
    Change(T + "save_checkpoint", WRAPS, "megagpt.resilience.checkpoint_guard",
           "a save the file system refuses (folder gone, disk full) fails with a stack trace "
           "from torch.distributed.checkpoint; the wrapper makes it one line naming the "
           "iteration, the folder and the newest checkpoint that stays; innermost",
           PRETRAIN, "42e813b3aa30"),
    Change(T + "save_checkpoint", WRAPS, "megagpt.resilience.config_snapshot",
           "each persistent save gets the resolved configuration beside it", PRETRAIN,
           "42e813b3aa30"),
    Change(T + "save_checkpoint", WRAPS, "megagpt.resilience.divergence",
           "every gradient norm still on its way from the GPU is checked before a save, so a "
           "diverged model is never saved; outside the snapshot's wrapper (no snapshot of a "
           "save that is refused)", PRETRAIN + ", when the gradient-norm guard is on",
           "42e813b3aa30"),
    Change(T + "save_checkpoint", WRAPS, "megagpt.resilience.checkpoint_integrity",
           "a shard overwritten in place keeps its length and loads as raw tensor bytes; the "
           "files' checksums, recorded after each persistent save, let a load tell a damaged "
           "checkpoint; outermost, so that the configuration snapshot is among the files "
           "hashed", PRETRAIN, "42e813b3aa30"),
    Change(T + "print_rank_last", WRAPS, "megagpt.run_log",
           "training_log prints its 300-character iteration line through it; the wrapper "
           "prints this entry's line from the same figures, with tokens/s, MFU and the time "
           "left, and records them for the run's plot; any other text passes", PRETRAIN,
           "888f2c02a721"),
    Change(T + "training_log", RELIES_ON, "megagpt.run_log.iteration_line",
           "the entry's iteration line is read from the one training_log builds: its fields "
           "are named and formatted there", PRETRAIN, "7e7ebec01bcf",
           needle="log_string += ' iteration {:8d}/{:8d} |'.format(iteration, args.train_iters)"),
    Change(T + "report_memory", REPLACES, "megagpt.run_log",
           "on the CPU torch.cuda's memory counters are all 0, and megatron reports them "
           "after the first iterations and around every save", "with --cpu, " + PRETRAIN,
           "471d75cba957"),
    Change("megatron.training.arguments._print_args", WRAPS, "megagpt.run_log.run_folder",
           "validate_args prints every argument (about 830 lines, most of a short run's log); "
           "the table goes to the run folder, and to the log with --print-arguments",
           "around megatron's validate_args in pretrain_gpt.main (run_log.argument_table_kept), "
           "undone after", "c69a5f5d3f0c"),
    Change("megatron.training.checkpointing.schedule_async_save", WRAPS,
           "megagpt.resilience.async_save",
           "an asynchronous save's request takes finalize functions only before it is "
           "scheduled (megatron freezes it); the configuration snapshot is one, written once "
           "the writer has finished", PRETRAIN + ", inside each asynchronous persistent save "
           "(resilience.config_snapshot)", "bdf6754425e0"),
    Change(T + "load_checkpoint", WRAPS, "megagpt.resilience.checkpoint_guard",
           "megatron reports a bad checkpoint with a stack trace from torch.distributed or a "
           "bare sys.exit(); the wrapper makes it one line naming the checkpoint", PRETRAIN,
           "ee0f61114e6f"),
    Change(T + "load_checkpoint", WRAPS, "megagpt.resilience.checkpoint_integrity",
           "megatron loads a damaged shard of the right length without noticing; the files "
           "are checked against their checksums first (a damaged checkpoint is set aside for "
           "the previous intact one), and the loaded weights for NaN and Inf after; outside "
           "the one-line errors' wrapper, which then names the checkpoint chosen here",
           PRETRAIN, "ee0f61114e6f"),
    Change("megatron.core.optimizer.optimizer.FP32Optimizer.load_state_dict", WRAPS,
           "megagpt.resilience.precision_change",
           "a checkpoint of megatron's bf16/fp16 optimizer keeps its parameter groups' settings "
           "one level down, where the fp32 optimizer (CPU mode, a launch without --bf16) does "
           "not look, and megatron stops on 'Could not find parameter group'; they are moved "
           "up first", PRETRAIN, "4e445929e714"),
    *(Change(f"{loader}.load_state_dict", WRAPS, "megagpt.resilience.optimizer_groups",
             "it loads the checkpoint's parameter groups with the checkpoint's keys only; "
             "saved by another install's inner optimizer (torch's AdamW), a group lacks a "
             "setting the running one reads in every step (apex's FusedAdam: KeyError "
             "'bias_correction' at the first step after the resume); the wrapper gives such a "
             "setting the running optimizer's own value", PRETRAIN, fingerprint,
             needle=needle)
      for loader, fingerprint, needle in (
          ("megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params",
           "23d536b83658", "self.optimizer.load_state_dict(state_dict[optimizer_key])"),
          ("megatron.core.optimizer.optimizer.FP32Optimizer", "4e445929e714", ""),
          ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", "707490502424",
           '{**param_groups_map[needed_groups], "params": inner_param_group[\'params\']}'))),
    Change(T + "train_step", WRAPS, "megagpt.resilience.divergence",
           "with megatron's in-step NaN checks off (the CUDA graph) a NaN or Inf gradient "
           "norm stops the run, read one iteration late so the check never idles the GPU",
           PRETRAIN + ", when the gradient-norm guard is on", "1823abf71532"),
    # --- diagnostics: hangs, stragglers, out of memory (megagpt.diagnostics) ------------------
    Change(T + "train_step", WRAPS, "megagpt.diagnostics.stragglers",
           "the step that ends each log interval is timed (the device synchronised at its "
           "start and end) for the straggler report; outside the divergence guard's wrapper, "
           "so its host read of the gradient norm counts in the step", DIAGNOSTICS,
           "1823abf71532"),
    Change(T + "finalize_model_grads", WRAPS, "megagpt.diagnostics.stragglers",
           "on the timed step, its start ends the forward and backward passes (a rank's "
           "compute) and its length is the gradient collectives (where a rank waits for the "
           "slowest)", DIAGNOSTICS, "3f44cc8723b8"),
    Change(T + "train", RELIES_ON, "megagpt.diagnostics.stragglers",
           "train() hands the schedule this module's finalize_model_grads when no other is "
           "set: the wrapper above is what the schedule calls", DIAGNOSTICS, "c8da3b7e0943",
           needle="config.finalize_model_grads_func = finalize_model_grads"),
    Change(T + "post_training_step_callbacks", WRAPS, "megagpt.diagnostics",
           "run after every iteration with its count: the collective timeout's warm-up and, at "
           "the log interval, the straggler report's all-gather", DIAGNOSTICS, "5cc914494319"),
    Change(T + "save_checkpoint", WRAPS, "megagpt.diagnostics.timeouts",
           "a save writes for as long as the file system needs between its collectives: it "
           "runs under the launch timeout, the tightened one comes back after; outermost, so "
           "the divergence guard's check runs under it too", DIAGNOSTICS, "42e813b3aa30"),
    Change("megatron.core.parallel_state.update_pg_timeout", RELIES_ON,
           "megagpt.diagnostics.timeouts",
           "sets the timeout of every process group megatron made (after a barrier)",
           DIAGNOSTICS, "6d470006602b", needle="_set_pg_timeout(timeout, group)"),
    Change("megatron.training.initialize._initialize_distributed", RELIES_ON,
           "megagpt.diagnostics.settings",
           "turns torch's flight recorder on from --flight-recorder-dump-path (dump path, "
           "buffer, dump on timeout, stack traces) before it creates the process groups; a "
           "directory gets the prefix _dump_, anything else is the prefix",
           "by the launch's writer (diagnostics.settings.choose_diagnostics), read by megatron at its "
           "process-group set-up", "e01f2e4468d6", needle="'TORCH_NCCL_DUMP_ON_TIMEOUT'"),
    Change("megatron.training.utils.utils.start_memory_history_recording", RELIES_ON,
           "megagpt.diagnostics.out_of_memory",
           "with --record-memory-history its out-of-memory observer writes "
           "<--memory-snapshot-path>_oom_rank-<rank>: the out-of-memory line names that file",
           DIAGNOSTICS, "72c39fbbc438", needle='filename = f"{base}_oom_rank-{rank}{ext}"'),
    Change(T + "initialize_megatron", WRAPS, "megagpt.cpu_mode",
           "it asserts CUDA unless allow_no_cuda=True, which pretrain does not pass",
           CPU_PRETRAIN, "1894d53ca729",
           needle='assert torch.cuda.is_available(), "Megatron requires CUDA."'),
    Change(T + "set_jit_fusion_options", REPLACES, "megagpt.cpu_mode",
           "it warms up GPU fusion kernels; on a CPU it is skipped (torch.compile is off in "
           "CPU mode)", CPU_PRETRAIN, "c1be95915ed4"),
    Change("megatron.core.datasets.utils.compile_helpers", REPLACES, "megagpt.compat",
           "initialize_megatron runs make on megatron/core/datasets, which the wheel ships "
           "without a Makefile (its helpers_cpp is prebuilt): make fails and the run exits; "
           "skipped only where helpers_cpp imports", LAUNCH, "02c160f0fa9c"),
    Change("megatron.core.tensor_parallel.layers.ColumnParallelLinear.__init__", WRAPS,
           "megagpt.compat",
           "with --gradient-accumulation-fusion (megatron's default) it refuses to be built "
           "unless apex's fused_weight_gradient_mlp_cuda imports, which TE does not provide: "
           "under TE's layers without apex (whose own layers fuse it) the output layer stopped "
           "every launch; built with the fusion off, it accumulates through autograd",
           LAUNCH + ", under TE's layers without apex", "ef7f6993d7de",
           needle="if config.gradient_accumulation_fusion and not _grad_accum_fusion_available"),
    Change("megatron.core.tensor_parallel.layers.RowParallelLinear.__init__", WRAPS,
           "megagpt.compat",
           "as ColumnParallelLinear: its backward needs apex's fused_weight_gradient_mlp_cuda "
           "when built with gradient-accumulation fusion; built with it off",
           LAUNCH + ", under TE's layers without apex", "a3ed8d3e583e",
           needle="self.gradient_accumulation_fusion = config.gradient_accumulation_fusion"),
    Change("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.sharded_state_dict",
           WRAPS, "megagpt.compat",
           "without TE/apex its state_dict() reads the step from torch's optimizer state, which "
           "an optimizer built to resume has not made yet (assert len(steps) == 1): every "
           "resume of a distributed-optimizer checkpoint stopped. A fresh optimizer asked for "
           "a state dict to load into first takes megatron's own dummy step "
           "(_init_optimizer_states_with_dummy_values); with TE or apex it is not installed",
           LAUNCH, "044b9c3b3b9a", needle="state_dict = self.state_dict()"),
    Change("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
           "_set_main_param_and_optimizer_states", WRAPS, "megagpt.compat",
           "loading, it copies the checkpoint's values into every tensor of a parameter's "
           "state, which for torch's optimizer includes the step the checkpoint keeps in the "
           "parameter groups (KeyError: 'step'), and into leaf tensors that require gradients "
           "outside no_grad (RuntimeError); the wrapper keeps the step and copies under "
           "no_grad; with TE or apex it is not installed",
           LAUNCH, "20b6b8ac2fd8", needle="dst_tensors[key].copy_(tensors[key])"),
    Change("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict",
           WRAPS, "megagpt.compat",
           "without TE/apex it gives every parameter's state one shared step tensor, which "
           "torch's AdamW then advances once per parameter per step: Adam's bias correction "
           "after a resume ran ahead of the uninterrupted run's. The wrapper gives each state "
           "its own copy; with TE or apex it is not installed",
           LAUNCH, "707490502424", needle='s["step"] = step'),
    Change("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
           "_init_optimizer_states_with_dummy_values", RELIES_ON, "megagpt.compat",
           "called before loading into a fresh distributed optimizer without TE/apex (above): "
           "one step on zero gradients, so that the state the load overwrites exists",
           LAUNCH, "f19e040b13b0"),
    Change("megatron.training.arguments.get_device_arch_version", REPLACES, "megagpt.arguments",
           "validate_args asks the GPU for its architecture when TP or CP > 1; a dry run or a "
           "CPU run answers with the planned GPU's (or 0)", VALIDATION, "076b134d5b1f"),
    # --- the optimizer without TE or apex (megagpt.train_step.optimizer) ----------------------------
    Change("megatron.core.optimizer.Adam", REPLACES, "megagpt.train_step.optimizer",
           "without TE/apex megatron takes torch's AdamW in its multi-pass foreach form; "
           "torch's fused=True AdamW is one kernel", FAST_LAUNCH + ", with the fast optimizer",
           "8a40ef85203f"),
    Change("megatron.core.optimizer.USING_PYTORCH_OPTIMIZER", REPLACES, "megagpt.train_step.optimizer",
           "set False with fused AdamW, so megatron passes it the fused optimizer's arguments",
           FAST_LAUNCH + ", with the fast optimizer", "e901a03a490f"),
    Change("megatron.core.optimizer.clip_grads.l2_norm_impl", REPLACES, "megagpt.train_step.optimizer",
           "megatron's local fallback reads one norm per tensor back to the host (hundreds of "
           "waits a step); torch._foreach_norm needs one",
           FAST_LAUNCH + ", with the fast optimizer", "27093e9af287"),
    Change("megatron.core.optimizer.clip_grads.multi_tensor_scale_impl", REPLACES,
           "megagpt.train_step.optimizer", "the local fallback scales tensor by tensor; "
           "torch._foreach_mul_ in a few kernels", FAST_LAUNCH + ", with the fast optimizer",
           "19c4e8618112"),
    Change("megatron.core.optimizer.clip_grads.multi_tensor_scale_tensor_impl", REPLACES,
           "megagpt.train_step.optimizer",
           "None without TE, so megatron brings the norm to the host to clip; TE's "
           "tensor-scale kernel in torch._foreach form keeps it on the GPU",
           FAST_LAUNCH + ", with the asynchronous step", "f2ef0c158231"),
    Change("megatron.core.optimizer.optimizer.multi_tensor_scale_impl", REPLACES,
           "megagpt.train_step.optimizer", "as clip_grads' (the optimizer module's own binding)",
           FAST_LAUNCH + ", with the fast optimizer", "19c4e8618112"),
    Change("megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that", REPLACES,
           "megagpt.train_step.optimizer",
           "for bf16 a Python loop of per-tensor copies of the master weights into the model "
           "weights; torch._foreach_copy_", FAST_LAUNCH + ", with the fast optimizer",
           "1c15b8061ac0"),
    Change("megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params."
           "_copy_model_grads_to_main_grads", REPLACES, "megagpt.train_step.optimizer",
           "one fp32 cast per parameter tensor (~300 kernels); one cast per gradient buffer",
           FAST_LAUNCH + ", with the fast optimizer", "fe8017bd890f"),
    # --- CPU mode where TE or apex is installed: megatron's own torch fallbacks (cpu_mode) -------
    Change("megatron.core.optimizer.Adam", REPLACES,
           "megagpt.cpu_mode",
           "TE's FusedAdam steps CUDA tensors only; torch's AdamW, megatron's own fallback",
           CPU_TE_KERNELS, "8a40ef85203f"),
    Change("megatron.core.optimizer.SGD", REPLACES,
           "megagpt.cpu_mode",
           "TE's FusedSGD likewise; torch's SGD",
           CPU_TE_KERNELS, "dc17bf751abe"),
    Change("megatron.core.optimizer.USING_PYTORCH_OPTIMIZER", REPLACES,
           "megagpt.cpu_mode",
           "True with torch's optimizers, so megatron passes them their arguments",
           CPU_TE_KERNELS, "e901a03a490f"),
    Change("megatron.core.optimizer.clip_grads.multi_tensor_applier", REPLACES,
           "megagpt.cpu_mode",
           "TE's multi-tensor kernel reads CUDA memory only (a CPU tensor is an illegal "
           "memory access on the GPU); megatron's local fallback",
           CPU_TE_KERNELS, "b93615652a38"),
    Change("megatron.core.optimizer.clip_grads.l2_norm_impl", REPLACES,
           "megagpt.cpu_mode",
           "TE's multi-tensor kernel reads CUDA memory only (a CPU tensor is an illegal "
           "memory access on the GPU); megatron's local fallback",
           CPU_TE_KERNELS, "27093e9af287"),
    Change("megatron.core.optimizer.clip_grads.multi_tensor_scale_impl", REPLACES,
           "megagpt.cpu_mode",
           "TE's multi-tensor kernel reads CUDA memory only (a CPU tensor is an illegal "
           "memory access on the GPU); megatron's local fallback",
           CPU_TE_KERNELS, "19c4e8618112"),
    Change("megatron.core.optimizer.clip_grads.multi_tensor_scale_tensor_impl", REPLACES,
           "megagpt.cpu_mode",
           "TE's multi-tensor kernel reads CUDA memory only (a CPU tensor is an illegal "
           "memory access on the GPU); megatron's local fallback",
           CPU_TE_KERNELS, "f2ef0c158231"),
    Change("megatron.core.optimizer.optimizer.multi_tensor_applier", REPLACES,
           "megagpt.cpu_mode",
           "TE's multi-tensor kernel reads CUDA memory only (a CPU tensor is an illegal "
           "memory access on the GPU); megatron's local fallback",
           CPU_TE_KERNELS, "2aff861f79ca"),
    Change("megatron.core.optimizer.optimizer.multi_tensor_scale_impl", REPLACES,
           "megagpt.cpu_mode",
           "TE's multi-tensor kernel reads CUDA memory only (a CPU tensor is an illegal "
           "memory access on the GPU); megatron's local fallback",
           CPU_TE_KERNELS, "19c4e8618112"),
    Change("megatron.training.utils.common_utils.multi_tensor_applier", REPLACES,
           "megagpt.cpu_mode",
           "TE's multi-tensor kernel reads CUDA memory only (a CPU tensor is an illegal "
           "memory access on the GPU); megatron's local fallback",
           CPU_TE_KERNELS, "5b95ab86582a"),
    Change("megatron.training.utils.common_utils.multi_tensor_l2norm", REPLACES,
           "megagpt.cpu_mode",
           "TE's multi-tensor kernel reads CUDA memory only (a CPU tensor is an illegal "
           "memory access on the GPU); megatron's local fallback",
           CPU_TE_KERNELS, "900df480fbd2"),
    # --- the full-iteration CUDA graph (megagpt.train_step.capture_watchdog) ---------------------
    Change("megatron.core.full_cuda_graph.FullCudaGraphWrapper.__call__", WRAPS,
           "megagpt.train_step.capture_watchdog",
           "a capture whose collectives wait for a peer that never joins blocks its process "
           "for good; the capturing iteration runs under a deadline that stops the run with "
           "one line naming the rank", FAST_LAUNCH + ", with the full-iteration graph",
           "53c96c89e211", needle="curr_iteration == self.cuda_graph_warmup_steps"),
    # --- megatron's DDP (megagpt.train_step.grad_write) -----------------------------------------
    Change(DDP + "_make_backward_post_hook", WRAPS, "megagpt.train_step.grad_write",
           "its hook adds each gradient into the buffer megatron zeroed; with one micro-batch "
           "per step and one data-parallel rank the hook copies instead",
           FAST_LAUNCH + ", with gradients written (the default where it applies)",
           "01aa652d523b"),
    Change(DDP + "zero_grad_buffer", WRAPS, "megagpt.train_step.grad_write",
           "it fills the whole gradient buffer with zeros every step (2.6 GB at 1.3B); where "
           "gradients are written it resets megatron's bookkeeping only (gradients are written "
           "while grad_write's wrappers are installed, process-wide as megatron's DDP methods "
           "are)",
           FAST_LAUNCH + ", with gradients written", "3e76d9a34a92"),
    Change(DDP + "finish_grad_sync", WRAPS, "megagpt.train_step.grad_write",
           "before any reduction, parameters that got no gradient this step are zeroed and "
           "the small gradients held back are copied together",
           FAST_LAUNCH + ", with gradients written", "2081a02efcfb"),
    # --- the fast layer spec: the project's modules in megatron's places -----------------------
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
           "megagpt.compat",
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
    # --- CPU mode ------------------------------------------------------------------------------
    Change("megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER", REPLACES,
           "megagpt.cpu_mode", "megatron's tracker forks CUDA generator states; CpuRngTracker "
           "forks the CPU generator's, saved and loaded with checkpoints as megatron's are",
           CPU_PRETRAIN, "94e958de6074"),
    Change("megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER_INITIALIZED", REPLACES,
           "megagpt.cpu_mode", "set with the CPU tracker, so megatron does not build its own",
           CPU_PRETRAIN, "95ac81d57dc3"),
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
    Change(T + "pretrain", COVERS, "megagpt.cpu_mode",
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
    Change("megatron.core.tensor_parallel.random._get_cuda_rng_state", REPLACES,
           "megagpt.cpu_mode",
           "activation recompute saves a CUDA generator state; in CPU mode a stand-in (the CPU "
           "generator's state, which dropout draws from here, is saved beside it)",
           CPU_PRETRAIN, "0c2b8f05b864",
           needle="torch.cuda.random.get_rng_state(device=device)"),
    Change("megatron.core.tensor_parallel.random._set_cuda_rng_state", REPLACES,
           "megagpt.cpu_mode",
           "activation recompute restores the CUDA generator state it saved; in CPU mode there "
           "is none to restore", CPU_PRETRAIN, "dea947ca0b7d"),
    Change("megatron.core.parallel_state.update_pg_timeout", COVERS, "megagpt.cpu_mode",
           "the collective timeout tightened after the warm-up (megagpt.diagnostics.timeouts) "
           "synchronises CUDA first: CPU mode's stand-in", CPU_PRETRAIN, "6d470006602b",
           needle="torch.cuda.synchronize()"),
    Change(T + "training_log", COVERS, "megagpt.cpu_mode",
           "--log-memory-to-tensorboard: torch.cuda.memory_stats reports zeros for the "
           "counters megatron logs", CPU_PRETRAIN, "7e7ebec01bcf",
           needle='mem_stats["reserved_bytes.all.current"]'),
    Change("megatron.training.initialize.initialize_megatron", COVERS, "megagpt.cpu_mode",
           "--async-save: the persistent checkpoint writer is forked, so it inherits CPU "
           "mode's stand-ins (a fork server's fresh interpreter has none)", CPU_PRETRAIN,
           "1894d53ca729", needle="init_persistent_async_worker(args.rank, 'forkserver')"),
    Change("megatron.core.dist_checkpointing.strategies.async_utils.PersistentAsyncCaller._get_process", REPLACES, "megagpt.cpu_mode",
           "it starts the writer by fork server or spawn; CPU mode's stand-ins reach it only "
           "in a forked process, so it forks", CPU_PRETRAIN, "d3c7da2097b2"),
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
    # --- tokenizers, globals, signals ----------------------------------------------------------
    Change("megatron.training.global_vars._GLOBAL_TOKENIZER", REPLACES, "megagpt.arguments",
           "megatron's GPT2BPETokenizer asks the HuggingFace hub for 'gpt2' even with local "
           "files; the global tokenizer is the project's, which loads them offline", GLOBALS,
           "eb0327eb5368"),
    Change("megatron.training.global_vars._GLOBAL_ARGS", REPLACES,
           "megagpt.preflight.schedule_check",
           "megatron's scheduler and sample counts read the run's arguments with get_args; "
           "the preflight runs them on the launch's arguments (or a copy) before megatron's "
           "globals are set, or without disturbing them", PREFLIGHT, "de64d38ea9a5"),
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


def entries_for(target: str) -> list[Change]:
    """The ledger's entries for ``target``, in ledger order."""
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
