"""GGUF / safetensors weights loaded in the CUDA int4 / int8 layouts (forerun/models/gguf_cuda.py: CudaQ4Linear and
CudaQ8Linear built straight from the blocks), run on the CPU: their forward on CPU tensors is dequantized() +
linear, so the mapping, the re-quantization and whole models are checked here without a GPU (the Triton products
themselves are tested in tests/test_q4_gpu_kernels.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

import test_loader
from forerun.config import SpecConfig
from forerun.engine.llm import LLM
from forerun.models.gguf_cuda import check_cuda_layout, gguf_q8_0_groups, make_cuda_linear
from forerun.models.loader import GGUFQuantized, load_checkpoint
from forerun.models.quant import gguf_int4_groups, parse_quantize, quantize_groups_int4, weight_bytes
from forerun.models.quant_cuda import CudaQ4Linear, CudaQ8Linear
from forerun.models.registry import build_cuda_quantized_model, build_model
from forerun.runtime.runner import Chunk
from forerun.sampling_params import SamplingParams
from test_loader import tiny_model, write_gguf
from test_quant import _random_q4k
from tiny import tiny_tokenizer

MODELS = Path.home() / ".cache" / "forerun" / "models"


# ====================================================================== K-quant encoders (gguf-py only decodes them)


def _quantize_q4k(x: np.ndarray) -> np.ndarray:
    """x [N, K] float (K % 256 == 0) -> Q4_K blocks (llama.cpp's layout, plain min/max rounding)."""
    n, k = x.shape
    g = x.reshape(-1, 8, 32).astype(np.float32)  # [B, 8 sub-blocks, 32]
    lo = np.minimum(g.min(-1), 0.0)
    step = np.maximum((g.max(-1) - lo) / 15.0, 1e-8)
    d = (step.max(-1, keepdims=True) / 63.0).astype(np.float16)
    dmin = np.maximum((-lo).max(-1, keepdims=True) / 63.0, 1e-8).astype(np.float16)
    sc = np.clip(np.round(step / d.astype(np.float32)), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin.astype(np.float32)), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32) * sc
    off = dmin.astype(np.float32) * m
    q = np.clip(np.round((g + off[..., None]) / scale[..., None]), 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    s = np.zeros((g.shape[0], 12), np.uint8)
    s[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)  # byte i of a 64-chunk: weight i (lo), i + 32 (hi)
    b = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), s, qs], axis=1)
    return b.reshape(n, -1)


def _quantize_q6k(x: np.ndarray) -> np.ndarray:
    """x [N, K] float (K % 256 == 0) -> Q6_K blocks (llama.cpp's layout, symmetric per 16 weights)."""
    n, k = x.shape
    g = x.reshape(-1, 16, 16).astype(np.float32)
    sub = np.maximum(np.abs(g).max(-1) / 31.0, 1e-8)  # [B, 16]
    d = (sub.max(-1, keepdims=True) / 127.0).astype(np.float16)
    sc = np.clip(np.round(sub / d.astype(np.float32)), 1, 127).astype(np.int8)
    q = np.clip(np.round(g / (d.astype(np.float32) * sc)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 2, 2, 32).astype(np.uint8)  # [B, half h, ql shift s, byte // 32, i] = row 4h + 2s + j
    ql = (q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)  # [B, h, j, i]: byte 32 j + i of half h
    hi = (q.reshape(-1, 2, 4, 32) >> 4)  # [B, h, t, i], row 4h + t
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    b = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1)
    return b.reshape(n, -1)


def _quantize_any(arr, qtype):
    if qtype == QT.Q4_K:
        return _quantize_q4k(arr)
    if qtype == QT.Q6_K:
        return _quantize_q6k(arr)
    return quantize(arr, qtype)


def _random_q5k(n: int, k: int, rng) -> np.ndarray:
    b = rng.integers(0, 256, size=(n * k // 256, 176), dtype=np.uint8)
    b[:, 0:2] = np.float16(rng.uniform(0.001, 0.01, size=(b.shape[0], 1))).view(np.uint8)
    b[:, 2:4] = np.float16(rng.uniform(0.001, 0.01, size=(b.shape[0], 1))).view(np.uint8)
    return b.reshape(n, -1)


def _gq(data, qtype: str, n: int, k: int) -> GGUFQuantized:
    return GGUFQuantized(data, qtype, (n, k), None, f"test {qtype}")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_encoders_round_trip(qtype):
    """The test's own encoders write blocks gguf decodes back to ~the input (so tiny models stay meaningful)."""
    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32) * 0.05
    back = dequantize(_quantize_any(x, QT[qtype]), QT[qtype]).reshape(x.shape)
    rel = np.abs(back - x).max() / np.abs(x).max()
    assert rel < (0.08 if qtype == "Q4_K" else 0.03), rel


# ====================================================================== (1) 4-bit blocks map exactly


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_1", "Q4_0"])
def test_gguf_4bit_blocks_map_exactly_onto_cuda_q4(qtype):
    rng = np.random.default_rng(1)
    n, k = 24, 768
    if qtype == "Q4_K":
        data = _random_q4k(n, k, rng)
    else:
        data = quantize(rng.standard_normal((n, k)).astype(np.float32), QT[qtype])
    ref = torch.from_numpy(dequantize(data, QT[qtype]).reshape(n, k).copy())  # gguf's own dequantization
    bias = torch.randn(n)
    # fp32 scales: bit for bit (a permuted nibble, group or row would fail here)
    lin = make_cuda_linear([_gq(data, qtype, n, k)], bias, "cpu", torch.float32)
    assert isinstance(lin, CudaQ4Linear)
    assert torch.equal(lin.dequantized(), ref)
    x = torch.randn(3, k)
    torch.testing.assert_close(lin(x), x @ ref.t() + bias, rtol=1e-5, atol=1e-5)
    # bf16 (what the model holds on CUDA): the scale and offset rounded to bf16, <= 2^-8 relative each; the kernel
    # computes q * scale + zero from them in fp32
    lin16 = make_cuda_linear([_gq(data, qtype, n, k)], None, "cpu", torch.bfloat16)
    q, s32, z32 = (torch.from_numpy(a) for a in gguf_int4_groups(data, qtype, (n, k)))
    s, z = lin16.scale.float(), lin16.zero.float()
    seen = (q.view(n, -1, 32).float() * s[..., None] + z[..., None]).reshape(n, k)  # the kernel's fp32 weights
    bound = 2.0 ** -8 * (15 * s32.abs() + z32.abs())  # bf16 keeps 8 significant bits: 2^-8 relative per rounding
    err = (seen - ref).view(n, -1, 32).abs().amax(-1)
    assert (err <= bound * (1 + 1e-6)).all()
    rel = ((seen - ref).abs().max() / ref.abs().max()).item()
    print(f"{qtype}: bf16 scale/offset, max |error| / max |w| = {rel:.2e}")
    assert rel < 2 ** -7, rel
    # and dequantized() (bf16 arithmetic, the prefill path) within one more bf16 rounding
    assert ((lin16.dequantized().float() - ref).abs().max() / ref.abs().max()).item() < 2 ** -6


def test_fp16_is_exact_for_q4_1_but_not_q4k_scales():
    """Why bf16 costs a rounding: Q4_1's d / m are fp16 values, Q4_K's d*sc (11 + 6 bits) fit neither type.
    CudaQ4Linear keeps scales in the activation dtype, so a bf16 model holds bf16 scales (see docs)."""
    rng = np.random.default_rng(2)
    q41 = quantize(rng.standard_normal((8, 256)).astype(np.float32), QT.Q4_1)
    _, s, o = gguf_int4_groups(q41, "Q4_1", (8, 256))
    for a in (s, o):
        t = torch.from_numpy(a)
        assert torch.equal(t.half().float(), t)
    _, s, _ = gguf_int4_groups(_random_q4k(8, 256, rng), "Q4_K", (8, 256))
    t = torch.from_numpy(s)
    assert not torch.equal(t.half().float(), t) and not torch.equal(t.bfloat16().float(), t)


# ====================================================================== (2) other types


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K", "Q5_0"])
def test_5_6_bit_matrices_requantized_to_int4_groups(qtype):
    rng = np.random.default_rng(3)
    n, k = 16, 512
    data = {"Q6_K": lambda: _quantize_q6k(rng.standard_normal((n, k)).astype(np.float32)),
            "Q5_K": lambda: _random_q5k(n, k, rng),
            "Q5_0": lambda: quantize(rng.standard_normal((n, k)).astype(np.float32), QT.Q5_0)}[qtype]()
    ref = torch.from_numpy(dequantize(data, QT[qtype]).reshape(n, k).copy())
    lin = make_cuda_linear([_gq(data, qtype, n, k)], None, "cpu", torch.float32)
    assert isinstance(lin, CudaQ4Linear)
    g = ref.view(n, -1, 32)
    half_step = (g.amax(-1) - g.amin(-1)) / 30  # min/max int4 rounding: at most half a step of the group range
    err = (lin.dequantized() - ref).view(n, -1, 32).abs().amax(-1)
    assert (err <= half_step * (1 + 1e-5) + 1e-7).all()
    assert torch.equal(lin.dequantized(), CudaQ4Linear(*quantize_groups_int4(ref), None, torch.float32).dequantized())


def _int8_half_step_ok(lin, ref):
    """Re-quantized to symmetric int8 groups of 32: within half a step (the stored scale) of the exact values
    (plus the one rounding of dequantized() to a 16-bit dtype)."""
    n = ref.shape[0]
    err = (lin.dequantized().float() - ref).view(n, -1, 32).abs()
    rounding = ref.abs().view(n, -1, 32) * 2.0 ** -8 if lin.dtype != torch.float32 else 0.0
    return bool((err <= lin.scale.float()[..., None] / 2 * (1 + 1e-3) + rounding + 1e-7).all())


def test_q8_0_matrices_kept_8bit_exactly_and_fused_parts_follow_the_4bit_part():
    rng = np.random.default_rng(4)
    n, k = 32, 256
    w = rng.standard_normal((n, k)).astype(np.float32)
    q8 = quantize(w, QT.Q8_0)
    ref8 = torch.from_numpy(dequantize(q8, QT.Q8_0).reshape(n, k).copy())
    for dtype in (torch.float32, torch.bfloat16):
        lin = make_cuda_linear([_gq(q8, "Q8_0", n, k)], None, "cpu", dtype)
        assert isinstance(lin, CudaQ8Linear) and lin.scale.dtype == torch.float16  # the GGUF's fp16 scales
        assert lin.weight_bytes == n * k + n * k // 32 * 2  # 8.5 bits per weight, as the file
        codes, scales = gguf_q8_0_groups(_gq(q8, "Q8_0", n, k))
        assert torch.equal(lin.codes(), codes)
        # exact: codes and scales copied (float32); in bf16 one rounding of each weight
        want = ref8 if dtype == torch.float32 else ref8.bfloat16()
        assert torch.equal(lin.dequantized(), want)
    # a tied head stays tied in the int4 layout; the int8 layout quantizes it (as the CPU int8 layout does)
    assert make_cuda_linear([_gq(q8, "Q8_0", n, k)], None, "cpu", torch.bfloat16, tied_head=True) is None
    assert isinstance(make_cuda_linear([_gq(q8, "Q8_0", n, k)], None, "cpu", torch.bfloat16, tied_head=True,
                                       layout="int8"), CudaQ8Linear)
    # fused qkv with Q4_K q/k and Q8_0 v: one int4 matrix, the 4-bit rows exact, v re-quantized
    q4 = _random_q4k(n, k, rng)
    ref4 = torch.from_numpy(dequantize(q4, QT.Q4_K).reshape(n, k).copy())
    fused = make_cuda_linear([_gq(q4, "Q4_K", n, k), _gq(q8, "Q8_0", n, k)], torch.zeros(2 * n), "cpu", torch.float32)
    assert isinstance(fused, CudaQ4Linear) and fused.out_features == 2 * n
    assert torch.equal(fused.dequantized()[:n], ref4)
    g = ref8.view(n, -1, 32)
    assert ((fused.dequantized()[n:] - ref8).view(n, -1, 32).abs().amax(-1)
            <= (g.amax(-1) - g.amin(-1)) / 30 * (1 + 1e-5)).all()
    # the int8 layout: Q8_0 parts exact beside re-quantized ones (float32 scales then), Q4_K within half a step
    fused8 = make_cuda_linear([_gq(q4, "Q4_K", n, k), _gq(q8, "Q8_0", n, k)], None, "cpu", torch.float32,
                              layout="int8")
    assert isinstance(fused8, CudaQ8Linear) and fused8.scale.dtype == torch.float32
    assert torch.equal(fused8.dequantized()[n:], ref8)
    assert _int8_half_step_ok(CudaQ8Linear(fused8.codes()[:n], fused8.scale[:n], None, torch.float32,
                                           scale_dtype=torch.float32), ref4)


def test_q6_k_head_requantized_to_int8_within_half_a_step():
    rng = np.random.default_rng(5)
    n, k = 24, 512
    data = _quantize_q6k(rng.standard_normal((n, k)).astype(np.float32))
    ref = torch.from_numpy(dequantize(data, QT.Q6_K).reshape(n, k).copy())
    # the head: not re-quantized to int4 by default (INT4_OTHERS="layers")
    part = GGUFQuantized(data, "Q6_K", (n, k), None, "tensor output.weight")
    lin = make_cuda_linear([part], None, "cpu", torch.float32)
    assert isinstance(lin, CudaQ8Linear) and lin.scale.dtype == torch.float32
    assert _int8_half_step_ok(lin, ref)
    err8 = (lin.dequantized() - ref).abs().max().item()
    err4 = (CudaQ4Linear(*quantize_groups_int4(ref), None, torch.float32).dequantized() - ref).abs().max().item()
    assert err8 < err4 / 8  # 8 bits keep ~16x less error than int4 groups would


def test_safetensors_tensors_quantized_like_from_float():
    torch.manual_seed(0)
    w, b = torch.randn(64, 96).bfloat16(), torch.randn(64)
    lin = make_cuda_linear([w[:40], w[40:]], b, "cpu", torch.bfloat16)
    assert isinstance(lin, CudaQ4Linear)
    assert torch.equal(lin.dequantized(), CudaQ4Linear.from_float(w, b).dequantized())
    assert make_cuda_linear([torch.randn(8, 40)], None, "cpu", torch.bfloat16).weight.shape == (8, 40)  # K % 32
    lin8 = make_cuda_linear([w[:40], w[40:]], b, "cpu", torch.bfloat16, layout="int8")
    assert isinstance(lin8, CudaQ8Linear) and lin8.scale.dtype == torch.bfloat16
    assert torch.equal(lin8.dequantized(), CudaQ8Linear.from_float(w, b).dequantized())
    assert _int8_half_step_ok(lin8, w.float())


# ====================================================================== (3) whole tiny models


def _write(tmp_path, kind: str, monkeypatch, q8_qk: bool = False) -> tuple[Path, dict]:
    """A tiny model as a Q4_K_M-like GGUF: Q4_K q/k/gate/up, Q6_K v (fused with Q4_K), Q4_1 o, ffn_down Q6_K
    (layer 0) / Q8_0 (layer 1), the head Q6_K (untied) or a Q8_0 embedding (tied); q8_qk: q and k Q8_0 (a Llama
    file's permuted Q/K rows then go through the Q8_0 un-permutation)."""
    monkeypatch.setattr(test_loader, "quantize", _quantize_any)
    tied = kind == "qwen2"
    hf = tiny_model(kind, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=tied)
    quant = {}
    for i in range(hf.config.num_hidden_layers):
        qk = QT.Q8_0 if q8_qk else QT.Q4_K
        for part, t in (("attn_q", qk), ("attn_k", qk), ("attn_v", QT.Q6_K), ("attn_output", QT.Q4_1),
                        ("ffn_gate", QT.Q4_K), ("ffn_up", QT.Q4_K), ("ffn_down", (QT.Q6_K, QT.Q8_0)[i % 2])):
            quant[f"blk.{i}.{part}.weight"] = t
    quant["token_embd.weight" if tied else "output.weight"] = QT.Q8_0 if tied else QT.Q6_K
    path = tmp_path / f"{kind}.gguf"
    expect = write_gguf(path, "llama" if kind == "llama" else kind, hf, quant=quant)
    return path, expect


def _logits(model, ids, dtype=torch.float32):
    llm = LLM.from_model(model, tiny_tokenizer(model.config.vocab_size), device="cpu", dtype=dtype)
    llm.runner.kv.add_sequence(1)
    with torch.no_grad():
        return llm.runner.forward([Chunk(1, ids, logits="all")])[0].logits.float()


def _kl(got, ref):
    return torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                      reduction="batchmean").item()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_gguf_loads_as_cuda_q4_close_to_fp32(tmp_path, monkeypatch, kind):
    path, expect = _write(tmp_path, kind, monkeypatch)
    ckpt = load_checkpoint(path)
    ref_model = build_model(ckpt, "cpu", torch.float32, progress=False, pack_cpu=False)
    model = build_cuda_quantized_model(ckpt, "cpu", torch.float32, progress=False)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        assert isinstance(layer.self_attn.qkv_proj, CudaQ4Linear) and isinstance(layer.mlp.gate_up_proj, CudaQ4Linear)
        # layer 0's Q6_K ffn_down is re-quantized to int4, layer 1's Q8_0 one stays 8-bit, exactly
        assert isinstance(layer.mlp.down_proj, (CudaQ4Linear, CudaQ8Linear)[i % 2])
        if i % 2:
            assert torch.equal(layer.mlp.down_proj.dequantized(), expect[f"model.layers.{i}.mlp.down_proj.weight"])
        # Q4_K rows exact, including Llama's un-permuted Q/K rows
        qk = torch.cat([expect[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qk"])
        assert torch.equal(layer.self_attn.qkv_proj.dequantized()[:qk.shape[0]], qk)
        assert torch.equal(layer.self_attn.o_proj.dequantized(), expect[f"model.layers.{i}.self_attn.o_proj.weight"])
    if kind == "qwen2":  # tied Q8_0 embedding: the head stays the embedding, no copy
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:  # Q6_K head: re-quantized to int8 groups, within half a step of the GGUF's values
        assert isinstance(model.lm_head, CudaQ8Linear) and _int8_half_step_ok(model.lm_head, expect["lm_head.weight"])
    ids = list(range(3, 60))
    ref = _logits(ref_model, ids)
    got = _logits(model, ids)
    # fp32: only the re-quantized Q6_K matrices (v, one ffn_down) differ from the dequantized model
    kl = _kl(got, ref)
    assert kl < 0.02, kl  # measured: llama 7.8e-4, qwen2 1.3e-5 (2.6e-3, 2.1e-3 with the Q8_0 / Q6_K ones bf16)
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\n{kind}: fp32 layout KL {kl:.2e} top-1 {top1:.3f}")
    assert top1 >= 0.75
    wb = weight_bytes(model)
    assert wb["quantized_linear_bytes"] > 0

    # bf16 (the CUDA dtype): bf16 scales, embedding, norms, activations
    model16 = build_cuda_quantized_model(ckpt, "cpu", torch.bfloat16, progress=False)
    assert model16.model.layers[0].self_attn.qkv_proj.scale.dtype == torch.bfloat16
    got16 = _logits(model16, ids, torch.bfloat16)
    kl16 = _kl(got16, ref)
    print(f"{kind}: bf16 layout KL {kl16:.2e} top-1 {(got16.argmax(-1) == ref.argmax(-1)).float().mean().item():.3f}")
    assert kl16 < 0.05, kl16  # measured: llama 8.2e-4, qwen2 1.4e-5


def test_tiny_gguf_cuda_q4_generates_greedy_spec_equals_plain(tmp_path, monkeypatch):
    path, _ = _write(tmp_path, "qwen2", monkeypatch)
    model = build_cuda_quantized_model(load_checkpoint(path), "cpu", torch.float32, progress=False)
    tok = tiny_tokenizer(model.config.vocab_size)
    prompts = ["t5 t6 t7 t5 t6 t7 t5 t6", "t9 t10 t11 t12 t9 t10 t11"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM.from_model(model, tok, device="cpu").generate(prompts, sp)
    assert all(len(o.token_ids) == 16 for o in plain)
    llm = LLM.from_model(model, tok, device="cpu", spec=SpecConfig(method="ngram", k=3))
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in plain]


def test_safetensors_int4_cuda_layout(tmp_path):
    hf = tiny_model("qwen2", hidden_size=128, intermediate_size=256, tie_word_embeddings=True)
    d = test_loader.save(hf, tmp_path / "m")
    ckpt = load_checkpoint(d)
    model = build_cuda_quantized_model(ckpt, "cpu", torch.float32, progress=False)
    assert isinstance(model.lm_head, CudaQ4Linear)  # as the CPU int4 layout: every linear, the tied head too
    ids = list(range(3, 40))
    assert _kl(_logits(model, ids), _logits(build_model(ckpt, "cpu", torch.float32, progress=False), ids)) < 0.2


@pytest.mark.parametrize("kind", ["gguf", "llama_gguf", "safetensors"])
def test_int8_cuda_layout_every_linear_8bit(tmp_path, monkeypatch, kind):
    """quantize="int8" on CUDA: every linear a CudaQ8Linear (the head too), logits close to the fp32 model; a Llama
    GGUF's Q8_0 q / k rows (stored permuted) come out exactly as the dequantized checkpoint's."""
    if kind == "llama_gguf":
        path, expect = _write(tmp_path, "llama", monkeypatch, q8_qk=True)
        for layout in ("int8", "int4"):  # int4: the fused qkv re-quantizes them (no 4-bit part), not exact
            model = build_cuda_quantized_model(load_checkpoint(path), "cpu", torch.float32, layout=layout,
                                               progress=False)
            if layout == "int8":
                qkv = model.model.layers[0].self_attn.qkv_proj
                qk = torch.cat([expect[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qk"])
                assert isinstance(qkv, CudaQ8Linear) and torch.equal(qkv.dequantized()[:qk.shape[0]], qk)
    if kind in ("gguf", "llama_gguf"):
        path, _ = _write(tmp_path, "qwen2" if kind == "gguf" else "llama", monkeypatch, q8_qk=kind == "llama_gguf")
    else:
        path = test_loader.save(tiny_model("qwen2", hidden_size=128, intermediate_size=256,
                                           tie_word_embeddings=True), tmp_path / "m")
    ckpt = load_checkpoint(path)
    model = build_cuda_quantized_model(ckpt, "cpu", torch.float32, layout="int8", progress=False)
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, CudaQ4Linear, CudaQ8Linear))]
    assert linears and all(isinstance(m, CudaQ8Linear) for m in linears)
    assert weight_bytes(model)["quantized_linear_bytes"] == sum(m.weight_bytes for m in linears)
    ids = list(range(3, 40))
    kl = _kl(_logits(model, ids), _logits(build_model(ckpt, "cpu", torch.float32, progress=False), ids))
    print(f"\n{kind}: int8 layout KL {kl:.2e}")
    assert kl < 0.01, kl


# ====================================================================== (4) what cannot run where


def test_parse_quantize_on_cuda_and_errors(tmp_path):
    assert parse_quantize("auto", "gguf", "cuda") == "int4"
    assert parse_quantize(None, "gguf", torch.device("cuda", 0)) == "int4"
    assert parse_quantize("auto", "safetensors", "cuda") == "none"
    assert parse_quantize("none", "gguf", "cuda") == "none"
    check_cuda_layout("int8", "cuda", torch.bfloat16)  # both quantized layouts exist on CUDA
    with pytest.raises(ValueError, match=r"^quantize='int2' has no CUDA layout; on cuda use 'int4'"):
        check_cuda_layout("int2", "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match=r"^quantize='int4' on cuda multiplies bfloat16 activations"):
        check_cuda_layout("int4", "cuda", torch.float32)
    with pytest.raises(ValueError, match=r"^quantize='int8' on cuda multiplies bfloat16 activations"):
        check_cuda_layout("int8", "cuda", torch.float32)
    with pytest.raises(ValueError, match=r"^quantize='int4' on cuda multiplies bfloat16 activations; got dtype "
                                         r"torch.float16"):  # the kernels take bf16 rows: refused, not slow
        check_cuda_layout("int4", "cuda", torch.float16)
    with pytest.raises(ValueError, match=r"^quantize='int4' runs on cpu and cuda only \(got device mps\)"):
        check_cuda_layout("int4", "mps", torch.bfloat16)
    # through build_model: refused before anything touches the device
    path = tmp_path / "t.gguf"
    write_gguf(path, "qwen2", tiny_model("qwen2"))
    with pytest.raises(ValueError, match="multiplies bfloat16 activations"):
        build_model(load_checkpoint(path), "cuda", torch.float32, progress=False, quantize="int8")
    with pytest.raises(ValueError, match="multiplies bfloat16 activations"):
        build_model(load_checkpoint(path), "cuda", torch.float32, progress=False, quantize="auto")


# ====================================================================== real models (slow)


def _real(name: str) -> Path:
    p = MODELS / f"{name}.gguf"
    if not p.exists():
        pytest.skip(f"{p} absent (forerun models pull {name})")
    return p


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_real_gguf_cuda_layout_vs_fp32_and_cpu_int4(name):
    """The real file through the CUDA layout (on the CPU), against the dequantized fp32 model and the CPU int4
    path. SmolLM2 is all Q4_1 (+ a Q8_0 tied embedding): in fp32 the CUDA layout IS the dequantized model."""
    ckpt = load_checkpoint(_real(name))
    tok = ckpt.tokenizer()
    ids = tok.encode("Speculative decoding checks a draft with one forward pass of the target model. "
                     "def fibonacci(n):\n    if n < 2:\n        return n\n")
    ref = _logits(build_model(ckpt, "cpu", torch.float32, progress=False), ids)
    got32 = _logits(build_cuda_quantized_model(ckpt, "cpu", torch.float32, progress=False), ids)
    got16 = _logits(build_cuda_quantized_model(ckpt, "cpu", torch.bfloat16, progress=False), ids, torch.bfloat16)
    cpu4 = _logits(build_model(ckpt, "cpu", torch.float32, progress=False, quantize="int4"), ids)
    kl32, kl16, klcpu = _kl(got32, ref), _kl(got16, ref), _kl(cpu4, ref)
    top = lambda a: (a.argmax(-1) == ref.argmax(-1)).float().mean().item()  # noqa: E731
    print(f"\n{name}: KL fp32 layout {kl32:.2e} (top-1 {top(got32):.3f}), bf16 layout {kl16:.2e} "
          f"(top-1 {top(got16):.3f}), CPU int4 {klcpu:.2e} (top-1 {top(cpu4):.3f}), "
          f"KL(bf16 layout | CPU int4) {_kl(got16, cpu4):.2e}")
    if name.startswith("smollm2"):  # measured: 5.6e-9, bf16 4.2e-3 (CPU int4 1.6e-2)
        assert kl32 < 1e-6 and kl16 < 0.02
    else:  # Q5_0 layers re-quantized to int4 (as on the CPU): measured 4.3e-2, bf16 4.7e-2 (CPU int4 5.6e-2)
        assert kl32 < 0.08 and kl16 < 0.08
    assert kl16 < 1.5 * klcpu  # no worse than the CPU int4 path on the same file


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels: run on the GPU machine")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_gguf_on_cuda_runs_the_q4_kernels(tmp_path, monkeypatch, kind):
    """build_model(..., "cuda", quantize="auto") keeps the 4-bit matrices 4-bit on the GPU, and decode (1 row)
    and verification-sized (4 rows) steps through the Triton kernels give the CPU layout's logits."""
    path, _ = _write(tmp_path, kind, monkeypatch)
    ckpt = load_checkpoint(path)
    model = build_model(ckpt, "cuda", torch.bfloat16, progress=False, quantize="auto")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, CudaQ4Linear) and qkv.qw32.is_cuda
    down8 = model.model.layers[1].mlp.down_proj  # the Q8_0 ffn_down: 8-bit on the GPU, through q8v_linear
    assert isinstance(down8, CudaQ8Linear) and down8.qw8.is_cuda
    ref_model = build_cuda_quantized_model(ckpt, "cpu", torch.float32, progress=False)
    ids = list(range(3, 40))
    ref = _logits(ref_model, ids)  # [37, V]
    tok = tiny_tokenizer(model.config.vocab_size)
    llm = LLM.from_model(model, tok, device="cuda", dtype=torch.bfloat16)
    llm.runner.kv.add_sequence(7)
    with torch.no_grad():
        llm.runner.forward([Chunk(7, ids[:30], logits="last")])  # prefill (> 16 rows: dequantized + cuBLAS)
        one = llm.runner.forward([Chunk(7, ids[30:31], logits="all")])[0].logits.float().cpu()  # 1 row: q4v, q8v
        four = llm.runner.forward([Chunk(7, ids[31:35], logits="all")])[0].logits.float().cpu()  # 4 rows: q4r, q8v
    for got, want in ((one, ref[30:31]), (four, ref[31:35])):
        kl = _kl(got, want)
        assert kl < 0.05, (kind, got.shape, kl)  # bf16 activations and scales vs the fp32 CPU layout
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate(["t5 t6 t7 t5 t6 t7 t5 t6"], sp)
    assert len(out[0].token_ids) == 12
    # n-gram speculation through the kernels (verify rows: q4r / q8v) gives plain decoding's tokens
    spec = LLM.from_model(model, tok, device="cuda", dtype=torch.bfloat16, spec=SpecConfig(method="ngram", k=3))
    got = spec.generate(["t5 t6 t7 t5 t6 t7 t5 t6"], sp)[0]
    assert got.token_ids == out[0].token_ids and got.stats.drafted > 0
