"""Insert/delete token editing: one step of `joint_threshold_indel` (LLaDA2.2; SGLang's
JointThresholdInDel), greedy, on one block.

The block keeps its B positions (and so its position ids and K/V slots). Each step reads the argmax
x and its probability p at every generated position of the block, as joint_threshold does, but a
candidate may also be one of two edit tokens: DELETE drops its position, SPLIT turns it into a new
mask followed by the token the position held. After the step's writes the generated suffix is
rescanned left to right and cut, or padded with new masks, back to the block's length. Which masks
are *original* (the block opened with them) moves with them through the rescan; a mask a SPLIT or a
pad brought in is *introduced*. With t = `confidence_threshold`, e = `edit_threshold`,
m = `max_post_edit_steps`:

1. The update count rises; while no original mask remains, so does the post-edit count (in all:
   a mask that reappears does not reset it). The step is the block's **cleanup** when the post-edit
   count reached m (m > 0), when m = 0 and no original mask remains, or past B + m updates.
2. Outside cleanup, an original mask whose argmax is the mask token takes its best other token.
3. Reveals: cleanup writes every mask; while original masks remain, every mask with p > t if there
   are at least 1 + (introduced masks) of them, else that many most confident masks (`torch.topk`
   over the block, prompt positions at -inf); with none left, every mask. With m = 0, the step that
   reveals the last original masks becomes the cleanup (and writes every mask).
4. Edits: every non-mask generated position whose argmax differs, with p > e.
5. Nothing to write: the block ends. Cleanup writes no mask, DELETE or SPLIT: such a write takes the
   best token of the row that is none of them. Otherwise, when this step's input block was seen
   before (anti-loop), the changing write of least confidence takes the best token not yet written
   at that position in this block (and not the mask, at an original mask).
6. The writes go in; a DELETE or SPLIT among them rescans the block. Cleanup ends the block.

A template's pinned positions (`InDelBlock.pinned`) are what SGLang's rule makes of committed
positions inside the block: never a mask, never edited, never written. They also stay where they
are: the rescan runs on each stretch of free positions between pins (and the block's ends) on its
own, each cut or padded back to its own length, so content never crosses a pin.

Everything here mirrors SGLang's tensors and calls (argmax, softmax, topk) so that ties resolve as
they do there. `InDelBlock` is the block's state between steps; `indel_step` returns the block
after the step as `Item`s that say where each position's content came from, so the caller carries
each token's step and logprob through the rescan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from configs import EngineConfig
from engine.core.decoding.unmasking import SpecialIds, UnmaskingSettings
from engine.model.spec import ModelSpec


def special_ids(spec: ModelSpec, config: EngineConfig, mask_id: int) -> SpecialIds:
    """The block's special tokens: the mask, and the edit tokens of config.json (`delete_token_id`,
    `split_token_id`, read by the family into `spec.extra`), else EngineConfig's
    `dllm_delete_token_id` / `dllm_split_token_id`; ValueError naming a bad one."""
    ids = {}
    for name in ("delete_token_id", "split_token_id"):
        token = getattr(spec.extra, name, None)
        ids[name] = getattr(config, f"dllm_{name}") if token is None else token
        if ids[name] is not None and not 0 <= ids[name] < spec.vocab_size:
            raise ValueError(f"dllm_{name}={ids[name]} must be a token id below vocab_size={spec.vocab_size}")
    found = [mask_id, *(t for t in ids.values() if t is not None)]
    if len(set(found)) != len(found):
        raise ValueError(f"dllm_delete_token_id, dllm_split_token_id and the mask token must differ: mask "
                         f"{mask_id}, delete {ids['delete_token_id']}, split {ids['split_token_id']}")
    return SpecialIds(mask_id, ids["delete_token_id"], ids["split_token_id"])


@dataclass
class InDelBlock:
    """A block's state under the rule, per generated position where a list (indices 0.. from the
    block's first generated position)."""

    orig_mask: list[bool]  # the position's content descends from a mask the block opened with
    post_edit_steps: int = 0  # updates without an original mask, in all
    num_update_steps: int = 0
    seen: set[tuple[int, ...]] = field(default_factory=set)  # the steps' input blocks
    history: dict[int, set[int]] = field(default_factory=dict)  # position -> tokens written there
    last: StepOutcome | None = None  # the last step that changed the block (its trace event)
    pinned: frozenset[int] = frozenset()  # positions a template pins: fixed, never written or moved


@dataclass(frozen=True)
class Item:
    """One generated position of the block after a step: where its content was in the step's input
    (`source`; None for a mask the step introduced), its token, and whether this step wrote it."""

    source: int | None
    token: int
    written: bool
    orig_mask: bool


@dataclass
class StepOutcome:
    """What a step did: the block after it, the changed writes at input positions (edit tokens
    included), whether it was the cleanup (the block ends) and, when it rescanned, each token the
    rescan moved (input position, position after the step) and the input positions whose content
    left the block."""

    items: list[Item]
    writes: dict[int, int]
    cleanup: bool
    rescanned: bool = False
    moves: list[tuple[int, int]] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.writes)


def _best_except(row: torch.Tensor, excluded: Any) -> torch.Tensor:
    """The argmax of `row` (one row or several) with the `excluded` token ids at -inf."""
    row = row.clone()
    row[..., excluded] = float("-inf")
    return torch.argmax(row, dim=-1)


def indel_step(state: InDelBlock, tokens: list[int], logits: torch.Tensor, offset: int, block_length: int,
               settings: UnmaskingSettings, ids: SpecialIds) -> StepOutcome | None:
    """One step on the block's generated positions `tokens` (their logits rows `logits`; `offset`
    prompt positions precede them in the block of `block_length`). None: nothing to write, the block
    ends. Updates `state`."""
    logits = logits.float()
    mask_id, delete_id, split_id = ids.mask_id, ids.delete_id, ids.split_id
    current = torch.tensor(tokens, device=logits.device)
    x = torch.argmax(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    p = torch.gather(probs, -1, x[:, None])[:, 0]
    masked = current == mask_id
    orig = torch.tensor(state.orig_mask, device=logits.device) & masked
    num_orig, num_masked = torch.stack((orig.sum(), masked.sum())).tolist()

    state.num_update_steps += 1
    if num_orig == 0:
        state.post_edit_steps += 1
    m = settings.max_post_edit_steps
    cleanup = ((m > 0 and state.post_edit_steps >= m) or (m == 0 and num_orig == 0)
               or state.num_update_steps > block_length + m)
    if not cleanup:  # an original mask must not stay a mask by its own write
        fallback = (orig & (x == mask_id)).nonzero()[:, 0]
        if fallback.numel():
            best = _best_except(logits[fallback], mask_id)
            x[fallback] = best
            p[fallback] = probs[fallback, best]

    reveal = torch.zeros_like(masked)
    if num_masked:
        confidence = torch.where(masked, p, float("-inf"))
        if cleanup or not num_orig:
            reveal = masked
        else:
            needed = 1 + num_masked - num_orig  # so at least one original mask is among them
            confident = (confidence > settings.confidence_threshold) & masked
            if confident.sum().item() >= needed:
                reveal = confident
            else:
                in_block = torch.cat((confidence.new_full((offset,), float("-inf")), confidence))
                _, chosen = torch.topk(in_block, k=min(needed, num_masked))
                reveal[chosen - offset] = True
    if m == 0 and num_orig and not (orig & ~reveal).any().item():
        cleanup, reveal = True, masked
    edits = (p > settings.edit_threshold) & (current != x) & ~masked
    if state.pinned:
        edits[list(state.pinned)] = False
    write_positions = (reveal | edits).nonzero()[:, 0]
    if not write_positions.numel():
        return None

    if cleanup:
        written = x[write_positions]
        scrub = write_positions[(written == mask_id) | (written == delete_id) | (written == split_id)]
        if scrub.numel():
            x[scrub] = _best_except(logits[scrub], [mask_id, delete_id, split_id])
    key = tuple(tokens)
    if key in state.seen and not cleanup:  # the same input again: change the least confident change
        changing = ((reveal | edits) & (x != current)).nonzero()[:, 0]
        if changing.numel():
            at = changing[p[changing].argmin()].item()
            excluded = list(state.history.get(at, ())) + ([mask_id] if orig[at].item() else [])
            x[at] = _best_except(logits[at], excluded) if excluded else torch.argmax(logits[at])
    state.seen.add(key)

    writes: dict[int, int] = {}
    for pos, token in torch.stack((write_positions, x[write_positions]), dim=1).tolist():
        state.history.setdefault(pos, set()).add(token)
        if token != tokens[pos]:
            writes[pos] = token
    if {delete_id, split_id} & set(writes.values()):
        items, deleted = _rescan(tokens, writes, state.orig_mask, ids, state.pinned)
        moves = [(it.source, j) for j, it in enumerate(items)
                 if it.source is not None and it.source != j and it.token != mask_id]
        outcome = StepOutcome(items, writes, cleanup, True, moves, deleted)
    else:
        outcome = StepOutcome([Item(i, writes.get(i, t), i in writes, state.orig_mask[i])
                               for i, t in enumerate(tokens)], writes, cleanup)
    state.orig_mask = [it.orig_mask for it in outcome.items]
    return outcome


def _rescan(tokens: list[int], writes: dict[int, int], orig_mask: list[bool], ids: SpecialIds,
            pinned: frozenset[int] = frozenset()) -> tuple[list[Item], list[int]]:
    """The block after writes with DELETE / SPLIT among them, and the input positions whose content
    left it: each stretch of positions between pins on its own, pins kept in place."""
    items: list[Item] = []
    deleted: list[int] = []
    start = 0
    for stop in [*sorted(pinned), len(tokens)]:
        run, gone = _rescan_run(tokens, writes, orig_mask, ids, start, stop)
        items += run
        deleted += gone
        if stop < len(tokens):
            items.append(Item(stop, tokens[stop], False, orig_mask[stop]))
        start = stop + 1
    return items, sorted(deleted)


def _rescan_run(tokens: list[int], writes: dict[int, int], orig_mask: list[bool], ids: SpecialIds,
                start: int, stop: int) -> tuple[list[Item], list[int]]:
    """Positions [start, stop) after the writes: left to right, a DELETE drops its position, a SPLIT
    becomes a new mask and the position's previous content; cut or padded with new masks back to
    stop - start positions."""
    items: list[Item] = []
    deleted: list[int] = []
    for i in range(start, stop):
        old = tokens[i]
        token = writes.get(i, old)
        if token == ids.delete_id:
            deleted.append(i)
        elif token == ids.split_id:
            items += [Item(None, ids.mask_id, False, False), Item(i, old, False, orig_mask[i])]
        else:
            items.append(Item(i, token, i in writes, orig_mask[i]))
    n = stop - start
    deleted += [it.source for it in items[n:] if it.source is not None]
    items = items[:n] + [Item(None, ids.mask_id, False, False)] * (n - len(items))
    return items, deleted
