"""Seed 000's batched layout: the request A/B table row for row, counters, bitmasks, golden, force top-k."""
from __future__ import annotations

import pytest
import torch

from forerun.verify import unpack_bitmask, verify_chain
from forerun.verify.layout import accept_prefix, chain_rows, columns_to_vocab, step_counters, vocab_to_columns
from test_verify_common import DEVICES, const_sampling, emitted, random_chain_batch

T_, F_ = True, False
V = 32


def _seed_table_batch(device="cpu"):
    """Requests A (6 rows, accepts d1 d2) and B (4 rows, accepts all 3) as a greedy batch whose target
    argmax gives exactly the seed's raw accept column: T T F T F T | T T T T."""
    drafts = torch.tensor([11, 12, 13, 14, 15, -1, 21, 22, 23, -1])
    argmax = torch.tensor([11, 12, 7, 14, 9, 5, 21, 22, 23, 30])  # rows 2 and 4 disagree; row 3 agrees
    logits = torch.nn.functional.one_hot(argmax, V).float() * 4
    return dict(target_logits=logits.to(device), draft_token_ids=drafts.to(device),
                first_token_positions=torch.tensor([0, 6], dtype=torch.int32, device=device),
                seqlens_q=torch.tensor([6, 4], dtype=torch.int32, device=device),
                sampling=const_sampling(2, temperature=0.0, device=device),
                uniforms=torch.rand(10, 2, device=device), rule="greedy", nextn=5)


@pytest.mark.parametrize("device", DEVICES)
def test_seed_000_request_a_b_table_row_for_row(device):
    r = verify_chain(**_seed_table_batch(device))
    assert r.row_to_req.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert r.local_step.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert r.is_verify.tolist() == [T_, T_, T_, T_, T_, F_, T_, T_, T_, F_]
    assert r.raw_accept.tolist() == [T_, T_, F_, T_, F_, T_, T_, T_, T_, T_]
    assert r.blocked.tolist() == [F_, F_, T_, F_, T_, T_, F_, F_, F_, T_]
    assert r.alive.tolist() == [T_, T_, T_, F_, F_, F_, T_, T_, T_, T_]
    assert r.accepted_mask.tolist() == [T_, T_, F_, F_, F_, F_, T_, T_, T_, F_]
    assert r.is_final.tolist() == [F_, F_, T_, F_, F_, F_, F_, F_, F_, T_]
    assert r.last_valid_offset.tolist() == [2, 3]
    assert r.sampled_token_ids.tolist() == [7, 30]  # r_A: target's token at row 2; bonus_B: row 9
    assert r.verified_token_ids.tolist() == [11, 12, -1, -1, -1, -1, 21, 22, 23, -1]
    assert r.num_generated_tokens.tolist() == [2, 2, 1, 0, 0]
    assert r.num_verified_tokens.tolist() == [2, 2, 2, 1, 1]
    assert emitted(r) == [[11, 12, 7], [21, 22, 23, 30]]  # A gets 3 tokens, B gets 4
    assert r.output_token_ids.shape == (2, 6) and r.output_token_ids[0, 3:].tolist() == [-1, -1, -1]
    assert r.draft_tok.tolist() == [6, 4] and r.accept_tok.tolist() == [3, 4]


def test_layout_functions_on_the_seed_table():
    ftp, seqlens = torch.tensor([0, 6]), torch.tensor([6, 4])
    row_to_req, local_step, is_verify = chain_rows(ftp, seqlens, 10)
    raw = torch.tensor([T_, T_, F_, T_, F_, T_, T_, T_, T_, T_])
    acc = accept_prefix(raw, is_verify, row_to_req, ftp)
    assert acc.num_accepted.tolist() == [2, 3] and acc.final_row.tolist() == [2, 9]
    gen, ver = step_counters(local_step, acc.accepted, is_verify, nextn=5)
    assert gen.tolist() == [2, 2, 1, 0, 0] and ver.tolist() == [2, 2, 2, 1, 1]
    gen, ver = step_counters(local_step, acc.accepted, is_verify, nextn=2)  # steps >= 1 pile into slot 1
    assert gen.tolist() == [2, 3] and ver.tolist() == [2, 6]


def test_chain_rows_with_shuffled_request_blocks():
    ftp, seqlens = torch.tensor([5, 0, 3]), torch.tensor([1, 3, 2])
    row_to_req, local_step, is_verify = chain_rows(ftp, seqlens, 6)
    assert row_to_req.tolist() == [1, 1, 1, 2, 2, 0]
    assert local_step.tolist() == [0, 1, 2, 0, 1, 0]
    assert is_verify.tolist() == [T_, T_, F_, T_, F_, F_]


def test_unpack_bitmask_xgrammar_convention():
    g = torch.Generator().manual_seed(0)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 2), generator=g, dtype=torch.int64).to(torch.int32)
    allowed = unpack_bitmask(mask, 40)
    for i in range(3):
        for t in range(40):
            assert bool(allowed[i, t]) == bool((int(mask[i, t // 32]) >> (t % 32)) & 1)


def _bitmask_allowing(tokens_per_row: list[list[int]], vocab: int) -> torch.Tensor:
    words = torch.zeros(len(tokens_per_row), (vocab + 31) // 32, dtype=torch.int64)
    for i, toks in enumerate(tokens_per_row):
        for t in toks:
            words[i, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def test_step_bitmasks_apply_to_row_ftp_plus_k_before_verification():
    b = _seed_table_batch()
    logits_before = b["target_logits"].clone()
    # step 1: request B may only emit 5 or 22 -> row 7 keeps 22 (accepted); request A may only emit 3 -> row 1
    # loses 12 (its draft) and emits 3. step 3: request B only 4 -> bonus row 9 emits 4.
    # step 4: request B has no row 4, its mask is skipped (request A's row 4 keeps only 15, its draft)
    masks = [None, (torch.tensor([1, 0]), _bitmask_allowing([[5, 22], [3]], V)),
             None, (torch.tensor([1]), _bitmask_allowing([[4]], V)),
             (torch.tensor([1, 0]), _bitmask_allowing([[0], [15]], V))]
    r = verify_chain(**b, token_bitmasks=masks)
    assert emitted(r) == [[11, 3], [21, 22, 23, 4]]
    assert torch.equal(b["target_logits"], logits_before), "caller's logits must not be modified"
    full = (torch.tensor([0]), _bitmask_allowing([[]], V))  # a request whose row allows nothing
    with pytest.raises(ValueError, match=r"request 0\) is fully masked"):
        verify_chain(**b, token_bitmasks=[full])


def test_golden_override_forces_tokens():
    b = _seed_table_batch()
    golden = torch.tensor([-1, 12, 13, -1, -1, -1, -1, 9, -1, -1])
    r = verify_chain(**b, golden_token_ids=golden)
    # A: row 2 forced to 13 = its draft -> accepted although the target disagrees; row 3 accepts (argmax),
    # row 4 rejects. B: row 7 forced to 9 != draft 22 -> rejected, final token forced to 9.
    assert emitted(r) == [[11, 12, 13, 14, 9], [21, 9]]


def test_force_topk_columns_match_the_full_vocabulary_path():
    g = torch.Generator().manual_seed(4)
    b = random_chain_batch(g, vocab=30)
    rows, vocab, k = b["target_logits"].shape[0], 30, 8
    # columns in vocabulary order, so that inverse-CDF sampling walks the tokens in the same order
    topk_index = torch.stack([torch.randperm(vocab, generator=g)[:k].sort().values for _ in range(rows)])
    cols_logits = b["target_logits"].gather(1, topk_index)
    full_logits = torch.full((rows, vocab), float("-inf")).scatter(1, topk_index, cols_logits)
    draft_cols = torch.rand(rows, k, generator=g)
    draft_cols /= draft_cols.sum(-1, keepdim=True)
    draft_full = torch.zeros(rows, vocab).scatter(1, topk_index, draft_cols)
    picks = columns_to_vocab(torch.multinomial(draft_cols, 1, generator=g).squeeze(1), topk_index)
    drafts = torch.where(b["draft_token_ids"] >= 0, picks, -1)
    drafts[::5] = torch.where(drafts[::5] >= 0, 29 - drafts[::5], -1)  # some drafts outside the top-k
    common = dict(first_token_positions=b["first_token_positions"], seqlens_q=b["seqlens_q"],
                  sampling=b["sampling"], uniforms=b["uniforms"], logprobs=2)
    for rule in ("greedy", "auto"):
        a = verify_chain(cols_logits, drafts, draft_probs=draft_cols, topk_index=topk_index, rule=rule, **common)
        want = verify_chain(full_logits, drafts, draft_probs=draft_full, rule=rule, **common)
        assert emitted(a) == emitted(want)
        assert a.logprobs.top_ids.tolist() == want.logprobs.top_ids.tolist()
        torch.testing.assert_close(a.logprobs.token_logprobs, want.logprobs.token_logprobs, equal_nan=True)
    assert vocab_to_columns(torch.tensor([topk_index[0, 3], -1]), topk_index[:2]).tolist() == [3, -1]


def test_logprobs_of_emitted_tokens_raw_and_processed():
    g = torch.Generator().manual_seed(5)
    b = random_chain_batch(g)
    for mode in ("raw", "processed"):
        r = verify_chain(**b, logprobs=3, logprobs_mode=mode)
        if mode == "raw":
            source = b["target_logits"].log_softmax(-1)
        else:
            source = b["sampling"].probs(b["target_logits"], r.row_to_req).log()
        for i, toks in enumerate(emitted(r)):
            for j, t in enumerate(toks):
                row = int(b["first_token_positions"][i]) + j
                torch.testing.assert_close(r.logprobs.token_logprobs[i, j], source[row, t])
                assert r.logprobs.top_ids[i, j].tolist() == source[row].topk(3).indices.tolist()
            assert r.logprobs.token_logprobs[i, len(toks):].isnan().all()
