"""The gated delta rule of a GatedDeltaNet layer: chunked prefill (chunk.py) and a recurrent step for decode and
speculative verify (fused_recurrent.py), which keeps every token's state update (verify_log.py) so that any
accepted prefix can be committed; their PyTorch references in naive.py. Imports kernels.launch and npuport.devices.

Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g (log decay), beta [B, T, HV]; value head j reads key head
j // (HV // H). The recurrent state of one value head is S [K, V] (keys along rows, values along columns),
so a batch of states is [B, HV, K, V], always in fp32 (float64 for float64 inputs) - the one orientation
used everywhere: prefill, chunked prefill, verify and commit. Per token, with q, k l2-normalized and
q scaled by K^-0.5:

    S = exp(g_t) * S;  u = beta_t * (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T q_t

so the state after token t is S_t = exp(g_t) S_{t-1} + k_t u_t^T: k_t, g_t and u_t (K + 1 + V numbers) hold it
as well as the K x V of S_t itself. A verify step records them per token (VerifyLog) and leaves the state at
the step's start; the next step first replays the entries its request accepted - the same operations on the
same fp32 values, so the same state as if it had been kept - and goes on from there. The state is read and
written once per step, as in a plain decode step, however many tokens were verified.
"""

from npuport.kernels.gated_delta_rule.chunk import (
    CHUNK,
    ChunkConfig,
    ChunkParts,
    chunk_config,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_triton,
    chunk_prepare,
    chunk_states,
)
from npuport.kernels.gated_delta_rule.fused_recurrent import (
    RecurrentConfig,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_triton,
    recurrent_config,
)
from npuport.kernels.gated_delta_rule.l2norm import L2NORM_EPS, l2norm
from npuport.kernels.gated_delta_rule.naive import (
    chunk_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule_reference,
)
from npuport.kernels.gated_delta_rule.verify_log import VerifyLog, replay_pending

__all__ = [
    "CHUNK", "ChunkConfig", "ChunkParts", "L2NORM_EPS", "RecurrentConfig", "VerifyLog", "chunk_config",
    "chunk_gated_delta_rule", "chunk_gated_delta_rule_reference", "chunk_gated_delta_rule_triton", "chunk_prepare",
    "chunk_states", "fused_recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule_reference",
    "fused_recurrent_gated_delta_rule_triton", "l2norm", "recurrent_config", "replay_pending",
]
