"""Training trajectories from a frozen snapshot: chain helpers and the offline builder (issue 9).

A frozen rollout (``S3TokenStore.freeze`` or ``read_snapshot``: a ``FrozenSnapshot``) holds one
``TokenEntry`` per model call. Each entry records its full prompt, or with ``prompt_is_delta`` only
the prompt suffix after its RESOLVED parent's cumulative tokens (the parent's full prompt plus its
generation), and the parent decision taken when the call was served (``parent_resolution``,
``parent_call_id``). This module turns such a snapshot into training rows.

Chain helpers (no S3, no NeMo Gym needed):

- ``cumulative_prompt(entry, entries_by_call_id)``: the full prompt token ids of any entry, rebuilt
  through its parent links when it is a delta (the same reconstruction as Gym's
  ``builder._materialize_delta_prompts`` and ``S3TokenStore``'s own delta chains, verified against
  the entry's ``digest``);
- ``check_chain(entries)``: the contiguity problems of a snapshot's entries (holes, children whose
  prompt does not extend their parent's cumulative tokens, digests and ``cum_len`` that do not match);
- ``to_gym_entries(snapshot)``: the same entries as NeMo Gym ``TokenEntry`` objects (needs ``nemo_gym``).

The builder, ``build_rollout(snapshot, builder=, engine=)`` -> ``RolloutBuild``, has two engines:

``engine="gym"`` runs NeMo Gym 0.7.0's own public consumer, ``nemo_gym.token_id_capture.consumer.
trajectories_from_source(rollout_id, source, builder=...)``, on an in-process source whose
``freeze`` returns this snapshot (entries converted by ``to_gym_entries``; same ``incomplete``,
``snapshot_id``, ``version``). Output, masking (``mask_sample``, ``capture_incomplete``) and metrics
are Gym's exactly; the returned dict is kept as ``RolloutBuild.gym_result``. No verified response
and no terminal call id are passed, so Gym's terminal attribution abstains (``no_response_object``)
and its strict single-chain policy decides the mask. Gym's ``rebuilt_response`` becomes one
``Trajectory`` (Gym delivers one chain per rollout, its "main" chain):

- the generated output items are the items with ``generation_token_ids`` (one per model call of
  the chain, in chain order; Gym has checked they are prefix-contiguous);
- ``token_ids`` = the first such item's ``prompt_token_ids`` + its ``generation_token_ids``, then for
  each following item the part of its ``prompt_token_ids`` after the tokens so far (the
  interstitial prompt tokens: tool results, the next user turn, chat-template glue) + its
  ``generation_token_ids``;
- ``loss_mask`` is 1 on generated tokens and 0 on prompt tokens; ``logprobs`` is the item's
  ``generation_log_probs`` on generated tokens and 0.0 on prompt tokens;
- ``call_ids``: each generated item is matched to the snapshot entry with the same full prompt and
  generation; when several entries have identical tokens (a retry that generated the same text),
  the one the next call of the chain names as its parent, and for the last call the smallest id
  (the sibling Gym keeps);
- ``chain_id`` is the id of the chain's last (terminal) model call (Gym's own name, ``"main"``, is
  the same for every rollout; the terminal call id names the chain across engines and re-builds).

A Gym build that fails (Gym's ``error``: no entries, no safe chain, a non-contiguous projection)
has no ``rebuilt_response`` and gives no trajectory.

``builder="per_request"`` (the built-in engine's own: NeMo Gym 0.7.0 has no such builder, and
``engine="auto"`` picks the built-in engine for it) gives one ``Trajectory`` per model call with
generated tokens: the call's full prompt (loss 0) and its generation (loss 1), ``chain_id`` the
call's id. It masks on the same evidence as ``prefix_merging``.

``engine="builtin"`` needs no NeMo Gym. It follows the recorded parent links and builds the main
chain the way Gym's ``prefix_merging`` does for the same input when no terminal is attributed:
duplicate model call ids are collapsed (conflicting ones masked); delta prompts are rebuilt through
their parents; calls are linked to their recorded parent when the child's full prompt starts with
the parent's cumulative tokens; an UNRESOLVED call (or one without a parent decision) starts its own
fragment; retry siblings (same parent, same prompt) keep the one a later call extends, and a retry
nobody extends is unresolved; the chains are the root-to-leaf paths without a quarantined retry and
the main chain is the one whose root call has the smallest ``(created_at, model_call_id)``; the
rollout is masked unless exactly one root and one chain remain with no unresolved retry or parent.
The metrics dict has Gym's keys and, on the same input, Gym's values (``terminal_attribution`` is
Gym's "no response" abstention). Where it differs from Gym, it is stricter (it masks where Gym might
deliver), never looser:

- a recorded parent that is not in the snapshot (a hole) or was dropped (an empty generation, a
  delta that cannot be rebuilt) is never replaced: Gym may re-attach such a child to a surviving
  ancestor by token-prefix matching (``parent_call_id_missing_recovered``); the built-in builder
  masks it (``missing_parent:<cid>``, or ``delta_chain_unreconstructable:<cid>`` for a delta prompt);
- any call with an empty generation masks the rollout (``empty_generation:<cid>``); Gym drops such
  calls and masks only when the drop breaks the chain;
- every recorded ``digest`` and ``cum_len`` is verified against the rebuilt cumulative tokens
  (``digest_mismatch:<cid>``, ``cum_len_mismatch:<cid>``); Gym verifies them only on parent links
  and delta rebuilds;
- a parent link is checked by comparing tokens (the child's prompt starts with the parent's
  cumulative tokens) where Gym compares the digest of the prompt prefix with the parent's recorded
  digest; with verified digests the two agree;
- an entry whose ``output_items`` carry token fields inline on more than the call's own item (two
  or more items with ``generation_token_ids`` and no valid ``token_item_index``, or another item
  beside the indexed one) masks the rollout (``token_fields_in_output_items:<cid>``): Gym's
  projection keeps token arrays on each of them (it copies the generation onto them without a
  valid index, and leaves a stray item's own arrays beside the indexed one), and its contiguity
  check then masks a main chain that holds one; the built-in builder masks the same
  (``per_request``: any call);
- it also has ``builder="per_request"`` (above), which Gym 0.7.0 does not.

Both engines mask every incomplete snapshot (``FrozenSnapshot.incomplete``, or a snapshot that
gives ``reasons``: Gym's source is then told it is incomplete); ``mask_reasons`` then starts with
the snapshot's own ``reasons`` followed by ``"capture_incomplete"``.

Mask reasons (``RolloutBuild.mask_reasons``; ``<cid>`` is a model call id): the snapshot's reasons
(``conflicting_payloads:<cid>``, ``dangling_intent:<cid>``, ``marked_incomplete:<cid>``,
``missing_parent:<cid>``, ...), ``capture_incomplete``, ``no_entries``, ``roots:<n>`` and
``chains:<n>`` (n roots / chains where exactly one is required), ``unresolved_retry:<cid>``; from the
Gym engine ``gym_mask_sample`` (always, when Gym masks), ``gym_error:<Gym's error>``,
``unresolved_parent:<cid>`` and, should Gym's output not map back onto the entries (not seen; then
no trajectory), ``gym_output_not_contiguous:<i>``, ``gym_output_unmatched:<i>`` or
``no_generated_tokens``; from the built-in engine ``duplicate_call_id_conflict:<cid>``,
``delta_chain_unreconstructable:<cid>``, ``parent_unresolved:<cid>``, ``missing_resolution:<cid>``,
``resolved_parent_missing_id:<cid>``, ``not_contiguous:<cid>``, ``digest_mismatch:<cid>``,
``cum_len_mismatch:<cid>``, ``empty_generation:<cid>``, ``logprob_length_mismatch:<cid>``,
``token_fields_in_output_items:<cid>`` and ``no_trainable_chain``. A masked rollout may still carry its main chain's trajectory (Gym's does
whenever its projection succeeded); it must never be trained on.

Memory: one rollout at a time; rebuilding a delta chain keeps every call's cumulative tokens (at
most the model's context window per call) for the duration of the build.
"""

# The package's modules: ``chains`` (ChainError, cumulative_prompt, check_chain), ``results``
# (Trajectory, RolloutBuild), ``gym`` (to_gym_entries and the Gym engine), ``builtin`` (the built-in
# engine) and ``build`` (build_rollout, build_rollout_async, the engine choice). Every public name
# is importable from ``s3capture.trajectory`` itself.
from s3capture.trajectory.build import (
    _choose_engine as _choose_engine,
    build_rollout as build_rollout,
    build_rollout_async as build_rollout_async,
)
from s3capture.trajectory.chains import (
    ChainError as ChainError,
    check_chain as check_chain,
    cumulative_prompt as cumulative_prompt,
)
from s3capture.trajectory.gym import to_gym_entries as to_gym_entries
from s3capture.trajectory.results import RolloutBuild as RolloutBuild, Trajectory as Trajectory

__all__ = [
    "ChainError",
    "cumulative_prompt",
    "check_chain",
    "to_gym_entries",
    "Trajectory",
    "RolloutBuild",
    "build_rollout",
    "build_rollout_async",
]
