"""llama.cpp as a benchmark peer: build once from a PyPI source package, then time it.

Why: the CPU bench compares forerun against llama.cpp on the same GGUF files, prompts and threads
(issue 12). llama.cpp is never a runtime dependency of forerun: this script downloads the
``llama-cpp-python`` source distribution with pip (the only registry reachable here), builds the
vendored llama.cpp tools once with CMake into a cache directory, and later runs the binaries as
subprocesses.

    python benchmarks/llamacpp.py build        # ~10 min on 2 cores, cached afterwards
    python benchmarks/llamacpp.py where        # prints the bin dir (or nothing)

The timing helpers (`run_plain`, `run_speculative`) are used by ``forerun/bench.py``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# where the build lives and its ISA flags: one definition, shared with `forerun bench --llamacpp`
from forerun.bench import llamacpp_build_config, llamacpp_built, llamacpp_dir  # noqa: E402

CACHE = llamacpp_dir()
PACKAGE = "llama-cpp-python"
TARGETS = ("llama-completion", "llama-speculative", "llama-bench", "llama-simple", "llama-speculative-simple")


def bin_dir() -> Path | None:
    """The directory holding the built tools, or None when not built yet."""
    return llamacpp_built()


def _source_dir(log) -> Path:
    src = sorted(CACHE.glob("src/*/vendor/llama.cpp"))
    if src:
        return src[-1]
    (CACHE / "dl").mkdir(parents=True, exist_ok=True)
    tars = sorted((CACHE / "dl").glob("*.tar.gz"))
    if not tars:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "-d", str(CACHE / "dl"), PACKAGE]
        log(" ".join(cmd))
        subprocess.run(cmd, check=True)
        tars = sorted((CACHE / "dl").glob("*.tar.gz"))
    (CACHE / "src").mkdir(parents=True, exist_ok=True)
    with tarfile.open(tars[-1]) as tf:
        members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name or m.name.endswith("/vendor/llama.cpp")]
        tf.extractall(CACHE / "src", members=members, filter="data")
    return sorted(CACHE.glob("src/*/vendor/llama.cpp"))[-1]


def build(jobs: int = 2, log=print) -> Path:
    """Configure and build the llama.cpp tools (CPU: native ISA, or without AMX where the CPU has it; no curl)
    into CACHE/<build folder> (forerun.bench.llamacpp_build_config)."""
    if bin_dir() is not None:
        return bin_dir()
    src = _source_dir(log)
    name, isa = llamacpp_build_config()
    bdir = CACHE / name
    cfg = ["cmake", "-S", str(src), "-B", str(bdir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
           *isa, "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_BUILD_TESTS=OFF"]
    log(" ".join(cfg))
    subprocess.run(cfg, check=True)
    cmd = ["cmake", "--build", str(bdir), "-j", str(jobs), "--target", *TARGETS]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True)
    return bdir / "bin"


def version() -> str:
    """The vendored llama.cpp build number/commit, for the bench table."""
    d = bin_dir()
    if d is None:
        return "not built"
    out = subprocess.run([str(d / "llama-completion"), "--version"], capture_output=True, text=True)
    m = re.search(r"version: (\S+) \(build (\d+), commit (\w+)\)", out.stdout + out.stderr)
    return f"{m.group(1)} commit {m.group(3)}" if m else "unknown"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["build", "where", "version"])
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    if a.what == "build":
        print(build(a.jobs))
    elif a.what == "where":
        print(bin_dir() or "")
    else:
        print(version())
