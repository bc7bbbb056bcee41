"""Which cuDNN Transformer Engine loads: torch's own where torch bundles one (megagpt.te_cudnn).

The folder layouts are those of torch's pip wheels (``site-packages/nvidia/cudnn/lib``) and of
a torch built against the system's cuDNN (no such folder); whether TE then maps one copy is
checked on the GPU (tests/test_transformer_engine_gpu.py).
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from megagpt import te_cudnn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wheel_site(tmp_path, with_cudnn: bool):
    site = tmp_path / "site-packages"
    (site / "torch").mkdir(parents=True)
    if with_cudnn:
        lib = site / "nvidia" / "cudnn" / "lib"
        lib.mkdir(parents=True)
        (lib / "libcudnn.so.9").write_bytes(b"")
    return site


TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.parametrize("with_cudnn, user_env, expected", [
    (True, {}, "torch's"),                        # pip torch: TE is pointed at its copy
    (True, {"CUDNN_PATH": "/opt/cudnn"}, None),   # the user's choice stands
    (True, {"CUDNN_HOME": "/opt/cudnn"}, None),
    (False, {}, None),                            # torch built against the system's cuDNN
])
def test_te_is_pointed_at_torchs_cudnn_only_where_torch_bundles_one(
        tmp_path, monkeypatch, with_cudnn, user_env, expected):
    site = wheel_site(tmp_path, with_cudnn)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else None)
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    environ = dict(user_env)
    done = te_cudnn.point_te_at_torchs_cudnn(environ, site=site)
    if expected is None:
        assert done is None and environ == user_env
    else:
        assert done == str(site / "nvidia" / "cudnn") == environ["CUDNN_HOME"]


def test_nothing_changes_without_transformer_engine(tmp_path, monkeypatch):
    site = wheel_site(tmp_path, with_cudnn=True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    environ = {}
    assert te_cudnn.point_te_at_torchs_cudnn(environ, site=site) is None and environ == {}


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
