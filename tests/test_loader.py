"""forerun.models.loader: HF safetensors directories and GGUF files -> ModelConfig + HF-named tensors."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from forerun.config import ModelConfig
from forerun.models.loader import Checkpoint, expected_tensor_names, load_checkpoint

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)


def tiny_model(kind: str, **overrides):
    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2, "mistral": 3}[kind])
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[kind]
    kw = dict(TINY)
    if kind == "qwen3":
        kw["head_dim"] = 32  # != hidden/heads, as in real Qwen3
    kw.update(overrides)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kw)).eval()
    with torch.no_grad():  # norms are ones at init: randomize so a mixup would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.normal_()
    return model


def save(model, path: Path, **kw) -> Path:
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


def assert_matches_state_dict(ckpt: Checkpoint, model, atol: float = 0.0) -> None:
    sd = model.state_dict()
    want = set(sd)
    if ckpt.config.tie_word_embeddings:
        want.discard("lm_head.weight")
    got = {}
    for name, t in ckpt.tensors():
        assert name not in got, f"{name} yielded twice"
        got[name] = t
    assert set(got) == want
    assert list(got) == ckpt.tensor_names()
    for name, t in got.items():
        assert t.shape == sd[name].shape, name
        if atol == 0:
            assert torch.equal(t, sd[name]), name
        else:
            assert (t - sd[name]).abs().max().item() <= atol, name


# ====================================================================== HF safetensors directories


@pytest.mark.parametrize(
    "kind,overrides",
    [
        ("llama", dict(tie_word_embeddings=False)),
        ("llama", dict(tie_word_embeddings=True, rope_scaling=None)),
        ("qwen2", dict(tie_word_embeddings=True)),
        ("qwen2", dict(tie_word_embeddings=False)),
        ("qwen3", dict(tie_word_embeddings=True)),
        ("mistral", dict(tie_word_embeddings=False)),
    ],
)
def test_hf_directory_roundtrip(tmp_path, kind, overrides):
    model = tiny_model(kind, **overrides)
    d = save(model, tmp_path / "ckpt")
    ckpt = load_checkpoint(d)
    assert ckpt.format == "safetensors" and ckpt.source == d
    assert ckpt.config == ModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    assert ckpt.hf_config["model_type"] == kind
    c = ckpt.config
    assert (c.arch, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == (kind, 64, 2, 4, 2, 256)
    assert c.head_dim == (32 if kind == "qwen3" else 16)
    assert c.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert c.attention_bias == (kind == "qwen2")
    assert c.qk_norm == (kind == "qwen3")
    assert_matches_state_dict(ckpt, model)
    names = ckpt.tensor_names()
    if kind == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in names
    if kind == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in names
    assert names[0] == "model.embed_tokens.weight"
    assert ("lm_head.weight" in names) != c.tie_word_embeddings
    # streaming order: layer 0 entirely before layer 1
    layer_of = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layer_of == sorted(layer_of)


def test_hf_sharded_checkpoint(tmp_path):
    model = tiny_model("qwen2", tie_word_embeddings=False)
    d = save(model, tmp_path / "sharded", max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").exists()
    assert len(list(d.glob("*.safetensors"))) > 3
    ckpt = load_checkpoint(d)
    assert_matches_state_dict(ckpt, model)


def test_hf_single_file_accepts_config_path_and_dtype(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=False).to(torch.bfloat16)
    d = save(model, tmp_path / "bf16")
    ckpt = load_checkpoint(d / "config.json")
    assert ckpt.source == d
    assert all(t.dtype == torch.bfloat16 for _, t in ckpt.tensors())  # stored dtype kept
    assert all(t.dtype == torch.float32 for _, t in ckpt.tensors(dtype=torch.float32))
    assert_matches_state_dict(ckpt, model)


def test_hf_extra_tensors_are_passed_on(tmp_path):
    """Llama with attention_bias also has o_proj.bias: it must not be dropped silently."""
    model = tiny_model("llama", attention_bias=True, tie_word_embeddings=False)
    ckpt = load_checkpoint(save(model, tmp_path / "bias"))
    assert "model.layers.0.self_attn.o_proj.bias" in ckpt.tensor_names()
    assert_matches_state_dict(ckpt, model)


def test_expected_tensor_names():
    cfg = ModelConfig(arch="qwen3", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=4, tie_word_embeddings=True, qk_norm=True)  # fmt: skip
    names = expected_tensor_names(cfg)
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "model.norm.weight"
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" not in names
    assert len(names) == 2 + 11


def test_hf_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = tiny_model("llama")
    d = save(model, tmp_path / "tok")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_checkpoint(d).tokenizer()
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                               unk_token="<unk>")  # fmt: skip
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(d)
    ckpt = load_checkpoint(d)
    t = ckpt.tokenizer()
    assert isinstance(t, transformers.PreTrainedTokenizerFast)
    assert t.encode("hello world", add_special_tokens=False) == [3, 4]
    assert t.chat_template and ckpt.tokenizer() is t  # cached


# ---------------------------------------------------------------- HF errors


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="resolve_model"):
        load_checkpoint("smollm2-135m-instruct")  # a model name, not a path


def test_dir_without_config(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"no config\.json.*m\.gguf"):
        load_checkpoint(tmp_path)


def test_dir_without_safetensors(tmp_path):
    model = tiny_model("llama")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_checkpoint(tmp_path)


def test_unsupported_hf_architecture(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'.*llama.*qwen2"):
        load_checkpoint(tmp_path)


def test_missing_tensor(tmp_path):
    from safetensors.torch import save_file

    model = tiny_model("llama", tie_word_embeddings=False)
    model.config.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.layers.1.mlp.down_proj.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_checkpoint(tmp_path)


def test_index_with_missing_shard(tmp_path):
    model = tiny_model("llama")
    d = save(model, tmp_path / "s", max_shard_size="40KB")
    sorted(d.glob("model-*.safetensors"))[1].unlink()
    with pytest.raises(FileNotFoundError, match="lists shard"):
        load_checkpoint(d)


# ====================================================================== GGUF (synthetic, small)

HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        mod, suffix = rest.rsplit(".", 1)
        return f"blk.{i}.{HF_TO_GGUF_BLOCK[mod]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]  # fmt: skip


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute (HF layout -> GGUF layout for interleaved RoPE)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, model, *, quant: dict | None = None, skip=(), extra_tensors=None,
               extra_kv=None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Write ``model`` as llama.cpp would; return the HF tensors the loader should give back
    (after any quantization round trip)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)
    w.add_rope_freq_base(theta)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages[0]['content'] }}")
    for k, v in (extra_kv or {}).items():
        getattr(w, k)(v)
    expect = {}
    tied = cfg.tie_word_embeddings
    for hf, t in model.state_dict().items():
        if (hf == "lm_head.weight" and tied) or hf in skip:
            continue
        name = gguf_name(hf)
        arr = t.detach().numpy().astype(np.float32)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            arr_gguf = llama_cpp_permute(arr, heads)
        else:
            arr_gguf = arr
        qtype = (quant or {}).get(name)
        if qtype is not None:
            q = quantize(arr_gguf, qtype)
            w.add_tensor(name, q, raw_dtype=qtype)
            back = dequantize(q, qtype).reshape(arr.shape)
            if arch == "llama" and arr_gguf is not arr:  # the loader undoes the permutation
                heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
                back = back.reshape(heads, -1, 2, *arr.shape[1:]).swapaxes(1, 2).reshape(arr.shape)
            expect[hf] = torch.from_numpy(np.ascontiguousarray(back))
        else:
            w.add_tensor(name, arr_gguf)
            expect[hf] = torch.from_numpy(arr)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expect


def assert_tensors_equal(ckpt: Checkpoint, expect: dict[str, torch.Tensor]) -> None:
    got = dict(ckpt.tensors())
    assert set(got) == set(expect)
    for name, t in got.items():
        assert t.dtype == torch.float32 and t.shape == expect[name].shape, name
        assert torch.equal(t, expect[name]), name


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_llama_unpermutes_qk(tmp_path, tied):
    model = tiny_model("llama", tie_word_embeddings=tied)
    path = tmp_path / "tiny-llama.gguf"
    expect = write_gguf(path, "llama", model)
    ckpt = load_checkpoint(path)
    assert ckpt.format == "gguf"
    c = ckpt.config
    assert (c.arch, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llama", 64, 128, 2, 4, 2, 16)  # fmt: skip
    assert c.vocab_size == 256 and c.tie_word_embeddings == tied and not c.attention_bias
    assert c.rms_norm_eps == model.config.rms_norm_eps and c.max_position_embeddings == 512
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert ckpt.hf_config["tie_word_embeddings"] == tied
    assert_tensors_equal(ckpt, expect)
    assert_matches_state_dict(ckpt, model)  # same as the original HF weights: permutation undone


def test_gguf_qwen2_biases_not_permuted(tmp_path):
    model = tiny_model("qwen2", tie_word_embeddings=True)
    path = tmp_path / "tiny-qwen2.gguf"
    write_gguf(path, "qwen2", model)
    ckpt = load_checkpoint(path)
    assert ckpt.config.arch == "qwen2" and ckpt.config.attention_bias and ckpt.config.tie_word_embeddings
    assert "model.layers.0.self_attn.k_proj.bias" in ckpt.tensor_names()
    assert "lm_head.weight" not in ckpt.tensor_names()
    assert_matches_state_dict(ckpt, model)


def test_gguf_qwen3_qk_norm_and_head_dim(tmp_path):
    model = tiny_model("qwen3", tie_word_embeddings=False)
    path = tmp_path / "tiny-qwen3.gguf"
    write_gguf(path, "qwen3", model)
    ckpt = load_checkpoint(path)
    assert ckpt.config.arch == "qwen3" and ckpt.config.qk_norm and ckpt.config.head_dim == 32
    assert_matches_state_dict(ckpt, model)


def test_gguf_quantized_tensors(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=False)
    path = tmp_path / "q.gguf"
    quant = {"token_embd.weight": QT.Q8_0, "blk.0.attn_q.weight": QT.Q4_1, "blk.0.attn_k.weight": QT.Q5_0,
             "blk.1.ffn_up.weight": QT.Q4_0, "output.weight": QT.F16, "blk.1.attn_v.weight": QT.BF16}  # fmt: skip
    expect = write_gguf(path, "llama", model, quant=quant)
    ckpt = load_checkpoint(path)
    assert_tensors_equal(ckpt, expect)
    assert all(t.dtype == torch.bfloat16 for _, t in ckpt.tensors(dtype=torch.bfloat16))


def test_gguf_llama3_rope_freqs(tmp_path):
    """Llama-3.1-style GGUFs carry rope scaling as a rope_freqs tensor; it becomes config.rope_scaling."""
    model = tiny_model("llama")
    dim, base = 16, 500000.0
    factor, low, high, orig = 8.0, 1.0, 4.0, 8192
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factors = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < orig / high:
            factors.append(1.0)
        elif wl > orig / low:
            factors.append(factor)
        else:
            s = (orig / wl - low) / (high - low)
            factors.append(1 / ((1 - s) / factor + s))
    path = tmp_path / "l3.gguf"
    model.config.rope_parameters = {"rope_theta": base, "rope_type": "default"}
    write_gguf(path, "llama", model, extra_tensors={"rope_freqs.weight": np.array(factors, dtype=np.float32)})
    ckpt = load_checkpoint(path)
    assert ckpt.config.rope_theta == base
    assert ckpt.config.rope_scaling_dict == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in str(ckpt.tensor_names())


# ---------------------------------------------------------------- GGUF errors


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'.*llama.*qwen2.*qwen3") as ei:
        load_checkpoint(path)
    assert str(path) in str(ei.value)


def test_gguf_garbage_and_truncated(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        load_checkpoint(bad)

    good = tmp_path / "good.gguf"
    write_gguf(good, "llama", tiny_model("llama"))
    data = good.read_bytes()
    for cut in (3, 8, 24, 200, len(data) // 2, len(data) - 1):
        trunc = tmp_path / f"trunc{cut}.gguf"
        trunc.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="not a valid GGUF file") as ei:
            load_checkpoint(trunc)
        assert str(trunc) in str(ei.value)

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        load_checkpoint(empty)


def test_gguf_missing_tensor(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=False)
    path = tmp_path / "missing.gguf"
    write_gguf(path, "llama", model, skip={"model.layers.1.mlp.down_proj.weight"})
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_checkpoint(path)


def test_gguf_unknown_tensor(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "unknown.gguf"
    write_gguf(path, "llama", model, extra_tensors={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        load_checkpoint(path)


# ====================================================================== real models (slow)

SMOL = "smollm2-135m-instruct"
QWEN_DRAFT = "qwen2.5-coder-0.5b-instruct"


def _real_model_check(name: str):
    from forerun.models.hub import resolve_model

    path = resolve_model(name, progress=False)
    ckpt = load_checkpoint(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    rc = ref.config
    c = ckpt.config
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        rc.hidden_size, rc.intermediate_size, rc.num_hidden_layers, rc.num_attention_heads,
        rc.num_key_value_heads, rc.vocab_size)  # fmt: skip
    assert c.tie_word_embeddings == rc.tie_word_embeddings
    assert c.rms_norm_eps == pytest.approx(rc.rms_norm_eps, rel=1e-6)
    sd = ref.state_dict()
    want = set(sd) - ({"lm_head.weight"} if c.tie_word_embeddings else set())
    seen = set()
    for tname, t in ckpt.tensors():
        assert t.dtype == torch.float32 and t.shape == sd[tname].shape, tname
        diff = (t - sd[tname]).abs().max().item()
        assert diff <= 1e-6, f"{tname}: max abs diff {diff}"
        seen.add(tname)
    assert seen == want
    del ref, sd
    tok = ckpt.tokenizer()
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    text = "Hello world! def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)  # ünïcödé 你好"
    assert tok.encode(text) == ref_tok.encode(text)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    return ckpt, tok


@pytest.mark.slow
def test_real_smollm2_gguf_matches_transformers():
    ckpt, tok = _real_model_check(SMOL)
    c = ckpt.config
    assert (c.arch, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 576, 30, 9, 3, 64)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5
    assert "lm_head.weight" not in ckpt.tensor_names()
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]


@pytest.mark.slow
def test_real_qwen25_coder_05b_gguf_matches_transformers():
    ckpt, tok = _real_model_check(QWEN_DRAFT)
    c = ckpt.config
    assert (c.arch, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("qwen2", 896, 24, 14, 2, 64)
    assert c.attention_bias and c.vocab_size == 151936 and c.rope_theta == 1e6
    assert "model.layers.0.self_attn.q_proj.bias" in ckpt.tensor_names()
    # This GGUF stores a separate (Q8_0) output.weight, so the head is *not* tied here,
    # unlike the original HF checkpoint; the loader follows the file.
    assert not c.tie_word_embeddings and "lm_head.weight" in ckpt.tensor_names()
    assert c.eos_token_ids == (151645,) and c.bos_token_id == 151643
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645


# ====================================================================== tokenizers: whose, and never run code (issue 10: 2, 3)


def _word_tokenizer(n: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(n)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", eos_token="w1")


def _cached(name: str):
    from forerun.models import hub

    return hub.model_path(name) if hub.is_cached(name) else None


def test_gguf_uses_its_own_tokenizer_not_the_folders(tmp_path):
    """A real GGUF next to another model's tokenizer files: the GGUF's embedded tokenizer wins (the folder's
    97-word tokenizer used to be picked up silently). Metadata only: no weight is read."""
    path = _cached(SMOL)
    if path is None:
        pytest.skip(f"{SMOL} not pulled")
    (tmp_path / "model.gguf").symlink_to(path)
    _word_tokenizer(97).save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path / "model.gguf")
    tok = ckpt.tokenizer()
    assert len(tok) == 49152 and tok.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert tok.chat_template and "im_start" in tok.chat_template
    other = ckpt.tokenizer(tmp_path)  # naming another tokenizer is still possible
    assert len(other) == 97 and other.encode("w5 w7", add_special_tokens=False) == [5, 7]


def _byte_level_tokens() -> list[str]:
    """GPT-2's byte -> unicode table: the 256 base tokens of a byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def test_synthetic_gguf_tokenizer_wins_over_folder_files(tmp_path):
    """Same as above without the real file: a tiny byte-level BPE embedded in a GGUF, next to a word-level
    tokenizer.json / tokenizer_config.json of another model."""
    tokens = _byte_level_tokens() + ["Ġt", "he", "Ġthe", "<|endoftext|>"]
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", tiny_model("qwen2", vocab_size=len(tokens), tie_word_embeddings=True),
               extra_kv={"add_tokenizer_model": "gpt2", "add_token_list": tokens,
                         "add_token_merges": ["Ġ t", "h e", "Ġt he"], "add_tokenizer_pre": "qwen2"})
    _word_tokenizer(97).save_pretrained(tmp_path)
    tok = load_checkpoint(path).tokenizer()
    assert len(tok) == len(tokens)
    ids = tok.encode(" the cat", add_special_tokens=False)
    assert ids == [tokens.index("Ġthe"), tokens.index("Ġ"), tokens.index("c"), tokens.index("a"), tokens.index("t")]
    assert tok.decode(ids) == " the cat"


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    model = tiny_model("llama")  # vocab_size 256
    d = save(model, tmp_path / "m")
    _word_tokenizer(300).save_pretrained(d)
    with pytest.raises(ValueError, match=r"tokenizer does not fit the model: its vocabulary has 300 tokens .* 256 rows"):
        load_checkpoint(d).tokenizer()
    _word_tokenizer(200).save_pretrained(d)  # smaller than a padded embedding: fine
    assert len(load_checkpoint(d).tokenizer()) == 200


def test_tokenizer_loading_never_trusts_remote_code(tmp_path, monkeypatch):
    calls = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    d = save(tiny_model("llama"), tmp_path / "m")
    _word_tokenizer(10).save_pretrained(d)
    load_checkpoint(d).tokenizer()
    gg = tmp_path / "g.gguf"
    write_gguf(gg, "llama", tiny_model("llama"))
    with pytest.raises(ValueError):  # no tokenizer in this synthetic GGUF; the call is what matters
        load_checkpoint(gg).tokenizer()
    assert len(calls) == 2 and all(kw.get("trust_remote_code") is False for kw in calls)


def test_custom_tokenizer_code_is_refused_without_a_prompt(tmp_path, capsys):
    """A folder whose tokenizer_config asks for its own Python class: refused, the code never runs, and
    nothing is asked on stdin (transformers' "Do you wish to run the custom code? [y/N]")."""
    d = save(tiny_model("llama"), tmp_path / "evil")
    _word_tokenizer(10).save_pretrained(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"]}
    cfg["tokenizer_class"] = "EvilTokenizer"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "RAN"
    (d / "tokenization_evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
                                            "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    with pytest.raises(ValueError, match="custom code"):
        load_checkpoint(d).tokenizer()
    out = capsys.readouterr()
    assert not marker.exists()
    assert "Do you wish" not in out.out + out.err


# ====================================================================== draft compatibility before loading (issue 10: 9)


def test_read_gguf_vocab_matches_gguf_reader(tmp_path):
    path = tmp_path / "v.gguf"
    tokens = [f"tok{i}" for i in range(250)] + ["ünï", "你好", "Ġx", "<|im_end|>", "\n", " ", ""]
    write_gguf(path, "llama", tiny_model("llama", vocab_size=len(tokens)),
               extra_kv={"add_tokenizer_model": "gpt2", "add_token_list": tokens})
    from forerun.models.compat import read_gguf_vocab

    got, rows = read_gguf_vocab(path)
    reader = gguf.GGUFReader(str(path))
    assert got == list(reader.fields["tokenizer.ggml.tokens"].contents()) == tokens
    assert rows == len(tokens)
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_vocab(Path(__file__))


class _Vocab:
    def __init__(self, tokens):
        self.v = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self):
        return self.v


def test_incompatible_gguf_draft_is_refused_from_its_header(tmp_path, monkeypatch):
    """The draft's weights are never read and its tokenizer never built: the header's token list decides."""
    from forerun.models import compat
    from forerun.models.loader import Checkpoint

    def no_weights(*a, **k):
        raise AssertionError("draft weights read")

    monkeypatch.setattr(Checkpoint, "tensors", no_weights)
    tokens = [f"tok{i}" for i in range(256)]
    path = tmp_path / "d.gguf"
    write_gguf(path, "llama", tiny_model("llama"), extra_kv={"add_tokenizer_model": "gpt2", "add_token_list": tokens})
    monkeypatch.setattr(compat, "draft_metadata", lambda d: (_ for _ in ()).throw(AssertionError("tokenizer built")))
    with pytest.raises(ValueError, match="does not fit this target: their tokenizers differ"):
        compat.check_draft_compatible(_Vocab([f"other{i}" for i in range(256)]), 256, str(path))
    with pytest.raises(ValueError, match="its vocabulary has 256 rows, the target's 300"):
        compat.check_draft_compatible(_Vocab(tokens), 300, str(path))
    compat.check_draft_compatible(_Vocab(tokens), 256, str(path))  # fits: no error, no tokenizer built
    for d in ("ngram", "none", "early-exit:3"):
        compat.check_draft_compatible(_Vocab(tokens), 256, d)
    with pytest.raises(ValueError, match="does not exist"):
        compat.check_draft_compatible(_Vocab(tokens), 256, str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="unknown model"):
        compat.check_draft_compatible(_Vocab(tokens), 256, "no-such-draft")


def test_incompatible_hf_draft_is_refused_before_its_weights(tmp_path, monkeypatch):
    from forerun.models import compat
    from forerun.models.loader import Checkpoint

    monkeypatch.setattr(Checkpoint, "tensors", lambda *a, **k: (_ for _ in ()).throw(AssertionError("weights read")))
    d = save(tiny_model("llama"), tmp_path / "draft")
    _word_tokenizer(200).save_pretrained(d)
    target_tok = _word_tokenizer(200)
    compat.check_draft_compatible(target_tok, 256, str(d))
    with pytest.raises(ValueError, match="its vocabulary has 256 rows, the target's 512"):
        compat.check_draft_compatible(target_tok, 512, str(d))
    compat.check_draft_compatible(_word_tokenizer(150), 256, str(d))  # the shared ids agree: fits
    other = _word_tokenizer(200)
    other.add_tokens(["zz"])  # id 200: the draft has no id 200, so still no disagreement
    compat.check_draft_compatible(other, 256, str(d))
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({f"x{i}": i for i in range(200)}, unk_token="x0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match="their tokenizers differ"):
        compat.check_draft_compatible(transformers.PreTrainedTokenizerFast(tokenizer_object=raw), 256, str(d))


def test_default_draft_fits_the_target():
    from forerun.models.compat import default_draft_for
    from forerun.models.hub import model_path

    assert default_draft_for("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-0.5b-instruct"
    assert default_draft_for(str(model_path("qwen2.5-coder-1.5b-instruct"))) == "qwen2.5-coder-0.5b-instruct"
    assert default_draft_for("smollm2-135m-instruct") == "ngram"  # no known draft shares its tokenizer
    assert default_draft_for("/somewhere/else.gguf") == "ngram"


def test_real_pairs_compat_without_loading(monkeypatch):
    """The real models: the Qwen pair fits, SmolLM2 with the Qwen draft does not; no weight is read."""
    from forerun.models.compat import check_draft_compatible, read_gguf_vocab

    monkeypatch.setattr(Checkpoint, "tensors", lambda *a, **k: (_ for _ in ()).throw(AssertionError("weights read")))

    paths = {n: _cached(n) for n in (SMOL, QWEN_DRAFT, "qwen2.5-coder-1.5b-instruct")}
    if any(p is None for p in paths.values()):
        pytest.skip("real models not pulled")
    smol_tokens, smol_rows = read_gguf_vocab(paths[SMOL])
    with pytest.raises(ValueError, match="does not fit this target"):
        check_draft_compatible(_Vocab(smol_tokens), smol_rows, QWEN_DRAFT)
    q_tokens, q_rows = read_gguf_vocab(paths["qwen2.5-coder-1.5b-instruct"])
    check_draft_compatible(_Vocab(q_tokens), q_rows, QWEN_DRAFT)


def test_draft_with_extra_padding_tokens_still_fits(tmp_path, monkeypatch):
    """A GGUF whose list pads the vocabulary with [PAD] tokens (as Qwen's does) fits a target tokenizer
    that stops earlier, as long as the embedding sizes agree; one token that differs does not fit."""
    from forerun.models import compat

    monkeypatch.setattr(compat, "draft_metadata", lambda d: (_Vocab(tokens), 256))
    tokens = [f"tok{i}" for i in range(250)] + [f"[PAD{i}]" for i in range(250, 256)]
    path = tmp_path / "d.gguf"
    write_gguf(path, "llama", tiny_model("llama"), extra_kv={"add_tokenizer_model": "gpt2", "add_token_list": tokens})
    compat.check_draft_compatible(_Vocab(tokens[:250]), 256, str(path))
    with pytest.raises(ValueError, match="their tokenizers differ"):
        compat.check_draft_compatible(_Vocab(tokens[:249] + ["other"]), 256, str(path))


# ====================================================================== load time: fast GGUF parse, tokenizer cache


def _gguf_with_big_arrays(path: Path) -> list[str]:
    tokens = _byte_level_tokens() + ["Ġt", "he", "Ġthe"] + [f"w{i}x" for i in range(5000)] + ["<|endoftext|>"]
    write_gguf(path, "qwen2", tiny_model("qwen2", vocab_size=len(tokens), tie_word_embeddings=True),
               extra_kv={"add_tokenizer_model": "gpt2", "add_token_list": tokens,
                         "add_token_types": [1] * len(tokens), "add_token_scores": [float(i) for i in range(len(tokens))],
                         "add_token_merges": ["Ġ t", "h e", "Ġt he"], "add_tokenizer_pre": "qwen2"})
    return tokens


def test_fast_gguf_reader_equals_gguf_reader(tmp_path):
    """FastGGUFReader: the same fields (long arrays: only their counts, in lazy_arrays) and the same tensors as
    gguf's GGUFReader. A wrong walk over a skipped string array shifts every later field and tensor."""
    from forerun.models.gguf_reader import LAZY_ARRAY, FastGGUFReader

    path = tmp_path / "big.gguf"
    tokens = _gguf_with_big_arrays(path)
    ref, fast = gguf.GGUFReader(str(path)), FastGGUFReader(str(path))
    assert len(tokens) > LAZY_ARRAY
    assert fast.lazy_arrays == {"tokenizer.ggml.tokens": len(tokens), "tokenizer.ggml.token_type": len(tokens),
                                "tokenizer.ggml.scores": len(tokens)}
    assert list(fast.fields) == [k for k in ref.fields if k not in fast.lazy_arrays]
    for k, f in fast.fields.items():
        assert f.types == ref.fields[k].types and f.offset == ref.fields[k].offset, k
        got, want = f.contents(), ref.fields[k].contents()
        assert (got == want) if not isinstance(want, np.ndarray) else np.array_equal(got, want), k
    assert fast.fields["tokenizer.ggml.merges"].contents() == ["Ġ t", "h e", "Ġt he"]  # short: parsed
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in fast.tensors] == \
           [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ref.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, ref.tensors))
    assert type(fast.data) is np.ndarray  # a plain view of the map, not np.memmap
    ckpt = load_checkpoint(path)
    assert ckpt.config.vocab_size == len(tokens)
    assert ckpt.tokenizer().encode(" the cat", add_special_tokens=False)[0] == tokens.index("Ġthe")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random fp16 scales: inf / nan (compared as equal)
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K,
                                   QT.Q5_K, QT.Q6_K])
def test_gguf_dequantize_in_row_chunks_equals_gguf(qtype):
    """GGUFQuantized.dequantize (many rows a call, over threads) == gguf.quants.dequantize, bit for bit, on random
    blocks (several chunks: 3000 rows)."""
    from forerun.models.loader import GGUFQuantized

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(3000, 2 * size), dtype=np.uint8)
    if qtype in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0):  # finite fp16 scales (leading bytes of a block)
        raw.reshape(3000, 2, size)[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    want = dequantize(raw, qtype)
    got = GGUFQuantized(raw, qtype.name, (3000, 2 * block)).dequantize().numpy()
    assert got.shape == want.shape and np.array_equal(got, want, equal_nan=True)


def test_gguf_tokenizer_cache(tmp_path, monkeypatch):
    """A converted GGUF tokenizer is kept in <cache>/tokenizers and read back next time (no conversion), with the
    same encoding and chat template; a changed file, a damaged entry or FORERUN_TOKENIZER_CACHE=0 convert again."""
    import os

    from forerun.models import loader

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "TOKENIZER_CACHE_MIN_SECONDS", 0.0)
    conversions = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*a, **kw):
        if kw.get("gguf_file"):
            conversions.append(a)
        assert kw.get("trust_remote_code") is False
        return real(*a, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    path = tmp_path / "m.gguf"
    tokens = _gguf_with_big_arrays(path)
    text, msgs = " the cat ünï 你好", [{"role": "user", "content": "hi"}]
    first = load_checkpoint(path).tokenizer()
    entries = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(conversions) == 1 and len(entries) == 1 and (entries[0] / "tokenizer.json").exists()
    second = load_checkpoint(path).tokenizer()
    assert len(conversions) == 1  # read back, not converted
    assert second.encode(text) == first.encode(text) and len(second) == len(first) == len(tokens)
    assert second.get_vocab() == first.get_vocab() and second.eos_token_id == first.eos_token_id
    assert second.apply_chat_template(msgs, tokenize=False) == first.apply_chat_template(msgs, tokenize=False)
    assert second.name_or_path == str(path)
    (entries[0] / "tokenizer.json").write_text("{not json")  # damaged: converted again and rewritten
    assert load_checkpoint(path).tokenizer().encode(text) == first.encode(text) and len(conversions) == 2
    assert load_checkpoint(path).tokenizer().encode(text) == first.encode(text) and len(conversions) == 2
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: another entry
    load_checkpoint(path).tokenizer()
    assert len(conversions) == 3 and len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2
    monkeypatch.setattr(loader, "TOKENIZER_CACHE_ENTRIES", 1)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    load_checkpoint(path).tokenizer()  # a third entry, the two older ones dropped
    assert len(conversions) == 4 and len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1
    monkeypatch.setenv("FORERUN_TOKENIZER_CACHE", "0")
    load_checkpoint(path).tokenizer()
    load_checkpoint(path).tokenizer()
    assert len(conversions) == 6


@pytest.mark.slow
def test_real_qwen_tokenizer_from_cache_equals_conversion(tmp_path, monkeypatch):
    """The Qwen2.5-Coder tokenizer read back from forerun's cache behaves exactly as transformers' conversion of
    the GGUF: vocabulary, added tokens, special ids, encodings (code, unicode, special tokens), decoding, chat
    template."""
    path = _cached("qwen2.5-coder-0.5b-instruct")
    if path is None:
        pytest.skip("qwen2.5-coder-0.5b-instruct not pulled")
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    fresh = load_checkpoint(path).tokenizer()
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    cached = load_checkpoint(path).tokenizer()
    assert type(cached) is type(fresh)
    assert cached.get_vocab() == fresh.get_vocab() and cached.added_tokens_decoder == fresh.added_tokens_decoder
    assert cached.special_tokens_map == fresh.special_tokens_map and len(cached) == len(fresh)
    texts = ["def f(x):\n    return x ** 2  # ünïcödé 你好 🙂\n\n\n", "<|im_start|>user\nhi<|im_end|>\n<|fim_prefix|>",
             "   tabs\t\tand  spaces  ", "fn main() { println!(\"{}\", 1e-5); }", ""]
    for t in texts:
        assert cached.encode(t) == fresh.encode(t), t
        assert cached.decode(fresh.encode(t)) == fresh.decode(fresh.encode(t)), t
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a prime check."}]
    assert cached.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
           fresh.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
