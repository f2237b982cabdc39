"""Regenerate every assistant turn of many conversations through the runtime, with continuous batching.

A conversation regenerates turn by turn: the prompt of assistant turn i is the chat template (with
the generation prompt) over the system message, the user turns and the REGENERATED assistant turns
before it, and the user turn that asks for it::

    messages      system  user0  asst0  user1  asst1
    turn 0 prompt system  user0                          -> reply0
    turn 1 prompt system  user0  reply0 user1            -> reply1
    output        system  user0  reply0 user1  reply1

``TurnRegenerator.run`` keeps up to ``concurrency`` requests in flight in a ``SpeculativeEngine``
(``submit`` / ``step``), each the next turn of a different conversation, drawn from the input in
order; when a turn finishes, the conversation's next turn is submitted at once, and a conversation
whose turns are all done is yielded (so conversations come out in completion order). A turn whose
prompt does not fit the engine's context ends its conversation there (``Conversation.stopped``): the
output keeps the turns regenerated before it, or none (then it is skipped).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from torchspec.data.formats import Message, SkipConversation
from torchspec.data.template import render
from torchspec.runtime.sampling import SamplingParams


@dataclass
class Conversation:
    index: int  # position of its record in the input (decides its shard)
    record: dict  # the input record: its other fields ("id", ...) are written back unchanged
    messages: list[Message]  # normalised input messages (torchspec.data.formats)
    replies: list[str] = field(default_factory=list)  # regenerated assistant turns so far
    stopped: str | None = None  # why it ended before its last turn, e.g. "prompt_too_long"
    generated_tokens: int = 0
    finish_reasons: Counter = field(default_factory=Counter)

    @property
    def reply_positions(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]

    @property
    def finished(self) -> bool:
        return self.stopped is not None or len(self.replies) == len(self.reply_positions)

    def regenerated(self, upto: int | None = None) -> list[Message]:
        """``messages[:upto]`` with the assistant turns replaced by the replies (there must be enough)."""
        replies = iter(self.replies)
        return [{"role": "assistant", "content": next(replies)} if m["role"] == "assistant" else dict(m)
                for m in self.messages[:upto]]

    def context(self) -> list[Message]:
        """The messages before the next assistant turn: what its prompt renders."""
        return self.regenerated(self.reply_positions[len(self.replies)])

    def output(self) -> list[Message]:
        """The conversation through its last regenerated turn ([] if none was)."""
        if not self.replies:
            return []
        return self.regenerated(self.reply_positions[len(self.replies) - 1] + 1)


class TurnRegenerator:
    """Drives a configured ``SpeculativeEngine`` over conversations; see the module docstring."""

    def __init__(self, engine, tokenizer, *, concurrency: int, max_new_tokens: int, sampling: SamplingParams):
        self.engine, self.tokenizer = engine, tokenizer
        self.concurrency, self.max_new_tokens, self.sampling = concurrency, max_new_tokens, sampling

    def prompt_ids(self, conversation: Conversation) -> list[int]:
        """The next turn's prompt: rendered as training renders it, tokenised without special tokens."""
        text = render(self.tokenizer, conversation.context(), add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def reply_text(self, token_ids: list[int], finish_reason: str) -> str:
        """The reply without its stop token (EOS / end of turn: the chat template adds it back)."""
        if finish_reason == "stop" and token_ids:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _submit(self, conversation: Conversation, in_flight: dict[int, Conversation]) -> bool:
        """Submit the next turn; False (with ``stopped`` set) when it cannot be generated."""
        try:
            prompt = self.prompt_ids(conversation)
        except SkipConversation as skip:
            conversation.stopped = skip.reason
            return False
        if len(prompt) >= self.engine.max_context:
            conversation.stopped = "prompt_too_long"
            return False
        request = self.engine.submit(prompt, max_new_tokens=self.max_new_tokens, sampling=self.sampling)
        in_flight[request] = conversation
        return True

    def run(self, conversations: Iterable[Conversation]) -> Iterator[Conversation]:
        """Yield every conversation once its turns are done (or it stopped), in completion order.
        Closing the generator early cancels the requests in flight."""
        source = iter(conversations)
        in_flight: dict[int, Conversation] = {}
        exhausted = False
        try:
            while True:
                while not exhausted and len(in_flight) < self.concurrency:
                    conversation = next(source, None)
                    if conversation is None:
                        exhausted = True
                    elif not self._submit(conversation, in_flight):
                        yield conversation
                if not in_flight:
                    return
                for result in self.engine.step():
                    conversation = in_flight.pop(result.request_id)
                    conversation.replies.append(self.reply_text(result.token_ids, result.finish_reason))
                    conversation.generated_tokens += len(result.token_ids)
                    conversation.finish_reasons[result.finish_reason] += 1
                    if conversation.finished or not self._submit(conversation, in_flight):
                        yield conversation
        finally:
            for request in in_flight:
                self.engine.cancel(request)
            while self.engine.has_work:
                self.engine.step()
