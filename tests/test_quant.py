"""Quantized weights kept quantized (forerun/models/quant.py): exact GGUF 4-bit block mapping, the linear
modules against float matmuls, batch invariance (what makes greedy spec == plain on the quantized path),
and whole models loaded quantized against the same checkpoint loaded in fp32."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from forerun.config import SpecConfig
from forerun.engine.llm import LLM
from forerun.models.loader import load_checkpoint
from forerun.models.quant import (Int4Linear, Int8Linear, Q4Linear, Q8Linear, gguf_int4_groups, parse_quantize,
                                  quantize_groups_int4, weight_bytes)
from forerun.models.registry import build_model, load_model
from forerun.runtime.runner import Chunk
from forerun.sampling_params import SamplingParams
from test_loader import save, tiny_model, write_gguf
from tiny import tiny_tokenizer


def _random_q4k(n: int, k: int, rng) -> np.ndarray:
    """Random but valid Q4_K blocks: random 6-bit scales/mins and nibbles, finite small d/dmin."""
    b = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    b[:, 0:2] = np.float16(rng.uniform(0.001, 0.01, size=(b.shape[0], 1))).view(np.uint8)
    b[:, 2:4] = np.float16(rng.uniform(0.001, 0.01, size=(b.shape[0], 1))).view(np.uint8)
    return b.reshape(n, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_0", "Q4_1"])
def test_gguf_4bit_blocks_map_exactly_onto_int4_groups(qtype):
    rng = np.random.default_rng(0)
    n, k = 8, 512
    if qtype == "Q4_K":
        data = _random_q4k(n, k, rng)
    else:
        data = quantize(rng.standard_normal((n, k)).astype(np.float32), QT[qtype])
    ref = dequantize(data, QT[qtype]).reshape(n, k)  # gguf's own dequantization: the reference
    q, scale, off = gguf_int4_groups(data, qtype, (n, k))
    assert q.max() <= 15
    got = (q.reshape(n, k // 32, 32) * scale[..., None] + off[..., None]).reshape(n, k)
    np.testing.assert_array_equal(got, ref)  # exact in fp32
    assert gguf_int4_groups(quantize(ref, QT.Q8_0), "Q8_0", (n, k)) is None


def test_int4_linear_matches_dequantized_matmul():
    torch.manual_seed(0)
    w, x, b = torch.randn(96, 128), torch.randn(5, 128), torch.randn(96)
    lin = Int4Linear.from_float(w, b)
    wd = lin.dequantized()  # what the kernel multiplies by (bf16 scales)
    assert (wd - w).abs().max() <= (w.amax() - w.amin()) / 15  # within one int4 step of the original
    ref = x @ wd.t() + b
    assert ((lin(x) - ref).abs().max() / ref.abs().max()).item() < 1e-2  # bf16 activations
    assert lin.weight_bytes < w.numel()  # ~0.56 bytes per weight


def test_int8_linear_matches_float_and_is_batch_invariant():
    torch.manual_seed(0)
    w, x, b = torch.randn(96, 128), torch.randn(16, 128), torch.randn(96)
    lin = Int8Linear.from_float(w, b)
    assert ((lin.dequantized() - w).abs().max(1).values <= w.abs().amax(1) / 127 * 0.5 + 1e-6).all()
    ref = x @ w.t() + b
    y = lin(x)
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-2
    # a row gives bit-identical results alone and among others (integer accumulation, per-row scales)
    for r in range(1, 16):
        assert torch.equal(lin(x[:r]), y[:r])
    assert torch.equal(lin(x[7:8]), y[7:8])


@pytest.mark.skipif(not Q4Linear.fits(64, 128), reason="needs gcc and AVX512-VNNI or AVX2 (forerun/kernels/cpu_q4.c)")
@pytest.mark.parametrize("n,k", [(272, 640), (270, 1536), (33, 96), (260, 8960)])
def test_q4_vnni_linear_matches_dequantized_matmul_and_is_batch_invariant(n, k):
    """The C int4 x int8 kernel: exact int4 codes with fp16 group scale / offset, int8 activations per 32 values.
    Shapes: a partial last chunk of 16 groups (640, 8960: 20 / 280 groups), K not a multiple of 128 (96), N not a
    multiple of the 4-row groups (270, 33), and enough row groups (>= 64) to split over 2 threads."""
    from forerun.kernels import cpu_q4

    torch.manual_seed(0)
    w, x, b = torch.randn(n, k), torch.randn(17, k), torch.randn(n)
    q, s, o = quantize_groups_int4(w)
    lin = Q4Linear(q, s, o, b)
    want = (q.float().view(n, k // 32, 32) * s.half().float()[..., None] + o.half().float()[..., None]).view(n, k)
    assert torch.equal(lin.dequantized(), want)  # the packing round-trips, fp16 scale and offset
    # the C activation quantization is bit-identical to the torch reference
    for got, ref in zip(cpu_q4.quantize_activations_c(x), cpu_q4.quantize_activations(x)):
        assert torch.equal(got, ref)
    ref = x @ want.t() + b
    y = lin(x)
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-2  # int8 activations
    for r in range(1, 18):
        for start in (0, 17 - r):
            assert torch.equal(lin(x[start:start + r]), y[start:start + r]), (r, start)
    old = torch.get_num_threads()
    try:
        for t in (1, 2):  # output row groups split over OpenMP threads: the same bits
            torch.set_num_threads(t)
            assert torch.equal(lin(x), y)
            assert torch.equal(lin(x[3:4]), y[3:4])
    finally:
        torch.set_num_threads(old)
    chunks = (k // 32 + 15) // 16
    assert lin.weight_bytes == -(-n // 4) * (256 * chunks + 64 * (k // 32))  # ~4.5 bits + the fp16 header


def test_run_groups_is_placed_where_its_one_row_loop_measured_fastest():
    """cpu_q4.c pins run_groups (the int4 product's per-thread loop, where decode steps spend most of their time) 16
    bytes past a 64-byte boundary, in .text.hot: on a Zen 2 its 1-row loop took 1.01-1.14x the time at the three other
    16-byte places with the same machine code, and edits elsewhere in the file used to move it (session 63,
    docs/quantization.md). Checked on the library as built here, and with the place moved by -DRUN_GROUPS_ENTRY."""
    import shutil
    import subprocess
    from pathlib import Path

    from forerun.kernels import cbuild, cpu_q4

    if not cpu_q4.available() or shutil.which("nm") is None:
        pytest.skip("no C kernel build or no nm here")

    def place(lib, name: str = "run_groups") -> int:
        syms = subprocess.run(["nm", lib._name], capture_output=True, text=True, check=True).stdout.split("\n")
        return next(int(line.split()[0], 16) for line in syms if line.endswith(" " + name))

    lib = cpu_q4._load()
    assert place(lib) % 64 == 16
    if cbuild.isa() == "avx2":  # the int8 layout's 1-2-row loop, pinned the same way (its own measurement)
        assert place(lib, "q8_run_groups_few") % 64 == 16
    moved = cbuild.library_for(Path(cpu_q4.__file__).with_name("cpu_q4.c"), cbuild.isa(), ["-DRUN_GROUPS_ENTRY=48"],
                               cpu_q4._declare)
    assert place(moved) % 64 == 48


def test_q4_kernel_builds_with_another_prefetch_distance_and_gives_the_same_bits():
    """cpu_q4.c's tuning constants can be set from the command line (benchmarks/cpu_q4_ab.py --flags=-DPFD=N): until
    session 63 `-DPFD` left KB_CHUNKS / KB_FROM undefined and the build failed. A prefetch distance only moves hints:
    the products of 1, 2, 3 and 8 rows (every pass of the build) must be the same bits as the default build's."""
    from pathlib import Path

    from forerun.kernels import cbuild, cpu_q4

    isa = cbuild.isa()
    if isa is None or not cpu_q4.available():
        pytest.skip("no C kernel build on this machine")
    src = Path(cpu_q4.__file__).with_name("cpu_q4.c")
    other = cbuild.library_for(src, isa, ["-DPFD=1024"], cpu_q4._declare)
    assert other is not None, "cpu_q4.c did not build with -DPFD=1024"
    n, k = 40, 4608  # K > 2048: the blocked multi-row pass (KB_CHUNKS) as well
    g = torch.Generator().manual_seed(3)
    s = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    packed = cpu_q4.pack_weights(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), s, -8 * s)
    for m in (1, 2, 3, 8):
        xq, xs, isum = cpu_q4.quantize_activations_c(torch.randn(m, k, generator=g))
        ys = []
        for lib in (cpu_q4._load(), other):
            y = torch.empty(m, n)
            lib.q4_gemm(packed.data_ptr(), n, k, xq.data_ptr(), xs.data_ptr(), isum.data_ptr(), m, y.data_ptr(), 1)
            ys.append(y)
        assert torch.equal(ys[0], ys[1]) and ys[0].abs().sum() > 0, m


@pytest.mark.parametrize("isa", ["avx512amx", "avx512", "avx2"])
@pytest.mark.parametrize("n,k", [(36, 640), (8, 96), (12, 288)])
def test_q4_kernel_builds_compute_the_exact_group_dot_products(isa, n, k):
    """Each ISA build of cpu_q4.c this CPU runs (AVX512-VNNI; AVX2 with maddubs + madd) gives, per output, the sum
    over groups of scale * xs * dot + offset * isum with the integer dot products exact: checked against float64
    to 1e-5 of the sum of the terms' sizes (one wrong group, nibble or half would be ~1e-2). K = 640 / 288 leave a
    chunk of 4 / 9 groups (the masked loads; 9 > 8 reaches the AVX2 build's second half), K = 96 a chunk of 3.
    Codes 0 and 15 and activations at +-127 are forced in: the AVX2 build's int16 sums are at their largest."""
    from pathlib import Path

    from forerun.kernels import cbuild, cpu_q4

    lib = cbuild.library_for(Path(cpu_q4.__file__).with_name("cpu_q4.c"), isa, [], cpu_q4._declare)
    if lib is None:
        pytest.skip(f"this CPU cannot run the {isa} build (or there is no gcc)")
    g = torch.Generator().manual_seed(n * k)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    q[0] = 15  # all-15 codes against all-127 activations: the largest int16 partial sums
    q[1] = 0
    s = torch.rand(n, k // 32, generator=g).add_(0.1).half().float()
    o = -torch.rand(n, k // 32, generator=g).half().float()
    x = torch.randn(5, k, generator=g)
    x[0] = 1.0  # every code +127
    x[1] = -1.0
    packed = cpu_q4.pack_weights(q, s, o)
    xq, xs, isum = cpu_q4.quantize_activations(x)
    y = torch.empty(5, n)
    lib.q4_gemm(packed.data_ptr(), n, k, xq.data_ptr(), xs.data_ptr(), isum.data_ptr(), 5, y.data_ptr(), 1)
    codes = xq.view(5, -1, 8, 16, 4).transpose(2, 3).reshape(5, -1, 32)[:, : k // 32].double()  # [M, G, 32]
    dots = torch.einsum("mgc,ngc->mng", codes, q.view(n, k // 32, 32).double())  # exact integers
    xs_, is_ = xs[:, : k // 32].double(), isum[:, : k // 32].double()
    terms = dots * s.double()[None] * xs_[:, None] + o.double()[None] * is_[:, None]  # [M, N, G]
    want, size = terms.sum(-1), terms.abs().sum(-1)
    assert ((y.double() - want).abs() <= 1e-5 * size + 1e-6).all(), (y.double() - want).abs().max()


def test_int8_activations_take_7_bits_without_vnni(monkeypatch):
    """oneDNN's u8 x s8 product saturates without VNNI (vpmaddubsw): Int8Linear then quantizes activations to
    -63..63 (zero point 64). Checked by faking the CPU flags; the product stays right either way on this CPU."""
    from forerun.kernels import cbuild
    from forerun.models import quant

    for flags, want in (({"avx2"}, (63, 64)), ({"avx2", "avx512_vnni"}, (127, 128)), ({"avx_vnni"}, (127, 128))):
        monkeypatch.setattr(cbuild, "cpu_ok", lambda feats, flags=flags: all(f in flags for f in feats))
        assert quant.int8_activation_range() == want
        lin = Int8Linear.from_float(torch.randn(64, 128))
        assert (lin.act_max, lin.act_zero) == want
    monkeypatch.undo()
    torch.manual_seed(1)
    w, x = torch.randn(64, 256), torch.randn(8, 256)
    lin = Int8Linear.from_float(w)
    if (lin.act_max, lin.act_zero) == (63, 64):  # this CPU has no VNNI: the 8-bit range would be wrong here
        lin8 = Int8Linear.from_float(w)
        lin8.act_max, lin8.act_zero = 127, 128
        assert ((lin8(x) - x @ w.t()).abs().max() / (x @ w.t()).abs().max()).item() > 5e-2
    assert ((lin(x) - x @ w.t()).abs().max() / (x @ w.t()).abs().max()).item() < 2e-2


@pytest.mark.skipif(not Q4Linear.fits(64, 128), reason="needs gcc and AVX512-VNNI or AVX2 (forerun/kernels/cpu_q4.c)")
@pytest.mark.parametrize("n,k", [(40, 288), (13, 1536)])
def test_q8_linear_is_int8_per_32_exactly(n, k):
    """Q8Linear (cpu_q4.c's int8 layout, q8_gemm): its output is, group by group, s * xs * dot(q, xq) + bias with the
    integer dot products exact (checked against float64 to 1e-5 of the terms' sizes), it dequantizes to q * s and
    gives its codes back, and a row's result is the same alone or among others (1-2 and 3-8 row passes). Codes
    -128 / +127 against activations at +-127 (the sign trick's largest pairs), a partial last chunk (K = 288: 9
    groups) and N not a multiple of 4 are in; a header with two groups' scales swapped fails it."""
    from forerun.kernels import cpu_q4

    g = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    q[0], q[1] = 127, -128
    s = torch.rand(n, k // 32, generator=g).add_(0.01).mul_(0.05).half().float()
    b = torch.randn(n, generator=g)
    lin = Q8Linear(q, s, b)
    assert lin.weight_bytes == -(-n // 4) * (-(-k // 512) * 128 + (k // 32) * 128)  # 8.5 bits a weight
    codes, scales = lin.codes()
    assert torch.equal(codes, q) and torch.equal(scales.float(), s)
    assert torch.equal(lin.dequantized(), (q.float().view(n, -1, 32) * s[..., None]).view(n, k))
    x = torch.randn(11, k, generator=g)
    x[0], x[1] = 1.0, -1.0
    y = lin(x)
    xq, xs, _ = cpu_q4.quantize_activations(x)
    acodes = xq.view(11, -1, 8, 16, 4).transpose(2, 3).reshape(11, -1, 32)[:, : k // 32].double()
    dots = torch.einsum("mgc,ngc->mng", acodes, q.view(n, -1, 32).double())
    terms = dots * s.double()[None] * xs[:, None, : k // 32].double()
    want = terms.sum(-1) + b.double()
    assert ((y.double() - want).abs() <= 1e-5 * (terms.abs().sum(-1) + b.double().abs()) + 1e-6).all()
    for r in range(1, 11):
        assert torch.equal(lin(x[r:r + 1]), y[r:r + 1]) and torch.equal(lin(x[:r]), y[:r])
    s_bad = s.clone()
    s_bad[:, [0, 1]] = s[:, [1, 0]]
    bad = Q8Linear(q, s, b)
    bad.packed = cpu_q4.pack_q8(q, s_bad)
    assert not ((bad(x).double() - want).abs() <= 1e-3 * want.abs().amax()).all()


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_q8_kernel_builds_give_the_same_bits(isa):
    """q8_gemm's AVX-512 build (dpbusd) and AVX2 build (maddubs + madd) make the same int32 dot products and the
    same float operations after them: the same bits, each equal to the build this CPU runs."""
    from pathlib import Path

    from forerun.kernels import cbuild, cpu_q4

    lib = cbuild.library_for(Path(cpu_q4.__file__).with_name("cpu_q4.c"), isa, [], cpu_q4._declare)
    if lib is None or not cpu_q4.available():
        pytest.skip(f"this CPU cannot run the {isa} build (or there is no gcc)")
    g = torch.Generator().manual_seed(5)
    n, k = 21, 800
    q = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    s = torch.rand(n, k // 32, generator=g).add_(0.01).half().float()
    packed = cpu_q4.pack_q8(q, s)
    x = torch.randn(6, k, generator=g)
    xq, xs, _ = cpu_q4.quantize_activations(x)
    y = torch.empty(6, n)
    lib.q8_gemm(packed.data_ptr(), n, k, xq.data_ptr(), xs.data_ptr(), 6, y.data_ptr(), 1)
    assert torch.equal(y, cpu_q4.q8_matmul(x, packed, n, 1))


def _random_q6k(n: int, k: int, rng) -> np.ndarray:
    """Random Q6_K blocks (every bit pattern is one: 6-bit codes, int8 scales -128..127), small finite fp16 d."""
    b = rng.integers(0, 256, size=(n * k // 256, 210), dtype=np.uint8)
    b[:, 208:210] = np.float16(rng.uniform(0.001, 0.01, size=(b.shape[0], 1))).view(np.uint8)
    return b.reshape(n, -1)


@pytest.mark.skipif(not Q4Linear.fits(64, 128), reason="needs gcc and AVX512-VNNI or AVX2 (forerun/kernels/cpu_q4.c)")
@pytest.mark.parametrize("n,k", [(37, 256), (20, 768), (300, 1536)])  # 1, 3 (a pair + one), 6 blocks a row
def test_q6k_linear_is_exact_over_the_blocks(n, k):
    """Q6KLinear (GGUF Q6_K blocks re-laid out by pack_q6k, cpu_q4.c's q6k_gemm): the layout gives the blocks back
    byte for byte and dequantizes as gguf does; per group of 32 its output is d * xs * the exact
    integer dot product of the weights' codes (q - 32, times their per-16 int8 scales) with the activations' codes
    (checked in float64 against gguf's own dequantization, to 1e-5 of the terms' sizes); the same bits for a row alone
    or among others, and with 1 or 2 threads. Codes 0 / 63 with scales -128 / 127 against activations at +-127 are
    in. A kernel reading a set's codes with the wrong scale, or the wrong 2 high bits, fails it."""
    from forerun.kernels import cpu_q4
    from forerun.models.quant import Q6KLinear

    rng = np.random.default_rng(n)
    blocks = _random_q6k(n, k, rng)
    blocks[0, :192] = 0xFF  # q = 63 everywhere, scales -128
    blocks[0, 192:208] = 0x80
    blocks[1, :192], blocks[1, 192:208] = 0x00, 0x7F  # q = 0, scales 127
    g = torch.Generator().manual_seed(n)
    b = torch.randn(n, generator=g)
    lin = Q6KLinear.from_blocks(blocks, k, b)
    w = torch.from_numpy(dequantize(blocks, QT.Q6_K).reshape(n, k).astype(np.float32))
    assert lin.weight_bytes == n * k // 256 * 210 and np.array_equal(lin.blocks(), blocks)
    assert torch.equal(lin.dequantized(), w)
    x = torch.randn(9, k, generator=g)
    x[0], x[1] = 1.0, -1.0
    y = lin(x)
    xq, xs, _ = cpu_q4.quantize_activations(x)
    acodes = xq.view(9, -1, 8, 16, 4).transpose(2, 3).reshape(9, -1, 32)[:, : k // 32].double()
    terms = torch.einsum("mgc,ngc->mng", acodes, w.view(n, -1, 32).double()) * xs[:, : k // 32].double()[:, None]
    want = terms.sum(-1) + b.double()
    assert ((y.double() - want).abs() <= 1e-5 * (terms.abs().sum(-1) + b.double().abs()) + 1e-6).all()
    for r in range(1, 9):
        assert torch.equal(lin(x[r:r + 1]), y[r:r + 1]) and torch.equal(lin(x[:r]), y[:r])
    assert torch.equal(lin.rows(x, threads=1), lin.rows(x, threads=2))
    ids = torch.tensor([5, 0, n - 1])
    sub = lin.select_rows(ids)
    assert torch.equal(sub(x), y[:, ids])


def test_a_q6_k_head_stays_exact_where_q8_would_run(monkeypatch):
    """The int4 and int8 layouts take a GGUF Q6_K output head as Q6KLinear (exact) on every CPU the kernel runs on,
    with VNNI (instead of oneDNN's per-row Int8Linear) and without (instead of Q8Linear); a Q6_K matrix of the layers
    is re-quantized to int4 as before; the draft-vocabulary subset of a Q6KLinear head is its rows' own bytes."""
    from forerun.models import quant
    from forerun.models.loader import GGUFQuantized
    from forerun.models.vocab_subset import _rows

    n, k = 64, 512
    data = _random_q6k(n, k, np.random.default_rng(1))
    head = GGUFQuantized(data, "Q6_K", (n, k), None, "tensor output.weight")
    layer = GGUFQuantized(data, "Q6_K", (n, k), None, "tensor blk.0.ffn_down.weight")
    if not Q4Linear.fits(n, k):
        pytest.skip("no C kernel here")
    for vnni in ((127, 128), (63, 64)):
        monkeypatch.setattr(quant, "int8_activation_range", lambda: vnni)
        for layout in ("int4", "int8"):
            lin = quant.make_quantized_linear([head], None, layout)
            assert isinstance(lin, quant.Q6KLinear) and np.array_equal(lin.blocks(), data)
    assert isinstance(quant.make_quantized_linear([layer], None, "int4"), Q4Linear)
    ids = torch.tensor([3, 0, 63, 17])
    sub = _rows(lin, ids)
    assert isinstance(sub, quant.Q6KLinear) and torch.equal(sub.dequantized(), lin.dequantized()[ids])


def test_int8_linear_picks_the_int4_kernel_without_vnni(monkeypatch):
    """The int4 layout's 8-bit matrices (and the int8 layout) go to Q8Linear on a CPU without VNNI, where oneDNN's
    int8 product is slow, and stay Int8Linear (oneDNN) with VNNI; the draft-vocabulary subset of a Q8Linear head
    keeps its rows' codes and scales exactly."""
    from forerun.models import quant
    from forerun.models.vocab_subset import _rows

    w = torch.randn(64, 128)
    monkeypatch.setattr(quant, "int8_activation_range", lambda: (127, 128))
    assert isinstance(quant.int8_linear(w), Int8Linear)
    monkeypatch.setattr(quant, "int8_activation_range", lambda: (63, 64))
    if not Q4Linear.fits(64, 256):
        assert isinstance(quant.int8_linear(w), Int8Linear)  # no C kernel: oneDNN it is
        return
    head = quant.int8_linear(w)
    assert isinstance(head, quant.Q8Linear)
    assert isinstance(quant.make_quantized_linear([w], None, "int8"), quant.Q8Linear)
    ids = torch.tensor([3, 0, 63, 17])
    sub = _rows(head, ids)
    assert isinstance(sub, quant.Q8Linear) and torch.equal(sub.dequantized(), head.dequantized()[ids])
    x = torch.randn(2, 128)
    assert torch.equal(sub(x), head(x)[:, ids])


@pytest.mark.parametrize("threads", [1, 2])
def test_q4_products_of_many_rows_run_in_row_blocks_with_the_same_bits(threads):
    """A product of more rows than q4_row_block(K) runs as passes of that many rows (their activations stay in
    cache while every output reads them; session 43): each row as a product of a few rows alone gives it, bit for
    bit (blocks of 128 rows at K = 4,096: two whole blocks, then 44 rows; on an AMX CPU the blocks run on tiles and
    the 7-row products on VNNI)."""
    from forerun.kernels import cpu_q4

    lib = cpu_q4._load()
    if lib is None:
        pytest.skip("no C kernel here")
    assert lib.q4_row_block(4096) == 128 and lib.q4_row_block(8960) == 64 and lib.q4_row_block(1536) == 336
    n, k = 72, 4096
    g = torch.Generator().manual_seed(7)
    packed = cpu_q4.pack_weights(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                                 torch.rand(n, k // 32, generator=g).add_(0.01).half().float(),
                                 -torch.rand(n, k // 32, generator=g).half().float())
    x = torch.randn(300, k, generator=g)
    got = cpu_q4.q4_matmul(x, packed, n, threads)
    want = torch.cat([cpu_q4.q4_matmul(x[i:i + 7], packed, n, threads) for i in range(0, 300, 7)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(40, 64), (100, 544), (1000, 4192), (2052, 1536)])
def test_q4_amx_path_gives_the_vnni_kernels_bits(n, k, threads):
    """On CPUs with AMX, q4_gemm hands products of >= amx_min_rows activation rows to tile products (one per group
    of 32) and then applies the VNNI kernel's float operations in its order: every output is bit-identical to the
    VNNI path's, at every row count, whatever the threshold (so batch invariance holds across the switch). Shapes:
    N not a multiple of 16 outputs (the last tile block partly empty), K leaving a partial chunk (544: 17 groups,
    4192: 131) or fewer than 16 groups (64: 2), row counts around the 16-row tiles; 2 threads split the blocks."""
    from forerun.kernels import cpu_q4

    if not cpu_q4.amx_ready():
        pytest.skip("no AMX here (the avx512amx build, or the kernel's permission for tile data)")
    lib = cpu_q4._load()
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = torch.rand(n, k // 32, generator=g).add_(0.01).half().float()
    o = -torch.rand(n, k // 32, generator=g).half().float()
    packed = cpu_q4.pack_weights(q, s, o)
    x = torch.randn(64, k, generator=g)
    x[3] = 1.0  # every code +127
    before = cpu_q4.amx_min_rows()
    try:
        cpu_q4.amx_min_rows(0)
        want = cpu_q4.q4_matmul(x, packed, n, threads)  # VNNI, 4 rows a pass
        for rows in (1, 5, 16, 17, 33, 40):
            cpu_q4.amx_min_rows(1)
            calls = lib.q4_amx_calls()
            got = cpu_q4.q4_matmul(x[:rows], packed, n, threads)
            assert lib.q4_amx_calls() == calls + 1  # it did run on tiles
            assert torch.equal(got, want[:rows]), (rows, (got - want[:rows]).abs().max())
        cpu_q4.amx_min_rows(32)  # the default switch point: 31 rows on VNNI, 32 on tiles, the same bits
        calls = lib.q4_amx_calls()
        assert torch.equal(torch.cat([cpu_q4.q4_matmul(x[:31], packed, n, threads),
                                      cpu_q4.q4_matmul(x[31:63], packed, n, threads)]), want[:63])
        assert lib.q4_amx_calls() == calls + 1
    finally:
        cpu_q4.amx_min_rows(before)


def test_amx_switch_point_from_the_environment():
    """FORERUN_AMX_MIN_ROWS sets the row count from which the int4 product uses AMX (0: never), read when the kernel
    library loads; anything but a count is refused with a one-line error."""
    import subprocess
    import sys

    from forerun.kernels import cpu_q4

    if not cpu_q4.amx_ready():
        pytest.skip("no AMX here")
    code = "from forerun.kernels import cpu_q4; print(cpu_q4.amx_min_rows())"
    for value, want in (("0", "0"), ("40", "40"), (None, "24")):  # None: the default (session 45; 32, 16 before)
        env = {k: v for k, v in os.environ.items() if k != "FORERUN_AMX_MIN_ROWS"}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env if value is None else {**env, "FORERUN_AMX_MIN_ROWS": value})
        assert r.stdout.strip() == want, r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "FORERUN_AMX_MIN_ROWS": "lots"})
    assert r.returncode != 0 and "FORERUN_AMX_MIN_ROWS must be a row count (0: never), got 'lots'" in r.stderr


def test_cpu_isa_override(monkeypatch):
    from forerun.kernels import cbuild

    monkeypatch.setenv("FORERUN_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="FORERUN_CPU_ISA must be one of avx512amx, avx512, avx2"):
        cbuild.isa()
    monkeypatch.setattr(cbuild, "cpu_ok", lambda feats: "avx512f" not in feats)
    monkeypatch.setenv("FORERUN_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="this CPU lacks"):
        cbuild.isa()
    monkeypatch.delenv("FORERUN_CPU_ISA")
    assert cbuild.isa() == "avx2"
    monkeypatch.setattr(cbuild, "cpu_ok", lambda feats: False)
    assert cbuild.isa() is None


def test_parse_quantize():
    from forerun.kernels import cpu_q4

    assert parse_quantize(None, "gguf") == ("int4" if cpu_q4.available() else "int8")
    assert parse_quantize("auto", "safetensors") == "none"
    assert parse_quantize("int4", "safetensors") == "int4"
    with pytest.raises(ValueError, match="quantize must be one of"):
        parse_quantize("int3", "gguf")


def _load(path, layout="none"):
    return build_model(load_checkpoint(path), "cpu", torch.float32, progress=False, quantize=layout)


def _logits(model, tok_ids):
    llm = LLM.from_model(model, tiny_tokenizer(model.config.vocab_size), device="cpu")
    llm.runner.kv.add_sequence(1)
    with torch.no_grad():
        return llm.runner.forward([Chunk(1, tok_ids, logits="all")])[0].logits


def _kl(got, ref):
    return torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                      reduction="batchmean").item()


@pytest.mark.parametrize("layout", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_safetensors_quantized_logits_close_to_fp32(tmp_path, kind, layout):
    hf = tiny_model(kind, hidden_size=128, intermediate_size=256, tie_word_embeddings=(kind == "qwen2"))
    d = save(hf, tmp_path / "m")
    ids = list(range(3, 40))
    ref = _logits(_load(d), ids)
    model = _load(d, layout)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    got = _logits(model, ids)
    # random weights are the hard case for 4-bit (no structure); the tolerance is on the distributions
    assert _kl(got, ref) < (0.05 if layout == "int8" else 0.2)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= (0.8 if layout == "int8" else 0.6)
    wb = weight_bytes(model)
    assert wb["quantized_linear_bytes"] > 0


def test_gguf_q4_weights_load_exactly_as_int4(tmp_path):
    """A GGUF of Q4_0/Q4_1 linears: the int4 model's weights equal gguf's dequantization up to the bf16
    rounding of the group scale/zero (the only loss), including the un-permuted Llama Q/K rows."""
    hf = tiny_model("llama", tie_word_embeddings=False)
    path = tmp_path / "q.gguf"
    quant = {}
    for i in range(hf.config.num_hidden_layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            quant[f"blk.{i}.{part}.weight"] = QT.Q4_1 if part != "ffn_down" else QT.Q4_0
    quant["output.weight"] = QT.Q8_0
    expect = write_gguf(path, "llama", hf, quant=quant)
    model = _load(path, "int4")
    attn = model.model.layers[1].self_attn
    want = torch.cat([expect[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    got = attn.qkv_proj.dequantized()
    scale = want.abs().amax()
    assert ((got - want).abs().max() / scale).item() < 2e-2  # bf16 scales (2^-9 relative) times |q - 8| <= 8
    from forerun.models import quant as quant_mod

    # Q8_0 has no 4-bit part: kept at 8 bits (per row in oneDNN; per 32 on the int4 kernel without VNNI)
    head_type = Int8Linear if quant_mod.int8_activation_range()[0] == 127 else quant_mod.Q8Linear
    assert isinstance(model.lm_head, head_type)
    ids = list(range(3, 30))
    ref = _logits(_load(path), ids)
    assert _kl(_logits(model, ids), ref) < 0.05


@pytest.mark.parametrize("layout", ["int8"])  # int4 (torch's bf16 kernel) is not batch-invariant: see quant.py
def test_spec_equals_plain_greedy_on_quantized_tiny(tmp_path, layout):
    from tiny import hf_model

    hf = hf_model("qwen2", hidden_size=128, intermediate_size=256)
    d = save(hf, tmp_path / "m")
    model = _load(d, layout)
    tok = tiny_tokenizer(model.config.vocab_size)
    prompts = ["t5 t6 t7 t5 t6 t7 t5 t6", "t9 t10 t11 t12 t9 t10 t11"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM.from_model(model, tok, device="cpu").generate(prompts, sp)
    llm = LLM.from_model(model, tok, device="cpu", spec=SpecConfig(method="early-exit", early_exit_layers=1, k=3))
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.aggregate_stats(outs).drafted > 0


@pytest.mark.slow
@pytest.mark.parametrize("layout,max_kl", [("int8", 0.15), ("int4", 0.05)])  # measured 0.08 / 0.013
def test_smollm2_quantized_vs_fp32(layout, max_kl):
    """Real SmolLM2-135M (Q4_1 GGUF): quantized logits vs the dequantized fp32 path."""
    model, tok, _ = load_model("smollm2-135m-instruct", quantize=layout, progress=False)
    ref_model = load_model("smollm2-135m-instruct", progress=False)[0]
    ids = tok.encode("Speculative decoding checks a draft with one forward pass of the target model. "
                     "def fibonacci(n):\n    if n < 2:\n        return n\n")
    ref = _logits(ref_model, ids)
    del ref_model
    got = _logits(model, ids)
    assert _kl(got, ref) < max_kl


@pytest.mark.slow
def test_smollm2_int8_speculative_greedy_identical_to_plain():
    model, tok, _ = load_model("smollm2-135m-instruct", quantize="int8", progress=False)
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    sp = SamplingParams(temperature=0, max_tokens=32)
    plain = LLM.from_model(model, tok, device="cpu").generate(prompts, sp, chat=True)
    llm = LLM.from_model(model, tok, device="cpu", spec=SpecConfig(method="ngram", k=4))
    outs = llm.generate(prompts, sp, chat=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.aggregate_stats(outs).drafted > 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["int8", "int4"])
def test_qwen_coder_pair_speculative_greedy_identical_to_plain(layout):
    """The real pair both held as int8 or int4 (the CPU default for GGUF where forerun's C kernel runs): greedy
    output with the 0.5B drafting k = 4 (and adaptive k) equals plain greedy output token for token, which needs
    every op on the CPU path to be batch-invariant (tests/test_batch_invariance.py): verify rows must get the bits
    decode rows get."""
    if layout == "int4" and not Q4Linear.fits(128, 128):
        pytest.skip("needs gcc and AVX2 or AVX512-VNNI (forerun/kernels/cpu_q4.c)")
    target, tok, _ = load_model("qwen2.5-coder-1.5b-instruct", quantize=layout, progress=False)
    draft, dtok, _ = load_model("qwen2.5-coder-0.5b-instruct", quantize=layout, progress=False)
    prompts = ["Write a Python function that checks whether a number is prime.",
               "Write a function that reverses a string in JavaScript.",
               "Write a Python class for a stack with push, pop and peek."]
    sp = SamplingParams(temperature=0, max_tokens=48)
    specs = [SpecConfig(method="draft", draft_model=(draft, dtok), k=4),
             SpecConfig(method="draft", draft_model=(draft, dtok), adaptive=True, k_max=6)]
    if layout == "int8":  # the fallback layout: one spec and two prompts keep CI under ~20 minutes (int4 runs all);
        # one prompt where the int8 linears are Q8Linear (no VNNI): the int4 kernel, which the int4 case runs anyway
        prompts, specs = prompts[:1 if isinstance(target.lm_head, Q8Linear) else 2], specs[:1]
    plain = LLM.from_model(target, tok, device="cpu").generate(prompts, sp, chat=True)
    for spec in specs:
        llm = LLM.from_model(target, tok, device="cpu", check_invariants=True, spec=spec)
        outs = llm.generate(prompts, sp, chat=True)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], spec
        assert llm.aggregate_stats(outs).acceptance_rate > 0.3


def test_triton_q4_q8_kernels_match_dequantized_matmul_in_interpreter():
    """forerun/kernels/quant_gemm.py run by Triton's CPU interpreter (fp16: the interpreter has no bf16 dot):
    both inner products, 1..16 rows, against x @ dequantized(W)^T. Timing lives in benchmarks/quant_gemm.py."""
    import os
    import subprocess
    import sys

    code = """
import torch
from forerun.kernels.quant_gemm import *
torch.manual_seed(0)
w = torch.randn(40, 512)
qw, s, z = quantize_int4(w.half())
assert torch.equal(pack_int4(unpack_int4(qw)), qw)
wd4 = dequantize_int4(qw, s, z)
assert (wd4 - w).abs().max() <= (w.amax() - w.amin()) / 15
q, s8 = quantize_int8(w.half())
wd8 = dequantize_int8(q, s8)
for m in (1, 3, 16):
    x = torch.randn(m, 512).half()
    for dot in (False, True):
        for y, ref in ((q4_linear(x, qw, s, z, use_dot=dot), x.float() @ wd4.t()),
                       (q8_linear(x, q, s8, use_dot=dot), x.float() @ wd8.t())):
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-3, (m, dot, err)
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_a_draft_model_loads_its_8_bit_matrices_and_head_as_int4(monkeypatch):
    """quant.int4_others sets, for loads inside it, how GGUF matrices with no 4-bit part are held; the engine and
    the bench load a separate draft model under DRAFT_INT4_OTHERS ("int4": its 8-bit matrices and head too), the
    target under the default ("layers": the head and 8-bit matrices stay int8). Restored afterwards, even on error."""
    from types import SimpleNamespace

    from forerun.engine import engine as engine_mod
    from forerun.models import quant

    head = SimpleNamespace(type_name="Q8_0", where="tensor output.weight")
    q6 = SimpleNamespace(type_name="Q6_K", where="tensor blk.0.ffn_down.weight")
    assert quant.INT4_OTHERS == "layers"
    assert not quant._requantize_to_int4(head) and quant._requantize_to_int4(q6)
    with quant.int4_others("int4"):
        assert quant._requantize_to_int4(head)
    with quant.int4_others("int8"):
        assert not quant._requantize_to_int4(q6)
    assert quant.INT4_OTHERS == "layers"
    with pytest.raises(RuntimeError), quant.int4_others("int4"):
        raise RuntimeError("a failed load")
    assert quant.INT4_OTHERS == "layers"
    with pytest.raises(ValueError, match="must be one of layers, int8, int4"):
        with quant.int4_others("int2"):
            pass
    seen = []
    monkeypatch.setattr(engine_mod, "load_model", lambda *a, **kw: seen.append(quant.INT4_OTHERS) or ("m", "t", "c"))
    assert engine_mod.load_draft_model("draft.gguf", "cpu", torch.float32, quantize="auto") == ("m", "t", "c")
    assert seen == [quant.DRAFT_INT4_OTHERS] == ["int4"] and quant.INT4_OTHERS == "layers"


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("layout", ["int4", "int8"])
def test_gguf_embedding_stays_in_its_blocks_with_the_same_rows_and_logits(tmp_path, tied, layout):
    """The CPU layouts keep a quantized GGUF embedding in its blocks (GGUFEmbedding): every row it returns is the
    fp32 table's row bit for bit, so the logits are those of the same quantized model with the fp32 table; the
    fp32 table is never allocated, weight_bytes counts the blocks, ids out of range raise."""
    from forerun.models.gguf_embedding import GGUFEmbedding

    hf = tiny_model("qwen2", tie_word_embeddings=tied)
    path = tmp_path / "e.gguf"
    quant = {"token_embd.weight": QT.Q5_0}
    for i in range(hf.config.num_hidden_layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            quant[f"blk.{i}.{part}.weight"] = QT.Q4_1
    expect = write_gguf(path, "qwen2", hf, quant=quant)
    model = _load(path, layout)
    emb = model.model.embed_tokens
    assert isinstance(emb, GGUFEmbedding) and emb.type_name == "Q5_0"
    assert "model.embed_tokens.weight" not in dict(model.named_parameters())
    table = expect["model.embed_tokens.weight"]
    ids = torch.arange(table.shape[0]).reshape(4, -1)
    got = emb(ids)
    assert got.dtype == torch.float32 and got.shape == (*ids.shape, table.shape[1])
    assert torch.equal(got, table[ids]) and torch.equal(emb.weight, table)
    assert emb(torch.zeros(0, dtype=torch.long)).shape == (0, table.shape[1])
    # small lookups (decode, verify, drafting steps) go through the row cache: the same rows, repeats included,
    # a caller writing into what it got changes nothing cached, and a full cache is cleared and refilled
    emb._cache.clear()
    small = torch.tensor([[5, 9, 5], [table.shape[0] - 1, 0, 9]])
    first = emb(small)
    assert torch.equal(first, table[small]) and set(emb._cache) == {0, 5, 9, table.shape[0] - 1}
    first.add_(1.0)
    assert torch.equal(emb(small), table[small])
    emb._cache_rows = 3  # the next miss overflows it
    assert torch.equal(emb(torch.tensor([7, 8])), table[[7, 8]]) and set(emb._cache) == {7, 8}
    with pytest.raises(IndexError):
        emb(torch.tensor([3, -1]))
    with pytest.raises(IndexError):
        emb(torch.tensor([table.shape[0]]))
    assert weight_bytes(model)["other_bytes"] >= emb.quantized_bytes > 0
    tok_ids = list(range(3, 40))
    got_logits = _logits(model, tok_ids)
    model.model.embed_tokens = torch.nn.Embedding.from_pretrained(table)  # the fp32 table, as before
    assert torch.equal(got_logits, _logits(model, tok_ids))


def test_requantizing_a_gguf_matrix_reads_it_by_row_chunks_with_the_same_result():
    """A GGUF matrix re-quantized at load (the 8-bit head, 5/6-bit layer matrices) is read a chunk of rows at a
    time (loader.DequantizedRows: no fp32 copy of a 151,936-row head): the same modules, bit for bit, as from the
    whole dequantized matrix; chunked quantize_groups_int4 equals a one-pass reference. 9,000 rows: two chunks."""
    from forerun.models import quant as quant_mod
    from forerun.models.loader import DequantizedRows, GGUFQuantized

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((9000, 64)) * 0.05).astype(np.float32)
    x = torch.randn(5, 64)
    for qt in (QT.Q8_0, QT.Q5_0):
        g = GGUFQuantized(quantize(w, qt), qt.name, w.shape)
        full = g.dequantize()
        rows = g.rows()
        assert isinstance(rows, DequantizedRows) and rows.shape == full.shape
        assert torch.equal(rows[8000:9000], full[8000:9000])
        lazy = quant_mod.make_quantized_linear([g], None, "int8")
        assert torch.equal(lazy(x), quant_mod.int8_linear(full)(x))
        if quant_mod.Q4Linear.fits(9000, 64):
            with quant_mod.int4_others("int4"):
                lazy4 = quant_mod.make_quantized_linear([g], None, "int4")
            assert torch.equal(lazy4(x), quant_mod.Q4Linear(*quant_mod.quantize_groups_int4(full), None)(x))
    t = torch.from_numpy(w).reshape(9000, 2, 32)
    lo, hi = t.amin(-1), t.amax(-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((t - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).reshape(9000, 64)
    got = quant_mod.quantize_groups_int4(torch.from_numpy(w))
    assert torch.equal(got[0], q) and torch.equal(got[1], scale) and torch.equal(got[2], lo)


def test_llm_keeps_a_gguf_quantized_by_default(tmp_path):
    """LLM / Engine load a GGUF by path in the quantized layout by default (quantize=None -> "auto"), as the CLI
    does; a float dtype the CPU layout does not compute in (bfloat16) asks for float weights instead ("none")."""
    from forerun.models.quant import Int8Linear, Q8Linear

    from test_loader import _byte_level_tokens

    tokens = _byte_level_tokens() + ["Ġt", "he", "Ġthe", "<|endoftext|>"]
    hf = tiny_model("qwen2", tie_word_embeddings=False, vocab_size=len(tokens))
    path = tmp_path / "d.gguf"
    quant = {f"blk.{i}.{p}.weight": QT.Q4_1 for i in range(hf.config.num_hidden_layers)
             for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    write_gguf(path, "qwen2", hf, quant=quant,
               extra_kv={"add_tokenizer_model": "gpt2", "add_token_list": tokens,
                         "add_token_merges": ["Ġ t", "h e", "Ġt he"], "add_tokenizer_pre": "qwen2"})
    quantized = (Q4Linear, Int4Linear, Int8Linear, Q8Linear)
    llm = LLM(str(path), device="cpu")
    assert llm.engine.quantize == "auto"
    assert isinstance(llm.engine.model.model.layers[0].self_attn.o_proj, quantized)
    bf16 = LLM(str(path), device="cpu", dtype=torch.bfloat16)
    assert bf16.engine.quantize == "none"
    assert not isinstance(bf16.engine.model.model.layers[0].self_attn.o_proj, quantized)
    assert LLM(str(path), device="cpu", quantize="none").engine.quantize == "none"
