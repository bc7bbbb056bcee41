#!/usr/bin/env python3
"""Build the NVIDIA apex extensions megatron-core imports, and nothing else, for one GPU
architecture: bench/gpu_apex_build.sh runs it on the GPU machine.

    python bench/apex_build.py --source .apex --site /tmp/apex-site [--budget 420] [--jobs 16]

apex's own ``setup.py --cuda_ext`` cannot pick extensions: it builds eleven (syncbn, mlp_cuda,
fused_dense_cuda, the rotary and generic softmax kernels, ... which megatron never imports),
and at 25.09 it asks nvcc for sm_70 code in two of them, which CUDA 13 no longer compiles.
Here each extension megatron takes (``megagpt.launch.apex_kernels``) is compiled from apex's sources
with the flags apex's setup.py gives it, for ``TORCH_CUDA_ARCH_LIST`` alone, through
``torch.utils.cpp_extension.load`` (ninja; the same compiler flags and libraries as a
setuptools build of a ``CUDAExtension``). Each extension is its own process with its own
build folder, all at once: together they have about as many sources as the machine has
cores, so the build takes about as long as its slowest source. The most important ones run at
normal priority and the rest niced, so on a busy machine the important ones finish first;
whatever is still compiling when ``--budget`` seconds are up is stopped and left out, and
the summary says so.

The built libraries go into ``--site`` beside apex's Python package (copied from
``--source``), so that ``PYTHONPATH=SITE`` makes apex importable as NVIDIA's containers
install it. Prints one line per extension (seconds, size, or why it is missing) and the total;
writes SITE/apex-build.json with the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# apex setup.py's macros for torch >= 1.5 (25.09's sources still test them)
VERSION_MACROS = ("-DVERSION_GE_1_1", "-DVERSION_GE_1_3", "-DVERSION_GE_1_5")
# what apex setup.py gives its kernels for megatron: half/bfloat16 operators back on
# (torch's extension flags turn them off), lambdas and constexpr in device code
HALF_OPERATORS = ("-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__")
BF16_OPERATORS = ("-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__")
DEVICE_LAMBDAS = ("--expt-relaxed-constexpr", "--expt-extended-lambda")
MEGATRON_KERNEL_FLAGS = ("-O3", *HALF_OPERATORS, *DEVICE_LAMBDAS)


@dataclass(frozen=True)
class Extension:
    """One compiled module, as apex's setup.py (25.09) declares it, less its -gencode list."""

    name: str
    sources: tuple[str, ...]  # relative to apex's source root
    nvcc: tuple[str, ...]
    cxx: tuple[str, ...] = ("-O3", *VERSION_MACROS)
    includes: tuple[str, ...] = ()  # relative to apex's source root
    setup_flag: str = "--cuda_ext"  # the apex setup.py option that builds it
    # built at lower CPU priority: it matters less (megagpt.launch.apex_kernels)
    niced: bool = False


def _megatron_kernel(name: str, *sources: str, fast_math: bool = False,
                     niced: bool = True) -> Extension:
    return Extension(name, tuple(f"csrc/megatron/{s}" for s in sources),
                     (*MEGATRON_KERNEL_FLAGS, *(("--use_fast_math",) if fast_math else ()),
                      *VERSION_MACROS), includes=("csrc",), niced=niced)


AMP_C_KERNELS = ("sgd_kernel", "scale_kernel", "axpby_kernel", "l2norm_kernel",
                 "l2norm_kernel_mp", "l2norm_scale_kernel", "lamb_stage_1", "lamb_stage_2",
                 "adam", "adagrad", "novograd", "lamb", "lamb_mp")

# in the order they matter: the weight-gradient kernel (megatron's linears refuse
# --gradient-accumulation-fusion without it), the optimizer's kernels, the norm megatron's
# local spec builds once `import apex` works; then the softmax kernels and the persistent norm
EXTENSIONS: tuple[Extension, ...] = (
    _megatron_kernel("fused_weight_gradient_mlp_cuda", "fused_weight_gradient_dense.cpp",
                     "fused_weight_gradient_dense_cuda.cu",
                     "fused_weight_gradient_dense_16bit_prec_cuda.cu", fast_math=True,
                     niced=False),
    Extension("amp_C", ("csrc/amp_C_frontend.cpp",
                        *(f"csrc/multi_tensor_{k}.cu" for k in AMP_C_KERNELS),
                        "csrc/update_scale_hysteresis.cu"),
              ("-lineinfo", "-O3", "--use_fast_math", *VERSION_MACROS)),
    Extension("fused_layer_norm_cuda", ("csrc/layer_norm_cuda.cpp",
                                        "csrc/layer_norm_cuda_kernel.cu"),
              ("-maxrregcount=50", "-O3", "--use_fast_math", *VERSION_MACROS)),
    _megatron_kernel("scaled_upper_triang_masked_softmax_cuda",
                     "scaled_upper_triang_masked_softmax.cpp",
                     "scaled_upper_triang_masked_softmax_cuda.cu"),
    _megatron_kernel("scaled_masked_softmax_cuda", "scaled_masked_softmax.cpp",
                     "scaled_masked_softmax_cuda.cu"),
    _megatron_kernel("scaled_softmax_cuda", "scaled_softmax.cpp", "scaled_softmax_cuda.cu"),
    Extension("fast_layer_norm", tuple(f"apex/contrib/csrc/layer_norm/{s}" for s in (
        "ln_api.cpp", "ln_fwd_cuda_kernel.cu", "ln_bwd_semi_cuda_kernel.cu")),
              ("-O3", *HALF_OPERATORS, *BF16_OPERATORS, *DEVICE_LAMBDAS, "--use_fast_math",
               *VERSION_MACROS),
              includes=("apex/contrib/csrc/layer_norm",), setup_flag="--fast_layer_norm",
              niced=True),
)
BY_NAME = {e.name: e for e in EXTENSIONS}


def generator_flags() -> tuple[str, ...]:
    """apex setup.py's -DOLD_GENERATOR_PATH where torch still has ATen/CUDAGeneratorImpl.h."""
    import torch

    old = Path(torch.__path__[0], "include", "ATen", "CUDAGeneratorImpl.h").exists()
    return ("-DOLD_GENERATOR_PATH",) if old else ()


def cuda_home() -> str:
    """The CUDA install to compile with: CUDA_HOME if set, else /usr/local/cuda where it has
    nvcc. torch's own guess is the folder above the first nvcc on PATH, which for a wrapper
    script in /usr/local/bin is /usr/local, whose lib64 has no libcudart to link."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    return "/usr/local/cuda" if Path("/usr/local/cuda/bin/nvcc").exists() else ""


def nvcc_release() -> str:
    """nvcc's release line ("Cuda compilation tools, release 13.0, V13.0.88")."""
    nvcc = Path(cuda_home() or "/usr/local/cuda", "bin", "nvcc")
    try:
        out = subprocess.run([str(nvcc) if nvcc.exists() else "nvcc", "--version"],
                             capture_output=True, text=True, timeout=60).stdout
    except OSError:
        return "unknown"
    return next((line for line in out.splitlines() if "release" in line), "unknown").strip()


def cuda_header_path() -> str:
    """CPATH for the compilers: the headers of the CUDA libraries torch's wheels bring (torch's
    own headers include cusparse.h and cublas headers, which a CUDA install holding only the
    compiler lacks), then the CUDA install's, as TE's build on the GPU machine sets it."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(str(d) for root in roots for d in Path(root).glob("*/include") if d.is_dir())
    home = cuda_home() or "/usr/local/cuda"
    return os.pathsep.join([*found, f"{home}/include",
                            *filter(None, [os.environ.get("CPATH", "")])])


def build_one(ext: Extension, source: Path, build_dir: Path) -> None:
    """Compile and link one extension into ``build_dir`` (this process; imports it after)."""
    from torch.utils.cpp_extension import load

    includes = [str(source / d) for d in ext.includes]
    generator = generator_flags() if ext.name == "fast_layer_norm" else ()
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's build waits, silently and for ever, on a lock file that a build stopped
    # mid-way (a killed call, an ended session) left behind; the extensions are built one
    # process each, so no other build holds this one
    (build_dir / "lock").unlink(missing_ok=True)
    load(name=ext.name, sources=[str(source / s) for s in ext.sources],
         extra_cflags=[*ext.cxx, *generator],
         extra_cuda_cflags=[*ext.nvcc, *generator, *(f"-I{d}" for d in includes)],
         extra_include_paths=includes, build_directory=str(build_dir), verbose=True,
         with_cuda=True)


def _start(ext: Extension, source: Path, build_root: Path, jobs: int) -> subprocess.Popen:
    log = open(build_root / f"{ext.name}.log", "w")
    env = dict(os.environ, MAX_JOBS=str(jobs), CPATH=cuda_header_path())
    if cuda_home():
        env["CUDA_HOME"] = cuda_home()
    cmd = [sys.executable, __file__, "--one", ext.name, "--source", str(source),
           "--build-root", str(build_root)]
    if ext.niced:
        cmd = ["nice", "-n", "10", *cmd]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """The extension's process and its ninja and compilers (a process group of their own)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def build_all(names: list[str], source: Path, build_root: Path, site: Path, budget: float,
              cores: int) -> dict:
    """Every extension of ``names`` at once; the finished ones copied into ``site``."""
    build_root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    running = {}
    for name in names:
        ext = BY_NAME[name]
        running[name] = (_start(ext, source, build_root, min(len(ext.sources), cores)),
                         time.monotonic())
    results = {}
    while running:
        for name, (proc, t0) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[name]
            results[name] = _result(name, rc, time.monotonic() - t0, build_root, site)
            print(_line(name, results[name]), flush=True)
        if running and time.monotonic() - started > budget:
            for name, (proc, t0) in running.items():
                _stop(proc)
                results[name] = dict(built=False, seconds=round(time.monotonic() - t0, 1),
                                     why=f"not finished within the {budget:.0f} s budget")
                print(_line(name, results[name]), flush=True)
            running = {}
        time.sleep(0.5)
    return dict(extensions={n: results[n] for n in names},
                total_s=round(time.monotonic() - started, 1))


def _result(name: str, rc: int, seconds: float, build_root: Path, site: Path) -> dict:
    built = build_root / name / f"{name}.so"
    if rc != 0 or not built.exists():
        tail = (build_root / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
        errors = [line for line in tail if "error" in line.lower()] or tail[-3:]
        return dict(built=False, seconds=round(seconds, 1),
                    why=f"build failed (rc {rc}): {' | '.join(errors)[:600]}")
    shutil.copy2(built, site / built.name)
    return dict(built=True, seconds=round(seconds, 1),
                mib=round(built.stat().st_size / 2**20, 1))


def _line(name: str, r: dict) -> str:
    if r["built"]:
        return f"apex build: {name}: {r['seconds']:.0f} s, {r['mib']} MiB"
    return f"apex build: {name}: MISSING after {r['seconds']:.0f} s: {r['why']}"


def copy_python_package(source: Path, site: Path) -> None:
    """apex's Python package (no compiled parts) into ``site``, as its own install puts it."""
    shutil.rmtree(site / "apex", ignore_errors=True)
    shutil.copytree(source / "apex", site / "apex",
                    ignore=shutil.ignore_patterns("csrc", "test", "tests", "__pycache__"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", type=Path, default=Path(".apex"),
                   help="apex's source (bench/gpu_apex_carry.sh makes .apex)")
    p.add_argument("--site", type=Path, default=Path("/tmp/apex-site"))
    p.add_argument("--build-root", type=Path, default=Path("/tmp/apex-build"))
    p.add_argument("--budget", type=float, default=420,
                   help="seconds; what is still compiling then is stopped and left out")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="cores: no extension compiles more sources at once than this")
    p.add_argument("--only", default="", help="comma-separated extensions (default: all)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a worker: build this one extension
    a = p.parse_args(argv)
    source = a.source.resolve()
    if not (source / "setup.py").is_file() or not (source / "csrc").is_dir():
        print(f"error: no apex source at {a.source}: run bench/gpu_apex_carry.sh here and "
              "carry .apex", file=sys.stderr)
        return 2
    if a.one:
        build_one(BY_NAME[a.one], source, a.build_root.resolve() / a.one)
        return 0
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        print("error: set TORCH_CUDA_ARCH_LIST (e.g. 9.0): the build is for one architecture",
              file=sys.stderr)
        return 2
    names = [n for n in a.only.split(",") if n] or [e.name for e in EXTENSIONS]
    unknown = sorted(set(names) - set(BY_NAME))
    if unknown:
        print(f"error: unknown extensions {unknown}; known: {', '.join(BY_NAME)}",
              file=sys.stderr)
        return 2
    names = [e.name for e in EXTENSIONS if e.name in names]  # in the order they matter
    site = a.site.resolve()
    site.mkdir(parents=True, exist_ok=True)
    copy_python_package(source, site)
    summary = build_all(names, source, a.build_root.resolve(), site, a.budget, a.jobs)
    import torch

    summary.update(arch=os.environ["TORCH_CUDA_ARCH_LIST"], torch=torch.__version__,
                   cuda=torch.version.cuda, nvcc=nvcc_release(),
                   source=dict(line.split(" ", 1) for line in (
                       source / "SOURCE").read_text().splitlines() if " " in line)
                   if (source / "SOURCE").exists() else None)
    (site / "apex-build.json").write_text(json.dumps(summary, indent=1))
    built = [n for n, r in summary["extensions"].items() if r["built"]]
    print(f"apex build: {len(built)} of {len(names)} extensions in {summary['total_s']:.0f} s "
          f"(TORCH_CUDA_ARCH_LIST={summary['arch']})", flush=True)
    return 0 if len(built) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
