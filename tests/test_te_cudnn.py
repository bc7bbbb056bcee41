"""Which cuDNN Transformer Engine loads: torch's own where torch bundles one (megagpt.te_cudnn).

The folder layouts are those of torch's pip wheels (``site-packages/nvidia/cudnn/lib``) and of
a torch built against the system's cuDNN (no such folder). Mapping torch's cuDNN libraries is
done for real here where torch's wheel bundles them; whether TE then maps one copy is checked
on the GPU (tests/test_transformer_engine_gpu.py).
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from megagpt import te_cudnn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CUDNN_LIBRARIES = ("libcudnn.so.9", "libcudnn_adv.so.9", "libcudnn_graph.so.9",
                   "libcudnn_heuristic.so.9", "libcudnn_ops.so.9")


def wheel_site(tmp_path, with_cudnn: bool):
    site = tmp_path / "site-packages"
    (site / "torch").mkdir(parents=True)
    if with_cudnn:
        lib = site / "nvidia" / "cudnn" / "lib"
        lib.mkdir(parents=True)
        for name in CUDNN_LIBRARIES:
            (lib / name).write_bytes(b"")
    return site


TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.parametrize("with_cudnn, user_env, expected", [
    (True, {}, "torch's"),                        # pip torch: TE is given its copy
    (True, {"CUDNN_PATH": "/opt/cudnn"}, None),   # the user's choice stands
    (True, {"CUDNN_HOME": "/opt/cudnn"}, None),
    (False, {}, None),                            # torch built against the system's cuDNN
])
def test_te_gets_torchs_cudnn_only_where_torch_bundles_one(
        tmp_path, monkeypatch, with_cudnn, user_env, expected):
    site = wheel_site(tmp_path, with_cudnn)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else None)
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    environ, loaded = dict(user_env), []
    done = te_cudnn.use_torchs_cudnn_for_te(environ, site=site, load=loaded.append)
    if expected is None:
        assert done is None and environ == user_env and loaded == []
    else:
        folder = site / "nvidia" / "cudnn"
        assert done == str(folder) == environ["CUDNN_HOME"]
        # every library of that cuDNN, the one the others link first
        assert [os.path.basename(p) for p in loaded] == [
            "libcudnn_graph.so.9", "libcudnn.so.9", "libcudnn_adv.so.9",
            "libcudnn_heuristic.so.9", "libcudnn_ops.so.9"]
        assert {os.path.dirname(p) for p in loaded} == {str(folder / "lib")}


def test_an_inherited_cudnn_home_of_torchs_folder_still_maps_its_libraries(tmp_path, monkeypatch):
    """A worker started by a process that imported megagpt (torchrun under a launcher, a
    tool's subprocess) inherits CUDNN_HOME: the libraries still have to be mapped in it."""
    site = wheel_site(tmp_path, with_cudnn=True)
    folder = site / "nvidia" / "cudnn"
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else None)
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    environ, loaded = {"CUDNN_HOME": str(folder)}, []
    assert te_cudnn.use_torchs_cudnn_for_te(environ, site=site, load=loaded.append) == str(folder)
    assert environ == {"CUDNN_HOME": str(folder)} and len(loaded) == len(CUDNN_LIBRARIES)


def test_a_library_that_does_not_load_stops_the_mapping(tmp_path):
    folder = wheel_site(tmp_path, with_cudnn=True) / "nvidia" / "cudnn"
    tried = []

    def load(path):
        tried.append(path)
        if "heuristic" in path:
            raise OSError(f"{path}: undefined symbol")

    mapped = te_cudnn.map_torchs_cudnn(folder, load)
    assert [os.path.basename(p) for p in mapped] == [
        "libcudnn_graph.so.9", "libcudnn.so.9", "libcudnn_adv.so.9"]
    assert len(tried) == 4


def test_nothing_changes_without_transformer_engine(tmp_path, monkeypatch):
    site = wheel_site(tmp_path, with_cudnn=True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    environ = {}
    assert te_cudnn.use_torchs_cudnn_for_te(environ, site=site, load=pytest.fail) is None
    assert environ == {}


def test_torchs_folder_is_found_where_torch_is_installed(tmp_path):
    site = wheel_site(tmp_path, with_cudnn=True)
    assert te_cudnn.torchs_cudnn_folder(site) == site / "nvidia" / "cudnn"
    assert te_cudnn.torchs_cudnn_folder(wheel_site(tmp_path / "b", with_cudnn=False)) is None


def test_importing_megagpt_leaves_the_environment_alone_without_te():
    """The package-level call, in a fresh interpreter: without TE nothing is set."""
    out = subprocess.run([sys.executable, "-c", "import os, megagpt; "
                          "print(os.environ.get('CUDNN_HOME'))"], cwd=REPO,
                         env={k: v for k, v in os.environ.items() if k != "CUDNN_HOME"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = str(te_cudnn.torchs_cudnn_folder()) if TE and te_cudnn.torchs_cudnn_folder() \
        else "None"
    assert out.stdout.strip() == expected


@pytest.mark.skipif(te_cudnn.torchs_cudnn_folder() is None,
                    reason="this torch bundles no cuDNN")
def test_torchs_cudnn_is_mapped_from_its_own_folder_alone():
    """For real, in a fresh interpreter: every library of torch's bundled cuDNN maps (no GPU
    needed), all from torch's folder, and the log names that one folder."""
    code = ("from megagpt import te_cudnn as t; f = t.torchs_cudnn_folder(); "
            "print(len(t.map_torchs_cudnn(f)), len(t.torchs_cudnn_libraries(f))); "
            "print(*t.mapped_cudnn_folders()); print(t.cudnn_te_loads({}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    counts, folders, said = out.stdout.splitlines()
    mapped, present = map(int, counts.split())
    assert mapped == present > 0
    assert folders.split() == [str(te_cudnn.torchs_cudnn_folder() / "lib")]
    assert "mapped from" not in said


def test_the_log_names_each_folder_cudnn_is_mapped_from(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0-7f1 r-xp 0 08:01 1 /site/nvidia/cudnn/lib/libcudnn.so.9\n"
        "7f1-7f2 r-xp 0 08:01 2 /site/nvidia/cudnn/lib/libcudnn_graph.so.9\n"
        "7f2-7f3 r-xp 0 08:01 3 /lib/x86_64-linux-gnu/libcudnn_heuristic.so.9\n"
        "7f3-7f4 r-xp 0 08:01 4 /lib/x86_64-linux-gnu/libc.so.6\n")
    folders = te_cudnn.mapped_cudnn_folders(str(maps))
    assert folders == ["/lib/x86_64-linux-gnu", "/site/nvidia/cudnn/lib"]
    said = te_cudnn.cudnn_te_loads({}, folders)
    assert "mapped from 2 folders (/lib/x86_64-linux-gnu, /site/nvidia/cudnn/lib)" in said


@pytest.mark.skipif(te_cudnn.torchs_cudnn_folder() is None,
                    reason="this torch bundles no cuDNN")
def test_a_child_of_a_megagpt_process_maps_torchs_cudnn_too(tmp_path):
    """As under a launcher: the parent's CUDNN_HOME (torch's folder) is inherited, and the
    child still maps torch's cuDNN when it imports megagpt (TE stood in by an empty package,
    so that the child believes TE is installed and not yet imported)."""
    fake = tmp_path / "fake_te" / "transformer_engine"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    folder = te_cudnn.torchs_cudnn_folder()
    env = {**os.environ, "CUDNN_HOME": str(folder),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake_te"), REPO])}
    code = "import megagpt; from megagpt import te_cudnn as t; print(*t.mapped_cudnn_folders())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(folder / "lib")]
