#!/usr/bin/env python
"""forerun on one CUDA GPU (written for an H200): decode against the memory floor, target forward cost per query
length, speculative decoding in synthetic-acceptance mode against its ideal, a batch sweep with k chosen by the
expected-throughput model, and transformers' generate on the same weights.

    python benchmarks/gpu.py            # from the repo root; ~5 minutes on an H200
    python benchmarks/gpu.py --quick    # a few layers and sizes: checks every code path in a minute

Random bf16 weights at Qwen3-8B (target) and Qwen3-0.6B (draft) shapes are built directly on the GPU. Every
sequence starts with a KV cache of --context random entries. Decode, draft and verify steps are replayed from
CUDA graphs (GraphRunner.run_uniform: inputs prepared on the device, no host sync); sampling and verification
use the fused Triton kernel. Speculation is synthetic: a round's acceptance is drawn with probability a per
draft token (the real draft forwards, target verify forward and verify kernel all run; their verdict is
overridden), so tok/s measures the machinery's cost at a known acceptance rate, not a real draft's quality.

Writes benchmarks/results/gpu_h200.json and .png (or --out) and prints a table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from forerun.config import CacheConfig, ModelConfig  # noqa: E402
from forerun.runtime.cuda_graph import GraphRunner, compile_elementwise  # noqa: E402
from forerun.runtime.runner import Chunk, ModelRunner  # noqa: E402

try:  # the measurements need triton; re-plotting a JSON (--plot) does not
    from forerun.attention.triton_backend import TritonPagedAttention
    from forerun.kernels.chain_sample import chain_sample
    from forerun.models.fused_ops import FusedLayerOps
    from forerun.kernels.skinny_gemm import skinny_linear
except ImportError:
    TritonPagedAttention = chain_sample = FusedLayerOps = skinny_linear = None
from forerun.models.layers import RotaryEmbedding  # noqa: E402
from forerun.models.llama import LlamaForCausalLM  # noqa: E402

QWEN3_8B = dict(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6,
                max_position_embeddings=40960, tie_word_embeddings=False)
QWEN3_06B = dict(arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                 num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6,
                 max_position_embeddings=40960, tie_word_embeddings=True)
DEV = torch.device("cuda")
BF16 = torch.bfloat16
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def bench_ms(fn, inner: int, outer: int = 5, warmup: int = 2) -> float:
    """Median over `outer` CUDA-event timings of `inner` back-to-back calls, per call (ms)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(outer):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return float(np.median(times))


# -- setup -------------------------------------------------------------------------------------------------
_ROOTS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
               for d in ("forerun", "benchmarks"))


def kernel_functions(roots: tuple[str, ...] | None = None) -> list[tuple[str, int]]:
    """(name, CUfunction handle) of every kernel compiled so far that forerun or a benchmark launches itself: the
    NVRTC cache (kernels/nvrtc.py) and the compiled kernels of every Triton JITFunction (autotuned or not) held by
    a module whose file lies under `roots` (forerun/ and benchmarks/ by default); torch's own kernels are not
    among them."""
    import ctypes
    import types

    from forerun.kernels import nvrtc
    roots = roots or _ROOTS
    out = [(key[1], k.func.value if isinstance(k.func, ctypes.c_void_p) else int(k.func))
           for key, k in nvrtc._kernels.items()]
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return out
    seen: set[int] = set()
    for mod in list(sys.modules.values()):
        if not (getattr(mod, "__file__", None) or "").startswith(roots):
            continue
        for v in list(vars(mod).values()):
            for _ in range(4):  # Autotuner / Heuristics hold the JITFunction in .fn
                if isinstance(v, JITFunction) or v is None:
                    break
                v = getattr(v, "fn", None) if not isinstance(v, (type, types.ModuleType)) else None
            if not isinstance(v, JITFunction) or id(v) in seen:
                continue
            seen.add(id(v))
            for entry in v.device_caches.values():  # (kernel cache, ...) per device
                for compiled in entry[0].values():
                    if getattr(compiled, "function", None):
                        out.append((v.__name__, int(compiled.function)))
    return out


def set_carveout(percent: int, roots: tuple[str, ...] | None = None) -> int:
    """Every kernel_functions() kernel's preferred shared-memory carveout (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_
    CARVEOUT: 0-100 % of the most shared memory an SM can have, -1 the driver's choice); the number set.
    RuntimeError if the driver refuses one. What it tested (session 55): whether one L1 / shared-memory split for
    every kernel, so that no kernel's blocks wait for an SM to drain before the split can change, makes the int4
    step faster. It does not (every value lost to the driver's own choices, q4_step_budget.py); it does explain
    why a resident kernel beside the chain stalled it (q4_l2_prefetcher_gpu.py)."""
    import ctypes

    if not -1 <= percent <= 100:
        raise ValueError(f"carveout {percent}: give a percentage 0-100, or -1 for the driver's choice")
    lib = torch.cuda._utils._get_gpu_runtime_library()
    funcs = kernel_functions(roots)
    for name, handle in funcs:
        # 9: CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        rc = lib.cuFuncSetAttribute(ctypes.c_void_p(handle), ctypes.c_int(9), ctypes.c_int(percent))
        if rc != 0:
            raise RuntimeError(f"cuFuncSetAttribute(preferred carveout {percent}) on kernel {name}: CUresult {rc}")
    return len(funcs)


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, dtype=BF16, device=DEV)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), inner=10, outer=5)
    del src, dst
    return 2 * n * 2 / (ms * 1e-3)


def build_model(shape: dict, num_layers: int | None, seed: int) -> LlamaForCausalLM:
    """Random bf16 weights made on the GPU (std 0.02, norms ~1); rotary tables rebuilt on the GPU."""
    cfg = ModelConfig(**{**shape, "num_layers": num_layers or shape["num_layers"]})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(BF16).to_empty(device=DEV).eval()
    if cfg.tie_word_embeddings:  # to_empty unties shared parameters
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.05, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if hasattr(model, "reset_rope"):
        model.reset_rope(DEV)
    else:
        model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict, model.max_positions).to(DEV)
    model.backend = TritonPagedAttention()
    return model


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameter bytes, bytes a decode step streams: all but an untied input embedding)."""
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    emb = model.model.embed_tokens.weight
    read = total - (0 if model.config.tie_word_embeddings else emb.numel() * emb.element_size())
    return total, read


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


@dataclass
class Side:
    """One model on the GPU: runner (KV pool, buffers) and its graph runner, with `max_seqs` sequences reserved."""
    model: LlamaForCausalLM
    runner: ModelRunner
    tables: torch.Tensor  # [max_seqs, W] block tables of sequences 0..max_seqs-1 (rows of the runner's buffers)
    graphs: GraphRunner | None = None

    def restore_tables(self) -> None:
        """Host-path steps (ModelRunner.forward) overwrite the buffers' block tables; run_uniform needs these."""
        self.runner.buffers.block_tables[: self.tables.shape[0], : self.tables.shape[1]].copy_(self.tables)


def make_side(model: LlamaForCausalLM, max_seqs: int, capacity: int) -> Side:
    blocks_per_seq = -(-capacity // 16)
    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=max_seqs * blocks_per_seq + 32), DEV, BF16,
                         max_batch_tokens=max(1024, max_seqs * 16), max_seqs=max_seqs)
    gen = torch.Generator(device=DEV).manual_seed(7)
    runner.kv.k.normal_(generator=gen)
    runner.kv.v.normal_(generator=gen)
    for i in range(max_seqs):
        runner.kv.add_sequence(i)
        runner.kv.reserve(i, capacity)
    side = Side(model, runner, runner.kv.block_table(list(range(max_seqs))).to(DEV))
    side.restore_tables()
    return side


# -- decode loops (device-driven) ------------------------------------------------------------------------
def plain_step_fn(side: Side, batch: int, ctx0: int, temperature: float):
    """A closure doing one full decode step for `batch` sequences: graph replay + sampling (chain kernel, k=0)."""
    gr = side.graphs
    ctx = torch.full((batch,), ctx0, dtype=torch.int64, device=DEV)
    last = torch.randint(0, side.model.config.vocab_size, (batch,), device=DEV)
    first = torch.arange(batch, device=DEV)
    ones = torch.ones(batch, dtype=torch.int64, device=DEV)
    no_draft = torch.full((batch,), -1, dtype=torch.int64, device=DEV)
    temps = torch.full((batch,), temperature, device=DEV)

    def step():
        logits = gr.run_uniform(last[:, None], ctx, 1)
        res = chain_sample(logits, no_draft, first, ones, temps, torch.rand(batch, 2, device=DEV), None, max_seqlen=1)
        last.copy_(res.output_token_ids[:, 0])
        ctx.add_(1)

    def reset():
        ctx.fill_(ctx0)

    return step, reset


def draft_sample(logits: torch.Tensor, inv_t: float, probs_out: torch.Tensor) -> torch.Tensor:
    """Sample one token per row from softmax(logits * inv_t); the probabilities go to probs_out [B, V]."""
    probs = torch.softmax(logits * inv_t, dim=-1)
    probs_out.copy_(probs)
    return torch.argmax(probs / torch.empty_like(probs).exponential_(), dim=-1)


def draft_step_fn(side: Side, batch: int, ctx0: int):
    gr = side.graphs
    ctx = torch.full((batch,), ctx0, dtype=torch.int64, device=DEV)
    last = torch.randint(0, side.model.config.vocab_size, (batch,), device=DEV)
    probs = torch.empty(batch, side.model.config.vocab_size, device=DEV)

    def step():
        logits = gr.run_uniform(last[:, None], ctx, 1)
        last.copy_(draft_sample(logits, 1.0, probs))
        ctx.add_(1)

    def reset():
        ctx.fill_(ctx0)

    return step, reset


def run_spec(target: Side, draft: Side, batch: int, k: int, accept: float, rounds: int, warm_rounds: int,
             ctx0: int, seed: int) -> dict:
    """Synthetic-acceptance speculative decoding: measured tok/s over `rounds` rounds (after warm-up)."""
    vocab = target.model.config.vocab_size
    rng = np.random.default_rng(seed)
    total_rounds = warm_rounds + rounds
    success = rng.random((total_rounds, batch, k)) < accept
    accepted = np.cumprod(success, axis=2).sum(axis=2)  # [rounds, B]: leading accepted drafts
    accepted_dev = torch.tensor(accepted, dtype=torch.int64, device=DEV)

    tctx = torch.full((batch,), ctx0, dtype=torch.int64, device=DEV)  # target: all committed but the newest
    last2 = torch.randint(0, vocab, (batch, 2), device=DEV)  # the draft still has to feed these two
    drafts = torch.empty(batch, k, dtype=torch.int64, device=DEV)
    qbuf = torch.zeros(batch, k + 1, vocab, device=DEV)  # draft probabilities, rows aligned with the verify rows
    first = torch.arange(batch, device=DEV) * (k + 1)
    lens = torch.full((batch,), k + 1, dtype=torch.int64, device=DEV)
    temps = torch.ones(batch, device=DEV)
    minus1 = torch.full((batch, 1), -1, dtype=torch.int64, device=DEV)

    def one_round(r: int) -> None:
        nonlocal last2
        dctx = tctx - 1
        logits = draft.graphs.run_uniform(last2, dctx, 1)
        for j in range(k):
            if j:
                logits = draft.graphs.run_uniform(drafts[:, j - 1 : j], dctx + 1 + j, 1)
            drafts[:, j] = draft_sample(logits, 1.0, qbuf[:, j])
        verify_in = torch.cat([last2[:, 1:], drafts], dim=1)  # [B, k+1]
        tlogits = target.graphs.run_uniform(verify_in, tctx, k + 1)  # [B*(k+1), V]
        draft_ids = torch.cat([drafts, minus1], dim=1).reshape(-1)
        res = chain_sample(tlogits, draft_ids, first, lens, temps, torch.rand(batch * (k + 1), 2, device=DEV),
                           qbuf.view(-1, vocab), max_seqlen=k + 1)
        n = accepted_dev[r]  # synthetic verdict overrides the kernel's
        final = res.output_token_ids.gather(1, n[:, None]).clamp_min(0)[:, 0]
        prev = torch.where(n == 0, last2[:, 1], drafts.gather(1, (n - 1).clamp_min(0)[:, None])[:, 0])
        last2 = torch.stack([prev, final], dim=1)
        tctx.add_(n + 1)
        if r % 16 == 15:  # keep the context near ctx0, where the plain step was timed (the KV content is random)
            tctx.copy_(ctx0 + (tctx - ctx0) % 256)

    for r in range(warm_rounds):
        one_round(r)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for r in range(warm_rounds, total_rounds):
        one_round(r)
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end)
    tokens = int((accepted[warm_rounds:] + 1).sum())
    return dict(batch=batch, k=k, a=accept, rounds=rounds, tokens=tokens, ms=ms, tok_s=tokens / (ms * 1e-3),
                tokens_per_round=tokens / (rounds * batch))


def expected_tokens(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a)


def verify_micro(vocab: int, batches: tuple[int, ...], k: int = 4) -> list[dict]:
    """ms per verification of `batch` requests x (k+1) rows, sampled (T = 0.8) with draft probabilities."""
    from forerun.verify import SamplingTensors, verify_chain

    out = []
    for b in batches:
        rows = b * (k + 1)
        logits = torch.randn(rows, vocab, device=DEV) * 3
        q = torch.softmax(logits + torch.randn_like(logits), -1)
        drafts = torch.multinomial(q, 1)[:, 0].view(b, k + 1)
        drafts[:, -1] = -1
        drafts = drafts.reshape(-1)
        first = torch.arange(b, device=DEV) * (k + 1)
        lens = torch.full((b,), k + 1, dtype=torch.int64, device=DEV)
        sampling = SamplingTensors(torch.full((b,), 0.8, device=DEV), torch.zeros(b, dtype=torch.long, device=DEV),
                                   torch.ones(b, device=DEV), torch.zeros(b, device=DEV))
        u = torch.rand(rows, 2, device=DEV)
        fused_fn = lambda: chain_sample(logits, drafts, first, lens, sampling, u, q, max_seqlen=k + 1)  # noqa: E731
        torch_fn = lambda: verify_chain(logits, drafts, first, lens, sampling, u, draft_probs=q, check=False)  # noqa: E731
        out.append(dict(
            batch=b, rows=rows, input_GB=2 * rows * vocab * 4 / 1e9,
            # GPU kernel time per call (profiler), then wall time per call with the host's launches included
            fused_ms=kernel_breakdown(fused_fn)["total_us"] / 1e3, torch_ms=kernel_breakdown(torch_fn, reps=3)["total_us"] / 1e3,
            fused_wall_ms=bench_ms(fused_fn, inner=10, outer=3), torch_wall_ms=bench_ms(torch_fn, inner=3, outer=3)))
    return out


def kernel_breakdown(fn, reps: int = 5, top: int = 25) -> dict:
    """GPU kernel time per call of fn (a graph replay), by kernel and by category (torch.profiler/CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = []
    for item in prof.key_averages():
        us = getattr(item, "device_time_total", None) or getattr(item, "cuda_time_total", 0)
        if us > 0:
            kernels.append(dict(name=item.key[:120], us=us / reps, count=item.count / reps))
    kernels.sort(key=lambda k: -k["us"])

    def category(name: str) -> str:
        low = name.lower()
        if "_paged_attention" in low or "_merge_splits" in low:
            return "attention (Triton)"
        if "_skinny_gemm" in low:
            return "matmul (skinny Triton)"
        if low.startswith(("_q4", "_q8", "_rows_kernel")):
            return "matmul (quantized Triton)"
        if low.startswith("q4c_"):
            return "matmul (quantized CUDA C++)"
        if "fused_decode_attention" in low:
            return "attention + RoPE (fused CUDA C++)"
        if low.startswith("decode_attention"):
            return "attention (CUDA C++)"
        if "_add_rmsnorm" in low or "_qk_norm_rope" in low:
            return "fused norm / rope / KV write (Triton)"
        if any(t in low for t in ("gemv", "gemm", "cutlass", "xmma", "sm90_", "splitk", "cublas")):
            return "matmul (cuBLAS)"
        if low.startswith("triton_"):
            return "fused elementwise (inductor)"
        if "index" in low or "scatter" in low:
            return "KV write / gather"
        return "other"

    cats: dict[str, dict] = {}
    for k in kernels:
        c = cats.setdefault(category(k["name"]), dict(us=0.0, count=0.0))
        c["us"] += k["us"]
        c["count"] += k["count"]
    return dict(total_us=sum(k["us"] for k in kernels), categories=cats, kernels=kernels[:top])


def gemm_efficiency(model: LlamaForCausalLM, bw: float, batch: int = 1) -> dict:
    """Each projection kind of all layers back to back in one graph at M = batch: ms and achieved GB/s, for cuBLAS
    (F.linear; gate/up then silu * up) and for the skinny Triton kernel as FusedLayerOps configures it."""
    layers = model.model.layers
    groups = {name: [getattr(layer.self_attn, name) for layer in layers] for name in ("qkv_proj", "o_proj")}
    groups.update({name: [getattr(layer.mlp, name) for layer in layers] for name in ("gate_up_proj", "down_proj")})
    groups["lm_head"] = [model.lm_head]
    ops = FusedLayerOps()
    out = {}

    def run(mods, fused: bool, glu: bool):
        xs = {m.weight.shape[1]: torch.randn(batch, m.weight.shape[1], dtype=BF16, device=DEV) for m in mods}

        def body():
            for m in mods:
                x = xs[m.weight.shape[1]]
                if not fused:
                    y = torch.nn.functional.linear(x, m.weight)
                    if glu:
                        g, u = y.chunk(2, dim=-1)
                        torch.nn.functional.silu(g) * u
                elif glu:
                    cfg = ops._config(x, m, glu=True)
                    if cfg is None:
                        g, u = torch.nn.functional.linear(x, m.weight).chunk(2, dim=-1)
                        torch.nn.functional.silu(g) * u
                    else:
                        skinny_linear(x, m.weight, glu=True, config=cfg)
                else:
                    ops.linear(x, m)

        body()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        ms = bench_ms(graph.replay, inner=5, outer=5)
        nbytes = sum(m.weight.numel() * m.weight.element_size() for m in mods)
        return dict(ms=ms, GBps=nbytes / (ms * 1e-3) / 1e9, of_copy_bw=nbytes / (ms * 1e-3) / bw,
                    shape=list(mods[0].weight.shape), count=len(mods))

    with torch.inference_mode():
        for name, mods in groups.items():
            out[name] = run(mods, False, name == "gate_up_proj")
            out[name]["skinny"] = run(mods, True, name == "gate_up_proj")
    torch.cuda.empty_cache()
    out["total_ms"] = sum(out[n]["ms"] for n in groups)
    out["skinny_total_ms"] = sum(out[n]["skinny"]["ms"] for n in groups)
    return out


# -- transformers baseline ---------------------------------------------------------------------------------
def hf_generate(model: LlamaForCausalLM, prompt_len: int, new_tokens: int) -> dict:
    """transformers' generate (eager PyTorch, sdpa attention, greedy) on the same weights, batch 1."""
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = model.config
    hcfg = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                       num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                       max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
                       tie_word_embeddings=cfg.tie_word_embeddings)
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(hcfg)
    missing, unexpected = hf.load_state_dict(model.hf_state_dict(), strict=False, assign=True)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    missing = [m for m in missing if m != "lm_head.weight" or not cfg.tie_word_embeddings]
    assert not missing and not unexpected, (missing, unexpected)
    with torch.device(DEV):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config)
    hf.eval()
    hf.generation_config.eos_token_id = None
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=DEV)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        # the same weights give the same logits (bf16 tolerance): our eager prefill vs transformers
        ref = hf(ids[:, :64]).logits[0].float()
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t
    assert out.shape[1] == prompt_len + new_tokens
    del hf
    return dict(transformers=transformers.__version__, prompt=prompt_len, new_tokens=new_tokens, seconds=secs,
                tok_s=new_tokens / secs, ms_per_token=secs / new_tokens * 1e3, ref_logits=ref, ids=ids[0, :64])


class _NoTextTokenizer:
    """Random weights have no vocabulary: the engine needs only decode (empty text) and the EOS id."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""

    def get_vocab(self) -> dict:
        return {}


def engine_generate(model: LlamaForCausalLM, prompt_len: int, new_tokens: int) -> dict:
    """Plain greedy decoding through forerun's public API, batch 1: what a user gets, host overhead included."""
    from forerun.engine.llm import LLM
    from forerun.sampling_params import SamplingParams

    llm = LLM.from_model(model, _NoTextTokenizer(), device="cuda", dtype=BF16, enable_prefix_caching=False)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # capture + compile
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = llm.generate([prompt], sp)[0]
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    return dict(tok_s=len(out.token_ids) / secs, tokens=len(out.token_ids), seconds=secs,
                graph_replays=llm.runner.graphs.replays, eager_steps=llm.runner.graphs.eager_steps)


def forerun_prefill_logits(side: Side, ids: torch.Tensor) -> torch.Tensor:
    """Eager prefill of a fresh sequence through the ModelRunner (host prepare, Triton attention)."""
    runner = side.runner
    seq = 10_000
    runner.kv.add_sequence(seq)
    out, _ = runner.forward([Chunk(seq, ids.tolist(), logits="all")])
    runner.kv.free(seq)
    side.restore_tables()
    return out.logits


def matmul_stream_ms(model: LlamaForCausalLM, batch: int) -> float:
    """All the decode step's weight matmuls back to back in one CUDA graph (cuBLAS, M = batch): the time to
    stream the weights through the GEMMs alone, without norms, rotary, attention or sampling."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {m.in_features: torch.randn(batch, m.in_features, dtype=BF16, device=DEV) for m in linears}

    def body():
        for m in linears:
            torch.nn.functional.linear(xs[m.in_features], m.weight)

    with torch.inference_mode():
        body()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return bench_ms(graph.replay, inner=10, outer=5)


def eager_decode_ms(side: Side, steps: int) -> float:
    """Decode through ModelRunner.forward (host prepare, no graphs), batch 1, ms per token."""
    runner, seq = side.runner, 10_001
    runner.kv.add_sequence(seq)
    runner.forward([Chunk(seq, list(range(1, 65)), logits="none")])
    tok = 5
    with torch.inference_mode():
        for _ in range(3):
            tok = int(runner.forward([Chunk(seq, [tok])])[0].logits[0].argmax())
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            tok = int(runner.forward([Chunk(seq, [tok])])[0].logits[0].argmax())
        torch.cuda.synchronize()
    runner.kv.free(seq)
    side.restore_tables()
    return (time.perf_counter() - t) / steps * 1e3


# -- the benchmark -----------------------------------------------------------------------------------------
def save(res: dict, path: str) -> dict:
    """Write the results so far (JSON; int keys become strings) and return them as written."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    out = json.loads(json.dumps(res, default=float))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few layers / sizes: a smoke run of every path")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "gpu_h200.json"))
    ap.add_argument("--context", type=int, default=512, help="cached tokens per sequence at the start")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the elementwise modules")
    ap.add_argument("--decode-only", action="store_true", help="stop after the batch-1 decode measurements")
    ap.add_argument("--only-verify", action="store_true",
                    help="re-measure only the verification kernels and update them in an existing --out JSON")
    args = ap.parse_args()
    if args.only_verify:
        with open(args.out) as f:
            res = json.load(f)
        res["verify_kernel"] = verify_micro(QWEN3_8B["vocab_size"], (1, 16, 64, 256))
        res["verify_kernel_date"] = datetime.datetime.now().isoformat(timespec="seconds")
        res = save(res, args.out)
        print_table(res)
        return
    quick = args.quick
    torch.manual_seed(0)
    batches = (1, 8) if quick else (1, 2, 4, 8, 16, 32, 64)
    accepts = (0.8,) if quick else (0.6, 0.8, 0.9)
    ks = (2, 4) if quick else (2, 3, 4, 5, 6)
    k_model = range(0, 7)
    ctx0 = args.context
    rounds, warm = (6, 2) if quick else (24, 3)
    rounds_b1 = 8 if quick else 240  # batch 1: enough rounds for the realized acceptance to settle
    capacity = ctx0 + 256 + 16 * 7 + 64  # run_spec wraps the context back every 16 rounds

    res: dict = dict(card=torch.cuda.get_device_name(0), date=datetime.datetime.now().isoformat(timespec="seconds"),
                     torch=torch.__version__, quick=quick, context=ctx0, block_size=16)
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        pass
    log(f"{res['card']}  torch {torch.__version__}")

    bw = copy_bandwidth(0.5 if quick else 2.0)
    res["copy_bandwidth_TBps"] = bw / 1e12
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")

    tmodel = build_model(QWEN3_8B, 4 if quick else None, seed=1)
    dmodel = build_model(QWEN3_06B, 2 if quick else None, seed=2)
    target = make_side(tmodel, max(batches), capacity)
    draft = make_side(dmodel, max(batches), capacity)
    models = {"target": target, "draft": draft}
    for name, side in models.items():
        total, read = weight_bytes(side.model)
        cfg = side.model.config
        res[f"{name}_shape"] = dict(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
                                    kv_heads=cfg.num_kv_heads, intermediate=cfg.intermediate_size,
                                    vocab=cfg.vocab_size, tied=cfg.tie_word_embeddings)
        res[f"{name}_weight_bytes"] = total
        res[f"{name}_streamed_bytes"] = read
        res[f"{name}_floor_ms"] = total / bw * 1e3
        log(f"{name}: {total / 1e9:.2f} GB of weights, floor {total / bw * 1e3:.3f} ms/token")

    # 1. batch-1 decode, side by side: eager; graphs with torch ops; graphs + torch.compile'd elementwise modules
    #    (the previous default); graphs + fused Triton layer kernels (the default now)
    dec: dict = {}
    for name, side in models.items():
        dec[f"{name}_eager_ms"] = eager_decode_ms(side, 8 if quick else 16)
        dec[f"{name}_matmul_stream_ms"] = matmul_stream_ms(side.model, 1)
        side.graphs = GraphRunner(side.runner, batch_sizes=batches, max_q_len=16)
        step, reset = plain_step_fn(side, 1, ctx0, 1.0)
        dec[f"{name}_graph_ms"] = bench_ms(step, inner=16, outer=3)
        reset()
        log(f"{name} b1: eager {dec[f'{name}_eager_ms']:.2f} ms, graphs {dec[f'{name}_graph_ms']:.3f} ms, "
            f"matmuls alone {dec[f'{name}_matmul_stream_ms']:.3f} ms")
    compiled = False
    if not args.no_compile:
        try:
            for side in models.values():
                compile_elementwise(side.model)
                side.graphs = GraphRunner(side.runner, batch_sizes=batches, max_q_len=16)
                side.graphs.capture(1, 1, device_prep=True)
            compiled = True
        except Exception as e:  # inductor unavailable: keep the uncompiled graphs
            log(f"torch.compile of the elementwise modules failed, continuing without: {e!r}")
            res["compile_error"] = repr(e)[:500]
            for side in models.values():
                for mod in side.model.modules():
                    mod._compiled_call_impl = None
    res["compiled_elementwise"] = compiled
    if compiled:
        for name, side in models.items():
            step, reset = plain_step_fn(side, 1, ctx0, 1.0)
            dec[f"{name}_compiled_ms"] = bench_ms(step, inner=16, outer=5)
            reset()
            log(f"{name} b1 decode, graphs + torch.compile'd elementwise: {dec[f'{name}_compiled_ms']:.3f} ms")
    # fused elementwise kernels with cuBLAS products (separates the two effects), then the default from here on:
    # fused Triton layer kernels (skinny products, add+norm, norm+rope+KV write)
    for name, side in models.items():
        side.model.ops = FusedLayerOps(max_skinny_rows=0)
        side.graphs = GraphRunner(side.runner, batch_sizes=batches, max_q_len=16)
        step, reset = plain_step_fn(side, 1, ctx0, 1.0)
        dec[f"{name}_fused_cublas_ms"] = bench_ms(step, inner=16, outer=5)
        reset()
        log(f"{name} b1 decode, graphs + fused elementwise, cuBLAS products: {dec[f'{name}_fused_cublas_ms']:.3f} ms")
    for side in models.values():
        side.model.ops = FusedLayerOps()
        side.graphs = GraphRunner(side.runner, batch_sizes=batches, max_q_len=16)
    for name, side in models.items():
        step, reset = plain_step_fn(side, 1, ctx0, 1.0)
        dec[f"{name}_ms"] = bench_ms(step, inner=16, outer=5)
        reset()
        dec[f"{name}_replay_ms"] = bench_ms(
            lambda: side.graphs.run_uniform(torch.zeros(1, 1, dtype=torch.int64, device=DEV),
                                            torch.full((1,), ctx0, device=DEV), 1), inner=16, outer=5)
        dec[f"{name}_tok_s"] = 1e3 / dec[f"{name}_ms"]
        dec[f"{name}_fraction_of_floor"] = res[f"{name}_floor_ms"] / dec[f"{name}_ms"]
        dec[f"{name}_fraction_of_streamed_floor"] = (
            (res[f"{name}_streamed_bytes"] + ctx0 * kv_bytes_per_token(side.model.config)) / bw * 1e3 / dec[f"{name}_ms"])
        if compiled:
            dec[f"{name}_fused_speedup_vs_compiled"] = dec[f"{name}_compiled_ms"] / dec[f"{name}_ms"]
        log(f"{name} b1 decode, graphs + fused Triton kernels: {dec[f'{name}_ms']:.3f} ms/token "
            f"({dec[f'{name}_tok_s']:.1f} tok/s, {100 * dec[f'{name}_fraction_of_floor']:.1f}% of floor), "
            f"forward replay {dec[f'{name}_replay_ms']:.3f} ms")
    res["decode_b1"] = dec
    save(res, args.out)

    # where the batch-1 decode time goes: kernels of one graph replay; matmul efficiency per projection
    for name, side in models.items():
        ids1 = torch.zeros(1, 1, dtype=torch.int64, device=DEV)
        ctx1 = torch.full((1,), ctx0, device=DEV)
        try:
            res[f"{name}_kernels_b1"] = kernel_breakdown(lambda: side.graphs.run_uniform(ids1, ctx1, 1))
            cats = res[f"{name}_kernels_b1"]["categories"]
            log(f"{name} b1 kernels: " + ", ".join(f"{c} {v['us']:.0f} us ({v['count']:.0f})" for c, v in cats.items()))
        except Exception as e:
            log(f"no kernel breakdown: {e!r}")
        res[f"{name}_gemm_b1"] = gemm_efficiency(side.model, bw)
        g = res[f"{name}_gemm_b1"]
        log(f"{name} matmuls b1: " + ", ".join(f"{n} {v['of_copy_bw']:.0%}" for n, v in g.items() if isinstance(v, dict))
            + f"; all {g['total_ms']:.3f} ms; skinny Triton: "
            + ", ".join(f"{n} {v['skinny']['of_copy_bw']:.0%}" for n, v in g.items() if isinstance(v, dict))
            + f"; all {g['skinny_total_ms']:.3f} ms")
    save(res, args.out)
    if args.decode_only:
        print_table(res)
        return

    # 2. target forward cost per query length (batch 1, logits for every row: verification shape)
    fwd = {}
    for q in range(1, 17):
        ids = torch.zeros(1, q, dtype=torch.int64, device=DEV)
        ctx = torch.full((1,), ctx0, device=DEV)
        fwd[q] = bench_ms(lambda: target.graphs.run_uniform(ids, ctx, q), inner=8, outer=3)
    res["target_forward_ms_by_q_b1"] = {str(q): v for q, v in fwd.items()}
    log("target forward ms by q (b1): " + " ".join(f"{q}:{v:.2f}" for q, v in fwd.items()))
    save(res, args.out)

    # 3. costs for the batch sweep: full plain / draft steps, target forwards at q = 1..7
    costs = {}
    for b in batches:
        step, reset = plain_step_fn(target, b, ctx0, 1.0)
        plain = bench_ms(step, inner=8, outer=3)
        reset()
        dstep, dreset = draft_step_fn(draft, b, ctx0)
        dms = bench_ms(dstep, inner=8, outer=3)
        dreset()
        replay = {}
        for q in range(1, 8):
            ids = torch.zeros(b, q, dtype=torch.int64, device=DEV)
            ctx = torch.full((b,), ctx0, device=DEV)
            replay[q] = bench_ms(lambda: target.graphs.run_uniform(ids, ctx, q), inner=4, outer=3)
        draft.graphs.capture(b, 2, device_prep=True)  # the first draft step of a round feeds two tokens
        costs[b] = dict(plain_step_ms=plain, draft_step_ms=dms, target_forward_ms=replay,
                        plain_tok_s=b / plain * 1e3, c=dms / plain)
        log(f"b={b}: plain step {plain:.2f} ms ({b / plain * 1e3:.0f} tok/s), draft step {dms:.2f} ms "
            f"(c={dms / plain:.3f}), target fwd q1..7 " + " ".join(f"{v:.2f}" for v in replay.values()))
    res["costs"] = costs

    # 4. speculative decoding at batch 1, synthetic acceptance, against the ideal
    spec_b1 = []
    c1 = costs[1]["c"]
    for a in accepts:
        for k in ks:
            r = run_spec(target, draft, 1, k, a, rounds_b1, warm, ctx0, seed=int(a * 100) + k)
            plain = costs[1]["plain_tok_s"]
            ideal = plain * expected_tokens(a, k) / (1 + k * c1)
            # the same formula with the acceptance this run realised (E[tokens] -> tokens per round)
            ideal_real = plain * r["tokens_per_round"] / (1 + k * c1)
            r.update(ideal_tok_s=ideal, fraction_of_ideal=r["tok_s"] / ideal, speedup=r["tok_s"] / plain,
                     ideal_realized_tok_s=ideal_real, fraction_of_ideal_realized=r["tok_s"] / ideal_real,
                     expected_tokens_per_round=expected_tokens(a, k))
            spec_b1.append(r)
            log(f"spec b1 a={a} k={k}: {r['tok_s']:.1f} tok/s (ideal {ideal:.1f}; at the realised acceptance "
                f"{ideal_real:.1f}, {100 * r['fraction_of_ideal_realized']:.1f}%), speedup {r['speedup']:.2f}x")
    res["spec_b1"] = spec_b1
    save(res, args.out)

    # 5. batch sweep: k chosen by the expected-throughput model from the measured costs
    sweep = []
    for b in batches:
        cb = costs[b]
        overhead = cb["plain_step_ms"] - cb["target_forward_ms"][1]  # prep + sampling per target step
        for a in accepts:
            def predicted(k):
                if k == 0:
                    return b / cb["plain_step_ms"] * 1e3
                t = k * cb["draft_step_ms"] + cb["target_forward_ms"][k + 1] + overhead
                return b * expected_tokens(a, k) / t * 1e3
            pred = {k: predicted(k) for k in k_model}
            k_best = max(pred, key=pred.get)
            row = dict(batch=b, a=a, k_chosen=k_best, predicted_tok_s={str(k): v for k, v in pred.items()},
                       plain_tok_s=cb["plain_tok_s"])
            if k_best:
                row["chosen_tok_s"] = run_spec(target, draft, b, k_best, a, rounds, warm, ctx0, seed=b * 7 + k_best)["tok_s"]
            else:
                row["chosen_tok_s"] = cb["plain_tok_s"]
            row["fixed_k4_tok_s"] = run_spec(target, draft, b, 4, a, rounds, warm, ctx0, seed=b * 11)["tok_s"]
            row["chosen_vs_plain"] = row["chosen_tok_s"] / cb["plain_tok_s"]
            sweep.append(row)
            res["batch_sweep"] = sweep
            save(res, args.out)
            log(f"sweep b={b} a={a}: k*={k_best}, spec {row['chosen_tok_s']:.0f} tok/s vs plain {cb['plain_tok_s']:.0f} "
                f"({row['chosen_vs_plain']:.2f}x); fixed k=4 {row['fixed_k4_tok_s']:.0f}")
    res["batch_sweep"] = sweep
    res["costs"] = {str(b): {**c, "target_forward_ms": {str(q): v for q, v in c["target_forward_ms"].items()}}
                    for b, c in costs.items()}

    # 6. transformers generate on the same target weights (batch 1)
    try:
        hf = hf_generate(tmodel, ctx0, 16 if quick else 64)
        ours = forerun_prefill_logits(target, hf.pop("ids"))
        ref = hf.pop("ref_logits")
        hf["logits_rel_err_vs_forerun"] = ((ours - ref).norm() / ref.norm()).item()
        res["transformers_generate_b1"] = hf
        log(f"transformers {hf['transformers']} generate: {hf['tok_s']:.1f} tok/s; logits rel err vs forerun "
            f"{hf['logits_rel_err_vs_forerun']:.2e}")
    except Exception as e:
        res["transformers_generate_b1"] = dict(error=repr(e)[:500])
        log(f"transformers baseline failed: {e!r}")

    # 6b. the user-facing path: LLM.generate (host-side step preparation, stop checks) on the same weights
    try:
        res["engine_generate_b1"] = engine_generate(tmodel, ctx0, 16 if quick else 128)
        log(f"engine LLM.generate b1: {res['engine_generate_b1']['tok_s']:.1f} tok/s "
            f"({res['engine_generate_b1']['graph_replays']} graph replays)")
    except Exception as e:
        res["engine_generate_b1"] = dict(error=repr(e)[:500])
        log(f"engine generate failed: {e!r}")

    # 7. verification alone: the fused kernel vs forerun.verify.verify_chain (torch), k = 4, temperature 0.8
    try:
        res["verify_kernel"] = verify_micro(target.model.config.vocab_size, (1, 16, 64, 256))
        for r in res["verify_kernel"]:
            log(f"verify b={r['batch']} ({r['rows']} rows): GPU time fused {r['fused_ms']:.3f} ms, verify_chain "
                f"{r['torch_ms']:.3f} ms; wall fused {r['fused_wall_ms']:.3f} ms, verify_chain {r['torch_wall_ms']:.3f} ms")
    except ImportError as e:
        log(f"no verify micro-benchmark: {e!r}")
    save(res, args.out)

    res["graph_replays"] = {n: s.graphs.replays for n, s in models.items()}
    res["graphs_captured"] = {n: len(s.graphs.graphs) for n, s in models.items()}
    res["elapsed_s"] = time.perf_counter() - T0
    res = save(res, args.out)
    log(f"wrote {args.out}")
    try:
        plot(res, os.path.splitext(args.out)[0] + ".png")
    except Exception as e:  # matplotlib missing: plot later with --plot
        log(f"no plot: {e!r}")
    print_table(res)


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    sweep = res["batch_sweep"]
    batches = sorted({r["batch"] for r in sweep})
    costs = res["costs"]
    ax.plot(batches, [costs[str(b)]["plain_tok_s"] for b in batches], "k-o", label="plain decode")
    for a, color in zip(sorted({r["a"] for r in sweep}), ("tab:blue", "tab:orange", "tab:green")):
        rows = [r for r in sweep if r["a"] == a]
        ax.plot([r["batch"] for r in rows], [r["chosen_tok_s"] for r in rows], "-s", color=color,
                label=f"spec, k by model, a={a}")
        ax.plot([r["batch"] for r in rows], [r["fixed_k4_tok_s"] for r in rows], ":", color=color,
                label=f"spec, k=4, a={a}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("tokens / s")
    ax.set_title("target Qwen3-8B shape, draft 0.6B shape (synthetic acceptance)")
    ax.legend(fontsize=7)

    ax = axes[1]
    spec = res["spec_b1"]
    for a, color in zip(sorted({r["a"] for r in spec}), ("tab:blue", "tab:orange", "tab:green")):
        rows = [r for r in spec if r["a"] == a]
        ax.plot([r["k"] for r in rows], [r["tok_s"] for r in rows], "-o", color=color, label=f"measured a={a}")
        ax.plot([r["k"] for r in rows], [r["ideal_tok_s"] for r in rows], "--", color=color, label=f"ideal a={a}")
        if "ideal_realized_tok_s" in rows[0]:
            ax.plot([r["k"] for r in rows], [r["ideal_realized_tok_s"] for r in rows], "x", color=color,
                    label=f"ideal at realised acceptance, a={a}")
    ax.axhline(res["decode_b1"]["target_tok_s"], color="k", lw=1, label="plain decode")
    ax.set_xlabel("k (drafts per round)")
    ax.set_ylabel("tokens / s, batch 1")
    ax.set_title("speculative decoding vs (1-a^(k+1))/((1-a)(1+kc))")
    ax.legend(fontsize=7)

    ax = axes[2]
    fwd = res["target_forward_ms_by_q_b1"]
    qs = sorted(int(q) for q in fwd)
    ax.plot(qs, [fwd[str(q)] for q in qs], "-o", label="target forward (graph replay)")
    ax.axhline(res["target_floor_ms"], color="r", ls="--", label="weights / copy bandwidth")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("query tokens (batch 1)")
    ax.set_ylabel("ms")
    ax.set_title("verification cost per query length")
    ax.legend(fontsize=7)
    fig.suptitle(f"forerun on {res['card']} ({res['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(res: dict) -> None:
    d = res["decode_b1"]
    lines = [f"forerun GPU benchmark: {res['card']}, {res['date']}, copy bandwidth {res['copy_bandwidth_TBps']:.2f} TB/s"
             f"{' (QUICK)' if res['quick'] else ''}"]
    lines.append(f"{'batch-1 decode':<34}{'target':>12}{'draft':>12}")
    for label, key, fmt in [("floor ms (weights / bandwidth)", "floor", "{:.3f}"), ("eager ms/token", "eager_ms", "{:.2f}"),
                            ("graphs, torch ops ms/token", "graph_ms", "{:.3f}"),
                            ("graphs + torch.compile ms/token", "compiled_ms", "{:.3f}"),
                            ("graphs + fused norms, cuBLAS ms/token", "fused_cublas_ms", "{:.3f}"),
                            ("graphs + fused Triton ms/token", "ms", "{:.3f}"),
                            ("tok/s", "tok_s", "{:.1f}"), ("fraction of floor", "fraction_of_floor", "{:.1%}"),
                            ("matmuls alone ms", "matmul_stream_ms", "{:.3f}")]:
        vals = [res[f"{n}_floor_ms"] if key == "floor" else d.get(f"{n}_{key}") for n in ("target", "draft")]
        lines.append(f"{label:<34}" + "".join(f"{fmt.format(v) if v is not None else '-':>12}" for v in vals))
    hf = res.get("transformers_generate_b1", {})
    if "tok_s" in hf:
        lines.append(f"transformers generate (8B shape, b1): {hf['tok_s']:.1f} tok/s; forerun is "
                     f"{d['target_tok_s'] / hf['tok_s']:.1f}x")
    eng = res.get("engine_generate_b1", {})
    if "tok_s" in eng:
        lines.append(f"forerun LLM.generate (8B shape, b1, host overhead included): {eng['tok_s']:.1f} tok/s")
    fwd = res.get("target_forward_ms_by_q_b1", {})
    lines.append("target forward ms, q=1..16: " + " ".join(f"{v:.2f}" for v in fwd.values()))
    if "costs" in res:
        lines.append(f"{'speculative, batch 1 (c = ' + format(res['costs']['1']['c'], '.3f') + ')':<34}"
                     "a    k   tok/s   ideal  %ideal  tok/round  ideal@real  %ideal@real  speedup")
    for r in res.get("spec_b1", []):
        lines.append(f"{'':<34}{r['a']:.1f}  {r['k']}  {r['tok_s']:6.1f}  {r['ideal_tok_s']:6.1f}  "
                     f"{r['fraction_of_ideal']:6.1%}  {r['tokens_per_round']:9.2f}  {r.get('ideal_realized_tok_s', 0):10.1f}  "
                     f"{r.get('fraction_of_ideal_realized', 0):11.1%}  {r['speedup']:.2f}x")
    lines.append("batch sweep: batch  a   k*  plain tok/s  spec(k*) tok/s  spec/plain  spec(k=4)")
    for r in res.get("batch_sweep", []):
        lines.append(f"{'':<13}{r['batch']:>5} {r['a']:.1f} {r['k_chosen']:>3} {r['plain_tok_s']:>12.0f} "
                     f"{r['chosen_tok_s']:>15.0f} {r['chosen_vs_plain']:>11.2f} {r['fixed_k4_tok_s']:>10.0f}")
    for name in ("target", "draft"):
        g = res.get(f"{name}_gemm_b1")
        if g:
            lines.append(f"{name} matmuls b1 (of copy bandwidth): " + " ".join(
                f"{n}={v['of_copy_bw']:.0%}" for n, v in g.items() if isinstance(v, dict))
                + f"; all {g['total_ms']:.2f} ms")
            if "skinny_total_ms" in g:
                lines.append(f"{name} skinny Triton matmuls b1 (of copy bandwidth): " + " ".join(
                    f"{n}={v['skinny']['of_copy_bw']:.0%}" for n, v in g.items() if isinstance(v, dict))
                    + f"; all {g['skinny_total_ms']:.2f} ms")
        kb = res.get(f"{name}_kernels_b1")
        if kb:
            lines.append(f"{name} decode kernels b1 ({kb['total_us'] / 1e3:.2f} ms): " + ", ".join(
                f"{c} {v['us'] / 1e3:.2f} ms/{v['count']:.0f}" for c, v in kb["categories"].items()))
    for r in res.get("verify_kernel", []):
        lines.append(f"verify b={r['batch']:>3} ({r['rows']:>4} rows, {r['input_GB']:.2f} GB in): GPU time fused "
                     f"{r['fused_ms']:.3f} ms, verify_chain {r['torch_ms']:.3f} ms"
                     + (f"; wall {r['fused_wall_ms']:.3f} / {r['torch_wall_ms']:.3f} ms" if "fused_wall_ms" in r else ""))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot":  # re-plot from a JSON: --plot results.json
        with open(sys.argv[2]) as f:
            data = json.load(f)
        plot(data, os.path.splitext(sys.argv[2])[0] + ".png")
        print_table(data)
    else:
        main()
