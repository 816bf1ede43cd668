"""Frozen configuration dataclasses, validated on creation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. Built from a Hugging Face config.json dict or GGUF metadata."""

    arch: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # e.g. Llama-3: rope_type, factor, ...
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Q/K/V bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on Q and K (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # every layer attends to the last `sliding_window` positions (issue 14)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.arch!r}; forerun supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} not divisible by num_kv_heads={self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a transformers config.json dict (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)."""
        model_type = cfg.get("model_type")
        if model_type is None:
            archs = cfg.get("architectures") or []
            model_type = archs[0].lower().replace("forcausallm", "") if archs else None
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {model_type!r} (config model_type / architectures); "
                f"forerun supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_scaling = cfg.get("rope_scaling") or None
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if rope_scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype in ("default", None):
                rope_scaling = None
            elif rtype not in ("llama3", "linear"):
                raise ValueError(f"unsupported rope_scaling type {rtype!r}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            arch=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=_hf_sliding_window(cfg, model_type),
        )


def _hf_sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    """The window every layer uses (None: full attention), from Mistral's `sliding_window`, Qwen2/3's
    `use_sliding_window` + `max_window_layers` (layer i is windowed iff i >= max_window_layers) or `layer_types`.
    A model that mixes windowed and full layers is refused (issue 14: not supported)."""
    window, layers = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return None
        first = cfg.get("max_window_layers", layers)
        windowed = [i >= first for i in range(layers)]
    elif model_type == "mistral":
        windowed = [window is not None] * layers
    else:
        windowed = [False] * layers
    types = cfg.get("layer_types")
    if types:
        windowed = [t == "sliding_attention" for t in types]
    if any(windowed) and not all(windowed):
        raise ValueError(f"{model_type} config mixes sliding-window and full-attention layers "
                         f"({sum(windowed)} of {layers} windowed): not supported")
    if not any(windowed) or window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    return window


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block_size tokens per block; the pool is sized from a memory budget or a block count."""

    block_size: int = 16
    memory_budget_bytes: int | None = 2 << 30
    num_blocks: int | None = None  # overrides memory_budget_bytes when set

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_blocks is None and (self.memory_budget_bytes is None or self.memory_budget_bytes <= 0):
            raise ValueError("give a positive memory_budget_bytes or num_blocks")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")


SPEC_METHODS = ("none", "draft", "early-exit", "ngram", "eagle")
# --confidence (forerun generate and forerun serve)
CONFIDENCE_HELP = ("stop a draft when its top probability is below this; with --draft eagle:DIR --tree, verify only the "
                   "nodes whose cumulative draft probability is at least this")
VERIFY_RULES = ("auto", "greedy", "rejection", "penalty", "typical")


@dataclass(frozen=True)
class SpecConfig:
    """How to speculate. method: none | draft (a separate model) | early-exit (the target's first
    early_exit_layers layers) | ngram (prompt lookup). k: drafts per round, or adaptive (k chosen each round
    per request in 0..k_max). rule: auto = greedy rows for temperature 0, exact rejection sampling otherwise;
    'penalty' is seed 000's alpha-penalty residual, 'typical' is Medusa's lossy typical acceptance."""

    method: str = "none"
    draft_model: str | None = None
    early_exit_layers: int = 0
    k: int = 4
    adaptive: bool = False
    k_max: int = 8
    ngram_min: int = 1
    ngram_max: int = 3
    # draft model / early exit: stop a chain at a draft below it; EAGLE tree: keep only nodes whose cumulative draft
    # probability reaches it (the drafter's tree_confidence)
    confidence_threshold: float = 0.0
    rule: str = "auto"
    draft_prob_penalty: float = 5e-5
    typical_epsilon: float = 0.09  # Medusa's posterior_threshold
    typical_delta: float = 0.3  # Medusa's posterior_alpha
    draft_dtype: str = "auto"  # auto: bfloat16 on CPUs with native bf16 (a draft only proposes), else the target's
    tree: tuple[int, ...] | None = None  # method 'draft' only: children per node at each depth, e.g. (2, 2, 1)
    eagle_head: str | None = None  # method 'eagle': a head's folder (EAGLE / SpecForge layout; forerun train-eagle)
    eagle_tree: tuple[int, int, int] | None = None  # method 'eagle': dynamic tree (top-k, steps, nodes); None = chain
    # method 'draft': the draft model ranks only the first draft_vocab token ids and the special tokens
    # (models/vocab_subset.py; a draft model passed in already built has its head replaced in place)
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculation method {self.method!r}; choose from {SPEC_METHODS}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("method 'draft' needs draft_model")
        if self.method == "eagle" and not self.eagle_head:
            raise ValueError("method 'eagle' needs eagle_head (a head's folder)")
        if self.eagle_tree is not None:
            object.__setattr__(self, "eagle_tree", tuple(int(x) for x in self.eagle_tree))
            if self.method != "eagle" or len(self.eagle_tree) != 3 or min(self.eagle_tree) < 1 or self.eagle_tree[2] < 2:
                raise ValueError("eagle_tree needs method 'eagle' and (top-k >= 1, steps >= 1, nodes >= 2)")
        if self.method == "early-exit" and self.early_exit_layers < 1:
            raise ValueError("method 'early-exit' needs early_exit_layers >= 1")
        if self.k < 0 or self.k_max < 0 or (self.adaptive and self.k_max < 1):
            raise ValueError("k and k_max must be >= 0 (k_max >= 1 when adaptive)")
        if self.rule not in VERIFY_RULES:
            raise ValueError(f"unknown verification rule {self.rule!r}; choose from {VERIFY_RULES}")
        if self.draft_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"draft_dtype must be auto, float32, bfloat16 or float16, got {self.draft_dtype!r}")
        if self.tree is not None:
            object.__setattr__(self, "tree", tuple(int(b) for b in self.tree))
            if self.method != "draft" or not self.tree or min(self.tree) < 1:
                raise ValueError("tree drafting needs method 'draft' and positive children counts per depth")
            if self.rule != "auto":
                raise ValueError(f"rule {self.rule!r} does nothing with a tree (trees verify with rule 'auto')")
            if self.confidence_threshold > 0:
                raise ValueError("confidence_threshold does nothing with a tree (a tree drafts its full shape)")
        if self.method == "eagle" and self.eagle_tree is None and self.confidence_threshold > 0:
            raise ValueError("confidence_threshold with method 'eagle' needs eagle_tree (it cuts a tree's nodes below "
                             "that cumulative draft probability)")
        if self.method == "ngram" and self.confidence_threshold > 0:
            raise ValueError("confidence_threshold does nothing with method 'ngram' (its drafts have no probabilities)")
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise ValueError("confidence_threshold must be in [0, 1)")
        if self.draft_vocab is not None and (self.method != "draft" or self.draft_vocab < 1):
            raise ValueError("draft_vocab needs method 'draft' (a separate draft model) and a positive token count")

    @property
    def enabled(self) -> bool:
        return self.method != "none" and (self.adaptive or self.k > 0 or self.is_tree)

    @property
    def is_tree(self) -> bool:
        """A round drafts a whole tree (draft-model tree or EAGLE dynamic tree) instead of a chain."""
        return self.tree is not None or self.eagle_tree is not None

    @property
    def max_draft_tokens(self) -> int:
        """Most draft tokens one request feeds the target in a round (chain: k_max or k; tree: its nodes)."""
        if self.eagle_tree is not None:
            return self.eagle_tree[2] - 1
        if self.tree is not None:
            nodes, width = 0, 1
            for b in self.tree:
                width *= b
                nodes += width
            return nodes
        return max(self.k_max, self.k)

    def check_sampling(self, params) -> None:
        """Refuse a SamplingParams this speculation setting would silently not honour: rule 'greedy' decodes
        the argmax whatever the temperature, so a sampled request under it would be decoded greedily."""
        if self.rule == "greedy" and params.temperature > 0:
            raise ValueError(f"rule 'greedy' decodes greedily and would ignore temperature={params.temperature}; "
                             "use rule 'auto' (exact sampling) or temperature 0")

    @classmethod
    def from_flags(cls, draft: str | None, k: str | int | None, confidence: float | None, rule: str | None,
                   ngram_max: int = 3, tree: str | None = None, draft_vocab: int | None = None) -> "SpecConfig":
        """The command line's --draft (MODEL | early-exit:N | ngram | none), --k (K | auto), --tree (B1,B2,..)
        -> SpecConfig (generate, serve, bench). Raises ValueError with a one-line message for a malformed or
        meaningless combination (a flag that would do nothing in the chosen mode is refused, not ignored).
        None for k / confidence / rule means "not given"."""
        if draft_vocab is not None and (not draft or draft in ("none", "ngram") or draft.startswith(("eagle:", "early-exit"))
                                        or str(k).strip() == "0"):
            raise ValueError("--draft-vocab works with a draft model only (--draft MODEL, k > 0)")
        if draft_vocab is not None and draft_vocab < 1:
            raise ValueError(f"--draft-vocab must be a positive token count, got {draft_vocab}")
        k = "auto" if k is None else str(k).strip()
        adaptive = k == "auto"
        if not adaptive:
            try:
                kk = int(k)
            except ValueError:
                raise ValueError(f"--k must be a non-negative integer or 'auto', got {k!r}") from None
            if kk < 0:
                raise ValueError(f"--k must be a non-negative integer or 'auto', got {k!r}")
        else:
            kk = 4
        confidence = confidence or None  # 0 = off = not given
        rule = None if rule in (None, "auto") else rule
        if confidence is not None and not 0.0 <= confidence < 1.0:
            raise ValueError(f"--confidence must be in [0, 1), got {confidence}")
        common = dict(k=kk, adaptive=adaptive, confidence_threshold=confidence or 0.0, rule=rule or "auto")
        if not draft or draft == "none":
            given = [f for f, v in (("--tree", tree), ("--confidence", confidence), ("--rule", rule)) if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)} need(s) a drafter; --draft none turns speculation off")
            return cls(rule=rule or "auto")
        if not adaptive and kk == 0:  # a drafter at k = 0 never drafts: the flags that shape drafting do nothing
            given = [f for f, v in (("--tree", tree), ("--confidence", confidence), ("--rule", rule)) if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)} do(es) nothing with --k 0 (no drafts: plain decoding)")
        if tree is not None and draft == "ngram" or tree is not None and draft.startswith("early-exit"):
            raise ValueError(f"--tree works with a draft model only, not with --draft {draft}")
        if draft == "ngram":
            if confidence is not None:
                raise ValueError("--confidence does nothing with --draft ngram (n-gram drafts have no probabilities)")
            return cls(method="ngram", ngram_max=ngram_max, **common)
        if draft.startswith("eagle:"):
            head = draft.partition(":")[2]
            if not head:
                raise ValueError("--draft eagle:DIR needs the head's folder, e.g. eagle:~/.cache/forerun/eagle/qwen1.5b")
            if confidence is not None and tree is None:
                raise ValueError("--confidence with --draft eagle:DIR needs --tree (it keeps the tree's nodes whose "
                                 "cumulative draft probability is at least that; an EAGLE chain drafts k tokens)")
            if tree is not None:
                if rule is not None:
                    raise ValueError(f"--rule {rule} does nothing with --tree (trees verify with the exact rule 'auto')")
                if k != "auto":
                    raise ValueError("--k does nothing with --tree (TOPK,STEPS,NODES set the drafts)")
                return cls(method="eagle", eagle_head=head, eagle_tree=parse_eagle_tree(tree), **common)
            return cls(method="eagle", eagle_head=head, **common)
        if draft.startswith("early-exit"):
            _, _, n = draft.partition(":")
            if not n.isdigit() or int(n) < 1:
                raise ValueError("--draft early-exit:N needs a positive layer count, e.g. early-exit:8")
            return cls(method="early-exit", early_exit_layers=int(n), **common)
        if tree is not None:
            if rule is not None:
                raise ValueError(f"--rule {rule} does nothing with --tree (trees verify with the exact rule 'auto')")
            if confidence is not None:
                raise ValueError("--confidence does nothing with --tree (a tree drafts its full shape)")
            if k != "auto":
                raise ValueError("--k does nothing with --tree (the tree shape sets the drafts)")
            return cls(method="draft", draft_model=draft, tree=parse_tree(tree), draft_vocab=draft_vocab, **common)
        return cls(method="draft", draft_model=draft, draft_vocab=draft_vocab, **common)


def parse_tree(text: str) -> tuple[int, ...]:
    """'2,2,1' -> (2, 2, 1): children per node at each depth, every count a positive integer."""
    parts = [x.strip() for x in str(text).split(",")]
    if not parts or not all(x.isdigit() and int(x) >= 1 for x in parts):
        raise ValueError(f"--tree must be comma-separated positive integers (children per depth), e.g. 2,2,1; "
                         f"got {text!r}")
    return tuple(int(x) for x in parts)


def parse_eagle_tree(text: str) -> tuple[int, int, int]:
    """EAGLE's --tree: 'TOPK,STEPS,NODES', e.g. 4,4,16 (or 'dynamic' for that default)."""
    if str(text).strip() == "dynamic":
        return (4, 4, 16)
    parts = parse_tree(text)
    if len(parts) != 3 or parts[2] < 2:
        raise ValueError(f"--tree with --draft eagle: is TOPK,STEPS,NODES (e.g. 4,4,16) or 'dynamic'; got {text!r}")
    return parts  # type: ignore[return-value]


def parse_eagle_tree_row(text: str) -> tuple[tuple[int, int, int], float | None]:
    """A benchmark's EAGLE tree row: 'TOPK,STEPS,NODES' or 'TOPK,STEPS,NODES@C' (C: the tree confidence, the
    cumulative draft probability a node needs to be verified, in (0, 1)) -> (shape, C or None)."""
    shape_text, at, conf = str(text).partition("@")
    shape = parse_eagle_tree(shape_text)
    if not at:
        return shape, None
    try:
        c = float(conf)
    except ValueError:
        c = -1.0
    if not 0.0 < c < 1.0:
        raise ValueError(f"an EAGLE tree row's confidence (after @) must be in (0, 1); got {text!r}")
    return shape, c


def tree_label(tree: tuple[int, ...]) -> str:
    """How stats name a tree shape: 'tree 2x2x1 (10 nodes)'."""
    nodes, width = 0, 1
    for b in tree:
        width *= b
        nodes += width
    return f"tree {'x'.join(map(str, tree))} ({nodes} nodes)"


_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits, validated on creation so a bad value is named instead of surfacing later as a KV
    shortage or a batching error. max_num_seqs: requests running at once (>= 1). max_model_len: longest
    sequence (prompt + output) in tokens, None = the model's own context. max_num_batched_tokens: tokens one
    forward may hold (>= 1; chunked prefill splits longer prompts)."""

    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        def whole(name: str, v) -> None:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            if not 1 <= v <= _INT64_MAX:
                raise ValueError(f"{name} must be >= 1, got {v}")

        whole("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            if isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len < 1:
                raise ValueError(f"max_model_len must be a positive integer or None (the model's context), "
                                 f"got {self.max_model_len!r}")
        whole("max_num_batched_tokens", self.max_num_batched_tokens)
