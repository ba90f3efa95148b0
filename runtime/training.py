"""Training losses of a Qwen35 model and its MTP head over whole sequences, through the model's own forward
(one model definition for training and inference): a prefill from empty caches, with autograd on.

The MTP objective is the Qwen / DeepSeek one: the head sees the target's final-normed hidden state at
position i and the embedding of token i + 1, and predicts token i + 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from npuport.runtime.model import Qwen35


@dataclass
class SequenceLosses:
    """Mean token cross-entropies (nats) over a batch: `target` of token i + 1 from position i, `mtp` of
    token i + 2 from the head at position i."""

    target: torch.Tensor
    mtp: torch.Tensor

    def total(self, mtp_weight: float) -> torch.Tensor:
        """The training objective: target + mtp_weight * mtp."""
        return self.target + mtp_weight * self.mtp


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [B, T, V] against labels [B, T], in float32 or wider."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(wide.flatten(0, 1), labels.flatten())


def sequence_losses(model: Qwen35, tokens: torch.Tensor) -> SequenceLosses:
    """tokens [B, T] (T >= 3, every row full length) -> the target's and the MTP head's losses.

    The target runs as one prefill from empty caches; the head then runs over positions 0..T-3, row i pairing
    token i + 1 with the target's final-normed hidden [B, T, hidden] at i, as generate's mtp_prefill does."""
    if model.mtp is None:
        raise ValueError("the model has no MTP head to train")
    batch, t = tokens.shape
    if t < 3:
        raise ValueError(f"sequences of {t} tokens are too short for the MTP loss (it needs 3)")
    lengths = torch.full((batch,), t, dtype=torch.long, device=tokens.device)
    hidden = model.prefill(tokens, model.new_state(batch, t), lengths)  # [B, T, hidden]
    target = _cross_entropy(model.logits(hidden[:, :-1]), tokens[:, 1:])
    mtp_logits, _ = model.mtp_forward(tokens[:, 1:-1], hidden[:, :-2], model.new_mtp_state(batch, t - 2))
    mtp = _cross_entropy(mtp_logits, tokens[:, 2:])
    return SequenceLosses(target, mtp)
