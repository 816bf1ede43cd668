import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The switch is read when a kernel module is
# imported, so it is set here, before any test module (in any collection order) imports forerun's kernels.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass


import time  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def virtual_sleep(monkeypatch):
    """sleep(s) advances time.perf_counter (what the engine's timers read) by s seconds at once, without waiting:
    a test makes a step look slow to the timers by a margin no real step on a loaded machine comes near."""
    real, offset = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + offset[0])

    def sleep(seconds: float) -> None:
        offset[0] += seconds

    return sleep
