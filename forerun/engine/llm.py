"""LLM.generate(prompts, SamplingParams): continuous batching with (optional) speculative decoding.

A step admits waiting requests while the KV pool has room, then runs one round over every running
request (new requests' first round is their prefill). Tokens are committed one at a time with the stop
checks after each, and whatever a round produced past a stop or max_tokens is dropped.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from ..config import CacheConfig, SpecConfig
from ..detokenizer import IncrementalDetokenizer
from ..drafters.base import Drafter
from ..drafters.model_drafter import DraftModelDrafter, EarlyExitDrafter
from ..drafters.ngram import NgramDrafter
from ..drafters.tree_drafter import TreeDrafter
from ..models.registry import load_model
from ..request import FinishReason, Request, RequestOutput
from ..sampling_params import SamplingParams
from ..stats import RequestStats, aggregate
from .overlap import overlap_applies, overlapped_decode
from ..runtime.cuda_graph import enable_cuda_graphs
from ..runtime.runner import ModelRunner
from .k_policy import KPolicy
from .spec_step import speculative_round
from .tree_step import tree_round


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


class LLM:
    def __init__(self, model: str, *, spec: SpecConfig | None = None, device: str | None = None,
                 dtype: torch.dtype | None = None, cache: CacheConfig | None = None, max_num_seqs: int = 64,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 8192, seed: int = 0,
                 check_invariants: bool = False, cuda_graphs: bool = True, overlap: bool = True,
                 _loaded=None) -> None:
        """overlap: with CUDA graphs, run plain decoding steps overlapped with the host's commits (engine/overlap.py)."""
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.cache = cache or CacheConfig()
        self.spec = spec or SpecConfig()
        target, self.tokenizer, _ = _loaded or load_model(model, self.device, self.dtype, max_model_len)
        self.model = target
        self.max_num_seqs, self.check_invariants, self.overlap = max_num_seqs, check_invariants, overlap
        self.runner = ModelRunner(target, self.cache, self.device, self.dtype, max_seqs=max_num_seqs,
                                  max_batch_tokens=max_num_batched_tokens)
        self.drafter = self._make_drafter()
        if cuda_graphs and self.device.type == "cuda":
            for runner in {id(r): r for r in (self.runner, getattr(self.drafter, "runner", None)) if r}.values():
                enable_cuda_graphs(runner, max_q_len=self.spec.max_draft_tokens + 1)
        self.scheduler = KPolicy(self.spec)
        self.generator = torch.Generator().manual_seed(seed)
        self._next_id = 0

    @classmethod
    def from_model(cls, model, tokenizer, **kw) -> "LLM":
        """Wrap an already built model (tests, benchmarks)."""
        return cls("<in-memory>", _loaded=(model, tokenizer, None), **kw)

    def _make_drafter(self) -> Drafter | None:
        s = self.spec
        if s.method == "ngram":
            return NgramDrafter(s.ngram_min, s.ngram_max)
        if s.method == "early-exit":
            return EarlyExitDrafter(self.runner, s.early_exit_layers, s.confidence_threshold)
        if s.method == "draft":
            ddtype = draft_dtype(s, self.device, self.dtype)
            if isinstance(s.draft_model, tuple):  # (model, tokenizer) already built
                dmodel, dtok = s.draft_model
                ddtype = next(dmodel.parameters()).dtype
            else:
                dmodel, dtok, _ = load_model(s.draft_model, self.device, ddtype, self.model.max_positions)
            check_tokenizers_match(self.tokenizer, dtok)
            if dmodel.config.vocab_size != self.model.config.vocab_size:
                raise ValueError(f"draft vocab size {dmodel.config.vocab_size} != target {self.model.config.vocab_size}")
            runner = ModelRunner(dmodel, self.cache, self.device, ddtype, max_seqs=self.max_num_seqs,
                                 max_batch_tokens=self.runner.buffers.max_tokens)
            if s.tree is not None:
                return TreeDrafter(runner, s.tree)
            return DraftModelDrafter(runner, confidence_threshold=s.confidence_threshold)
        return None

    # -- requests ------------------------------------------------------------------------------------
    def _make_request(self, prompt, params: SamplingParams, chat: bool) -> Request:
        if isinstance(prompt, str):
            text = prompt
            if chat:
                ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                         add_generation_prompt=True, tokenize=True)
                ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            else:
                ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        rid = self._next_id
        if not ids:
            raise ValueError(f"request {rid}: empty prompt")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"request {rid}: token id out of range [0, {vocab})")
        limit = self.model.max_positions
        if len(ids) >= limit:
            raise ValueError(f"request {rid}: prompt of {len(ids)} tokens is too long for the context of {limit} "
                             "(it needs room for at least one new token)")
        if len(ids) + self.spec.max_draft_tokens + 1 > self.runner.buffers.max_tokens:
            raise ValueError(f"request {rid}: prompt of {len(ids)} tokens exceeds max_num_batched_tokens "
                             f"({self.runner.buffers.max_tokens})")
        if self.runner.kv.capacity_tokens < len(ids) + 1:
            raise ValueError(f"request {rid}: prompt of {len(ids)} tokens does not fit the KV pool "
                             f"({self.runner.kv.capacity_tokens} tokens); raise CacheConfig.memory_budget_bytes")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.model.config.eos_token_ids)
            if self.tokenizer.eos_token_id is not None:
                stops.add(self.tokenizer.eos_token_id)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (), generator=self.generator))
        self._next_id += 1
        return Request(rid, text, ids, params, torch.Generator().manual_seed(seed), frozenset(stops),
                       detokenizer=IncrementalDetokenizer(self.tokenizer))

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 chat: bool = False, progress: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (a string, or a list of token ids); returns outputs in prompt order."""
        requests = self._requests(prompts, sampling_params, chat)
        bar = tqdm(total=sum(r.params.max_tokens for r in requests), disable=not progress, unit="tok")
        for done in self._run(requests):
            bar.update(done)
        bar.close()
        return [self._output(r) for r in requests]

    def stream(self, prompt, sampling_params: SamplingParams | None = None, *, chat: bool = False) -> Iterator[str]:
        """Yield the text of one request as it grows (one piece per round)."""
        (req,) = self._requests([prompt], sampling_params, chat)
        shown = 0
        for _ in self._run([req]):
            if len(req.text) > shown:
                yield req.text[shown:]
                shown = len(req.text)

    def _requests(self, prompts, sampling_params, chat) -> list[Request]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        return [self._make_request(p, sp, chat) for p, sp in zip(prompts, plist)]  # all validated before any runs

    # -- the loop ------------------------------------------------------------------------------------
    def _run(self, requests: list[Request]) -> Iterator[int]:
        """Admit, run rounds, commit, free; yields tokens committed per step. If it stops early (an error, or a
        stream() closed by its reader), the requests still running give their KV blocks back."""
        waiting, running = list(requests), []
        kv = self.runner.kv
        budget = kv.num_blocks - 1  # blocks promised to running requests, for their whole lifetime
        try:
            while waiting or running:
                # Admit while the worst case of every running request (prompt + max_tokens + drafts) still fits,
                # so a running request never meets a full pool mid-generation.
                while waiting and len(running) < self.max_num_seqs and \
                        sum(map(self._worst_blocks, running + waiting[:1])) <= budget and \
                        sum(map(self._step_tokens, running + waiting[:1])) <= self.runner.buffers.max_tokens:
                    r = waiting.pop(0)
                    kv.add_sequence(r.req_id)
                    running.append(r)
                if not running:
                    raise RuntimeError(f"request {waiting[0].req_id} needs more KV blocks than the pool has "
                                       f"({budget}); raise CacheConfig.memory_budget_bytes or lower max_tokens")
                limit = self.model.max_positions
                produced = None
                ks = None if isinstance(self.drafter, TreeDrafter) else self._ks(running, limit)
                plain = ks is not None and not any(ks)
                if self.overlap and plain and overlap_applies(self.runner, running, limit, self.spec.rule):
                    # plain decoding: no drafter, or adaptive k at 0 for all until the scheduler's next probe
                    ids = [r.req_id for r in running]
                    steps = self.scheduler.rounds_before_probe(ids) if self.drafter and self.spec.adaptive else None
                    launched = yield from overlapped_decode(self.runner, running, limit, self._commit, max_steps=steps)
                    self.scheduler.skip_idle_rounds(ids, launched - 1)  # ks() above counted the first
                else:
                    produced = self._round(running, limit, ks)
                if self.check_invariants:
                    self._check(running)
                for r in [r for r in running if r.finished]:
                    running.remove(r)
                    self._release(r)
                if produced is not None:
                    yield produced
        finally:
            for r in running:
                self._release(r)

    def _release(self, r: Request) -> None:
        self.runner.kv.free(r.req_id)
        if self.drafter is not None:
            self.drafter.release(r)
        self.scheduler.forget(r.req_id)

    def _ks(self, running: list[Request], limit: int) -> list[int]:
        """k per request this round (0 = plain decoding), capped by the room each has left."""
        room = [max(0, min(r.remaining - 1, limit - r.num_tokens)) for r in running]
        return self.scheduler.ks([r.req_id for r in running], room)

    def _round(self, running: list[Request], limit: int, ks: list[int] | None) -> int:
        """One round (prefill, plain decode or speculation) over the running requests; returns tokens committed.
        ks: drafts per request (None for a tree drafter, which decides itself)."""
        if ks is None:  # a tree needs room for all its nodes, else a plain round
            fits = all(r.remaining - 1 >= len(self.spec.tree) and limit - r.num_tokens >= self.spec.max_draft_tokens
                       for r in running)
            res = tree_round(self.runner, self.drafter, running) if fits else \
                speculative_round(self.runner, None, running, [0] * len(running), self.spec.rule)
        else:
            res = speculative_round(self.runner, self.drafter, running, ks, self.spec.rule, self._verify_kwargs(),
                                    timing=self.spec.adaptive)
        self._observe(res, len(running))
        produced = 0
        for i, r in enumerate(running):
            self.scheduler.observe(r.req_id, res.num_drafted[i], res.num_accepted[i])
            r.stats.record(res.num_drafted[i], res.num_accepted[i], len(res.emitted[i]))
            produced += self._commit(r, res.emitted[i], res.logprobs[i] if res.logprobs else None)
        return produced

    def _step_tokens(self, r: Request) -> int:
        """Tokens the request feeds the target in its next round, at most."""
        kv = self.runner.kv
        return r.num_tokens - (kv.length(r.req_id) if kv.has(r.req_id) else 0) + self.spec.max_draft_tokens + 1

    def _worst_blocks(self, r: Request) -> int:
        tokens = min(len(r.prompt_token_ids) + r.params.max_tokens, self.model.max_positions) + self.spec.max_draft_tokens + 2
        return -(-tokens // self.runner.kv.block_size)

    def _verify_kwargs(self) -> dict:
        s = self.spec
        if s.rule == "penalty":
            return {"penalty": s.draft_prob_penalty}
        if s.rule == "typical":
            return {"typical_epsilon": s.typical_epsilon, "typical_delta": s.typical_delta}
        return {}

    def _observe(self, res, num_requests: int) -> None:
        """Feed the cost model with decode/verify rounds only: a prefill's per-token cost is not a verify's."""
        cost = self.scheduler.cost
        if res.target_tokens <= num_requests * (self.spec.max_draft_tokens + 1):
            cost.record_target(res.target_tokens, res.target_seconds)
        if res.draft_step_seconds is not None:
            cost.record_draft_step(res.draft_step_seconds)

    def _commit(self, r: Request, tokens: list[int], logprobs: list[dict] | None) -> int:
        """Append tokens one by one; stop at a stop token, a stop string or max_tokens (the rest is dropped)."""
        n = 0
        for j, t in enumerate(tokens):
            r.output_token_ids.append(t)
            n += 1
            if logprobs is not None and r.params.logprobs is not None:
                entry = dict(logprobs[j])
                if "top" in entry:
                    entry["top"] = dict(list(entry["top"].items())[: r.params.logprobs])
                r.logprobs.append(entry)
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
                                            or r.num_tokens >= self.model.max_positions):
                r.finish_reason = FinishReason.LENGTH
            if r.finished:
                r.text = self._final_text(r, matched)
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

    def _check(self, running: list[Request]) -> None:
        """The rollback invariant: caches hold every committed token except the newest."""
        for r in running:
            if r.finished:
                continue
            want = r.num_tokens - 1
            got = self.runner.kv.length(r.req_id)
            if got != want:
                raise AssertionError(f"request {r.req_id}: target cache holds {got} tokens, expected {want}")
            if self.drafter is not None:
                d = self.drafter.cached_length(r)
                if d is not None and d > want:
                    raise AssertionError(f"request {r.req_id}: draft cache holds {d} tokens > committed {want}")

    def _output(self, r: Request) -> RequestOutput:
        return RequestOutput(r.req_id, r.prompt, r.prompt_token_ids, r.text, list(r.output_token_ids),
                             r.finish_reason.value, r.stats, r.logprobs if r.params.logprobs is not None else None)

    @staticmethod
    def aggregate_stats(outputs: list[RequestOutput]) -> RequestStats:
        return aggregate([o.stats for o in outputs])
