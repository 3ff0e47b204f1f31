"""What one target call yields per row: the `SequenceSelection` every sequence-level rule returns.

Shared by the SpecTr-style walk (`spectr.sequence`) and block verification (`spectr.block`);
it holds no logic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_TOKEN = -1


@dataclass
class SequenceSelection:
    """What one target call yields per prompt.

    tokens: [B, L + 1] int64, accepted draft tokens then one correction or bonus token;
        positions >= num_tokens hold PAD_TOKEN (-1).
    num_tokens: [B] int64 in 1..L+1.
    num_accepted: [B] int64 = num_tokens - 1, the accepted draft tokens.
    draft_index: [B] int64, a draft whose first num_accepted tokens equal the accepted ones
        (its KV cache can be committed).
    accepted_per_position: [L] int64, how many rows accepted a draft token at position i.
    """

    tokens: torch.Tensor
    num_tokens: torch.Tensor
    num_accepted: torch.Tensor
    draft_index: torch.Tensor
    accepted_per_position: torch.Tensor
