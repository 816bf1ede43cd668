"""Where forerun keeps what it writes: one root for pulled models, built C kernels, converted tokenizers and the
llama.cpp benchmark build (a leaf module: every layer may import it)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of forerun's cache: $FORERUN_CACHE, else $XDG_CACHE_HOME/forerun, else ~/.cache/forerun."""
    if os.environ.get("FORERUN_CACHE"):
        return Path(os.environ["FORERUN_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "forerun"
    return Path.home() / ".cache" / "forerun"
