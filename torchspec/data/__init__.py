"""Conversations -> token ids + loss mask -> batches.

``formats`` reads JSONL / JSON-array files (OpenAI or ShareGPT records) into normalised
messages, ``template`` renders them with the tokenizer's chat template into ``(input_ids,
loss_mask)``, ``dataset`` builds the train/held-out split, collates batches and samples them
resumably. ``tiny_tokenizer`` builds the offline ChatML tokenizer used by tests and tiny targets.
"""

from torchspec.data.dataset import Example, ResumableBatchSampler, build_datasets, collate, shard_for_rank
from torchspec.data.formats import (
    FORMATS,
    ROLE_ALIASES,
    SHAREGPT_ALIAS,
    Message,
    SkipConversation,
    SkipStats,
    iter_conversations,
    normalize_messages,
    read_conversations,
)
from torchspec.data.template import ON_TOO_LONG, assistant_spans, render, tokenize_conversation
from torchspec.data.tiny_tokenizer import CHATML_TEMPLATE, build_tiny_tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "FORMATS",
    "ON_TOO_LONG",
    "ROLE_ALIASES",
    "SHAREGPT_ALIAS",
    "Example",
    "Message",
    "ResumableBatchSampler",
    "SkipConversation",
    "SkipStats",
    "assistant_spans",
    "build_datasets",
    "build_tiny_tokenizer",
    "collate",
    "iter_conversations",
    "normalize_messages",
    "read_conversations",
    "render",
    "shard_for_rank",
    "tokenize_conversation",
]
