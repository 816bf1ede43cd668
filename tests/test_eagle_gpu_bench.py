"""benchmarks/eagle_gpu.py --tiny: the H200 EAGLE benchmark's code path on this CPU (tiny random target and head,
the engine's TreeRound with synthetic acceptance). Guards what its numbers mean: every tree is drafted at the
shape asked for (until session 25 the script's RoundItem(k=1) let the engine cut every tree to one draft), the
expected tokens per round follow from those trees, and --profile / the PNG work."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_eagle_gpu_tiny_drafts_whole_trees(tmp_path):
    out = tmp_path / "e.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "eagle_gpu.py"), "--tiny", "--batches", "1,3",
           "--trees", "3,3,8;1,3,4", "--rounds", "3", "--profile", "--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "WARNING" not in p.stdout
    res = json.load(open(out))
    assert {(r["batch"], r["nodes"]) for r in res["trees"]} == {(1, 8), (3, 8), (1, 4), (3, 4)}
    for r in res["trees"]:
        assert r["nodes_per_tree"] == r["nodes"]
        # a = 0.8 at the first rank: a tree of 4 or 8 nodes expects well over the 1.8 tokens of a one-draft tree
        assert r["expected_tokens_per_round"] > 2.2 and r["tokens_per_round"] >= 1.0
    assert {p_["what"] for p_ in res["profiles"]} == {"propose_tree", "tree_round"}
    assert all(p_["wall_us"] > 0 and p_["host_ops"] for p_ in res["profiles"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "e.png").stat().st_size > 0
