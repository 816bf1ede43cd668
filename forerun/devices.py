"""Host -> device transfers that do not stall the host.

`torch.tensor(x, device="cuda")` copies synchronously: the host waits until every kernel queued before the copy
has finished, so a round's host work could never overlap its GPU work. A non-blocking copy from ordinary
(pageable) host memory is staged by the driver at once and runs in stream order behind those kernels: the host
goes on. Every host list that becomes a device tensor in a round goes through `h2d`. (`device_problem` judges a
--device flag for the command lines.)
"""
from __future__ import annotations

import os

import torch


def kernels_on(flag: str, device: torch.device) -> bool:
    """Whether Triton kernels that stand in for torch ops run: on CUDA by default; the environment variable `flag`
    = 0 keeps the torch ops, = 1 runs the kernels elsewhere too (the CPU under Triton's interpreter: tests)."""
    value = os.environ.get(flag, "")
    return value != "0" and (device.type == "cuda" or value == "1")


def card_switch(flag: str) -> bool | None:
    """An environment variable that overrides a per-card default: True / False for 1 / 0, None if unset (the card
    decides); any other value is a ValueError, so that a misspelt value never passes silently."""
    value = os.environ.get(flag)
    if value not in (None, "0", "1"):
        raise ValueError(f"{flag} must be 0 or 1 (unset: by card), got {value!r}")
    return None if value is None else value == "1"


def device_problem(name: str | None) -> str | None:
    """Why --device NAME cannot run forerun here (one line), or None: forerun runs on cpu and cuda[:N]."""
    if name is None:
        return None
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        return f"--device {name!r}: not a device name (cpu, cuda, cuda:N)"
    if dev.type not in ("cpu", "cuda"):
        return f"--device {name!r}: forerun runs on cpu and cuda only"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {name}: no CUDA device is available here"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def h2d(data, device: torch.device | str | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a list, or a CPU tensor) as a tensor on `device`, queued without waiting for the device."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device is None or torch.device(device).type == "cpu":
        return t
    return t.to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """Queue a device tensor's copy into pinned host memory: (host tensor, CUDA event recorded after the copy:
    synchronize it before reading). On the CPU: (t, None)."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class Marks:
    """Time points in stream order without synchronising: CUDA events on a GPU (read after a later sync, e.g. the
    verification's), perf_counter on the CPU (where the host runs the work itself)."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.points: list = []

    def mark(self) -> int:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.points.append(e)
        else:
            import time

            self.points.append(time.perf_counter())
        return len(self.points) - 1

    def seconds(self, a: int, b: int) -> float:
        """Time from mark a to mark b (waits for mark b if the device has not reached it yet)."""
        if not self.cuda:
            return self.points[b] - self.points[a]
        self.points[b].synchronize()
        return self.points[a].elapsed_time(self.points[b]) * 1e-3
