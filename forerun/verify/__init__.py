"""forerun.verify: speculative-decoding verification on plain torch tensors (CPU and CUDA).

probs      the one logits -> probabilities transform shared by draft and target; sampling; logprobs
layout     seed 000's flattened chain layout and padded tree layouts (masks, positions, SGLang links)
chain      verify_chain: greedy, exact rejection, alpha-penalty residual, typical acceptance
tree       verify_tree: greedy, SGLang target-only, exact multi-draft (recursive rejection), typical
reference  per-row loops: the readable oracle of the tests
"""
from .chain import DRAFT_PROB_PENALTY, RULES, VerifyResult, residual_weights, verify_chain
from .layout import (build_row_to_req, chain_rows, parents_from_retrive, retrive_links, tree_attention_mask,
                     tree_layout, tree_positions, unpack_bitmask)
from .probs import (PROB_SUM_TOLERANCE, Logprobs, SamplingTensors, check_probs, compute_logprobs, logits_to_probs,
                    sample_from_probs)
from .tree import TREE_RULES, TreeVerifyResult, verify_tree

__all__ = [
    "DRAFT_PROB_PENALTY", "PROB_SUM_TOLERANCE", "RULES", "TREE_RULES", "Logprobs", "SamplingTensors",
    "TreeVerifyResult", "VerifyResult", "build_row_to_req", "chain_rows", "check_probs", "compute_logprobs",
    "logits_to_probs", "parents_from_retrive", "residual_weights", "retrive_links", "sample_from_probs",
    "tree_attention_mask", "tree_layout", "tree_positions", "unpack_bitmask", "verify_chain", "verify_tree",
]
