"""The log of a run: one iteration line with the figures a user looks for, megatron's argument
table in the run folder, no message that does not apply to this install, no memory report on
the CPU, and the training plot beside the run at its end. Two real CPU launches of the tiny
model: the entry's log, and megatron's (--megatron-iteration-log, MEGAGPT_ALL_WARNINGS=1)."""

import importlib.util
import json
import re
from argparse import Namespace
from pathlib import Path

import pytest

from helpers import TINY_MODEL, parse_losses, run_entry
from megagpt.run_log import iteration_line, quiet, run_folder

RUN = TINY_MODEL + ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "4",
                    "--save-interval", "4", "--eval-interval", "2", "--eval-iters", "1"]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """{"entry": (output, run folder), "megatron": (output, run folder)}"""
    work = tmp_path_factory.mktemp("run_log")
    out = {}
    for name, extra, env in (
            ("entry", [], {"MEGAGPT_NO_PLOT": "0"}),
            ("megatron", ["--megatron-iteration-log", "--print-arguments"],
             {quiet.ALL_WARNINGS: "1"})):
        folder = work / name / "checkpoints"
        proc = run_entry(RUN + ["--save", str(folder), *extra], cwd=work, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:]
        out[name] = (proc.stdout, folder)
    return out


def iteration_lines(text):
    return [line for line in text.splitlines() if re.search(r"\biteration\s+\d+/\s*\d+ \|", line)]


@pytest.mark.slow
def test_one_short_iteration_line_with_megatrons_figures(launches):
    entry, _ = launches["entry"]
    megatron, _ = launches["megatron"]
    lines = iteration_lines(entry)
    assert len(lines) == 4 and all(len(line) < 200 for line in lines), lines
    assert not any("consumed samples" in line for line in lines)
    for line in lines[1:]:
        assert re.search(r"\| lm loss: \S+ \| lr: \S+ \| grad norm: \S+ \| tokens/s: [\d,]+ \| "
                         r"TFLOP/s/GPU: \S+ \| ms/iter: [\d.]+ \| time left: \d+s$", line), line
    assert not any("MFU" in line for line in lines)  # not on the CPU: no peak to divide by
    assert "no MFU on the CPU" in entry
    # the same numbers megatron printed for the same iterations (deterministic mode)
    assert parse_losses(entry) == parse_losses(megatron) and len(parse_losses(entry)) == 4
    assert all("consumed samples" in line for line in iteration_lines(megatron))


@pytest.mark.slow
def test_the_records_and_the_plot_are_in_the_run_folder(launches):
    _, folder = launches["entry"]
    records = [json.loads(line) for line in (folder / iteration_line.RECORDS).read_text()
               .splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert all(r["tokens_per_s"] > 0 and r["tflops"] > 0 for r in records)
    assert (folder / run_folder.PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {folder / run_folder.PLOT}" in launches["entry"][0]


@pytest.mark.slow
def test_megatrons_argument_table_is_in_the_run_folder_and_shown_on_request(launches):
    entry, folder = launches["entry"]
    table = (folder / run_folder.ARGUMENTS).read_text()
    assert table.startswith("------------------------ arguments ------------------------")
    assert len(table.splitlines()) > 500 and "  hidden_size ...." in table
    assert "------------------------ arguments" not in entry
    assert f"megatron's arguments: {folder / run_folder.ARGUMENTS} (--print-arguments" in entry
    megatron, _ = launches["megatron"]
    assert "------------------------ arguments ------------------------" in megatron


@pytest.mark.slow
def test_no_memory_report_on_the_cpu(launches):
    """megatron reports torch.cuda's counters after the first iterations and around every
    save, all 0 on the CPU."""
    assert "memory (MB) | allocated" not in launches["entry"][0]


@pytest.mark.slow
@pytest.mark.parametrize("quieted", [q for q in quiet.QUIETED],
                         ids=[q.pattern[:32] for q in quiet.QUIETED])
def test_each_quieted_message_is_megatrons_text_and_is_gone(launches, quieted):
    """Where its condition holds here, the message is in a real launch with every filter off,
    the pattern matches it there, and the entry's launch has none of it."""
    assert quieted.when()  # every condition holds on a CPU machine without TE
    unfiltered, filtered = launches["megatron"][0], launches["entry"][0]
    assert _found(quieted.pattern, unfiltered), f"not printed any more: {quieted.pattern}"
    assert not _found(quieted.pattern, filtered)
    if quieted.first_line_stays:
        first = quieted.pattern.split("\\n")[0]
        assert _found(first, filtered)


def _found(pattern: str, text: str) -> bool:
    """Whether a message starting with ``pattern`` is in ``text``, after the prefix of each
    logged or warned line ('LEVEL:logger:', 'file:N: Category: ', torch's 'W1204 ... N] ')."""
    for prefix in (r"^[A-Z]+:[\w.]+:", r"^.*?\.py:\d+: \w+: ", r"^[WIE]\d{4} .*?\] "):
        text = re.sub(prefix, "", text, flags=re.M)
    return re.search("^" + pattern, text, flags=re.M) is not None


@pytest.mark.slow
def test_one_loggers_internal_link_is_not_printed(launches):
    assert "one_logger package is required" in launches["megatron"][0]
    assert "one_logger" not in launches["entry"][0]


# ---------------------------------------------------------------------------
# Without a launch
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("quieted", quiet.QUIETED, ids=[q.module for q in quiet.QUIETED])
def test_each_quieted_message_is_still_in_its_modules_source(quieted):
    """An upgrade that rewords or drops a message fails here, so a filter never outlives it."""
    source = Path(importlib.util.find_spec(quieted.module).origin).read_text()
    assert quieted.needle in source, (quieted.module, quieted.needle)


def test_mfu_time_left_and_rates_from_megatrons_figures():
    peak, about = iteration_line.peak_for(Namespace(cpu=False, bf16=True, fp16=False,
                                                    gpu_type="H200"))
    assert peak.tflops == 989 and "H200's 989 TFLOP/s dense 16-bit peak" in about
    assert iteration_line.peak_for(Namespace(cpu=False, bf16=False, fp16=False,
                                             gpu_type="H200"))[0] is None
    # an FP8 launch (TE's layers or the fast spec's, as its plan says) against the FP8 peak
    fp8_peak, fp8_about = iteration_line.peak_for(
        Namespace(cpu=False, bf16=True, fp16=False, gpu_type="H200"), fp8=True)
    assert fp8_peak.tflops == 1979 and "dense FP8 peak" in fp8_about
    line = iteration_line.parse(
        " [2026-12-04 10:01:02.123456] iteration       40/    1000 | consumed samples:"
        "         2560 | elapsed time per iteration (ms): 45.0 | throughput per GPU "
        "(TFLOP/s/GPU): 412.3 | learning rate: 2.463557E-03 | global batch size:    64 | "
        "lm loss: 6.581037E+00 | loss scale: 1.0 | grad norm: 0.886 | number of skipped "
        "iterations:   0 | number of nan iterations:   2 |")
    log = iteration_line.IterationLine(1024, 8, lambda batch: 0.0, peak)
    log.lines = 1  # not the first line of the launch
    text = log.text(log.figures(line))
    assert text == (" [2026-12-04 10:01:02] iteration   40/1000 | lm loss: 6.581037E+00 | lr: "
                    "2.464E-03 | grad norm: 0.886 | tokens/s: 1,456,356 (182,044 per GPU) | "
                    "TFLOP/s/GPU: 412.3 | MFU: 41.7% | ms/iter: 45.0 | time left: 43s | "
                    "nan iterations: 2")
    assert [iteration_line.duration(s) for s in (43.2, 725, 12000, 200000)] == [
        "43s", "12m 05s", "3h 20m", "2d 07h"]


@pytest.mark.gpu
def test_the_line_gives_mfu_against_this_gpus_peak_in_bf16(tmp_path):
    """On a GPU the dry run knows (H100, H200, A100), a bf16 run's line has MFU: its
    TFLOP/s per GPU over that peak."""
    gpu_flags = [a for a in TINY_MODEL if a not in ("--cpu", "--deterministic-mode")]
    proc = run_entry(gpu_flags + ["--bf16", "--train-iters", "6"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    peak = re.search(r"MFU against the (.*)'s ([\d.]+) TFLOP/s dense 16-bit peak", proc.stdout)
    assert peak, "not a GPU the dry run knows: " + proc.stdout[-2000:]
    lines = iteration_lines(proc.stdout)
    tflops, mfu = map(float, re.search(r"TFLOP/s/GPU: ([\d.]+) \| MFU: ([\d.]+)%",
                                       lines[-1]).groups())
    assert mfu == pytest.approx(100 * tflops / float(peak.group(2)), abs=0.1)
