"""The model layer against transformers: logits parity, ragged batches, tree masks, truncation."""
from __future__ import annotations

import pytest
import torch

from forerun.runtime.runner import Chunk
from tiny import hf_model, ours_from_hf

ARCHS = ["llama", "llama3", "qwen2", "qwen3", "mistral"]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_parity_with_transformers(arch):
    hf = hf_model(arch)
    runner = ours_from_hf(hf)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    runner.kv.add_sequence(0)
    out, _ = runner.forward([Chunk(0, ids[0].tolist(), logits="all")])
    assert rel_err(out.logits, ref) <= 1e-4
    # then decode 5 more tokens one at a time over the cache
    more = torch.randint(0, 97, (5,), generator=torch.Generator().manual_seed(2))
    full = torch.cat([ids[0], more])
    with torch.no_grad():
        ref2 = hf(full[None]).logits[0, 40:]
    got = torch.stack([runner.forward([Chunk(0, [int(t)])])[0].logits[0] for t in more])
    assert rel_err(got, ref2) <= 1e-4


def test_ragged_batch_equals_alone():
    hf = hf_model("qwen3")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (7, 1, 23, 12)]
    alone = []
    for i, p in enumerate(prompts):
        r = ours_from_hf(hf)
        r.kv.add_sequence(i)
        alone.append(r.forward([Chunk(i, p, logits="all")])[0].logits)
    runner = ours_from_hf(hf)
    for i in range(len(prompts)):
        runner.kv.add_sequence(i)
    out, starts = runner.forward([Chunk(i, p, logits="all") for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        torch.testing.assert_close(out.logits[starts[i] : starts[i] + len(p)], alone[i], rtol=1e-5, atol=1e-5)
    # a decode step of mixed query lengths over the cached prefixes
    steps = [[5], [6, 7, 8], [9, 10], [11]]
    out2, starts2 = runner.forward([Chunk(i, s, logits="all") for i, s in enumerate(steps)])
    for i, (p, s) in enumerate(zip(prompts, steps)):
        with torch.no_grad():
            ref = hf(torch.tensor([p + s])).logits[0, len(p):]
        assert rel_err(out2.logits[starts2[i] : starts2[i] + len(s)], ref) <= 1e-4


def test_tree_mask_equals_each_branch():
    hf = hf_model("llama")
    prefix = list(range(3, 15))
    # tree: node0 (root) -> 1, 2 ; 1 -> 3 ; 2 -> 4, 5 ; 3 -> 6
    parent = [-1, 0, 0, 1, 2, 2, 3]
    tokens = [20, 21, 22, 23, 24, 25, 26]
    n = len(parent)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
        depth[i] = 0 if parent[i] < 0 else depth[parent[i]] + 1
    runner = ours_from_hf(hf)
    runner.kv.add_sequence(0)
    runner.forward([Chunk(0, prefix, logits="none")])
    out, _ = runner.forward([Chunk(0, tokens, positions=[len(prefix) + d for d in depth], tree_mask=mask, logits="all")])
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parent[j]
        with torch.no_grad():
            ref = hf(torch.tensor([prefix + path])).logits[0, -1]
        assert rel_err(out.logits[i], ref) <= 1e-4, i


def test_truncate_then_continue():
    hf = hf_model("qwen2")
    runner = ours_from_hf(hf)
    runner.kv.add_sequence(0)
    runner.forward([Chunk(0, list(range(10, 30)), logits="none")])
    runner.forward([Chunk(0, [50, 51, 52, 53, 54, 55], logits="none")])  # speculative writes, then rejected
    runner.kv.truncate(0, 21)  # keep the first of them
    got = runner.forward([Chunk(0, [60, 61], logits="all")])[0].logits
    fresh = ours_from_hf(hf)
    fresh.kv.add_sequence(0)
    want = fresh.forward([Chunk(0, list(range(10, 30)) + [50, 60, 61], logits="all")])[0].logits[-2:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_early_exit_and_hidden_states():
    hf = hf_model("llama")
    runner = ours_from_hf(hf)
    runner.kv.add_sequence(0)
    ids = list(range(5, 25))
    out, _ = runner.forward([Chunk(0, ids, logits="all")], num_layers=2, hidden_layers=(0, 1))
    with torch.no_grad():
        h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        ref = hf.lm_head(hf.model.norm(h[2]))[0]
    assert rel_err(out.logits, ref) <= 1e-4
    assert rel_err(out.hidden_states[0], h[1][0]) <= 1e-4


def test_prompt_longer_than_context_raises():
    hf = hf_model("llama", max_position_embeddings=32)
    runner = ours_from_hf(hf)
    runner.kv.add_sequence(0)
    with pytest.raises(ValueError, match="exceed the context"):
        runner.forward([Chunk(0, list(range(40)))])


def test_packed_cpu_linears_match():
    from forerun.models.cpu_linear import pack_linears, packing_available

    if not packing_available():
        pytest.skip("no oneDNN in this torch build")
    hf = hf_model("qwen2")
    plain, packed = ours_from_hf(hf), ours_from_hf(hf)
    assert pack_linears(packed.model) == 3 * 4 + 1  # qkv, o, gate_up, down per layer + the head (a copy when tied)
    ids = list(range(3, 40))
    for r in (plain, packed):
        r.kv.add_sequence(0)
    a = plain.forward([Chunk(0, ids, logits="all")])[0].logits
    b = packed.forward([Chunk(0, ids, logits="all")])[0].logits
    assert rel_err(b, a) <= 1e-5


def test_a_product_that_adds_the_residual_itself_changes_nothing():
    """LayerOps.linear_add may add the residual in the product and return (the sum, None) (the CUDA int4 kernels
    do, FusedLayerOps.split_norms): a forward whose o and down products do so gives the same logits, bit for bit,
    as the default (the add left to the norm after), and the same hidden states of the layers asked for."""
    from forerun.models.ops import LayerOps

    class Adding(LayerOps):
        def __init__(self):
            self.adds = 0

        def linear_add(self, x, layer, residual):
            if residual is None:
                return super().linear_add(x, layer, residual)
            self.adds += 1
            return self.linear(x, layer) + residual, None

        def norm_mlp(self, x, residual, norm, mlp):  # down through linear_add too: a layer returns (x, None)
            h, s = self.add_rmsnorm(x, residual, norm)
            return self.linear_add(mlp.activation(mlp.gate_up_proj(h)), mlp.down_proj, s)

    hf = hf_model("qwen3", num_hidden_layers=3)
    runner = ours_from_hf(hf)
    prompt = torch.randint(2, 97, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    outs = []
    for ops in (LayerOps(), Adding()):
        runner.model.ops = ops
        runner.kv.add_sequence(0)
        got = [runner.forward([Chunk(0, prompt, logits="all")], hidden_layers=(0, 2))]
        got.append(runner.forward([Chunk(0, [7], logits="last")], hidden_layers=(1,)))
        runner.kv.free(0)
        outs.append(got)
    assert runner.model.ops.adds == 2 * 3 * 2
    for (ref, _), (out, _) in zip(*outs):
        assert torch.equal(ref.logits, out.logits)
        assert ref.hidden_states.keys() == out.hidden_states.keys()
        for i in ref.hidden_states:
            assert torch.equal(ref.hidden_states[i], out.hidden_states[i])
