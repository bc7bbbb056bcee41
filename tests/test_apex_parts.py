"""megagpt.launch.apex_kernels: what megatron takes from NVIDIA apex, found through real imports.

apex is not installed here: the absent case is this environment as it is. The present case is
a stand-in apex written to a temporary folder and put on the import path, module for module as
megatron imports them (the packages, the compiled extensions as plain modules), so that the
detection and megatron's own ``try: import ... except ImportError`` both run against Python's
real import system; nothing of megatron is replaced.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megagpt import compat
from megagpt.launch import apex_kernels
from megagpt.launch.layers import Modules

FAST, LOCAL, TE = Modules.FAST, Modules.LOCAL, Modules.TE
from megagpt.errors import UserError
from megagpt.launch import apex_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import apex_build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MEGATRON = Path(importlib.util.find_spec("megatron").submodule_search_locations[0])

STAND_IN = {
    "apex/__init__.py": "",
    "apex/optimizers/__init__.py": "class FusedAdam:\n    pass\n\n\nclass FusedSGD:\n    pass\n",
    "apex/multi_tensor_apply/__init__.py": "multi_tensor_applier = object()\n",
    "apex/normalization/__init__.py": "",
    "apex/normalization/fused_layer_norm.py": "class FusedLayerNormAffineFunction:\n    pass\n",
    "apex/contrib/__init__.py": "",
    "apex/contrib/layer_norm/__init__.py": "",
    # as apex's: the module imports its compiled kernel at the top
    "apex/contrib/layer_norm/layer_norm.py": "import fast_layer_norm\n\n\n"
                                             "class FastLayerNormFN:\n    pass\n",
    "amp_C.py": "def multi_tensor_l2norm(*args):\n    pass\n\n\n"
                "def multi_tensor_scale(*args):\n    pass\n",
    **{f"{name}.py": "" for name in apex_kernels.EXTENSIONS if name != "amp_C"},
}
STAND_IN_MODULES = ("apex", "amp_C", *apex_kernels.EXTENSIONS)


def write_stand_in(folder: Path, leave_out=(), broken=()) -> Path:
    """The stand-in apex in ``folder``; ``leave_out``: files not written; ``broken``: modules
    that raise ImportError when imported, as a library with an undefined symbol does."""
    for name, text in STAND_IN.items():
        if name in leave_out:
            continue
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        module = name[:-3].replace("/", ".").removesuffix(".__init__")
        path.write_text(f"raise ImportError('undefined symbol in {module}')\n"
                        if module in broken else text)
    return folder


@pytest.fixture
def on_path(monkeypatch, tmp_path):
    """Put a folder first on sys.path; the modules imported from it are forgotten after."""
    def put(folder: Path) -> Path:
        monkeypatch.syspath_prepend(str(folder))
        return folder

    yield put
    for name in list(sys.modules):
        if name.split(".")[0] in STAND_IN_MODULES:
            del sys.modules[name]
    importlib.invalidate_caches()


def test_nothing_is_found_where_apex_is_not_installed():
    assert apex_kernels.found_parts() == frozenset()
    said = []
    assert apex_kernels.log_launch_line(None, SimpleNamespace(), said.append) is None
    assert said == []


def test_every_part_is_found_from_an_importable_apex(on_path, tmp_path):
    on_path(write_stand_in(tmp_path))
    assert apex_kernels.found_parts() == {part.key for part in apex_kernels.PARTS}


def test_a_library_that_does_not_load_leaves_its_part_out(on_path, tmp_path):
    """Found by the import system (find_spec), but its import fails: missing, as megatron's
    ``except ImportError`` sees it. A part needs every one of its modules."""
    on_path(write_stand_in(tmp_path, leave_out=("scaled_softmax_cuda.py",),
                           broken=("fast_layer_norm",)))
    assert importlib.util.find_spec("fast_layer_norm") is not None
    found = apex_kernels.found_parts()
    assert "persistent_layer_norm" not in found and "softmax" not in found
    assert {"layer_norm", "optimizer", "multi_tensor", "wgrad"} <= found


@pytest.mark.slow
def test_megatron_takes_an_importable_apex(tmp_path):
    """megatron's own imports, run against the stand-in in a fresh process: its optimizer
    binds FusedAdam and amp_C's norm, its linears find the weight-gradient kernel, its local
    spec builds FusedLayerNorm with the persistent kernel. Without it (this process): none."""
    code = ("import json; from megagpt.launch.apex_kernels import megatron_bindings; "
            "print(json.dumps(megatron_bindings()))")
    path = [str(write_stand_in(tmp_path)), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with_apex = json.loads(out.stdout.splitlines()[-1])
    assert with_apex == {"adam": "apex", "adam_bound": "apex", "sgd": "apex",
                         "grad_norm": "apex", "wgrad_kernel": True, "fused_layer_norm": True,
                         "persistent_kernel": True}
    without = apex_kernels.megatron_bindings()
    assert without["adam"] == "torch" and without["grad_norm"] == "megatron"
    assert not (without["wgrad_kernel"] or without["fused_layer_norm"]
                or without["persistent_kernel"])


ALL = frozenset(part.key for part in apex_kernels.PARTS)
# megatron with apex and no TE, the fast optimizer's AdamW over megatron's Adam
APEX_BOUND = {"adam": "megagpt", "adam_bound": "apex", "sgd": "apex", "grad_norm": "apex",
              "wgrad_kernel": True, "fused_layer_norm": True, "persistent_kernel": True}
TE_BOUND = {**APEX_BOUND, "adam": "transformer_engine", "adam_bound": "transformer_engine",
            "grad_norm": "transformer_engine"}


def launch(**settings) -> SimpleNamespace:
    """megatron's args for a one-GPU bf16 launch of the 345M shape, with ``settings``."""
    return SimpleNamespace(**{
        "cpu": False, "optimizer": "adam", "use_distributed_optimizer": False,
        "gradient_accumulation_fusion": True, "fast_spec_fused_layer": True,
        "fast_lm_loss": True, "cross_entropy_loss_fusion": False,
        "tensor_model_parallel_size": 1, "sequence_parallel": False, "bf16": True,
        "fp16": False, "masked_softmax_fusion": True, "normalization": "LayerNorm",
        "hidden_size": 1024, "no_persist_layer_norm": False,
        "transformer_impl": "local", **settings})


def line(modules, args, found=ALL, bound=None, te=False) -> str:
    return apex_kernels.launch_line(apex_kernels.launch_uses(
        modules, args, found, APEX_BOUND if bound is None else bound, te,
        chunked_loss=args.fast_lm_loss))


def taken(text: str) -> str:
    return text.split(". Installed, not taken:")[0]


def test_the_fast_path_takes_the_gradient_norm_kernels_only():
    text = line(FAST, launch())
    assert taken(text) == ("apex: what this launch takes from it: amp_C multi-tensor kernels "
                           "(megatron's gradient norm and clipping)")
    for left in ("FusedAdam (the fast optimizer's torch fused AdamW replaces it)",
                 "fused_weight_gradient_mlp_cuda (the fast spec's fused layers and chunked LM "
                 "loss form their weight gradients)",
                 "(the fast spec's norms are torch's)", "attention is the fast spec's"):
        assert left in text.split("not taken:")[1]


def dry_run(tmp_path, *flags) -> str:
    """The plan ``--dry-run`` prints for a tiny bf16 launch, the stand-in apex importable."""
    folder = write_stand_in(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(folder), os.environ.get("PYTHONPATH", "")]))}
    out = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), "--dry-run",
                          *TINY_LAUNCH, *flags], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


TINY_LAUNCH = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "64",
               "--max-position-embeddings", "64", "--micro-batch-size", "2",
               "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--bf16"]


@pytest.mark.slow
def test_with_apex_the_fast_path_still_writes_gradients(tmp_path):
    """apex's weight-gradient kernel leaves megatron's fusion on, which would keep the
    gradients added into a zeroed buffer; the fast spec's fused layers and chunked loss never
    use it, so the plan turns it off and writes them (the plan without apex)."""
    text = dry_run(tmp_path)
    assert "fast path: --no-gradient-accumulation-fusion: the fast spec's fused layers" in text
    assert re.search(r"grad write +on", text), text
    kept = dry_run(tmp_path, "--fast-disable", "grad-write")
    assert "--no-gradient-accumulation-fusion" not in kept


@pytest.mark.slow
def test_with_apex_layernorm_1p_takes_megatrons_local_spec(tmp_path):
    """torch's norms (the fast spec's) have no zero-centred gamma, apex's FusedLayerNorm
    has: --apply-layernorm-1p builds megatron's local spec, not the fast spec."""
    text = dry_run(tmp_path, "--apply-layernorm-1p")
    assert re.search(r"layers +local — megatron's local modules; fast spec off: "
                     r"--apply-layernorm-1p", text), text


def test_the_distributed_optimizer_keeps_fused_adam():
    text = line(FAST, launch(use_distributed_optimizer=True), bound={**APEX_BOUND,
                                                                     "adam": "apex"})
    assert "FusedAdam (the distributed optimizer's Adam)" in taken(text)


def test_megatron_linears_fuse_where_they_run_their_own_backward():
    assert ("gradient-accumulation fusion in the output layer" in
            taken(line(FAST, launch(fast_lm_loss=False))))
    assert "the layers' linears" in taken(line(FAST, launch(fast_spec_fused_layer=False)))
    assert "in megatron's linear layers" in taken(line(LOCAL, launch()))
    assert ("--no-gradient-accumulation-fusion" in
            line(LOCAL, launch(gradient_accumulation_fusion=False)))


def test_beside_transformer_engine_only_the_output_layer_takes_apex():
    text = line(TE, launch(transformer_impl="transformer_engine"), bound=TE_BOUND, te=True)
    assert taken(text).endswith("fused_weight_gradient_mlp_cuda (gradient-accumulation fusion "
                                "in the output layer; Transformer Engine's layers fuse their "
                                "own)")
    assert "FusedAdam (megatron takes Transformer Engine's first)" in text
    assert "the gradient norm is transformer_engine's" in text
    # the fast spec beside TE, the fast optimizer over TE's FusedAdam: nothing from apex
    text = line(FAST, launch(), bound={**TE_BOUND, "adam": "megagpt"}, te=True)
    assert taken(text).endswith("takes from it: nothing")
    assert "FusedAdam (megatron takes Transformer Engine's first)" in text


def test_megatron_local_spec_takes_the_norms_and_the_softmax():
    text = taken(line(LOCAL, launch()))
    assert "persistent layer norm (fast_layer_norm) (megatron's local spec's LayerNorms)" in text
    assert "scaled-softmax kernels (megatron's local attention" in text
    assert ("persistent kernel: no kernel for hidden size 64" in
            taken(line(LOCAL, launch(hidden_size=64))))
    assert ("persistent kernel: --no-persist-layer-norm" in
            taken(line(LOCAL, launch(no_persist_layer_norm=True))))
    assert ("they take fp16/bf16 scores" in line(LOCAL, launch(bf16=False)))
    # turned off by the launch itself (megagpt.launch.apex_kernels): its reason
    left = apex_kernels.launch_line(apex_kernels.launch_uses(
        LOCAL, launch(no_persist_layer_norm=True), ALL, APEX_BOUND, False,
        persistent_left=apex_kernels.PERSISTENT_LAYER_NORM_SLOWER))
    assert (f"FusedLayerNorm (fused_layer_norm_cuda) (megatron's local spec's LayerNorms; "
            f"persistent kernel: {apex_kernels.PERSISTENT_LAYER_NORM_SLOWER})" in taken(left))


def test_the_fast_spec_keeps_megatrons_qk_norms():
    assert ("FusedLayerNorm (fused_layer_norm_cuda) (the q/k norms of --qk-layernorm" in
            taken(line(FAST, launch(qk_layernorm=True))))
    assert "FusedLayerNorm" not in taken(line(FAST, launch(qk_layernorm=True,
                                                           normalization="RMSNorm")))


def test_a_local_spec_without_the_norm_kernel_says_its_norms_will_fail():
    text = line(LOCAL, launch(), found=ALL - {"layer_norm", "persistent_layer_norm"})
    assert "FusedLayerNorm (megatron's local spec builds it, but fused_layer_norm_cuda" in text


def test_cpu_mode_takes_nothing_from_apex():
    for modules in (FAST, LOCAL):
        text = line(modules, launch(cpu=True, gradient_accumulation_fusion=False, bf16=False))
        assert taken(text).endswith("takes from it: nothing"), text
        assert "FusedAdam (CPU mode runs megatron's torch optimizer)" in text
    assert "(CPU mode builds torch's norms)" in line(LOCAL, launch(cpu=True))


def test_a_cpu_model_of_megatrons_local_spec_has_torch_norms():
    """Where apex imports megatron's local spec takes apex's FusedLayerNorm, whose kernels
    take CUDA tensors only; a --cpu model (training or generating) gets torch's instead."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megagpt import gpt_model
    from megagpt.fast_spec.norm import TorchNorm

    spec = get_gpt_layer_local_spec(qk_layernorm=True)
    attention = spec.submodules.self_attention.submodules
    # megatron's spec as it is where apex imports (gpt_layer_specs.LNImpl)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = FusedLayerNorm
    attention.q_layernorm = attention.k_layernorm = FusedLayerNorm
    gpt_model.with_torch_norms(spec)
    assert {spec.submodules.input_layernorm, spec.submodules.pre_mlp_layernorm,
            attention.q_layernorm, attention.k_layernorm} == {TorchNorm}


def test_every_apex_import_of_megatron_is_known():
    """The installed megatron imports from apex only what PARTS and NOT_TAKEN name: an
    upgrade that adds an import fails here."""
    pattern = re.compile(r"^\s*(?:from|import)\s+(apex[\w.]*|amp_C|\w+_cuda|fast_layer_norm)\b",
                         re.MULTILINE)
    imported = {m for path in MEGATRON.rglob("*.py") for m in pattern.findall(path.read_text())}
    known = {m for part in apex_kernels.PARTS for m in part.modules} | set(apex_kernels.NOT_TAKEN)
    assert imported - known == set()
    for part in apex_kernels.PARTS:
        texts = [(MEGATRON / site).read_text() for site in part.sites]
        assert any(m in text for text in texts for m in part.modules), part.key


def test_the_persistent_hidden_sizes_are_megatrons():
    source = (MEGATRON / "core/fusions/fused_layer_norm.py").read_text()
    tree = ast.parse(source)
    lists = [ast.literal_eval(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Assign) and any(
                 getattr(t, "id", None) == "persist_ln_hidden_sizes" for t in node.targets)]
    assert lists and set(lists[0]) == apex_kernels.PERSISTENT_HIDDEN_SIZES


def test_the_build_makes_exactly_the_extensions_megatron_takes():
    assert sorted(e.name for e in apex_build.EXTENSIONS) == sorted(apex_kernels.EXTENSIONS)
    # the most important first: the weight-gradient kernel, the optimizer's, the norm's
    assert [e.name for e in apex_build.EXTENSIONS[:3]] == [
        "fused_weight_gradient_mlp_cuda", "amp_C", "fused_layer_norm_cuda"]
    assert not any(e.niced for e in apex_build.EXTENSIONS[:3])


def test_the_build_without_apex_source_says_so_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "bench" / "apex_build.py"), "--source",
                          str(tmp_path / "nothing")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: no apex source at {tmp_path / 'nothing'}: run bench/gpu_apex_carry.sh here "
        "and carry .apex"]


def _bench_output(folder: Path, shape: str, ms: dict[str, float]) -> None:
    """What bench_throughput.py writes for one invocation, the figures given."""
    folder.mkdir(parents=True)
    info = dict(date="2026-12-04 10:00 UTC", commit="abc1234", machine="NVIDIA H200",
                versions={"torch": "2.11.0+cu130", "megatron-core": "0.19.2"},
                command=f"python bench/bench_throughput.py --shape {shape} --out /root/x",
                shape=shape)
    results = {path: dict(ms_per_iter=v, tflops_per_gpu=400.0 * 44.0 / v, peak_mem_mib=12000.0)
               for path, v in ms.items()}
    (folder / f"bench_{shape}.json").write_text(json.dumps(dict(info=info, results=results)))


def _versions_txt(folder: Path, transformer_engine: str) -> None:
    """The versions.txt that bench/gpu_record_apex.sh writes first."""
    (folder / "versions.txt").write_text(
        "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\ntorch 2.11.0+cu130 megatron-core 0.19.2 "
        "apex 25.09 (4bdecd06, built for 9.0 with Cuda compilation tools, release 13.0) "
        f"transformer-engine {transformer_engine}\n")


def test_the_records_of_a_run_compare_each_launch_with_apex_hidden(tmp_path):
    import apex_records
    import records
    import tables
    from table_specs import TABLES

    _versions_txt(tmp_path, "not installed")
    _bench_output(tmp_path / "speed" / "apex_345M", "345M", {"fast": 44.0})
    _bench_output(tmp_path / "speed" / "hidden_345M", "345M", {"fast": 44.9})
    _bench_output(tmp_path / "pieces" / "apex_local_345M", "345M",
                  {"local": 80.0, "nopersist": 82.0})
    made = {(r["row"]["install"], r["row"]["path"]): r
            for r in apex_records.make_records(tmp_path)}
    assert set(made) == {("apex", "fast"), ("without apex", "fast"), ("apex", "local"),
                         ("apex", "nopersist")}
    assert made["apex", "fast"]["figures"]["vs_without_apex"] == round(44.9 / 44.0, 3)
    assert made["apex", "nopersist"]["figures"]["vs_piece_on"] == round(80 / 82, 3)
    assert made["apex", "fast"]["versions"]["apex"] == "25.09 (4bdecd06)"
    assert made["without apex", "fast"]["versions"]["apex"] == "hidden"
    assert all(records.problems(r) == [] for r in made.values())
    spec = next(t for t in TABLES if t.name == "apex")
    text = "\n".join(tables.render_table(spec, list(made.values()), list(made.values())))
    assert "| 345M | apex | the entry's default (fast spec) | 44.0 |" in text
    assert "not measured yet: shape 1.3B, install apex, path fast" in text


def test_the_records_beside_te_name_its_version(tmp_path):
    import apex_records
    import records

    _versions_txt(tmp_path, "2.20.2")
    _bench_output(tmp_path / "speed" / "apex_te_1.3B", "1.3B", {"fast": 139.7})
    _bench_output(tmp_path / "speed" / "te_1.3B", "1.3B", {"fast": 139.5})
    _bench_output(tmp_path / "speed" / "apex_1.3B", "1.3B", {"fast": 138.5})
    made = {r["row"]["install"]: r for r in apex_records.make_records(tmp_path)}
    assert made["apex beside TE"]["figures"]["vs_without_apex"] == round(139.5 / 139.7, 3)
    assert made["apex beside TE"]["versions"]["transformer-engine"] == "2.20.2"
    assert made["TE without apex"]["versions"]["transformer-engine"] == "2.20.2"
    assert made["TE without apex"]["versions"]["apex"] == "hidden"
    assert "transformer-engine" not in made["apex"]["versions"]
    assert all(records.problems(r) == [] for r in made.values())


# apex with its persistent layer norm, no Transformer Engine
APEX_INSTALLED = compat.Installed(transformer_engine=False, apex=True, fused_layer_norm=True,
                                  masked_softmax_kernels=True, gradient_accumulation_kernels=True)
ONE_GPU = ["--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "8",
           "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
           "--global-batch-size", "1", "--train-iters", "2", "--mock-data", "--bf16",
           "--dry-run"]
LOCAL_MODULES = ["--transformer-impl", "local", "--no-fast-spec"]


def test_the_persistent_layer_norm_is_left_where_megatrons_local_norms_would_take_it():
    """megatron's local LayerNorms take apex's persistent kernel by default; it measured
    slower than apex's other kernel, so the launch leaves it, in its plan and with one line,
    unless --persist-layer-norm asks for it. Launches whose norms would not take it (the fast
    spec's, a hidden size without a kernel, CPU mode's torch norms) say nothing of it."""
    from megagpt.launch import resolve

    def launch(*flags, installed=APEX_INSTALLED):
        return resolve([*ONE_GPU, *flags], installed=installed)

    left = launch(*LOCAL_MODULES)
    assert left.arg("no_persist_layer_norm") is True
    choice = left.choice(apex_kernels.PERSISTENT_LAYER_NORM)
    assert choice.value is False and str(choice.reason) == apex_kernels.PERSISTENT_LAYER_NORM_SLOWER
    assert any(apex_kernels.PERSISTENT_LAYER_NORM.name in line and "off" in line
               for line in left.describe())
    assert [line for line in left.log if "persistent kernel measured slower" in line] == [
        f"compat: {apex_kernels.PERSISTENT_LAYER_NORM_SLOWER}; --no-persist-layer-norm"]
    asked = launch(*LOCAL_MODULES, "--persist-layer-norm")
    assert asked.arg("no_persist_layer_norm") is False
    assert asked[apex_kernels.PERSISTENT_LAYER_NORM] is True
    for quiet in (launch(), launch(*LOCAL_MODULES, "--hidden-size", "64", "--num-attention-heads",
                                   "4"), launch(*LOCAL_MODULES, "--no-persist-layer-norm"),
                  resolve([*(f for f in ONE_GPU if f != "--bf16"), *LOCAL_MODULES, "--cpu"],
                          installed=APEX_INSTALLED)):
        assert not quiet.made(apex_kernels.PERSISTENT_LAYER_NORM)
        assert not [line for line in quiet.log if "persistent kernel measured" in line]
    with pytest.raises(compat.MissingDependencyError, match="needs NVIDIA apex built"):
        launch(*LOCAL_MODULES, "--persist-layer-norm", installed=compat.Installed(
            transformer_engine=False, apex=False, fused_layer_norm=False,
            masked_softmax_kernels=False, gradient_accumulation_kernels=False))
    with pytest.raises(UserError, match="opposite kernels"):
        launch(*LOCAL_MODULES, "--persist-layer-norm", "--no-persist-layer-norm")
