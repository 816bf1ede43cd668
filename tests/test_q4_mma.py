"""The int4 tensor-core product of 2-16 rows (forerun/kernels/q4_mma.py): its source compiles without spills where
nvcc exists (this CPU machine), its lane-to-code mapping -- transcribed here lane by lane, with the MMA's register
layout of the PTX ISA -- gives x @ dequantized(W)^T on the CPU, and on a GPU the kernel itself does, plain and
SwiGLU, 2-16 rows, in a CUDA graph, with and without PDL, and as CudaQ4Linear's products where the table names it."""
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
import torch

from forerun.kernels import q4_mma
from forerun.kernels.quant_gemm import pack_int4_w32
from forerun.models.quant import quantize_groups_int4


def _quantized(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    q, s, z = quantize_groups_int4(w)
    s, z = s.bfloat16(), z.bfloat16()
    deq = (q.double().reshape(n, k // 32, 32) * s.double()[..., None] + z.double()[..., None]).reshape(n, k)
    return q, s, z, deq.to(torch.bfloat16).float()  # w = q * scale + zero, rounded once


def test_source_compiles_without_spills():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    with tempfile.TemporaryDirectory() as d:
        for k, w, depth, tiles, glu, pdl, xst in (
                (4096, 8, 4, 1, 0, 1, 0), (4096, 8, 4, 2, 1, 1, 0), (12288, 8, 4, 2, 0, 1, 0),
                (1536, 4, 3, 2, 0, 0, 0), (896, 1, 4, 1, 1, 1, 0), (4864, 2, 4, 2, 1, 1, 0), (4096, 8, 4, 4, 1, 1, 0),
                (12288, 8, 4, 4, 0, 1, 0), (4096, 4, 4, 3, 1, 1, 0), (4096, 8, 4, 2, 1, 1, 1),
                (12288, 8, 4, 2, 0, 1, 1), (4096, 4, 4, 2, 1, 1, 1), (896, 1, 4, 2, 1, 1, 1)):
            assert not xst or q4_mma.staged_fits(w, tiles, bool(glu))
            src = os.path.join(d, "k.cu")
            with open(src, "w") as f:  # (the packed scales' variant where PDL is on: the one the engine runs)
                f.write(q4_mma.source(k, w, depth, tiles, bool(glu), bool(pdl), bool(pdl), bool(xst)))
            out = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", os.path.join(d, "k.cubin"), src,
                                  "-Xptxas", "-v"], capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            assert "0 bytes spill stores" in out.stderr, (k, w, depth, out.stderr[-500:])


def _sass(source: str) -> str:
    import triton
    nvcc = shutil.which("nvcc")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if nvcc is None or not os.path.exists(cuobjdump):
        pytest.skip("no nvcc / cuobjdump here")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.cu"), "w") as f:
            f.write(source)
        subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", os.path.join(d, "k.cubin"), os.path.join(d, "k.cu")],
                       check=True, capture_output=True, timeout=300)
        return subprocess.run([cuobjdump, "-sass", os.path.join(d, "k.cubin")], capture_output=True, text=True,
                              check=True, timeout=120).stdout


def _activations_after_the_wait(sass: str) -> bool:
    """In the machine code: before griddepcontrol.wait (ACQBULK) only read-only loads (the weights, scales and
    offsets, __ldg: LDG...CONSTANT), and the activations read with coherent loads (__ldca: LDG...STRONG.SM). A
    read-only load of the activations may be moved above the wait by ptxas, reading them before the kernel before
    has written them (it happened: q4_mma's first version failed the PDL chain test on the H200)."""
    import re
    pre, wait, post = sass.partition("ACQBULK")
    return bool(wait) and all(ld.endswith("CONSTANT") for ld in re.findall(r"LDG\.E[\w.]*", pre)) \
        and re.search(r"LDG\.E[\w.]*\.STRONG\.", post) is not None


def test_activations_are_read_after_the_wait_in_the_machine_code():
    """Both NVRTC int4 kernels (this one and kernels/q4_cuda.py, plain, with the add + RMSNorm prologue and with the
    split norm's halves: the residual and the partial sums are written by kernels before too), in the
    configurations the H200 table uses, with PDL; the old read-only load of the activations is caught."""
    from forerun.kernels import q4_cuda
    sources = [q4_mma.source(k, w, d, nt, glu, True, packed, xst) for k, w, d, nt, glu, packed, xst in
               ((4096, 8, 4, 1, False, True, False), (4096, 4, 4, 1, True, True, False),
                (12288, 8, 4, 1, False, True, False), (4096, 4, 4, 2, True, False, False),
                (4096, 8, 4, 4, True, True, False), (4096, 8, 4, 2, True, True, True),
                (12288, 8, 4, 1, False, True, True))]
    sources += [q4_cuda.source(4096, 2, 16, 2, False, True, False), q4_cuda.source(4096, 1, 16, 2, True, True, False),
                q4_cuda.source(12288, 1, 16, 4, False, True, False), q4_cuda.source(4096, 2, 16, 2, False, True, True),
                q4_cuda.source(4096, 1, 16, 2, True, True, split=128), q4_cuda.source(4096, 2, 16, 2, False, True, split=256),
                q4_cuda.source(4096, 2, 16, 4, False, True, add=True), q4_cuda.source(12288, 1, 16, 4, False, True, add=True)]
    for src in sources:
        assert _activations_after_the_wait(_sass(src)), src[:200]
    old = q4_mma.source(4096, 8, 4, 1, False, True).replace("__ldca(x +", "__ldg(x +")
    assert not _activations_after_the_wait(_sass(old))


def _row_requested_at_once(sass: str) -> tuple[int, bool]:
    """(the coherent 16-byte loads between griddepcontrol.wait and the first barrier, whether every one of them is
    issued before the first shuffle or store): a thread's words of the activation row (and of the residual) go to
    the L2 together, one round trip, not one trip per word."""
    import re
    post = sass.partition("ACQBULK")[2].partition("BAR.SYNC")[0]
    ops = re.findall(r"LDG\.E\.128\.STRONG\.\w+|SHFL\.\w+|STS[.\w]*|STG[.\w]*", post)
    loads = [o.startswith("LDG") for o in ops]
    first_other = loads.index(False) if False in loads else len(loads)
    return sum(loads), all(loads[:first_other]) and sum(loads[:first_other]) == sum(loads)


def test_the_activation_row_is_requested_at_once_in_the_machine_code():
    """kernels/q4_cuda.py's 1-row kernel where a thread holds several words of the row (K / 8 > 32 x warps: down's
    12288-wide row at 16 warps, the 4096-wide rows at 12 or 8 warps; plain, with the add + RMSNorm prologue, the
    split norm's and the add epilogue's builds) requests them all before converting any. Converted one load at a
    time they cost one L2 round trip each on the critical path after the wait (session 58: ptxas kept the loads
    behind the shuffles, shared stores and block 0's store of the sum). The check itself sees interleaving: the
    staged-activation build of kernels/q4_mma.py stores each piece before loading the next, and fails it."""
    from forerun.kernels import q4_cuda
    for args, kw, words in (((12288, 1, 16, 4, False, True), {}, 3), ((4096, 2, 12, 2, False, True), {}, 2),
                            ((4096, 2, 8, 2, False, True), {}, 2), ((4096, 1, 8, 4, False, True), {}, 2),
                            ((4096, 2, 12, 2, False, True, True), {}, 4), ((4096, 2, 8, 2, False, True, True), {}, 4),
                            ((4096, 2, 8, 2, False, True), dict(split=256), 2),
                            ((12288, 1, 16, 4, False, True), dict(add=True), 3)):
        n, at_once = _row_requested_at_once(_sass(q4_cuda.source(*args, **kw)))
        assert n == words and at_once, (args, kw, n)
    n, at_once = _row_requested_at_once(_sass(q4_mma.source(12288, 8, 4, 1, False, True, True, True)))
    assert n > 1 and not at_once


def _mma(a_regs, b_regs, c):
    """mma.m16n8k16 (row.col) over a warp, by the PTX ISA's fragment layout: a_regs [32, 4, 2] (a0..a7), b_regs
    [32, 2, 2], c [32, 4] float; lane = 4 g + t."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for e in range(2):
            A[g, 2 * t + e], A[g + 8, 2 * t + e] = a_regs[lane, 0, e], a_regs[lane, 1, e]
            A[g, 2 * t + 8 + e], A[g + 8, 2 * t + 8 + e] = a_regs[lane, 2, e], a_regs[lane, 3, e]
            B[2 * t + e, g], B[2 * t + 8 + e, g] = b_regs[lane, 0, e], b_regs[lane, 1, e]
    D = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]


def _bf16_halves(word):  # an int32 of packed_scales -> (scale, offset) as floats
    w = int(word) & 0xFFFFFFFF
    return tuple(float(torch.tensor([h], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)) for h in
                 (w & 0xFFFF, w >> 16))


def _emulate(x, q, s, z, warps, glu, packed=None):
    """q4m_gemm, lane by lane: which codes and activations each lane puts in which MMA register, as the kernel does;
    with packed (q4_mma.packed_scales), each lane's scales and offsets read from it as the SZP kernel does."""
    t_rows, k = x.shape
    n = q.shape[0]
    n_out = n // 2 if glu else n
    spw, tiles = k // 128 // warps, -(-t_rows // 8)
    words = pack_int4_w32(q).numpy().view(np.uint32)  # [N, K / 8]
    sf, zf = s.float().numpy(), z.float().numpy()
    xf = x.float().numpy()
    y = np.zeros((t_rows, n_out))

    def deq(row, gi, i, j, sz):  # pair j of word i of group gi of a row, dequantized as the kernel's bfma2 chain
        w = int(words[row, 4 * gi + i])
        lo, hi = (w >> (4 * j)) & 15, (w >> (16 + 4 * j)) & 15
        return [float(torch.tensor(c * sz[0] + sz[1], dtype=torch.float64).bfloat16()) for c in (lo, hi)]

    for n0 in range(0, n_out, 16):
        acc = np.zeros((tiles, 2 if glu else 1, 32, 4))
        for warp in range(warps):
            for s_ in range(warp * spw, (warp + 1) * spw):
                for u in range(8):
                    i, j = u >> 1, 2 * (u & 1)
                    for r in range(2 if glu else 1):
                        a = np.zeros((32, 4, 2))
                        b = np.zeros((tiles, 32, 2, 2))
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            gi = 4 * s_ + t
                            rows = [n0 + g + h * 8 + (n_out if r else 0) for h in (0, 1)]
                            if packed is None:
                                sz = [(sf[rw, gi], zf[rw, gi]) for rw in rows]
                            else:
                                tile = (n0 + (n_out if r else 0)) // 16
                                sz = [_bf16_halves(packed[tile, s_, lane, h]) for h in (0, 1)]
                            a[lane] = [deq(rows[0], gi, i, j, sz[0]), deq(rows[1], gi, i, j, sz[1]),
                                       deq(rows[0], gi, i, j + 1, sz[0]), deq(rows[1], gi, i, j + 1, sz[1])]
                            for nt in range(tiles):
                                tok = g + 8 * nt
                                if tok < t_rows:
                                    base = 32 * gi + 8 * i + 2 * j
                                    b[nt, lane] = [xf[tok, base: base + 2], xf[tok, base + 2: base + 4]]
                        for nt in range(tiles):
                            _mma(a, b[nt], acc[nt, r])
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for nt in range(tiles):
                for e in range(4):
                    tok, row = 8 * nt + 2 * t + (e & 1), n0 + g + 8 * (e >> 1)
                    v = acc[nt, 0, lane, e]
                    if glu:
                        v = v / (1 + np.exp(-v)) * acc[nt, 1, lane, e]
                    if tok < t_rows:
                        y[tok, row] = v
    return y


@pytest.mark.parametrize("rows,glu,warps", [(3, False, 2), (8, True, 1), (13, False, 2), (16, True, 2),
                                             (21, True, 2), (32, False, 1)])
def test_lane_mapping_gives_the_product(rows, glu, warps):
    k, n = 256, 64 if glu else 32
    q, s, z, deq = _quantized(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = x.float() @ deq.t()
    if glu:
        want = torch.nn.functional.silu(want[:, : n // 2]) * want[:, n // 2:]
    got = torch.from_numpy(_emulate(x, q, s, z, warps, glu)).float()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    # the check can fail: the lanes' k positions swapped between A and B
    q2 = q.reshape(n, k // 8, 4, 2).flip(2).reshape(n, k)
    bad = torch.from_numpy(_emulate(x, q2, s, z, warps, glu)).float()
    assert ((bad - want).abs().max() / want.abs().max()).item() > 0.05


@pytest.mark.parametrize("rows,glu,warps", [(5, True, 2), (11, False, 1)])
def test_packed_scales_give_the_same_product(rows, glu, warps):
    """The kernel's copy of the scales and offsets (q4_mma.packed_scales), read lane by lane as the SZP kernel does,
    gives exactly what scale / zero give; a copy with rows g and g + 8 swapped does not."""
    k, n = 256, 64 if glu else 32
    q, s, z, _ = _quantized(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    packed = q4_mma.packed_scales(s, z)
    assert packed.shape == (n // 16, k // 128, 32, 2) and packed.dtype == torch.int32
    want = _emulate(x, q, s, z, warps, glu)
    assert np.array_equal(_emulate(x, q, s, z, warps, glu, packed.numpy()), want)
    swapped = packed.flip(-1).contiguous()
    assert not np.allclose(_emulate(x, q, s, z, warps, glu, swapped.numpy()), want, rtol=1e-3, atol=1e-3)
    assert q4_mma.packed_scales(s[:24], z[:24]) is None  # N not a multiple of 16


def test_lane_scales_go_to_the_tensor_core_kernel_only_and_count_as_memory(monkeypatch):
    """q4_product hands CudaQ4Linear's lane-ordered scales to the tensor-core kernel ("m") and to no other; on the CPU
    the copy is not built; where it is, the memory report counts it once, as quantized-linear bytes, and the state
    dict leaves it out (it is derived)."""
    from forerun.models import quant, quant_cuda
    calls = []
    for name in ("m", "c"):
        monkeypatch.setitem(quant_cuda.KERNELS, name, lambda *a, _n=name, **kw: calls.append((_n, kw.get("packed"))))
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    cfg = dict(block_n=16, block_k=256, use_dot=True, num_warps=2, num_stages=2)
    quant_cuda.q4_product(x, None, None, None, False, dict(cfg, kernel="m"), "lane scales")
    quant_cuda.q4_product(x, None, None, None, False, dict(cfg, kernel="c"), "lane scales")
    quant_cuda.q4_product(x, None, None, None, False, dict(cfg, kernel="m"))
    quant_cuda.q4_product(x, None, None, None, False, dict(cfg, kernel="m", lane_scales=False), "lane scales")
    assert calls == [("m", "lane scales"), ("c", None), ("m", None), ("m", None)]
    # a tuned entry's choice reaches q4_product (the tuner tries both; entries without the key read them)
    monkeypatch.setattr(quant_cuda, "_card", ["test card"])
    monkeypatch.setitem(quant_cuda.NVRTC_KERNELS, "m", lambda: True)
    quant_cuda.set_configs("test card", {quant_cuda.config_key(4, 64, 256, False): dict(cfg, kernel="m",
                                                                                        lane_scales=False),
                                         quant_cuda.config_key(8, 64, 256, False): dict(cfg, kernel="m")})
    assert quant_cuda.tuned(4, 64, 256, False)["lane_scales"] is False
    assert "lane_scales" not in quant_cuda.tuned(8, 64, 256, False)
    lin = quant_cuda.CudaQ4Linear.from_float(torch.randn(32, 256))
    assert lin.lane_scales is None
    before = quant.weight_bytes(lin)
    lin.lane_scales = q4_mma.packed_scales(lin.scale, lin.zero)
    after = quant.weight_bytes(lin)
    extra = 32 * 256 // 32 * 4  # a bf16 scale and offset per group of 32
    assert after["quantized_linear_bytes"] == before["quantized_linear_bytes"] + extra
    assert after["total_bytes"] == before["total_bytes"] + extra and "lane_scales" not in lin.state_dict()


def test_table_entries_fall_back_where_the_kernel_cannot_run(monkeypatch):
    """A tuned entry naming the tensor-core kernel ("m") gives the Triton entry kept beside it (or the default) where
    NVRTC cannot run, FORERUN_Q4_MMA=0, or the shape does not fit the kernel; and is used where it can."""
    from forerun.models import quant_cuda
    monkeypatch.setattr(quant_cuda, "_card", ["test card"])
    key = quant_cuda.config_key(4, 64, 256, False)
    m = dict(kernel="m", block_n=16, block_k=256, use_dot=True, num_warps=2, num_stages=2)
    r = dict(kernel="r", block_n=8, block_k=256, use_dot=False, num_warps=4, num_stages=2)
    quant_cuda.set_configs("test card", {key: m, "triton_" + key: r})
    monkeypatch.setitem(quant_cuda.NVRTC_KERNELS, "m", lambda: False)
    assert quant_cuda.tuned(4, 64, 256, False) == r
    monkeypatch.setitem(quant_cuda.NVRTC_KERNELS, "m", lambda: True)
    assert quant_cuda.tuned(4, 64, 256, False) == m
    assert quant_cuda.tuned(3, 64, 256, False) == m  # an untuned row count takes the next tuned one
    monkeypatch.setitem(quant_cuda.NVRTC_KERNELS, "m", lambda: False)
    assert quant_cuda.tuned(3, 64, 256, False) == r  # ... or the Triton entry kept beside that one
    monkeypatch.setitem(quant_cuda.NVRTC_KERNELS, "m", lambda: True)
    bad = quant_cuda.config_key(4, 72, 256, False)  # 72 outputs: not a multiple of 16
    quant_cuda.set_configs("test card", {bad: m, "triton_" + bad: r})
    assert quant_cuda.tuned(4, 72, 256, False) == r
    monkeypatch.setattr(q4_mma.nvrtc, "available", lambda t=None: True)
    monkeypatch.delenv("FORERUN_Q4_MMA", raising=False)
    assert q4_mma.available()  # on by default where NVRTC runs
    monkeypatch.setenv("FORERUN_Q4_MMA", "0")
    assert not q4_mma.available()
    monkeypatch.setattr(q4_mma.nvrtc, "available", lambda t=None: False)
    monkeypatch.delenv("FORERUN_Q4_MMA")
    assert not q4_mma.available()


def test_untuned_shapes_take_the_tensor_core_kernel_from_two_rows(monkeypatch):
    """A shape the table does not hold (a draft model's) runs 2-32 rows on the tensor-core kernel where it can run
    (K split over the warps that divide it), else the Triton default; 1 row takes the CUDA C++ kernel's default where
    it can run (session 49), else Triton's. (Both kernels' availability is set here: on a GPU the 1-row default
    used to be compared with Triton's while the CUDA C++ kernel could run, and failed there only.)"""
    from forerun.models import quant_cuda
    monkeypatch.setattr(quant_cuda, "_card", ["test card"])
    quant_cuda.set_configs("test card", {})
    monkeypatch.setitem(quant_cuda.NVRTC_KERNELS, "m", lambda: True)
    monkeypatch.setitem(quant_cuda.NVRTC_KERNELS, "c", lambda: True)
    assert quant_cuda.tuned(1, 1024, 3072, True) == quant_cuda.default_c_config(1024, 3072, True)
    assert quant_cuda.tuned(1, 1024, 3072, True)["kernel"] == "c"
    monkeypatch.setitem(quant_cuda.NVRTC_KERNELS, "c", lambda: False)
    for m in (2, 3, 4, 9, 16):
        assert quant_cuda.tuned(m, 1024, 3072, True) == dict(kernel="m", block_n=16, block_k=3072, use_dot=True,
                                                            num_warps=8, num_stages=4)
    assert quant_cuda.tuned(4, 896, 896, False)["num_warps"] == 1  # 7 superblocks: one warp
    assert quant_cuda.tuned(1, 1024, 3072, True) == quant_cuda.default_config(1)
    assert quant_cuda.tuned(32, 1024, 3072, True)["kernel"] == "m"  # (CudaQ4Linear calls it with up to 32 rows)
    assert quant_cuda.tuned(33, 1024, 3072, True) == quant_cuda.default_config(33)
    assert quant_cuda.tuned(4, 72, 1024, False) == quant_cuda.default_config(4)  # 72 outputs do not fit
    assert quant_cuda.tuned(4, 1024, 1024, False, bits=8) == quant_cuda.default_config(4, 8)
    monkeypatch.setitem(quant_cuda.NVRTC_KERNELS, "m", lambda: False)
    assert quant_cuda.tuned(4, 1024, 3072, True) == quant_cuda.default_config(4)


def test_more_than_16_rows_take_the_tensor_core_kernel_in_32_row_calls(monkeypatch):
    """17-32 rows: the 16-row entry where it names the tensor-core kernel, and CudaQ4Linear calls it with up to 32
    rows at once (the weights streamed once for a 4 x 5-token verification); 16-row calls where it cannot run."""
    from forerun.models import quant_cuda
    monkeypatch.setattr(quant_cuda, "_card", ["test card"])
    m16 = dict(kernel="m", block_n=16, block_k=256, use_dot=True, num_warps=2, num_stages=2)
    t16 = dict(kernel="t", block_n=64, block_k=256, use_dot=True, num_warps=4, num_stages=3)
    quant_cuda.set_configs("test card", {quant_cuda.config_key(16, 64, 256, False): m16,
                                         "triton_" + quant_cuda.config_key(16, 64, 256, False): t16})
    monkeypatch.setitem(quant_cuda.NVRTC_KERNELS, "m", lambda: True)
    assert quant_cuda.tuned(20, 64, 256, False) == m16 == quant_cuda.tuned(32, 64, 256, False)
    calls = []
    monkeypatch.setitem(quant_cuda.KERNELS, "m", lambda x, *a, **kw: calls.append(("m", x.shape[0])) or x[:, :64])
    monkeypatch.setitem(quant_cuda.KERNELS, "t", lambda x, *a, **kw: calls.append(("t", x.shape[0])) or x[:, :64])
    lin = quant_cuda.CudaQ4Linear(torch.randint(0, 16, (64, 256)), torch.ones(64, 8), torch.zeros(64, 8))
    x = torch.randn(45, 256, dtype=torch.bfloat16)
    assert lin._product(x, False).shape == (45, 64)
    assert calls == [("m", 32), ("m", 13)]
    calls.clear()
    monkeypatch.setitem(quant_cuda.NVRTC_KERNELS, "m", lambda: False)
    assert lin._product(x, False).shape == (45, 64)
    assert calls == [("t", 16), ("t", 16), ("t", 13)]


def test_save_configs_merges_entries_into_the_file(tmp_path, monkeypatch):
    """The tuning benchmarks' --write: whole entries replaced or added for one card, the rest of the file kept."""
    import json

    from forerun.models import quant_cuda
    path = tmp_path / "q4_configs.json"
    path.write_text(json.dumps({"card A": {"k1": {"kernel": "r"}, "k2": {"kernel": "t"}}, "card B": {"k1": {}}}))
    monkeypatch.setattr(quant_cuda, "CONFIGS", path)
    quant_cuda.save_configs("card A", {"k2": {"kernel": "m"}, "triton_k2": {"kernel": "t"}})
    quant_cuda.save_configs("card C", {"k9": {"kernel": "c"}})
    assert json.loads(path.read_text()) == {"card A": {"k1": {"kernel": "r"}, "k2": {"kernel": "m"},
                                                       "triton_k2": {"kernel": "t"}},
                                            "card B": {"k1": {}}, "card C": {"k9": {"kernel": "c"}}}


def test_staged_activations_fit_or_fall_back():
    """The staged activations (XST) run up to 2 tiles (16 rows; 4 tiles with SwiGLU spill) with their shared memory
    within 48 KB; elsewhere q4m_linear loads directly (the tuned 16-row entry also serves 17-32 rows)."""
    assert q4_mma.staged_fits(8, 2, True) and q4_mma.staged_fits(4, 2, True) and q4_mma.staged_fits(1, 1, False)
    assert not q4_mma.staged_fits(4, 3, False) and not q4_mma.staged_fits(16, 2, False)
    assert "#define XST 1" in q4_mma.source(4096, 8, 4, 2, True, True, True, True)
    assert "#define XST 0" in q4_mma.source(4096, 8, 4, 2, True, True, True)


def test_fits_and_default_warps():
    assert q4_mma.fits(5, 4096, 4096) and q4_mma.fits(32, 16, 128) and not q4_mma.fits(33, 4096, 4096)
    assert not q4_mma.fits(4, 4100, 4096) and not q4_mma.fits(4, 4096, 4000)
    assert q4_mma.default_warps(4096) == 8 and q4_mma.default_warps(12288) == 8 and q4_mma.default_warps(896) == 1
    assert q4_mma.default_warps(1536) == 4 and q4_mma.default_warps(4864) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
def test_mma_kernel_on_gpu(monkeypatch):
    """q4m_linear against x @ dequantized(W)^T (float32): rows 1-32, K 896 / 1536 / 4096 / 12288, plain and SwiGLU,
    warps and depths, PDL on and off, replayed from a CUDA graph; a broken layout fails."""
    from forerun.models.quant_cuda import CudaQ4Linear
    monkeypatch.setenv("FORERUN_Q4_MMA", "1")
    assert q4_mma.available(), "the NVRTC kernel did not compile on the GPU machine"
    torch.manual_seed(0)
    made = CudaQ4Linear.from_float(torch.randn(32, 256, device="cuda", dtype=torch.bfloat16))
    assert made.lane_scales is not None and "lane_scales" not in made.state_dict()
    for n, k in ((64, 896), (256, 1536), (6144, 4096), (512, 12288)):
        lin = CudaQ4Linear.from_float(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        ref = lin.dequantized().float()
        for rows in (1, 5, 9, 16, 20, 32):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            y = x.float() @ ref.t()
            glu = torch.nn.functional.silu(y[:, : n // 2]) * y[:, n // 2:]
            for warps, depth, pdl in ((None, None, True), (1, 2, False), (2, 8, True)):
                if k % (128 * (warps or 1)) or (warps == 1 and k > 1536):  # (long unrolled loops compile slowly)
                    continue
                got = q4_mma.q4m_linear(x, lin.qw32, lin.scale, lin.zero, warps=warps, depth=depth, pdl=pdl)
                assert ((got.float() - y).abs().max() / y.abs().max()).item() < 1e-2, (n, k, rows, warps)
                if warps is None:  # the copy of the scales CudaQ4Linear keeps: bit for bit
                    packed = q4_mma.q4m_linear(x, lin.qw32, lin.scale, lin.zero, depth=depth, pdl=pdl,
                                               packed=lin.lane_scales)
                    assert torch.equal(packed, got), (n, k, rows, "packed")
                    staged = q4_mma.q4m_linear(x, lin.qw32, lin.scale, lin.zero, depth=depth, pdl=pdl,
                                               packed=lin.lane_scales, staged=True)  # (direct loads past 48 KB)
                    assert torch.equal(staged, got), (n, k, rows, "staged")
                got = q4_mma.q4m_linear(x, lin.qw32, lin.scale, lin.zero, glu=True, warps=warps, depth=depth, pdl=pdl)
                assert ((got.float() - glu).abs().max() / glu.abs().max()).item() < 2e-2, (n, k, rows, warps, "glu")
                if warps is None:
                    packed = q4_mma.q4m_linear(x, lin.qw32, lin.scale, lin.zero, glu=True, depth=depth, pdl=pdl,
                                               packed=lin.lane_scales)
                    assert torch.equal(packed, got), (n, k, rows, "packed glu")
    x = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
    lin = CudaQ4Linear.from_float(torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16))
    y = x.float() @ lin.dequantized().float().t()
    out = q4_mma.q4m_linear(x, lin.qw32, lin.scale, lin.zero)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = q4_mma.q4m_linear(x, lin.qw32, lin.scale, lin.zero)
    x.copy_(torch.randn_like(x))
    graph.replay()
    y = x.float() @ lin.dequantized().float().t()
    assert ((out.float() - y).abs().max() / y.abs().max()).item() < 1e-2
    bad = q4_mma.q4m_linear(x, lin.qw32.flip(1).contiguous(), lin.scale, lin.zero)
    assert ((bad.float() - y).abs().max() / y.abs().max()).item() > 0.05
