"""Engine: the online engine. Requests join (`add_request`) and leave (`abort`, or finishing) while it runs;
each `step()` is one scheduler decision and one round, and returns what every request gained.

The path of a request: add_request (tokenize, validate) -> Scheduler.waiting -> admitted when its first
chunk fits -> prefill chunks -> rounds (ChainRound / TreeRound: propose, one target forward, RoundSampler,
roll back) -> _commit (stop tokens / strings, max_tokens, context) -> a RequestDelta -> finished: blocks freed.
Plain decoding on CUDA graphs runs overlapped (engine/overlap.py) while nothing else needs the scheduler.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import torch

from ..config import CacheConfig, EngineConfig, SpecConfig
from ..inputs import normalize_prompt
from ..kvcache.sizing import default_cache_config, describe_pool
from ..models.compat import check_draft_compatible
from ..models.quant import weight_bytes
from ..detokenizer import IncrementalDetokenizer
from ..drafters.base import Drafter
from ..drafters.model_drafter import DraftModelDrafter, EarlyExitDrafter
from ..drafters.ngram import NgramDrafter
from ..drafters.tree_drafter import TreeDrafter, TreeShape, tree_depth_cap
from ..models.registry import load_model
from ..request import FinishReason, Request
from ..runtime.cuda_graph import enable_cuda_graphs
from ..runtime.runner import ModelRunner
from ..sampling_params import SamplingParams
from ..stats import RequestStats
from .k_policy import KPolicy
from .overlap import overlap_applies, overlapped_decode
from .overlap_spec import (overlapped_spec_rounds, request_in_scope, samples_in_scope,
                           spec_overlap_applies)
from .round import ChainRound, RoundItem, RoundResult, TreeRound
from .sampler import RoundSampler, forcing, is_coupled
from .scheduler import Scheduler


@dataclass(frozen=True)
class RequestDelta:
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    text: str  # text delta; joined deltas == the final text (text that a stop string could still cut is held back)
    logprobs: list[dict] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: RequestStats  # cumulative


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int  # the target pool (block 0, the padding block, not counted)
    kv_blocks_free: int
    num_preemptions: int
    spec_num_drafts: int  # rounds that drafted at least one token (vLLM's num_drafts)
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_accepted_per_pos: list[int]
    grammar_rejected: int = 0  # draft tokens / tree nodes cut by structured-output grammars (forerun/structured.py)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the target's prefix cache (vLLM's prefix_cache_queries)
    prefix_cache_hits: int = 0  # ... of which found there


def load_draft_model(path: str, device: torch.device | str, dtype: torch.dtype, max_positions: int | None = None,
                     quantize: str | None = "none"):
    """(model, tokenizer, checkpoint) of a separate draft model: as load_model, but in the CPU int4 layout its
    GGUF matrices with no 4-bit part (8-bit ones, the head) are int4 too (quant.DRAFT_INT4_OTHERS): a draft only
    proposes, and its steps get faster (docs/quantization.md)."""
    from ..models import quant

    with quant.int4_others(quant.DRAFT_INT4_OTHERS):
        return load_model(path, device, dtype, max_positions, quantize=quantize)


def draft_dtype(spec: SpecConfig, device: torch.device, target_dtype: torch.dtype) -> torch.dtype:
    """The draft only proposes, so its precision cannot change the output: on a CPU with native bf16
    (oneDNN packed weights) 'auto' halves its bytes; elsewhere it follows the target."""
    if spec.draft_dtype != "auto":
        return getattr(torch, spec.draft_dtype)
    from ..models.cpu_linear import fast_cpu_bf16

    return torch.bfloat16 if device.type == "cpu" and fast_cpu_bf16() else target_dtype


def check_tokenizers_match(target_tok, draft_tok) -> None:
    """Drafts are token ids: they mean the same text only if both vocabularies agree exactly."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()), key=lambda x: x[1])[:3]
        raise ValueError(f"draft and target tokenizers differ ({len(tv)} vs {len(dv)} tokens; e.g. {diff}); "
                         "a draft model must share the target's tokenizer")


def stop_holdback(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that could still grow into a stop string (so must not be shown yet)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


class Engine:
    """Not thread-safe by itself: one caller steps it (AsyncEngine's loop thread, or LLM under its lock)."""

    # adaptive k inside an overlapped speculative session: a new k > 0 goes on in the session (its device-side state
    # does not depend on k); False: a new k ends the session and the next one starts at it (the tenth session's
    # behaviour, kept for `benchmarks/online.py --restart-on-new-k`)
    KEEP_SESSION_ON_NEW_K = True
    # joins held back while an overlapped session runs (TGI's waiting_served_ratio / max_waiting_tokens): arrivals
    # wait until they number JOIN_WAIT_RATIO x the running requests or the oldest has waited JOIN_WAIT_STEPS steps,
    # so requests that finish a step or two apart are replaced in one prefill round and one session restart instead
    # of one each. 0 steps: off (the default; not measured yet). Each waiting step adds one step to a TTFT.
    JOIN_WAIT_RATIO = 0.0
    JOIN_WAIT_STEPS = 0
    # a due join is held while a running request is about to reach its max_tokens (at most k + 1 tokens left; in
    # plain sessions at most this many, a token per step), for at most this many steps after the oldest arrival's:
    # the arrival replacing it is then read in the same prefill round instead of one of its own. Applies to
    # arrivals joining a session (JOIN_IN_SESSION: a speculative session may start or go on with one held) and to
    # plain overlapped sessions (each finish ends those; a held arrival does not also end the restarted one), not
    # when speculative sessions end at every finish (their drain step gathers arrivals already; see _try_overlap).
    # Reading one 128-token prompt costs about a weight stream on the H200 (8B shape: ~7 ms, and ~2.4 ms more per
    # extra prompt in the same round: plain c = 1 / 2 / 4, run 31)
    JOIN_HOLD_STEPS = 2
    # arrivals join an overlapped speculative session (their prompt read between two of its rounds) and finished
    # requests leave it, instead of either ending it: see `_regroup`. On by default since the thirteenth session:
    # with JOIN_HOLD_STEPS, H200 runs 35-37 at a = 0.8 gave 1.18-1.21 / 1.13-1.16x plain at 16 / 32 requests
    # against 1.15-1.17 / 1.08-1.09x restarting (run 35), the same within noise elsewhere; its GPU test's one
    # failure (twelfth session) did not recur in 1200 randomized runs (benchmarks/joins_stress_gpu.py) or 8 runs of
    # the test. False: every join and finish ends the session
    JOIN_IN_SESSION = True
    # a lone arrival joining a session is read in the members' next verify forward (GraphRunner.run_uniform_join),
    # launched while the round before it runs, instead of in a forward of its own between two rounds that nothing
    # overlaps: on the H200 (8B shape) a 128-token prompt's own read cost ~10 ms beyond a steady 8 ms step at 4
    # requests (run 43), about a weight stream plus the lost overlap. False: every join reads alone
    MIX_JOINS = True
    # arrivals queued together (up to this many) join one per round, the head mixed into each verify forward; a
    # longer queue is read together in a round of their own (one weight stream for all of them). On the H200 at 4
    # requests (closed loop, run 47) 9 reads of arrivals queued together cost 24 ms each against 7.8 ms for a
    # mixed join: the later arrivals wait a round or three for their first token, the members lose nothing
    MIX_QUEUE = 4

    def __init__(self, model: str | None = None, *, spec: SpecConfig | None = None, device: str | None = None,
                 dtype: torch.dtype | None = None, cache: CacheConfig | None = None, max_num_seqs: int = 64,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 8192, seed: int = 0,
                 check_invariants: bool = False, cuda_graphs: bool = True, overlap: bool = True,
                 overlap_spec: bool = True, mixed_prefill: bool = False,
                 draft_cache: CacheConfig | None = None, quantize: str | None = None,
                 join_wait: tuple[float, int] | None = None, enable_prefix_caching: bool = True,
                 _loaded=None) -> None:
        """quantize: weights of models loaded by name / path: "none" (float), "int8" / "int4" (kept quantized,
        CPU; GGUF Q4 blocks exactly as int4), "auto" (GGUF files: int4 with forerun's C kernel, AVX512-VNNI or AVX2, else int8;
        on CUDA int4; safetensors as stored). None (default): "auto", unless ``dtype`` names a float type the
        quantized layout of the device does not compute in (CPU: float32, CUDA: bfloat16), then "none".
        See docs/quantization.md. overlap_spec: overlapped speculative rounds (engine/overlap_spec.py; greedy
        requests, a separate draft model, CUDA graphs; on by default since the eighth session's H200 run:
        1.41-1.77x plain at 1-4 requests against 1.17-1.54x without it, `benchmarks/online.py --overlap-spec`).
        mixed_prefill: True: new prompts share a round with the running requests' verify rows (chunked prefill as
        vLLM mixes it). False (default): while the running requests draft in overlapped sessions, arrivals prefill
        in a round of their own (as SGLang runs prefill batches apart), so the others' next round is a session
        round again instead of a split forward with eager drafting (see `_prefill_alone`; H200 run 19, adaptive k
        at acceptance 0.8: 0.985x plain at 64 requests against 0.942x mixed, 1.30x against 1.19x at 8, 1.52x
        against 1.46x at 2; within noise at 1 and 4 requests and with a useless draft). Prompts that do not
        qualify mix as before. join_wait=(ratio, steps): arrivals wait while a session runs until they number
        ratio x the running requests or the oldest has waited `steps` steps (JOIN_WAIT_RATIO / JOIN_WAIT_STEPS:
        fewer, larger prefill rounds for up to `steps` steps more of TTFT; off by default).
        enable_prefix_caching: a prompt that starts like an earlier request's tokens reuses their keys and values
        (the target's pool and the drafter's own: a draft model's, an EAGLE head's; kvcache/pool.py), as vLLM's
        automatic prefix caching does; on by default (as in vLLM, SGLang and llama.cpp's server)."""
        if join_wait is not None:
            ratio, steps = join_wait
            if not (ratio >= 0 and int(steps) == steps and steps >= 0):
                raise ValueError(f"join_wait must be (ratio >= 0, whole steps >= 0), got {join_wait!r}")
            self.JOIN_WAIT_RATIO, self.JOIN_WAIT_STEPS = float(ratio), int(steps)
        self.overlap_spec, self.mixed_prefill = overlap_spec, mixed_prefill
        EngineConfig(max_num_seqs, max_model_len, max_num_batched_tokens)  # validated: a bad value is named here
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if quantize is None:  # a GGUF stays quantized, unless a float dtype its layout does not compute in is asked
            native = torch.bfloat16 if self.device.type == "cuda" else torch.float32
            quantize = "auto" if dtype in (None, native) else "none"
        self.quantize = quantize
        if dtype is None and _loaded is not None:  # an already built model: its own activations' dtype
            dtype = _loaded[0].model.norm.weight.dtype
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.spec = spec or SpecConfig()
        self.model_name = model or "<in-memory>"
        target, self.tokenizer, _ = _loaded or load_model(model, self.device, self.dtype, max_model_len,
                                                          quantize=quantize)
        self.model = target
        self._draft_loaded = self._load_draft()  # before any pool: an incompatible draft is refused first
        dmodel = self._draft_loaded[0] if self._draft_loaded else None
        ddtype = next(dmodel.parameters()).dtype if dmodel is not None else None
        self.cache = cache or default_cache_config(
            target.config, self.dtype, self.device, max_num_seqs=max_num_seqs, max_model_len=target.max_positions,
            draft=dmodel.config if dmodel is not None else None, draft_dtype=ddtype,
            max_draft_tokens=self.spec.max_draft_tokens,
            weight_bytes=weight_bytes(target)["total_bytes"])
        self.draft_cache = draft_cache or self.cache  # a separate draft model's own pool
        self.pool_description = describe_pool(self.cache, target.config, self.dtype,
                                              draft=dmodel.config if dmodel is not None else None,
                                              draft_dtype=ddtype, device=self.device)
        self.max_num_seqs, self.check_invariants, self.overlap = max_num_seqs, check_invariants, overlap
        budget = max(max_num_batched_tokens, self.spec.max_draft_tokens + 2)
        # (two sequences more than the batch: a prompt joining a full session and its padding, run_uniform_join)
        self.runner = ModelRunner(target, self.cache, self.device, self.dtype, max_seqs=max_num_seqs + 2,
                                  max_batch_tokens=budget)
        self.drafter = self._make_drafter()
        self.prefix_caching = enable_prefix_caching
        if enable_prefix_caching:
            self.runner.kv.prefix_caching = True
            if getattr(self.drafter, "kv", None) is not None:  # a separate draft model's own pool
                self.drafter.kv.prefix_caching = True
        if cuda_graphs and self.device.type == "cuda":
            for runner in {id(r): r for r in (self.runner, getattr(self.drafter, "runner", None)) if r}.values():
                enable_cuda_graphs(runner, max_q_len=self.spec.max_draft_tokens + 1, max_seqs=max_num_seqs)
        self.k_policy = KPolicy(self.spec)
        if self.spec.method == "eagle" and self.spec.eagle_tree is not None:  # dynamic trees shrink as the batch
            self.drafter.use_target_cost(self.k_policy.cost)  # grows, from the target's measured costs (issue 13)
        tree = self.spec.is_tree
        self.sampler = RoundSampler(self.spec.rule, self._verify_kwargs())
        round_cls = TreeRound if tree else ChainRound
        self.round = round_cls(self.runner, self.drafter, self.sampler)
        if tree:
            self.round.lookahead = self._tree_lookahead
        self.scheduler = Scheduler(self.runner.kv, self.drafter, max_num_seqs, budget, tree)
        self.scheduler.draft_prefill = self.runner.graphs is None  # on graphs a prompt's chunk replays as pieces
        self.generator = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}  # unfinished requests by external id
        self._overlap = None  # (generator, requests) of an overlapped decoding session in progress
        self._clock_in, self._clock_t0 = 0.0, 0.0  # seconds spent inside overlapped sessions' steps (_clock)
        self._ks_cache: dict[int, int] | None = None
        self._no_session = False  # the last overlapped session launched nothing (no blocks): skip one start
        self._session: list | None = None  # the session running: [first step's seconds, later steps', tokens]
        self._steps = 0  # step() calls so far
        self._arrived: dict[int, int] = {}  # waiting request -> the step count when it was queued (JOIN_WAIT_*)
        self._last_session_spec: bool | None = None  # whether the last session drafted
        self._alone = False  # the last round read prompts alone (mixed_prefill off): the next one includes all
        self._session_extra: list[Request] = []  # requests a session step touched beyond its members (_regroup)
        self._end_session = False  # a read prompt cannot join the session running: end it (_regroup)
        self.session_reads = 0  # prefill rounds read between two rounds of a session (Engine._regroup)
        self.session_joins = 0  # requests that joined a session running (Engine._regroup)
        self.mixed_joins = 0  # ... of which read in the members' verify forward (MIX_JOINS)
        self._unread: set[int] = set()  # requests admitted for such a read (the invariant check skips them unread)
        self._spec_totals = RequestStats()
        self._spec_num_drafts = 0

    def warmup(self, max_batch: int | None = None, join_lens: tuple[int, ...] = ()) -> int:
        """Capture now the CUDA graphs that decode and verify steps replay (they are otherwise captured, and their
        Triton kernels compiled, by the first step of each shape: a stall of up to a second in the middle of
        serving). Target: every batch bucket up to max_batch (default max_num_seqs) x every verify length the
        spec can ask for (1 .. max_draft_tokens + 1; chains), plus the overlapped-decoding step; a separate draft
        model: its draft step and its merged catch-up step; an EAGLE head: its extend and tree graphs
        (`EagleDrafter.capture_graphs`). join_lens: prompt lengths (tokens) whose mixed joins (MIX_JOINS) are
        captured too, for every batch bucket and verify length (one graph per piece size that holds such a prompt;
        other lengths are captured when first read). Returns how many graphs were captured."""
        gr = self.runner.graphs
        if gr is None:
            return 0
        limit = max_batch or self.max_num_seqs
        sizes = [b for b in gr.batch_sizes if b <= limit]
        if limit > max(sizes, default=0) and gr.bucket(limit) is not None:
            sizes.append(gr.bucket(limit))
        before = len(gr.graphs)
        qs = range(1, self.spec.max_draft_tokens + 2) if self.drafter is not None and not self.spec.is_tree else [1]
        dgr = getattr(getattr(self.drafter, "runner", None), "graphs", None)
        dgr = dgr if dgr is not gr else None
        dbefore = len(dgr.graphs) if dgr is not None else 0
        hidden = tuple(self.drafter.target_hidden_layers) if self.drafter is not None else ()
        for b in sizes:
            for q in qs:
                if q <= gr.max_q_len:
                    gr.capture(b, q, q, hidden_layers=hidden)
            for n in (self._tree_sizes() if self.drafter is not None and self.spec.is_tree else ()):
                if n <= gr.max_q_len:  # a whole tree (the root and its nodes), or one cut near a request's end
                    gr.capture(b, n, n, tree=True, hidden_layers=hidden)
            if self.overlap:
                gr.capture(b, 1, 1, device_prep=True)
            if self.overlap_spec and dgr is not None and not self.spec.is_tree:  # engine/overlap_spec.py
                for q in qs[1:]:
                    if q <= gr.max_q_len:
                        gr.capture(b, q, q, device_prep=True)
                        for j in sorted({gr.join_len(b, n) for n in join_lens} - {None}):
                            gr.capture(b, q, q, device_prep=True, join_len=j)
                if dgr.max_q_len >= 2:
                    dgr.capture(b, 2, 1, device_prep=True)
                    for j in sorted({dgr.join_len(b, n - 1) for n in join_lens} - {None}):  # the draft's read of
                        dgr.capture(b, 2, 1, device_prep=True, join_len=j)  # a mixed join (overlap_spec.launch)
            if dgr is not None and self.spec.method == "draft":
                for q in (1, 2):
                    if q <= dgr.max_q_len:
                        dgr.capture(b, q, 1)
                dgr.capture(b, 1, 1, device_prep=True)  # draft steps 1.. (ModelDrafter, run_uniform)
                shape = getattr(self.drafter, "shape", None)  # a fixed tree: its level steps (TreeDrafter)
                for d, level in enumerate(shape.levels[:-1] if shape is not None else []):
                    if d and level[-1] + 1 <= dgr.max_q_len:
                        dgr.capture(b, level[-1] + 1, len(level), tree=True)
                for q in dgr.piece_sizes:  # catch-ups of many requests (forward_pieces groups their pieces)
                    if q <= dgr.max_q_len:
                        dgr.capture(b, q, 0)
        eagle_before = eagle_after = 0
        if self.spec.method == "eagle" and hasattr(self.drafter, "capture_graphs"):  # its extend and tree graphs
            static = getattr(self.drafter, "static", None)
            eagle_before = len(static.graphs) if static is not None else 0
            eagle_after = self.drafter.capture_graphs(batch_sizes=sizes) or eagle_before
        if self.device.type == "cuda" and self.spec.rule == "auto":  # the fused sampler's kernels, per power of two
            _warm_chain_sample(sizes, qs, self.model.config.vocab_size, self.device)
        # prefill pieces (GraphRunner.forward_pieces): one sequence x every piece length, with logits for the
        # last row (a prompt's last chunk) or none (earlier chunks; the draft model's prompt feed)
        # and several sequences' pieces replayed together (GraphRunner.piece_batch: prompts arriving together)
        for q in gr.piece_sizes:
            for m in (0, 1):
                gr.capture(1, q, m, hidden_layers=hidden)
                if q > gr.max_q_len:
                    for b in gr.batch_sizes:
                        if 1 < b <= min(gr.piece_batch(q), max(sizes)):
                            gr.capture(b, q, m, hidden_layers=hidden)
            if dgr is not None and self.spec.method == "draft" and q > dgr.max_q_len:
                for b in dgr.batch_sizes:
                    if b <= min(dgr.piece_batch(q), max(sizes)):
                        dgr.capture(b, q, 0)
        return len(gr.graphs) - before + (len(dgr.graphs) - dbefore if dgr is not None else 0) \
            + eagle_after - eagle_before

    @classmethod
    def from_model(cls, model, tokenizer, **kw) -> "Engine":
        """Wrap an already built model (tests, benchmarks)."""
        return cls(None, _loaded=(model, tokenizer, None), **kw)

    @property
    def max_model_len(self) -> int:
        return self.model.max_positions

    def _load_draft(self):
        """(model, tokenizer) of a separate draft model, checked against the target: its tokenizer and
        vocabulary are compared from metadata BEFORE its weights load, then once more in full."""
        s = self.spec
        if s.method != "draft":
            return None
        if isinstance(s.draft_model, tuple):  # (model, tokenizer) already built
            dmodel, dtok = s.draft_model
        else:
            check_draft_compatible(self.tokenizer, self.model.config.vocab_size, s.draft_model)
            ddtype = draft_dtype(s, self.device, self.dtype)
            dmodel, dtok, _ = load_draft_model(s.draft_model, self.device, ddtype, self.model.max_positions,
                                               self.quantize)
        check_tokenizers_match(self.tokenizer, dtok)
        if dmodel.config.vocab_size != self.model.config.vocab_size:
            raise ValueError(f"draft vocab size {dmodel.config.vocab_size} != target {self.model.config.vocab_size}")
        if s.draft_vocab is not None:  # the draft ranks part of the vocabulary (models/vocab_subset.py)
            from ..models.vocab_subset import restrict_head, special_token_ids

            restrict_head(dmodel, s.draft_vocab, special_token_ids(dtok))
        return dmodel, dtok

    def _make_drafter(self) -> Drafter | None:
        s = self.spec
        if s.method == "ngram":
            return NgramDrafter(s.ngram_min, s.ngram_max)
        if s.method == "early-exit":
            return EarlyExitDrafter(self.runner, s.early_exit_layers, s.confidence_threshold)
        if s.method == "eagle":
            from ..drafters.eagle import EagleDrafter

            tk, steps, nodes = s.eagle_tree or (4, 4, 16)
            return EagleDrafter(self.runner, os.path.expanduser(s.eagle_head), cache=self.draft_cache if self.draft_cache is not self.cache else None,
                                tree_topk=tk, tree_steps=steps, tree_nodes=nodes, max_seqs=self.max_num_seqs,
                                max_batch_tokens=self.runner.buffers.max_tokens,
                                tree_confidence=s.confidence_threshold if s.eagle_tree is not None else 0.0)
        if s.method == "draft":
            dmodel, _ = self._draft_loaded
            ddtype = next(dmodel.parameters()).dtype
            runner = ModelRunner(dmodel, self.draft_cache, self.device, ddtype, max_seqs=self.max_num_seqs,
                                 max_batch_tokens=self.runner.buffers.max_tokens)
            if s.tree is not None:
                return TreeDrafter(runner, s.tree)
            return DraftModelDrafter(runner, confidence_threshold=s.confidence_threshold)
        return None

    def _verify_kwargs(self) -> dict:
        s = self.spec
        if s.rule == "penalty":
            return {"penalty": s.draft_prob_penalty}
        if s.rule == "typical":
            return {"typical_epsilon": s.typical_epsilon, "typical_delta": s.typical_delta}
        return {}

    # -- requests --------------------------------------------------------------------------------------
    def make_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None, *,
                     chat: bool = False) -> Request:
        """Tokenize and validate one request (raises ValueError, naming it); does not queue it."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        rid = next(self._ids)
        ext = str(request_id) if request_id is not None else f"req-{rid}"
        if ext in self.requests:
            raise ValueError(f"request id {ext!r} is already in use")
        prompt = normalize_prompt(prompt)
        if isinstance(prompt, str):
            text = prompt
            if chat:
                ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                         add_generation_prompt=True, tokenize=True)
                ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            else:
                ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, [int(t) for t in prompt]
        else:
            raise TypeError(f"request {ext}: a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"request {ext}: empty prompt")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"request {ext}: token id out of range [0, {vocab})")
        if params.forced_tokens and max(params.forced_tokens) >= vocab:
            raise ValueError(f"request {ext}: forced_tokens entry out of range [0, {vocab})")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"request {ext}: prompt of {len(ids)} tokens is too long for the context of {limit} "
                             "(it needs room for at least one new token)")
        kv = self.runner.kv
        need = min(len(ids) + params.max_tokens, limit) + self.spec.max_draft_tokens + 1
        if need > kv.capacity_tokens:
            raise ValueError(f"request {ext}: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) needs {need} tokens "
                             f"of KV cache, the pool holds {kv.capacity_tokens}; lower max_tokens or raise the KV "
                             "memory budget")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.model.config.eos_token_ids)
            if self.tokenizer.eos_token_id is not None:
                stops.add(self.tokenizer.eos_token_id)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (), generator=self.generator))
        r = Request(rid, text, ids, params, torch.Generator().manual_seed(seed), frozenset(stops),
                    detokenizer=IncrementalDetokenizer(self.tokenizer), external_id=ext, arrival=time.monotonic())
        r.coupled = is_coupled(r, self.spec.rule)
        if params.structured_output is not None:  # issue 14: the request's grammar matcher (forerun/structured.py)
            r.grammar = self._grammar_compiler().new_state(params.structured_output)
        return r

    def _grammar_compiler(self):
        """issue 14: one xgrammar compiler per engine (tokenizer + the model's vocab size), built on first use."""
        if getattr(self, "_grammars", None) is None:
            from ..structured import GrammarCompiler

            stops = set(self.model.config.eos_token_ids) | {self.tokenizer.eos_token_id} - {None}
            self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, stops)
        return self._grammars

    def enqueue(self, r: Request) -> str:
        if r.external_id in self.requests:
            raise ValueError(f"request id {r.external_id!r} is already in use")
        self.requests[r.external_id] = r
        self.scheduler.add(r)
        self._arrived[r.req_id] = self._steps
        return r.external_id

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None, *,
                    chat: bool = False) -> str:
        """Validate and queue a request (a string, or a list of token ids); returns its id."""
        return self.enqueue(self.make_request(prompt, params, request_id, chat=chat))

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its KV blocks (target and draft) go back at once (or, in an overlapped decoding
        session, at the next step: it leaves a speculative session (JOIN_IN_SESSION) or ends a plain one, at most two
        steps later). Nothing more of it is reported by step(). False if it is unknown or already finished."""
        r = self.requests.get(str(request_id))
        if r is None or r.finished:
            return False
        r.finish_reason, r.finished_time = FinishReason.ABORT, time.monotonic()
        r.sent_tokens = -1  # its last delta is the caller's (finish_abort_delta): a later step reports nothing of it
        if self._overlap is None or r not in self._overlap[1]:
            self._finish(r)
            del self.requests[r.external_id]
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks in every pool (target, and the drafter's own), as vLLM's
        reset_prefix_cache: e.g. after weights change. Blocks running requests hold stay until they finish; returns
        whether every pool's cache is empty now."""
        pools = {id(kv): kv for kv in (self.runner.kv, getattr(self.drafter, "kv", None)) if kv is not None}
        return all([kv.reset_prefix_cache() for kv in pools.values()])

    def _finish(self, r: Request) -> None:
        self.scheduler.remove(r)
        self.k_policy.forget(r.req_id)
        self._arrived.pop(r.req_id, None)
        self._unread.discard(r.req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._overlap is not None

    def stats(self) -> EngineStats:
        kv, t = self.runner.kv, self._spec_totals
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), kv.num_blocks - 1,
                           kv.num_free_blocks, self.scheduler.num_preemptions, self._spec_num_drafts,
                           t.drafted_nodes, t.accepted, list(t.accepted_at),
                           self._grammars.num_rejected_drafts if getattr(self, "_grammars", None) is not None else 0,
                           kv.prefix_queries, kv.prefix_hits)

    # -- one step ---------------------------------------------------------------------------------------
    def step(self) -> list["RequestDelta"]:
        """One scheduler decision and one round (or one overlapped decoding step); returns the deltas."""
        touched: list[Request] = []
        self._steps += 1
        if self._overlap is not None:
            touched = self._overlap_step()
        elif self.scheduler.has_unfinished():
            touched = self._round_step()
        deltas = [d for d in (self._delta(r) for r in touched) if d is not None]
        for r in touched:
            if r.finished and self.requests.get(r.external_id) is r and \
                    (self._overlap is None or r not in self._overlap[1]):
                del self.requests[r.external_id]
        return deltas

    def _k_for(self, reqs: list[Request]) -> list[int]:
        """Drafts per request this round (0 = plain decoding), capped by the room each has left. Trees: the nodes
        beyond the root of the tree that fits (`_tree_drafts`), 0 when not even one draft does."""
        if self._ks_cache is not None:  # decided already this step (by _try_overlap): asking again would
            cache, self._ks_cache = self._ks_cache, None  # count the round twice and lose a due probe
            if all(r.req_id in cache for r in reqs):
                return [cache[r.req_id] for r in reqs]
        limit = self.max_model_len
        if self.spec.is_tree:
            return [0 if forcing(r) else self._tree_drafts(r) for r in reqs]  # golden tokens: plain rows (the chain
            # verifier forces them)
        room = [max(0, min(r.remaining - 1, limit - r.num_tokens - 1)) for r in reqs]
        if self.runner.graphs is None or not self.spec.enabled:
            # (the plain check times a round of these requests decoding: not a prompt's last chunk being read)
            kv = self.runner.kv
            steady = all(kv.has(r.req_id) and kv.length(r.req_id) == r.num_tokens - 1 for r in reqs)
            lags = remaining = None
            if self._catch_up_priced:  # what each draft cache lacks: drafting must repay its catch-up
                lags = [self._draft_lag(r) for r in reqs]
                remaining = [r.remaining for r in reqs]
            return self.k_policy.ks([r.req_id for r in reqs], room, plain_check=steady, lags=lags,
                                    remaining=remaining, batch=self._decode_batch(reqs) if lags is not None else None)
        # CUDA graphs replay uniform steps only: a ragged verify batch (k differing per request) would run
        # eagerly, several times slower; so the batch drafts one k, chosen for the batch as a whole. A request
        # near its max_tokens drafts it too (commit drops what lies past its end); only the context caps it.
        if self.spec.adaptive:
            k = self.k_policy.batch_k([r.req_id for r in reqs], room)
        else:
            k = min(self.spec.k, max(room, default=0))
        return [max(0, min(k, limit - r.num_tokens - 1)) for r in reqs]

    # the CPU path prices the draft's catch-ups (prompt reads, plain stretches) against what drafting saves; False:
    # every prompt is read by the draft while adaptive k drafts (the fifteenth session's behaviour, kept for
    # `benchmarks/online.py --cpu --catch-up both`)
    PRICE_CATCH_UP = True

    @property
    def _catch_up_priced(self) -> bool:
        """Adaptive k per request on the CPU (no CUDA graphs; the host waits for each forward, so a feed's wall time
        is its cost) with a separate draft model: its reads of prompts and of plain stretches are timed and priced
        against what drafting saves (KPolicy.catch_up_pays). (On CUDA graphs the batch drafts one k and the draft's
        catch-ups are priced by the session start costs and the veto.)"""
        return (self.PRICE_CATCH_UP and self.spec.adaptive and self.spec.method == "draft" and self.runner.graphs is None
                and self.runner.device.type == "cpu"
                and self.drafter is not None and self.drafter.kv is not None)

    def _on_feed(self, tokens: int, seconds: float) -> None:
        """The drafter read `tokens` tokens its cache lacked in `seconds`: the cost model's feed record, and a read
        longer than a round leaves behind (what catch_up_pays prices) is kept apart from the round's realized time."""
        self.k_policy.cost.record_draft_feed(tokens, seconds)
        if tokens > self.spec.max_draft_tokens + 2:
            self._read_seconds += seconds

    def _feed_pays(self, r: Request) -> bool:
        """Whether the draft reads this request's prompt as the target does: drafting over its answer (its
        max_tokens left), at the batch size it will decode in, saves more than the read costs."""
        return self.k_policy.catch_up_pays(r.req_id, self._draft_lag(r), r.remaining, self._decode_batch([r]))

    def _decode_batch(self, reqs: list[Request]) -> int:
        """The batch these requests will decode in: the running requests, these, and the waiting ones (admitted as
        the pools allow; at most max_num_seqs). A prompt is admitted alone (k_for([r])) before the one queued
        behind it: priced at its own batch of one, the draft read every prompt of two that arrived together."""
        sched = self.scheduler
        ids = {r.req_id for r in sched.running} | {r.req_id for r in reqs}
        waiting = sum(1 for r in sched.waiting if r.req_id not in ids)
        return max(1, min(sched.max_num_seqs, len(ids) + waiting))

    def _draft_lag(self, r: Request) -> int:
        """Committed tokens of r that the draft's own cache (which the caller knows exists) does not hold."""
        kv = self.drafter.kv
        return r.num_tokens - (kv.length(r.req_id) if kv.has(r.req_id) else 0)

    def _tree_lookahead(self, reqs: list[Request], accepted_max: int, nodes: int) -> bool:
        """TreeRound's check before it queues the next round's verify step from the device verdict: the next round
        will be these requests' tree round (nobody waits to join, nobody else runs) and every next tree of `nodes`
        nodes fits its context whatever this round accepts (at most accepted_max drafts plus the bonus token)."""
        sched = self.scheduler
        if sched.waiting or len(sched.running) != len(reqs):
            return False
        return all(r.num_tokens + accepted_max + 1 + nodes < self.max_model_len for r in reqs)

    def _tree_drafts(self, r: Request) -> int:
        """Nodes beyond the root of the tree request r drafts this round: the configured tree cut to what fits, as
        a chain is cut to its room. Its depth is at most remaining - 1 (a round commits its accepted path plus one
        token; nothing past max_tokens is kept) and it holds at most limit - num_tokens - 1 drafts (the context
        room: no node's position reaches max_model_len, nothing committed past it). A static tree (method 'draft')
        takes its deepest prefix within both; a dynamic EAGLE tree keeps min(nodes - 1, room) nodes, and the drafter
        caps its steps at the same depth (`tree_depth_cap`). 0: not even one draft fits (a plain row). Before,
        a tree was drafted only when the whole of it fitted, so the last `steps` tokens of every request were
        decoded one per round."""
        room = self.max_model_len - r.num_tokens - 1
        depth = tree_depth_cap(r, room)
        if depth < 1:
            return 0
        if self.spec.tree is not None:
            return self._tree_shape.nodes_upto(self._tree_shape.prefix_depth(depth, room)) - 1
        return min(self.spec.max_draft_tokens, room)

    @property
    def _tree_shape(self) -> TreeShape:
        """The static tree (method 'draft' with a tree): the drafter's, else built from the configured branching."""
        return getattr(self.drafter, "shape", None) or TreeShape.from_branching(self.spec.tree)

    def _tree_sizes(self) -> list[int]:
        """Node counts (root included) of the trees `_tree_drafts` gives away from the context limit: the whole tree
        and, near a request's end, the tree cut to each depth (a static tree's prefixes; a greedy EAGLE tree of
        fewer steps keeps min(nodes, its candidates)). The verify steps warmup captures."""
        if self.spec.tree is not None:
            return [self._tree_shape.nodes_upto(d) for d in range(1, len(self.spec.tree) + 1)]
        from ..drafters.eagle import TreeLayout

        k, steps, nodes = self.spec.eagle_tree
        k = min(k, getattr(getattr(self.drafter, "head", None), "draft_vocab_size", k))
        return sorted({TreeLayout.get(k, d, nodes).greedy_nodes for d in range(1, steps + 1)})

    def _round_step(self) -> list[Request]:
        sched = self.scheduler
        if self._no_session:  # the last session could not launch a step (no blocks): an ordinary round, which
            self._no_session = False  # preempts; starting a session again would end at once, forever
        elif self._try_spec_overlap() or self._try_overlap():
            self._alone = False  # (the running requests take part in the session)
            return self._overlap_step()
        t_start = time.perf_counter()
        self._read_seconds = 0.0  # this round's draft reads that catch_up_pays priced (_on_feed)
        self.round.feed_prefill = not self.k_policy.idle()  # adaptive k at 0: new prompts skip the drafter
        if self._catch_up_priced:  # (the CPU path) a prompt is read by the draft where drafting repays the read
            self.round.feed_filter = self._feed_pays
            self.drafter.on_feed = self._on_feed  # (its prompt reads and catch-ups, timed)
        self._session = None  # (an ordinary round: no session runs)
        out = None
        if self._prefill_alone():  # (prompts read alone draft nothing: the k policy is not asked)
            out = sched.schedule(lambda reqs: [0] * len(reqs), prefill_only=True)
        self._alone = out is not None and bool(out.items or out.failed)
        if not self._alone:  # the usual round (also when no prompt could start alone)
            out = sched.schedule(self._k_for)
        self._ks_cache = None
        touched = []
        for r, msg in out.failed:
            r.finish_reason, r.error, r.finished_time = FinishReason.ERROR, msg, time.monotonic()
            self.k_policy.forget(r.req_id)
            self._arrived.pop(r.req_id, None)
            touched.append(r)
        if not out.items:
            return touched
        items = out.items
        # (read before the round moves the draft's cache; only the veto's record below uses it)
        realized = self.spec.adaptive and (self.runner.graphs is not None or self._catch_up_priced)
        switch = realized and self._draft_lags([it.request for it in items if it.final and it.feed == 1 and it.k > 0])
        res = self.round.run(items)
        self._observe(res, items)
        if any(it.final and it.feed == 1 for it in items):  # a round that decoded (not only read prompts): the
            self._last_session_spec = any(res.num_drafted)  # mode the next session's start follows (record_session)
        touched += self._commit_items(items, res)
        if self.spec.adaptive and self.overlap and self.runner.graphs is not None and any(res.num_drafted) \
                and res.target_tokens == res.sampled_rows:
            # (timed rounds synchronise the device, so these are real) what a speculative round costs beyond
            # its kernels: plain decoding on CUDA graphs runs overlapped and does not pay it, so the k policy
            # must weigh it (without overlap both pay it, once per round: recorded below for every round)
            self.k_policy.cost.record_spec_overhead(time.perf_counter() - t_start - res.target_seconds - res.draft_seconds)
        elif self.spec.adaptive and self.runner.graphs is None and res.target_tokens == res.sampled_rows \
                and res.sampled_rows:
            # no overlapped decoding: plain and speculative rounds pay the host work alike, once per round
            wall = time.perf_counter() - t_start
            self.k_policy.cost.record_round_overhead(wall - res.target_seconds - res.draft_seconds)
            if not any(res.num_drafted) and all(it.final and it.feed == 1 for it in items):
                self.k_policy.record_plain_round(len(items), wall)  # (what the veto weighs drafting against)
        if realized and any(res.num_drafted) and not switch:
            # what the round delivered, host work, the draft's catch-up over new prompts and stalls included
            # (not a round whose draft first catches up on a stretch of plain decoding: that is paid once, as a
            # session's first look is left out in _try_spec_overlap, `_draft_lags`):
            # batch_k overrules its cost model when speculative rounds realize less than plain decoding would.
            # A round carrying a new prompt's prefill is compared with the same round without drafting (plain
            # pays that prefill too): against plain's bare predicted step, 16 requests arriving every few rounds
            # vetoed drafting that paid (adaptive 0.94x plain where fixed k = 4 ran at 1.03x); left out, the veto
            # saw few rounds at 64 requests (1-2 arrivals per round) and never fired (0.94x plain)
            wall = time.perf_counter() - t_start
            committed = sum(len(res.emitted[i]) for i, it in enumerate(items) if it.final)
            n = len({it.request.req_id for it in items})
            plain = None
            if res.target_tokens != res.sampled_rows:
                cost = self.k_policy.cost
                finals = sum(1 for it in items if it.final)
                rows = sum(res.drafted_nodes or res.num_drafted)  # verify rows beyond one per request
                tokens = res.target_tokens  # (on top of the prefill: a flat slope at small counts would undercount)
                extra = max(0.0, cost.target_time(tokens) - cost.target_time(max(1, tokens - rows)))
                plain = (finals, max(wall - res.draft_seconds - extra, 0.05 * wall))
            # (less the draft's reads of stretches longer than a round leaves behind, a new prompt's above all:
            # catch_up_pays priced each before it ran, and counted again here the first rounds of every request,
            # one prompt read in an 8-round window, realized less than plain and vetoed drafting for the rest of
            # the request and, remembered, for the next: adaptive k ran 1.03x plain where k = 2 ran 1.09x, 20
            # prompts one at a time on the Zen 3, session 38)
            self.k_policy.record_realized(n, committed, max(wall - self._read_seconds, 0.05 * wall), plain)
        if self.check_invariants:
            self._check([it.request for it in items if it.final])
        for it in items:
            if it.request.finished:
                self._finish(it.request)
        return touched

    def _commit_items(self, items: list[RoundItem], res: RoundResult) -> list[Request]:
        """Commit a round's tokens to the requests whose item sampled (not a prompt's middle chunk)."""
        touched = []
        for i, it in enumerate(items):
            r = it.request
            if not it.final:
                continue
            if self.drafter is not None:
                self.k_policy.observe(r.req_id, res.num_drafted[i], res.num_accepted[i], wanted=it.k)
            self._count_spec(res.num_drafted[i], res.num_accepted[i], res.drafted_nodes[i])
            n = self._commit(r, res.emitted[i], res.logprobs[i])  # (a stop or max_tokens may cut the round)
            r.stats.record(res.num_drafted[i], res.num_accepted[i], n, res.drafted_nodes[i])
            touched.append(r)
        return touched

    def _count_spec(self, drafted: int, accepted: int, nodes: int) -> None:
        if drafted:
            self._spec_num_drafts += 1
            self._spec_totals.record(drafted, accepted, 0, nodes)

    def _observe(self, res: RoundResult, items: list[RoundItem]) -> None:
        """Feed the cost model with decode/verify rounds only: a prefill's per-token cost is not a verify's."""
        cost = self.k_policy.cost
        if res.target_tokens == res.sampled_rows and res.sampled_rows:
            cost.record_target(res.target_tokens, res.target_seconds)
        if res.draft_step_seconds is not None:
            ks = [it.k for it in items if it.final and it.k > 0]  # (steps past the first are timed: with several
            # k their batches shrink step by step, and the step is kept in the pooled record only)
            cost.record_draft_step(res.draft_step_seconds, len(ks) if len(set(ks)) == 1 else None)

    @property
    def _in_session(self) -> bool:
        """Whether arrivals join overlapped speculative sessions (JOIN_IN_SESSION; never with mixed_prefill)."""
        return self.JOIN_IN_SESSION and not self.mixed_prefill

    def _joins_due(self, hold_k: int | None = None) -> bool:
        """Whether waiting requests should join now (end the session, or not start one): any wait, unless joins
        are held back (JOIN_WAIT_STEPS > 0) and fewer than JOIN_WAIT_RATIO x the running requests wait, the oldest
        for fewer than JOIN_WAIT_STEPS steps. hold_k (the k of the session asking; 0: plain): also held while a
        running request has at most hold_k + 1 tokens left to its max_tokens (plain sessions: JOIN_HOLD_STEPS, a
        token per step), for at most JOIN_HOLD_STEPS steps after the oldest arrival's (its replacement is then read
        with it)."""
        sched = self.scheduler
        if not sched.waiting:
            return False
        if not sched.running:
            return True
        oldest = min(self._arrived.get(r.req_id, self._steps) for r in sched.waiting)
        if hold_k is not None and self._steps - oldest <= self.JOIN_HOLD_STEPS and \
                any(not r.finished and r.remaining <= max(hold_k + 1, self.JOIN_HOLD_STEPS) for r in sched.running):
            return False
        if self.JOIN_WAIT_STEPS <= 0 or len(sched.waiting) >= self.JOIN_WAIT_RATIO * len(sched.running):
            return True
        return self._steps - oldest >= self.JOIN_WAIT_STEPS

    # -- overlapped plain decoding (CUDA graphs) ---------------------------------------------------------
    def _try_overlap(self) -> bool:
        """Start an overlapped session when every running request is past its prefill, nothing waits, and the
        draft-length policy gives k = 0 to all (no drafter, or adaptive k at 0 until its next probe)."""
        sched = self.scheduler
        # the join hold (JOIN_HOLD_STEPS) starts plain sessions with an arrival held: without a drafter, or when
        # arrivals join speculative sessions too (then _try_spec_overlap held it first and asked the k policy:
        # its k = 0 is reused below). Restarting speculative sessions do not hold: a held arrival would make this
        # ask the k policy, and a k > 0 would be lost to the prompt's round that follows (a probe among them)
        hold = 0 if self.drafter is None or self._in_session else None
        if not self.overlap or self._joins_due(hold_k=hold) or not sched.running or self.spec.is_tree:
            return False
        running = list(sched.running)
        limit = self.max_model_len
        if any(getattr(r, "grammar", None) is not None or forcing(r) for r in running):
            return False  # overlapped decoding samples without grammar masks or golden tokens
        if not overlap_applies(self.runner, running, limit, self.spec.rule):
            return False
        if self.drafter is not None:
            if not self.spec.adaptive:
                return False
            ks = self._k_for(running)
            if any(ks):  # the k policy counted this round: the scheduler reuses its answer
                self._ks_cache = {r.req_id: k for r, k in zip(running, ks)}
                return False
        ids = [r.req_id for r in running]
        steps = self.k_policy.rounds_before_probe(ids) if self.drafter is not None else None
        gen = overlapped_decode(self.runner, running, limit, self._commit_overlapped, self.sampler,
                                max_steps=steps,
                                should_stop=lambda: self._joins_due(hold_k=hold) or any(r.finished for r in running),
                                step_time=self.k_policy.cost.record_target if self.drafter is not None else None)
        self._overlap = (gen, running, False)
        return True

    def _prefill_alone(self) -> bool:
        """Whether this round reads new prompts without the running requests (mixed_prefill off): they all run
        greedy overlapped speculative rounds and would otherwise pay a mixed round (a split forward, the draft
        catching up eagerly, one host wait) for ~2.5 tokens each. A prompt read alone costs its prefill; the
        session that follows gives the others their tokens. At most one such round runs between two rounds of
        the running requests, and only for an arrival that can join their session (greedy, in the session's
        scope, a graph for the larger batch); a prompt read in chunks mixes after its first chunk."""
        sched = self.scheduler
        if self._alone:  # the running requests sat the last round out: they take part in this one
            return False
        if (self.mixed_prefill or not self.overlap_spec or self.spec.method != "draft" or self.spec.is_tree
                or not sched.waiting or not sched.running or self.runner.graphs is None or self.k_policy.idle()):
            return False
        running = list(sched.running)
        if not samples_in_scope(sched.waiting[0]) or self.runner.graphs.bucket(len(running) + 1) is None:
            return False
        k = self.spec.k if not self.spec.adaptive else max(1, self.spec.k)  # (the scope check only)
        return spec_overlap_applies(self.runner, self.drafter, running, k, self.max_model_len)

    def _try_spec_overlap(self) -> bool:
        """Start a session of overlapped speculative rounds (engine/overlap_spec.py) when every running request
        is past its prefill, nothing waits, the batch drafts one k > 0 and the session's scope fits."""
        sched = self.scheduler
        # (joining sessions, an arrival held for a request about to finish (JOIN_HOLD_STEPS) lets one start: the
        # arrival joins it once due; k_max bounds the k the session will draft)
        hold = self.spec.max_draft_tokens if self._in_session else None
        if (not self.overlap_spec or self.spec.method != "draft" or self.spec.is_tree or not self.spec.enabled
                or self._joins_due(hold_k=hold) or not sched.running):
            return False
        running = list(sched.running)
        ks = self._k_for(running)
        k = ks[0] if len(set(ks)) == 1 else 0
        if not k or not spec_overlap_applies(self.runner, self.drafter, running, k, self.max_model_len):
            self._ks_cache = {r.req_id: kk for r, kk in zip(running, ks)}  # this step's rounds reuse the decision
            return False
        # times are read from the engine's own clock (time spent inside step(): what the caller does between
        # steps is not the rounds' cost); the first look comes after the draft's catch-up at the session start
        # switch: drafting starts after plain decoding (a probe, or the model's k > 0), whose first look spans the
        # draft's catch-up over every token of the plain stretch: paid once, it is not what the rounds realize
        # hold: a prompt read in the members' verify forward (MIX_JOINS) is in flight, from its admission to its
        # first token: the looks in between are left out of the realized rate (see commit)
        seen = {"t": self._clock_in, "tokens": sum(len(r.output_token_ids) for r in running), "kernels": None,
                "steady": False, "switch": self._draft_lags(running), "hold": False}
        cost = self.k_policy.cost

        def timing(kk: int, draft_s: float, verify_s: float, b: int) -> None:
            # the cost model learns from these rounds as from ordinary ones: without them a session left the
            # draft-step cost unmeasured (drafting looked free: a useless draft ran at k = 8, 0.65-0.84x plain)
            cost.record_draft_step(draft_s / kk, b)
            cost.record_target(b * (kk + 1), verify_s)
            seen["kernels"] = draft_s + verify_s

        def commit(r: Request, tokens: list[int], accepted: int, kk: int) -> int:
            if r.finished:  # aborted while its round was in flight
                seen["hold"] = seen["hold"] and kk > 0  # (a joiner aborted before its first token)
                return 0
            self._unread.discard(r.req_id)
            self.k_policy.observe(r.req_id, kk, accepted, wanted=kk)
            self._count_spec(kk, accepted, kk)
            n = self._commit(r, tokens, None)
            r.stats.record(kk, accepted, n, kk)  # tokens committed: a stop or max_tokens may cut the round
            if not kk:  # a joining prompt's first token (read in the round, k = 0): not what drafting realized,
                # and neither is the look that spans its round (the prompt's prefill rode in it; plain decoding pays
                # it too, in a round of its own). Counted, mixed joins at 16-32 requests (a = 0.6) put the realized
                # rate at 0.86x plain's while steady rounds ran 1.19x, and the veto sent the batch to plain
                # decoding at 0.93x plain (run 52)
                seen.update(tokens=seen["tokens"] + n, switch=True, steady=False, hold=False)
            return n

        in_session = self._in_session

        def should_stop() -> bool:
            if self._end_session:
                return True
            if not in_session and (self._joins_due() or any(r.finished for r in running)):
                return True
            if not self.spec.adaptive:
                return False
            now, tokens = self._clock(), sum(len(r.output_token_ids) for r in running)
            if tokens > seen["tokens"]:  # what the rounds realized since the last look: the veto's input
                if not seen["switch"] and not seen["hold"]:  # (a switch's first look is left out: `_draft_lags`)
                    self.k_policy.record_realized(len(running), tokens - seen["tokens"], now - seen["t"])
                if seen["kernels"] is not None and seen["steady"]:  # one round committed since the last look:
                    # its wall time beyond its kernels (mostly hidden). Not the session's first commit: that look
                    # spans the session's start (draft catch-up, two launches); counted, it made every short
                    # session (a warm-up, a probe) report a whole round of overhead, and adaptive k stayed at 0
                    cost.record_spec_overhead(now - seen["t"] - seen["kernels"])
                seen.update(t=now, tokens=tokens, kernels=None, steady=not seen["hold"], switch=False)
            return False

        def next_k() -> int:
            """The policy decides every round after the session's first (whose k the start's decision gave: asking
            again before it spent a due probe, which ended before drafting and only doubled the wait). A new k > 0
            goes on in the session (`KEEP_SESSION_ON_NEW_K`); ending it cost a restart (the draft's feed, a round
            not overlapped): at 1 request and a = 0.8 on the H200, 26 restarts of ~3.5 ms in a 0.9 s run."""
            ks = self._k_for(running)
            kk = ks[0] if len(set(ks)) == 1 else 0
            kk = kk if kk == k or self.KEEP_SESSION_ON_NEW_K else 0
            if not kk:  # the session ends: the next step's rounds reuse this decision (asking again would count
                self._ks_cache = {r.req_id: x for r, x in zip(running, ks)}  # the round twice)
            return kk

        def regroup(members: list[Request], settle, kk: int) -> list[Request]:
            reads, mixed = self.session_reads, self.mixed_joins
            new = self._regroup(members, settle, kk)
            if self.mixed_joins != mixed:  # (its prompt is read in the next launch)
                seen["hold"] = True
            changed = [r.req_id for r in new] != [r.req_id for r in running]
            if changed:
                running[:] = new  # (the engine's view of the session: deltas, aborts, the k policy's batch)
            if changed or reads != self.session_reads:
                # the realized rate and the rounds' overhead restart from here (a prompt's read, a newcomer's first
                # token, are not the session's rounds)
                seen.update(t=self._clock(), tokens=sum(len(r.output_token_ids) for r in running), kernels=None,
                            steady=False, switch=False)
            return new

        self._end_session = False
        gen = overlapped_spec_rounds(self.runner, self.drafter, running, k, self.max_model_len, commit,
                                     verdict=self.sampler.device_verdict, should_stop=should_stop,
                                     timing=timing if self.spec.adaptive else None,
                                     next_k=next_k if self.spec.adaptive else None,
                                     regroup=regroup if in_session else None)
        self._overlap = (gen, running, True)
        return True

    def _draft_lags(self, reqs: list[Request]) -> bool:
        """Whether the draft's cache misses more than a round's tokens of some of these decoding requests: a
        stretch of plain decoding (or a prompt read while adaptive k was at 0) that the draft first catches up on.
        That catch-up is paid once per switch to drafting, so the realized rate the veto reads leaves out the
        round or look that spans it (on the H200 at a = 0.6 and 32 requests it put a probe's 8 rounds at 0.85x
        plain while its steady rounds ran at 1.23x, and the veto ended every trial: run 40)."""
        if self.drafter is None or self.drafter.kv is None:
            return False
        lag = self.spec.max_draft_tokens + 2  # (what one round can leave behind: an all-accepted round's drafts)
        # counted over the tokens decoded since the prompt only: a draft cache that has not read a new prompt yet
        # (EAGLE feeds short prompts at the first extend) is the recurring catch-up over arrivals, which counts
        return any(min(self._draft_lag(r), len(r.output_token_ids)) > lag for r in reqs)

    def _regroup(self, members: list[Request], settle, k: int) -> list[Request]:
        """Between two rounds of an overlapped speculative session (JOIN_IN_SESSION): finished and aborted members
        leave (their blocks go back now), and arrivals join. A join reads prompts in a round of their own, as
        between sessions (`_prefill_alone`), but the session goes on: the members skip that one round's overlap
        instead of ending the session, catching the draft up and starting a new one (a start cost 1.4-6 % of a
        closed-loop run at 4-64 requests on the H200, run 31). Only arrivals that can join are admitted (greedy
        and in the session's scope, a graph for the larger batch); the head of the queue that cannot ends the
        session (should_stop), as does a read prompt that cannot join (`_end_session`). A head waiting for a seat
        or for blocks waits for members to leave, and the rounds keep their overlap. Returns the members of the
        next round: those who stay, in order, then those who joined."""
        sched = self.scheduler
        stay = []
        for r in members:
            if r.finished:  # its last tokens were reported the step before; its row in the round in flight is
                self._finish(r)  # skipped at its commit. (The blocks it still writes go back now: any later use
                if self.requests.get(r.external_id) is r:  # of them is queued after that round.)
                    del self.requests[r.external_id]
            else:
                stay.append(r)
        ids = {r.req_id for r in stay}
        kv, limit = self.runner.kv, self.max_model_len
        graphs, dgraphs = self.runner.graphs, self.drafter.runner.graphs
        fits = lambda n: graphs.bucket(n) is not None and dgraphs.bucket(n) is not None  # noqa: E731
        others = [r for r in sched.running if r.req_id not in ids]  # admitted in an earlier join, not yet members
        reading = [r for r in others if kv.length(r.req_id) < r.num_tokens - 1]  # prompts read in chunks
        due, head = self._joins_due(hold_k=k), (sched.waiting[0] if sched.waiting else None)
        if stay and due and not (samples_in_scope(head) and fits(len(stay) + len(others) + 1)):
            self._end_session = True  # the head of the queue can never join this session: it ends for it
            due = False
        if stay and due and not reading and self._mixes(head, len(stay) + len(others)):
            sched.admit_head()  # its prompt is read in the next round's verify forward (overlap_spec: `reading`)
            self._unread.add(head.req_id)
            ids.add(head.req_id)
            stay.append(head)
            self.session_joins += 1
            self.mixed_joins += 1
            due = False
        # a read needs a seat and the blocks of the head's first chunk (else it waits for members to leave, and the
        # round in flight keeps its overlap)
        room = due and len(sched.running) < sched.max_num_seqs and \
            -(-min(head.num_tokens, sched.budget) // kv.block_size) <= kv.num_free_blocks
        if stay and (reading or room):
            settle()  # (the round in flight done: the prompts' forward runs on an idle device)
            self.round.feed_prefill = True  # (the session drafts: the draft reads the prompts in their round)
            out = sched.schedule(lambda reqs: [0] * len(reqs), prefill_only=True, exclude=ids,
                                 admit=lambda r: due and samples_in_scope(r) and fits(len(sched.running) + 1),
                                 preempt=False)  # (members hold their blocks: no preemption while they run)
            if out.items:
                self.session_reads += 1
                res = self.round.run(out.items)
                self._observe(res, out.items)
                for r in self._commit_items(out.items, res):
                    self._session_extra.append(r)  # (its delta: the step reports it)
        for r in [r for r in sched.running if r.req_id not in ids]:
            if r.finished:
                self._finish(r)  # (done by its first token: it never joins; its delta is in _session_extra)
            elif kv.length(r.req_id) == r.num_tokens - 1 and r.num_tokens >= 2:  # its prompt is read (all of it,
                # or all but the last token: the session's verify feeds that one, as a decode row would)
                if fits(len(stay) + 1) and request_in_scope(kv, r, k, limit):
                    stay.append(r)
                    self.session_joins += 1
                    if r in self._session_extra:
                        self._session_extra.remove(r)  # (a member now: reported as one)
                else:
                    self._end_session = True  # it cannot join: the ordinary rounds serve it
        return stay

    def _mixes(self, head: Request, members: int) -> bool:
        """Whether the head of the queue, alone in it, joins a session by a read in the members' next verify
        forward (MIX_JOINS): at most MIX_QUEUE requests wait (the others join in later rounds, one per round), its
        prompt fits one join graph and the step's token budget, it has a seat, its first blocks and room for two
        rounds."""
        sched, kv, limit = self.scheduler, self.runner.kv, self.max_model_len
        dkv = self.drafter.runner.kv
        n, kmax = head.num_tokens, self.spec.max_draft_tokens
        return (self.MIX_JOINS and len(sched.waiting) <= self.MIX_QUEUE and n >= 2 and n <= sched.budget
                and len(sched.running) < sched.max_num_seqs and n + 2 * (kmax + 1) + 2 < limit
                and self.runner.graphs.join_len(members, n) is not None
                and -(-(n + kmax + 1) // kv.block_size) <= kv.num_free_blocks
                and -(-(n + kmax + 1) // dkv.block_size) <= dkv.num_free_blocks)

    def _commit_overlapped(self, r: Request, tokens: list[int], logprobs) -> int:
        if r.finished:  # aborted while its step was in flight
            return 0
        return self._commit(r, tokens, logprobs)

    def _clock(self) -> float:
        """Seconds spent inside overlapped sessions' steps (valid while one runs)."""
        return self._clock_in + time.perf_counter() - self._clock_t0

    def _overlap_step(self) -> list[Request]:
        gen, running, spec = self._overlap
        self._clock_t0 = time.perf_counter()
        produced, ended = None, False
        try:
            produced = next(gen)
        except StopIteration as stop:  # the session has ended
            launched, ended = stop.value or 0, True
        finally:
            extra, self._session_extra = self._session_extra, []  # (requests _regroup touched during next(gen))
            dt = time.perf_counter() - self._clock_t0
            self._clock_in += dt
            if produced is not None:  # a step that committed: the session's first, or a steady one
                if self._session is None:  # (its batch size: the session's at its start; joins change it)
                    self._session = [dt, [], 0, len(running)]
                else:
                    self._session[1].append(dt)
                self._session[2] += produced
        if not ended:
            return list(running) + extra
        self._overlap = None
        if self._session is not None and self.drafter is not None and self.spec.adaptive:
            first, rest, tokens, size = self._session
            # what a start cost beyond a steady step (the draft's catch-up on newcomers, a first step that nothing
            # overlaps), per token the session gave: the k policy weighs it (KPolicy.record_session)
            self.k_policy.record_session(spec, size, first, sorted(rest)[len(rest) // 2] if rest else None,
                                         tokens, same_mode=self._last_session_spec == spec)
        self._last_session_spec, self._session = spec, None
        if not launched:  # its first step found no blocks (OutOfBlocks): the next step runs an ordinary round
            self._no_session = True
        if self.check_invariants:
            self._check(running)
        if self.drafter is not None and not spec:
            self.k_policy.skip_idle_rounds([r.req_id for r in running], max(0, launched - 1))
        for r in running:
            if r.finished:
                self._finish(r)
        return list(running) + extra

    # -- commit -----------------------------------------------------------------------------------------
    def _commit(self, r: Request, tokens: list[int], logprobs: list[dict] | None) -> int:
        """Append tokens one by one; stop at a stop token, a stop string or max_tokens (the rest is dropped)."""
        n, now = 0, time.monotonic()
        if tokens:
            if r.first_token_time is None:
                r.first_token_time = now
            r.last_token_time = now
        for j, t in enumerate(tokens):
            r.output_token_ids.append(t)
            n += 1
            if logprobs is not None and r.params.logprobs is not None:
                r.logprobs.append(logprobs[j])
            prev, matched = len(r.text), False
            r.detokenizer.add(t)  # decodes a short window, not the whole output
            r.text = r.detokenizer.text
            if t in r.stop_token_ids:
                r.finish_reason = FinishReason.STOP
            for s in r.params.stop:
                at = r.text.find(s, max(0, prev - len(s) + 1))
                if at >= 0:
                    r.text = r.text[:at]
                    r.finish_reason = FinishReason.STOP
                    matched = True
                    break
            if r.finish_reason is None and (len(r.output_token_ids) >= r.params.max_tokens
                                            or r.num_tokens >= self.max_model_len):
                r.finish_reason = FinishReason.LENGTH
            if r.finished:
                r.text = self._final_text(r, matched)
                r.finished_time = now
                break
        return n

    def _final_text(self, r: Request, stopped_by_string: bool) -> str:
        """The exact full decode (the incremental text can differ where a tokenizer rewrites earlier text, e.g.
        byte-fallback bytes that turn out invalid), cut at the first stop string."""
        full = r.detokenizer.final()
        if stopped_by_string:
            cuts = [at for at in (full.find(s) for s in r.params.stop) if at >= 0]
            return full[: min(cuts)] if cuts else r.text
        return full

    def visible_text_end(self, r: Request) -> int:
        """How much of r.text is final: all of it once finished; before that, all but a tail that could still
        become a stop string."""
        if r.finished:
            return len(r.text)
        return len(r.text) - stop_holdback(r.text, r.params.stop)

    def _delta(self, r: Request) -> RequestDelta | None:
        if r.sent_tokens < 0:  # already reported as finished
            return None
        new = r.output_token_ids[r.sent_tokens:]
        end = self.visible_text_end(r)
        text = r.text[r.sent_text: end] if end > r.sent_text else ""
        if not new and not text and not r.finished:
            return None
        lps = r.logprobs[r.sent_tokens:] if r.params.logprobs is not None else None
        r.sent_tokens = len(r.output_token_ids)
        r.sent_text = max(r.sent_text, end)
        d = RequestDelta(r.external_id, new, text, lps, r.finished, r.finish_reason.value if r.finished else None,
                         r.error, len(r.prompt_token_ids), len(r.output_token_ids), r.stats)
        if r.finished:
            r.sent_tokens = -1  # nothing more will be reported
        return d

    def finish_abort_delta(self, r: Request) -> RequestDelta:
        """The last delta of an aborted request (abort() does not go through step())."""
        return RequestDelta(r.external_id, [], "", None, True, FinishReason.ABORT.value, None,
                            len(r.prompt_token_ids), len(r.output_token_ids), r.stats)

    def _check(self, requests: list[Request]) -> None:
        """The rollback invariant: caches hold every committed token except the newest (past the prefill)."""
        for r in requests:
            if r.finished or not self.runner.kv.has(r.req_id):
                continue
            want = r.num_tokens - 1
            got = self.runner.kv.length(r.req_id)
            if got == 0 and r.req_id in self._unread:
                continue  # admitted to join a session by a read in its next round, which the session ended before
            if got != want:
                raise AssertionError(f"request {r.req_id}: target cache holds {got} tokens, expected {want}")
            if self.drafter is not None:
                d = self.drafter.cached_length(r)
                if d is not None and d > want:
                    raise AssertionError(f"request {r.req_id}: draft cache holds {d} tokens > committed {want}")


def _warm_chain_sample(batches, qs, vocab: int, device) -> None:
    """Compile the fused chain sampler's kernel variants before serving (a variant compiled mid-run stalls a
    round for ~0.5-1 s): one call per (batch size, rows per request), with and without draft probabilities.
    Every batch size up to the largest bucket, not only the buckets (b = 3, q = 5 pads its splits like 16 rows,
    which no power-of-two batch does at q = 5); sizes giving the same split counts are called once."""
    from ..kernels.chain_sample import chain_sample

    qs = sorted(set(qs) | {1})
    top = max(batches) * max(qs)
    logits = torch.zeros(top, vocab, device=device)
    probs = torch.full((top, vocab), 1.0 / vocab, device=device)
    seen = set()
    for b in range(1, max(batches) + 1):
        for q in qs:
            n = b * q
            key = (1 << (b - 1).bit_length(), 1 << (n - 1).bit_length(), q)  # what the variant depends on:
            if key in seen:  # the split counts (powers of two of b and b * q) and the rows per request
                continue
            seen.add(key)
            ids = torch.full((n,), -1, dtype=torch.int64, device=device)
            first = torch.arange(b, device=device) * q
            lens = torch.full((b,), q, dtype=torch.int64, device=device)
            temp = torch.ones(b, device=device)
            coins = torch.rand(n, 2, device=device)
            for p in (None, probs[:n]) if q > 1 else (None,):
                chain_sample(logits[:n], ids, first, lens, temp, coins, draft_probs=p, max_seqlen=q)
    del logits, probs
    torch.cuda.synchronize(device)

