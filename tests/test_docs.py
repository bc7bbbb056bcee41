"""The manual works: every relative link of the pages resolves (files and #anchors), every
command in a page's bash blocks names a script, module, console script or make target that
exists and only flags its script takes, and the user's pages keep their shape (README.md at
most 150 lines, each task page opening with its task and its command, no commit hashes, no
dates outside the README's one "measured on" line)."""

import functools
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from helpers import REPO

USER_PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
CONTRIBUTOR_PAGES = ["CONTRIBUTING.md", "bench/README.md"]
# pages whose links must resolve, beyond those: the lab's notes and generated tables
LINKED_PAGES = [*USER_PAGES, *CONTRIBUTOR_PAGES, "bench/benchmarks.md",
                *sorted(str(p.relative_to(REPO)) for p in (REPO / "bench").rglob("*.md")
                        if p.name != "benchmarks.md" and p.parent != REPO / "bench")]
COMMAND_PAGES = [*USER_PAGES, *CONTRIBUTOR_PAGES]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def text_of(page: str) -> str:
    return (REPO / page).read_text()


def prose(text: str) -> str:
    """``text`` without its fenced blocks and inline code (links there are not links)."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def anchor(title: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, markdown and punctuation dropped
    (letters, digits, '-', '_' and spaces stay), spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link keeps its text
    text = text.replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors_of(page: str) -> set[str]:
    """The anchors GitHub makes for ``page``'s headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    text = FENCE.sub("", text_of(page))
    out = set(re.findall(r'<a (?:id|name)="([^"]+)"', text))  # explicit anchors GitHub keeps
    for line in text.splitlines():
        m = re.match(r"^#{1,6} +(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = anchor(m.group(1))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links_of(page: str) -> list[str]:
    return [a or b for a, b in LINK.findall(prose(text_of(page)))]


def broken_links(page: str) -> list[str]:
    problems = []
    folder = (REPO / page).parent
    for target in links_of(page):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        if path:
            resolved = (folder / path).resolve()
            if not resolved.exists():
                problems.append(f"{target}: no such file")
                continue
            if REPO.resolve() not in resolved.parents:
                problems.append(f"{target}: outside the repository")
                continue
            linked = str(resolved.relative_to(REPO.resolve()))
        else:
            resolved, linked = REPO / page, page
        if fragment and resolved.suffix == ".md" and fragment not in anchors_of(linked):
            problems.append(f"{target}: no heading with that anchor")
    return problems


def test_the_anchors_are_githubs():
    """The anchor rule on headings whose anchors GitHub is known to make."""
    assert anchor("Attention backends (`--attention-backend`)") == \
        "attention-backends---attention-backend"
    assert anchor("What a user of NVIDIA's containers gets") == \
        "what-a-user-of-nvidias-containers-gets"
    assert anchor("Several GPUs: what the dry run predicts (estimates, not measured)") == \
        "several-gpus-what-the-dry-run-predicts-estimates-not-measured"


@pytest.mark.parametrize("page", LINKED_PAGES)
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"{page}: {broken_links(page)}"


def test_a_broken_link_or_anchor_is_found(tmp_path, monkeypatch):
    """The check itself: a missing file, a missing anchor and a good link of a page."""
    import test_docs

    page = REPO / "docs" / "a_page_for_the_test.md"
    monkeypatch.setattr(test_docs, "text_of", lambda p: (
        "# A page\n\n## Its section\n\n[ok](#its-section) [bad](#no-such) "
        "[gone](no_such_file.md) [readme](../README.md)\n" if p == str(page.relative_to(REPO))
        else (REPO / p).read_text()))
    anchors_of.cache_clear()
    try:
        found = test_docs.broken_links(str(page.relative_to(REPO)))
    finally:
        anchors_of.cache_clear()
    assert found == ["#no-such: no heading with that anchor", "no_such_file.md: no such file"]


# ---------------------------------------------------------------------------------------
# the pages the code names
# ---------------------------------------------------------------------------------------
CODE = ["pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "Makefile", "pyproject.toml",
        *(str(p.relative_to(REPO)) for folder in ("megagpt", "tools", "bench", "tests",
                                                   "examples", "scripts", "configs")
          for p in sorted((REPO / folder).rglob("*"))
          if p.suffix in (".py", ".sh", ".sbatch", ".yaml") and "figures" not in p.parts)]
# a page of docs/ or bench/ named in the code (not git's COMMIT:path of an old one)
PAGE_PATH = re.compile(r"(?<![\w:/.-])((?:docs|bench)/[\w/.-]*?\.md)\b")


def test_every_page_the_code_names_exists():
    """Comments, docstrings and messages cite pages (``docs/fp8.md``, ``bench/notes/...``):
    a page moved or renamed leaves none of them pointing at nothing."""
    assert PAGE_PATH.findall("(docs/fp8.md, \"FP8\"); git show 5883aa4:docs/old.md") == \
        ["docs/fp8.md"]
    missing = [f"{path}: {page}" for path in CODE
               for page in PAGE_PATH.findall((REPO / path).read_text(errors="replace"))
               if not (REPO / page).is_file()]
    assert not missing, "\n".join(missing)


# ---------------------------------------------------------------------------------------
# the shape of the user's pages
# ---------------------------------------------------------------------------------------
HASH = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/-])")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_the_readme_is_a_front_door():
    lines = text_of("README.md").splitlines()
    assert len(lines) <= 150, len(lines)
    assert lines[0].startswith("# ")
    # the two set-up commands come first
    first_block = FENCE.search(text_of("README.md")).group(2).splitlines()
    assert [line.split("#")[0].strip() for line in first_block[:2]] == ["make demo", "make test"]
    dated = [line for line in lines if DATE.search(line)]
    assert len(dated) <= 1 and all(line.startswith("TFLOP/s per GPU") for line in dated), dated


@pytest.mark.parametrize("page", [p for p in USER_PAGES if p != "README.md"])
def test_a_task_page_states_its_task_then_gives_its_command(page):
    text = text_of(page)
    title = text.splitlines()[0]
    assert title.startswith("# ") and len(title) > 8, title
    after = text[len(title):].lstrip("\n")
    # at most a short paragraph before the command
    fence = after.index("```bash\n")
    assert after[:fence].count("\n") <= 4, after[:fence]
    assert not DATE.search(text), DATE.findall(text)


@pytest.mark.parametrize("page", USER_PAGES)
def test_no_commit_hashes_on_the_users_pages(page):
    assert not HASH.findall(text_of(page)), HASH.findall(text_of(page))


def test_the_hash_pattern_finds_commits_not_words():
    assert HASH.findall("measured at 0c9d8bf (and c5b75dd)") == ["0c9d8bf", "c5b75dd"]
    assert not HASH.findall("a decade, 1234567 tokens, e4m3, bench/f393d09d.csv, deadbeef")


# ---------------------------------------------------------------------------------------
# the commands of the pages' bash blocks
# ---------------------------------------------------------------------------------------
def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.-]*):", (REPO / "Makefile").read_text(), re.M))


def console_scripts() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project.get("scripts", {})


def commands_of(block: str) -> list[list[str]]:
    """The simple commands of a bash block: continuation lines joined, comments dropped,
    split at ``&&``, ``||``, ``;`` and ``|``; each as its words."""
    text = block.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words, current = list(lexer), []
        for word in words:
            if word in (";", "&&", "||", "|", "&"):
                out.append(current)
                current = []
            else:
                current.append(word)
        out.append(current)
    return [c for c in out if c]


PYTHONS = ("python", "python3", ".venv/bin/python")
SHELLS = ("bash", "sh", "source", ".")
LAUNCHERS = ("torchrun", ".venv/bin/torchrun", "sbatch")


def what_runs(words: list[str]) -> tuple[str, list[str], list[str]] | None:
    """(what, its help command, the words it is given) for a command that runs something of
    this repository; None for one that does not (pip, git, export, ...)."""
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]  # VARIABLE=value
    if not words:
        return None
    head, rest = words[0], words[1:]
    if head == "make":
        return ("make", [], rest)
    if head in console_scripts():
        module, _, function = console_scripts()[head].partition(":")
        code = (f"import sys; sys.argv[0] = {head!r}; from {module} import {function}; "
                f"sys.exit({function}())")
        return (head, [sys.executable, "-c", code], rest)
    if head in PYTHONS:
        if rest[:1] == ["-c"] or not rest:
            return None
        if rest[0] == "-m":
            return (f"-m {rest[1]}", [sys.executable, "-m", rest[1]], rest[2:])
        return (rest[0], [sys.executable, rest[0]], rest[1:])
    if head in SHELLS:
        return (rest[0], [], rest[1:]) if rest else None
    if head in LAUNCHERS:
        scripts = [i for i, w in enumerate(rest) if re.search(r"\.(py|sh|sbatch)$", w)]
        if not scripts:
            return None
        i = scripts[0]
        script = rest[i]
        return (script, [sys.executable, script] if script.endswith(".py") else [], rest[i + 1:])
    if re.search(r"\.(py|sh)$", head):
        return (head.removeprefix("./"), [sys.executable, head] if head.endswith(".py") else [],
                rest)
    if head.startswith("--"):  # a fragment of flags: pretrain_gpt.py's
        return ("pretrain_gpt.py", [sys.executable, "pretrain_gpt.py"], words)
    return None


@functools.cache
def help_text(help_command: tuple[str, ...]) -> str:
    """What ``help_command --help`` prints (the script's parser, run for real)."""
    out = subprocess.run([*help_command, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"{' '.join(help_command)} --help: {out.stderr[-2000:]}"
    return out.stdout


def usage(help_command: tuple[str, ...]) -> str:
    return help_text(help_command).split("\n\n")[0]


def flags_of(help_command: tuple[str, ...]) -> frozenset[str]:
    """Every option a script's parser takes, from the usage its --help prints."""
    return frozenset(re.findall(r"(?<![\w-])--[A-Za-z0-9][\w-]*", usage(help_command)))


def subcommand(help_command: list[str], given: list[str]) -> list[str]:
    """The help command of a subcommand (``records.py add``) where the words start with one."""
    if not help_command or not given or given[0].startswith("-"):
        return help_command
    choices = re.search(r"\{([\w,-]+)\}", usage(tuple(help_command)))
    if choices and given[0] in choices.group(1).split(","):
        return [*help_command, given[0]]
    return help_command


def takes_megatron_flags(help_command: tuple[str, ...]) -> bool:
    """A tool that passes the flags after its own to megatron (its --help says so)."""
    return "megatron flags" in " ".join(help_text(help_command).split())


def flags_given(words: list[str]) -> list[str]:
    """The ``--flags`` among ``words`` (``--flag=value`` as ``--flag``; ``[--flag`` too)."""
    return [w.lstrip("[").split("=")[0].rstrip("]") for w in words
            if re.match(r"^\[?--[A-Za-z]", w)]


def command_problems(words: list[str]) -> list[str]:
    runs = what_runs(words)
    if runs is None:
        return []
    what, help_command, given = runs
    if what == "make":
        return [f"make {t}: no such target" for t in given
                if not t.startswith("-") and "=" not in t and t not in makefile_targets()]
    if what.startswith("-m "):
        module = what[3:]
        if module.split(".")[0] in ("megagpt",) and not any(
                (REPO / (module.replace(".", "/") + suffix)).exists()
                for suffix in (".py", "/__main__.py")):
            return [f"python -m {module}: no such module"]
        if not module.startswith("megagpt"):
            return []
    elif what not in console_scripts():
        if not (REPO / what).is_file():
            return [f"{what}: no such file"]
    if not help_command:  # a shell script: its own words take no flags, those after -- are
        # pretrain_gpt.py's (the examples pass them on)
        own, _, passed = (given[:given.index("--")], None, given[given.index("--") + 1:]) \
            if "--" in given else (given, None, [])
        known = flags_of((sys.executable, "pretrain_gpt.py"))
        return ([f"{what}: takes no flag {f}" for f in flags_given(own)]
                + [f"{what} -- {f}: pretrain_gpt.py takes no such flag"
                   for f in flags_given(passed) if f not in known])
    help_command = subcommand(help_command, given)
    known = flags_of(tuple(help_command))
    if takes_megatron_flags(tuple(help_command)):
        known |= flags_of((sys.executable, "pretrain_gpt.py"))
    return [f"{what}: no flag {f}" for f in flags_given(given) if f not in known]


def bash_blocks(page: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text_of(page)) if lang in ("bash", "sh")]


def test_commands_are_read_as_a_shell_reads_them():
    block = ("DRY_RUN=1 bash examples/train_gpt345m.sh 8   # or 1\n"
             "python tools/generate.py --load CKPT \\\n    --prompt \"a # b\" && make test\n")
    assert commands_of(block) == [["DRY_RUN=1", "bash", "examples/train_gpt345m.sh", "8"],
                                  ["python", "tools/generate.py", "--load", "CKPT", "--prompt",
                                   "a # b"], ["make", "test"]]
    assert what_runs(["torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", "--bf16"])[::2] \
        == ("pretrain_gpt.py", ["--bf16"])


@pytest.mark.slow
def test_a_wrong_script_target_or_flag_is_named():
    """The check itself, on commands that are wrong in each way it looks for."""
    assert command_problems(["bash", "examples/no_such.sh"]) == \
        ["examples/no_such.sh: no such file"]
    assert command_problems(["make", "demo", "no-such-target"]) == \
        ["make no-such-target: no such target"]
    assert command_problems(["python", "tools/generate.py", "--load", "x", "--no-such"]) == \
        ["tools/generate.py: no flag --no-such"]
    assert command_problems(["python", "pretrain_gpt.py", "--hiden-size", "8"]) == \
        ["pretrain_gpt.py: no flag --hiden-size"]
    assert command_problems(["bash", "examples/train_gpt345m.sh", "--", "--dry-runn"]) == \
        ["examples/train_gpt345m.sh -- --dry-runn: pretrain_gpt.py takes no such flag"]
    assert command_problems(["python", "-m", "megagpt.no_such_module"]) == \
        ["python -m megagpt.no_such_module: no such module"]
    # megatron's flags after generate.py's own (it passes them on), and a subcommand's flags
    assert command_problems(["python", "tools/generate.py", "--load", "x",
                             "--tokenizer-model", "t"]) == []
    assert command_problems(["python", "bench/records.py", "add", "x.json", "--commit", "c"]) == []


@pytest.mark.slow
@pytest.mark.parametrize("page", COMMAND_PAGES)
def test_every_command_names_what_exists_with_flags_it_takes(page):
    problems = [f"{' '.join(words)}: {p}" for block in bash_blocks(page)
                for words in commands_of(block) for p in command_problems(words)]
    assert not problems, "\n".join(problems)
