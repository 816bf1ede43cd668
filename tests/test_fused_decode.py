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
    ok = fused_decode.applies
    assert ok(qkv, k, _meta([1, 1, 1]), 32, 8, 128, None, w)
    assert ok(qkv, k, _meta([1, 1, 1]), 32, 8, 128, None, None)  # no Q/K norm
    assert not ok(qkv, k, _meta([1, 1, 1]), 32, 8, 128, 64, w)  # sliding window
    assert not ok(qkv, k, _meta([1, 1, 1], tree=True), 32, 8, 128, None, w)  # tree verification
    assert not ok(torch.zeros(4, 48 * 128, dtype=bf), k, _meta([2, 1, 1]), 32, 8, 128, None, w)  # 2 new tokens
    assert not ok(qkv.float(), k.float(), _meta([1, 1, 1]), 32, 8, 128, None, w)  # float32
    assert not ok(qkv, k, _meta([1, 1, 1]), 32, 8, 128, None, w.float())  # norm weights not bf16
    assert not ok(torch.zeros(3, 48 * 256, dtype=bf), torch.zeros(8, 16, 8, 256, dtype=bf), _meta([1, 1, 1]),
                  32, 8, 256, None, None)  # D 256
    assert not ok(torch.zeros(3, 96 * 128, dtype=bf), k, _meta([1, 1, 1]), 80, 8, 128, None, w)  # group 10
    assert not ok(qkv, k, _meta([1, 1, 1], dtype=torch.int32), 32, 8, 128, None, w)  # int32 lengths
    assert not fused_decode.supports(qkv, k, _meta([1, 1, 1]), 32, 8, 128, None, w)  # CPU tensors


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
        for dim, group, trigger, wait, norm in ((128, 4, 1, 1, 1), (128, 8, 1, 0, 0), (64, 1, 0, 0, 1),
                                                (64, 8, 1, 1, 1), (128, 2, 1, 1, 0)):
            src = os.path.join(d, "a.cu")
            with open(src, "w") as f:
                f.write(fused_decode.source(dim, group, bool(trigger), bool(wait), bool(norm)))
            out = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", os.path.join(d, "a.cubin"), src, "-Xptxas", "-v"],
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            assert "0 bytes spill stores" in out.stderr, (dim, group, out.stderr[-400:])


# -- on the GPU ---------------------------------------------------------------------------------------------
DEV = "cuda"
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and nvrtc.available()),
                         reason="needs a CUDA card of compute capability 9 with NVRTC")


def _unfused(qkv, pos, cos, sin, qw, kw, eps, meta, kc, vc, hq, hkv, d, scale):
    from forerun.kernels.fused_norm import qk_norm_rope_store
    q = qk_norm_rope_store(qkv, pos, cos, sin, qw, kw, eps, meta.slot_mapping, kc, vc, hq, hkv, d)
    return TritonPagedAttention().forward(q, kc, vc, meta, scale)


@gpu
@pytest.mark.parametrize("hq,hkv,d,norm", [(32, 8, 128, True), (16, 2, 128, False), (8, 8, 64, True),
                                           (16, 2, 64, False)])
def test_fused_matches_rope_then_the_triton_kernels(hq, hkv, d, norm):
    from forerun.models.layers import RotaryEmbedding
    rope = RotaryEmbedding(d, 1e6, None, 8192).to(DEV)
    g = torch.Generator(device="cpu").manual_seed(hq * d + norm)
    eps, scale = 1e-6, d ** -0.5
    for prefixes in ([0], [1], [30], [31], [32], [63], [64], [100], [511], [1000], [3000], [5, 200, 64]):
        b = len(prefixes)
        _, kc, vc, meta = paged_case([1] * b, prefixes, hq, hkv, d, 16, DEV, torch.bfloat16, seed=sum(prefixes))
        qkv = (torch.randn(b, (hq + 2 * hkv) * d, generator=g) * 2).to(DEV, torch.bfloat16)
        qw = (1 + 0.3 * torch.randn(d, generator=g)).to(DEV, torch.bfloat16) if norm else None
        kw = (1 + 0.3 * torch.randn(d, generator=g)).to(DEV, torch.bfloat16) if norm else None
        pos = torch.tensor(prefixes, device=DEV)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        ref = _unfused(qkv, pos, rope.cos, rope.sin, qw, kw, eps, meta, kc_ref, vc_ref, hq, hkv, d, scale).float()
        for splits in range(1, 9):
            kc2, vc2 = kc.clone(), vc.clone()
            out = fused_decode.attention(qkv, pos, rope.cos, rope.sin, qw, kw, eps, meta, kc2, vc2, hq, hkv, d, scale,
                                         num_splits=splits).float()
            torch.cuda.synchronize()
            case = (hq, hkv, d, norm, prefixes, splits)
            assert torch.isfinite(out).all(), case
            assert (out - ref).abs().max().item() < 2e-2, (case, (out - ref).abs().max().item())
            assert torch.equal(vc2, vc_ref), case  # the values as they came
            # the keys after norm + RoPE: bf16 rounding at the same points, the norm's reciprocal square root may
            # differ in its last float bit (Triton's approximate one): at most one bf16 step, rarely
            dk = (kc2.float() - kc_ref.float()).abs()
            assert (dk <= kc_ref.float().abs() * 2 ** -7 + 1e-30).all(), case
            assert (dk == 0).float().mean().item() > 0.99, case


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
