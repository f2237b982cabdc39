"""Chat template -> ``(input_ids, loss_mask)``: the loss mask marks the tokens the drafter learns.

The conversation is rendered once with the tokenizer's chat template and tokenized once (with
character offsets). The mask is therefore computed on exactly the ids the target model will see,
never by tokenizing messages separately (which would disagree with the full tokenization at
every message boundary where BPE merges across it).

Assistant character spans come from rendering prefixes of the conversation. For assistant
message ``i``::

    P = render(messages[:i], add_generation_prompt=True)   # everything up to the reply
    Q = render(messages[:i + 1])                            # ... and the reply itself

Both must be prefixes of the full render (otherwise the template rewrites history, e.g. strips
reasoning from earlier turns, and the conversation is skipped as ``template_mismatch``). The span
is ``[len(P), len(Q))``: the reply text plus whatever the template closes the turn with, so the
end-of-turn token is trained on and the drafter learns to predict the end of an answer. A token
is in the mask iff its first character lies inside a span. (A token that starts before a span
and runs into it, e.g. a merged ``"\\n\\n"`` when a reply starts with a newline, stays out.)

Worked example with the ChatML tiny tokenizer, messages ``[user "Hi", assistant "Hello!"]``::

    full   <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
           <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
    P      ...<|im_start|>assistant\\n              (ends right before "Hello!")
    Q      ...<|im_start|>assistant\\nHello!<|im_end|>\\n
    tokens ... <|im_start|> a s sistant \\n  H e l l o !  <|im_end|> \\n
    mask   ...      0      0 0    0     0   1 1 1 1 1 1      1       1

Too long conversations are truncated (ids and mask cut together at ``max_length``) or skipped
(``on_too_long="skip"``); a result with no assistant token left is skipped.
"""

from __future__ import annotations

from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from torchspec.data.formats import Message, SkipConversation

ON_TOO_LONG = ("truncate", "skip")

__all__ = ["ON_TOO_LONG", "SkipConversation", "assistant_spans", "render", "tokenize_conversation"]


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no chat "
            "template; pass one as data.chat_template (a Jinja string, e.g. the ChatML template of "
            "torchspec.data.tiny_tokenizer.CHATML_TEMPLATE)"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} is not a fast (Rust) tokenizer, so it cannot return "
            "character offsets for the loss mask; load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )


def render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], add_generation_prompt: bool = False) -> str:
    """The chat template applied to ``messages`` as text; a template error skips the conversation."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as e:
        raise SkipConversation("template_error") from e
    assert isinstance(text, str), f"apply_chat_template(tokenize=False) returned {type(text).__name__}"
    return text


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], full: str, stop: int | None = None
) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of ``full`` (the whole render) to train on, in order.

    With ``stop``, spans starting at or after character ``stop`` are not computed: truncation
    has already cut that part of the conversation away, so its prefixes need not be rendered.
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        if stop is not None and len(before) >= stop:
            break
        through = render(tokenizer, messages[: i + 1])
        if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
            raise SkipConversation("template_mismatch")
        spans.append((len(before), len(through)))
    return spans


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose start offset lies in one of the sorted, disjoint ``spans``."""
    mask = []
    s = 0
    for start, _ in offsets:
        while s < len(spans) and spans[s][1] <= start:
            s += 1
        mask.append(int(s < len(spans) and spans[s][0] <= start))
    return mask


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    max_length: int,
    on_too_long: str = "truncate",
) -> tuple[list[int], list[int]]:
    """Render, tokenize and mask one conversation; see the module docstring.

    Returns ``(input_ids, loss_mask)`` of equal length <= ``max_length``, ``loss_mask[t] == 1``
    on assistant tokens (reply text and end-of-turn). Raises SkipConversation with reason
    ``no_assistant_turn``, ``template_error``, ``template_mismatch``, ``too_long`` (only with
    ``on_too_long="skip"``), ``no_assistant_tokens`` or ``no_assistant_tokens_after_truncation``.
    """
    if on_too_long not in ON_TOO_LONG:
        raise ValueError(f"on_too_long={on_too_long!r} is not one of {ON_TOO_LONG}")
    if max_length < 1:
        raise ValueError(f"max_length={max_length} must be a positive number of tokens")
    _check_tokenizer(tokenizer)
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipConversation("no_assistant_turn")

    full = render(tokenizer, messages)
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = list(encoding["input_ids"])
    offsets: list[tuple[int, int]] = list(encoding["offset_mapping"])
    truncated = len(input_ids) > max_length
    if truncated:
        if on_too_long == "skip":
            raise SkipConversation("too_long")
        input_ids, offsets = input_ids[:max_length], offsets[:max_length]

    spans = assistant_spans(tokenizer, messages, full, stop=offsets[-1][0] + 1 if truncated else None)
    loss_mask = _mask_from_offsets(offsets, spans)
    if not any(loss_mask):
        raise SkipConversation("no_assistant_tokens_after_truncation" if truncated else "no_assistant_tokens")
    return input_ids, loss_mask
