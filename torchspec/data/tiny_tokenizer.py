"""A tiny ChatML tokenizer built locally, for tests and the tiny (``debugmodel``-style) targets.

``build_tiny_tokenizer`` trains a byte-level BPE on a few hundred synthetic English sentences
held in memory, so it needs no network and no files. The result behaves like the tokenizer of
a small ChatML chat model (SmolLM2, Qwen): the same special tokens, a chat template that injects
a default system prompt, fast offsets. Because the training corpus and the trainer settings are
fixed, two calls build the same vocabulary and merges, in any process; a tiny target model
sized to ``len(tokenizer)`` therefore sees the same ids everywhere.

Special token ids are fixed: ``<|endoftext|>`` = 0 (padding), ``<|im_start|>`` = 1,
``<|im_end|>`` = 2 (end of turn, also ``eos_token``).
"""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# The ChatML template of SmolLM2/Qwen-style chat models, with a short default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_SUBJECTS = ["the cat", "a dog", "my friend", "the model", "this system", "the user", "an assistant",
             "the teacher", "our team", "the robot", "a student", "the city"]
_VERBS = ["writes", "reads", "likes", "answers", "builds", "explains", "finds", "needs", "helps",
          "sees", "trains", "asks about"]
_OBJECTS = ["a short story", "the question", "some code", "the answer", "a good plan", "the data",
            "many tokens", "the weather", "a small model", "the book", "your message", "python"]
_ENDINGS = [".", "!", "?", " today.", " again.", " quickly.", " with care.", " every day."]
_EXTRA = ["Hello there!", "How are you?", "Thank you very much.", "What is two plus two?",
          "Two plus two is four.", "Sure, here is the answer:", "I do not know.", "Yes, of course.",
          "system", "user", "assistant", "1 2 3 4 5 6 7 8 9 10", "def f(x):\n    return x + 1\n"]


def _synthetic_corpus(num_sentences: int = 400, seed: int = 0) -> list[str]:
    """Deterministic English-like sentences: subject verb object ending, plus a few fixed lines."""
    rng = random.Random(seed)
    sentences = [
        f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        f"{rng.choice(_ENDINGS)}"
        for _ in range(num_sentences)
    ]
    return sentences + _EXTRA * 5


def build_tiny_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE ChatML tokenizer of ``vocab_size`` entries.

    The 256 byte symbols and the 3 special tokens are always present, so ``vocab_size`` must
    exceed 259; what is left becomes BPE merges learnt on the synthetic corpus. Any text (any
    Unicode) can be encoded, because byte-level BPE falls back to single bytes.

    Example::

        tok = build_tiny_tokenizer()
        text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
        # '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n'
    """
    min_size = 256 + len(SPECIAL_TOKENS) + 1
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs 256 byte symbols plus "
            f"{len(SPECIAL_TOKENS)} special tokens; pass vocab_size >= {min_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        model_max_length=1 << 20,
    )
