"""benchmarks/q4_step_timeline_gpu.py off the GPU: kernels named by their role in a layer, and each kernel's share of
the critical path (its end minus the end before), which add up to the step, on hand-made kernel records."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from q4_step_timeline_gpu import analyse, label  # noqa: E402

LAYER = ["q4c_gemv", "_qk_norm_rope_store_kernel", "_paged_attention_kernel", "_merge_splits_kernel", "q4c_gemv",
         "_add_rmsnorm_kernel", "q4c_gemv", "q4c_gemv", "_add_rmsnorm_kernel"]


def _step(layers=2, fused=False):
    names = ["embedding_kernel"]
    for _ in range(layers):
        names += ([n for n in LAYER if n not in ("_qk_norm_rope_store_kernel", "_paged_attention_kernel",
                                                   "_merge_splits_kernel")][:1] + ["fused_decode_attention"]
                  + LAYER[4:]) if fused else LAYER
    names.append("q4c_gemv")  # the head
    ks, t = [], 0.0
    for i, n in enumerate(names):  # each kernel starts 300 ns before the one before it ends (PDL), runs 1-2 us
        dur = 1000.0 + 100 * (i % 7)
        start = t - 300 if i else 0.0
        ks.append(dict(name=n, start=start, end=start + dur))
        t = start + dur
    return ks


def test_kernels_are_named_by_their_role():
    names = label(_step(2))
    assert names[:10] == ["embedding_kernel", "qkv", "q/k norm + rope + cache", "attention", "merge", "o",
                          "add + rmsnorm", "gate/up", "down", "add + rmsnorm"]
    assert names[-1] == "head" and names.count("qkv") == 2 and names.count("down") == 2
    assert label(_step(1, fused=True))[1:4] == ["qkv", "fused attention", "o"]


def test_shares_add_up_to_the_step_and_pdl_overlap_is_counted():
    calls = [_step(3), _step(3)]
    res = analyse(calls)
    ks = calls[0]
    step_us = (max(k["end"] for k in ks) - ks[0]["start"]) / 1e3
    assert abs(res["step_us"] - step_us) < 1e-9
    assert abs(sum(r["step_share_us"] for r in res["kinds"].values()) - step_us) < 1e-6
    assert res["kinds"]["qkv"]["count"] == 3 and res["kinds"]["add + rmsnorm"]["count"] == 6
    assert abs(res["kinds"]["o"]["starts_before"] - 0.3) < 1e-9  # each started 300 ns before the one before ended
    r = res["kinds"]["attention"]
    assert abs(r["ends_after"] - (r["duration"] - 0.3)) < 1e-9
