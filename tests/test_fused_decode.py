"""attention/fused_decode.py: a decode step's Q/K norm + RoPE + cache write + split attention + cluster merge in one
kernel. Off the GPU: when it applies, that the model falls back to the unfused path, and that its source compiles
with nvcc (no spills) where a CUDA toolkit is installed. On a Hopper card: its outputs and cache rows against the
unfused kernels (kernels/fused_norm.py's RoPE kernel, then the Triton backend) for every split count, context
lengths around the tile and split edges, several GQA shapes, with and without Q/K norm; and a model's decode logits
with it on and off, replayed from a CUDA graph under PDL."""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_cases import paged_case  # noqa: E402

from forerun.attention import fused_decode  # noqa: E402
from forerun.attention.metadata import AttnMetadata  # noqa: E402
from forerun.attention.triton_backend import TritonPagedAttention  # noqa: E402
from forerun.kernels import nvrtc  # noqa: E402


def _meta(q_lens, tree=False, dtype=torch.int64):
    b, t = len(q_lens), sum(q_lens)
    return AttnMetadata(query_start_loc=torch.tensor([0] + q_lens).cumsum(0), seq_lens=torch.full((b,), 40, dtype=dtype),
                        block_tables=torch.zeros(b, 4, dtype=torch.int64), slot_mapping=torch.zeros(t, dtype=torch.int64),
                        max_query_len=max(q_lens), max_seq_len=40,
                        tree_mask=torch.ones(t, max(q_lens), dtype=torch.bool) if tree else None)


def test_applies_to_pure_bf16_decode_steps_only():
    bf = torch.bfloat16
    k = torch.zeros(8, 16, 8, 128, dtype=bf)
    qkv = torch.zeros(3, (32 + 16) * 128, dtype=bf)
    w = torch.ones(128, dtype=bf)
    pos = torch.zeros(3, dtype=torch.int64)
    cos = torch.zeros(64, 128)

    def ok(qkv=qkv, k=k, meta=None, hq=32, d=128, window=None, w=w, pos=pos, cos=cos):
        return fused_decode.applies(qkv, pos, cos, cos, w, w, _meta([1, 1, 1]) if meta is None else meta, k, k, hq,
                                    8, d, window)

    assert ok()
    assert ok(w=None)  # no Q/K norm
    assert not ok(window=64)  # sliding window
    assert not ok(meta=_meta([1, 1, 1], tree=True))  # tree verification
    assert not ok(qkv=torch.zeros(4, 48 * 128, dtype=bf), meta=_meta([2, 1, 1]))  # 2 new tokens
    assert not ok(qkv=qkv.float(), k=k.float())  # float32
    assert not ok(w=w.float())  # norm weights not bf16
    assert not ok(qkv=torch.zeros(3, 48 * 256, dtype=bf), k=torch.zeros(8, 16, 8, 256, dtype=bf), d=256,
                  w=None)  # D 256
    assert not ok(qkv=torch.zeros(3, 96 * 128, dtype=bf), hq=80)  # group 10
    assert not ok(meta=_meta([1, 1, 1], dtype=torch.int32))  # int32 lengths
    assert not ok(pos=pos.int())  # int32 positions
    assert not ok(cos=cos.to(bf))  # bf16 RoPE tables (an EAGLE head moved to bf16): the kernel reads float32
    assert not ok(qkv=torch.zeros(3, 48 * 128 + 1, dtype=bf)[:, 1:])  # rows not 16-byte aligned
    assert not fused_decode.supports(qkv, pos, cos, cos, w, w, _meta([1, 1, 1]), k, k, 32, 8, 128, None)  # CPU


def test_the_model_falls_back_where_it_does_not_apply():
    """FusedLayerOps.decode_attention returns None off CUDA, for a backend that does not fuse, and when switched
    off; the model then runs the RoPE kernel and the backend (checked on the GPU by the tests below)."""
    from forerun.models.fused_ops import FusedLayerOps
    ops = FusedLayerOps(device_name="cpu")
    qkv = torch.zeros(1, 48 * 128, dtype=torch.bfloat16)
    assert ops.decode_attention(qkv, None, None, None, None, 0, _meta([1]), None, 32, 8, 128,
                                TritonPagedAttention(), 0.1, None) is None
    assert TritonPagedAttention().fuses_decode
    assert not TritonPagedAttention(num_splits=4).fuses_decode and not TritonPagedAttention(cuda_decode=True).fuses_decode
    from forerun.attention.base import ReferenceBackend
    assert not getattr(ReferenceBackend(), "fuses_decode", False)


@pytest.mark.parametrize("value,on", [("0", False), ("1", True)])
def test_switched_by_the_environment(value, on):
    code = "from forerun.attention import fused_decode; print(fused_decode.enabled())"
    env = dict(os.environ, FORERUN_FUSED_ATTENTION=value)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == str(on), out.stderr[-500:]


def test_source_compiles_without_spills_for_common_shapes():
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("no nvcc here")
    with tempfile.TemporaryDirectory() as d:
        shapes = ((128, 4, 1, 1, 1, 2), (128, 8, 1, 0, 0, 2), (64, 1, 0, 0, 1, 2), (64, 8, 1, 1, 1, 2),
                  (128, 2, 1, 1, 0, 2), (128, 4, 1, 1, 1, 4), (128, 8, 1, 1, 1, 4), (128, 4, 1, 1, 1, 4, 16),
                  (64, 8, 1, 1, 0, 2, 16))  # (the last: clusters of up to 16 blocks)
        for dim, group, trigger, wait, norm, warps, *most in shapes:
            src = os.path.join(d, "a.cu")
            with open(src, "w") as f:
                f.write(fused_decode.source(dim, group, bool(trigger), bool(wait), bool(norm), warps, *most))
            out = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", os.path.join(d, "a.cubin"), src, "-Xptxas", "-v"],
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            assert "0 bytes spill stores" in out.stderr, (dim, group, out.stderr[-400:])


# -- on the GPU ---------------------------------------------------------------------------------------------
DEV = "cuda"
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and nvrtc.available()),
                         reason="needs a CUDA card of compute capability 9 with NVRTC")


def _reference(qkv, pos, cos, sin, qw, kw, eps, meta, kc, vc, hq, hkv, d, scale):
    """The unfused kernels' RoPE + cache write (kernels/fused_norm.py, into kc / vc), then attention over the
    result in float64 (the SDPA reference)."""
    from forerun.attention.reference import paged_attention_reference
    from forerun.kernels.fused_norm import qk_norm_rope_store
    q = qk_norm_rope_store(qkv, pos, cos, sin, qw, kw, eps, meta.slot_mapping, kc, vc, hq, hkv, d)
    return paged_attention_reference(q.double(), kc.double(), vc.double(), meta, scale)


@gpu
@pytest.mark.parametrize("hq,hkv,d,norm,page", [(32, 8, 128, True, 16), (16, 2, 128, False, 16),
                                                (8, 8, 64, True, 8), (16, 2, 64, False, 32)])
def test_fused_matches_rope_then_attention(hq, hkv, d, norm, page):
    from forerun.kernels import pdl
    from forerun.models.layers import RotaryEmbedding
    rope = RotaryEmbedding(d, 1e6, None, 8192).to(DEV)
    g = torch.Generator(device="cpu").manual_seed(hq * d + norm)
    eps, scale = 1e-6, d ** -0.5
    saved = list(pdl._attention)
    # (cached tokens per sequence, RoPE position shift, probe): a probe zeroes every value but one (the new token's,
    # or cached token t's) so that the output is that one token's share alone: a token dropped, a wrong key or a
    # wrong value shows in full, where among thousands of tokens it would hide under bf16 rounding
    cases = [([p], 0, None) for p in (0, 1, 30, 31, 32, 63, 64, 100, 511, 1000, 3000)] + [
        ([5, 200, 64], 0, None), ([40], 7, None), ([3000], 0, "new"), ([3000], 0, 1234), ([100], 0, 33),
        ([63], 0, "new"), ([2, 700, 96], 0, "new")]
    try:
        for waits in (False, True):  # True: steps of any batch wait under PDL and fetch their first tile before
            pdl.set_attention_waits(waits, max_rows=1 << 30)
            for prefixes, shift, probe in cases:  # shift: RoPE positions apart from the cache's (mixups show)
                b = len(prefixes)
                _, kc, vc, meta = paged_case([1] * b, prefixes, hq, hkv, d, page, DEV, torch.bfloat16,
                                             seed=sum(prefixes))
                qkv = (torch.randn(b, (hq + 2 * hkv) * d, generator=g) * 2).to(DEV, torch.bfloat16)
                if probe is not None:
                    keep = vc.flatten(0, 1)[meta.block_tables[0, probe // page] * page + probe % page].clone() \
                        if probe != "new" else None
                    vc.zero_()
                    if keep is not None:  # cached token `probe` of sequence 0 keeps its value, the new ones none
                        # (x 1024, exact in bf16: one of 3000 tokens can weigh ~2e-5, and its share must stand
                        # above the tolerance; unscaled it did not at d = 64, H100, session 59)
                        vc.flatten(0, 1)[meta.block_tables[0, probe // page] * page + probe % page] = keep * 1024
                        qkv[:, (hq + hkv) * d:] = 0
                    else:
                        qkv[:, (hq + hkv) * d:] *= 1024  # (the new tokens' values: the same, exact in bf16)
                qw = (1 + 0.3 * torch.randn(d, generator=g)).to(DEV, torch.bfloat16) if norm else None
                kw = (1 + 0.3 * torch.randn(d, generator=g)).to(DEV, torch.bfloat16) if norm else None
                pos = torch.tensor(prefixes, device=DEV) + shift
                kc_ref, vc_ref = kc.clone(), vc.clone()
                ref = _reference(qkv, pos, rope.cos, rope.sin, qw, kw, eps, meta, kc_ref, vc_ref, hq, hkv, d, scale)
                slots = meta.slot_mapping
                written = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=DEV)
                written[slots] = True
                for splits in (*range(1, 9), 12, 16):  # 9-16: non-portable cluster sizes
                    for warps in (2, 4):
                        kc2, vc2 = kc.clone(), vc.clone()
                        torch.cuda.synchronize()  # (a PDL launch may read the caches before its wait)
                        out = fused_decode.attention(qkv, pos, rope.cos, rope.sin, qw, kw, eps, meta, kc2, vc2, hq,
                                                     hkv, d, scale, num_splits=splits, warps=warps).double()
                        torch.cuda.synchronize()
                        case = (hq, hkv, d, norm, page, waits, prefixes, shift, splits, warps)
                        assert torch.isfinite(out).all(), case
                        err = (out - ref).abs()  # bf16 outputs: half a step of rounding, 2 ** -9 relative
                        assert (err <= 2e-4 + 2 ** -8 * ref.abs()).all(), (case, err.max().item())
                        if probe is not None:
                            assert ref.abs().max().item() > 1e-3, case  # the probe's share is there to see
                        assert torch.equal(vc2, vc_ref), case  # the values as they came, nothing else touched
                        flat2, flat_ref = kc2.flatten(0, 1), kc_ref.flatten(0, 1)
                        assert torch.equal(flat2[~written], flat_ref[~written]), case
                        # the new keys after norm + RoPE: bf16 rounding at the same points as the RoPE kernel; the
                        # norm's reciprocal square root may differ in its last float bit (Triton's approximate
                        # one): at most one bf16 step, rarely
                        # one head's rotation may round apart where its two products nearly cancel (nvcc and Triton
                        # contract a * cos - b * sin into different fused multiply-adds): a float32 step of the
                        # head's scale on top, far below what a wrong position, head or token would change
                        new2, new_ref = flat2[written].float(), flat_ref[written].float()
                        tol = new_ref.abs() * 2 ** -7 + new_ref.abs().amax(-1, keepdim=True) * 2 ** -16
                        bad = (new2 - new_ref).abs() > tol
                        assert not bad.any(), (case, new2[bad][:4].tolist(), new_ref[bad][:4].tolist())
                        assert (new2 == new_ref).float().mean().item() > 0.97, case
    finally:
        pdl.set_attention_waits(*saved)


@gpu
@pytest.mark.parametrize("bits", [16, 4])
def test_model_decode_logits_with_the_fused_kernel_in_a_graph(bits):
    """A 4-layer Qwen3-8B-shape model's decode steps (1 and 3 sequences), replayed from CUDA graphs under PDL, with
    the fused kernel and without: logits within bf16 noise and the same greedy tokens; the fused replays are
    deterministic and see their inputs (two alternating inputs other than the capture's)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import gpu as G
    from forerun.models.fused_ops import FusedLayerOps
    from forerun.runtime.cuda_graph import GraphRunner
    model = G.build_model(dict(G.QWEN3_8B, vocab_size=4096), 4, seed=7)
    model.ops = FusedLayerOps(pdl_norms=bits == 4)
    if bits == 4:
        from forerun.models.quant_cuda import quantize_model_cuda
        quantize_model_cuda(model)
    side = G.make_side(model, 4, 512)
    g = torch.Generator(device=DEV).manual_seed(1)
    saved = fused_decode.enabled()
    try:
        for b in (1, 3):
            inputs = [torch.randint(0, 4096, (b, 1), device=DEV, generator=g) for _ in range(3)]
            ctx = torch.tensor([300, 17, 129][:b], device=DEV)
            logits = {}
            for on in (False, True):
                fused_decode.set_enabled(on)
                side.graphs = GraphRunner(side.runner, batch_sizes=[b], max_q_len=1)
                side.graphs.run_uniform(inputs[0], ctx, 1)  # the capture
                for i in (1, 2, 1, 2):
                    out = side.graphs.run_uniform(inputs[i], ctx, 1).float().clone()
                    assert torch.isfinite(out).all(), (b, on)
                    assert torch.equal(out, logits.setdefault((on, i), out)), (b, on, i)
            for i in (1, 2):
                a, r = logits[(True, i)], logits[(False, i)]
                assert (a - r).abs().max().item() < 0.05 * r.abs().max().item(), (b, bits, i)
                assert torch.equal(a.argmax(-1), r.argmax(-1)), (b, bits, i)
            assert not torch.equal(logits[(True, 1)], logits[(True, 2)])
    finally:
        fused_decode.set_enabled(saved)
