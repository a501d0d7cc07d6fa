"""One rollout's session on the gateway: its calls, token in / token out, and its end.

The gateway keeps, per session, every assistant turn it produced: the ids it sampled, the text
and the tool-call ids it answered with. When the harness sends the conversation back, each of
its assistant turns that the gateway produced (found by its tool-call ids, else by its text) is
rendered as those exact ids rather than re-tokenised text, so the next call's prompt extends the
previous call's prompt and completion and the session's calls merge into one chain. Clients
re-serialise tool-call arguments, wrap invalid JSON, strip text: none of that changes the ids.
A client that drops the empty assistant turn it was answered gets it put back where it was.

Under a checkpoint's own chat template (`dew.serve.tokenizer.TemplateTokenizer`) the template
renders the conversation and the gateway's latest turn in it is spliced in as its call's ids
(`dew.gateway._templated`); a rendering that differs from what was sampled is counted on the
session (`drift`, `rerendered`) rather than re-tokenised silently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np
import trio

from dew.gateway._api_error import ApiError
from dew.gateway._schema import ChatRequest, Message
from dew.gateway._template import message_text, system_text
from dew.gateway._templated import Rendered, templated_prompt
from dew.objectives.rl.sessions import Call, Label
from dew.serve.tokenizer import TemplateTokenizer


@attrs.define(eq=False)
class Turn:
    """An answer the gateway gave: the call, what the client saw of it, and where it stands.

    Args:
        call: the recorded call (its completion cut at a stop string).
        content: the text answered, for matching a turn that carries no tool calls.
        tool_call_ids: the ids of the tool calls answered.
        messages: how many messages the request held (where a dropped empty turn goes back).
        fingerprint: the request body's hash, to recognise a client's retry of it.
        text: for the completions endpoint, the prompt and completion text as answered.
        text_ids: the ids of `text` as the engine saw and sampled them, where they are known
            (a completion cut at its stop token or a stop string answers less text than it
            sampled: its client's text goes on without those tokens).
        templated: under a checkpoint's chat template, the request as the template rendered it.
        thread: the request's `X-Session-ID` header, where it had one: the client's own name
            for the conversation the call belongs to (verifiers sends each agent trace's id).
    """

    call: Call
    content: str | None
    tool_call_ids: tuple[str, ...]
    messages: int
    fingerprint: bytes
    text: str | None = None
    text_ids: np.ndarray | None = None
    rendered: np.ndarray | None = None  # the turn's ids in a later prompt, made once
    templated: Rendered | None = None
    thread: str | None = None


@attrs.frozen(eq=False)
class Template:
    """A tokenizer (the `dew.serve.tokenizer.Tokenizer` protocol) and its chat template's fixed
    pieces, made once: every call of every session renders them.

    Args:
        tokenizer: the tokenizer.
        prefix: `chat_prefix()`, what opens a conversation.
        generation: `generation_prompt()`, what opens an assistant turn.
        suffix: `turn_suffix()`, what follows a turn's stop token.
    """

    tokenizer: Any
    prefix: np.ndarray
    generation: np.ndarray
    suffix: np.ndarray

    @classmethod
    def of(cls, tokenizer: Any) -> Template:
        """`tokenizer`'s template pieces."""
        if isinstance(tokenizer, TemplateTokenizer):
            # A checkpoint's template renders whole conversations (`_templated`): sessions use
            # no fixed pieces of it, and a template may have none.
            none = np.zeros(0, np.int32)
            return cls(tokenizer, none, none, none)
        return cls(
            tokenizer,
            np.asarray(tokenizer.chat_prefix(), np.int32),
            np.asarray(tokenizer.generation_prompt(), np.int32),
            np.asarray(tokenizer.turn_suffix(), np.int32),
        )

    def closing(self, completion: np.ndarray) -> np.ndarray:
        """What the template writes after a sampled reply: the stop token where the reply lacks
        it (cut at a stop string or by its budget), then the turn suffix."""
        eos = self.tokenizer.eos_id
        if len(completion) and int(completion[-1]) == eos:
            return self.suffix
        return np.concatenate([np.array([eos], np.int32), self.suffix])


def _empty(turn: Turn) -> bool:
    """Whether a chat answer carried nothing (the kind clients drop from their history)."""
    return turn.text is None and not turn.tool_call_ids and not turn.content


class GatewaySession:
    """The gateway's record of one rollout, served under an unguessable URL prefix.

    Attributes:
        base_url: the OpenAI base URL for the harness (`.../<token>/v1`).
        api_key: the key to hand the client. The URL prefix is the credential: a request with
            no key (or the placeholder `EMPTY`) is served, but one whose `Authorization` bearer
            key is another is refused (401), so a harness wired to the wrong session is caught.
        label: the rollout's label (keys each call's sampling), or None.
        max_calls: the most calls before the session is TRUNCATED (`turns`), or None.
        drift: under a checkpoint's chat template, the calls whose prompt kept one of the
            gateway's turns as the ids sampled where the template renders it as other text.
        rerendered: under a checkpoint's chat template, the gateway's turns a prompt holds as
            the template's text, not the ids sampled (the session's chain breaks there).
        requests: the session's requests the gateway is reading or answering now.
    """

    def __init__(
        self,
        token: str,
        base_url: str,
        *,
        label: Label | None,
        engine: Any,
        template: Template,
        max_calls: int | None,
        on_close: Callable[[GatewaySession], None],
    ):
        self.token = token
        self.base_url = base_url
        self.api_key = "dew-" + token
        self.label = label
        self.engine = engine
        self.template = template
        self.tokenizer = template.tokenizer
        self.max_calls = max_calls
        self._on_close = on_close
        self._turns: list[Turn] = []
        self._empty = 0  # how many of them answered nothing (no text, no tool call)
        self._started = 0
        self._in_flight: set[trio.CancelScope] = set()
        self._admitted = 0  # calls admitted and not yet answered or abandoned
        self.requests = 0
        self.closed: str | None = None
        self.truncation: str | None = None
        self.infra_error: str | None = None
        self.ended = trio.Event()
        self.transcript: list[dict[str, Any]] = []
        self.drift = 0
        self.rerendered = 0
        # Harnesses send the whole conversation each call: each message is encoded once.
        self._encoded: dict[tuple[str, str], np.ndarray] = {}

    @property
    def calls(self) -> tuple[Call, ...]:
        """The recorded calls, in the order they were answered."""
        return tuple(turn.call for turn in self._turns)

    @property
    def threads(self) -> tuple[str | None, ...]:
        """Each recorded call's `X-Session-ID` header (None without one), as `calls`."""
        return tuple(turn.thread for turn in self._turns)

    @property
    def in_flight(self) -> int:
        """Engine calls running for this session now."""
        return len(self._in_flight)

    # --- ending ---------------------------------------------------------------------------------

    def truncate(self, reason: str) -> None:
        """Mark the rollout TRUNCATED for `reason` (the first reason stays) and end it."""
        if self.truncation is None:
            self.truncation = reason
        self.ended.set()

    def fail(self, error: str) -> None:
        """Mark an infrastructure fault (the engine failed a call) and end the rollout."""
        if self.infra_error is None:
            self.infra_error = error
        self.ended.set()

    def close(self, reason: str = "finished") -> None:
        """Refuse every later call with 410 and cancel the engine calls in flight at once."""
        if self.closed is not None:
            return
        self.closed = reason
        for scope in self._in_flight:
            scope.cancel(reason=f"session {reason}")
        self.ended.set()
        self._on_close(self)

    def check_open(self) -> None:
        """Raises: ApiError 410 when the session is closed."""
        if self.closed is not None:
            raise ApiError(
                410,
                f"this session ({self.label}) is closed ({self.closed}); a rollout's session "
                "takes no more calls",
                code="session_closed",
            )

    # --- calls ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def admitted(self, fingerprint: bytes, retry: bool) -> Iterator[int]:
        """A call, from its admission until it is answered (recorded inside) or abandoned:
        forget the answer a retry replaces, enforce the call limit.

        A retry (the client's retry counter above 0) whose body is the last answered call's
        never received that answer: the call is dropped, so it is neither trained as if seen
        nor recorded twice. The limit counts every admitted call not yet answered, not only
        those in the engine: a large request is rendered in a worker thread after its
        admission, while the session admits others.

        Yields:
            The call's index in the session (keys its sampling).

        Raises:
            ApiError: 410 when closed; 400 when the call limit is reached (the session is then
                TRUNCATED with `turns`).
        """
        self.check_open()
        if retry and self._turns and self._turns[-1].fingerprint == fingerprint:
            self._empty -= _empty(self._turns.pop())
        if self.max_calls is not None and len(self._turns) + self._admitted >= self.max_calls:
            self.truncate("turns")
            raise ApiError(
                400,
                f"this session reached its limit of {self.max_calls} calls",
                code="call_limit_exceeded",
            )
        index = self._started
        self._started += 1
        self._admitted += 1
        try:
            yield index
        finally:
            self._admitted -= 1

    @contextlib.contextmanager
    def running(self) -> Iterator[trio.CancelScope]:
        """A cancel scope for an engine call, cancelled when the session closes."""
        scope = trio.CancelScope()
        if self.closed is not None:
            scope.cancel(reason=f"session {self.closed}")
        self._in_flight.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._in_flight.discard(scope)

    def record(self, turn: Turn) -> None:
        """Keep an answered call, unless the session closed while it was answered.

        A closed session's record has been handed over (its source reads `calls` as it closes
        it): a call kept after that would be lost to it, though its client was answered. So it
        is refused, and its client told, instead. The check and the append run without a
        checkpoint between them, so a call is either in the record the close hands over or
        refused.

        Raises:
            ApiError: 410 naming the session when it is closed.
        """
        if self.closed is not None:
            raise ApiError(
                410,
                f"this session ({self.label}) closed ({self.closed}) while the call was answered; "
                "the call is not recorded",
                code="session_closed",
            )
        self._turns.append(turn)
        self._empty += _empty(turn)

    # --- prompts --------------------------------------------------------------------------------

    def chat_prompt(self, request: ChatRequest, field: str = "messages") -> Rendered:
        """The token ids the engine sees for a chat request: the gateway's own turns as the ids
        it sampled, everything else through the chat template.

        Args:
            field: the request's field the conversation came in (`messages`; a Responses
                request's `input`), which an error names.

        Raises:
            ApiError: 400 when a checkpoint's template refuses the conversation.
        """
        if isinstance(self.tokenizer, TemplateTokenizer):
            rendered = templated_prompt(self.tokenizer, request, self._match, field)
            self.drift += rendered.drift
            self.rerendered += rendered.rerendered
            return rendered
        head = [self.template.prefix]
        system = system_text(request)
        if system is not None:
            head.append(self._encode("system", system))
        matched: set[int] = set()
        pieces = []
        for message in request.messages:
            turn = self._match(message)
            if turn is not None:
                matched.add(id(turn))
                pieces.append(self._turn_ids(turn))
            else:
                text = message_text(message)
                pieces.append(self._encode(message.role, text))
        self._restore_dropped(request.messages, head, pieces, matched)
        ids = np.concatenate([*head, *pieces, self.template.generation]).astype(np.int32)
        return Rendered(ids, None)

    def _match(self, message: Message) -> Turn | None:
        """The gateway's turn an assistant message stands for: by its tool-call ids, else (for a
        turn without calls) by its text, exact or stripped; the latest such turn."""
        if message.role != "assistant":
            return None
        for turn in reversed(self._turns):
            if turn.text is not None:
                continue
            if message.tool_calls:
                if any(call_id in turn.tool_call_ids for call_id, _, _ in message.tool_calls):
                    return turn
            elif not turn.tool_call_ids and (turn.content or "").strip() == message.content.strip():
                return turn
        return None

    def _encode(self, role: str, content: str) -> np.ndarray:
        """A message's turn under the template, encoded once per session."""
        ids = self._encoded.get((role, content))
        if ids is None:
            ids = self.tokenizer.encode_turn({"role": role, "content": content})
            self._encoded[role, content] = ids
        return ids

    def _turn_ids(self, turn: Turn) -> np.ndarray:
        if turn.rendered is None:
            completion = turn.call.completion
            turn.rendered = np.concatenate(
                [self.template.generation, completion, self.template.closing(completion)]
            ).astype(np.int32)
        return turn.rendered

    def _restore_dropped(self, messages, head, pieces, matched) -> None:
        """Put back each empty answer the client left out: where the messages before it are the
        ones it answered, and what follows is not an assistant turn standing in its place."""
        if not self._empty:  # most sessions: every call of each request walks its turns
            return
        inserted = 0
        generation = len(self.template.generation)
        for turn in self._turns:
            at = turn.messages
            if not _empty(turn) or id(turn) in matched or len(messages) < at:
                continue
            if at < len(messages) and messages[at].role == "assistant":
                continue
            before = np.concatenate([*head, *pieces[: at + inserted]])
            asked = turn.call.prompt[: len(turn.call.prompt) - generation]
            if len(before) == len(asked) and (before == asked).all():
                pieces.insert(at + inserted, self._turn_ids(turn))
                inserted += 1

    def text_prompt(self, prompt: str) -> np.ndarray:
        """The token ids of a completions prompt: where it starts with an earlier answer's prompt
        and completion text whose ids are known, those exact ids, then the rest encoded (so a
        prompt extending an answer cut by its budget extends that call's chain)."""
        for turn in reversed(self._turns):
            if turn.text_ids is not None and prompt.startswith(turn.text):
                rest = self.tokenizer.encode(prompt[len(turn.text) :])
                return np.concatenate([turn.text_ids, rest]).astype(np.int32)
        return np.asarray(self.tokenizer.encode(prompt), np.int32)
