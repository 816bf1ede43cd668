"""benchmarks/serve_gpu.py --tiny: the H200 serving benchmark's code path on this CPU (tiny random models, the
real server in-process, benchmarks/serve.py's load generator as a client process)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serve_gpu_tiny_end_to_end(tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "serve_gpu.py"), "--tiny", "--out", str(tmp_path),
           "--name", "t", "--concurrency", "1,4", "--requests", "2", "--requests-per-client", "1",
           "--max-tokens", "12", "--poisson-rate", "8", "--poisson-requests", "4", "--configs", "plain,k4"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.load(open(tmp_path / "t.json"))
    assert list(res["runs"]) == ["plain", "k=4, synthetic a=0.8"] and res["problems"] == []
    for name, run in res["runs"].items():
        assert run["clean_shutdown"] and not run["engine_dead"]
        assert run["kv_blocks_free_after"] == run["kv_blocks_total"]
        levels = run["levels"] + [run["poisson"]]
        assert [lv["concurrency"] for lv in run["levels"]] == [1, 4]
        for lv in levels:
            assert lv["ok"] == lv["requests"] > 0 and lv["timeouts"] == 0
            assert lv["completion_tokens"] == 12 * lv["requests"] == lv["text_chars"]  # one character per token
            assert lv["ttft_p50_s"] > 0 and lv["tpot_p50_s"] > 0 and lv["throughput_tok_s"] > 0
            assert (lv["acceptance_rate"] is None) == (name == "plain")
    assert set(res["speedup_throughput_vs_plain"]["k=4, synthetic a=0.8"]) == {"1", "4", "poisson"}
    assert "k=4, synthetic a=0.8" in p.stdout and "TPOT p50" in p.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "t.png").stat().st_size > 0
