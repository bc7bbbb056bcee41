"""Before loading: find the newest complete checkpoint, refuse bad ones in one line.

How megatron 0.19 writes a ``torch_dist`` checkpoint (``training/checkpointing.py``
``save_checkpoint``, ``core/dist_checkpointing/serialization.py`` ``save``):

1. every rank writes its shards (``__<rank>_<n>.distcp``) into ``iter_XXXXXXX/``;
2. the coordinator writes the global index ``.metadata`` (torch.distributed.checkpoint);
3. rank 0 writes ``metadata.json`` (backend and version), then all ranks meet at a barrier;
4. rank 0 rewrites ``latest_checkpointed_iteration.txt`` with the iteration (plain
   ``open(..., "w")``: neither atomic nor synced).

So the tracker moves only after the data is complete, but a ``kill -9`` can still leave:
a partial newest ``iter_`` directory (harmless to megatron, which follows the tracker, but
overwritten in place on the next save of that iteration); a complete directory the tracker
does not name yet (killed between 3 and 4); or an empty tracker (killed inside 4), which
megatron's ``read_metadata`` answers with ``sys.exit()`` and status 0. A directory is
*complete* here when ``metadata.json`` parses, ``.metadata`` parses, and every shard file
the index names exists and is long enough for its last byte range.

Rules applied by ``prepare_load`` (all ranks compute the same answer; rank 0 writes):

- The tracker's checkpoint is loaded when it is complete.
- Otherwise the newest complete checkpoint below it (any, if the tracker is missing or
  unreadable) is loaded instead (megatron's ``--ckpt-step``), with a logged line; in the
  run's own ``--save`` directory the tracker is rewritten atomically to name it.
- Directories newer than the one loaded are moved to ``<save>/.megagpt-set-aside/`` when
  ``--load`` is the ``--save`` directory (the resumed run will write those iterations again).
- ``--load`` with no checkpoint at all is an error, except when it is also the ``--save``
  directory: the usual "same command for the first launch and every resume" then starts
  fresh, and says so.
- A checkpoint with a ``megagpt_config.yaml`` is compared with this run: another model
  shape, tokenizer or vocabulary is an error naming each difference; so is another
  optimizer (the distributed optimizer's state and the plain one's do not load into each
  other) unless the run loads no optimizer state (``--no-load-optim``, ``--finetune``);
  another parallel layout is fine (the distributed format reshards) and is logged.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Callable

from megagpt import vocab_padding
from megagpt.errors import UserError
from megagpt.megatron_change import TRAINING, WRAPS, Change
from megagpt.resilience import config_snapshot

TRACKER = "latest_checkpointed_iteration.txt"
SET_ASIDE = ".megagpt-set-aside"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be resumed from; the message names the problem and the path."""


# ---------------------------------------------------------------------------
# Inspecting a checkpoint directory (no torch.distributed needed)
# ---------------------------------------------------------------------------

def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def saved_iterations(root: str) -> list[int]:
    """Iterations with an ``iter_XXXXXXX`` directory under ``root``, ascending."""
    if not os.path.isdir(root):
        return []
    found = (_ITER_DIR.match(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found
                  if m and os.path.isdir(os.path.join(root, m.group(0))))


def read_tracker(root: str) -> int | str | None:
    """The tracker's iteration, ``"release"``, ``None`` if absent; ValueError if unreadable."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return text
    if not text.isdigit():
        raise ValueError(f"{path}: {text[:40]!r} is not an iteration number")
    return int(text)


def write_tracker(root: str, iteration: int) -> None:
    """Replace the tracker atomically (a crash leaves the old one or the new one)."""
    path = os.path.join(root, TRACKER)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def incompleteness(ckpt_dir: str) -> str | None:
    """Why ``ckpt_dir`` is not a complete checkpoint, or None when it is."""
    if not os.path.isdir(ckpt_dir):
        return "the directory does not exist"
    legacy = [d for d in os.listdir(ckpt_dir) if d.startswith("mp_rank_")]
    if legacy and not os.path.exists(os.path.join(ckpt_dir, "metadata.json")):
        empty = [d for d in legacy
                 if not os.path.isfile(os.path.join(ckpt_dir, d, "model_optim_rng.pt"))
                 or os.path.getsize(os.path.join(ckpt_dir, d, "model_optim_rng.pt")) == 0]
        return f"{empty[0]}/model_optim_rng.pt is missing or empty" if empty else None
    try:
        with open(os.path.join(ckpt_dir, "metadata.json")) as f:
            json.load(f)
    except FileNotFoundError:
        return "metadata.json is missing (the save did not finish)"
    except (OSError, ValueError) as exc:
        return f"metadata.json is unreadable ({exc})"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(ckpt_dir).read_metadata()
    except FileNotFoundError:
        return ".metadata is missing (the save did not finish)"
    except Exception as exc:  # noqa: BLE001 - a truncated pickle raises anything
        return f".metadata is unreadable ({type(exc).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            return f"shard {name} is missing"
        size = os.path.getsize(path)
        if size < end:
            return f"shard {name} is truncated ({size} of at least {end} bytes)"
    return None


# ---------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadPlan:
    """What to load from ``root``: ``iteration`` None means start fresh."""

    root: str
    iteration: int | None
    reason: str
    tracker: int | str | None = None
    set_aside: tuple[int, ...] = ()


def _same_dir(a: str | None, b: str | None) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def plan_load(load: str, save: str | None) -> LoadPlan:
    """Choose the checkpoint to resume from under ``load`` (see the module docstring)."""
    resuming_own = _same_dir(load, save)
    try:
        tracker = read_tracker(load)
        tracker_problem = None
    except (OSError, ValueError) as exc:
        tracker, tracker_problem = None, str(exc)
    iterations = saved_iterations(load)
    if tracker == "release":
        return LoadPlan(load, None, "release checkpoint (left to megatron)", tracker)
    if tracker is None and not iterations and tracker_problem is None:
        if resuming_own:
            return LoadPlan(load, None, f"no checkpoint in {load} yet: starting from scratch "
                                        "(it is also --save; later launches resume from it)")
        what = "does not exist" if not os.path.exists(load) else \
            f"has no checkpoint (no {TRACKER}, no iter_* directories)"
        raise CheckpointError(f"--load {load} {what}; drop --load to start from scratch, "
                              "or give the --save directory of the run to resume")

    problems = {}
    if tracker is not None:
        problem = incompleteness(iteration_dir(load, tracker))
        if problem is None:
            newer = tuple(i for i in iterations if i > tracker)
            return LoadPlan(load, tracker, f"iteration {tracker}", tracker,
                            newer if resuming_own else ())
        problems[tracker] = problem
    ceiling = tracker if tracker is not None else float("inf")
    for candidate in sorted((i for i in iterations if i < ceiling), reverse=True):
        problem = incompleteness(iteration_dir(load, candidate))
        if problem is None:
            if tracker_problem:
                why = f"{TRACKER} is unreadable ({tracker_problem})"
            elif tracker is None:
                why = f"no {TRACKER}"
            else:
                why = f"iter_{tracker:07d} is incomplete: {problems[tracker]}"
            newer = tuple(i for i in iterations if i > candidate)
            return LoadPlan(load, candidate,
                            f"iteration {candidate}, the newest complete checkpoint ({why})",
                            tracker, newer if resuming_own else ())
        problems[candidate] = problem
    if tracker is None and tracker_problem is None and resuming_own:
        # Killed during the first save: nothing was ever completed; same as a first launch.
        return LoadPlan(load, None, f"no complete checkpoint in {load} yet: starting from "
                                    "scratch (it is also --save)", None, tuple(iterations))
    listed = "; ".join(f"iter_{i:07d}: {p}" for i, p in sorted(problems.items(), reverse=True))
    if tracker_problem:
        listed = f"{TRACKER}: {tracker_problem}" + (f"; {listed}" if listed else "")
    raise CheckpointError(f"--load {load}: no complete checkpoint to resume from ({listed})")


def compare_with_run(ckpt_dir: str, args) -> tuple[list[str], list[str]]:
    """(differences that forbid loading, layout changes) between a checkpoint and this run."""
    saved = config_snapshot.read(ckpt_dir)
    if saved is None:
        return [], []
    now = config_snapshot.entry_section(args, 0)
    blocking = []
    for section, label in (("model", "model"), ("tokenizer", "tokenizer")):
        for key, before in (saved.get(section) or {}).items():
            after = now[section].get(key)
            if after is None and section == "tokenizer":
                continue  # not given in this run: the tokenizer decides (padded size checked)
            if before != after:
                flag = "--" + key.replace("_", "-")
                message = f"{label} {flag} {before} there, {after} here"
                if key == "padded_vocab_size":
                    message += _vocab_padding_hint(saved, args)
                blocking.append(message)
    layout = []
    for key, before in (saved.get("layout") or {}).items():
        after = now["layout"].get(key)
        if before != after and key != "world_size":
            layout.append(f"{key.replace('_model_parallel_size', '').replace('_size', '')} "
                          f"{before}->{after}")
    return blocking, layout


def optimizer_state_mismatch(ckpt_dir: str, args) -> str | None:
    """Why the checkpoint's optimizer state cannot load into this run's optimizer (None when
    it can, when this run loads no optimizer state, or when the checkpoint does not say).

    megatron loads the plain optimizer's state only into the plain optimizer and the
    distributed optimizer's only into the distributed one (each way it fails deep in its
    loader: a bare AssertionError, a KeyError on a missing state key); the optimizer's
    algorithm has to match too; and the distributed optimizer's default checkpoint format
    (``dp_reshardable``) loads only under the same TP x PP (megatron says so after the model
    is built, advising a flag that does not change the format) and into buckets of the same
    parameter and gradient dtypes, by which it names them. The weights load in every case,
    with a fresh optimizer."""
    if getattr(args, "no_load_optim", False) or getattr(args, "finetune", False):
        return None
    snapshot = config_snapshot.read(ckpt_dir) or {}
    saved = snapshot.get("optimizer")
    if not isinstance(saved, dict):
        return None  # saved before the snapshot recorded its optimizer
    run = config_snapshot.entry_section(args, 0)
    now = run["optimizer"]
    differences = []
    if "use_distributed_optimizer" in saved and \
            bool(saved["use_distributed_optimizer"]) != bool(now["use_distributed_optimizer"]):
        with_ = lambda on: "with" if on else "without"  # noqa: E731
        differences.append(f"saved {with_(saved['use_distributed_optimizer'])} "
                           f"--use-distributed-optimizer, and this run is "
                           f"{with_(now['use_distributed_optimizer'])} it")
    if saved.get("optimizer") and now.get("optimizer") and saved["optimizer"] != now["optimizer"]:
        differences.append(f"--optimizer {saved['optimizer']} there, {now['optimizer']} here")
    if differences:
        return (f"--load {ckpt_dir}: its optimizer state does not load into this run's "
                f"optimizer ({'; '.join(differences)}): launch with the optimizer flags it was "
                f"saved with, or pass --no-load-optim to resume its weights with a fresh "
                f"optimizer")
    tp_pp = lambda d: (d.get("tensor_model_parallel_size") or 1,  # noqa: E731
                       d.get("pipeline_model_parallel_size") or 1)
    saved_tp_pp, run_tp_pp = tp_pp(snapshot.get("layout") or {}), tp_pp(run["layout"])
    by_bucket = _saved_by_bucket(saved) and now["use_distributed_optimizer"]
    saved_buffer, run_buffer = saved.get("gradient_buffer"), now.get("gradient_buffer")
    if by_bucket and saved_buffer and run_buffer and saved_buffer != run_buffer:
        # megatron names each bucket by its (parameter, gradient) dtypes and looks for this
        # run's names in the checkpoint: a KeyError or a bare AssertionError after the build
        return (f"--load {ckpt_dir}: the distributed optimizer saved its state by gradient "
                f"bucket (megatron's default format), its buckets {saved_buffer} "
                f"(parameters/gradients) there and {run_buffer} here (--grad-reduce-in-bf16 "
                f"keeps bf16 gradients; TE's and megatron's layers, several GPUs and the "
                f"fast path saving this format float32 ones): resume "
                f"it with the layers and gradients that saved it, or pass --no-load-optim to "
                f"resume its weights with a fresh optimizer (a run that saves with "
                f"--dist-ckpt-optim-fully-reshardable keeps the state by parameter, which "
                f"loads under other layers too)")
    if by_bucket and saved_tp_pp != run_tp_pp:
        return (f"--load {ckpt_dir}: its distributed optimizer's state was saved in megatron's "
                f"default format, which loads only under the TP x PP it was saved with "
                f"({saved_tp_pp[0]} x {saved_tp_pp[1]} there, {run_tp_pp[0]} x {run_tp_pp[1]} "
                f"here): resume under {saved_tp_pp[0]} x {saved_tp_pp[1]}, or pass "
                f"--no-load-optim to resume its weights with a fresh optimizer (a run that "
                f"saves with --dist-ckpt-optim-fully-reshardable can change its layout later)")
    return None


# the checkpoint formats in which megatron keeps the distributed optimizer's state by gradient
# bucket unless --dist-ckpt-optim-fully-reshardable is given
BUCKETED_FORMATS = ("torch_dist", "torch")


def saves_by_bucket(args) -> bool:
    """Whether this run saves its distributed optimizer's state by gradient bucket (megatron's
    default format, which names each bucket by its parameter and gradient dtypes)."""
    return bool(getattr(args, "use_distributed_optimizer", False) and getattr(args, "save", None)
                and not getattr(args, "dist_ckpt_optim_fully_reshardable", False)
                and getattr(args, "ckpt_format", "torch_dist") in BUCKETED_FORMATS)


def checkpoint_to_load(args) -> str | None:
    """The iteration folder a launch of ``args`` loads (``--load``, ``--ckpt-step`` or the
    newest complete checkpoint), None where it starts fresh or the folder cannot be told
    (``prepare_load`` says what is wrong with it once megatron has validated)."""
    if not getattr(args, "load", None):
        return None
    step = getattr(args, "ckpt_step", None)
    if step is not None:
        return iteration_dir(args.load, step)
    try:
        plan = plan_load(args.load, getattr(args, "save", None))
    except (CheckpointError, OSError, ValueError):
        return None
    return None if plan.iteration is None else iteration_dir(plan.root, plan.iteration)


def bucketed_gradient_buffer(args) -> tuple[str, str] | None:
    """(checkpoint folder, its "parameters/gradients" dtypes) of the checkpoint a resume of
    ``args`` loads, where that checkpoint keeps its distributed optimizer's state by gradient
    bucket (megatron's default format, which names each bucket by those dtypes) and this run
    loads it into the distributed optimizer; None otherwise, and where the checkpoint cannot
    be read (``prepare_load`` says what is wrong with it once megatron has validated)."""
    if (not getattr(args, "use_distributed_optimizer", False)
            or getattr(args, "no_load_optim", False) or getattr(args, "finetune", False)
            or getattr(args, "ckpt_format", "torch_dist") not in BUCKETED_FORMATS):
        return None
    ckpt_dir = checkpoint_to_load(args)
    if ckpt_dir is None:
        return None
    try:
        saved = (config_snapshot.read(ckpt_dir) or {}).get("optimizer")
    except (config_snapshot.SnapshotError, OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not _saved_by_bucket(saved) \
            or not saved.get("gradient_buffer"):
        return None
    return ckpt_dir, saved["gradient_buffer"]


def _saved_by_bucket(saved: dict) -> bool:
    """Whether a snapshot's optimizer section is the distributed optimizer's in megatron's
    default format (by gradient bucket); a snapshot older than the format's key does not say."""
    return bool(saved.get("use_distributed_optimizer")
                and "dist_ckpt_optim_fully_reshardable" in saved
                and not saved["dist_ckpt_optim_fully_reshardable"])


def _vocab_padding_hint(saved: dict, args) -> str:
    """Why the embedding's rows differ, and what resumes it: megatron pads the vocabulary
    to a multiple of --make-vocab-size-divisible-by x TP and loads only the same divisor
    and shape (megagpt.vocab_padding)."""
    model = saved.get("model") or {}
    saved_padded = model.get("padded_vocab_size")
    saved_tp = (saved.get("layout") or {}).get("tensor_model_parallel_size") or 1
    vocab = _tokenizer_vocab_size(args)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    divisor = (model.get("make_vocab_size_divisible_by")
               or getattr(args, "make_vocab_size_divisible_by", None)
               or vocab_padding.DEFAULT_DIVISOR)
    if not isinstance(saved_padded, int) or not vocab or saved_padded < vocab:
        return ""
    loads_under = vocab_padding.tensor_parallel_sizes_with(vocab, divisor, saved_padded)
    if not loads_under:
        return ""
    hint = (f" (megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by "
            f"x TP and loads only the same padding: this checkpoint, divisor {divisor}, loads "
            f"under TP {', '.join(map(str, loads_under))}")
    across = vocab_padding.divisor_for(vocab, (saved_tp, tp)) if saved_tp != tp else None
    if across:
        hint += (f"; a run meant to move between TP {saved_tp} and {tp} needs "
                 f"--make-vocab-size-divisible-by {across} from its first launch")
    return hint + ")"


def _tokenizer_vocab_size(args):
    """The tokenizer's own vocabulary size (before padding), where it is known (megatron
    pads the tokenizer's size, which for its NullTokenizer is --vocab-size + 1)."""
    try:
        from megatron.training.global_vars import get_tokenizer

        return int(get_tokenizer().vocab_size)
    except Exception:  # noqa: BLE001 - no tokenizer installed (a unit test): --vocab-size
        return int(args.vocab_size) if getattr(args, "vocab_size", None) else None


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _set_aside(root: str, iterations: tuple[int, ...], log) -> None:
    if not iterations or not _rank0():
        return
    target = os.path.join(root, SET_ASIDE)
    os.makedirs(target, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in iterations:
        src = iteration_dir(root, i)
        if os.path.isdir(src):
            shutil.move(src, os.path.join(target, f"iter_{i:07d}-{stamp}"))
    names = ", ".join(f"iter_{i:07d}" for i in iterations)
    log(f"resume: moved {names} (newer than the checkpoint loaded) to {target}")


# TE's attention keeps FP8 metadata as extra state, saved under this name; megatron's local
# attention and the fast spec's keep none (their linears' extra-state entries are saved
# under the same names as TE's linears')
TE_ATTENTION_STATE = "self_attention.core_attention._extra_state"


def saved_without_te_attention(ckpt_dir: str) -> bool:
    """Whether a distributed checkpoint was saved by a model without TE's attention (the
    fast spec, megatron's local spec): its ``.metadata`` holds no TE attention state."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    return not any(TE_ATTENTION_STATE in key for key in keys)


def load_into_te_layers(ckpt_dir: str, args, given: frozenset[str],
                        log: Callable[[str], None]) -> dict[str, object]:
    """Resuming a checkpoint saved without TE's layers under TE's layers: TE's attention asks
    for its extra state, which the checkpoint does not hold, and megatron's default
    ``--dist-ckpt-strictness assume_ok_unexpected`` lets the read fail on it. With
    ``log_unexpected`` megatron drops what the checkpoint lacks from the request (and logs
    it); the attention's FP8 metadata then starts afresh, every weight loads. Returns the
    argument to write (none: ``{}``); ``given``: the launch's explicit flags."""
    if (getattr(args, "transformer_impl", None) != "transformer_engine"
            or getattr(args, "ckpt_format", None) != "torch_dist"
            or "--dist-ckpt-strictness" in given
            or not saved_without_te_attention(ckpt_dir)):
        return {}
    log(f"resume: {ckpt_dir} was saved without Transformer Engine's layers; their attention's "
        "FP8 metadata starts afresh (--dist-ckpt-strictness log_unexpected)")
    return {"dist_ckpt_strictness": "log_unexpected"}


# Transformer Engine (2.20 and later) refuses to unpickle the delayed-scaling FP8 state its
# layers saved unless this is "1" (transformer_engine/pytorch/_extra_state.py)
TE_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
TE_PICKLE_REFUSAL = "Refusing to load pickled Transformer Engine extra state"


def te_refuses_pickled_state() -> bool:
    """Whether the installed Transformer Engine refuses pickled extra state by default (read
    from its source, without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or not spec.submodule_search_locations:
        return False
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "pytorch", "_extra_state.py")
        try:
            with open(path) as f:
                if TE_UNSAFE_PICKLE_ENV in f.read():
                    return True
        except OSError:
            continue
    return False


def te_pickled_state_advice(where: str) -> str:
    """The one line for a checkpoint whose TE FP8 state TE will not unpickle."""
    return (f"{where} holds Transformer Engine's delayed-scaling FP8 state (scales and amax "
            "history) as a Python pickle, and Transformer Engine unpickles it only with "
            f"{TE_UNSAFE_PICKLE_ENV}=1 in the environment, since unpickling can run code. Set "
            "it for a checkpoint you trust, such as your own run's; or resume with the fast "
            "spec's FP8 or in bf16 (drop --transformer-impl transformer_engine): every weight "
            "loads and the FP8 scales start afresh")


def te_pickled_state_refusal(ckpt_dir: str, args) -> str | None:
    """Why this run's TE layers would refuse the checkpoint's pickled FP8 state (None: they
    would not), read from the checkpoint's snapshot before the model is built."""
    if getattr(args, "transformer_impl", None) != "transformer_engine":
        return None  # the fast spec and megatron's local layers do not read TE's state
    saved = config_snapshot.read(ckpt_dir)
    if not saved or not saved.get("te_pickled_fp8_state"):
        return None
    if os.environ.get(TE_UNSAFE_PICKLE_ENV) == "1" or not te_refuses_pickled_state():
        return None
    return te_pickled_state_advice(f"--load {ckpt_dir}")


def prepare_load(args, given: frozenset[str], log: Callable[[str], None]) -> dict[str, object]:
    """Check ``--load`` against the validated arguments, set aside what the resumed run will
    write again, and return megatron's arguments that point it at the checkpoint to resume
    from (``--ckpt-step``, ``--dist-ckpt-strictness``; none: ``{}``); the launch writes them
    (``megagpt.launch.writer.after_validation``). ``given``: the launch's explicit flags."""
    if not args.load or args.ckpt_format not in ("torch_dist", "torch"):
        return {}
    if args.ckpt_step:
        return {}  # the user chose an iteration; megatron loads exactly that one
    plan = plan_load(args.load, args.save)
    if plan.iteration is None:
        _set_aside(plan.root, plan.set_aside, log)
        log(f"resume: {plan.reason}")
        return {}
    ckpt_dir = iteration_dir(plan.root, plan.iteration)
    try:
        blocking, layout = compare_with_run(ckpt_dir, args)
        optimizer = optimizer_state_mismatch(ckpt_dir, args)
    except config_snapshot.SnapshotError as exc:
        if not _has_checksums(ckpt_dir):
            raise CheckpointError(f"--load {ckpt_dir}: {exc}") from None
        # the checksums name the damage when megatron is about to load, and a checkpoint
        # before it loads instead (checkpoint_integrity)
        log(f"resume: {exc}; not compared with this run")
        blocking, layout, optimizer = [], [], None
    if blocking:
        raise CheckpointError(f"--load {ckpt_dir} was saved for another model: "
                              + "; ".join(blocking))
    if optimizer:
        raise CheckpointError(optimizer)
    pickled = te_pickled_state_refusal(ckpt_dir, args)
    if pickled:
        raise CheckpointError(pickled)
    writes = load_into_te_layers(ckpt_dir, args, given, log)
    if plan.tracker != plan.iteration:
        writes["ckpt_step"] = plan.iteration  # what megatron loads; the tracker is only
        # repaired in our own --save directory, or where megatron could not read it at all.
        if _rank0() and (_same_dir(args.load, args.save) or plan.tracker is None):
            try:
                write_tracker(plan.root, plan.iteration)
            except OSError as exc:
                raise CheckpointError(f"{os.path.join(plan.root, TRACKER)} names no complete "
                                      f"checkpoint and cannot be rewritten ({exc}); pass "
                                      f"--ckpt-step {plan.iteration}") from None
    _set_aside(plan.root, plan.set_aside, log)
    log(f"resume: loading {ckpt_dir} ({plan.reason})")
    if layout:
        log("resume: parallel layout changed (" + ", ".join(layout)
            + "); the distributed checkpoint format reshards on load")
    return writes


def _has_checksums(ckpt_dir: str) -> bool:
    from megagpt.resilience.checksums import MANIFEST

    return os.path.isfile(os.path.join(ckpt_dir, MANIFEST))


def resume_hint(args) -> str:
    """Which checkpoint a relaunch would resume from, as a sentence."""
    if not args.save:
        return "Nothing is saved (no --save)."
    complete = [i for i in reversed(saved_iterations(args.save))
                if incompleteness(iteration_dir(args.save, i)) is None]
    if not complete:
        return f"{args.save} has no complete checkpoint yet."
    return f"The newest checkpoint, {iteration_dir(args.save, complete[0])}, is untouched."


# ---------------------------------------------------------------------------
# Errors raised while megatron loads
# ---------------------------------------------------------------------------

def _hint(cause: BaseException) -> str:
    """What to do about a failure megatron explains in its own terms."""
    if "OptimizerParamScheduler" in str(cause) and "do not match" in str(cause):
        # megatron compares the schedule of this launch with the checkpoint's, in samples
        return ("; this launch's learning-rate schedule (--train-iters, --lr-decay-iters, "
                "--lr-warmup-iters, ... in samples) differs from the checkpoint's: add "
                "--override-opt_param-scheduler to take this launch's, or "
                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    text = str(cause)
    if _buckets_differ(cause, text):
        return ("; the distributed optimizer saved its state by gradient bucket, and this "
                "launch's parameters fill the buckets otherwise (other layers: Transformer "
                "Engine's, the fast spec's or megatron's local ones, or another layout): "
                "resume with the layers and layout that saved it, or add --no-load-optim to "
                "load the weights alone (the optimizer's state then starts afresh); a run "
                "that saves with --dist-ckpt-optim-fully-reshardable keeps the state by "
                "parameter, which loads under other layers too")
    return ""


def _buckets_differ(cause: BaseException, text: str) -> bool:
    """megatron's distributed optimizer keys its default format by gradient bucket and by
    (parameter, gradient) dtype, and fails in two ways where this launch fills its buckets
    otherwise: a KeyError on a bucket the checkpoint lacks (TE's norms live inside its
    linears, the fast spec's beside them), and an AssertionError where the buckets hold as
    many elements under another gradient dtype (the fast path's bf16 gradient buffer
    against TE's float32 one)."""
    if isinstance(cause, KeyError):
        return "optimizer.distributed." in text and "bucket_idx" in text
    return isinstance(cause, AssertionError) and "unpadded elements in each bucket" in text


def _root_cause(exc: BaseException) -> BaseException:
    """torch.distributed.checkpoint wraps each rank's error in a CheckpointException
    (a BaseException) whose ``failures`` map ranks to the original exceptions."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            return first[0]  # (exception, traceback summary)
        return getattr(first, "exception", first)
    return exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


LOAD_CHECKPOINT = Change(
    TRAINING + "load_checkpoint", WRAPS, __name__,
    does="a checkpoint that does not load is one line naming it",
    why="megatron reports a bad checkpoint with a stack trace from torch.distributed or a bare "
        "sys.exit()",
    fingerprint="ee0f61114e6f")
SAVE_CHECKPOINT = Change(
    TRAINING + "save_checkpoint", WRAPS, __name__,
    does="a save the file system refuses is one line naming the iteration, the folder and the "
         "newest checkpoint that stays",
    why="a save the file system refuses (folder gone, disk full) fails with a stack trace from "
        "torch.distributed.checkpoint; innermost",
    fingerprint="42e813b3aa30")
MEGATRON_CHANGES = (SAVE_CHECKPOINT, LOAD_CHECKPOINT)


def one_line_load_errors(load_checkpoint, args):
    """Wrap megatron's ``load_checkpoint``: failures become a ``CheckpointError``.

    Megatron reports a bad checkpoint with a stack trace from deep in torch.distributed
    (shape mismatch, unreadable shard) or with a bare ``sys.exit()`` (RNG state missing).
    """

    @functools.wraps(load_checkpoint)
    def wrapper(*a, **kw):
        where = args.load
        if args.ckpt_step:
            where = iteration_dir(args.load, args.ckpt_step)
        else:
            try:
                tracker = read_tracker(args.load) if args.load else None
            except (OSError, ValueError):
                tracker = None
            if isinstance(tracker, int):
                where = iteration_dir(args.load, tracker)
        try:
            return load_checkpoint(*a, **kw)
        except SystemExit as exc:
            raise CheckpointError(f"cannot load checkpoint {where}: megatron gave up "
                                  f"(exit status {exc.code}); see the lines above") from None
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure here is about the checkpoint
            cause = _root_cause(exc)
            if TE_PICKLE_REFUSAL in str(cause):
                # TE's own text is longer than a line, the variable to set at its end
                raise CheckpointError("cannot load checkpoint: "
                                      + te_pickled_state_advice(where)) from exc
            raise CheckpointError(f"cannot load checkpoint {where}: {type(cause).__name__}: "
                                  f"{_first_line(cause)}{_hint(cause)}") from exc

    wrapper._megagpt_original = load_checkpoint
    return wrapper


def one_line_save_errors(save_checkpoint, args):
    """Wrap megatron's ``save_checkpoint``: a file-system error (the folder gone or turned
    into a file, the disk full, no permission) becomes a ``CheckpointError`` naming the
    iteration, the folder and the newest checkpoint that stays, rather than a stack trace
    from deep in torch.distributed.checkpoint. The partial folder is left for the next
    launch, which sets it aside (``prepare_load``); megatron's tracker still names the newest
    complete save."""

    @functools.wraps(save_checkpoint)
    def wrapper(iteration, *a, **kw):
        try:
            return save_checkpoint(iteration, *a, **kw)
        except (KeyboardInterrupt, GeneratorExit, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - sorted below: only the file system's
            cause = _root_cause(exc)
            if not isinstance(cause, OSError) or isinstance(cause, ConnectionError):
                raise  # (a connection's error is a collective's: diagnostics says which)
            try:
                kept = read_tracker(args.save)
            except (OSError, ValueError):
                kept = None
            stays = (f"the newest checkpoint is still {iteration_dir(args.save, kept)}"
                     if isinstance(kept, int) else "no earlier checkpoint was saved there")
            raise CheckpointError(f"cannot save the checkpoint of iteration {iteration} to "
                                  f"{args.save}: {type(cause).__name__}: {_first_line(cause)}; "
                                  f"{stays}") from exc

    wrapper._megagpt_original = save_checkpoint
    return wrapper
