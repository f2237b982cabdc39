"""Shared test fixtures: offline environment, tiny tokenizer, tiny targets, tiny conversations.

Everything is built locally from configs (no hub access): a byte-level BPE ChatML tokenizer, and
tiny random Llama / Qwen3 targets whose 4 KV heads divide by 4 (for TP=4 tests on gloo).
"""

from __future__ import annotations

import json
import os
import random

for _key, _value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
                     "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from torchspec.data import build_tiny_tokenizer

    return build_tiny_tokenizer(384)


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny_target_dir(request, tmp_path_factory, tiny_tokenizer):
    from torchspec.targets import build_tiny_target

    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    return build_tiny_target(str(out), flavour=request.param, vocab_size=384, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer):
    from torchspec.targets import build_tiny_target

    out = tmp_path_factory.mktemp("tiny_llama")
    return build_tiny_target(str(out), flavour="llama", vocab_size=384, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def controller_pair(tmp_path_factory, tiny_tokenizer):
    """The tiny target and its drafter that the draft controller's CPU tests serve (seeded: every module built the
    same pair; each module loads its own engines from it, ``tests/controller_cases.cpu_engine``)."""
    from tests.runtime_pair import build_pair

    return build_pair(tmp_path_factory.mktemp("controller_pair"), tiny_tokenizer)


def make_conversations(n: int, seed: int = 0) -> list[dict]:
    """Synthetic chats with learnable structure: the assistant echoes and counts."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "one", "two", "three", "cat", "dog"]
    convs = []
    for _ in range(n):
        picked = [rng.choice(words) for _ in range(rng.randint(3, 8))]
        question = "repeat: " + " ".join(picked)
        answer = "Sure. " + " ".join(picked) + ". Count: " + " ".join(str(i) for i in range(len(picked)))
        convs.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return convs


@pytest.fixture(scope="session")
def tiny_chat_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(80)))
    return str(path)


@pytest.fixture(scope="module")
def one_thread():
    """Modules of tiny or narrow tensors opt in (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    intra-op threads do not pay off there, and on a shared 2-core machine they make the module slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
