"""Batch invariance of the CPU path: a row's result is bit-identical whether it is computed alone (plain decode),
as one of k + 1 verify rows, as a tree node, inside a prefill, or next to other sequences. That is what makes
greedy speculative output equal plain output exactly on the CPU, also on the quantized path, where the per-row
int8 activation rounding turns any last-bit difference upstream into a different token now and then."""
from __future__ import annotations

import pytest
import torch

from forerun.attention.metadata import AttnMetadata
from forerun.attention.reference import paged_attention_padded, paged_attention_rowwise
from forerun.engine.llm import LLM
from forerun.models.cpu_linear import PackedLinear
from forerun.models.layers import RMSNorm, RotaryEmbedding
from forerun.models.loader import load_checkpoint
from forerun.models.quant import Int8Linear, Q4Linear, quantize_groups_int4
from forerun.models.registry import build_model
from forerun.runtime.runner import Chunk
from test_loader import save
from tiny import hf_model, tiny_tokenizer

ROWS = 17


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("shape", [(256, 300), (1536, 2048), (512, 1792)])
def test_linears_norm_rope_are_row_invariant(threads, shape):
    """Each op on its own: row i of a batch of r rows (any r in 1..17, any offset) == row i computed alone."""
    k, n = shape
    torch.manual_seed(0)
    w, b, x = torch.randn(n, k) * 0.05, torch.randn(n), torch.randn(ROWS, k)
    lin = torch.nn.Linear(k, n)
    lin.weight.data, lin.bias.data = w, b
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = torch.randn(k)
    ops = {"int8": Int8Linear.from_float(w, b), "fp32 packed": PackedLinear(lin), "rmsnorm": norm}
    if Q4Linear.fits(n, k):  # forerun's C int4 kernel (gcc, AVX512-VNNI)
        ops["int4 q4"] = Q4Linear(*quantize_groups_int4(w), bias=b)
    with torch.inference_mode():
        for name, op in ops.items():
            full = op(x)
            for r in range(1, ROWS + 1):
                for start in (0, ROWS - r):
                    got = op(x[start:start + r])
                    assert torch.equal(got, full[start:start + r]), (name, r, start)
        rope = RotaryEmbedding(64, 10000.0, None, 512)
        q, kk = torch.randn(ROWS, 4, 64), torch.randn(ROWS, 2, 64)
        pos = torch.randint(0, 512, (ROWS,))
        fq, fk = rope(q, kk, pos)
        for i in range(ROWS):
            aq, ak = rope(q[i:i + 1], kk[i:i + 1], pos[i:i + 1])
            assert torch.equal(aq[0], fq[i]) and torch.equal(ak[0], fk[i])


def _meta(q_lens, prefixes, page, tables, tree=None):
    seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
    qsl = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist())
    slots = torch.cat([tables[b, torch.arange(p, p + n) // page] * page + torch.arange(p, p + n) % page
                       for b, (p, n) in enumerate(zip(prefixes, q_lens))])
    return AttnMetadata(qsl, torch.tensor(seq_lens), tables, slots, max(q_lens), max(seq_lens), tree_mask=tree)


@pytest.mark.parametrize("window", [None, 5])
def test_rowwise_attention_matches_sdpa_and_is_batch_invariant(threads, window):
    g = torch.Generator().manual_seed(0)
    page, hq, hkv, d = 4, 6, 2, 64
    nblocks = 64
    tables = torch.randperm(nblocks, generator=g)[:48].view(4, 12)  # 4 sequences, up to 48 keys each
    k = torch.randn(nblocks, page, hkv, d, generator=g)
    v = torch.randn(nblocks, page, hkv, d, generator=g)
    scale = d ** -0.5
    # a verify-like batch: 5 rows of sequence 0 after 30 cached keys, plus other sequences of other lengths
    q_lens, prefixes = [5, 1, 9, 2], [30, 17, 3, 40]
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    meta = _meta(q_lens, prefixes, page, tables)
    out = paged_attention_rowwise(q, k, v, meta, scale, window)
    ref = paged_attention_padded(q, k, v, meta, scale, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # same semantics as SDPA
    # sequence 0's rows as 5 separate decode steps (the same keys: the cache already holds them)
    for i in range(5):
        alone = paged_attention_rowwise(q[i:i + 1], k, v, _meta([1], [30 + i], page, tables[:1]), scale, window)
        assert torch.equal(alone[0], out[i]), i
    # as a chain-shaped tree (each node sees its ancestors): the same bits as the causal rows
    tree = torch.ones(5, 5, dtype=torch.bool).tril()
    as_tree = paged_attention_rowwise(q[:5], k, v, _meta([5], [30], page, tables[:1], tree), scale, window)
    assert torch.equal(as_tree, out[:5])
    # a branching tree: node 3 hangs off node 0 (sees 0 and itself); its bits == a decode row over those keys
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    meta_t = _meta([4], [30], page, tables[:1], tree)
    got = paged_attention_rowwise(q[:4], k, v, meta_t, scale, window)
    torch.testing.assert_close(got, paged_attention_padded(q[:4], k, v, meta_t, scale, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["int8", "int4", "none"])
def test_model_row_logits_bitwise_equal_alone_verify_batched_prefill(tmp_path, layout):
    """The whole model (tiny random Qwen2, quantized int8, int4 (forerun's C kernel where it runs) or fp32): the logits of 6 new tokens after a
    37-token prefix, computed as 6 decode steps, as one 6-row verify chunk, as a verify chunk next to another
    sequence's rows, and as the tail of one prefill, are bit-identical."""
    hf = hf_model("qwen2", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=300)
    model = build_model(load_checkpoint(save(hf, tmp_path / "m")), "cpu", torch.float32, progress=False,
                        quantize=layout)
    runner = LLM.from_model(model, tiny_tokenizer(300), device="cpu").runner
    g = torch.Generator().manual_seed(0)
    prefix, new, other = (torch.randint(2, 300, (n,), generator=g).tolist() for n in (37, 6, 53))

    def logits(chunks, seq):
        out, starts = runner.forward(chunks)
        i = [c.seq_id for c in chunks].index(seq)
        return out.logits[starts[i]:starts[i] + chunks[i].logit_count()]

    def fresh(seq, tokens):
        runner.kv.add_sequence(seq)
        runner.forward([Chunk(seq, tokens, logits="none")])

    fresh(1, prefix)
    decode = torch.cat([logits([Chunk(1, [t], logits="all")], 1) for t in new])
    fresh(2, prefix)
    verify = logits([Chunk(2, new, logits="all")], 2)
    fresh(3, prefix)
    fresh(4, other)
    batched = logits([Chunk(4, other[:3], logits="all"), Chunk(3, new, logits="all")], 3)
    runner.kv.add_sequence(5)
    prefill = logits([Chunk(5, prefix + new, logits=len(new))], 5)
    for name, got in [("verify", verify), ("batched", batched), ("prefill", prefill)]:
        assert torch.equal(got, decode), (name, (got - decode).abs().max().item())
