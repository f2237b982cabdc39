"""Training examples, the held-out split, batch collation and a resumable batch sampler.

``build_datasets`` turns a conversation file (or a finished regeneration directory,
``torchspec.data.regenerated``) into tokenized ``Example``s, drops exact duplicates
(``KeptExamples``) and splits off a held-out set fixed by a seed (``held_out_indices``); a
directory written by ``data_pipelines.prepare`` is read as it is (``torchspec.data.prepared``):
the same examples and split, no tokenisation. ``collate`` right-pads
a batch and adds the per-token ``position_ids`` and ``document_ids`` that packed rows
(``torchspec.data.packing``) need.
``ResumableBatchSampler`` yields batches of example indices
forever, epoch after epoch; its ``state_dict`` (epoch, position) is what a checkpoint stores so
that a resumed run sees exactly the batches an uninterrupted run would have seen.
``shard_for_rank`` gives each data-parallel rank its share of a global batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from torchspec.data.formats import SkipConversation, SkipStats
from torchspec.data.regenerated import read_source
from torchspec.data.template import tokenize_conversation


@dataclass
class Example:
    """One tokenized conversation, or a packed row of several: ``input_ids``, ``loss_mask`` long ``[T]``.

    ``document_lengths`` is None for a single conversation; for a packed row it lists the lengths
    of its conversations in order (they sum to T).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    document_lengths: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return self.input_ids.numel()


def build_datasets(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    fmt: str = "auto",
    max_length: int,
    eval_size: int,
    seed: int,
    max_conversations: int | None,
    on_too_long: str = "truncate",
    chat_template: str | None = None,
    dedup: bool = True,
    eval_path: str | None = None,
) -> tuple[list[Example], list[Example], SkipStats]:
    """Read, tokenize and split ``path`` into ``(train, eval, stats)``.

    ``eval_path`` (a conversation file or regeneration directory, e.g. MT-Bench answered by the target):
    the held-out set is its first ``eval_size`` conversations instead of a split of ``path``; every
    example of ``path`` trains, except exact copies of a held-out one (with ``dedup``).

    ``max_conversations`` caps the number of examples that survive tokenization (reading stops
    once it is reached), so ``max_conversations=2000`` gives 2000 examples unless the file runs
    out. With ``dedup`` an exact duplicate of an earlier example is dropped before the cap and the
    split (``KeptExamples``; counted in ``stats.duplicates``), so no held-out example has a copy
    among the training examples. The held-out set is ``eval_size`` examples chosen by a
    permutation seeded with ``seed`` alone (its own generator, not the global RNG): the same file,
    settings and seed always give the same split. Both lists keep file order. ``chat_template``, if given, replaces the
    tokenizer's own template (it is set on the tokenizer). ``stats.kept`` counts the examples.
    A prepared directory (``data_pipelines.prepare``) gives the same lists without tokenising, or a
    ValueError when it was prepared for another tokenizer, template or settings.
    """
    if eval_size < 0:
        raise ValueError(f"eval_size={eval_size} must be >= 0")
    if eval_path is None and max_conversations is not None and max_conversations < eval_size + 1:
        raise ValueError(
            f"max_conversations={max_conversations} leaves no training example after eval_size={eval_size}; "
            f"raise max_conversations above {eval_size} or lower eval_size"
        )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    from torchspec.data.prepared import is_prepared_dir, load_prepared  # it imports Example from here

    if eval_path is not None and is_prepared_dir(path):
        raise ValueError(f"data.eval_path={eval_path!r} with the prepared directory {path!r}: its held-out split is "
                         f"fixed when it is prepared; train on the conversations (or the regeneration) it was "
                         f"prepared from, or drop data.eval_path.")
    if is_prepared_dir(path):
        settings = {"format": fmt, "max_length": max_length, "on_too_long": on_too_long,
                    "max_conversations": max_conversations, "eval_size": eval_size, "seed": seed, "dedup": dedup}
        prepared = load_prepared(path, tokenizer, settings)
        return prepared.train, prepared.eval, prepared.stats

    stats = SkipStats()
    kept = KeptExamples(stats, dedup, max_conversations)
    held_out_set = None
    if eval_path is not None:
        held_out_set = read_held_out(eval_path, tokenizer, fmt, max_length, on_too_long, eval_size)
        for e in held_out_set:
            kept.exclude(e.input_ids.tolist(), e.loss_mask.tolist())
    examples: list[Example] = []
    with closing(read_source(path, fmt, stats)) as conversations:
        for messages in conversations:
            try:
                ids, mask = tokenize_conversation(tokenizer, messages, max_length, on_too_long)
            except SkipConversation as skip:
                stats.skip(skip.reason)
                continue
            if kept.keep(ids, mask):
                examples.append(Example(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)))
            if kept.full:
                break
    stats.kept = len(examples)
    if held_out_set is not None:
        if not examples:
            raise ValueError(f"no training example survived from {path!r} ({stats.summary()}).")
        return examples, held_out_set, stats

    if len(examples) < eval_size + 1:
        raise ValueError(
            f"only {len(examples)} examples survived from {path!r}, fewer than eval_size + 1 = {eval_size + 1} "
            f"({stats.summary()}); use a larger file, a smaller eval_size, or a larger max_length"
        )
    held_out = held_out_indices(len(examples), eval_size, seed)
    train = [e for i, e in enumerate(examples) if i not in held_out]
    evaluation = [e for i, e in enumerate(examples) if i in held_out]
    return train, evaluation, stats


def read_held_out(path: str, tokenizer: PreTrainedTokenizerBase, fmt: str, max_length: int, on_too_long: str,
                  eval_size: int) -> list[Example]:
    """The first ``eval_size`` conversations of ``path`` that tokenize, in file order (``data.eval_path``)."""
    stats, examples = SkipStats(), []
    try:
        with closing(read_source(path, fmt, stats)) as conversations:
            for messages in conversations:
                try:
                    ids, mask = tokenize_conversation(tokenizer, messages, max_length, on_too_long)
                except SkipConversation as skip:
                    stats.skip(skip.reason)
                    continue
                examples.append(Example(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)))
                if len(examples) == eval_size:
                    break
    except ValueError as err:  # a missing, empty or unreadable file, named by the reader
        raise ValueError(f"data.eval_path={path!r}: {err}") from None
    if not examples:
        raise ValueError(f"data.eval_path={path!r}: no held-out conversation could be used ({stats.summary()}).")
    return examples


class KeptExamples:
    """THE rule for which tokenised conversations become examples, applied in file order before the
    split by ``build_datasets`` and ``data_pipelines.prepare`` alike.

    With ``dedup``, an example whose ``input_ids`` and ``loss_mask`` both equal an earlier example's
    is dropped (the first occurrence stays) and counted in ``stats.duplicates``: regenerating
    ShareGPT greedily turns its many identical prompts ("continue", "hi") into identical
    conversations, and a held-out copy of a training example inflates held-out acceptance.
    ``full`` says ``max_conversations`` examples are kept (duplicates do not count).
    """

    def __init__(self, stats: SkipStats, dedup: bool, max_conversations: int | None):
        self.stats, self.dedup, self.max_conversations = stats, dedup, max_conversations
        self.kept = 0
        self._seen: set[bytes] = set()  # 16-byte digests: ShareGPT-sized sets cost a few MB

    @staticmethod
    def _key(input_ids: list[int] | np.ndarray, loss_mask: list[int] | np.ndarray) -> bytes:
        # ids and mask have one length, so their bytes back to back name the example unambiguously
        tokens = np.asarray(input_ids, dtype=np.int64).tobytes() + np.asarray(loss_mask, dtype=np.int8).tobytes()
        return hashlib.blake2b(tokens, digest_size=16).digest()

    def exclude(self, input_ids: list[int] | np.ndarray, loss_mask: list[int] | np.ndarray) -> None:
        """With ``dedup``, a later copy of this example (a held-out one) is dropped as a duplicate."""
        if self.dedup:
            self._seen.add(self._key(input_ids, loss_mask))

    def keep(self, input_ids: list[int] | np.ndarray, loss_mask: list[int] | np.ndarray) -> bool:
        """Whether the next example in file order is kept."""
        if self.dedup:
            key = self._key(input_ids, loss_mask)
            if key in self._seen:
                self.stats.duplicates += 1
                return False
            self._seen.add(key)
        self.kept += 1
        return True

    @property
    def full(self) -> bool:
        return self.max_conversations is not None and self.kept >= self.max_conversations


def held_out_indices(num_examples: int, eval_size: int, seed: int) -> set[int]:
    """THE split rule: the first ``eval_size`` of a permutation seeded with ``seed`` alone."""
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed)).tolist()
    return set(order[:eval_size])


def collate(examples: list[Example], pad_id: int, packed: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad a batch to its longest example.

    Returns long tensors, all ``[B, T]`` with ``T`` the longest length: ``input_ids`` (``pad_id``
    on padding), ``loss_mask`` (0 on padding), ``attention_mask`` (1 on real tokens),
    ``position_ids`` (position inside the token's own document; padding continues the last
    document's count, so an unpacked row is exactly ``arange(T)``) and, with ``packed`` (the data
    set holds packed rows, ``data.pack``), ``document_ids`` (index of the token's document in its
    row, 0, 1, ...; -1 on padding). Unpacked batches carry no ``document_ids``, so the target and
    the drafter take their plain causal attention (padding sits after every real token, so
    causality hides it). The key's presence depends on the data set, never on one batch's
    content: the ranks of a tensor-parallel group concatenate their batches.
    """
    assert examples, "collate needs at least one example"
    lengths = [len(e) for e in examples]
    batch, longest = len(examples), max(lengths)
    input_ids = torch.full((batch, longest), pad_id, dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((batch, longest), dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((batch, longest), dtype=torch.long)  # [B, T]
    position_ids = torch.arange(longest).repeat(batch, 1)  # [B, T]
    document_ids = torch.full((batch, longest), -1, dtype=torch.long)  # [B, T]
    for row, (example, length) in enumerate(zip(examples, lengths)):
        input_ids[row, :length] = example.input_ids
        loss_mask[row, :length] = example.loss_mask
        attention_mask[row, :length] = 1
        start = 0
        for doc, n in enumerate(example.document_lengths or (length,)):
            position_ids[row, start:] = torch.arange(longest - start)  # restart; the next document restarts again
            document_ids[row, start : start + n] = doc
            start += n
        assert start == length, f"document_lengths {example.document_lengths} do not sum to the length {length}"
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask,
             "position_ids": position_ids}
    if packed:
        batch["document_ids"] = document_ids
    return batch


class ResumableBatchSampler:
    """Batches of example indices, forever, resumable from ``state_dict``.

    Epoch ``e`` is the permutation ``torch.randperm(num_examples, generator=Generator().manual_seed(seed + e))``
    cut into ``num_examples // batch_size`` full batches (the incomplete last batch is dropped).
    The state is only ``(epoch, position)``, position = batches already taken in this epoch, because
    every epoch's order is a pure function of the seed: nothing else needs to be saved.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if batch_size > num_examples:
            raise ValueError(
                f"batch_size={batch_size} is larger than the {num_examples} training examples, so no full "
                "batch exists; lower the batch size or use more data (max_conversations)"
            )
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.batches_per_epoch = num_examples // batch_size
        self._epoch = 0
        self._position = 0
        self._order: list[int] | None = None  # permutation of the current epoch, built lazily

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self._epoch

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            generator = torch.Generator().manual_seed(self.seed + self._epoch)
            self._order = torch.randperm(self.num_examples, generator=generator).tolist()
        return self._order

    def next_batch(self) -> list[int]:
        start = self._position * self.batch_size
        batch = self._epoch_order()[start : start + self.batch_size]
        self._position += 1
        if self._position == self.batches_per_epoch:
            self._epoch, self._position, self._order = self._epoch + 1, 0, None
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if set(state) != {"epoch", "position"}:
            raise ValueError(f"sampler state has keys {sorted(state)}; expected ['epoch', 'position']")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.batches_per_epoch:
            raise ValueError(
                f"sampler state epoch={epoch}, position={position} is out of range for "
                f"{self.batches_per_epoch} batches per epoch (num_examples={self.num_examples}, "
                f"batch_size={self.batch_size}); was it saved with a different dataset or batch size?"
            )
        self._epoch, self._position, self._order = epoch, position, None


def shard_for_rank(indices: list[int], rank: int, world: int) -> list[int]:
    """Rank ``rank``'s strided share ``indices[rank::world]`` of a global batch."""
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside [0, world={world})")
    if len(indices) % world:
        raise ValueError(
            f"a batch of {len(indices)} indices does not split evenly over world={world} ranks; "
            f"choose a batch size divisible by {world}"
        )
    return indices[rank::world]
