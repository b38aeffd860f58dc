"""A minimal valid entry for tests that need one stored call."""

from s3capture.fingerprint import stamp_continuation
from s3capture.records import ParentResolutionStatus, TokenEntry, compute_digest


def make_entry_for_spill(rollout_id: str, call_id: str) -> TokenEntry:
    entry = TokenEntry(rollout_id=rollout_id, model_call_id=call_id, prompt_token_ids=[1, 2], generation_token_ids=[3],
                       generation_log_probs=[-0.5], output_items=[{"type": "message", "role": "assistant", "content": "x"}],
                       created_at=1700000000.0)
    stamp_continuation(entry, [{"role": "user", "content": "q"}])
    entry.cum_len, entry.digest = 3, compute_digest([1, 2, 3])
    entry.parent_resolution = ParentResolutionStatus.ROOT
    return entry
