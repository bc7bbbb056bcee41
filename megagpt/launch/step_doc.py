"""``docs/step.md``: what one iteration runs, in order, written from the launch's table of
megatron changes (``megatron_changes.PIECES``) for three launches: the default one-GPU
launch, eight GPUs of data parallelism, and ``--cpu``.

    python -m megagpt.launch.step_doc          # writes docs/step.md (make step-doc)
    python -m megagpt.launch.step_doc --check  # exit status 1 where docs/step.md differs

Each launch is resolved as its command line would be on a machine with neither Transformer
Engine nor apex (``EXAMPLES``); what it enters comes from the table alone
(``megatron_changes.entered``), so the page is the same on every machine.
``tests/test_step_table.py`` holds the committed page against ``render()``, and what the
pieces really install against the table.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from megagpt.compat import Installed
from megagpt.megatron_change import REPLACES, Change

from . import megatron_changes
from .plan import Launch
from .resolution import resolve

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "step.md"

NEITHER_TE_NOR_APEX = Installed(transformer_engine=False, apex=False, fused_layer_norm=False,
                                masked_softmax_kernels=False,
                                gradient_accumulation_kernels=False)

# What torchrun sets for each process, and what megatron's parser reads of it.
LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Example:
    """One launch of the page: its command line, as run, and the environment it starts in."""

    title: str
    command: str  # as a user types it (paths relative to the repository)
    argv: tuple[str, ...]  # pretrain_gpt.py's arguments; configs/ paths relative to REPO
    environ: tuple[tuple[str, str], ...] = ()  # the launcher's variables
    where: str = "neither Transformer Engine nor apex installed"

    def resolved(self, installed: Installed = NEITHER_TE_NOR_APEX) -> Launch:
        """The launch, as ``pretrain_gpt.py`` resolves this command line with ``installed``
        (megatron's parser reads the launcher's variables from the process's environment:
        they are set for the call, and put back after)."""
        argv = [str(REPO / a) if a.startswith("configs/") else a for a in self.argv]
        with _launcher_environment(dict(self.environ)):
            return resolve(argv, installed=installed, environ=dict(self.environ))


EIGHT_GPUS = (("WORLD_SIZE", "8"), ("RANK", "0"), ("LOCAL_RANK", "0"),
              ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"))

EXAMPLES: tuple[Example, ...] = (
    Example("One GPU, the default launch",
            "python pretrain_gpt.py --config configs/gpt2_345m.yaml --mock-data",
            ("--config", "configs/gpt2_345m.yaml", "--mock-data"),
            where="one GPU, neither Transformer Engine nor apex installed"),
    Example("Eight GPUs, data parallel",
            "torchrun --nproc-per-node 8 pretrain_gpt.py --config configs/gpt2_345m.yaml "
            "--mock-data",
            ("--config", "configs/gpt2_345m.yaml", "--mock-data"), EIGHT_GPUS,
            where="eight GPUs of one node (rank 0's view), neither Transformer Engine nor "
                  "apex installed"),
    Example("On the CPU",
            "python pretrain_gpt.py --config configs/tiny.yaml --cpu",
            ("--config", "configs/tiny.yaml", "--cpu"),
            where="no GPU, neither Transformer Engine nor apex installed"),
)


@contextlib.contextmanager
def _launcher_environment(environ: Mapping[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    try:
        for name in LAUNCHER_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(environ)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# --- the page ---------------------------------------------------------------------------------

INTRO = """\
# What one iteration runs, in order

What a launch of yours decides (its layers, graphs, optimizer, FP8 and each reason) the dry run
prints; this page is what one iteration then runs inside megatron, for three launches:

```bash
python pretrain_gpt.py --config configs/gpt2_345m.yaml --mock-data --dry-run
```

<!-- Written by `make step-doc` (python -m megagpt.launch.step_doc) from the launch's table,
megagpt/launch/megatron_changes.py, and the records beside each change: edit those, not this
page. -->

One iteration is megatron's training loop (`megatron.training.training.train`) with the
launch's changes in place. The launch enters them as the pieces of one context around
`megatron.training.pretrain`, in the order of its table (`megagpt/launch/megatron_changes.py`),
and takes them off when `pretrain` returns. Each change is a record beside the code that makes
it (`megagpt.megatron_change.Change`, in its module's `MEGATRON_CHANGES`); the table says when
each piece and each change applies. Where several changes wrap one megatron function, the one
installed first is innermost (`megagpt/megatron_wrappers.py`): below, each function's changes
are listed outermost first, the order in which megatron's call runs through them.
`tests/test_step_table.py` fails when this page, or what the pieces install when they are
entered, differs from the table.

Outside this context the project changes megatron only around one call (megatron's
`validate_args` where no GPU answers, the preflight's schedule check, the scheduling of an
asynchronous save, the tools' generation on the CPU, megatron's global tokenizer):
`megagpt.megatron_ledger` lists those with everything else.
"""


def _number(change: Change) -> int:
    return megatron_changes.CHANGES.index(change) + 1


def _link(change: Change) -> str:
    return f"[#{_number(change)}](#change-{_number(change)})"


def _how(change: Change) -> str:
    return "replaced" if change.how == REPLACES else "wrapped"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _piece_link(index: int, name: str) -> str:
    return f"[{index}. {name}](#piece-{index})"


def _table() -> list[str]:
    lines = ["## The table", "",
             "Every piece, in the order it is entered, and every change it can make, in the "
             "order it makes them.", ""]
    for index, piece in enumerate(megatron_changes.PIECES, 1):
        lines += [f"### <a id=\"piece-{index}\"></a>{index}. {piece.name} (`{piece.owner}`)",
                  "", f"{_sentence(piece.does)}. **When:** {piece.when.text}. "
                  f"**Here:** {piece.order}.", ""]
        for change, when in piece.changes:
            also = f" — {when.text}" if when is not megatron_changes.ALWAYS else ""
            marker = f"{_number(change)}. "
            lines += [f"{marker}<a id=\"change-{_number(change)}\"></a>"
                      f"`{change.target}` {_how(change)} by `{change.owner}`{also}",
                      f"{' ' * len(marker)}- does: {change.does}",
                      f"{' ' * len(marker)}- why: {change.why}"]
        lines += [""] if piece.changes else ["No megatron attribute changes.", ""]
    return lines


def _entered(example: Example) -> list[str]:
    launch = example.resolved()
    entered = megatron_changes.entered(launch, bool(launch.arg("cpu")))
    pieces = {piece.name: changes for piece, changes in entered}
    lines = [f"## {example.title}", "", f"`{example.command}`: {example.where}.", "",
             "Entered, in order:", ""]
    for index, piece in enumerate(megatron_changes.PIECES, 1):
        if piece.name not in pieces:
            continue
        left = [change for change, _ in piece.changes if change not in pieces[piece.name]]
        note = (f" (not {', '.join(_link(c) for c in left)}: "
                f"{'; '.join(dict.fromkeys(w.text for c, w in piece.changes if c in left))})"
                if left else "")
        lines.append(f"- {_piece_link(index, piece.name)}{note}")
    skipped = [f"{_piece_link(index, piece.name)} ({piece.when.text})"
               for index, piece in enumerate(megatron_changes.PIECES, 1)
               if piece.name not in pieces]
    lines += ["", "Not entered: " + ("; ".join(skipped) if skipped else "none") + ".", "",
              "What megatron's call of each function runs through, outermost first (the "
              "functions in the order the table first changes them):", ""]
    made = [change for _, changes in entered for change in changes]
    for target in dict.fromkeys(change.target for change in made):
        lines.append(f"- `{target}`")
        replaced = False
        for step, change in enumerate(reversed([c for c in made if c.target == target]), 1):
            under = " (under the replacement above: not reached)" if replaced else ""
            lines.append(f"  {step}. `{change.owner}` {change.how} it {_link(change)}: "
                         f"{change.does}{under}")
            replaced = replaced or change.how == REPLACES
        lines.append(f"  {step + 1}. megatron's own"
                     + (" (under the replacement above: not reached)" if replaced else ""))
    return lines + [""]


def render() -> str:
    """The page, as the table and the records say it now."""
    lines = [INTRO, *_table()]
    for example in EXAMPLES:
        lines += _entered(example)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    page = render()
    if "--check" in argv:
        same = PAGE.exists() and PAGE.read_text() == page
        if not same:
            print(f"{PAGE.relative_to(REPO)} differs from the table: run make step-doc",
                  file=sys.stderr)
        return 0 if same else 1
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    from megagpt.compat import quiet_fallback_warnings

    quiet_fallback_warnings()
    raise SystemExit(main())
