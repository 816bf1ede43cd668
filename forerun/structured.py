"""Structured output (JSON schema, JSON object, regex, EBNF grammar, choice) with speculative decoding, on xgrammar.

Why it stays exact. For a constrained request every distribution the sampler sees is taken over the grammar's
allowed tokens: masked tokens get -inf logits before the probability transform, in the drafter (so a drafted
token is always allowed and q and p share their support) and in the target at every verify row. Row j of a
request's verify block is the distribution after committed + d_1..d_j, so its mask is the grammar state after
those tokens: `GrammarState.draft_masks` advances the matcher through the draft, fills one packed mask row per
verify row (the draft positions plus one), then rolls back to the committed state. The rejection rule of
`forerun.verify` is exact for any pair (p, q) with q's draws inside p's support's superset, so the output is
distributed as constrained plain sampling, softmax(masked target logits) token by token (tested by chi-square
in tests/test_structured.py). Greedy rows take the argmax of masked logits: constrained plain greedy.

A drafted token the grammar rejects (a point-mass drafter such as n-gram proposes it without a mask) cuts the
draft before it: with p(x) = 0 the verifier would reject x with probability 1 and resample from p itself, so
cutting changes no distribution, it only saves the rows. Cut tokens are counted (`num_rejected_drafts`, and
in the request's speculation stats as `grammar_rejected`: `grammar_of` links the state to `request.stats`).
The matcher advances only by committed tokens (`commit`). Trees are walked depth first with one-token rollback
(`tree_masks`).

After the grammar terminates (it accepted a stop token) only a stop token may follow: rows past the end
allow the stop tokens alone (never a fully masked row), and `commit` says how many tokens the grammar consumed
(what follows the terminating stop token is dropped by the engine, which stops at a stop token anyway).

Engine hooks, in round order (see docs/structured.md):
  1. drafter: `apply_grammar_to_draft_logits` before its probability transform, `GrammarState.draft_accept`
     after each pick, `GrammarState.draft_end` when done;
  2. round, before the target forward: `cut_drafts` (drops grammar-rejected draft tails, gives mask rows);
  3. round, after the target forward: `verify_bitmask` + `apply_bitmask_` (or `tree_verify_bitmask` for trees);
  4. after verification: `GrammarState.commit` with the tokens the request actually commits.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
ALL_ALLOWED = -1  # an int32 word with every bit set


def _one_line(e: Exception) -> str:
    """xgrammar's C++ errors start with '[hh:mm:ss] file.cc:NN: ': keep the message, one line."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if msg.startswith("[") and "] " in msg:
        msg = msg.split("] ", 1)[1]
        if ".cc:" in msg.split(" ", 1)[0]:
            msg = msg.split(": ", 1)[-1]
    return msg


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match; exactly one of the five is set. Validated on creation (the grammar is
    parsed, no tokenizer needed), so a bad spec fails with a one-line ValueError when SamplingParams is built.

    json_schema: a JSON schema (dict or JSON text), stored as compact JSON text (hashable; the key order is kept,
      since xgrammar emits the properties in the schema's order). json_object: any JSON object. regex: xgrammar's regex dialect (ECMAScript-like).
    grammar: EBNF in xgrammar's (GBNF-style) syntax with a `root` rule. choice: one of these strings exactly.
    any_whitespace: JSON may put arbitrary whitespace between tokens (default: compact separators, which small
      models follow far more reliably: free whitespace lets them loop on newlines until max_tokens).
    """

    json_schema: str | dict | bool | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) is not None and getattr(self, k) is not False)]
        if len(given) != 1:
            raise ValueError(f"structured output needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema must be a JSON object (or true/false), got {type(schema).__name__}")
            object.__setattr__(self, "json_schema", json.dumps(schema))  # key order kept: it is the output's order
        if self.json_object is not True and self.json_object is not False:
            raise ValueError(f"json_object must be True or False, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str):
                raise ValueError("choice must be a list of strings, not one string")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
        _grammar(self)  # parse now: errors surface here, once

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False)

    @property
    def key(self) -> tuple:
        """Hashable identity of the grammar (the compile cache key)."""
        return (self.kind, self.json_schema, self.regex, self.grammar, self.choice, self.any_whitespace)

    @classmethod
    def from_response_format(cls, response_format: dict) -> "StructuredOutput":
        """OpenAI `response_format`: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}."""
        kind = response_format.get("type")
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            if "schema" not in spec:
                raise ValueError("response_format json_schema needs a 'schema'")
            return cls(json_schema=spec["schema"])
        raise ValueError(f"response_format type must be 'json_object' or 'json_schema', got {kind!r}")


_GRAMMARS: "OrderedDict[tuple, Any]" = OrderedDict()
_LOCK = threading.Lock()


def _grammar(spec: StructuredOutput):
    """The parsed xgrammar.Grammar of a spec (tokenizer independent; cached)."""
    import xgrammar as xgr

    with _LOCK:
        g = _GRAMMARS.get(spec.key)
        if g is not None:
            _GRAMMARS.move_to_end(spec.key)
            return g
    kind = spec.kind
    try:
        if kind == "json_schema":
            g = xgr.Grammar.from_json_schema(spec.json_schema, any_whitespace=spec.any_whitespace)
        elif kind == "json_object":
            g = xgr.Grammar.builtin_json_grammar() if spec.any_whitespace else \
                xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        elif kind == "regex":
            g = xgr.Grammar.from_regex(spec.regex)
        elif kind == "grammar":
            g = xgr.Grammar.from_ebnf(spec.grammar)
        else:  # choice: JSON string escapes are valid EBNF string literals
            g = xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"invalid {kind} for structured output: {_one_line(e)}") from None
    with _LOCK:
        _GRAMMARS[spec.key] = g
        while len(_GRAMMARS) > 256:
            _GRAMMARS.popitem(last=False)
    return g


def _bit(i: int) -> int:
    """int32 value with bit i set (bit 31 is the sign bit)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack(bitmask: Tensor, vocab_size: int) -> Tensor:
    """Packed int32 [..., words] -> allowed bool [..., vocab] (token t: bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [..., W, 32]
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_bitmask_(logits: Tensor, bitmask: Tensor, rows: Tensor | None = None) -> Tensor:
    """Set disallowed tokens to -inf in place. logits: [N, V] float; bitmask: [M, words] int32 packed
    (rows None: M == N, one mask per row; else rows [M] long: the logits rows the masks apply to).
    xgrammar's kernel (CPU for float32, CUDA / Triton on the GPU) where it applies: it reads the packed words
    directly, about 40x faster on the CPU than unpacking to a bool mask in torch (measured, 6 x 49152 rows)."""
    vocab = logits.shape[1]
    with torch.inference_mode(logits.is_inference()):  # the model's logits may be inference tensors
        if logits.is_cuda or logits.dtype == torch.float32:
            try:
                import xgrammar as xgr

                if rows is not None:  # one row per logits row, all allowed where no mask applies
                    full = torch.full((logits.shape[0], bitmask.shape[1]), ALL_ALLOWED, dtype=torch.int32)
                    full.index_copy_(0, rows.cpu(), bitmask.cpu())  # (index_put is ~3000x slower on CPU here)
                    bitmask = full
                xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab)
                return logits
            except (ImportError, RuntimeError, ValueError, TypeError):
                pass  # the portable path below
        allowed = unpack(bitmask.to(logits.device, non_blocking=True), vocab)  # [M, V]
        if rows is None:
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            rows = rows.to(logits.device)
            logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))
    return logits


class GrammarCompiler:
    """One model's grammar compiler: xgrammar.TokenizerInfo from the HF tokenizer and the model's vocab size
    (ids past the tokenizer's own vocabulary are never allowed), compiled grammars cached by spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int] | None = None,
                 max_threads: int = 2, cache_size: int = 128) -> None:
        import xgrammar as xgr

        kw = {} if stop_token_ids is None else {"stop_token_ids": sorted({int(t) for t in stop_token_ids})}
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, **kw)
        self.vocab_size = vocab_size
        self.num_rejected_drafts = 0  # over every state made here: the engine-wide grammar_rejected
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self._cache: "OrderedDict[tuple, Any]" = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def from_vocab(cls, vocab: list[str], stop_token_ids: Sequence[int], vocab_size: int | None = None
                   ) -> "GrammarCompiler":
        """A compiler over a raw string vocabulary (tests: tiny grammars with a handful of tokens)."""
        import xgrammar as xgr

        self = cls.__new__(cls)
        self.vocab_size = vocab_size or len(vocab)
        self.num_rejected_drafts = 0
        self.info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                      stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._cache, self._cache_size, self._lock = OrderedDict(), 128, threading.Lock()
        return self

    def compile(self, spec: StructuredOutput):
        with self._lock:
            cg = self._cache.get(spec.key)
            if cg is not None:
                self._cache.move_to_end(spec.key)
                return cg
        cg = self._compiler.compile_grammar(_grammar(spec))
        with self._lock:
            self._cache[spec.key] = cg
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return cg

    def new_state(self, spec: StructuredOutput, stats=None) -> "GrammarState":
        """A matcher for one request; stats: its RequestStats (grammar_rejected counted there), or None."""
        state = GrammarState(self.compile(spec), self.vocab_size, stats)
        state.compiler = self
        return state


class GrammarState:
    """The grammar matcher of one request. Outside drafting it sits at the committed tokens; a draft session
    (`draft_mask` / `draft_accept` / `draft_end`) advances it tentatively and remembers the mask rows it filled
    so that `draft_masks` on the same tokens does not fill them twice."""

    def __init__(self, compiled, vocab_size: int, stats=None) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._stop_row = torch.zeros(self.words, dtype=torch.int32)  # after termination: only a stop token
        for t in self.matcher.stop_token_ids:
            if 0 <= t < vocab_size:
                self._stop_row[t // 32] |= _bit(t % 32)
        if not bool(self._stop_row.any()):
            self._stop_row.fill_(ALL_ALLOWED)
        self.num_committed = 0
        self.num_rejected_drafts = 0  # drafted tokens cut because the grammar rejects them (or an earlier one)
        self.stats = stats  # the request's RequestStats (set by grammar_of): grammar_rejected follows the cuts
        self.compiler = None  # the GrammarCompiler that made it (new_state): its engine-wide count follows too
        self._pending = 0  # tokens accepted beyond the committed ones (draft session)
        self._in_session = False
        self._cache_tokens: list[int] = []  # draft tokens of the last session
        self._cache_rows: list[Tensor] = []  # row i: mask after committed + _cache_tokens[:i]

    # -- state -----------------------------------------------------------------------------------
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """The output so far is a complete match (a stop token may come next)."""
        return self.matcher.is_completed()

    def _fill(self, out: Tensor) -> Tensor:
        """out: [words] int32 (CPU) <- mask of the matcher's current state; once terminated, the stop tokens only."""
        if self.matcher.is_terminated():
            out.copy_(self._stop_row)
        else:
            self.matcher.fill_next_token_bitmask(out.unsqueeze(0))
        return out

    def next_mask(self, out: Tensor | None = None) -> Tensor:
        """Mask of the next token after the committed tokens (plus any pending draft tokens).
        out: None (a new packed [words] int32), a packed [words] int32 or a bool [vocab] tensor to fill."""
        if out is not None and out.dtype == torch.bool:
            out.copy_(unpack(self._fill(torch.empty(self.words, dtype=torch.int32)), self.vocab_size))
            return out
        if out is None:
            out = torch.empty(self.words, dtype=torch.int32)
        return self._fill(out)

    def _accept(self, token: int) -> bool:
        if self.matcher.is_terminated() or not 0 <= token < self.vocab_size:
            return False
        return self.matcher.accept_token(int(token))

    def _count_rejected(self, n: int) -> None:
        if n:
            self.num_rejected_drafts += n
            if self.stats is not None:
                self.stats.grammar_rejected += n
            if self.compiler is not None:
                self.compiler.num_rejected_drafts += n

    def _rollback_pending(self) -> None:
        if self._pending:
            self.matcher.rollback(self._pending)
            self._pending = 0

    # -- drafting ------------------------------------------------------------------------------------
    def _session_start(self) -> None:
        if not self._in_session:
            self._in_session = True
            self._cache_rows, self._cache_tokens = [], []

    def draft_mask(self) -> Tensor:
        """Packed [words] mask for the next draft position (committed + the tokens accepted in this session)."""
        self._session_start()
        i = self._pending
        if i < len(self._cache_rows):
            return self._cache_rows[i]
        row = self._fill(torch.empty(self.words, dtype=torch.int32))
        if len(self._cache_rows) == i:
            self._cache_rows.append(row)
        return row

    def draft_accept(self, token: int) -> bool:
        """Advance the draft session by a drafted token; False if the grammar rejects it (the draft must end
        there) or has terminated."""
        self._session_start()
        if not self._accept(token):
            return False
        self._pending += 1
        self._cache_tokens.append(int(token))
        return True

    def draft_end(self) -> None:
        """Roll back to the committed tokens; the session's mask rows stay cached for `draft_masks`."""
        self._rollback_pending()
        self._in_session = False

    def draft_masks(self, draft_tokens: Sequence[int]) -> tuple[int, Tensor]:
        """(num_valid, masks [num_valid + 1, words] int32): the longest prefix of the draft the grammar accepts,
        and one mask row per verify row of that prefix (row j: after committed + d_1..d_j). Counts the cut
        tokens in num_rejected_drafts. The matcher is back at the committed tokens afterwards."""
        self._rollback_pending()
        self._in_session = False
        draft = [int(t) for t in draft_tokens]
        rows = torch.empty(len(draft) + 1, self.words, dtype=torch.int32)
        valid = len(draft)
        for j in range(len(draft) + 1):
            if j < len(self._cache_rows) and self._cache_tokens[:j] == draft[:j]:
                rows[j] = self._cache_rows[j]
            else:
                self._fill(rows[j])
            if j == len(draft):
                break
            if not self._accept(draft[j]):
                valid = j
                break
            self._pending += 1
        self._rollback_pending()
        self._count_rejected(len(draft) - valid)
        return valid, rows[: valid + 1]

    # -- committing ----------------------------------------------------------------------------------
    def commit(self, tokens: Sequence[int]) -> int:
        """Advance by committed tokens; returns how many the grammar consumed: all of them, or up to and
        including the stop token that terminated it (what follows must be dropped by the caller).
        A committed token the grammar rejects before terminating is a bug upstream: ValueError."""
        self._rollback_pending()
        self._in_session = False
        self._cache_rows, self._cache_tokens = [], []
        for n, t in enumerate(tokens):
            if self.matcher.is_terminated():
                return n
            if not self.matcher.accept_token(int(t)):
                raise ValueError(f"committed token {int(t)} is not allowed by the grammar (after "
                                 f"{self.num_committed} committed tokens)")
            self.num_committed += 1
        return len(tokens)

    # -- trees ----------------------------------------------------------------------------------------
    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int], count: bool = True) -> tuple[Tensor, Tensor]:
        """(valid [n] bool, masks [n, words] int32) for a draft tree (node 0 = root = the newest committed token,
        parents[i] < i). Walked depth first with one-token rollback: mask row i is the grammar state after the
        path to node i. A node whose token the grammar rejects is not valid, nor its subtree; their rows are
        all allowed (such nodes have p = 0 at their parent, so they are never accepted)."""
        self._rollback_pending()
        self._in_session = False
        n = len(tokens)
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            children[parents[i]].append(i)
        masks = torch.full((n, self.words), ALL_ALLOWED, dtype=torch.int32)
        valid = torch.zeros(n, dtype=torch.bool)
        valid[0] = True
        stack: list[tuple[int, int]] = [(0, 0)]  # (node, next child index); the matcher sits at the top node
        self._fill(masks[0])
        while stack:
            node, c = stack[-1]
            if c == len(children[node]):
                stack.pop()
                if stack:
                    self.matcher.rollback(1)
                continue
            stack[-1] = (node, c + 1)
            child = children[node][c]
            if self._accept(tokens[child]):
                valid[child] = True
                self._fill(masks[child])
                stack.append((child, 0))
        if count:
            self._count_rejected(int(n - 1 - int(valid[1:].sum())))
        return valid, masks


# -- engine-facing helpers ------------------------------------------------------------------------------
def grammar_of(request) -> GrammarState | None:
    """The request's grammar state (the engine sets `request.grammar` when SamplingParams asks for structured
    output), or None. Links the state to the request's stats, so the draft tokens it cuts (`cut_drafts`,
    `tree_masks`) are counted in `request.stats.grammar_rejected`."""
    state = getattr(request, "grammar", None)
    if state is not None:
        stats = getattr(request, "stats", None)
        if stats is not None and state.stats is not stats:
            state.stats = stats
    return state


def apply_grammar_to_draft_logits(logits: Tensor, states: Sequence[GrammarState | None]) -> Tensor:
    """Drafter hook, before its probability transform: mask row i of logits [A, V] with states[i]'s next draft
    position (None: unconstrained row). In place; returns logits."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if rows:
        masks = torch.stack([states[i].draft_mask() for i in rows])  # [M, words]
        apply_bitmask_(logits, masks, None if len(rows) == logits.shape[0] else torch.tensor(rows))
    return logits


def cut_drafts(states: Sequence[GrammarState | None], drafts: Sequence[list[int]],
               probs: Sequence[Tensor | None]) -> tuple[list[list[int]], list[Tensor | None], list[Tensor | None]]:
    """Round hook, before the target forward: per request, drop the draft from its first grammar-rejected token
    on (the dropped tokens are counted in the state's num_rejected_drafts and, once `grammar_of` has linked it,
    in the request's stats.grammar_rejected). Returns (drafts, probs cut to match, mask rows [len(draft) + 1, words] or None when unconstrained)."""
    out_d, out_p, out_m = [], [], []
    for s, d, q in zip(states, drafts, probs):
        if s is None:
            out_d.append(list(d)), out_p.append(q), out_m.append(None)
            continue
        n, rows = s.draft_masks(d)
        out_d.append(list(d[:n]))
        out_p.append(None if q is None else q[:n])
        out_m.append(rows)
    return out_d, out_p, out_m


def verify_bitmask(masks: Sequence[Tensor | None], seqlens: Sequence[int]) -> Tensor | None:
    """[T, words] int32 packed masks for the flattened verify rows (request i owns seqlens[i] rows, in order;
    unconstrained requests get all-allowed rows), or None when no request is constrained."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    words = present[0].shape[1]
    parts = [m if m is not None else torch.full((n, words), ALL_ALLOWED, dtype=torch.int32)
             for m, n in zip(masks, seqlens)]
    for m, n in zip(parts, seqlens):
        if m.shape[0] != n:
            raise ValueError(f"a request has {m.shape[0]} mask rows for {n} verify rows")
    return torch.cat(parts)


def tree_verify_bitmask(states: Sequence[GrammarState | None], tokens: Sequence[Sequence[int]],
                        parents: Sequence[Sequence[int]]) -> Tensor | None:
    """[T, words] masks for flattened draft trees (request i's nodes in order), None when none is constrained."""
    if all(s is None for s in states):
        return None
    masks = [None if s is None else s.tree_masks(t, p)[1] for s, t, p in zip(states, tokens, parents)]
    return verify_bitmask(masks, [len(t) for t in tokens])


def mask_target_logits_(logits: Tensor, bitmask: Tensor | None) -> Tensor:
    """Round hook, after the target forward: logits [T, V] of the verify rows, masked in place."""
    return logits if bitmask is None else apply_bitmask_(logits, bitmask)


def mask_request_rows_(logits: Tensor, masks: Sequence[Tensor | None], starts: Sequence[int]) -> Tensor:
    """Round hook, after the target forward: request i's mask rows [n_i, words] apply to logits rows
    starts[i] .. starts[i] + n_i - 1 (logits [T, V], in place; None: unconstrained). Returns logits."""
    idx = [(s, m) for s, m in zip(starts, masks) if m is not None]
    if idx:
        rows = torch.cat([torch.arange(s, s + m.shape[0]) for s, m in idx])
        apply_bitmask_(logits, torch.cat([m for _, m in idx]), rows)
    return logits


def commit_emitted(states: Sequence[GrammarState | None], emitted: Sequence[Sequence[int]]) -> None:
    """Round hook, after verification: advance each constrained request's matcher by its emitted tokens. The
    engine may drop tokens past max_tokens or a stop string, but then the request finishes, so its grammar
    no longer matters; tokens after the terminating stop token are ignored (commit's return value)."""
    for s, toks in zip(states, emitted):
        if s is not None and toks:
            s.commit(toks)


def tree_node_masks(state: GrammarState, tokens: Sequence[int], parents: Sequence[int],
                    nodes: Sequence[int]) -> Tensor:
    """Tree-drafter hook: masks [len(nodes), words] of the given nodes of a partial tree (tokens / parents of the
    nodes drafted so far; node 0 = the root), i.e. the grammar state after each node's path. Rejected nodes
    (their token or an ancestor's is not allowed) get all-allowed rows; nothing is counted as rejected here."""
    m = max(nodes) + 1
    _, masks = state.tree_masks(list(tokens[:m]), list(parents[:m]), count=False)
    return masks[list(nodes)]
