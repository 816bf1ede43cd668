"""The L2 prefetch plan of int4 models (#12, models/quant_cuda.plan_l2_prefetch): the decode order it assumes, the
windows it deals out, and (on the GPU) that prefetching changes no result."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from forerun.config import CacheConfig, ModelConfig
from forerun.models.llama import LlamaForCausalLM
from forerun.models.quant_cuda import CudaQ4Linear, decode_order, prefetch_plan, quantize_model_cuda
from forerun.runtime.runner import Chunk, ModelRunner


def _tiny_cfg(**over) -> ModelConfig:
    return ModelConfig(**dict(dict(arch="qwen3", vocab_size=256, hidden_size=128, intermediate_size=256,
                                   num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                                   max_position_embeddings=512, tie_word_embeddings=False), **over))


def test_decode_order_is_the_order_a_forward_runs_the_products():
    """plan_l2_prefetch deals the weights out as one stream in `decode_order`; it must be the order in which a
    decode forward calls the int4 linears (else each product would prefetch the wrong weights)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_cfg())
    assert quantize_model_cuda(model) == 3 * 4 + 1
    order = decode_order(model)
    assert [glu for _, glu in order] == [False, False, True, False] * 3 + [False]
    called = []
    for lin, _ in order:
        lin.register_forward_pre_hook(lambda mod, args: called.append(mod))
    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=16), torch.device("cpu"), torch.float32,
                         max_batch_tokens=64, max_seqs=2)
    runner.kv.add_sequence(0)
    runner.forward([Chunk(0, [3, 4, 5], logits="none")])
    called.clear()
    runner.forward([Chunk(0, [6], logits="last")])
    assert [id(m) for m in called] == [id(lin) for lin, _ in order]
    assert all(isinstance(m, CudaQ4Linear) for m in called)


def _covered(plan, rows):
    seen = [[0] * r for r in rows]
    for pieces in plan.values():
        for p, r0, r1 in pieces:
            assert 0 <= r0 < r1 <= rows[p]
            for r in range(r0, r1):
                seen[p][r] += 1
    return seen


def test_prefetch_windows_start_where_the_last_stopped_and_cover_the_stream_once():
    """With a look-ahead longer than any gap between two issuing products, the windows tile the whole stream
    (the last one wrapping round into the next step): every row of every product is prefetched once (twice at
    most for a row two windows share at their boundary). Each window lies within look-ahead bytes past its
    issuer's end."""
    sizes = [600, 400, 2400, 1200, 600, 400, 2400, 1200, 5000]  # 2 layers (qkv, o, gate/up, down) + head
    rows = [60, 40, 120, 120, 60, 40, 120, 120, 500]
    issuers = [True, True, False, True, True, True, True, True, True]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    for lookahead in (5200, 6000, 7000):  # the longest gap between two issuers' ends: down 9000 to head 14200
        plan = prefetch_plan(sizes, rows, issuers, lookahead)
        assert set(plan) == {i for i, on in enumerate(issuers) if on}
        seen = _covered(plan, rows)
        assert all(c >= 1 for per in seen for c in per), lookahead
        assert sum(c - 1 for per in seen for c in per) <= len(plan)
        for i, pieces in plan.items():
            end = starts[i] + sizes[i]
            for p, r0, r1 in pieces:
                per_row = sizes[p] // rows[p]
                at = starts[p] + r0 * per_row
                at += total if at < end else 0  # the next step's
                assert end <= at < end + lookahead, (i, p, r0)
    # a short look-ahead: each issuer prefetches exactly the bytes after it, and gaps stay unprefetched
    plan = prefetch_plan(sizes, rows, issuers, 200)
    assert plan[0] == [(1, 0, 20)] and plan[1] == [(2, 0, 10)] and plan[3] == [(4, 0, 20)]
    assert plan[8] == [(0, 0, 20)]  # the head's window: the next step's first product
    seen = _covered(plan, rows)
    assert seen[2][10] == 0  # gate/up past the first 200 bytes is not prefetched: its issuer (o) stops there


def test_plan_needs_the_cuda_kernel():
    """Off the GPU (or with a look-ahead of 0) nothing is planned and every table is cleared."""
    model = LlamaForCausalLM(_tiny_cfg(num_layers=1))
    quantize_model_cuda(model)
    from forerun.models.quant_cuda import plan_l2_prefetch
    order = decode_order(model)
    order[0][0].l2_prefetch = torch.zeros(1, 2, dtype=torch.int64)
    assert plan_l2_prefetch(model, 1 << 20) == 0
    assert all(lin.l2_prefetch is None for lin, _ in order)


def test_prefetch_chunks_align_and_split():
    from forerun.kernels.q4_cuda import prefetch_chunks
    t = prefetch_chunks([(1000, 40000), (4096, 16)], "cpu", chunk=16384).tolist()
    assert t[0] == [992, 16384] and t[1] == [992 + 16384, 16384] and t[2] == [992 + 32768, 41008 - 33760]
    assert t[3] == [4096, 16]
    assert all(a % 16 == 0 and n % 16 == 0 and 0 < n <= 16384 for a, n in t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
def test_prefetch_changes_no_result_on_gpu():
    """The CUDA C++ product with an L2 prefetch table gives the same bits as without (plain and SwiGLU, eager and
    replayed from a CUDA graph); a random 4-layer int4 model with a plan gives the same logits, and every 1-row
    CUDA C++ product got a table."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import gpu as G
    from forerun.kernels import q4_cuda
    from forerun.kernels.layer_ops import FusedLayerOps
    from forerun.kernels.quant_gemm import pack_int4_w32
    from forerun.models.quant import quantize_groups_int4
    from forerun.models.quant_cuda import plan_l2_prefetch
    from forerun.runtime.cuda_graph import GraphRunner
    assert q4_cuda.available()
    torch.manual_seed(0)
    other = torch.randint(0, 1 << 30, (8 << 20,), dtype=torch.int32, device="cuda")  # 32 MB to prefetch
    pf = q4_cuda.prefetch_chunks([(other.data_ptr(), other.numel() * 4)], "cuda")
    for n, k, glu in ((4096, 4096, False), (2 * 3072, 1024, True)):
        q, s, z = quantize_groups_int4(torch.randn(n, k, device="cuda"))
        q32, s, z = pack_int4_w32(q), s.to(torch.bfloat16), z.to(torch.bfloat16)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        ref = q4_cuda.q4c_linear(x, q32, s, z, glu=glu)
        assert torch.equal(q4_cuda.q4c_linear(x, q32, s, z, glu=glu, prefetch=pf), ref)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = q4_cuda.q4c_linear(x, q32, s, z, glu=glu, prefetch=pf)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, ref)
    with pytest.raises(ValueError, match="prefetch takes int64"):
        q4_cuda.q4c_linear(x, q32, s, z, glu=True, prefetch=pf.int())

    model = G.build_model(dict(G.QWEN3_8B, vocab_size=4096), 4, seed=3)
    model.ops = FusedLayerOps()
    quantize_model_cuda(model)
    side = G.make_side(model, 1, 256)
    ids = torch.randint(0, 4096, (40,)).tolist()
    side.runner.kv.truncate(0, 0)
    side.runner.forward([Chunk(seq_id=0, token_ids=ids[:39], logits="none")])
    side.restore_tables()
    logits = {}
    for lookahead in (0, 16 << 20):
        planned = plan_l2_prefetch(model, lookahead)
        if lookahead:
            issuers = [lin for lin, _ in decode_order(model) if lin.l2_prefetch is not None]
            assert len(issuers) == len(decode_order(model)) and planned >= lookahead * len(issuers) // 2
        side.graphs = GraphRunner(side.runner, batch_sizes=[1], max_q_len=1)
        tok = torch.tensor([[ids[39]]], device="cuda")
        ctx = torch.full((1,), 39, dtype=torch.int64, device="cuda")
        logits[lookahead] = side.graphs.run_uniform(tok, ctx, 1).float().clone()
    plan_l2_prefetch(model, 0)
    assert torch.equal(logits[0], logits[16 << 20])
