"""The GPU int4 and int8 word-layout kernels (forerun/kernels/quant_gemm.py) and the CUDA linears built on them
(forerun/models/quant_cuda.py: CudaQ4Linear, CudaQ8Linear) against x @ dequantized(W)^T: the Triton kernels
without inline PTX in Triton's CPU interpreter (fp16: the interpreter has no bf16 dot), the PTX kernels on the
GPU machine, their arithmetic emulated bit for bit on the CPU. Timing lives in benchmarks/quant_decode_gpu.py."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from forerun.kernels.quant_gemm import (pack_int4_w32, quantize_int4, repack_int4_w32, unpack_int4,
                                        unpack_int4_w32, x_pairs_f16)
from forerun.models.quant import quantize_groups_int4
from forerun.models.quant_cuda import CudaQ4Linear


def test_word_layout_round_trips():
    q = torch.randint(0, 16, (24, 256), dtype=torch.uint8)
    w = pack_int4_w32(q)
    assert w.dtype == torch.int32 and w.shape == (24, 32)
    assert torch.equal(unpack_int4_w32(w), q)
    assert int(w[0, 0]) == sum(int(q[0, 2 * j]) << (4 * j) | int(q[0, 2 * j + 1]) << (16 + 4 * j) for j in range(4)) \
        - (2 ** 32 if q[0, 7] >= 8 else 0)  # code 8i + 2j at bits 4j, code 8i + 2j + 1 at bits 16 + 4j
    qw, _, _ = quantize_int4(torch.randn(8, 256))
    assert torch.equal(unpack_int4_w32(repack_int4_w32(qw)), unpack_int4(qw))


def test_cuda_q4_linear_dequantizes_its_groups_and_falls_back_off_gpu():
    torch.manual_seed(0)  # the fallback computes in bf16: about 1 % error at worst, so fixed inputs
    w = torch.randn(48, 256).to(torch.bfloat16)
    lin = CudaQ4Linear.from_float(w)
    q, s, z = quantize_groups_int4(w)
    assert torch.equal(unpack_int4_w32(lin.qw32), q)
    ref = (q.float().reshape(48, 8, 32) * s.bfloat16().float()[..., None] + z.bfloat16().float()[..., None]).reshape(48, 256)
    assert (lin.dequantized().float() - ref).abs().max() <= 0.02 * ref.abs().max()
    assert (ref - w.float()).abs().max() <= (w.float().amax() - w.float().amin()) / 15  # half a step per group
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = x.float() @ ref.t()
    assert ((lin(x).float() - y).abs().max() / y.abs().max()) < 1e-2
    glu = torch.nn.functional.silu(y[:, :24]) * y[:, 24:]
    assert ((lin.glu(x).float() - glu).abs().max() / glu.abs().max()) < 1e-2
    assert lin.weight_bytes == 48 * 256 // 2 + 2 * 2 * 48 * 8


def _in_interpreter(code: str) -> None:
    """Run `code` (which prints "ok" at its end) in a fresh process under Triton's CPU interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_word_layout_kernels_in_interpreter():
    code = """
import numpy as np
import pytest
import torch
from forerun.kernels.quant_gemm import *
torch.manual_seed(0)
w = torch.randn(64, 512)
qw, s, z = quantize_int4(w.half())
q32 = repack_int4_w32(qw)
wd = dequantize_int4(qw, s, z)
for m in (1, 2, 3, 16):
    x = torch.randn(m, 512).half()
    ref = x.float() @ wd.t()
    glu = torch.nn.functional.silu(ref[:, :32]) * ref[:, 32:]
    for fn in (q4w_linear, q4w2_linear):
        for dot in ((False, True) if m <= 2 else (True,)):
            for bk in (128, 256):
                y = fn(x, q32, s, z, use_dot=dot, block_k=bk, block_n=16)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                assert err < 3e-3, (fn.__name__, m, dot, bk, err)
                y = fn(x, q32, s, z, use_dot=dot, block_k=bk, block_n=16, glu=True)
                err = ((y.float() - glu).abs().max() / glu.abs().max()).item()
                assert err < 5e-3, ("glu", fn.__name__, m, dot, bk, err)
print("ok")
"""
    _in_interpreter(code)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX: CUDA only (run on the GPU machine)")
def test_packed_f16_decode_kernel_on_gpu():
    """q4v_linear (inline-PTX unpacking, f16 pair products) against x @ dequantized(W)^T in float32, 1 and 2 rows,
    plain and fused SwiGLU, one and several K steps, small and large activations (the f16 pre-scaling)."""
    from forerun.kernels.quant_gemm import q4v_linear, x_pairs_f16
    torch.manual_seed(0)
    w = torch.randn(96, 1024, device="cuda") * 0.05
    q, s, z = quantize_groups_int4(w)
    q32 = pack_int4_w32(q)
    s, z = s.to(torch.bfloat16), z.to(torch.bfloat16)
    wd = (q.float().reshape(96, 32, 32) * s.float()[..., None] + z.float()[..., None]).reshape(96, 1024)
    for m in (1, 2):
        for amp in (1.0, 3000.0):
            x = (torch.randn(m, 1024, device="cuda") * amp).to(torch.bfloat16)
            ref = x.float() @ wd.t()
            glu = torch.nn.functional.silu(ref[:, :48]) * ref[:, 48:]
            for bk in (256, 1024):
                for bn in (4, 16):
                    y = q4v_linear(x, q32, s, z, block_k=bk, block_n=bn)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    assert err < 1e-2, (m, amp, bk, bn, err)
                    # activations converted beforehand (x_pairs_f16): the same result bit for bit
                    assert torch.equal(q4v_linear(x, q32, s, z, block_k=bk, block_n=bn, x_pairs=x_pairs_f16(x)), y)
                    y = q4v_linear(x, q32, s, z, block_k=bk, block_n=bn, glu=True)
                    err = ((y.float() - glu).abs().max() / glu.abs().max()).item()
                    assert err < 2e-2, ("glu", m, amp, bk, bn, err)
                    assert torch.equal(q4v_linear(x, q32, s, z, block_k=bk, block_n=bn, glu=True,
                                                  x_pairs=x_pairs_f16(x)), y)
    # a broken unpacking (nibbles of the wrong word half) must not pass: swap the code halves
    bad = pack_int4_w32(q.reshape(96, -1, 2).flip(-1).reshape(96, 1024))
    x = torch.randn(1, 1024, device="cuda").to(torch.bfloat16)
    ref = x.float() @ wd.t()
    assert ((q4v_linear(x, bad, s, z).float() - ref).abs().max() / ref.abs().max()).item() > 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX: CUDA only (run on the GPU machine)")
def test_tensor_core_verify_kernel_on_gpu():
    """q4t_linear (inline-PTX bf16 dequantization, tensor-core products) against x @ dequantized(W)^T, 1..16 rows,
    plain and SwiGLU, K steps of 64..256; and CudaQ4Linear on a width that is not a multiple of 256 (896)."""
    from forerun.kernels.quant_gemm import q4t_linear
    torch.manual_seed(0)
    for n, k in ((192, 1024), (128, 896)):
        q, q32, s, z, wd = _cuda_int4_weights(n, k)
        lin = CudaQ4Linear(q, s, z)
        for m in (1, 2, 3, 5, 16):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = x.float() @ wd.t()
            glu = torch.nn.functional.silu(ref[:, :n // 2]) * ref[:, n // 2:]
            for bk in ((64, 128) if k == 896 else (128, 256)):
                y = q4t_linear(x, q32, s, z, block_k=bk, block_n=64)
                assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, (m, bk)
                y = q4t_linear(x, q32, s, z, block_k=bk, block_n=64, glu=True)
                assert ((y.float() - glu).abs().max() / glu.abs().max()).item() < 2e-2, ("glu", m, bk)
            y = lin(x)  # tuned or default configuration, K steps shrunk to divide K
            assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, ("CudaQ4Linear", m, k)
            y = lin.glu(x)
            assert ((y.float() - glu).abs().max() / glu.abs().max()).item() < 2e-2, ("CudaQ4Linear glu", m, k)
            if m <= 2:
                from forerun.kernels.quant_gemm import q4v_linear
                y = q4v_linear(x, q32, s, z)  # default K step: the largest power of two dividing K
                assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, ("q4v", m, k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX: CUDA only (run on the GPU machine)")
def test_short_verify_kernel_on_gpu():
    """q4r_linear (packed f16, one unpacking per 4 rows) against x @ dequantized(W)^T for 1..8 rows, plain and
    SwiGLU, one and several K steps, a width that is not a power of two (896)."""
    from forerun.kernels.quant_gemm import q4r_linear
    torch.manual_seed(0)
    for n, k, bks in ((96, 1024, (256, 1024)), (64, 896, (128,))):
        q, q32, s, z, wd = _cuda_int4_weights(n, k)
        for m in range(1, 9):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = x.float() @ wd.t()
            glu = torch.nn.functional.silu(ref[:, :n // 2]) * ref[:, n // 2:]
            for bk in bks:
                y = q4r_linear(x, q32, s, z, block_k=bk, block_n=4)
                assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, (m, k, bk)
                y = q4r_linear(x, q32, s, z, block_k=bk, block_n=4, glu=True)
                assert ((y.float() - glu).abs().max() / glu.abs().max()).item() < 2e-2, ("glu", m, k, bk)


def _emulate_q4v_word(words: np.ndarray, xpairs: list) -> np.ndarray:
    """The PTX block of `_q4v_kernel` (quant_gemm._Q4_WORD_UNPACK / _Q4_WORD_DOT) step by step in numpy, bit for
    bit in float16: words uint32 [n]; xpairs: 4 float16 arrays [n, 2] (the activations 8i+2j, 8i+2j+1,
    pre-scaled) -> the word's dot product as float32 [n]."""
    m = np.uint32(0x64006400)
    h = words >> np.uint32(8)
    t = [(words & np.uint32(0x000F000F)) | m, (words & np.uint32(0x00F000F0)) | m,
         (h & np.uint32(0x000F000F)) | m, (h & np.uint32(0x00F000F0)) | m]  # lop3 (a & b) | c
    magic = np.array([1024, 1024], dtype=np.float16)
    a = np.zeros((len(words), 2), dtype=np.float16)
    for j in range(4):
        pair = t[j].view(np.float16).reshape(-1, 2) - magic  # sub.f16x2: exact
        a = (pair.astype(np.float32) * xpairs[j].astype(np.float32) + a.astype(np.float32)).astype(np.float16)
    return a.astype(np.float32).sum(1)


def test_packed_f16_unpacking_matches_the_word_layout():
    """CPU check of the decode kernel's arithmetic (the PTX itself runs on the GPU machine): unpacking a word
    with lop3 masks into the f16 magic 1024 + c gives, in the f16 pair j, the codes 8i + 2j and 8i + 2j + 1 of
    pack_int4_w32 (times 16 for odd j), so with activations pre-scaled by 1/16 and 1/256 the word's products
    times 16 equal the exact dot product to f16 rounding -- and nothing of this survives a changed layout."""
    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.integers(0, 16, (16, 32), dtype=np.uint8))  # 16 rows of 4 words
    words = pack_int4_w32(q).numpy().reshape(-1).view(np.uint32)  # [64] words, 8 codes each
    q = q.reshape(64, 8)
    x = rng.standard_normal((64, 8)).astype(np.float32) * 3
    pairs = [(x[:, 2 * j: 2 * j + 2] * (1 / 16 if j % 2 == 0 else 1 / 256)).astype(np.float16) for j in range(4)]
    got = 16 * _emulate_q4v_word(words, pairs)
    want = (q.numpy().astype(np.float64) * x).sum(1)
    # x_pairs_f16 (the activations converted once, outside the kernel) makes exactly these pairs and group sums
    xb = torch.from_numpy(x).to(torch.bfloat16).reshape(16, 32)
    conv, sums = x_pairs_f16(xb)
    xf = xb.float().numpy().reshape(64, 8)
    want_pairs = [(xf[:, 2 * j: 2 * j + 2] * (1 / 16 if j % 2 == 0 else 1 / 256)).astype(np.float16) for j in range(4)]
    assert np.array_equal(conv.numpy().view(np.float16).reshape(64, 4, 2), np.stack(want_pairs, 1))
    assert torch.allclose(sums, xb.float().reshape(16, 1, 32).sum(-1), rtol=0, atol=1e-5)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()  # measured 5e-4 (f16 rounding)
    swapped = pack_int4_w32(q.reshape(64, 4, 2).flip(-1).reshape(16, 32)).numpy().reshape(-1).view(np.uint32)
    assert np.abs(16 * _emulate_q4v_word(swapped, pairs) - want).max() > 0.05 * np.abs(want).max()


def _emulate_dp4a_row(words: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4_cuda's DP4A path for one weight row, its index arithmetic transcribed: store_word8 writes word i of the
    activation row x [8 * 4G] into xq8 (uint2 units: [(c / 2) * 2G + 2g + c % 2]), the dot loop reads xq[g] and
    xq[G + g] (uint4 units) and group_dot8 takes each weight word in two masks (low / high nibbles of its bytes)
    against them with dp4a. Returns (the int32 dot per group, the int8 row in x's order)."""
    G = len(words) // 4
    xq8 = np.zeros(4 * G * 2, np.uint32)  # the smem area as 32-bit words: uint2 index u -> [2u, 2u + 1]
    q8 = np.zeros(8 * 4 * G, np.int64)
    for g in range(G):
        a = x[32 * g: 32 * g + 32].astype(np.float32)
        m = np.float32(np.abs(a).max())
        inv = np.float32(127.0) / m if m > np.float32(1e-30) else np.float32(0.0)
        q = np.rint(a * inv).astype(np.int64)  # __float2int_rn: to nearest, ties to even
        q8[32 * g: 32 * g + 32] = q
        for c in range(4):
            b = q[8 * c: 8 * c + 8]  # word i = 4g + c: q0..q7
            pack = [int(np.uint32(np.int64(b0) & 0xFF | (np.int64(b1) & 0xFF) << 8 | (np.int64(b2) & 0xFF) << 16
                                  | (np.int64(b3) & 0xFF) << 24)) for b0, b1, b2, b3 in
                    ((b[0], b[4], b[1], b[5]), (b[2], b[6], b[3], b[7]))]
            u = (c >> 1) * 2 * G + 2 * g + (c & 1)
            xq8[2 * u], xq8[2 * u + 1] = pack
    sbytes = lambda v: np.frombuffer(np.uint32(v).tobytes(), np.int8).astype(np.int64)  # noqa: E731
    dots = np.zeros(G, np.int64)
    for g in range(G):
        xa, xb = xq8[4 * g: 4 * g + 4], xq8[4 * (G + g): 4 * (G + g) + 4]
        acts = [xa[0], xa[1], xa[2], xa[3], xb[0], xb[1], xb[2], xb[3]]
        w = words[4 * g: 4 * g + 4]
        parts = [p for wd in w for p in (wd & 0x0F0F0F0F, (wd >> 4) & 0x0F0F0F0F)]
        dots[g] = sum(int((sbytes(p) * sbytes(a)).sum()) for p, a in zip(parts, acts))
    return dots, q8


def test_dp4a_unpacking_and_row_layout_match_the_word_layout():
    """CPU check of q4_cuda's DP4A path (the kernel runs on the GPU machine): with its shared-memory indices and
    byte order transcribed, each group's dp4a sum equals the exact dot product of pack_int4_w32's codes with the
    int8-rounded activations (max |a| of the group -> 127); a layout with the code halves swapped does not. The
    transcribed lines are checked to be the kernel's."""
    from forerun.kernels import q4_cuda
    for line in ("xq8[(c >> 1) * 2 * G + 2 * g + (c & 1)] = make_uint2(pack4(q0, q4, q1, q5), pack4(q2, q6, q3, q7));",
                 "const uint4 xa = xq[g], xb = xq[G_ + g];", "int s = __dp4a((int)(w.x & m), (int)a.x, 0);",
                 "s = __dp4a((int)((w.x >> 4) & m), (int)a.y, s);", "s = __dp4a((int)(w.y & m), (int)a.z, s);",
                 "s = __dp4a((int)((w.y >> 4) & m), (int)a.w, s);", "s = __dp4a((int)(w.z & m), (int)b.x, s);",
                 "s = __dp4a((int)((w.z >> 4) & m), (int)b.y, s);", "s = __dp4a((int)(w.w & m), (int)b.z, s);",
                 "return __dp4a((int)((w.w >> 4) & m), (int)b.w, s);"):
        assert line in q4_cuda._SRC, f"q4_cuda's DP4A path changed: update the emulation here ({line})"
    rng = np.random.default_rng(0)
    k = 320  # 10 groups: the planes' offsets (2G) are not a power of two
    q = torch.from_numpy(rng.integers(0, 16, (1, k), dtype=np.uint8))
    words = pack_int4_w32(q).numpy().reshape(-1).view(np.uint32)
    x = rng.standard_normal(k).astype(np.float32) * 3
    dots, q8 = _emulate_dp4a_row(words, x)
    assert np.abs(q8).max() == 127 and (np.abs(q8) <= 127).all()
    want = (q.numpy().astype(np.int64).reshape(-1, 32) * q8.reshape(-1, 32)).sum(1)
    assert np.array_equal(dots, want)
    swapped = pack_int4_w32(q.reshape(-1, 2).flip(-1).reshape(1, k)).numpy().reshape(-1).view(np.uint32)
    assert not np.array_equal(_emulate_dp4a_row(swapped, x)[0], want)


def test_int8_rows_reference_rounds_as_the_kernel_and_the_accuracy_emulation_uses_it():
    """q4_cuda.int8_rows_reference (the GPU test's and quant_accuracy.py's stand-in for the DP4A kernel's rounding)
    equals the kernel's steps as _emulate_dp4a_row transcribes them (numpy float32, true division, ties to even) on
    bf16 rows, where many products sit exactly on a half, and on float rows with a zero group; torch's `127.0 / m`
    would not (the power check, session 65's fault). quant_accuracy.py's a8 emulation of a CudaQ4Linear is that row times the exactly
    dequantized weights, its x32 emulation the row as it is."""
    import importlib.util
    from pathlib import Path
    from forerun.kernels.q4_cuda import int8_rows_reference
    from forerun.kernels.quant_gemm import unpack_int4_w32
    torch.manual_seed(0)
    x = (torch.randn(64, 256) * 3).to(torch.bfloat16).float()
    x[3, 32:64] = 0.0
    a, d = int8_rows_reference(x)
    words = np.zeros(256 // 8, np.uint32)  # (the codes do not matter here: only the rounded row is compared)
    want = np.stack([_emulate_dp4a_row(words, row)[1] for row in x.numpy()]).reshape(64, -1, 32)
    m = np.abs(x.numpy().reshape(64, -1, 32)).max(-1, keepdims=True)
    assert np.array_equal(a.numpy(), want) and np.array_equal(d.numpy(), m * np.float32(1 / 127))
    assert (a[3, 1] == 0).all() and a.abs().amax().item() == 127
    mt = x.reshape(64, -1, 32).abs().amax(-1, keepdim=True)
    assert not torch.equal(a, torch.round(x.reshape(64, -1, 32) * (127.0 / mt).nan_to_num(0.0, 0.0, 0.0)))

    spec = importlib.util.spec_from_file_location(
        "quant_accuracy", Path(__file__).resolve().parents[1] / "benchmarks" / "quant_accuracy.py")
    qa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qa)
    lin = CudaQ4Linear.from_float(torch.randn(48, 256) * 0.05)  # bf16 scales / offsets
    q = unpack_int4_w32(lin.qw32)
    assert torch.equal(pack_int4_w32(q), lin.qw32)
    w = (q.reshape(48, 8, 32).float() * lin.scale.float()[..., None] + lin.zero.float()[..., None]).reshape(48, 256)
    model = torch.nn.Sequential(lin)
    xb = x[:5].to(torch.bfloat16)
    assert qa.emulate_one_row_kernel(model, "x32") == 1
    assert torch.equal(lin(xb), (xb.float() @ w.t()).to(torch.bfloat16))
    assert qa.emulate_one_row_kernel(model, "a8") == 1
    a5, d5 = int8_rows_reference(xb.float())
    assert torch.equal(lin(xb), ((a5 * d5).reshape(5, 256) @ w.t()).to(torch.bfloat16))
    assert not torch.equal(lin(xb), (xb.float() @ w.t()).to(torch.bfloat16))
    with pytest.raises(ValueError, match="a8 or x32"):
        qa.emulate_one_row_kernel(model, "a4")


def test_dequant_kernel_in_interpreter_equals_the_groups_exactly():
    """dequantize_int4_w32 (products of more than 16 rows: long verification at a batch, prefill) gives every
    weight as code * scale + zero of its own group, rounded once: a swapped nibble, half-word or group fails."""
    code = """
import torch
from forerun.kernels.quant_gemm import dequantize_int4_w32, pack_int4_w32
torch.manual_seed(0)
n, k = 40, 320  # rows past one 16-row tile, words (40) past a 64-word tile only in the masks
q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
s = torch.rand(n, k // 32) + 0.5
z = torch.randn(n, k // 32)
ref = q.float().reshape(n, k // 32, 32) * s[..., None] + z[..., None]
got = dequantize_int4_w32(pack_int4_w32(q), s, z, torch.float32)
assert got.shape == (n, k)
assert torch.equal(got, ref.reshape(n, k)), (got - ref.reshape(n, k)).abs().max()
print("ok")
"""
    _in_interpreter(code)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
def test_products_of_more_than_16_rows_on_gpu():
    """More rows than one kernel call takes: 16-row calls up to CHUNKED_ROWS, then the one-pass dequantization
    + cuBLAS; both equal the torch reference weights' product within bf16 rounding, plain and SwiGLU."""
    torch.manual_seed(0)
    w = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    lin = CudaQ4Linear.from_float(w)
    ref = lin.dequantized_reference().float()
    assert (lin.dequantized().float() - ref).abs().max() <= 0.01 * ref.abs().max()
    for m in (17, 20, 64, 65, 200):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        y = x.float() @ ref.t()
        assert ((lin(x).float() - y).abs().max() / y.abs().max()) < 1e-2, m
        glu = torch.nn.functional.silu(y[:, :128]) * y[:, 128:]
        assert ((lin.glu(x).float() - glu).abs().max() / glu.abs().max()) < 2e-2, m


# ====================================================================== int4, 1 row, CUDA C++ (kernels/q4_cuda.py)


def test_cuda_c_kernel_source_compiles_for_every_shape_it_takes():
    """The NVRTC kernel's source, instantiated for K below, at and past a multiple of 32 groups (tails of the lane
    loop), SwiGLU, PDL, the add + RMSNorm prologue and the split norm's two halves, each with f16 pairs and with
    int8 activations (DP4A), compiles with nvcc where a CUDA toolkit is installed (this CPU machine has one; the GPU
    machine compiles it with NVRTC in the tests below) and uses no local memory (a spill would mean the register
    ring of weights in flight did not fit)."""
    import shutil
    import tempfile

    from forerun.kernels import q4_cuda
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    with tempfile.TemporaryDirectory() as d:
        for k, r, w, depth, glu, pdl, norm, split, add in (
                (896, 1, 4, 2, 0, 0, 0, 0, 0), (1536, 2, 4, 2, 1, 1, 0, 0, 0), (4096, 4, 8, 4, 0, 1, 0, 0, 0),
                (12288, 2, 8, 4, 0, 1, 0, 0, 0), (4096, 2, 16, 2, 0, 1, 1, 0, 0), (4096, 1, 16, 2, 1, 1, 1, 0, 0),
                (896, 1, 4, 2, 0, 0, 1, 0, 0), (4096, 2, 16, 2, 0, 1, 0, 1, 0), (4096, 1, 16, 2, 1, 1, 0, 1, 0),
                (896, 1, 4, 2, 0, 0, 0, 1, 0), (4096, 2, 16, 4, 0, 1, 0, 0, 1), (12288, 1, 16, 4, 0, 1, 0, 0, 1),
                (1536, 4, 8, 2, 0, 0, 0, 0, 1)):
            for dp4a in (False, True):
                src = os.path.join(d, "k.cu")
                with open(src, "w") as f:
                    f.write(q4_cuda.source(k, r, w, depth, bool(glu), bool(pdl), bool(norm), 256 * split, bool(add),
                                           dp4a))
                out = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", os.path.join(d, "k.cubin"), src,
                                      "-Xptxas", "-v"], capture_output=True, text=True, timeout=300)
                assert out.returncode == 0, out.stderr[-2000:]
                assert "0 bytes spill stores" in out.stderr, (k, r, w, depth, dp4a, out.stderr[-500:])


def _wide_products_take_the_cuda_pass(cls, name: str, monkeypatch) -> None:
    """A product of CHUNKED_ROWS + 1 rows through cls dequantizes with quant_cuda.<name> (the CUDA pass) and
    equals cuBLAS on that matrix; with FORERUN_Q4_DEQUANT=triton the Triton pass gives the same result."""
    from forerun.models import quant_cuda
    calls = []
    real = getattr(quant_cuda, name)
    monkeypatch.setattr(quant_cuda, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    lin = cls.from_float(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(lin.CHUNKED_ROWS + 1, 256, device="cuda", dtype=torch.bfloat16)
    y = lin(x)
    assert calls and torch.equal(y, x @ lin.dequantized().t())
    monkeypatch.setenv("FORERUN_Q4_DEQUANT", "triton")
    calls.clear()
    assert torch.equal(lin(x), y) and not calls


def test_cuda_dequant_source_compiles_without_spills():
    """q4_cuda's wide-product dequantization passes (the bf16 matrix cuBLAS multiplies for more than CHUNKED_ROWS
    rows) compile with nvcc: int4 for every words-per-thread setting the benchmark tries, int8 for each scale type;
    no local memory."""
    import shutil
    import tempfile

    from forerun.kernels import q4_cuda
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    with tempfile.TemporaryDirectory() as d:
        for src_text in [q4_cuda._DEQUANT_SRC.format(VEC=v) for v in (1, 2, 4)] + [
                q4_cuda._DEQUANT8_SRC.format(SCALE=kind) for kind in (0, 1, 2)]:
            src = os.path.join(d, "d.cu")
            with open(src, "w") as f:
                f.write(src_text)
            for arch in ("sm_80", "sm_90"):  # (Ampere / Ada run them too: q4_cuda.dequant_available)
                out = subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-o", os.path.join(d, "d.cubin"), src,
                                      "-Xptxas", "-v"], capture_output=True, text=True, timeout=300)
                assert out.returncode == 0, out.stderr[-2000:]
                assert "0 bytes spill stores" in out.stderr, out.stderr[-500:]


def test_dequant_passes_run_from_ampere_the_product_kernels_from_hopper(monkeypatch):
    """nvrtc.available gates by compute capability: the product kernels (griddepcontrol) need 9, the
    dequantization passes 8; an sm_86 card gets the passes and not the products, an sm_90 card both, sm_75
    neither (a card that is not CUDA, none)."""
    from forerun.kernels import nvrtc, q4_cuda
    monkeypatch.setattr(nvrtc, "_state", {})
    monkeypatch.setattr(nvrtc, "kernel", lambda source, name: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda *a: None, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for major, products, passes in ((7, False, False), (8, False, True), (9, True, True), (10, True, True)):
        nvrtc._state.pop("majors", None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, m=major: (m, 6))
        assert (q4_cuda.available(), q4_cuda.dequant_available()) == (products, passes), major
    monkeypatch.setenv("FORERUN_Q4_CUDA", "0")
    assert not q4_cuda.dequant_available()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
def test_cuda_dequant_equals_the_groups_exactly_on_gpu(monkeypatch):
    """q4c_dequant gives every weight as code * scale + zero of its own group in float32, rounded once to bf16, bit
    for bit as Triton's pass: word counts that leave a partial step of the grid-stride loop, one group per row, a
    swapped half-word fails; CudaQ4Linear.dequantized() takes it, or Triton's with FORERUN_Q4_DEQUANT=triton."""
    from forerun.kernels.q4_cuda import dequant_available as available, q4c_dequant
    from forerun.kernels.quant_gemm import dequantize_int4_w32
    if not available():
        pytest.skip("no NVRTC here")
    torch.manual_seed(0)
    for n, k in ((3, 32), (37, 96), (256, 4096), (1000, 1536)):
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
        s = (torch.rand(n, k // 32, device="cuda") + 0.5).to(torch.bfloat16)
        z = torch.randn(n, k // 32, device="cuda").to(torch.bfloat16)
        want = (q.float().reshape(n, -1, 32) * s.float()[..., None] + z.float()[..., None]).reshape(n, k)
        want = want.to(torch.bfloat16)
        qw = pack_int4_w32(q)
        for vec in (1, 2, 4):
            assert torch.equal(q4c_dequant(qw, s, z, vec=vec), want), (n, k, vec)
        assert torch.equal(dequantize_int4_w32(qw, s, z, torch.bfloat16), want), (n, k)
    swapped = pack_int4_w32(q.reshape(n, -1, 2).flip(-1).reshape(n, k))
    assert not torch.equal(q4c_dequant(swapped, s, z), want)
    with pytest.raises(ValueError, match="q4c_dequant"):
        q4c_dequant(qw, s.float(), z)
    _wide_products_take_the_cuda_pass(CudaQ4Linear, "q4c_dequant", monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
def test_cuda_int8_dequant_equals_the_groups_exactly_on_gpu(monkeypatch):
    """q8c_dequant gives (u - 128) * scale of each weight's own group in float32, rounded once to bf16, bit for bit
    as Triton's pass, for bf16 / f16 / f32 scales; a swapped byte pair fails; CudaQ8Linear.dequantized() takes it
    (Triton's with FORERUN_Q4_DEQUANT=triton)."""
    from forerun.kernels.q4_cuda import dequant_available as available, q8c_dequant
    from forerun.kernels.quant_gemm import dequantize_int8_w32, pack_int8_w32
    from forerun.models.quant_cuda import CudaQ8Linear
    if not available():
        pytest.skip("no NVRTC here")
    torch.manual_seed(0)
    for n, k in ((3, 32), (37, 96), (1000, 1536)):
        q = torch.randint(-128, 128, (n, k), dtype=torch.int16, device="cuda").to(torch.int8)
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            s = (torch.rand(n, k // 32, device="cuda") * 0.01 + 1e-3).to(dt)
            want = (q.float().reshape(n, -1, 32) * s.float()[..., None]).reshape(n, k).to(torch.bfloat16)
            qw = pack_int8_w32(q)
            assert torch.equal(q8c_dequant(qw, s), want), (n, k, dt)
            assert torch.equal(dequantize_int8_w32(qw, s, torch.bfloat16), want), (n, k, dt)
    swapped = pack_int8_w32(q.reshape(n, -1, 2).flip(-1).reshape(n, k))
    assert not torch.equal(q8c_dequant(swapped, s), want)
    with pytest.raises(ValueError, match="q8c_dequant"):
        q8c_dequant(qw, s.to(torch.float64))
    _wide_products_take_the_cuda_pass(CudaQ8Linear, "q8c_dequant", monkeypatch)


def test_cuda_c_kernel_falls_back_to_triton_configs_where_it_cannot_run(monkeypatch):
    """A tuned table whose 1-row entry is the CUDA kernel ("c") gives the Triton winner kept beside it (or the
    default) on a machine where the kernel cannot compile or is switched off (FORERUN_Q4_CUDA=0)."""
    from forerun.models import quant_cuda
    monkeypatch.setattr(quant_cuda, "_card", ["test card"])
    key = quant_cuda.config_key(1, 64, 256, False)
    c = dict(kernel="c", block_n=2, block_k=256, use_dot=False, num_warps=4, num_stages=2)
    v = dict(kernel="v", block_n=8, block_k=256, use_dot=False, num_warps=2, num_stages=2)
    quant_cuda.set_configs("test card", {key: c, "triton_" + key: v})
    monkeypatch.setattr(quant_cuda, "q4c_available", lambda: False)
    assert quant_cuda.tuned(1, 64, 256, False) == v
    quant_cuda.set_configs("test card", {key: c})
    assert quant_cuda.tuned(1, 64, 256, False) == quant_cuda.default_config(1)
    assert quant_cuda.tuned(1, 4096, 12288, False) == quant_cuda.default_config(1)  # untuned, no NVRTC: Triton
    monkeypatch.setattr(quant_cuda, "q4c_available", lambda: True)
    assert quant_cuda.tuned(1, 64, 256, False) == c
    assert quant_cuda.tuned(2, 64, 256, False) != c  # one row only
    # an untuned 1-row shape (a card without a table) where the kernel runs: the CUDA kernel's default
    for n, k, glu, rows, depth in ((4096, 12288, False, 1, 4), (6144, 4096, False, 2, 2), (12288, 4096, True, 1, 2),
                                     (151936, 4096, False, 1, 2)):
        got = quant_cuda.tuned(1, n, k, glu)
        assert got == dict(kernel="c", block_n=rows, block_k=k, use_dot=False, num_warps=16, num_stages=depth), got
    monkeypatch.setenv("FORERUN_Q4_CUDA", "0")
    from forerun.kernels import q4_cuda
    assert not q4_cuda.available()


def test_cuda_c_launch_structures_match_the_driver_abi():
    """cuLaunchKernelEx's CUlaunchConfig (56 bytes: 7 uint32, the stream at 32, the attributes at 40, their count at
    48) and the PDL attribute (72 bytes: id 6 = programmatic stream serialization, padding, value 1 at byte 8) as
    the driver reads them. (A first version wrote the value through a bytes copy: the attribute stayed 0 and the
    write landed in a Python object.)"""
    import ctypes

    from forerun.kernels.nvrtc import _LaunchConfig, pdl_attribute
    attr = pdl_attribute()
    assert ctypes.sizeof(attr) == 72
    assert bytes(attr)[:12] == b"\x06\x00\x00\x00" + b"\x00" * 4 + b"\x01\x00\x00\x00" and not any(bytes(attr)[12:])
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchConfig.hStream.offset, _LaunchConfig.attrs.offset, _LaunchConfig.numAttrs.offset) == (32, 40, 48)


def _q4_word_layout(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random weights [n, k] on the GPU in the word layout with bf16 scales and offsets (qw32, scale, zero)."""
    q, sc, z = quantize_groups_int4(torch.randn(n, k, device="cuda") * 0.05)
    return pack_int4_w32(q), sc.to(torch.bfloat16), z.to(torch.bfloat16)


def _q4c_ok() -> bool:
    from forerun.kernels import q4_cuda
    return q4_cuda.available()


def _cuda_int4_weights(n: int, k: int):
    """Random int4 groups on the GPU: (codes [N, K], word layout, bf16 scales, bf16 offsets, dequantized float)."""
    w = torch.randn(n, k, device="cuda") * 0.05
    q, s, z = quantize_groups_int4(w)
    s, z = s.to(torch.bfloat16), z.to(torch.bfloat16)
    wd = (q.float().reshape(n, k // 32, 32) * s.float()[..., None] + z.float()[..., None]).reshape(n, k)
    return q, pack_int4_w32(q), s, z, wd


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
def test_cuda_c_decode_kernel_on_gpu(monkeypatch):
    """q4c_linear (NVRTC) against x @ dequantized(W)^T in float32: every configuration kind, K with a lane tail
    (1536: 48 groups) and with fewer groups than lanes (896), N not a multiple of a block's rows, plain and SwiGLU,
    small and large activations, with and without PDL, inside a CUDA graph; close to the Triton kernel; a broken
    layout fails. The f16-pair path whatever the card's default or FORERUN_Q4_DP4A (the int8 path has its own test:
    its SwiGLU error at amp 3000 read 2.03e-2 against this test's 2e-2, H100, session 66)."""
    from forerun.kernels import q4_cuda
    from forerun.kernels.q4_cuda import q4c_linear
    from forerun.kernels.quant_gemm import q4v_linear
    monkeypatch.setattr(q4_cuda, "INT8_ACTIVATIONS", [False])
    assert _q4c_ok(), "NVRTC kernel did not compile on the GPU machine"
    torch.manual_seed(0)
    for n, k in ((96, 1024), (50, 1536), (40, 896)):
        q, q32, s, z, wd = _cuda_int4_weights(n, k)
        for amp in (1.0, 3000.0):
            x = (torch.randn(1, k, device="cuda") * amp).to(torch.bfloat16)
            ref = x.float() @ wd.t()
            glu = torch.nn.functional.silu(ref[:, :n // 2]) * ref[:, n // 2:]
            tri = q4v_linear(x, q32, s, z, block_k=k & -k if k & -k <= 1024 else 1024, block_n=4)
            for rows, warps, depth in ((1, 4, 2), (2, 4, 4), (4, 8, 2), (3, 2, 1)):
                for pdl in (False, True):
                    y = q4c_linear(x, q32, s, z, rows=rows, warps=warps, depth=depth, pdl=pdl)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    assert err < 1e-2, (n, k, amp, rows, warps, depth, pdl, err)
                    assert ((y.float() - tri.float()).abs().max() / ref.abs().max()).item() < 1e-2
                    y = q4c_linear(x, q32, s, z, glu=True, rows=rows, warps=warps, depth=depth, pdl=pdl)
                    assert y.shape == (1, n // 2)
                    err = ((y.float() - glu).abs().max() / glu.abs().max()).item()
                    assert err < 2e-2, ("glu", n, k, amp, rows, warps, depth, pdl, err)
    # inside a CUDA graph (as the engine replays decode), new activations each replay
    x = torch.randn(1, 896, device="cuda").to(torch.bfloat16)
    y = q4c_linear(x, q32, s, z, pdl=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = q4c_linear(x, q32, s, z, pdl=True)
    x.copy_(torch.randn(1, 896, device="cuda").to(torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    ref = x.float() @ wd.t()
    assert ((yg.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    # a broken unpacking (the code halves of each word swapped) must not pass
    bad = pack_int4_w32(q.reshape(n, -1, 2).flip(-1).reshape(n, k))
    assert ((q4c_linear(x, bad, s, z).float() - ref).abs().max() / ref.abs().max()).item() > 0.05
    with pytest.raises(ValueError, match="one contiguous bf16 row"):
        q4c_linear(torch.zeros(2, 896, device="cuda", dtype=torch.bfloat16), q32, s, z)


def _int8_activation_product(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """What q4_cuda's DP4A kernel computes, in float64 from its int8 rounding of x (float32 steps as the kernel
    takes them): per group of 32, d = max |x| / 127, a = round(x * (127 / max |x|)), y = sum over groups of
    scale * d * (codes . a) + offset * d * sum(a). q: codes [N, K], s / z: [N, K / 32]."""
    from forerun.kernels.q4_cuda import int8_rows_reference
    qa, d = int8_rows_reference(x)  # (a true float32 division in 127 / m: session 65's reference fault)
    qa, d = qa.reshape(-1, 32).double(), d.double().reshape(1, -1)
    dots = (q.double().reshape(q.shape[0], -1, 32) * qa[None]).sum(-1)  # exact integers
    return ((dots * s.double() + z.double() * qa.sum(-1)[None]) * d).sum(-1)[None]


def _within_bf16_of(y: torch.Tensor, want: torch.Tensor) -> bool:
    """y (bf16) is want rounded to bf16, give or take float32 sums: each element within half a bf16 step (2^-8 of
    itself) plus 2e-4 of the largest."""
    return bool(((y.double() - want).abs() <= 2 ** -8 * want.abs() + 2e-4 * want.abs().max()).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
def test_cuda_c_decode_kernel_with_int8_activations_on_gpu(monkeypatch):
    """INT8_ACTIVATIONS (FORERUN_Q4_DP4A): the row rounded to int8 per group of 32, dp4a products. Equal to that
    rounding done in torch with exact integer dots (up to float32 sums and the bf16 output) for every configuration
    kind, K with a lane tail, plain and SwiGLU, with and without PDL, in a CUDA graph; within 1.5e-2 of x @
    dequantized(W)^T. With an outlier 30x the rest in every group (int8 steps coarse) the int8 reference and the
    float one are 0.6-2 % apart, and the kernel follows the int8 one element by element; the f16-pair kernel does not
    (the power check)."""
    from forerun.kernels import q4_cuda
    assert _q4c_ok(), "NVRTC kernel did not compile on the GPU machine"
    torch.manual_seed(0)
    for n, k in ((96, 1024), (50, 1536), (40, 896)):
        q, q32, s, z, wd = _cuda_int4_weights(n, k)
        for amp, outlier in ((1.0, False), (3000.0, False), (1.0, True)):
            x = torch.randn(1, k, device="cuda") * amp
            if outlier:
                x = x.reshape(-1, 32)
                x[:, 7] = 30.0 * amp
                x = x.reshape(1, k)
            x = x.to(torch.bfloat16)
            ref = x.double() @ wd.double().t()
            emu = _int8_activation_product(x, q, s, z)
            emu_glu = torch.nn.functional.silu(emu[:, :n // 2]) * emu[:, n // 2:]
            gap = ((emu - ref).abs().max() / ref.abs().max()).item()
            assert gap < 1.5e-2 if not outlier else gap > 4e-3, (n, k, amp, gap)
            for rows, warps, depth in ((1, 4, 2), (2, 4, 4), (4, 8, 2), (3, 2, 1)):
                for pdl in (False, True):
                    monkeypatch.setattr(q4_cuda, "INT8_ACTIVATIONS", [True])
                    y = q4_cuda.q4c_linear(x, q32, s, z, rows=rows, warps=warps, depth=depth, pdl=pdl)
                    assert _within_bf16_of(y, emu), (n, k, amp, outlier, rows, warps, depth, pdl)
                    y = q4_cuda.q4c_linear(x, q32, s, z, glu=True, rows=rows, warps=warps, depth=depth, pdl=pdl)
                    err = ((y.double() - emu_glu).abs().max() / emu_glu.abs().max()).item()
                    assert err < 5e-3, ("glu", n, k, amp, outlier, rows, warps, depth, pdl, err)
            if outlier:  # the f16 pairs follow the float reference, not the int8 rounding
                monkeypatch.setattr(q4_cuda, "INT8_ACTIVATIONS", [False])
                assert not _within_bf16_of(q4_cuda.q4c_linear(x, q32, s, z), emu), (n, k)
    # inside a CUDA graph, new activations each replay
    monkeypatch.setattr(q4_cuda, "INT8_ACTIVATIONS", [True])
    x = torch.randn(1, 896, device="cuda").to(torch.bfloat16)
    q4_cuda.q4c_linear(x, q32, s, z, pdl=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = q4_cuda.q4c_linear(x, q32, s, z, pdl=True)
    x.copy_(torch.randn(1, 896, device="cuda").to(torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    assert _within_bf16_of(yg, _int8_activation_product(x, q, s, z))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
def test_cuda_q4_linear_runs_the_cuda_c_kernel_for_one_row_where_tuned(monkeypatch):
    """CudaQ4Linear's 1-row products go to the CUDA C++ kernel when the table says "c" (and to Triton when it is
    switched off), the same result within f16 rounding; 2 rows stay on Triton."""
    from forerun.models import quant_cuda
    assert _q4c_ok()
    torch.manual_seed(0)
    w = torch.randn(256, 1024, device="cuda").to(torch.bfloat16)
    lin = CudaQ4Linear.from_float(w)
    ref = lin.dequantized_reference().float()
    name = torch.cuda.get_device_name()
    key = quant_cuda.config_key(1, 256, 1024, False)
    old = dict(quant_cuda._tables.get(name, {}))
    calls = []
    real = quant_cuda.KERNELS["c"]
    monkeypatch.setitem(quant_cuda.KERNELS, "c", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    try:
        quant_cuda.set_configs(name, {**old, key: dict(kernel="c", block_n=2, block_k=1024, use_dot=False,
                                                        num_warps=4, num_stages=2)})
        x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
        y = x.float() @ ref.t()
        assert ((lin(x).float() - y).abs().max() / y.abs().max()) < 1e-2 and calls == [1]
        monkeypatch.setenv("FORERUN_Q4_CUDA", "0")
        assert ((lin(x).float() - y).abs().max() / y.abs().max()) < 1e-2 and calls == [1]
    finally:
        quant_cuda.set_configs(name, old)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
@pytest.mark.parametrize("int8", [False, True], ids=["f16", "int8"])
def test_cuda_c_norm_prologue_equals_add_rmsnorm_then_the_product(int8, monkeypatch):
    """q4c_norm_linear (add + RMSNorm in the product's prologue) against fused_norm.add_rmsnorm followed by
    q4c_linear: the sum x + residual bit-identical, the product within bf16 rounding of the normalised row (the sum
    of squares adds in another order); with and without a residual, plain and SwiGLU, several configurations,
    K with lane tails, large activations, in a CUDA graph; a wrong norm weight or eps fails. With the f16 pairs and
    with int8 activations (DP4A) on both sides."""
    from forerun.kernels.fused_norm import add_rmsnorm
    from forerun.kernels import q4_cuda
    from forerun.kernels.q4_cuda import q4c_linear, q4c_norm_linear
    assert _q4c_ok()
    monkeypatch.setattr(q4_cuda, "INT8_ACTIVATIONS", [int8])  # both sides: the f16 pairs, or int8 (DP4A)
    torch.manual_seed(1)
    for n, k in ((96, 4096), (50, 1536), (40, 896)):
        q32, sc, z = _q4_word_layout(n, k)
        nw = (1 + 0.3 * torch.randn(k, device="cuda")).to(torch.bfloat16)
        for amp in (1.0, 200.0):
            x = (torch.randn(1, k, device="cuda") * amp).to(torch.bfloat16)
            res = (torch.randn(1, k, device="cuda") * amp * 3).to(torch.bfloat16)
            for residual in (res, None):
                h, s_ref = add_rmsnorm(x, residual, nw, 1e-6)
                for glu in (False, True):
                    for rows, warps, depth in ((1, 4, 2), (2, 16, 2), (1, 16, 6)):
                        ref = q4c_linear(h, q32, sc, z, glu=glu, rows=rows, warps=warps, depth=depth).float()
                        y, s = q4c_norm_linear(x, residual, nw, 1e-6, q32, sc, z, glu=glu, rows=rows, warps=warps,
                                               depth=depth)
                        assert torch.equal(s, s_ref), (n, k, residual is None)
                        if residual is None:
                            assert s is x
                        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                        assert err < 1e-2, (n, k, amp, residual is None, glu, rows, warps, depth, err)
    # the checks can fail: another norm weight, another eps (where it matters: a tiny row)
    y, _ = q4c_norm_linear(x, res, torch.ones_like(nw), 1e-6, q32, sc, z)
    ref = q4c_linear(add_rmsnorm(x, res, nw, 1e-6)[0], q32, sc, z).float()
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() > 0.05
    tiny = (torch.randn(1, k, device="cuda") * 1e-3).to(torch.bfloat16)
    ref = q4c_linear(add_rmsnorm(tiny, None, nw, 1e-6)[0], q32, sc, z).float()
    y, _ = q4c_norm_linear(tiny, None, nw, 1e-2, q32, sc, z)
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() > 0.05
    # in a CUDA graph, new inputs each replay
    y, s = q4c_norm_linear(x, res, nw, 1e-6, q32, sc, z, pdl=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg, sg = q4c_norm_linear(x, res, nw, 1e-6, q32, sc, z, pdl=True)
    x.copy_(torch.randn(1, k, device="cuda").to(torch.bfloat16))
    g.replay()
    h, s_ref = add_rmsnorm(x, res, nw, 1e-6)
    ref = q4c_linear(h, q32, sc, z).float()
    assert torch.equal(sg, s_ref) and ((yg.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
@pytest.mark.parametrize("int8", [False, True], ids=["f16", "int8"])
def test_cuda_c_split_norm_equals_add_then_add_rmsnorm_then_the_product(int8, monkeypatch):
    """The add + RMSNorm split across two products: q4c_add_linear's sum is bit for bit the product rounded to
    bf16 plus the residual (add_rmsnorm's add), its partial sums of squares add up to the sum's; then
    q4c_split_norm_linear equals add_rmsnorm + q4c_linear within bf16 rounding of the normalised row (the sum of
    squares adds in another order), plain and SwiGLU, several configurations, N not a multiple of a block's rows,
    K with lane tails, large activations, chained in a CUDA graph under PDL; wrong partial sums, norm weight or eps
    fail. With the f16 pairs and with int8 activations (DP4A) on both sides."""
    from forerun.kernels.fused_norm import add_rmsnorm
    from forerun.kernels import q4_cuda
    from forerun.kernels.q4_cuda import q4c_add_linear, q4c_linear, q4c_split_norm_linear
    assert _q4c_ok()
    monkeypatch.setattr(q4_cuda, "INT8_ACTIVATIONS", [int8])  # both sides: the f16 pairs, or int8 (DP4A)
    torch.manual_seed(2)
    for n, k in ((4096, 1024), (1056, 1536), (896, 896)):  # (the add product's N is the norm's width and the
        # K of the product after it: 1056 leaves a block's rows part-filled and a lane tail)
        qa, sa, za = _q4_word_layout(n, k)
        qb, sb, zb = _q4_word_layout(2 * 40, n)  # the product after the norm (SwiGLU: 40 of each half)
        nw = (1 + 0.3 * torch.randn(n, device="cuda")).to(torch.bfloat16)
        for amp in (1.0, 100.0):
            x = (torch.randn(1, k, device="cuda") * amp).to(torch.bfloat16)
            res = (torch.randn(1, n, device="cuda") * amp * 3).to(torch.bfloat16)
            for rows, warps, depth in ((1, 4, 2), (2, 16, 2), (4, 8, 4), (1, 16, 6)):
                s, parts = q4c_add_linear(x, res, qa, sa, za, rows=rows, warps=warps, depth=depth)
                y0 = q4c_linear(x, qa, sa, za, rows=rows, warps=warps, depth=depth)
                assert torch.equal(s, (y0.float() + res.float()).to(torch.bfloat16)), (n, k, rows, warps)
                assert parts.shape == (-(-n // (rows * warps)),) and parts.dtype == torch.float32
                ss = (s.double() ** 2).sum()
                assert abs(parts.double().sum() - ss) <= 1e-5 * ss, (n, k, rows, warps)
                h, _ = add_rmsnorm(s, None, nw, 1e-6)
                for glu in (False, True):
                    ref = q4c_linear(h, qb, sb, zb, glu=glu, rows=rows, warps=warps, depth=depth).float()
                    y = q4c_split_norm_linear(s, parts, nw, 1e-6, qb, sb, zb, glu=glu, rows=rows, warps=warps,
                                              depth=depth).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    assert err < 1e-2, (n, k, amp, glu, rows, warps, depth, err)
    # the checks can fail: other partial sums, another norm weight, another eps (where it matters: a tiny row)
    ref = q4c_linear(add_rmsnorm(s, None, nw, 1e-6)[0], qb, sb, zb).float()
    for args in ((s, parts * 4, nw, 1e-6), (s, parts, torch.ones_like(nw), 1e-6)):
        y = q4c_split_norm_linear(*args, qb, sb, zb).float()
        assert ((y - ref).abs().max() / ref.abs().max()).item() > 0.05
    tiny = (torch.randn(1, n, device="cuda") * 1e-3).to(torch.bfloat16)
    tiny_parts = (tiny.float() ** 2).sum().reshape(1)
    ref = q4c_linear(add_rmsnorm(tiny, None, nw, 1e-6)[0], qb, sb, zb).float()
    y = q4c_split_norm_linear(tiny, tiny_parts, nw, 1e-2, qb, sb, zb).float()
    assert ((y - ref).abs().max() / ref.abs().max()).item() > 0.05
    y = q4c_split_norm_linear(tiny, tiny_parts, nw, 1e-6, qb, sb, zb).float()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-2
    # chained in a CUDA graph under PDL (the split product reads what the add product wrote), new inputs each replay
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sg, pg = q4c_add_linear(x, res, qa, sa, za, pdl=True)
        yg = q4c_split_norm_linear(sg, pg, nw, 1e-6, qb, sb, zb, glu=True, pdl=True)
    for _ in range(3):
        x.copy_(torch.randn(1, k, device="cuda").to(torch.bfloat16))
        g.replay()
        s, parts = q4c_add_linear(x, res, qa, sa, za)
        ref = q4c_linear(add_rmsnorm(s, None, nw, 1e-6)[0], qb, sb, zb, glu=True).float()
        assert torch.equal(sg, s) and torch.equal(pg, parts)
        assert ((yg.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
def test_int4_model_forward_with_norms_fused_into_the_products(monkeypatch):
    """A random 4-layer Qwen3-shape model quantized to int4 on the GPU: the 1-row forward with add + RMSNorm fused
    into the CUDA C++ products (FusedLayerOps.fuse_norms; off by default: measured slower) gives the logits of the unfused
    forward (bf16 rounding apart) and of the torch LayerOps over the same quantized matrices, and every fused
    product ran the fused kernel (2 per layer + the head); so does the forward with each norm split between the
    products around it (FusedLayerOps.split_norms, on by default on the H100 only: measured slower on the H200),
    every product in its place taking its half."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import gpu as G
    from forerun.kernels import q4_cuda
    from forerun.models.fused_ops import FusedLayerOps
    from forerun.models.ops import LayerOps
    from forerun.models.quant_cuda import quantize_model_cuda
    from forerun.runtime.runner import Chunk
    assert _q4c_ok()
    from forerun.models import quant_cuda
    card = torch.cuda.get_device_name()
    tables = json.loads(quant_cuda.CONFIGS.read_text())
    if card not in tables:  # (a card without a tuned table decodes with Triton's kernel, which has no fused form: the
        # H200's table, whose 1-row entries name the CUDA C++ kernel, stands in; seen on an H100, session 43)
        monkeypatch.setitem(quant_cuda._tables, card, tables["NVIDIA H200"])
        monkeypatch.setattr(quant_cuda, "_card", [card])
    shape = dict(G.QWEN3_8B, vocab_size=4096)
    model = G.build_model(shape, 4, seed=3)
    quantize_model_cuda(model)
    side = G.make_side(model, 1, 256)
    ids = torch.randint(0, 4096, (40,)).tolist()
    model.ops = LayerOps()
    side.runner.kv.truncate(0, 0)
    side.runner.forward([Chunk(seq_id=0, token_ids=ids[:39], logits="none")])  # prefill (many rows: unfused)
    logits = {}
    calls = []
    real = {f: getattr(q4_cuda, f) for f in ("q4c_norm_linear", "q4c_add_linear", "q4c_split_norm_linear")}
    for name, ops in (("torch", LayerOps()), ("unfused", FusedLayerOps(fuse_norms=False, split_norms=False)),
                      ("fused", FusedLayerOps(fuse_norms=True, split_norms=False)),
                      ("split", FusedLayerOps(split_norms=True))):
        model.ops = ops
        with pytest.MonkeyPatch.context() as mp:
            for f, fn in real.items():
                mp.setattr(f"forerun.models.quant_cuda.{f}",
                           lambda *a, _f=f, _fn=fn, _n=name, **kw: calls.append((_n, _f)) or _fn(*a, **kw))
            out, _ = side.runner.forward([Chunk(seq_id=0, token_ids=ids[39:], logits="last")])
        logits[name] = out.logits.float()
        side.runner.kv.truncate(0, 39)
    # fused: a prologue per norm (2 per layer + the head's); split: o and down add (2 per layer), gate/up, the
    # next layers' qkv and the head normalise (layer 0's qkv follows the embedding: its norm runs apart)
    assert calls == [("fused", "q4c_norm_linear")] * (2 * 4 + 1) + [
        ("split", f) for _ in range(4) for f in ("q4c_add_linear", "q4c_split_norm_linear", "q4c_add_linear",
                                                  "q4c_split_norm_linear")], calls
    # a product of too many blocks (the head's, here made so) keeps the norm apart and still gets the same logits
    monkeypatch.setattr(quant_cuda.CudaQ4Linear, "SPLIT_MAX_BLOCKS_PER_SM", 0)
    calls.clear()
    model.ops = FusedLayerOps(split_norms=True)
    with pytest.MonkeyPatch.context() as mp:
        for f, fn in real.items():
            mp.setattr(f"forerun.models.quant_cuda.{f}",
                       lambda *a, _f=f, _fn=fn, **kw: calls.append(_f) or _fn(*a, **kw))
        out, _ = side.runner.forward([Chunk(seq_id=0, token_ids=ids[39:], logits="last")])
    assert calls == ["q4c_add_linear"] * (2 * 4), calls
    assert ((out.logits.float() - logits["split"]).abs().max() / logits["split"].abs().max()).item() < 3e-2
    for name in ("unfused", "fused", "split"):
        err = ((logits[name] - logits["torch"]).abs().max() / logits["torch"].abs().max()).item()
        assert err < 5e-2, (name, err)
    for name in ("fused", "split"):
        assert ((logits[name] - logits["unfused"]).abs().max() / logits["unfused"].abs().max()).item() < 3e-2


# ====================================================================== int8 (GGUF Q8_0) word layout: CudaQ8Linear


def test_int8_word_layout_round_trips_and_cuda_q8_linear_falls_back_off_gpu():
    from forerun.kernels.quant_gemm import pack_int8_w32, unpack_int8_w32
    from forerun.models.quant_cuda import CudaQ8Linear

    q = torch.randint(-128, 128, (24, 256), dtype=torch.int8)
    w = pack_int8_w32(q)
    assert w.dtype == torch.int32 and w.shape == (24, 64)
    assert torch.equal(unpack_int8_w32(w), q)
    word = int(w[0, 0]) & 0xFFFFFFFF  # byte j of word i: code 4i + j, biased by +128
    assert word == sum((int(q[0, j]) + 128) << (8 * j) for j in range(4))
    torch.manual_seed(0)
    wf = torch.randn(48, 256).to(torch.bfloat16)
    lin = CudaQ8Linear.from_float(wf)
    assert lin.weight_bytes == 48 * 256 + 48 * 8 * 2  # 8.5 bits per weight with bf16 scales
    ref = (lin.codes().float().reshape(48, 8, 32) * lin.scale.float()[..., None]).reshape(48, 256)
    assert (ref - wf.float()).view(48, 8, 32).abs().amax(-1).le(lin.scale.float() / 2 * 1.001).all()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = x.float() @ ref.t()
    assert ((lin(x).float() - y).abs().max() / y.abs().max()) < 1e-2
    glu = torch.nn.functional.silu(y[:, :24]) * y[:, 24:]
    assert ((lin.glu(x).float() - glu).abs().max() / glu.abs().max()) < 1e-2


def _q8_ptx_constants() -> tuple[int, int, tuple[int, int]]:
    """(the prmt source constant, the subtracted f16 pair, the two prmt selectors) read from the kernel's PTX."""
    import re

    from forerun.kernels.quant_gemm import _Q8_WORD_UNPACK

    magic = int(re.search(r"mov\.b32 m, (0x[0-9A-Fa-f]+);", _Q8_WORD_UNPACK).group(1), 16)
    prmt = re.findall(r"prmt\.b32 t(\d), \$W, (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+);", _Q8_WORD_UNPACK)
    assert [t for t, _, _ in prmt] == ["0", "1"] and prmt[0][1] == prmt[1][1]
    return int(prmt[0][1], 16), magic, (int(prmt[0][2], 16), int(prmt[1][2], 16))


def _emulate_q8_word(words: np.ndarray, x0: np.ndarray, x1: np.ndarray, sel=None) -> np.ndarray:
    """The PTX block of `_rows_kernel` with BITS=8 (quant_gemm._Q8_WORD_UNPACK / _Q8_WORD_DOT) in numpy, with its constants
    read from the PTX text: prmt(word, src, sel) picks, per result byte, byte sel-nibble of (word bytes 0-3, src
    bytes), then sub.f16x2 of the magic pair (exact); the products in float32 rounded to f16 after each step (an
    fma rounds once: for these small integer codes times f16 activations the float32 product is exact, so this
    is the fma's rounding); words uint32 [n]; x0, x1: float16 [n, 2] (activations 4i, 4i+1 and 4i+2, 4i+3,
    pre-scaled) -> float32 [n]."""
    src_const, magic_bits, ptx_sel = _q8_ptx_constants()
    sel = ptx_sel if sel is None else sel
    src_bytes = np.frombuffer(np.uint32(src_const).tobytes(), np.uint8)
    src = np.concatenate([words.view(np.uint8).reshape(-1, 4), np.tile(src_bytes, (len(words), 1))], 1)
    magic = np.array([magic_bits & 0xFFFF, magic_bits >> 16], dtype=np.uint16).view(np.float16)
    pairs = []
    for s in sel:
        idx = [(s >> (4 * b)) & 7 for b in range(4)]
        pairs.append(src[:, idx].copy().view(np.float16).reshape(-1, 2) - magic)  # sub.f16x2: exact
    a = (pairs[0].astype(np.float32) * x0.astype(np.float32)).astype(np.float16)
    a = (pairs[1].astype(np.float32) * x1.astype(np.float32) + a.astype(np.float32)).astype(np.float16)
    return a.astype(np.float32).sum(1)


def test_int8_packed_f16_unpacking_matches_the_word_layout():
    """CPU check of the 8-bit kernel's arithmetic (the PTX runs on the GPU machine): the prmt selectors put codes
    4i, 4i+1 in the first f16 pair and 4i+2, 4i+3 in the second, as the f16 values 1024 + (q + 128), so after
    subtracting 1152 and with activations pre-scaled by 1/128 the word's products times 128 equal the exact dot
    product to f16 rounding; swapped selectors or unbiased codes do not."""
    from forerun.kernels.quant_gemm import pack_int8_w32

    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.integers(-128, 128, (16, 32), dtype=np.int8))  # 16 rows of 8 words
    words = pack_int8_w32(q).numpy().reshape(-1).view(np.uint32)  # [128] words, 4 codes each
    qq = q.numpy().reshape(128, 4).astype(np.float64)
    x = rng.standard_normal((128, 4)).astype(np.float32) * 3
    x0, x1 = (x[:, 0:2] / 128).astype(np.float16), (x[:, 2:4] / 128).astype(np.float16)
    want = (qq * x).sum(1)
    got = 128 * _emulate_q8_word(words, x0, x1)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()  # f16 rounding
    sel = _q8_ptx_constants()[2]
    assert np.abs(128 * _emulate_q8_word(words, x0, x1, sel[::-1]) - want).max() > 0.05 * np.abs(want).max()
    raw = q.contiguous().view(torch.int32).numpy().reshape(-1).view(np.uint32)  # codes not biased
    assert np.abs(128 * _emulate_q8_word(raw, x0, x1) - want).max() > 0.05 * np.abs(want).max()


def test_int8_dequant_kernel_in_interpreter_equals_the_groups_exactly():
    """dequantize_int8_w32 (CudaQ8Linear's products of more than CHUNKED_ROWS rows: prefill) in Triton's
    interpreter gives every weight as code * scale of its own group, rounded once, as the torch path does."""
    code = """
import torch
from forerun.kernels.quant_gemm import dequantize_int8_w32, pack_int8_w32
torch.manual_seed(0)
n, k = 40, 320  # rows past one 16-row tile, codes past one 256-wide tile only in the masks
q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
s = (torch.rand(n, k // 32) + 0.5).half()
ref = (q.float().reshape(n, k // 32, 32) * s.float()[..., None]).reshape(n, k)
got = dequantize_int8_w32(pack_int8_w32(q), s, torch.float32, kernel=True)
assert got.shape == (n, k) and torch.equal(got, ref), (got - ref).abs().max()
assert torch.equal(dequantize_int8_w32(pack_int8_w32(q), s, torch.float32, kernel=False), ref)  # the torch path
got16 = dequantize_int8_w32(pack_int8_w32(q), s, torch.bfloat16, kernel=True).float()  # one rounding (the interpreter truncates)
assert ((got16 - ref).abs() <= ref.abs() * 2.0 ** -7).all()
print("ok")
"""
    _in_interpreter(code)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX: CUDA only (run on the GPU machine)")
def test_int8_kernel_on_gpu():
    """q8v_linear against x @ dequantized(W)^T in float32 for 1..8 rows, plain and fused SwiGLU, one and several K
    steps, small and large activations (the f16 pre-scaling), a width that is not a power of two (896); then
    CudaQ8Linear past 8 rows (8-row calls, then dequantization + cuBLAS); unbiased codes must fail."""
    from forerun.kernels.quant_gemm import pack_int8_w32, q8v_linear
    from forerun.models.quant_cuda import CudaQ8Linear, quantize_int8_groups

    torch.manual_seed(0)
    for n, k, bks in ((96, 1024, (256, 1024)), (64, 896, (128,))):
        w = torch.randn(n, k, device="cuda") * 0.05
        q, s = quantize_int8_groups(w, torch.bfloat16)
        qw8 = pack_int8_w32(q)
        wd = (q.float().reshape(n, k // 32, 32) * s.float()[..., None]).reshape(n, k)
        for m in range(1, 9):
            for amp in (1.0, 3000.0):
                x = (torch.randn(m, k, device="cuda") * amp).to(torch.bfloat16)
                ref = x.float() @ wd.t()
                glu = torch.nn.functional.silu(ref[:, :n // 2]) * ref[:, n // 2:]
                for bk in bks:
                    for bn in (4, 16):
                        y = q8v_linear(x, qw8, s, block_k=bk, block_n=bn)
                        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                        assert err < 1e-2, (n, k, m, amp, bk, bn, err)
                        y = q8v_linear(x, qw8, s, block_k=bk, block_n=bn, glu=True)
                        err = ((y.float() - glu).abs().max() / glu.abs().max()).item()
                        assert err < 2e-2, ("glu", n, k, m, amp, bk, bn, err)
        lin = CudaQ8Linear(q, s)
        for m in (1, 5, 9, 16, 17, 64, 65, 200):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wd.t()
            assert ((lin(x).float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, ("CudaQ8Linear", m, k)
            glu = torch.nn.functional.silu(ref[:, :n // 2]) * ref[:, n // 2:]
            assert ((lin.glu(x).float() - glu).abs().max() / glu.abs().max()).item() < 2e-2, ("glu", m, k)
    x = torch.randn(1, 1024, device="cuda").to(torch.bfloat16)
    w = torch.randn(96, 1024, device="cuda") * 0.05
    q, s = quantize_int8_groups(w, torch.bfloat16)
    wd = (q.float().reshape(96, 32, 32) * s.float()[..., None]).reshape(96, 1024)
    ref = x.float() @ wd.t()
    raw = q.contiguous().view(torch.int32)  # the codes without the +128 bias
    assert ((q8v_linear(x, raw, s).float() - ref).abs().max() / ref.abs().max()).item() > 0.05


def test_the_l2_prefetchers_chunk_table_covers_the_chain_in_order():
    """q4_l2_prefetcher_gpu's table (CPU): every byte of every range once, in chunks of at most CHUNK and of 16-byte
    units, and each chunk released once the products' counted progress is within `ahead` bytes of its end."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import q4_l2_prefetcher_gpu as LP
    # product A: 4 blocks (2 warps each) of a 32 KB and a 4 KB range; product B: 2 blocks (4 warps) of 64 KB
    ranges = [([(1 << 20, 32768), (2 << 20, 4096)] * 4, 8), ([(3 << 20, 65536)] * 2, 8)]
    addr, size, need = LP.chunk_table(ranges, 40000, "cpu")
    assert int(size.sum()) == 4 * 36864 + 2 * 65536 and int(size.max()) <= LP.CHUNK and int((size % 16).sum()) == 0
    assert addr[:3].tolist() == [1 << 20, (1 << 20) + 16384, 2 << 20]
    ends = size.cumsum(0).double()
    # bytes consumed after P warps: A's 147456 over its 8 warps, then B's 131072 over its 8
    consumed = [min(p, 8) * 18432 + max(p - 8, 0) * 16384 for p in range(17)]
    for e, n in zip(ends.tolist(), need.tolist()):
        assert consumed[n] >= e - 40000 and (n == 0 or consumed[n - 1] < e - 40000), (e, n)
    assert need.tolist() == sorted(need.tolist()) and need[0] == 0 and int(need.max()) <= 16


def test_the_chain_benchmarks_kernels_still_build_from_this_source():
    """The chain benchmarks build their kernels from q4_cuda.py's source (its helpers, or the kernel itself with
    timestamps added by text edits): each must still find what it edits and compile with nvcc without local
    memory (q4_block_timing_gpu, q4_smem_prefetch_gpu, q4_stream_gpu, q4_persistent_gpu, q4_l2_prefetcher_gpu).
    (Session 23's
    q4_persistent_gpu.py stopped running when the source gained format keys, unnoticed until session 51.)"""
    import shutil
    import tempfile

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import q4_block_timing_gpu as BT
    import q4_l2_prefetcher_gpu as LP
    import q4_persistent_gpu as PG
    import q4_smem_prefetch_gpu as SP
    import q4_stream_gpu as SG
    sources = [BT.timed_source(4096, 2, 16, 2, False), BT.timed_source(4096, 1, 16, 2, True),
               SP.smem_source(4096, 2, 16, False), SP.smem_source(12288, 1, 16, False),
               SP.smem_source(4096, 1, 16, True),
               SG.stream_source(16, 5, True, 0, True, True), SG.stream_source(16, 2, True, 2, False, False),
               PG._HELPERS.format(K=4096, R=2, WARPS=8, DEPTH=4, GLU=0, PDL=0, NORM=0, SPLIT=0, NP=1, ADD=0, DP4A=0)
               + PG._PERSIST.format(PF=2),
               LP.counting_source(4096, 2, 16, 2, False), LP.counting_source(12288, 1, 16, 4, False), LP._PREFETCHER]
    assert "%globaltimer" in sources[0] and sources[0].count("_ts[") >= 9
    with tempfile.TemporaryDirectory() as d:
        for i, text in enumerate(sources):
            src = os.path.join(d, f"k{i}.cu")
            with open(src, "w") as f:
                f.write(text)
            out = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", os.path.join(d, f"k{i}.cubin"), src,
                                  "-Xptxas", "-v"], capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            assert "0 bytes spill stores" in out.stderr, (i, out.stderr[-500:])
