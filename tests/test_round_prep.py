"""forerun/kernels/round_prep.py (a queued tree verify step's inputs in one launch) against its torch ops
(`verify_inputs_torch`, what the CPU runs and what TreeRound ran before session 48), on the CPU under Triton's
interpreter or on CUDA: random verdicts (accepted counts, bonus tokens in a packed verdict's strided views), roots,
block tables of several widths and block sizes, depths and masks from random trees, buffers wider than the step and
holding stale values, trees of 2..17 nodes (the kernel pads to a power of two)."""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
from forerun.kernels.round_prep import extend_inputs, extend_inputs_torch, verify_inputs, verify_inputs_torch  # noqa: E402,E501
from forerun.verify import tree_attention_mask  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


def _case(g, b, n, bs, max_blocks, max_q):
    acc = torch.randint(0, min(n, 5), (b,), generator=g)
    packed = torch.randint(0, 50000, (b, 2 + 2 * n), generator=g)  # a packed verdict: [a, nodes..., tokens...]
    packed[:, 0] = acc
    out_tokens, num_accepted = packed[:, 1 + n: 1 + 2 * n], packed[:, 0]  # strided views, as the verdict's
    roots = torch.randint(1, 300, (b,), generator=g)
    need = (roots + acc + 1 + n + bs - 1) // bs  # blocks the step's positions reach
    w = min(max_blocks, int(need.max()) + int(torch.randint(0, 3, (1,), generator=g)))
    assert int(need.max()) <= w
    table = torch.randint(1, 1000, (b, w), generator=g)
    stage = torch.cat([roots, table.reshape(-1)])
    parents = []
    for _ in range(b):
        parents.append([-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, n)])
    par = torch.tensor(parents)
    mask = tree_attention_mask(par.reshape(-1), torch.arange(b) * n, torch.full((b,), n), n).view(b, n, n)
    depth = mask.sum(-1) - 1
    tree_tokens = torch.randint(0, 50000, (b, n + 3), generator=g)
    wide = lambda: dict(  # noqa: E731  (the graph's buffers: wider than the step, stale values in them)
        input_ids=torch.randint(0, 9, (b * n + 7,), generator=g), positions=torch.randint(0, 9, (b * n + 7,), generator=g),
        slot_mapping=torch.randint(0, 9, (b * n + 7,), generator=g), seq_lens=torch.randint(0, 9, (b + 3,), generator=g),
        query_start_loc=torch.randint(0, 9, (b + 4,), generator=g),
        block_tables=torch.randint(0, 9, (b + 2, max_blocks), generator=g),
        tree_rows=torch.randint(0, 2, (b * n + 7, max_q), generator=g).bool())
    bufs = wide()
    return (out_tokens, num_accepted, stage, tree_tokens[:, : n + 1], depth, mask, bs), bufs


@pytest.mark.parametrize("b,n,bs,max_blocks", [(1, 2, 16, 32), (3, 5, 4, 300), (4, 16, 16, 40), (2, 17, 8, 64),
                                               (5, 9, 1, 2100)])
def test_kernel_writes_what_the_torch_ops_write(b, n, bs, max_blocks):
    g = torch.Generator().manual_seed(1000 * b + n)
    args, bufs = _case(g, b, n, bs, max_blocks, 20)
    ref = {k: v.clone().to(DEV) for k, v in bufs.items()}
    got = {k: v.clone().to(DEV) for k, v in bufs.items()}
    dargs = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
    s_ref = verify_inputs_torch(*dargs, **ref)
    s_got = verify_inputs(*dargs, **got)
    assert torch.equal(s_ref, s_got)
    for k in bufs:
        assert torch.equal(ref[k], got[k]), k
    # and what the step means: node j's slot is its cache position ctx + j through the table; rows past the step
    # and the block tables' rows past B untouched
    out_tokens, acc, stage = args[0], args[1], args[2]
    ctx = stage[:b] + acc + 1
    t = b * n
    assert torch.equal(got["input_ids"][:t].view(b, n)[:, 0].cpu(), out_tokens.gather(1, acc[:, None])[:, 0])
    assert torch.equal(got["seq_lens"][:b].cpu(), ctx + n)
    assert torch.equal(got["input_ids"][t:].cpu(), bufs["input_ids"][t:])
    assert torch.equal(got["block_tables"][b:].cpu(), bufs["block_tables"][b:])
    assert torch.equal(got["tree_rows"][:, n:].cpu(), bufs["tree_rows"][:, n:])


@pytest.mark.parametrize("b,n,s,f,w", [(1, 2, 1, 8, 1), (3, 16, 4, 40, 7), (4, 9, 3, 4096 + 5, 20), (2, 5, 4, 16, 3)])
def test_extend_kernel_writes_what_the_torch_ops_write(b, n, s, f, w):
    g = torch.Generator().manual_seed(100 * b + 10 * s + n)
    acc = torch.stack([torch.randint(0, s + 1, (1,), generator=g)[0] for _ in range(b)])
    acc[0] = s  # (a whole path: the bonus token in the last row)
    nodes = torch.full((b, n), -1, dtype=torch.long)
    for i in range(b):
        a = int(acc[i])
        nodes[i, : a + 1] = torch.tensor([0] + sorted(torch.randperm(n - 1, generator=g)[:a].add(1).tolist()))
    packed = torch.randint(0, 50000, (b, 2 + 2 * n), generator=g)  # strided views of a packed verdict
    packed[:, 0], packed[:, 1: 1 + n] = acc, nodes
    verdict = dict(num_accepted=packed[:, 0], accepted_nodes=packed[:, 1: 1 + n], out_tokens=packed[:, 1 + n: 1 + 2 * n])
    tree_tokens = torch.randint(0, 50000, (b, n), generator=g)
    roots = torch.randint(1, 500, (b,), generator=g)
    stage = torch.cat([roots, roots - 1, torch.randint(0, 900, (b * w,), generator=g)])
    prev = torch.randn(b, f, generator=g).to(torch.bfloat16)
    feats = torch.randn(b, s + 1, f, generator=g).to(torch.bfloat16)
    qe = s + 2
    bufs = dict(ids=torch.randint(0, 9, (b * qe + 5,), generator=g), rows=torch.randn(b * qe + 5, f, generator=g).to(
        torch.bfloat16), lo=torch.randint(0, 9, (b + 2,), generator=g), nlast=torch.randint(0, 9, (b + 2,), generator=g),
        ctx=torch.randint(0, 9, (b + 2,), generator=g), tables=torch.randint(0, 9, (b + 2, w + 3), generator=g))
    ref = {k: v.clone().to(DEV) for k, v in bufs.items()}
    got = {k: v.clone().to(DEV) for k, v in bufs.items()}
    args = [x.to(DEV) for x in (tree_tokens, verdict["accepted_nodes"], verdict["out_tokens"], verdict["num_accepted"],
                                stage, prev, feats)]
    extend_inputs_torch(*args, **ref)
    extend_inputs(*args, **got)
    for k in bufs:
        assert torch.equal(ref[k], got[k]), k
    # what the rows mean: request i's ids are the path's tokens, then the bonus token at row a_i + 1
    ids = got["ids"][: b * qe].view(b, qe).cpu()
    for i in range(b):
        a = int(acc[i])
        assert ids[i, : a + 1].tolist() == tree_tokens[i, nodes[i, : a + 1]].tolist()
        assert int(ids[i, a + 1]) == int(verdict["out_tokens"][i, a])
    assert torch.equal(got["rows"][: b * qe].view(b, qe, f)[:, 0].cpu(), prev)
    assert torch.equal(got["nlast"][:b].cpu(), acc + 1) and torch.equal(got["ctx"][:b].cpu(), roots + acc + 1)
    assert torch.equal(got["ids"][b * qe:].cpu(), bufs["ids"][b * qe:])


def _variants(kernel) -> int | None:
    caches = getattr(kernel, "device_caches", None)
    return None if caches is None else sum(len(c[0]) for c in caches.values())


@pytest.mark.skipif(not CUDA, reason="compiled kernels: CUDA only")
def test_the_kernels_compile_once_across_batches_and_table_widths():
    """No integer argument is specialised on and no block size follows the live table width: batches of 1..4 and
    block tables of ~10..40 blocks (a value of 1 or a multiple of 16, or a new power of two, would otherwise compile
    a variant of its own in the middle of serving, the GPU idle meanwhile) add at most one compiled variant each."""
    from forerun.kernels import round_prep

    before = _variants(round_prep._verify_inputs_kernel), _variants(round_prep._extend_inputs_kernel)
    if None in before:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    g = torch.Generator().manual_seed(7)
    for b, bs in [(1, 16), (2, 8), (3, 16), (4, 8), (4, 32)]:  # (tables of ~10..40 blocks)
        args, bufs = _case(g, b, 16, bs, 64, 20)
        verify_inputs(*[a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args],
                      **{k: v.to(DEV) for k, v in bufs.items()})
    for b, w in [(1, 3), (2, 15), (3, 16), (4, 17), (4, 33)]:
        s, f, qe = 3, 64, 5
        nodes = torch.full((b, 8), -1, dtype=torch.long)
        nodes[:, 0] = 0
        stage = torch.cat([torch.full((b,), 40), torch.full((b,), 39), torch.randint(0, 99, (b * w,), generator=g)])
        extend_inputs(torch.randint(0, 99, (b, 8), generator=g).to(DEV), nodes.to(DEV),
                      torch.randint(0, 99, (b, 8), generator=g).to(DEV), torch.zeros(b, dtype=torch.long, device=DEV),
                      stage.to(DEV), torch.zeros(b, f, device=DEV), torch.zeros(b, s + 1, f, device=DEV),
                      torch.zeros(64 * qe, dtype=torch.long, device=DEV), torch.zeros(64 * qe, f, device=DEV),
                      *[torch.zeros(64, dtype=torch.long, device=DEV) for _ in range(3)],
                      torch.zeros(64, 48, dtype=torch.long, device=DEV))
    after = _variants(round_prep._verify_inputs_kernel), _variants(round_prep._extend_inputs_kernel)
    assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1, (before, after)
