"""attention/cuda_decode.py off the GPU: when the one-launch CUDA decode attention applies (the GPU machine checks
its numbers in tests/test_gpu.py::test_cuda_decode_attention_matches_reference), and its source compiling with
nvcc where a CUDA toolkit is installed."""
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from forerun.attention import cuda_decode
from forerun.attention.metadata import AttnMetadata


def _meta(q_lens, tree=False):
    b = len(q_lens)
    t = sum(q_lens)
    return AttnMetadata(query_start_loc=torch.tensor([0] + q_lens).cumsum(0), seq_lens=torch.full((b,), 40),
                        block_tables=torch.zeros(b, 4, dtype=torch.int64), slot_mapping=torch.zeros(t, dtype=torch.int64),
                        max_query_len=max(q_lens), max_seq_len=40,
                        tree_mask=torch.ones(t, max(q_lens), dtype=torch.bool) if tree else None)


def test_supports_only_pure_bf16_decode(monkeypatch):
    monkeypatch.setattr(cuda_decode, "available", lambda t=None: True)
    k = torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16)
    q = torch.zeros(3, 32, 128, dtype=torch.bfloat16)
    assert cuda_decode.supports(q, k, _meta([1, 1, 1]), None)
    assert not cuda_decode.supports(q, k, _meta([1, 1, 1]), window=64)  # sliding window: Triton
    assert not cuda_decode.supports(q, k, _meta([1, 1, 1], tree=True), None)  # tree verification
    assert not cuda_decode.supports(torch.zeros(4, 32, 128, dtype=torch.bfloat16), k, _meta([2, 1, 1]), None)
    assert not cuda_decode.supports(q.float(), k.float(), _meta([1, 1, 1]), None)
    assert not cuda_decode.supports(torch.zeros(3, 32, 256, dtype=torch.bfloat16),  # D 256: Triton
                                    torch.zeros(8, 16, 8, 256, dtype=torch.bfloat16), _meta([1, 1, 1]), None)
    assert not cuda_decode.supports(torch.zeros(3, 32, 80, dtype=torch.bfloat16),
                                    torch.zeros(8, 16, 8, 80, dtype=torch.bfloat16), _meta([1, 1, 1]), None)
    assert not cuda_decode.supports(torch.zeros(3, 80, 128, dtype=torch.bfloat16), torch.zeros(8, 16, 8, 128,
                                    dtype=torch.bfloat16), _meta([1, 1, 1]), None)  # GQA group of 10
    monkeypatch.setattr(cuda_decode, "available", lambda t=None: False)
    assert not cuda_decode.supports(q, k, _meta([1, 1, 1]), None)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("FORERUN_CUDA_ATTENTION", "0")
    assert not cuda_decode.available()


def test_source_compiles_without_spills_for_common_shapes():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    with tempfile.TemporaryDirectory() as d:
        for dim, group, pdl, trigger in ((128, 4, 1, 0), (128, 8, 1, 1), (64, 1, 0, 0), (128, 2, 1, 2), (64, 8, 1, 0)):
            src = os.path.join(d, "a.cu")
            with open(src, "w") as f:
                f.write(cuda_decode.source(dim, group, bool(pdl), warps=cuda_decode.max_warps(dim, group, 16),
                                           trigger=trigger))
            out = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", os.path.join(d, "a.cubin"), src, "-Xptxas", "-v"],
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            assert "0 bytes spill stores" in out.stderr, (dim, group, out.stderr[-400:])
