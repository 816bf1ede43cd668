"""CUDA-only checks: Triton paged attention vs the reference, the fused chain sampler vs a float64 reference,
CUDA-graph replay vs eager. Skipped where CUDA is unavailable."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from attention_cases import random_tree_mask  # noqa: E402
from forerun.attention.metadata import AttnMetadata  # noqa: E402
from forerun.attention.reference import paged_attention_reference  # noqa: E402
from forerun.attention.triton_backend import TritonPagedAttention  # noqa: E402
from forerun.config import CacheConfig, ModelConfig  # noqa: E402
from forerun.runtime.cuda_graph import GraphRunner, compile_elementwise  # noqa: E402
from forerun.runtime.runner import Chunk, ModelRunner  # noqa: E402
from forerun.kernels.chain_sample import chain_sample  # noqa: E402
from forerun.kernels.fused_norm import add_rmsnorm  # noqa: E402
from forerun.models.fused_ops import FusedLayerOps  # noqa: E402
from forerun.kernels.skinny_gemm import GemmConfig, skinny_linear  # noqa: E402
from forerun.models.llama import LlamaForCausalLM  # noqa: E402

DEV = torch.device("cuda")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# -- paged attention -------------------------------------------------------------------------------------
def make_attention_case(q_lens, prefixes, hq, hkv, d, page=16, dtype=torch.bfloat16, tree=False, seed=0):
    """Random paged KV cache (shuffled blocks, block 0 unused) and a ragged batch: q, k_cache, v_cache, meta."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefixes, q_lens)]
    nblk = [-(-s // page) for s in seq_lens]
    total = sum(nblk) + 3
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(q_lens), max(nblk) + 2, dtype=torch.int64)
    i = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = torch.tensor(perm[i:i + n])
        i += n
    k = torch.randn(total, page, hkv, d, generator=g).to(dtype)
    v = torch.randn(total, page, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(q_lens)).cumsum(0)
    slots = []
    for b, (p, n) in enumerate(zip(prefixes, q_lens)):
        pos = torch.arange(p, p + n)
        slots.append(tables[b, pos // page] * page + pos % page)
    mask = random_tree_mask(q_lens, qsl, g) if tree else None  # each node sees its ancestors and itself
    meta = AttnMetadata(query_start_loc=qsl.to(DEV), seq_lens=torch.tensor(seq_lens).to(DEV),
                        block_tables=tables.to(DEV), slot_mapping=torch.cat(slots).to(DEV),
                        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                        tree_mask=None if mask is None else mask.to(DEV))
    return q.to(DEV), k.to(DEV), v.to(DEV), meta


def _check_attention(q, k, v, meta, splits=(None, 1, 3)):
    scale = q.shape[-1] ** -0.5
    ref = paged_attention_reference(q.float(), k.float(), v.float(), meta, scale)
    for s in splits:
        for cuda_decode in (True, False):  # decode steps: the CUDA kernel, and the Triton kernels it replaces
            out = TritonPagedAttention(num_splits=s, cuda_decode=cuda_decode).forward(q, k, v, meta, scale)
            assert out.dtype == q.dtype and out.shape == q.shape
            assert torch.isfinite(out).all()
            assert rel_err(out, ref) < 1e-2, (s, cuda_decode, rel_err(out, ref))


def test_cuda_decode_attention_matches_reference():
    """attention/cuda_decode.py (one launch, the splits merged by the last block) against the float32 reference:
    GQA groups 1-8, D 64 / 128, pages of 16 and 4, sequences of 1..3000 tokens, 1..16 splits (more splits than
    tokens too), 4 and 8 warps, every PDL trigger position, twice in a row (the arrival counters are left at zero),
    and replayed from a CUDA graph with new lengths; a wrong split merge fails."""
    from forerun.attention import cuda_decode
    assert cuda_decode.available(), "the NVRTC decode attention did not compile on the GPU machine"
    cases = [((32, 8, 128), 16, [511], None), ((32, 8, 128), 16, [1, 17, 3000, 64, 700], None),
             ((16, 16, 64), 4, [5, 2, 130], None), ((64, 8, 128), 16, [900, 33], None), ((8, 4, 128), 16, [300], 1),
             ((8, 8, 128), 16, [31, 32, 33, 64, 65], None)]
    for i, ((hq, hkv, d), page, lens, _) in enumerate(cases):
        q, k, v, meta = make_attention_case([1] * len(lens), [n - 1 for n in lens], hq, hkv, d, page=page, seed=i)
        assert cuda_decode.supports(q, k, meta, None)
        scale = d ** -0.5
        ref = paged_attention_reference(q.float(), k.float(), v.float(), meta, scale)
        for splits in (1, 2, 7, 16, None):
            for warps, trigger in ((None, None), (8, 2), (4, 1)):
                for _ in range(2):
                    out = cuda_decode.decode_attention(q, k, v, meta, scale, splits, warps=warps, trigger=trigger)
                    assert rel_err(out, ref) < 1e-2, (i, splits, warps, rel_err(out, ref))
    # in a CUDA graph: the lengths change between replays (one more token each), the launch shape does not
    q, k, v, meta = make_attention_case([1, 1, 1], [99, 2000, 7], 32, 8, 128, seed=9)
    out = cuda_decode.decode_attention(q, k, v, meta, 128 ** -0.5)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cuda_decode.decode_attention(q, k, v, meta, 128 ** -0.5)
    for extra in (0, -5):
        meta.seq_lens.copy_(torch.tensor([100 + extra, 2001 + extra, 8 + extra], device=DEV))
        g.replay()
        ref = paged_attention_reference(q.float(), k.float(), v.float(), meta, 128 ** -0.5)
        assert rel_err(out, ref) < 1e-2, extra
    # the checks can fail: dropping one split's keys moves the output
    meta2 = AttnMetadata(query_start_loc=meta.query_start_loc, seq_lens=(meta.seq_lens // 2).clamp_min(1),
                         block_tables=meta.block_tables, slot_mapping=meta.slot_mapping, max_query_len=1,
                         max_seq_len=meta.max_seq_len)
    assert rel_err(cuda_decode.decode_attention(q, k, v, meta2, 128 ** -0.5, 4), ref) > 0.05


@pytest.mark.parametrize("max_q", list(range(1, 17)))
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 8, 128), (8, 8, 64)])
def test_triton_attention_matches_reference(max_q, heads):
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(max_q)
    q_lens = [max_q] + torch.randint(1, max_q + 1, (4,), generator=g).tolist()
    prefixes = [0, 1, 15, 16] + torch.randint(17, 900, (1,), generator=g).tolist()
    _check_attention(*make_attention_case(q_lens, prefixes, hq, hkv, d, seed=max_q))


def test_triton_attention_tree_mask():
    _check_attention(*make_attention_case([7, 16, 1, 11], [30, 257, 5, 0], 32, 8, 128, tree=True, seed=1))


def test_triton_attention_prefill_and_small_pages():
    _check_attention(*make_attention_case([300, 37, 1], [0, 64, 1000], 32, 8, 128, seed=2))
    _check_attention(*make_attention_case([5, 9, 2], [33, 70, 3], 12, 4, 80, page=4, seed=3))  # group 3, D 80


@pytest.mark.parametrize("bits", [16, 4])
def test_attention_chain_with_pdl_gives_the_same_logits(bits):
    """The attention chain launched with PDL (kernels/pdl.py `set_attention_waits`: Q/K norm + RoPE, the split
    kernel and its merge each start early and wait on the kernel before; the split kernel fetches its first tile of
    cached keys and values before the wait) gives bit-identical logits to the plain launches, in graph replays of
    4-layer Qwen3-8B-shape models (bf16, and int4 whose products let the next kernel launch at their start), for
    decode and 5-token steps at 1 and 4 sequences, the chain waiting at every step size here. The replays alternate
    two inputs other than the capture's, and before each one the step's new cache rows are poisoned with NaN: a
    kernel that read its input before the kernel before it wrote it (a missing wait) would see the other input's
    values, and a preload of a new row would see NaN."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import gpu as G
    from forerun.kernels import pdl
    from forerun.runtime.cuda_graph import GraphRunner
    if not pdl.enabled(torch.zeros(1, device=DEV)):
        pytest.skip("no PDL on this card / Triton")
    saved = list(pdl._attention)
    assert saved == [True, 1] or os.environ.get("FORERUN_PDL_ATTENTION") == "0"  # the default: 1-token steps wait
    model = G.build_model(dict(G.QWEN3_8B, vocab_size=4096), 4, seed=5)
    model.ops = FusedLayerOps(pdl_norms=bits == 4)
    if bits == 4:
        from forerun.models.quant_cuda import quantize_model_cuda
        quantize_model_cuda(model)
    side = G.make_side(model, 4, 512)
    kv = side.runner.kv
    g = torch.Generator(device=DEV).manual_seed(0)
    try:
        for b, q in ((1, 1), (4, 1), (1, 5), (4, 5)):
            inputs = [torch.randint(0, 4096, (b, q), device=DEV, generator=g) for _ in range(3)]
            ctx = torch.tensor([300, 17, 64, 129][:b], device=DEV)
            logits = {}
            for waits in (False, True):
                pdl.set_attention_waits(waits, max_rows=1 << 30)  # every step of the test
                side.graphs = GraphRunner(side.runner, batch_sizes=[b], max_q_len=q)
                side.graphs.run_uniform(inputs[0], ctx, q)  # the capture
                for i in (1, 2, 1, 2):
                    for row in range(b):  # poison the step's new rows in every layer's cache
                        pos = torch.arange(int(ctx[row]), int(ctx[row]) + q, device=DEV)
                        slots = side.tables[row, pos // kv.block_size] * kv.block_size + pos % kv.block_size
                        for t in (kv.k, kv.v):
                            t.view(t.shape[0], -1, *t.shape[3:])[:, slots] = float("nan")
                    out = side.graphs.run_uniform(inputs[i], ctx, q).float().clone()
                    assert torch.isfinite(out).all(), (b, q, waits)
                    assert torch.equal(out, logits.setdefault((waits, i), out)), (b, q, waits, i)
            for i in (1, 2):
                assert torch.equal(logits[(True, i)], logits[(False, i)]), (b, q, bits, i)
            assert not torch.equal(logits[(False, 1)], logits[(False, 2)])  # the inputs show in the logits
    finally:
        pdl.set_attention_waits(*saved)


# -- fused chain sampler ---------------------------------------------------------------------------------
def reference_chain(logits, drafts, first, seqlens, temperature, uniforms, draft_probs, max_len):
    """Float64 chain rejection sampling. Also returns, per request, the smallest relative distance of any of
    its decisions to the decision boundary (accept test or inverse CDF): a mismatch there is a numerical tie."""
    num_req, vocab = seqlens.shape[0], logits.shape[1]
    logits, drafts, u = logits.cpu(), drafts.cpu(), uniforms.cpu().double()
    q_all = None if draft_probs is None else draft_probs.cpu().double()
    out = torch.full((num_req, max_len), -1, dtype=torch.int64)
    num_acc = torch.zeros(num_req, dtype=torch.int64)
    margin = torch.full((num_req,), float("inf"), dtype=torch.float64)
    for r in range(num_req):
        s0, n, t = int(first[r]), int(seqlens[r]), float(temperature[r])
        greedy = t <= 0
        inv_t = torch.tensor(1.0) if greedy else 1.0 / torch.tensor(t, dtype=torch.float32)

        def probs(row):
            x = logits[row].float() * inv_t
            e = torch.exp((x - x.max()).double())
            return e / e.sum()

        def q_row(row):
            if q_all is not None:
                return q_all[row]
            q = torch.zeros(vocab, dtype=torch.float64)
            q[int(drafts[row])] = 1.0
            return q

        j = 0
        while j < n - 1:
            row = s0 + j
            d = int(drafts[row])
            if greedy:
                ok = int(torch.argmax(logits[row].float())) == d
            else:
                p_d, q_d = probs(row)[d], q_row(row)[d]
                ok = bool(u[row, 0] * q_d < p_d)
                margin[r] = min(margin[r], abs(u[row, 0] * q_d - p_d) / max(p_d, 1e-300))
            if not ok:
                break
            out[r, j] = d
            j += 1
        row = s0 + j
        if greedy:
            tok = int(torch.argmax(logits[row].float()))
        else:
            p = probs(row)
            w = (p - q_row(row)).clamp_min(0) if j < n - 1 else p
            if w.sum() <= 0:
                w = p
            cdf = torch.cumsum(w, 0)
            target = u[row, 1] * cdf[-1]
            tok = int(torch.searchsorted(cdf, target, right=True).clamp_max(vocab - 1))
            near = [abs(cdf[i] - target) for i in (tok - 1, tok) if 0 <= i < vocab]
            margin[r] = min(margin[r], min(near) / cdf[-1])
        out[r, j] = tok
        num_acc[r] = j
    return out, num_acc, margin


def make_chain_case(seqlens, temps, vocab=151936, seed=0, accept_bias=0.6):
    g = torch.Generator().manual_seed(seed)
    seqlens = torch.tensor(seqlens)
    first = torch.cumsum(seqlens, 0) - seqlens
    rows = int(seqlens.sum())
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(torch.bfloat16).float()  # bf16 values: ties exist
    q = torch.softmax(logits + torch.randn(rows, vocab, generator=g), -1)
    drafts = torch.multinomial(q, 1, generator=g)[:, 0]
    drafts = torch.where(torch.rand(rows, generator=g) < accept_bias, logits.argmax(-1), drafts)
    drafts[first + seqlens - 1] = -1
    uniforms = torch.rand(rows, 2, generator=g)
    return (logits.to(DEV), drafts.to(DEV), first.to(DEV), seqlens.to(DEV), torch.tensor(temps, dtype=torch.float32).to(DEV),
            uniforms.to(DEV), q.to(DEV))


def _check_chain(case, with_q: bool, max_len: int, exact: bool):
    logits, drafts, first, seqlens, temps, uniforms, q = case
    dp = q if with_q else None
    got = chain_sample(logits, drafts, first, seqlens, temps, uniforms, dp, max_seqlen=max_len)
    want, want_acc, margin = reference_chain(logits, drafts, first, seqlens, temps, uniforms, dp, max_len)
    got_out, got_acc = got.output_token_ids.cpu(), got.num_accepted.cpu()
    assert ((got_out >= -1) & (got_out < logits.shape[1])).all()
    same = (got_out == want).all(1) & (got_acc == want_acc)
    if exact:
        assert same.all(), (got_out[~same], want[~same])
    else:  # identical except at numerical ties
        assert (margin[~same] < 1e-5).all(), (got_out[~same], want[~same], margin[~same])
        assert (~same).sum() <= max(1, len(same) // 50)
    return got_acc


def test_chain_sample_greedy_exact():
    for seed in range(3):
        seqlens = [1, 2, 3, 5, 7, 7, 4, 1, 6, 2]
        case = make_chain_case(seqlens, [0.0] * len(seqlens), seed=seed, accept_bias=0.8)
        acc = _check_chain(case, with_q=False, max_len=7, exact=True)
        assert acc.sum() > 0  # the test exercises acceptances


def test_chain_sample_compiles_no_variant_for_unaligned_views():
    """The sampler uploads (first rows, row counts) as one [2, R] tensor: with R odd the second row's address is
    8 bytes off 16, and Triton specialises on pointer alignment. chain_sample re-aligns such views, so a call
    after the warm-up compiles nothing (under Poisson arrivals each new variant stalled a round ~1 s)."""
    import triton.knobs as knobs

    from forerun.kernels.chain_sample import chain_sample

    r, q, vocab = 5, 3, 1000
    logits = torch.randn(r * q, vocab, device="cuda")
    ids = torch.full((r * q,), -1, dtype=torch.int64, device="cuda")
    temp = torch.zeros(r, device="cuda")
    coins = torch.rand(r * q, 2, device="cuda")
    aligned = [torch.arange(r, device="cuda") * q, torch.full((r,), q, dtype=torch.int64, device="cuda")]
    want = chain_sample(logits, ids, *aligned, temp, coins, max_seqlen=q)  # compiles the aligned variants
    both = torch.stack(aligned).contiguous()
    assert both[1].data_ptr() % 16 == 8  # the unaligned view the sampler passes
    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(kw.get("repr"))
    try:
        got = chain_sample(logits, ids, both[0], both[1], temp, coins, max_seqlen=q)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == []
    assert torch.equal(got.num_accepted, want.num_accepted)
    assert torch.equal(got.output_token_ids, want.output_token_ids)


@pytest.mark.parametrize("with_q", [True, False])
def test_chain_sample_sampling_matches_reference(with_q):
    seqlens = [1, 2, 3, 5, 7, 7, 4, 1, 6, 2, 3, 5]
    temps = [1.0, 0.6, 1.5, 0.0, 1.0, 0.8, 1.2, 1.0, 0.7, 1.0, 0.0, 2.0]
    for seed in range(4):
        _check_chain(make_chain_case(seqlens, temps, seed=10 + seed), with_q=with_q, max_len=7, exact=False)


def test_chain_sample_small_vocab_distribution():
    """10^6 draws at a small vocabulary: the emitted first token follows the target distribution (chi-square),
    and the same draws reject it with one point (0.01) of probability moved between its two likeliest tokens."""
    from test_verify_common import assert_exact_with_one_point_power

    vocab, n = 37, 1_000_000
    g = torch.Generator().manual_seed(5)
    target = torch.randn(vocab, generator=g) * 2
    draft = target + torch.randn(vocab, generator=g)
    q = torch.softmax(draft, -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    logits = target.to(DEV).repeat(2 * n, 1)
    ids = torch.stack([drafts, torch.full((n,), -1)], 1).reshape(-1)
    qp = q.to(DEV).repeat(2 * n, 1)
    res = chain_sample(logits, ids.to(DEV), torch.arange(0, 2 * n, 2).to(DEV), torch.full((n,), 2).to(DEV),
                       torch.ones(n).to(DEV), torch.rand(2 * n, 2, generator=g).to(DEV), qp, max_seqlen=2)
    first = res.output_token_ids[:, 0].cpu()
    counts = torch.bincount(first, minlength=vocab)
    assert_exact_with_one_point_power(counts, torch.softmax(target.double(), -1))


# -- CUDA graphs -----------------------------------------------------------------------------------------
def tiny_runner(seed: int = 0, ops: str = "torch") -> ModelRunner:
    """A random bf16 Qwen3-shaped model; ops: "torch" (reference), "compiled" (torch.compile'd modules) or
    "fused" (Triton layer kernels)."""
    cfg = ModelConfig(arch="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=8, num_kv_heads=2, head_dim=64, qk_norm=True, max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(DEV, torch.bfloat16).eval()
    model.backend = TritonPagedAttention()
    if ops == "compiled":
        compile_elementwise(model)
    elif ops == "fused":
        model.ops = FusedLayerOps()
    return ModelRunner(model, CacheConfig(block_size=16, num_blocks=256), DEV, torch.bfloat16,
                       max_batch_tokens=512, max_seqs=32)


def _prefilled_pair(ops: str):
    graph_side, eager_side = tiny_runner(ops=ops), tiny_runner()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (7, 40, 16, 3, 100)]
    for r in (graph_side, eager_side):
        for i, p in enumerate(prompts):
            r.kv.add_sequence(i)
        r.forward([Chunk(i, p, logits="none") for i, p in enumerate(prompts)])
    return graph_side, eager_side


@pytest.mark.parametrize("ops", ["torch", "compiled", "fused"])
def test_graph_replay_equals_eager(ops):
    a, b = _prefilled_pair(ops)
    gr = GraphRunner(a, batch_sizes=(1, 2, 4, 8), max_q_len=16)
    gr.capture(5, 1)
    gr.capture(5, 4, 4)
    steps = [
        [Chunk(i, [10 + i]) for i in range(5)],  # decode, padded to bucket 8
        [Chunk(i, [1, 2, 3, 4], logits="all") for i in range(5)],  # verify 3 drafts
        [Chunk(i, [5 + i]) for i in range(2)],  # decode, bucket 2 (captured on demand)
        [Chunk(i, [7] * 16, logits=3) for i in range(3)],  # 16 tokens, last 3 logits
        [Chunk(i, [1, 2][: 1 + i % 2], logits="all") for i in range(5)],  # ragged: eager
    ]
    for step in steps:
        got, s1 = gr.forward(step)
        want, s2 = b.forward(step)
        assert s1 == s2
        assert got.logits.shape == want.logits.shape
        assert rel_err(got.logits, want.logits) < 2e-2
    assert gr.replays == 4 and gr.eager_steps == 1
    # tree-masked verification through a graph
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    step = [Chunk(i, [9, 8, 7, 6], positions=[a.kv.length(i) + dd for dd in (0, 1, 1, 2)], tree_mask=mask, logits="all")
            for i in range(5)]
    got, _ = gr.forward(step)
    want, _ = b.forward(step)
    assert rel_err(got.logits, want.logits) < 2e-2
    # device-prepared uniform steps (decode loops)
    seqs = list(range(5))
    ctx = torch.tensor([a.kv.length(i) for i in seqs], device=DEV)
    for i in seqs:
        a.kv.reserve(i, a.kv.length(i) + 3)
    table = a.kv.block_table(seqs)
    a.buffers.block_tables[:5, : table.shape[1]].copy_(table)
    ids = torch.randint(0, 512, (5, 3), device=DEV)
    got = gr.run_uniform(ids, ctx, logits_per_seq=3).clone()
    want, _ = b.forward([Chunk(i, ids[i].tolist(), logits="all") for i in seqs])
    assert rel_err(got, want.logits) < 2e-2


def test_prefill_pieces_on_cuda_graphs_equal_eager():
    """Ragged steps (prompts of 7..300 tokens beside decode rows, chunks without logits) replayed as graph
    pieces (GraphRunner.forward_pieces, via ModelRunner.forward) give the eager forward's logits, and the cache
    they leave gives the same next step."""
    a, b = tiny_runner(ops="fused"), tiny_runner(ops="fused")
    a.graphs = GraphRunner(a, batch_sizes=(1, 2, 4, 8), max_q_len=4, max_pieces=12)
    g = torch.Generator().manual_seed(3)
    lens = (7, 40, 100, 300, 1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
    for r in (a, b):
        for i in range(len(prompts) + 1):
            r.kv.add_sequence(i)
        r.forward([Chunk(5, [3, 4, 5])])
    steps = [[Chunk(i, p, logits="none" if i == 1 else "last") for i, p in enumerate(prompts)] + [Chunk(5, [9])],
             [Chunk(i, [11 + i]) for i in range(6)]]
    for step in steps:
        replays = a.graphs.replays
        got, s1 = a.forward(step)
        want, s2 = b.forward(step)
        assert s1 == s2 and got.logits.shape == want.logits.shape
        assert rel_err(got.logits, want.logits) < 2e-2
        assert a.graphs.replays > replays
    assert a.graphs.pieces_steps >= 1 and a.graphs.eager_steps == 0
    assert [a.kv.length(i) for i in range(6)] == [b.kv.length(i) for i in range(6)]


def test_grouped_prompt_pieces_on_cuda_graphs_equal_eager():
    """Several prompts of one length read together: their long pieces share replays (three 40-token prompts padded
    to a bucket of 4, five 128-token prompts as 4 + 1: the runner's 512-token buffers cap a replay at 4 of them),
    on CUDA graphs, against the eager forward. (Written after the eleventh session's device time ran out: its
    first two runs failed in the test's own reference forward, which exceeded the runner's buffers.)"""
    a, b = tiny_runner(ops="fused"), tiny_runner(ops="fused")
    a.graphs = GraphRunner(a, batch_sizes=(1, 2, 4, 8), max_q_len=4, max_pieces=12)
    g = torch.Generator().manual_seed(5)
    lens = (40, 40, 40, 128, 128, 128, 128, 128)  # (the runner holds 8 sequences)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
    for r in (a, b):
        for i in range(len(prompts)):
            r.kv.add_sequence(i)
    step = [Chunk(i, p, logits="last") for i, p in enumerate(prompts)]
    plan = a.graphs.plan_pieces(step)
    assert plan is not None and any(len(i) == 3 for i, *_ in plan) and any(len(i) == 4 and q == 128 for i, q, *_ in plan)
    for st in (step, [Chunk(i, [11 + i]) for i in range(len(prompts))]):
        got, _ = a.forward(st)
        # the reference in two forwards (its buffers hold 512 tokens; each sequence's rows are its own)
        want = torch.cat([b.forward(st[:5])[0].logits, b.forward(st[5:])[0].logits])
        assert got.logits.shape == want.shape and rel_err(got.logits, want) < 2e-2
    assert a.graphs.eager_steps == 0
    assert [a.kv.length(i) for i in range(len(prompts))] == [b.kv.length(i) for i in range(len(prompts))]


def test_chain_sample_matches_forerun_verify():
    """The fused kernel against the engine's torch verifier on the same inputs (ties aside)."""
    verify = pytest.importorskip("forerun.verify")
    seqlens = [1, 2, 3, 5, 7, 7, 4, 1, 6, 2, 3, 5]
    temps = [1.0, 0.6, 1.5, 0.0, 1.0, 0.8, 1.2, 1.0, 0.7, 1.0, 0.0, 2.0]
    mismatches, total = 0, 0
    for seed in range(4):
        logits, drafts, first, seqlens_t, temps_t, uniforms, q = make_chain_case(seqlens, temps, seed=20 + seed)
        r = len(seqlens)
        sampling = verify.SamplingTensors(temps_t, torch.zeros(r, dtype=torch.long, device=DEV),
                                          torch.ones(r, device=DEV), torch.zeros(r, device=DEV))
        want = verify.verify_chain(logits, drafts, first, seqlens_t, sampling, uniforms, draft_probs=q)
        got = chain_sample(logits, drafts, first, seqlens_t, sampling, uniforms, q, max_seqlen=7)
        _, _, margin = reference_chain(logits, drafts, first, seqlens_t, temps_t, uniforms, q, 7)
        same = ((got.output_token_ids == want.output_token_ids).all(1) & (got.num_accepted == want.num_accepted)).cpu()
        assert (margin[~same] < 1e-5).all(), (got.output_token_ids[~same], want.output_token_ids[~same])
        mismatches += int((~same).sum())
        total += r
    assert mismatches <= max(1, total // 50)


# -- the engine end to end on CUDA -------------------------------------------------------------------------
def model_factory(hf, dtype: torch.dtype):
    """A function building fresh forerun copies of a transformers model on the GPU."""
    cfg = ModelConfig.from_hf(hf.config.to_dict())

    def build():
        m = LlamaForCausalLM(cfg).eval()
        m.load_weights(hf.state_dict().items())
        m = m.to(DEV, dtype)
        m.reset_rope(DEV)
        return m

    return build


@pytest.mark.parametrize("method", ["draft", "ngram", "early-exit", "tree"])
def test_engine_on_cuda_graphs_greedy_spec_equals_plain(method):
    """LLM on CUDA (Triton attention, fused layer kernels, CUDA graphs, fused verify kernel): speculative greedy
    output == plain greedy output, for every drafter. In float32: in bf16 a verify step (k+1 rows) and a decode
    step (1 row) may round differently (other kernel tiles), which can flip an argmax at a near-tie."""
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny import hf_model, sharpen, tiny_tokenizer

    from forerun.config import SpecConfig
    from forerun.engine.llm import LLM
    from forerun.sampling_params import SamplingParams

    build = model_factory(sharpen(hf_model("llama"), 3.0), torch.float32)

    tok = tiny_tokenizer()
    spec = {"draft": lambda: SpecConfig(method="draft", draft_model=(build(), tok), k=3),
            "ngram": lambda: SpecConfig(method="ngram", k=3),
            "early-exit": lambda: SpecConfig(method="early-exit", early_exit_layers=1, k=3),
            "tree": lambda: SpecConfig(method="draft", draft_model=(build(), tok), tree=(2, 2, 1))}[method]()
    kw = dict(device="cuda", dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=512))
    prompts = [[5, 9, 13, 22, 40, 7, 5, 9, 13], [70, 71, 72, 70, 71, 72, 70]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM.from_model(build(), tok, **kw).generate(prompts, sp)
    llm = LLM.from_model(build(), tok, spec=spec, check_invariants=True, **kw)
    assert isinstance(llm.runner.model.ops, FusedLayerOps)
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.runner.graphs is not None and llm.runner.graphs.replays > 0
    if method in ("draft", "tree"):  # the draft is the target: every draft position is accepted
        assert llm.aggregate_stats(outs).position_acceptance_rate == 1.0


def test_overlapped_speculative_rounds_on_cuda_graphs_equal_plain():
    """Engine(overlap_spec=True) on CUDA graphs (device-prepared draft and verify steps, pinned verdict copies):
    greedy output equals plain greedy output, and the overlapped sessions ran."""
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny import hf_model, sharpen, tiny_tokenizer

    import forerun.engine.engine as engine_module
    from forerun.config import SpecConfig
    from forerun.engine.llm import LLM
    from forerun.sampling_params import SamplingParams

    build = model_factory(sharpen(hf_model("llama"), 3.0), torch.float32)
    tok = tiny_tokenizer()
    kw = dict(device="cuda", dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=512))
    prompts = [[5, 9, 13, 22, 40, 7, 5, 9, 13], [70, 71, 72, 70, 71, 72, 70], list(range(3, 60))]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM.from_model(build(), tok, **kw).generate(prompts, sp)
    sessions = []
    real = engine_module.overlapped_spec_rounds

    def counted(*args, **kwargs):
        sessions.append(1)
        return real(*args, **kwargs)

    engine_module.overlapped_spec_rounds = counted
    try:
        llm = LLM.from_model(build(), tok, spec=SpecConfig(method="draft", draft_model=(build(), tok), k=3),
                             check_invariants=True, overlap_spec=True, **kw)
        llm.engine.warmup()
        outs = llm.generate(prompts, sp)
    finally:
        engine_module.overlapped_spec_rounds = real
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sessions
    assert llm.aggregate_stats(outs).position_acceptance_rate == 1.0  # the draft is the target


def drive_arrivals(eng, prompts, params, arrivals) -> dict[str, list[int]]:
    """Step `eng` to the end, adding request i (id str(i)) at step arrivals[i]; the tokens of each request."""
    out, step = {}, 0
    while step <= max(arrivals) or eng.has_unfinished():
        for i, at in enumerate(arrivals):
            if at == step:
                eng.add_request(prompts[i], params[i], request_id=str(i))
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
        step += 1
    return out


@pytest.mark.parametrize("in_session,mix", [(True, True), (True, False), (False, False)])
def test_session_joins_and_leaves_on_cuda_graphs_equal_plain(in_session, mix):
    """Arrivals joining a running overlapped speculative session and finished requests leaving it
    (Engine.JOIN_IN_SESSION; off: each ends the session) on CUDA graphs, where the round in flight is still on the
    device when the host drops a finished request's rows and frees its blocks: outputs equal plain greedy, every
    block comes back, and (on) the joins happened inside sessions. mix (Engine.MIX_JOINS): lone arrivals are read
    in the members' verify forward (GraphRunner.run_uniform_join: prompts of 3-77 tokens padded to 64-128 rows),
    launched while the round before runs."""
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny import hf_model, sharpen, tiny_tokenizer

    from forerun.config import SpecConfig
    from forerun.engine.engine import Engine
    from forerun.sampling_params import SamplingParams

    build = model_factory(sharpen(hf_model("llama"), 3.0), torch.float32)
    dbuild = model_factory(sharpen(hf_model("llama", seed=1, num_hidden_layers=1), 3.0), torch.float32)
    tok = tiny_tokenizer()
    kw = dict(device="cuda", dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=512))
    prompts = [list(range(3, 3 + n)) for n in (5, 19, 40, 77)] + [[8, 8, 8], [70, 71, 72, 70, 71]] * 2
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 9, 30, 14, 25, 7, 33, 12)]
    arrivals = [0, 0, 3, 6, 9, 12, 15, 16]

    def drive(eng):
        return drive_arrivals(eng, prompts, params, arrivals)

    want = drive(Engine.from_model(build(), tok, **kw))
    for name, draft in (("weak draft", dbuild), ("self-draft", build)):  # rollbacks every round / all accepted
        eng = Engine.from_model(build(), tok, spec=SpecConfig(method="draft", draft_model=(draft(), tok), k=3),
                                check_invariants=True, overlap_spec=True, **kw)
        eng.JOIN_IN_SESSION, eng.MIX_JOINS = in_session, mix
        eng.warmup(max_batch=8)
        got = drive(eng)
        # (the twelfth session saw this test fail once, its message lost: say which request and where it differs)
        diff = {rid: next(((i, a, b) for i, (a, b) in enumerate(zip(got.get(rid, []) + [None] * 99, want[rid]))
                           if a != b), ("longer", len(got.get(rid, [])), len(want[rid])))
                for rid in want if got.get(rid) != want[rid]}
        assert not diff, (name, "first difference (position, got, want) per request", diff)
        assert (eng.session_joins > 0) == in_session, (name, eng.session_joins, eng.session_reads)
        assert (eng.mixed_joins > 0) == mix and (eng.runner.graphs.join_replays > 0) == mix, \
            (name, eng.mixed_joins, eng.runner.graphs.join_replays)
        assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks - 1
        assert eng.drafter.kv.num_free_blocks == eng.drafter.kv.num_blocks - 1


@pytest.mark.parametrize("overlap_spec", [True, False])
def test_prefix_caching_on_cuda_graphs_equals_plain(overlap_spec):
    """Prefix caching (kvcache/pool.py) under CUDA graphs, overlapped sessions and their joins: prompts that share
    their starts (all begin 3, 4, 5, ...), arriving while others run and after others finished, read the cached
    blocks (target and draft pools); outputs equal plain greedy without the cache, every block comes back."""
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny import hf_model, sharpen, tiny_tokenizer

    from forerun.config import SpecConfig
    from forerun.engine.engine import Engine
    from forerun.sampling_params import SamplingParams

    build = model_factory(sharpen(hf_model("llama"), 3.0), torch.float32)
    dbuild = model_factory(sharpen(hf_model("llama", seed=1, num_hidden_layers=1), 3.0), torch.float32)
    tok = tiny_tokenizer()
    kw = dict(device="cuda", dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=512))
    prompts = [list(range(3, 3 + n)) for n in (40, 19, 77, 41, 40, 60)] + [[8, 8, 8], list(range(3, 40)) + [9]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 9, 30, 14, 25, 7, 33, 12)]
    arrivals = [0, 0, 3, 6, 9, 40, 60, 61]

    def drive(eng):
        return drive_arrivals(eng, prompts, params, arrivals)

    want = drive(Engine.from_model(build(), tok, enable_prefix_caching=False, **kw))
    eng = Engine.from_model(build(), tok, spec=SpecConfig(method="draft", draft_model=(dbuild(), tok), k=3),
                            check_invariants=True, overlap_spec=overlap_spec, enable_prefix_caching=True, **kw)
    eng.warmup(max_batch=8)
    got = drive(eng)
    assert got == want
    assert eng.runner.kv.prefix_hits > 0 and eng.drafter.kv.prefix_hits > 0
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks - 1
    assert eng.drafter.kv.num_free_blocks == eng.drafter.kv.num_blocks - 1


# -- fused layer kernels in bf16 (the interpreter tests in test_kernels.py cover float32 / float16) ----------
@pytest.mark.parametrize("m", [1, 2, 4, 16])
@pytest.mark.parametrize("glu", [False, True])
def test_skinny_linear_bf16(m, glu):
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, 4096, device=DEV, generator=g, dtype=torch.bfloat16)
    w = torch.randn(2 * 1536, 4096, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02
    ref = x.float() @ w.float().T
    if glu:
        gate, up = ref.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
    cfgs = [GemmConfig(8, 512, False, 4, 1), GemmConfig(16, 256, True, 4, 4)] if m <= 2 else [GemmConfig(16, 256, True, 4, 4)]
    for cfg in cfgs + [None]:
        y = skinny_linear(x, w, glu=glu, config=cfg)
        assert y.dtype == torch.bfloat16 and rel_err(y, ref) < 8e-3, cfg


def test_fused_norm_kernels_bf16():
    g = torch.Generator(device=DEV).manual_seed(0)
    x, r = (torch.randn(7, 4096, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(4096, device=DEV, generator=g, dtype=torch.bfloat16)
    y, s = add_rmsnorm(x, r, w, 1e-6)
    s64 = x.double() + r.double()
    assert torch.equal(s, x + r)
    assert rel_err(y, w.double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6)) < 8e-3


@pytest.mark.parametrize("ops", ["compiled", "fused"])
def test_fused_ops_match_torch_ops_bf16(ops):
    """Prefill (torch products) and decode / verify steps (skinny products) agree with the torch ops in bf16."""
    a, b = _prefilled_pair(ops)
    for step in ([Chunk(i, [10 + i]) for i in range(5)], [Chunk(i, [1, 2, 3, 4], logits="all") for i in range(5)]):
        got, _ = a.forward(step)
        want, _ = b.forward(step)
        assert rel_err(got.logits, want.logits) < 2e-2


@pytest.mark.parametrize("m", [1, 4, 16])
def test_skinny_linear_float32_default_config(m):
    """float32 activations take the default configuration (the tuned table is for bf16) and must fit the
    shared memory with a wide K; dot products in IEEE float32, not TF32."""
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, 4096, device=DEV, generator=g)
    w = torch.randn(2 * 2048, 4096, device=DEV, generator=g)
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    y = FusedLayerOps().mlp(x, _Mlp(w, torch.eye(4096, 2048, device=DEV)))
    assert rel_err(y, (torch.nn.functional.silu(gate) * up) @ torch.eye(4096, 2048, device=DEV, dtype=torch.float64).T) < 1e-5


class _Mlp(torch.nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(gate_up.shape[1], gate_up.shape[0], bias=False, device=DEV)
        self.down_proj = torch.nn.Linear(down.shape[1], down.shape[0], bias=False, device=DEV)
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(gate_up)
            self.down_proj.weight.copy_(down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_overlapped_decoding_on_cuda_equals_rounds(dtype):
    """Plain decoding on CUDA overlaps the host's commits with the next graph replay (engine/overlap.py): same
    tokens as ordinary rounds, greedy and seeded sampling, with requests finishing at different steps."""
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny import hf_model, sharpen, tiny_tokenizer

    import forerun.engine.engine as llm_module
    from forerun.engine.llm import LLM
    from forerun.sampling_params import SamplingParams

    build = model_factory(sharpen(hf_model("qwen3"), 2.0), dtype)

    prompts = [[5, 9, 13, 22, 40, 7], [3], list(range(10, 60, 3)), [70, 71, 72, 70, 71], [8, 8, 8]]
    params = [SamplingParams(temperature=t, max_tokens=n, seed=i, ignore_eos=True)
              for i, (t, n) in enumerate([(0, 20), (0.8, 7), (0, 33), (1.0, 15), (0, 2)])]
    kw = dict(device="cuda", dtype=dtype, cache=CacheConfig(block_size=16, num_blocks=256), check_invariants=True)
    ref = LLM.from_model(build(), tiny_tokenizer(), overlap=False, **kw).generate(prompts, params)
    calls = []
    real = llm_module.overlapped_decode

    def spy(*args, **kwargs):
        calls.append(1)
        return (yield from real(*args, **kwargs))

    llm_module.overlapped_decode = spy
    try:
        got = LLM.from_model(build(), tiny_tokenizer(), **kw).generate(prompts, params)
    finally:
        llm_module.overlapped_decode = real
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert calls


def test_warmup_captures_every_decode_and_verify_graph_before_serving():
    """Engine.warmup captures the target's decode / verify graphs (and the draft's steps) up front: a run at or
    below the warmed batch size then captures no new target graph, and its output equals plain decoding."""
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny import hf_model, sharpen, tiny_tokenizer

    from forerun.config import SpecConfig
    from forerun.engine.llm import LLM
    from forerun.sampling_params import SamplingParams

    build = model_factory(sharpen(hf_model("llama"), 3.0), torch.float32)
    tok = tiny_tokenizer()
    kw = dict(device="cuda", dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=512))
    prompts = [[5, 9, 13, 22, 40, 7, 5, 9, 13], [70, 71, 72, 70, 71, 72, 70]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM.from_model(build(), tok, **kw).generate(prompts, sp)
    llm = LLM.from_model(build(), tok, spec=SpecConfig(method="draft", draft_model=(build(), tok), k=3),
                         max_num_seqs=4, **kw)
    n = llm.engine.warmup()
    gr = llm.runner.graphs
    assert n > 0 and len(gr.graphs) >= len([b for b in gr.batch_sizes if b <= 4]) * 4  # q = 1..4 per bucket
    before = set(gr.graphs)
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert set(gr.graphs) == before, f"captured while serving: {set(gr.graphs) - before}"


def _eagle_cuda_runs(tmp_path):
    """(run, build, tok, kw) for the EAGLE-on-CUDA-graphs tests: run(overlap, preverify, drawn, max_tokens, stops)
    serves PROMPTS with a random head on a tiny qwen2 (tree (3, 3, 8), no budget) and returns (tokens by request id,
    the drawn verdict's record or None, prelaunch_stats, preverify_stats)."""
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from test_eagle_round import PROMPTS, _PathSampler, _drain
    from tiny import hf_model, random_eagle_head_dir, sharpen, tiny_tokenizer

    from forerun.config import SpecConfig
    from forerun.engine.engine import Engine
    from forerun.sampling_params import SamplingParams

    hf = sharpen(hf_model("qwen2"), 3.0)
    build = model_factory(hf, torch.float32)
    head = random_eagle_head_dir(build().cpu(), tmp_path / "head")
    tok = tiny_tokenizer(hf.config.vocab_size)
    kw = dict(device="cuda", dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=512))

    def run(overlap, preverify=None, drawn=True, max_tokens=lambda i: 40 + 6 * i, stops=None):
        eng = Engine.from_model(build(), tok, spec=SpecConfig(method="eagle", eagle_head=head, eagle_tree=(3, 3, 8)),
                                **kw)
        eng.drafter.budget = None
        eng.drafter.overlap_trees = overlap
        eng.round.preverify = preverify
        assert eng.drafter._graphs_on()
        sampler = None
        if drawn:
            eng.round.sampler = sampler = _PathSampler(seed=5)
        for i, p in enumerate(PROMPTS):
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens(i), ignore_eos=True,
                                              stop_token_ids=(stops or {}).get(i, ())), request_id=str(i))
        out = _drain(eng)
        return out, (sampler.seen if sampler else None), dict(eng.drafter.prelaunch_stats), \
            dict(eng.round.preverify_stats)

    return run, build, tok, kw


@pytest.mark.parametrize("overlap", [True, False])
def test_eagle_prefix_caching_on_cuda_graphs_equals_plain(tmp_path, overlap):
    """EAGLE trees on CUDA graphs (drafting prelaunched from the device verdict or not) with prefix caching: prompts
    sharing their starts, arriving while others run and after others finished, read cached rows in the target's
    pool and the head's (named by token pairs); outputs equal plain greedy without the cache, every block back."""
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny import hf_model, random_eagle_head_dir, sharpen, tiny_tokenizer

    from forerun.config import SpecConfig
    from forerun.engine.engine import Engine
    from forerun.sampling_params import SamplingParams

    hf = sharpen(hf_model("qwen2"), 3.0)
    build = model_factory(hf, torch.float32)
    head = random_eagle_head_dir(build().cpu(), tmp_path / "head")
    tok = tiny_tokenizer(hf.config.vocab_size)
    kw = dict(device="cuda", dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=512))
    prompts = [list(range(3, 3 + n)) for n in (40, 19, 77, 41, 40, 60)] + [[8, 8, 8], list(range(3, 40)) + [9]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 9, 30, 14, 25, 7, 33, 12)]
    arrivals = [0, 0, 3, 6, 9, 40, 60, 61]
    want = drive_arrivals(Engine.from_model(build(), tok, enable_prefix_caching=False, **kw), prompts, params,
                          arrivals)
    eng = Engine.from_model(build(), tok, spec=SpecConfig(method="eagle", eagle_head=head, eagle_tree=(3, 3, 8)),
                            check_invariants=True, enable_prefix_caching=True, **kw)
    eng.drafter.overlap_trees = overlap
    assert eng.drafter._graphs_on()
    got = drive_arrivals(eng, prompts, params, arrivals)
    assert got == want
    assert eng.runner.kv.prefix_hits > 0 and eng.drafter.kv.prefix_hits > 0
    for kv in (eng.runner.kv, eng.drafter.kv):
        assert kv.num_free_blocks == kv.num_blocks - 1


def test_eagle_prelaunched_drafting_on_cuda_graphs(tmp_path):
    """EAGLE trees on CUDA graphs with the next round's drafting (and verify step) queued from the device verdict (on
    by default):
    with a drawn verdict (0..2 drafts accepted), every round verifies the same trees and commits the same tokens
    as with the drafting launched after the host read; with the real greedy verdict the output is plain greedy."""
    run, build, tok, kw = _eagle_cuda_runs(tmp_path)  # (puts tests/ on sys.path)
    from test_eagle_round import PROMPTS, _drain

    from forerun.engine.engine import Engine
    from forerun.sampling_params import SamplingParams

    # on: the next round's drafting and verify step queued from the device verdict (the defaults); draft: the
    # drafting only; off: neither
    on, draft, off = run(None), run(None, preverify=False), run(False)
    assert on[2]["used"] >= 8 and off[2]["launched"] == 0, on[2]
    assert on[3]["used"] >= 8 and draft[3]["launched"] == 0 and off[3]["launched"] == 0, on[3]
    assert sorted({a for _, _, accs in on[1] for a in accs}) == [0, 1, 2]
    assert on[1] == off[1] == draft[1] and on[0] == off[0] == draft[0]
    greedy = run(None, drawn=False, max_tokens=lambda i: 24)
    assert greedy[2]["used"] > 0 and greedy[3]["used"] > 0
    plain = Engine.from_model(build(), tok, **kw)
    for i, p in enumerate(PROMPTS):
        plain.add_request(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), request_id=str(i))
    assert greedy[0] == _drain(plain)


def test_eagle_fused_tree_kernels_on_cuda_graphs(tmp_path, monkeypatch):
    """The greedy tree's bookkeeping in Triton (forerun/kernels/eagle_tree.py, CUDA's default) against grow_tree's
    torch ops (FORERUN_EAGLE_FUSED=0), both captured in the drafting graphs: the same trees verified round by round
    (a drawn verdict: 0..2 drafts accepted) and the same tokens; the kernels ran."""
    import forerun.drafters.eagle as E

    run = _eagle_cuda_runs(tmp_path)[0]
    calls = []
    real = E._grow_tree_fused
    monkeypatch.setattr(E, "_grow_tree_fused", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fused = run(None)
    assert calls
    monkeypatch.setenv("FORERUN_EAGLE_FUSED", "0")
    n = len(calls)
    ops = run(None)
    assert len(calls) == n
    assert fused[1] == ops[1] and fused[0] == ops[0]


def test_eagle_queued_rounds_with_early_ends_on_cuda_graphs(tmp_path):
    """On CUDA graphs, requests ending on a stop token while the next round's drafting and verify step are queued:
    the next round takes the others' rows (`partial`), with the same trees and tokens as without queuing."""
    run = _eagle_cuda_runs(tmp_path)[0]
    lengths = lambda i: 48 + 6 * i  # noqa: E731
    free = run(None, True, max_tokens=lengths)[0]
    first_new = lambda out, at: next(t for j, t in enumerate(out) if j >= at and t not in out[:j])  # noqa: E731
    stops = {i: (first_new(free[str(i)], 12 + 8 * i),) for i in range(3)}
    on = run(None, True, max_tokens=lengths, stops=stops)
    off = run(False, False, max_tokens=lengths, stops=stops)
    assert len(on[0]["0"]) < 48 and on[2]["partial"] >= 1 and on[3]["partial"] >= 1, (on[2], on[3])
    assert on[1] == off[1] and on[0] == off[0]
