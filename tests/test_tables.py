"""bench/benchmarks.md and the figures of the user's pages are generated from the records in
bench/figures/runs/ (bench/records.py, bench/tables.py, bench/page_figures.py): the committed
files are what the records give, every record is valid, a newer record takes a row over and
the older one goes to the log, and bench outputs become records."""

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "bench"))

import page_figures  # noqa: E402
import records  # noqa: E402
import suite_time  # noqa: E402
import tables  # noqa: E402


def test_the_committed_docs_are_what_the_records_give():
    """Fails when a record was added or changed without running ``python bench/tables.py``
    (or the docs were edited by hand)."""
    assert tables.main(["--check", "--records-only"]) == 0


@pytest.mark.slow
def test_the_cost_lines_are_what_the_dry_run_prints_today():
    """docs/several-gpus.md's estimate of the 175B example and its layout search, from that dry
    run (bench/dry_run_cost.py): fails when the step model changes and make tables was not run."""
    import dry_run_cost

    output = dry_run_cost.dry_run_output()
    block = dry_run_cost.block(output)
    assert block in (REPO / dry_run_cost.PAGE).read_text()
    assert "  per iteration   " in block and "whole run" in block and "GPU-hours" in block
    assert re.search(r"its best \(TP \d+ × PP \d+ × DP \d+, .*\) is [\d.]+ % faster", block)


def test_every_record_is_valid_and_every_known_table_has_rows():
    found = records.load()
    # a table without records yet says what to run for each of its rows
    unmeasured = {t.name for t in tables.TABLES} - {r["table"] for r in found}
    assert all(t.expected for t in tables.TABLES if t.name in unmeasured), unmeasured
    for r in found:
        assert r["commit"] is None or len(r["commit"].split("+")[0]) >= 7, r["_file"]


def _one(table="train-1gpu", **row):
    for r in records.load():
        if r["table"] == table and all(r["row"].get(k) == v for k, v in row.items()):
            return {k: v for k, v in r.items() if k != "_file"}
    raise LookupError(row)


def test_a_newer_record_takes_the_row_and_the_older_goes_to_the_log(tmp_path):
    old = _one(shape="1.3B", path="fast", dropout=0.0)
    new = copy.deepcopy(old)
    new.update(date="2027-01-02 03:04 UTC", commit="abcdef0")
    new["figures"]["tflops_per_gpu"] = 612.3
    records.write(old, tmp_path)
    path = records.write(new, tmp_path)
    assert path.name.startswith("2027-01-02T0304_train-1gpu_1.3B_fast_0")
    text = tables.benchmarks_text(records.load(tmp_path))
    table, log = text.split("## Earlier results")
    row = next(line for line in table.splitlines() if line.startswith("| 1.3B | fast path | 0 |"))
    assert "612.3" in row and "`abcdef0`" in row and "2027-01-02 03:04" in row
    assert f"{old['figures']['tflops_per_gpu']:.1f} TFLOP/s/GPU" in log
    assert old["date"] in log and "2027-01-02" not in log


def test_a_record_marked_not_current_never_stands_in_a_table(tmp_path):
    good = _one(shape="345M", path="reference", dropout=0.1)
    outlier = copy.deepcopy(good)
    outlier.update(date="2027-01-01 00:00 UTC", current=False, why="a slow machine")
    outlier["figures"]["tflops_per_gpu"] = 1.5
    records.write(good, tmp_path)
    records.write(outlier, tmp_path)
    table, log = tables.benchmarks_text(records.load(tmp_path)).split("## Earlier results")
    assert "| 345M | plain PyTorch | 0.1 |" in table and "1.5" not in table.split("| 345M |")[1]
    assert "not a current figure: a slow machine" in log
    del outlier["why"]
    assert "current: false needs a why" in records.problems(outlier)


def test_a_table_the_generator_does_not_know_is_shown_with_its_keys(tmp_path):
    rec = dict(_one(), table="decode-latency", row=dict(shape="345M", batch=16),
               figures=dict(ms_per_token=4.0))
    records.write(rec, tmp_path)
    text = tables.benchmarks_text(records.load(tmp_path))
    assert "## decode-latency" in text and "| shape | batch | ms_per_token |" in text


def test_rows_expected_and_not_measured_name_their_command(tmp_path):
    records.write(_one(), tmp_path)  # one training row only
    text = tables.benchmarks_text(records.load(tmp_path))
    assert "not measured yet: shape 1.3B, path reference, dropout 0 " \
           "(`python bench/bench_throughput.py --shape 1.3B --paths reference " \
           "--reference-dropout 0" in text


def test_a_bad_record_is_refused_with_what_is_wrong(tmp_path):
    bad = dict(_one(), date="yesterday")
    del bad["command"]
    (tmp_path / "x.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"x.json: command: missing.*date: not like"):
        records.load(tmp_path)


def test_throughput_output_becomes_training_switch_and_loss_records():
    """The keys bench_throughput.py writes into bench_<shape>.json (its main needs a GPU)."""
    from run_info import run_info

    info = dict(run_info(), gpu="NVIDIA H200", torch="2.11.0+cu130", shape="345M",
                megatron_core="0.19.2", bf16_matmul_peak_tflops=780.0)
    info["versions"].setdefault("torch", "2.11.0+cu130")
    info["versions"].setdefault("megatron-core", "0.19.2")
    entry = dict(ms_per_iter=50.0, tokens_per_s=163840.0, tflops_per_gpu=372.2,
                 peak_mem_mib=12604.8)
    summary = dict(
        info=info, flops_per_iter=18.61e12, entry_args="", data="mock",
        path_flags={"local": ["--no-fast-spec", "--fast-disable", "optimizer,lm-loss"],
                    "fast": [], "nodrop": ["--hidden-dropout", "0", "--attention-dropout", "0"],
                    "nowrite": ["--hidden-dropout", "0", "--attention-dropout", "0",
                                "--fast-disable", "grad-write"]},
        results={"fast": entry, "nodrop": dict(entry, ms_per_iter=45.0),
                 "nowrite": dict(entry, ms_per_iter=45.6), "local": dict(entry, ms_per_iter=170.0),
                 "reference": dict(ms_per_iter=52.0, dropout=0.0, tokens_per_s=1.0,
                                   tflops_per_gpu=2.0, peak_mem_mib=13000.0),
                 "broken": dict(rc=1)},
        loss_comparison=dict(paths=["local", "fast"], iterations=50, max_abs_diff=0.05,
                             max_rel_diff=0.006, mean_abs_diff=0.01, identical=0))
    made = records.from_throughput(summary)
    rows = {(r["table"], tuple(r["row"].values())): r for r in made}
    assert ("train-1gpu", ("345M", "fast", 0.1)) in rows
    assert rows[("train-1gpu", ("345M", "fast", 0.0))]["figures"]["ms_per_iter"] == 45.0
    assert ("train-1gpu", ("345M", "local", 0.1)) in rows
    assert ("train-1gpu", ("345M", "reference", 0.0)) in rows
    switch = rows[("switches", ("345M", "--fast-disable grad-write", 0.0))]["figures"]
    assert (switch["default_ms"], switch["switch_ms"]) == (45.0, 45.6)
    agreement = rows[("loss-agreement", ("345M", "mock", "fast vs local", ""))]["figures"]
    assert agreement["max_abs_diff"] == 0.05
    assert agreement["max_rel_diff"] == 0.006  # small differences are not rounded away
    assert all(not records.problems(r) for r in made)


def _throughput_output(shape: str, path_flags: dict, ms_per_iter: dict, **more) -> dict:
    """bench_throughput.py's bench_<shape>.json for these paths, flags and step times."""
    from run_info import run_info

    info = dict(run_info(), gpu="NVIDIA H200", shape=shape,
                command=f"python bench/bench_throughput.py --shape {shape} --out /root/out/x")
    results = {path: dict(ms_per_iter=ms, tokens_per_s=1.0, tflops_per_gpu=1.0,
                          peak_mem_mib=1.0) for path, ms in ms_per_iter.items()}
    return dict(info=info, entry_args="", data="mock", path_flags=path_flags,
                results=results, **more)


def test_a_path_through_another_checkouts_entry_is_compared_not_tabled_as_this_commits():
    """``--entry-of base=...``: the earlier commit's run is set against this checkout's run
    with the same flags (one against-commit record each), and is no training row."""
    mgpu = ["--fast-multi-gpu-path", "--use-distributed-optimizer"]
    earlier = dict(entry=".bench-base/pretrain_gpt.py", commit="13aa416")
    made = records.from_throughput(_throughput_output(
        "1.3B", {"fast": [], "base": [], "mgpu": mgpu, "base-mgpu": mgpu,
                 "lonely": ["--seed", "2"]},
        {"fast": 134.0, "base": 135.34, "mgpu": 140.0, "base-mgpu": 139.0, "lonely": 134.0},
        entry_of={"base": earlier, "base-mgpu": earlier, "lonely": dict(earlier, commit=None)}))
    against = {r["row"]["path"]: r for r in made if r["table"] == "against-commit"}
    assert set(against) == {"fast", "mgpu"}
    assert against["fast"]["row"]["against"] == "13aa416"
    assert against["fast"]["figures"]["speed_vs_earlier"] == 1.01
    assert against["mgpu"]["figures"]["speed_vs_earlier"] == round(139 / 140, 3)
    assert against["mgpu"]["row"]["flags"] == "--fast-multi-gpu-path --use-distributed-optimizer"
    trained = [r for r in made if r["table"] == "train-1gpu"]
    assert [r["figures"]["ms_per_iter"] for r in trained] == [134.0]
    # the earlier commit's runs are in no switch row either
    assert {r["row"]["switch"] for r in made if r["table"] == "switches"} == \
        {"--fast-multi-gpu-path --use-distributed-optimizer"}
    assert all(not records.problems(r) for r in made)


def test_a_switch_added_to_another_path_is_measured_against_that_path():
    """``--fast-disable deferred-nan-checks`` added to the several-GPU path's flags: its row
    says so and its "default" is the several-GPU run, not the single-GPU default."""
    mgpu = ["--fast-multi-gpu-path", "--use-distributed-optimizer"]
    made = records.from_throughput(_throughput_output(
        "345M", {"fast": [], "mgpu": mgpu,
                 "nodefer": [*mgpu, "--fast-disable", "deferred-nan-checks"]},
        {"fast": 48.0, "mgpu": 381.4, "nodefer": 421.85}))
    switches = {(r["row"]["switch"], r["row"].get("on")): r["figures"] for r in made
                if r["table"] == "switches"}
    assert switches[("--fast-disable deferred-nan-checks", shlex.join(mgpu))] == dict(
        default_ms=381.4, switch_ms=421.85, default_mib=1.0, switch_mib=1.0)
    assert switches[(shlex.join(mgpu), None)]["default_ms"] == 48.0
    text = tables.benchmarks_text([dict(r, _file=str(i)) for i, r in enumerate(made)])
    assert "`--fast-disable deferred-nan-checks` on `--fast-multi-gpu-path " \
           "--use-distributed-optimizer`" in text


def test_dropout_runs_become_cost_records_and_only_uniform_dropout_trains_a_row():
    """Paths differing from a no-dropout run by their dropout flags alone give the dropout
    table's rows, each costed against that run; a path with attention and hidden dropout
    unequal is in no training row (that table's rows are keyed by one dropout)."""
    from run_info import run_info

    info = dict(run_info(), gpu="NVIDIA H200", shape="345M",
                command="python bench/bench_throughput.py --shape 345M --out /root/out/tp")
    entry = dict(ms_per_iter=44.0, tokens_per_s=1.0, tflops_per_gpu=423.0, peak_mem_mib=1.0)
    summary = dict(
        info=info, entry_args="", data="mock",
        path_flags={"fast": [], "nodrop": ["--hidden-dropout", "0", "--attention-dropout", "0"],
                    "attention-only": ["--hidden-dropout", "0"],
                    "hidden-only": ["--attention-dropout", "0"]},
        results={"nodrop": entry, "attention-only": dict(entry, ms_per_iter=46.5),
                 "hidden-only": dict(entry, ms_per_iter=45.9),
                 "fast": dict(entry, ms_per_iter=48.2)})
    made = records.from_throughput(summary)
    cost = {(r["row"]["attention_dropout"], r["row"]["hidden_dropout"]): r["figures"]["cost"]
            for r in made if r["table"] == "dropout"}
    assert cost == {(0.0, 0.0): 0.0, (0.1, 0.0): round(46.5 / 44 - 1, 4),
                    (0.0, 0.1): round(45.9 / 44 - 1, 4), (0.1, 0.1): round(48.2 / 44 - 1, 4)}
    trained = {r["row"]["dropout"]: r["figures"]["ms_per_iter"] for r in made
               if r["table"] == "train-1gpu"}
    assert trained == {0.0: 44.0, 0.1: 48.2}
    assert all(r["command"].endswith("--out OUT") for r in made)
    assert all(not records.problems(r) for r in made)


def test_resume_output_becomes_a_resume_record():
    """resume_fidelity.py's JSON as it writes it (the keys of its ``result``)."""
    from run_info import run_info

    result = dict(info=run_info(), iterations=40, stopped_at=20,
                  flags=["--num-layers", "24", "--hidden-size", "1024"],
                  all=dict(iterations_compared=40, identical=40, max_abs_diff=0.0),
                  after_resume={})
    (made,) = records.from_output(result)
    assert made["row"] == dict(shape="345M", saved_under="one process",
                               resumed_under="one process")
    assert made["command"].startswith("python ") and made["commit"]


def test_run_info_names_this_checkout():
    from run_info import commit, run_info

    info = run_info(argv=[str(REPO / "bench" / "layouts.py"), "--gpus", "2"])
    assert info["command"] == "python bench/layouts.py --gpus 2"
    assert info["commit"] == commit() and info["commit"]
    assert {"python", "torch", "megatron-core"} <= set(info["versions"])


def test_copied_records_regenerate_the_same_docs(tmp_path):
    """The generator reads nothing but the records (a copy of them gives the same text)."""
    shutil.copytree(records.RUNS, tmp_path / "runs")
    assert tables.benchmarks_text(records.load(tmp_path / "runs")) == \
        (REPO / "bench" / "benchmarks.md").read_text()


def test_a_newer_record_changes_the_figure_on_the_users_page():
    """The README's table shows the newest record of each row, and names its GPU; the block of
    a page is replaced whole, the page around it kept."""
    newer = _one(shape="1.3B", path="fast", dropout=0.0)
    newer.update(date="2027-01-02 03:04 UTC", machine="NVIDIA H100 80GB HBM3")
    newer["figures"].update(tflops_per_gpu=612.3, peak_mib=33366)
    found = records.load() + [dict(newer, _file="new")]
    current = list(tables.current_and_earlier(found)[0].values())
    text = page_figures.with_blocks("README.md", (REPO / "README.md").read_text(), current)
    block = text.split(page_figures.start_marker("training"))[1].split(
        page_figures.end_marker("training"))[0]
    assert "| 1.3B | 0 | 612.3 (33,366 MiB) |" in block
    assert "one NVIDIA H100 80GB HBM3 and one NVIDIA H200" in block and "2027-01-02" in block
    assert text.split(page_figures.start_marker("training"))[0] == \
        (REPO / "README.md").read_text().split(page_figures.start_marker("training"))[0]


def test_a_page_without_its_markers_is_refused():
    with pytest.raises(SystemExit, match="docs/fp8.md: needs one"):
        page_figures.with_blocks("docs/fp8.md", "# FP8\n\nno markers here\n", [])


def test_a_block_links_to_its_table_and_names_no_commit():
    current = list(tables.current_and_earlier(records.load())[0].values())
    for page, blocks in page_figures.PAGES.items():
        for name, render in blocks.items():
            lines = render(current, page)
            assert any("](" in line and "benchmarks.md#" in line for line in lines), (page, name)
            assert not any(r["commit"] and r["commit"].split("+")[0] in "\n".join(lines)
                           for r in current if r["commit"]), (page, name)


def test_the_suite_time_is_read_from_pytests_own_summary(tmp_path):
    """pytest's last line, from a real pytest run, becomes a valid test-suite record, and the
    contributor's page says it."""
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n\n"
        "@pytest.mark.skip(reason='no')\ndef test_c():\n    pass\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(tmp_path / "test_x.py")], capture_output=True, text=True,
                         cwd=tmp_path)
    counts = suite_time.pytest_counts(out.stdout)
    assert counts == {"passed": 2, "skipped": 1}, out.stdout[-500:]
    assert suite_time.pytest_counts("no summary here") == {}
    record = suite_time.suite_record(
        240.0, 1038.2, counts, caches="warm", date="2027-01-02 03:04 UTC", commit="abcdef0",
        machine_name="2-core x86_64 CPU", versions={"torch": "2.14.1", "megatron-core": "0.19.2"},
        command="python bench/suite_time.py")
    assert not records.problems(record)
    assert record["figures"] == dict(demo_min=4.0, suite_min=17.3, passed=2, skipped=1)
    line = page_figures.test_suite([record], "CONTRIBUTING.md")[0]
    assert "`make demo` 4.0 minutes, `make test` 17.3 (2 passed)" in line
