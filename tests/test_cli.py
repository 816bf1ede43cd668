"""The command line: one-line errors, exit code 2 for usage errors, nothing loaded before the checks (issue 10: 8-11)."""
from __future__ import annotations

import json

import subprocess
import sys
import types

import pytest

from forerun import cli
from forerun.config import SpecConfig
from forerun.models import hub


def run(args, capsys):
    """forerun.cli.main in-process -> (exit code, stdout, stderr); a SystemExit counts as its code."""
    try:
        rc = cli.main(list(args))
    except SystemExit as e:  # pragma: no cover - main returns codes; kept so a regression shows as a failure
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything tries to load weights or download."""
    import forerun.models.registry as registry
    from forerun.models.loader import Checkpoint

    def boom(*a, **k):
        raise AssertionError("a model was loaded or downloaded before the command line was checked")

    monkeypatch.setattr(registry, "load_model", boom)
    monkeypatch.setattr(registry, "build_model", boom)
    monkeypatch.setattr(Checkpoint, "tensors", boom)
    monkeypatch.setattr(hub, "pip_download", boom)


USAGE = [
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens must be in [1,"),
    (["generate", "hi", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["generate", "hi", "--k", "-1"], "--k must be a non-negative integer or 'auto'"),
    (["generate", "hi", "--k", "x"], "--k must be a non-negative integer or 'auto'"),
    (["generate", "hi", "--tree", "a,b"], "--tree must be comma-separated positive integers"),
    (["generate", "hi", "--tree", "2,0"], "--tree must be comma-separated positive integers"),
    (["generate", "hi", "--confidence", "1.5"], "--confidence must be in [0, 1)"),
    (["generate", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'; known models:"),
    (["generate", "hi", "--model", "./nowhere/model.gguf"], "unknown model path './nowhere/model.gguf'"),
    (["generate", "hi", "--draft", "no-such-draft"], "unknown draft model 'no-such-draft'"),
    (["generate", "hi", "--top-k", str(2**70)], "--top-k must be in [-1,"),
    (["generate", "hi", "--seed", str(2**64)], "--seed must be in"),
    (["generate", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["generate", "hi", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["generate", "hi", "--rule", "fast"], "argument --rule: invalid choice: 'fast'"),
    (["generate", "hi", "--threads", "-2"], "--threads must be >= 0"),
    (["generate", "hi", "--device", "warp9"], "--device 'warp9'"),
    (["generate", "hi", "--device", "meta"], "--device 'meta': forerun runs on cpu and cuda only"),
    (["generate", "hi", "--device", "mps"], "--device 'mps': forerun runs on cpu and cuda only"),
    (["generate", ""], "a prompt is empty"),
    (["generate"], "the following arguments are required: prompt"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["models"], "required: mcmd"),
    (["models", "pull", "no-such-model"], "unknown model 'no-such-model'"),
    (["models", "verify", "no-such-model"], "unknown model 'no-such-model'"),
    (["models", "pull"], "the following arguments are required: NAME"),
    # flags that would do nothing in the chosen mode (issue 10: 10)
    (["generate", "hi", "--draft", "ngram", "--tree", "2,2"], "--tree works with a draft model only"),
    (["generate", "hi", "--draft", "early-exit:4", "--tree", "2"], "--tree works with a draft model only"),
    (["generate", "hi", "--tree", "2,2", "--rule", "greedy"], "--rule greedy does nothing with --tree"),
    (["generate", "hi", "--tree", "2,2", "--confidence", "0.3"], "--confidence does nothing with --tree"),
    (["generate", "hi", "--tree", "2,2", "--k", "3"], "--k does nothing with --tree"),
    (["generate", "hi", "--rule", "greedy", "--temperature", "0.8"], "rule 'greedy' decodes greedily"),
    (["generate", "hi", "--draft", "ngram", "--confidence", "0.5"], "--confidence does nothing with --draft ngram"),
    (["generate", "hi", "--draft", "none", "--k", "3"], "--k does nothing with --draft none"),
    (["generate", "hi", "--draft", "none", "--tree", "2"], "need(s) a drafter"),
    (["generate", "hi", "--draft", "none", "--compare-plain"], "--compare-plain does nothing with --draft none"),
    (["generate", "hi", "--draft", "early-exit:x"], "early-exit:N needs a positive layer count"),
    (["generate", "hi", "--model", "smollm2-135m-instruct", "--tree", "2,2"], "no known compatible draft"),
    # sampling flags at temperature 0, drafting flags where nothing drafts, EAGLE flags that do nothing
    (["generate", "hi", "--top-p", "0.5", "--seed", "3"], "--top-p, --seed do(es) nothing at --temperature 0"),
    (["generate", "hi", "--min-p", "0.1"], "--min-p do(es) nothing at --temperature 0"),
    (["generate", "hi", "--draft", "none", "--rule", "typical"], "--rule need(s) a drafter"),
    (["generate", "hi", "--draft", "ngram", "--k", "0", "--rule", "typical"], "--rule do(es) nothing with --k 0"),
    (["generate", "hi", "--draft", "ngram", "--k", "0", "--compare-plain"], "--compare-plain does nothing with --k 0"),
    (["generate", "hi", "--draft", "eagle:/tmp", "--confidence", "0.5"], "--confidence with --draft eagle:DIR needs --tree"),
    (["generate", "hi", "--draft", "eagle:/tmp", "--tree", "4,4,16", "--confidence", "1.5"], "--confidence must be in [0, 1)"),
    (["bench", "--drafters", "eagle", "--eagle-trees", "3,4,12@1.5"], "confidence (after @) must be in (0, 1)"),
    (["bench", "--drafters", "eagle", "--eagle-trees", "3,4,12@x"], "confidence (after @) must be in (0, 1)"),
    (["generate", "hi", "--draft", "eagle:/tmp", "--tree", "4,4,16", "--k", "3"], "--k does nothing with --tree"),
    (["generate", "hi", "--draft", "eagle:/tmp", "--tree", "4,4,16", "--rule", "typical"], "does nothing with --tree"),
    (["generate", "hi", "--draft", "eagle:/tmp"], "is not an EAGLE head folder (no config.json"),
    # the subcommands with parsers of their own: argparse's errors are one line too (no usage block)
    (["bench", "--no-such-flag"], "unrecognized arguments: --no-such-flag (see `forerun bench --help`)"),
    # bench: judged before its models load (they used to fail with KeyError / ValueError after loading)
    (["bench", "--drafters", "foo"], "--drafters takes distinct names from draft, early-exit, ngram, eagle"),
    (["bench", "--drafters", "ngram,ngram"], "--drafters takes distinct names"),
    (["bench", "--ks", "2,-1"], "--ks / --eagle-ks: must be a non-negative integer"),
    (["bench", "--num-prompts", "0"], "--num-prompts must be in [1, 20]"),
    (["bench", "--num-prompts", "500"], "--num-prompts must be in [1, 20]"),
    (["bench", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["bench", "--threads", "-1"], "--threads must be >= 0"),
    (["bench", "--drafters", "ngram", "--early-exit-layers", "3"], "--early-exit-layers do(es) nothing in this run"),
    (["bench", "--eagle-ks", "9"], "--eagle-ks do(es) nothing in this run"),
    (["bench", "--llamacpp-draft-max", "2"], "--llamacpp-draft-max do(es) nothing in this run"),
    (["bench", "--drafters", "ngram", "--draft-vocabs", "32768"], "--draft-vocabs do(es) nothing in this run"),
    (["bench", "--draft-vocabs", "0"], "--draft-vocabs takes positive token counts"),
    (["generate", "hi", "--draft", "ngram", "--draft-vocab", "1000"], "--draft-vocab works with a draft model only"),
    (["generate", "hi", "--draft", "early-exit:4", "--draft-vocab", "9"], "--draft-vocab works with a draft model only"),
    (["generate", "hi", "--draft-vocab", "0"], "--draft-vocab must be a positive token count"),
    (["bench", "--drafters", "eagle", "--eagle-head", "/nowhere"], "--drafters eagle: no EAGLE head in /nowhere"),
    (["serve", "m", "--port", "x"], "argument --port: invalid int value: 'x' (see `forerun serve --help`)"),
    (["serve"], "the following arguments are required: model"),
    (["train-eagle", "--out", "o"], "the following arguments are required: --target"),
]


@pytest.mark.parametrize("args, message", USAGE, ids=[" ".join(a)[:60] for a, _ in USAGE])
def test_usage_errors_are_one_line_with_exit_code_2(args, message, capsys, no_loading):
    rc, out, err = run(args, capsys)
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forerun: error: "), err
    assert message in lines[0]
    assert "Traceback" not in err and out == ""


def test_debug_shows_the_traceback(capsys, no_loading):
    with pytest.raises(cli.UsageError, match="unknown model"):
        cli.main(["--debug", "generate", "hi", "--model", "no-such-model"])
    with pytest.raises(cli.UsageError):
        cli.main(["generate", "hi", "--max-tokens", "0", "--debug"])


def test_failures_while_running_are_one_line_with_exit_code_1(capsys, monkeypatch):
    def fail(a):
        raise RuntimeError("out of something\nsecond line")

    monkeypatch.setattr(cli, "cmd_generate", fail)
    rc, _, err = run(["generate", "hi"], capsys)
    assert rc == 1 and err.strip() == ("forerun: error: RuntimeError: out of something | second line "
                                       "(run with --debug for the traceback)")
    with pytest.raises(RuntimeError):
        cli.main(["generate", "hi", "--debug"])


def test_the_installed_command_prints_no_traceback():
    """As a user runs it: a real process, stderr one line, exit code 2, before any model loads."""
    proc = subprocess.run([sys.executable, "-m", "forerun.cli", "generate", "hi", "--k", "x"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        "forerun: error: --k must be a non-negative integer or 'auto', got 'x'"]


# ---------------------------------------------------------------- the default draft fits the target (issue 10: 9)


def _checked(args):
    a = cli.build_parser().parse_args(["generate", "hi", *args])
    return cli._check_generate(a)


def test_default_draft_is_ngram_for_a_model_without_a_known_draft(no_loading):
    spec, _ = _checked(["--model", "smollm2-135m-instruct"])
    assert spec.method == "ngram" and spec.adaptive


def test_default_draft_for_the_default_model_is_its_known_draft(monkeypatch, no_loading):
    pairs = []
    monkeypatch.setattr(cli, "_check_pair", lambda m, d: pairs.append((m, d)))
    spec, _ = _checked([])
    assert spec.method == "draft" and spec.draft_model == "qwen2.5-coder-0.5b-instruct"
    assert pairs == [("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")]  # checked before any load


def test_incompatible_draft_is_refused_before_any_weights(capsys, no_loading, monkeypatch):
    """The issue's reproduction: SmolLM2 target with the Qwen draft used to load the 0.5B model (40 s,
    6.7 GB) and then fail; now the headers decide, nothing loads. Needs the pulled files (no download)."""
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"):
        if not hub.is_cached(name):
            pytest.skip(f"{name} not pulled")
    monkeypatch.setattr(hub, "_verified_on_load", lambda *a: True)
    rc, _, err = run(["generate", "hi", "--model", "smollm2-135m-instruct", "--draft", "qwen2.5-coder-0.5b-instruct"],
                     capsys)
    assert rc == 2 and "does not fit this target: their tokenizers differ" in err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- stats name the tree (issue 10: 11)


def test_stats_label_names_the_tree_shape():
    tree = SpecConfig(method="draft", draft_model="m", tree=(2, 2, 1))
    assert cli.spec_label(tree) == "speculative (draft, tree 2x2x1 (10 nodes))"
    assert "k=auto" not in cli.spec_label(tree)
    assert cli.spec_label(SpecConfig(method="ngram", k=3)) == "speculative (ngram, k=3)"
    assert cli.spec_label(SpecConfig(method="ngram", adaptive=True)) == "speculative (ngram, k=auto (adaptive, k_max 8))"
    assert cli.spec_label(SpecConfig()) == "plain"
    cut = SpecConfig.from_flags("eagle:/h", None, 0.1, None, tree="3,4,12")  # an EAGLE tree with its cut
    assert cut.eagle_tree == (3, 4, 12) and cut.confidence_threshold == 0.1
    assert cli.spec_label(cut) == "speculative (eagle, tree 3,4,12, confidence 0.1)"
    assert cli.spec_label(SpecConfig.from_flags("eagle:/h", None, None, None, tree="4,4,16")) == \
        "speculative (eagle, tree 4,4,16)"
    with pytest.raises(ValueError, match="needs eagle_tree"):
        SpecConfig(method="eagle", eagle_head="/h", confidence_threshold=0.1)


# ---------------------------------------------------------------- subcommands with their own parsers


def test_serve_is_dispatched_lazily(monkeypatch):
    seen = []
    fake = types.ModuleType("forerun.server.cli")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "forerun.server.cli", fake)
    assert cli.main(["serve", "smollm2-135m-instruct", "--port", "0"]) == 0
    assert seen == [["smollm2-135m-instruct", "--port", "0"]]


def test_models_verify_is_a_subcommand(monkeypatch):
    seen = []
    monkeypatch.setattr(hub, "main_verify", lambda argv: seen.append(argv) or 0)
    assert cli.main(["models", "verify", "smollm2-135m-instruct"]) == 0
    assert seen == [["smollm2-135m-instruct"]]


def test_help_exits_0(capsys):
    rc, out, _ = run(["generate", "--help"], capsys)
    assert rc == 0 and "--draft" in out and "--debug" in out


@pytest.mark.parametrize("args, message", [
    (["--threads", "-1"], "--threads must be >= 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--intermediate", "0"], "--intermediate must be >= 1"),
    (["--wall-minutes", "0"], "--wall-minutes must be a finite number > 0"),
    (["--minutes", "-3"], "--minutes must be a finite number > 0"),
    (["--extra-data", "/nowhere/at/all"], "--extra-data /nowhere/at/all: no such folder"),
    (["--resume"], "holds no train_state.pt to resume from"),
    (["--restart-schedule"], "--restart-schedule works with --resume only"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--device", "bogus"], "--device 'bogus': not a device name"),
    (["--distill-batch", "4"], "--distill-batch works with --corpus distill only"),
    (["--corpus", "code", "--distill-minutes", "3"], "--distill-minutes works with --corpus distill only"),
    (["--distill-passes", "2"], "--distill-passes works with --corpus distill only"),
    (["--version", "1", "--draft-vocab", "8000"], "--draft-vocab is for EAGLE-3 heads"),
    (["--version", "1", "--train-lm-head"], "--train-lm-head is for EAGLE-3 heads"),
    (["--corpus", "distill", "--distill-batch", "0"], "--distill-batch must be >= 1"),
    (["--draft-vocab", "0"], "--draft-vocab must be >= 1"),
])
def test_train_eagle_flags_are_judged_before_anything_loads(args, message, capsys, no_loading, tmp_path):
    rc, out, err = run(["train-eagle", "--target", "smollm2-135m-instruct", "--out", str(tmp_path / "head"), *args],
                       capsys)
    assert rc == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_model_paths_that_are_not_checkpoints_are_usage_errors(tmp_path, capsys, no_loading):
    """A path that exists but holds no checkpoint is refused before anything loads, with exit code 2, for the
    target and the draft of generate and for serve."""
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    (tmp_path / "ggufs").mkdir()
    (tmp_path / "ggufs" / "m.gguf").write_bytes(b"GGUF")
    cases = [(tmp_path / "notes.txt", "notes.txt: not a checkpoint (expected a directory with config.json"),
             (tmp_path / "empty", "empty is not a Hugging Face checkpoint: no config.json"),
             (tmp_path / "ggufs", "no config.json (it has GGUF files ['m.gguf']: pass one of them instead)")]
    for path, message in cases:
        for args in (["generate", "hi", "--model", str(path)], ["generate", "hi", "--draft", str(path)],
                     ["serve", str(path)]):
            rc, out, err = run(args, capsys)
            assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, (args, rc, err)
            assert "Traceback" not in err and out == ""


def test_train_eagle_resume_refuses_flags_that_would_change_the_heads_shape(capsys, no_loading, tmp_path):
    """A resumed head keeps its draft vocabulary and MLP width: --draft-vocab / --intermediate naming others are
    refused (they would go unheard); the same values pass."""
    out = tmp_path / "head"
    out.mkdir()
    (out / "train_state.pt").write_bytes(b"")
    (out / "config.json").write_text(json.dumps({"draft_vocab_size": 16384, "intermediate_size": 4480}))
    base = ["train-eagle", "--target", "smollm2-135m-instruct", "--out", str(out), "--resume"]
    for args, message in ((["--draft-vocab", "8000"], "--draft-vocab 8000: the head in"),
                          (["--intermediate", "64"], "--intermediate 64: the head in")):
        rc, _, err = run(base + args, capsys)
        assert rc == 2 and message in err and "keeps its shape" in err and err.count("\n") == 1, err
    from forerun.eagle import train as T

    a = T.parse_flags(base[1:] + ["--draft-vocab", "16384", "--intermediate", "4480"])
    assert not isinstance(a, str) and a.draft_vocab == 16384


def test_train_eagle_target_must_name_a_model_and_defaults_fill_in(capsys, no_loading, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    rc, _, err = run(["train-eagle", "--target", str(tmp_path / "notes.txt"), "--out", str(tmp_path / "h")], capsys)
    assert rc == 2 and "notes.txt: not a checkpoint" in err and err.count("\n") == 1, err
    from forerun.eagle.train import DEFAULTS, parse_flags

    a = parse_flags(["--target", "smollm2-135m-instruct", "--out", str(tmp_path / "h"), "--corpus", "distill",
                     "--distill-batch", "4"])
    assert a.distill_batch == 4 and a.distill_max_new == DEFAULTS["distill_max_new"]
    assert a.draft_vocab == DEFAULTS["draft_vocab"]


def test_llamacpp_build_config_avoids_amx():
    """The benchmark's llama.cpp build: native where the CPU lacks AMX; on an AMX CPU the same ISA listed without
    it, in a folder of its own (its AMX matrix product crashed on the Q4_K_M target here)."""
    from forerun.bench import llamacpp_build_config

    name, flags = llamacpp_build_config({"avx2", "fma", "avx512f"})
    assert (name, flags) == ("build", ["-DGGML_NATIVE=ON"])
    name, flags = llamacpp_build_config({"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni",
                                         "amx_tile", "amx_int8"})
    assert name == "build_noamx" and "-DGGML_NATIVE=OFF" in flags
    assert "-DGGML_AVX512=ON" in flags and "-DGGML_AVX512_VNNI=ON" in flags and "-DGGML_AVX512_BF16=OFF" in flags
    assert not any("AMX" in f for f in flags)


def test_llamacpp_timings_split_the_prompt_from_the_decoding():
    """The peer rows' times from llama.cpp's logs (lines copied from the build the benchmarks use, b0c1e570):
    prompt + decode seconds, tokens = decode runs + the prompt pass's token; the speculative tool's encode /
    decode lines and draft counts. The prompt line must not be taken for the decode line (a bug once)."""
    from forerun.bench import llamacpp_timings

    plain = ("0.02.122.834 I common_perf_print: prompt eval time =     382.02 ms /    12 tokens (   31.83 ms per token,"
             "    31.41 tokens per second)\n"
             "0.02.122.836 I common_perf_print:        eval time =     389.91 ms /     7 runs   (   55.70 ms per token,"
             "    17.95 tokens per second)\n")
    t = llamacpp_timings(plain, speculative=False)
    assert t["tokens"] == 8 and t["prompt_seconds"] == pytest.approx(0.38202)
    assert t["seconds"] == pytest.approx(0.38202 + 0.38991)
    spec = ("0.04.038.281 I encoded   12 tokens in    0.471 seconds, speed:   25.502 t/s\n"
            "0.04.038.282 I decoded   12 tokens in    0.886 seconds, speed:   13.537 t/s\n"
            "0.04.038.283 I n_drafted = 12\n0.04.038.283 I n_accept  = 8\n")
    t = llamacpp_timings(spec, speculative=True)
    assert (t["tokens"], t["drafted"], t["accepted"]) == (12, 12, 8)
    assert t["prompt_seconds"] == pytest.approx(0.471) and t["seconds"] == pytest.approx(0.471 + 0.886)
    with pytest.raises(RuntimeError, match="lacks"):
        llamacpp_timings(plain.splitlines()[0], speculative=False)


# ---------------------------------------------------------------- a GGUF runs quantized by default


def _serve_engine_kwargs(monkeypatch, args) -> dict:
    """What `forerun serve m.gguf ARGS` passes to Engine (stopped before anything loads)."""
    from forerun.engine import engine as engine_mod
    from forerun.server import cli as serve_cli

    seen = {}

    def fake_engine(*a, **kw):
        seen.update(kw)
        raise ValueError("stop before loading")

    monkeypatch.setattr(engine_mod, "Engine", fake_engine)
    monkeypatch.setattr(hub, "model_problem", lambda *a, **k: None)
    assert serve_cli.main(["m.gguf", "--port", "0", *args]) != 0
    return seen


@pytest.mark.parametrize("args, want", [([], "auto"), (["--dtype", "bfloat16"], "none"), (["--quantize", "int8"], "int8"),
                                        (["--dtype", "float32", "--quantize", "int4"], "int4")])
def test_serve_keeps_a_gguf_quantized_unless_a_float_dtype_is_asked(monkeypatch, args, want):
    """`forerun serve M` loads a GGUF as `--quantize auto` (int4 kept quantized: the layout the benchmarks measure);
    `--dtype bfloat16` alone asks for float weights (none); an explicit --quantize wins."""
    assert _serve_engine_kwargs(monkeypatch, args)["quantize"] == want


@pytest.mark.parametrize("args, want", [([], True), (["--no-enable-prefix-caching"], False),
                                        (["--enable-prefix-caching"], True)])
def test_serve_caches_prefixes_by_default(monkeypatch, args, want):
    """Prefix caching is on unless --no-enable-prefix-caching (vLLM's spelling), EAGLE heads included."""
    assert _serve_engine_kwargs(monkeypatch, args)["enable_prefix_caching"] is want
    assert cli.build_parser().parse_args(["generate", "hi", *args]).enable_prefix_caching is want


def test_generate_keeps_a_gguf_quantized_by_default():
    assert cli.build_parser().parse_args(["generate", "hi"]).quantize == "auto"
    assert cli.build_parser().parse_args(["generate", "hi", "--quantize", "none"]).quantize == "none"
