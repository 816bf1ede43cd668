"""Triton layer kernels (skinny GEMM, add+RMSNorm, Q/K norm + RoPE + cache write) against the torch LayerOps.

Without a GPU they run under Triton's interpreter (TRITON_INTERPRET=1) in float32 / float16: the interpreter
emulates bfloat16 imprecisely, so bf16 is checked on CUDA only (tests/test_gpu.py). With a GPU they run there.
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the first import of triton, and stays set: the interpreter is consulted at run time
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
from forerun.kernels.fused_norm import add_rmsnorm, qk_norm_rope_store  # noqa: E402
from forerun.models.fused_ops import FusedLayerOps  # noqa: E402
from forerun.kernels.skinny_gemm import GemmConfig, default_config, skinny_linear  # noqa: E402
from forerun.attention.metadata import AttnMetadata  # noqa: E402
from forerun.config import CacheConfig, ModelConfig  # noqa: E402
from forerun.kvcache.pool import KVPool  # noqa: E402
from forerun.models.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from forerun.models.ops import LayerOps  # noqa: E402

from tiny import hf_model, ours_from_hf  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
if not CUDA:
    pytestmark = pytest.mark.filterwarnings("ignore")


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


CONFIGS = [GemmConfig(block_n=8, block_k=64, use_dot=False, num_stages=1),
           GemmConfig(block_n=4, block_k=32, use_dot=False, num_stages=1),
           GemmConfig(block_n=16, block_k=64, use_dot=True, num_stages=2)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["cuda-core", "cuda-core-small", "dot"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16])
def test_skinny_linear_matches_matmul(cfg, m):
    if not cfg.use_dot and m > 4:
        pytest.skip("the CUDA-core variant is for up to 4 rows")
    g = torch.Generator().manual_seed(m)
    k, n = 200, 72  # K not a multiple of BLOCK_K, N not a multiple of BLOCK_N
    x, w, b = (torch.randn(*s, generator=g).to(DEV) for s in ((m, k), (n, k), (n,)))
    y = skinny_linear(x, w, b, config=cfg)
    assert y.shape == (m, n)
    assert rel_err(y, x.double() @ w.double().T + b.double()) < 1e-5
    y16 = skinny_linear(x.half(), w.half(), config=cfg)
    assert y16.dtype == torch.float16 and rel_err(y16, x.half().double() @ w.half().double().T) < 2e-3
    glu = skinny_linear(x, w, glu=True, out_dtype=torch.float32, config=cfg)  # gate rows 0..35, up rows 36..71
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    assert glu.shape == (m, n // 2) and rel_err(glu, torch.nn.functional.silu(gate) * up) < 1e-5


def test_skinny_linear_default_configs_and_errors():
    x, w = torch.randn(3, 64, device=DEV), torch.randn(40, 64, device=DEV)
    for m in (1, 2, 3):
        cfg = default_config(m, 40, 64)
        assert rel_err(skinny_linear(x[:m], w, config=cfg), x[:m].double() @ w.double().T) < 1e-5
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(torch.randn(17, 64, device=DEV), w)
    with pytest.raises(ValueError, match="contiguous K"):
        skinny_linear(x, torch.randn(40, 32, device=DEV))


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_torch(with_residual):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, 1e-6).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    x, r = torch.randn(5, 96, generator=g).to(DEV), torch.randn(5, 96, generator=g).to(DEV)
    res = r if with_residual else None
    y, s = add_rmsnorm(x, res, norm.weight, norm.eps)
    y_ref, s_ref = LayerOps().add_rmsnorm(x, res, norm)
    assert torch.equal(s, s_ref)
    assert rel_err(y, y_ref) < 1e-6


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_matches_torch(qk_norm):
    g = torch.Generator().manual_seed(2)
    cfg = ModelConfig(arch="qwen3", vocab_size=10, hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, qk_norm=qk_norm)
    t, hq, hkv, d = 6, 4, 2, 16
    rope = RotaryEmbedding(d, 10000.0, None, 128).to(DEV)
    norms = (None, None)
    if qk_norm:
        norms = tuple(RMSNorm(d, 1e-6).to(DEV) for _ in range(2))
        with torch.no_grad():
            for nm in norms:
                nm.weight.copy_(torch.randn(d, generator=g))
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(DEV)
    positions = torch.randint(0, 128, (t,), generator=g).to(DEV)
    slots = torch.randperm(8 * 4, generator=g)[:t].to(DEV)
    meta = AttnMetadata(query_start_loc=torch.tensor([0, t], device=DEV), seq_lens=torch.tensor([t], device=DEV),
                        block_tables=torch.zeros(1, 8, dtype=torch.int64, device=DEV), slot_mapping=slots,
                        max_query_len=t, max_seq_len=t)
    pools = [KVPool(cfg, CacheConfig(block_size=4, num_blocks=8), torch.float32, DEV) for _ in range(2)]
    pools[0].k.copy_(torch.randn(pools[0].k.shape, generator=g))  # untouched slots must stay as they were
    pools[0].v.copy_(torch.randn(pools[0].v.shape, generator=g))
    pools[1].k.copy_(pools[0].k)
    pools[1].v.copy_(pools[0].v)
    q_ref = LayerOps().qkv_to_cache(qkv, positions, rope, *norms, 1, meta, pools[0], hq, hkv, d)
    q = qk_norm_rope_store(qkv, positions, rope.cos, rope.sin, *(nm.weight if nm is not None else None for nm in norms),
                           1e-6, slots, pools[1].k[1], pools[1].v[1], hq, hkv, d)
    assert rel_err(q, q_ref) < 1e-6
    assert rel_err(pools[1].k, pools[0].k) < 1e-6 and torch.equal(pools[1].v, pools[0].v)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_fused_layer_ops_model_forward(arch):
    """A whole forward (prefill of 20 rows, i.e. cuBLAS/torch products + fused norms, then decode-sized steps
    on the skinny kernels) with FusedLayerOps equals the torch ops."""
    from forerun.runtime.runner import Chunk

    hf = hf_model(arch, num_hidden_layers=2)
    runners = [ours_from_hf(hf) for _ in range(2)]
    runners[0].model.ops = LayerOps()  # (a runner made for the CPU takes the C ops, which stay on the CPU)
    runners[1].model.ops = FusedLayerOps(devices=("cuda", "cpu"))
    for r in runners:
        r.model.to(DEV)
        r.model.reset_rope(DEV)
        r.kv.k, r.kv.v = r.kv.k.to(DEV), r.kv.v.to(DEV)
        r.buffers.__init__(r.buffers.max_tokens, r.buffers.max_seqs, r.buffers.max_blocks, DEV)
        r.device = DEV
    prompt = torch.randint(2, 97, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    steps = [[Chunk(0, prompt, logits="all")], [Chunk(0, [5], logits="all"), Chunk(1, [7, 8, 9], logits="all")]]
    for r in runners:
        r.kv.add_sequence(0)
        r.kv.add_sequence(1)
        r.forward([Chunk(1, prompt[:7])])
    outs = [[r.forward(s)[0].logits for s in steps] for r in runners]
    for ref, got in zip(*outs):
        assert rel_err(got, ref) < 1e-5


def test_chain_sample_realigns_unaligned_views():
    """Pointer alignment is part of a Triton kernel's specialisation: chain_sample passes 16-byte aligned
    copies of views that are not (the [2, R] upload's second row with R odd), the same tensor otherwise."""
    from forerun.kernels.chain_sample import _aligned

    both = torch.arange(10, dtype=torch.int64).view(2, 5).clone()
    view = both[1]
    assert view.data_ptr() % 16 == 8
    fixed = _aligned(view)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, view)
    assert _aligned(both[0]) is both[0] or _aligned(both[0]).data_ptr() == both[0].data_ptr()


def test_split_norms_default_follows_the_card_and_the_environment(monkeypatch):
    """FusedLayerOps.split_norms: on by default only on the cards where it measured faster, FORERUN_SPLIT_NORMS=0/1
    overrides, anything else is refused with a one-line error (not ignored)."""
    monkeypatch.delenv("FORERUN_SPLIT_NORMS", raising=False)
    monkeypatch.setattr(FusedLayerOps, "SPLIT_NORMS_CARDS", ("NVIDIA H100 80GB HBM3",))
    assert FusedLayerOps(device_name="NVIDIA H100 80GB HBM3").split_norms is True
    assert FusedLayerOps(device_name="NVIDIA H200").split_norms is False
    assert FusedLayerOps(device_name="NVIDIA H200", split_norms=True).split_norms is True
    monkeypatch.setenv("FORERUN_SPLIT_NORMS", "1")
    assert FusedLayerOps(device_name="NVIDIA H200").split_norms is True
    monkeypatch.setenv("FORERUN_SPLIT_NORMS", "0")
    assert FusedLayerOps(device_name="NVIDIA H100 80GB HBM3").split_norms is False
    monkeypatch.setenv("FORERUN_SPLIT_NORMS", "yes")
    with pytest.raises(ValueError, match="FORERUN_SPLIT_NORMS must be 0 or 1"):
        FusedLayerOps(device_name="NVIDIA H200")


def test_int8_activations_by_card_env_overrides_and_bad_values_refused(monkeypatch):
    """q4_cuda.int8_activations (the 1-row int4 kernel's DP4A path): the switch if set, else FORERUN_Q4_DP4A=0/1,
    else on for the cards in DP4A_CARDS only; a bad FORERUN_Q4_DP4A is refused with a one-line error when the layer
    ops are built (not ignored); the kernel source follows the choice."""
    from forerun.kernels import q4_cuda
    monkeypatch.delenv("FORERUN_Q4_DP4A", raising=False)
    monkeypatch.setattr(q4_cuda, "INT8_ACTIVATIONS", [None])
    monkeypatch.setattr(q4_cuda, "DP4A_CARDS", ("NVIDIA H100 80GB HBM3",))
    assert q4_cuda.int8_activations("NVIDIA H100 80GB HBM3") is True
    assert q4_cuda.int8_activations("NVIDIA H200") is False
    if not torch.cuda.is_available():  # no card: off, and the source says so
        assert q4_cuda.int8_activations() is False
        assert "#define DP4A 0" in q4_cuda.source(4096, 2, 4, 2, False, True)
    monkeypatch.setenv("FORERUN_Q4_DP4A", "1")
    assert q4_cuda.int8_activations("NVIDIA H200") is True
    assert "#define DP4A 1" in q4_cuda.source(4096, 2, 4, 2, False, True)
    monkeypatch.setenv("FORERUN_Q4_DP4A", "0")
    assert q4_cuda.int8_activations("NVIDIA H100 80GB HBM3") is False
    monkeypatch.setattr(q4_cuda, "INT8_ACTIVATIONS", [True])  # the switch (benchmarks, tests) over the environment
    assert q4_cuda.int8_activations("NVIDIA H200") is True
    monkeypatch.setattr(q4_cuda, "INT8_ACTIVATIONS", [None])
    monkeypatch.setenv("FORERUN_Q4_DP4A", "on")
    with pytest.raises(ValueError, match="FORERUN_Q4_DP4A must be 0 or 1"):
        FusedLayerOps(device_name="NVIDIA H200")
