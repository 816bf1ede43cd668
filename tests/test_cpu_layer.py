"""The CPU layer kernels (forerun/kernels/cpu_layer.c: attention one query row at a time, add + RMSNorm, Q/K norm
+ RoPE + cache write) against the torch code they replace (LayerOps, the reference attention's torch rows), and
their batch invariance: a row's bits do not depend on the rows beside it or on the thread count."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import forerun.attention.reference as R
from forerun.attention.reference import paged_attention_padded, paged_attention_rowwise
from forerun.config import CacheConfig
from forerun.engine.llm import LLM
from forerun.kernels import cpu_layer
from forerun.kvcache.pool import KVPool
from forerun.models.cpu_ops import CpuLayerOps
from forerun.models.layers import RMSNorm, RotaryEmbedding
from forerun.models.loader import load_checkpoint
from forerun.models.ops import LayerOps
from forerun.models.registry import build_model
from test_batch_invariance import _meta, threads  # noqa: F401  (the 1 / 2 thread fixture)
from test_loader import save
from tiny import hf_model, tiny_tokenizer

pytestmark = pytest.mark.skipif(not cpu_layer.available(), reason="needs gcc and AVX2 or AVX-512 (the C kernels)")


def _torch_rows(monkeypatch):
    """Make paged_attention_rowwise take its torch path (the C kernel refused)."""
    monkeypatch.setattr(cpu_layer, "attention_rows", lambda *a, **k: None)


@pytest.mark.parametrize("window", [None, 5])
def test_c_attention_equals_torch_rows_and_sdpa(threads, window, monkeypatch):
    g = torch.Generator().manual_seed(1)
    page, hq, hkv, d = 4, 12, 2, 128  # Qwen2.5-1.5B's heads
    nblocks = 64
    tables = torch.randperm(nblocks, generator=g)[:48].view(4, 12)
    k = torch.randn(nblocks, page, hkv, d, generator=g)
    v = torch.randn(nblocks, page, hkv, d, generator=g)
    scale = d ** -0.5
    q_lens, prefixes = [5, 1, 9, 2], [30, 17, 3, 40]
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    cases = [(q, _meta(q_lens, prefixes, page, tables)), (q[:4], _meta([4], [30], page, tables[:1], tree))]
    for qq, meta in cases:
        c = paged_attention_rowwise(qq, k, v, meta, scale, window)
        with monkeypatch.context() as m:
            _torch_rows(m)
            t = paged_attention_rowwise(qq, k, v, meta, scale, window)
        torch.testing.assert_close(c, t, rtol=2e-6, atol=2e-6)  # float32 sums in another order
        torch.testing.assert_close(c, paged_attention_padded(qq, k, v, meta, scale, window), rtol=1e-5, atol=1e-5)
        assert not torch.equal(c, torch.zeros_like(c))
    # a row alone == the same row in the batch, bit for bit (sequence 0's rows as decode steps)
    out = paged_attention_rowwise(q, k, v, _meta(q_lens, prefixes, page, tables), scale, window)
    for i in range(5):
        alone = paged_attention_rowwise(q[i:i + 1], k, v, _meta([1], [30 + i], page, tables[:1]), scale, window)
        assert torch.equal(alone[0], out[i]), i
    # a wrong key list must show: drop a row's newest key from the flat plan
    R._plan_cache[:] = [None, None, None]
    meta = _meta([1], [30], page, tables[:1])
    plan = R._row_plan(meta, page, window)
    keys, off, lens, mx = R._flat_plan(plan, 1)
    bad = cpu_layer.attention_rows((q[:1] * scale).contiguous(), k.view(-1, hkv, d), v.view(-1, hkv, d), keys, off,
                                   lens - 1, mx)
    good = paged_attention_rowwise(q[:1], k, v, meta, scale, window)
    assert (bad - good).abs().max() > 1e-3


def test_flat_row_plan_gives_every_row_the_keys_of_the_row_plan():
    """`flat_row_plan` (the C kernel's key lists in a few numpy operations) against `_row_plan` + `_flat_plan` (the
    Python loop over rows it replaced where there is no window): 300 random steps of 1-4 sequences, causal or tree
    (random parents, prefixes 0-77, pages of 4 or 16): every row's key slots, in order, and the longest row equal;
    `_row_plan` still answers after `flat_row_plan` filled the shared cache for the same step; a dropped ancestor
    in a tree changes a row's keys (the comparison can fail)."""
    import itertools
    import random

    from forerun.attention.metadata import AttnMetadata

    rng = random.Random(0)

    def tree_of(n):
        par = [-1] + [rng.randrange(i) for i in range(1, n)]
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                m[i, j], j = True, par[j]
        return m

    def rows(flat):
        keys, off, lens, _ = flat
        return [keys[o:o + n].tolist() for o, n in zip(off.tolist(), lens.tolist())]

    trees = 0
    for _ in range(300):
        bs, b = rng.choice([4, 16]), rng.randint(1, 4)
        qls, pre = [rng.randint(1, 9) for _ in range(b)], [rng.choice([0, 1, 5, 30, 77]) for _ in range(b)]
        tm = None
        if rng.random() < 0.6:
            tm, r = torch.zeros(sum(qls), max(qls), dtype=torch.bool), 0
            for q in qls:
                tm[r:r + q, :q], r = tree_of(q), r + q
            trees += 1
        lens = [p + q for p, q in zip(pre, qls)]
        tables = torch.randint(0, 200, (b, max(-(-n // bs) for n in lens) + 2))
        meta = AttnMetadata(torch.tensor([0, *itertools.accumulate(qls)]), torch.tensor(lens), tables,
                            torch.zeros(sum(qls), dtype=torch.long), max(qls), max(lens), tm)
        R._plan_cache[:] = [None, None, None]
        want = R._flat_plan(R._row_plan(meta, bs, None), sum(qls))
        R._plan_cache[:] = [None, None, None]
        got = R.flat_row_plan(meta, bs, None)
        assert rows(got) == rows(want) and got[3] == want[3]
        assert R._row_plan(meta, bs, None) is not None
    assert trees > 100
    tm = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    meta = AttnMetadata(torch.tensor([0, 3]), torch.tensor([8]), torch.arange(4)[None], torch.zeros(3, dtype=torch.long),
                        3, 8, tm)
    R._plan_cache[:] = [None, None, None]
    full = rows(R.flat_row_plan(meta, 4, None))
    R._plan_cache[:] = [None, None, None]
    assert rows(R.flat_row_plan(replace(meta, tree_mask=tm & ~torch.eye(3, dtype=torch.bool).roll(-1, 0)), 4, None)) \
        != full


def _isa_builds() -> list[str]:
    """The builds of cpu_layer.c this CPU runs (AVX2 everywhere the kernels run; AVX-512 where present)."""
    from forerun.kernels import cbuild

    return [isa for isa in cbuild.ISAS if cbuild.cpu_ok(cbuild.ISAS[isa][1])]


def _c_rows(lib, q, k, v, meta, scale, window=None):
    """The attention of a given build of cpu_layer.c (as paged_attention_rowwise calls the loaded one)."""
    t, hq, d = q.shape
    hkv = k.shape[2]
    plan = R._row_plan(meta, k.shape[1], window)
    R._plan_cache[:] = [None, None, None]
    keys, off, lens, mx = R._flat_plan(plan, t)
    qs, out = (q * scale).contiguous(), torch.empty_like(q)
    lib.attn_rows(qs.data_ptr(), k.view(-1, hkv, d).data_ptr(), v.view(-1, hkv, d).data_ptr(), keys.data_ptr(),
                  off.data_ptr(), lens.data_ptr(), out.data_ptr(), t, hq, hkv, d, max(mx, 1))
    return out


@pytest.mark.parametrize("isa", _isa_builds())
@pytest.mark.parametrize("hq,hkv,d", [(12, 2, 128), (14, 2, 64), (4, 4, 96), (3, 1, 36)])
def test_c_attention_in_blocks_of_rows_is_row_invariant(threads, isa, hq, hkv, d, monkeypatch):
    """A long prefill chunk: the C kernel takes up to 16 rows of a sequence together (each tile of keys and values
    shared while in cache; session 43), so 37 rows after 70 cached keys run as items of 16, 16 and 5 rows, beside a
    3-row sequence and a tree. In each build this CPU runs (AVX-512: 16 keys a tile, AVX2: 8), every row gives the
    bits it gives alone (as a decode step), and torch's rows' values. (D = 96 and 36 take the scalar loop: the vector
    path serves D = 4, 8 or 16 vector widths.)"""
    from pathlib import Path

    from forerun.kernels import cbuild

    lib = cbuild.library_for(Path(cpu_layer.__file__).with_name("cpu_layer.c"), isa, ["-ffp-contract=off"],
                             cpu_layer._declare)
    g = torch.Generator().manual_seed(5)
    page, nblocks = 16, 64
    tables = torch.randperm(nblocks, generator=g)[:48].view(3, 16)
    k = torch.randn(nblocks, page, hkv, d, generator=g)
    v = torch.randn(nblocks, page, hkv, d, generator=g)
    scale = d ** -0.5
    q_lens, prefixes = [37, 3], [70, 130]
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    meta = _meta(q_lens, prefixes, page, tables)
    out = _c_rows(lib, q, k, v, meta, scale)
    with monkeypatch.context() as m:
        _torch_rows(m)
        torch.testing.assert_close(out, paged_attention_rowwise(q, k, v, meta, scale), rtol=3e-6, atol=3e-6)
    for i in range(0, 37, 3):
        alone = _c_rows(lib, q[i:i + 1], k, v, _meta([1], [70 + i], page, tables[:1]), scale)
        assert torch.equal(alone[0], out[i]), i
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tout = _c_rows(lib, q[37:], k, v, _meta([3], [130], page, tables[1:2], tree), scale)  # each row its own keys
    assert torch.equal(tout[0], out[37])  # (the root sees the same 131 keys as the chain's first row)
    assert not torch.equal(tout[2], out[39])  # (the tree's third row skips key 131)
    # the scalar loop (attn_rows_blocked(0)) gives the same values, in its own order
    before = lib.attn_rows_blocked(-1)
    try:
        lib.attn_rows_blocked(0)
        torch.testing.assert_close(_c_rows(lib, q, k, v, meta, scale), out, rtol=3e-6, atol=3e-6)
    finally:
        lib.attn_rows_blocked(before)


@pytest.mark.parametrize("isa", _isa_builds())
def test_c_attention_over_a_long_context_takes_fewer_rows_an_item(threads, isa):
    """Where an item's scores would pass 32 MB a thread (rows x query heads per kv head x keys x 4 bytes), the C
    kernel takes fewer than 16 rows an item: 16 query heads on one kv head over 36,000 keys give 14. Twenty rows of a
    prefill chunk (items of 14 and 6) match torch's rows, and each row alone (a decode step) gives the same bits."""
    from pathlib import Path

    from forerun.kernels import cbuild

    lib = cbuild.library_for(Path(cpu_layer.__file__).with_name("cpu_layer.c"), isa, ["-ffp-contract=off"],
                             cpu_layer._declare)
    g = torch.Generator().manual_seed(9)
    page, hq, hkv, d, prefix, rows = 16, 16, 1, 64, 35_980, 20
    nblocks = (prefix + rows) // page + 1
    assert (32 << 20) // (4 * (hq // hkv) * (prefix + rows)) == 14  # the item size this case exercises
    tables = torch.randperm(nblocks, generator=g).view(1, nblocks)
    k = torch.randn(nblocks, page, hkv, d, generator=g)
    v = torch.randn(nblocks, page, hkv, d, generator=g)
    scale = d ** -0.5
    q = torch.randn(rows, hq, d, generator=g) * 3  # sharper softmaxes than unit queries give over 36k keys
    meta = _meta([rows], [prefix], page, tables)
    out = _c_rows(lib, q, k, v, meta, scale)
    R._plan_cache[:] = [None, None, None]
    ref = paged_attention_padded(q, k, v, meta, scale)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for i in (0, 13, 14, 19):  # the first and last rows of both items
        alone = _c_rows(lib, q[i:i + 1], k, v, _meta([1], [prefix + i], page, tables), scale)
        assert torch.equal(alone[0], out[i]), i


def test_add_rmsnorm_equals_torch_and_is_row_invariant(threads):
    torch.manual_seed(0)
    ops, ref = CpuLayerOps(), LayerOps()
    x, r = torch.randn(17, 1536), torch.randn(17, 1536)
    norm = RMSNorm(1536, 1e-6)
    norm.weight.data = torch.rand(1536) + 0.5
    with torch.inference_mode():
        for res in (r, None):
            y, s = ops.add_rmsnorm(x, res, norm)
            y0, s0 = ref.add_rmsnorm(x, res, norm)
            assert torch.equal(s, s0)  # the sum is exact either way
            torch.testing.assert_close(y, y0, rtol=1e-6, atol=1e-6)
            for i in (0, 7, 16):
                yi, _ = ops.add_rmsnorm(x[i:i + 1].clone(), None if res is None else res[i:i + 1].clone(), norm)
                assert torch.equal(yi[0], y[i])
        norm.weight.data[3] = 0.0  # the weight is applied: a zeroed channel comes out zero
        assert (ops.add_rmsnorm(x, r, norm)[0][:, 3] == 0).all()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_store_equals_torch(threads, qk_norm):
    torch.manual_seed(0)
    hq, hkv, d, t = 4, 2, 64, 7
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=hkv, head_dim=d, sliding_window=None)
    pools = [KVPool(cfg, CacheConfig(block_size=4, num_blocks=16), torch.float32, "cpu") for _ in range(2)]
    rope = RotaryEmbedding(d, 10000.0, None, 256)
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    pos = torch.tensor([3, 9, 10, 11, 40, 41, 200])
    slots = torch.tensor([5, 17, 18, 2, 33, 34, 60])
    norms = (RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)) if qk_norm else (None, None)
    if qk_norm:  # Qwen3's per-head Q / K norms
        norms[0].weight.data, norms[1].weight.data = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    with torch.inference_mode():
        q = CpuLayerOps().qkv_to_cache(qkv, pos, rope, *norms, 1, SimpleNamespace(slot_mapping=slots), pools[0],
                                       hq, hkv, d)
        q0 = LayerOps().qkv_to_cache(qkv, pos, rope, *norms, 1, SimpleNamespace(slot_mapping=slots), pools[1],
                                     hq, hkv, d)
        torch.testing.assert_close(q, q0, rtol=1e-6, atol=1e-6)
        for a, b in ((pools[0].k, pools[1].k), (pools[0].v, pools[1].v)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert pools[0].k[1].abs().sum() > 0 and pools[0].k[0].abs().sum() == 0  # layer 1 written, layer 0 not
        q3 = CpuLayerOps().qkv_to_cache(qkv[3:4].clone(), pos[3:4].clone(), rope, *norms, 1,
                                        SimpleNamespace(slot_mapping=slots[3:4].clone()), pools[0], hq, hkv, d)
        assert torch.equal(q3[0], q[3])  # a row alone: the same bits


def test_what_the_c_code_cannot_take_falls_back_to_torch():
    """The kernel functions say None for what they cannot take (here bfloat16 rows, Q / K norms of different eps), and
    CpuLayerOps then runs LayerOps' torch code: the same result as LayerOps, not an error."""
    torch.manual_seed(1)
    x = torch.randn(3, 64).bfloat16()
    norm = RMSNorm(64, 1e-6).bfloat16()
    assert cpu_layer.add_rmsnorm_rows(x, None, norm.weight, norm.eps) is None
    with torch.inference_mode():
        y, s = CpuLayerOps().add_rmsnorm(x, x, norm)
        y0, s0 = LayerOps().add_rmsnorm(x, x, norm)
        assert torch.equal(y, y0) and torch.equal(s, s0)
        hq, hkv, d = 2, 1, 32
        cfg = SimpleNamespace(num_layers=1, num_kv_heads=hkv, head_dim=d, sliding_window=None)
        pools = [KVPool(cfg, CacheConfig(block_size=4, num_blocks=4), torch.float32, "cpu") for _ in range(2)]
        rope = RotaryEmbedding(d, 10000.0, None, 64)
        qkv, pos, meta = torch.randn(2, (hq + 2 * hkv) * d), torch.tensor([0, 1]), SimpleNamespace(
            slot_mapping=torch.tensor([0, 1]))
        norms = (RMSNorm(d, 1e-6), RMSNorm(d, 1e-5))  # different eps: the C code takes one
        q = CpuLayerOps().qkv_to_cache(qkv, pos, rope, *norms, 0, meta, pools[0], hq, hkv, d)
        q0 = LayerOps().qkv_to_cache(qkv, pos, rope, *norms, 0, meta, pools[1], hq, hkv, d)
        assert torch.equal(q, q0) and torch.equal(pools[0].k, pools[1].k)


def test_cpu_float32_runner_uses_the_c_layer_ops(tmp_path):
    hf = hf_model("qwen2", hidden_size=128, intermediate_size=256, vocab_size=300)
    model = build_model(load_checkpoint(save(hf, tmp_path / "m")), "cpu", torch.float32, progress=False)
    llm = LLM.from_model(model, tiny_tokenizer(300), device="cpu")
    assert type(llm.runner.model.ops) is CpuLayerOps


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("kind", ["mixed", "int4"])
def test_flat_decoder_layers_are_bit_identical_to_the_module_path(tmp_path, arch, kind, threads, monkeypatch):
    """CpuLayerOps.decoder_layers (the int4 layout's layers as C calls) against the modules it replaces, on a tiny
    int4 model (Qwen2: Q/K/V bias; Qwen3: Q/K norms; Llama): prefill, a decode row, a 4-row tree verify beside
    another sequence's rows, early exit and hidden states, all bit for bit; and it is the path taken. "int4": every
    layer goes to the C stack (cpu_layer.decoder_stack, split after each wanted layer); "mixed": layer 1's
    o-projection 8-bit (Q8Linear: in the stack too) and layer 2's down-projection left float (nn.Linear: the
    module's own call), so layer 2 runs call by call from Python. The Python calls alone (no stack) match too."""
    from forerun.kernels import cpu_q4
    from forerun.models import quant
    from forerun.runtime.runner import Chunk

    if not cpu_q4.available():
        pytest.skip("needs the int4 kernel")
    hf = hf_model(arch, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=300, num_hidden_layers=3)
    model = build_model(load_checkpoint(save(hf, tmp_path / "m")), "cpu", torch.float32, progress=False,
                        quantize="int4")
    layers = model.model.layers
    assert type(layers[0].self_attn.qkv_proj) is quant.Q4Linear
    if kind == "mixed":
        layers[1].self_attn.o_proj = quant.Q8Linear.from_float(layers[1].self_attn.o_proj.dequantized())
        down = torch.nn.Linear(256, 128, bias=False)
        down.weight.data.copy_(layers[2].mlp.down_proj.dequantized())
        layers[2].mlp.down_proj = down
    runner = LLM.from_model(model, tiny_tokenizer(300), device="cpu").runner
    assert type(model.ops) is CpuLayerOps
    g = torch.Generator().manual_seed(0)
    prefix, other = torch.randint(2, 300, (23,), generator=g).tolist(), torch.randint(2, 300, (9,), generator=g).tolist()
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)

    def run(base):  # the same steps on sequences base, base + 1; every logits row and hidden state
        runner.kv.add_sequence(base)
        runner.kv.add_sequence(base + 1)
        got = []
        for chunks, kw in [([Chunk(base, prefix, logits="all")], {}),
                           ([Chunk(base, [7], logits="all")], {"hidden_layers": (0, 2)}),
                           ([Chunk(base + 1, other, logits="all"), Chunk(base, [5, 9, 11, 13], logits="all",
                                                                          tree_mask=tree)], {}),
                           ([Chunk(base, [17], logits="all")], {"num_layers": 2, "hidden_layers": (1,)})]:
            out, _ = runner.forward(chunks, **kw)
            got += [out.logits, *out.hidden_states.values()]
        return got

    calls, stacks = [], []
    flat, stack = CpuLayerOps.decoder_layers, cpu_layer.decoder_stack

    def counted(self, *a, **k):
        r = flat(self, *a, **k)
        calls.append(r is not None)
        return r

    def counted_stack(table, *a, **k):
        stacks.append(table.shape[0])
        return stack(table, *a, **k)

    with torch.inference_mode():
        monkeypatch.setattr(CpuLayerOps, "decoder_layers", counted)
        monkeypatch.setattr(cpu_layer, "decoder_stack", counted_stack)
        fast = run(10)
        assert calls == [True] * 4
        # layers per stack call: int4 [3], [1, 2] (hidden after layers 0 and 2), [3], [2] (early exit after layer 1);
        # mixed: layers 0-1, then layer 2 from Python
        assert stacks == ([3, 1, 2, 3, 2] if kind == "int4" else [2, 1, 1, 2, 2])
        monkeypatch.setattr(CpuLayerOps, "_stack_ok", staticmethod(lambda *a: False))
        python = run(30)
        assert len(stacks) == 5  # no stack call with it refused
        monkeypatch.setattr(CpuLayerOps, "decoder_layers", lambda self, *a, **k: None)
        slow = run(20)
    assert len(fast) == len(slow) == len(python) == 7
    for i, (a, b, c) in enumerate(zip(fast, slow, python)):
        assert torch.equal(c, b), (i, (c - b).abs().max().item())
        assert torch.equal(a, b), (i, (a - b).abs().max().item())


def test_c_silu_mul_matches_torch_and_is_batch_invariant(threads):
    """silu(gate) * up in C (its own vectorized exp) within a few float32 ulps of torch's, over large and small
    gates and an intermediate size that is not a multiple of 8 (the tail vector); a row's bits alone == in a batch."""
    g = torch.Generator().manual_seed(3)
    for inter in (8960, 27):
        gu = torch.randn(5, 2 * inter, generator=g) * torch.tensor([0.1, 1.0, 4.0, 30.0, 200.0])[:, None]
        got = cpu_layer.silu_mul_rows(gu)
        gate, up = gu.chunk(2, dim=-1)
        ref = (gate.double() * torch.sigmoid(gate.double()) * up.double())
        normal = ref.abs() > 1e-30  # (below: results that underflow; checked in absolute terms)
        err = ((got.double() - ref).abs() / ref.abs())[normal]
        assert err.max().item() < 4e-7, err.max().item()  # a few ulps (2^-23 = 1.2e-7); torch's: ~1.5e-7
        torch_err = (((torch.nn.functional.silu(gate) * up).double() - ref).abs() / ref.abs())[normal].max().item()
        assert err.max().item() < 4 * max(torch_err, 1.2e-7)
        assert (got.double() - ref).abs()[~normal].max().item() < 1e-30
        for r in range(5):
            assert torch.equal(cpu_layer.silu_mul_rows(gu[r:r + 1].clone())[0], got[r])
    assert cpu_layer.silu_mul_rows(torch.tensor([[-1e4, 1e4, 2.0, 3.0]]))[0].tolist() == [0.0, 3e4]  # exp overflows


def test_stack_table_follows_swapped_modules(tmp_path, monkeypatch):
    """CpuLayerOps keeps the C stack's table of addresses between forwards; a layer module swapped after the first
    forward (here a down-projection with other weights, then a float one the stack cannot take) is seen: the
    logits match the module path's with the new module, and differ from the old ones."""
    from forerun.kernels import cpu_q4
    from forerun.models import quant
    from forerun.runtime.runner import Chunk

    if not cpu_q4.available():
        pytest.skip("needs the int4 kernel")
    hf = hf_model("qwen2", hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=300, num_hidden_layers=2)
    model = build_model(load_checkpoint(save(hf, tmp_path / "m")), "cpu", torch.float32, progress=False,
                        quantize="int4")
    runner = LLM.from_model(model, tiny_tokenizer(300), device="cpu").runner
    prompt = list(range(5, 25))

    def logits(seq):
        runner.kv.add_sequence(seq)
        out, _ = runner.forward([Chunk(seq, prompt, logits="all")])
        return out.logits

    def module_path(seq):
        with monkeypatch.context() as m:
            m.setattr(CpuLayerOps, "decoder_layers", lambda self, *a, **k: None)
            return logits(seq)

    with torch.inference_mode():
        before = logits(1)
        assert torch.equal(before, module_path(2))
        w = model.model.layers[1].mlp.down_proj.dequantized()
        model.model.layers[1].mlp.down_proj = quant.make_quantized_linear([2 * w], None, "int4")
        swapped = logits(3)
        assert not torch.equal(swapped, before) and torch.equal(swapped, module_path(4))
        dense = torch.nn.Linear(256, 128, bias=False)
        dense.weight.data.copy_(-w)
        model.model.layers[1].mlp.down_proj = dense
        dense_out = logits(5)
        assert not torch.equal(dense_out, swapped) and torch.equal(dense_out, module_path(6))
