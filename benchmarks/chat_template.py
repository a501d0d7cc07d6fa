"""A checkpoint's chat template in the gateway: the cost of rendering each chat request with it.

Each request of a multi-turn tool-calling session (the history sent back each call, as agents
do) is rendered, answered by an instant engine and recorded in-process, as the gateway does it
without HTTP: once under dew's ChatML template (the byte tokenizer), once under Qwen2.5's real
template (tests/fixtures/templates) over a small BPE trained here, where the gateway renders the
whole conversation with Jinja and splices its latest turn in as the ids sampled. Prints the time
per request at each conversation length and how many prompts were spliced.

    python benchmarks/chat_template.py          # sessions of 16 calls, 50 sessions
    python benchmarks/chat_template.py --smoke  # a few, for CI
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np
import trio
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from dew.gateway import Gateway
from dew.gateway._answers import cut
from dew.gateway._record import Turn
from dew.gateway._schema import chat_request
from dew.gateway._template import parse_reply
from dew.gateway._templated import tally
from dew.objectives.rl.sessions import Call
from dew.serve.chat_template import ChatTemplate
from dew.serve.tokenizer import BYTES, TemplateTokenizer

TEMPLATE = pathlib.Path(__file__).parent.parent / "tests/fixtures/templates/qwen2.5-instruct.jinja"
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a key up.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k3"}}\n</tool_call>'


def qwen_tokenizer() -> TemplateTokenizer:
    """Qwen2.5's template over a byte-level BPE with its special tokens, trained here."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([TEMPLATE.read_text(), CALL, "Check the weather. All good."], trainer)
    bpe.add_tokens([AddedToken("<tool_call>"), AddedToken("</tool_call>")])
    template = ChatTemplate.of(TEMPLATE.read_text(), eos_token="<|im_end|>")
    return TemplateTokenizer(bpe, template)


class InstantEngine:
    """Answers each call at once: a tool call on even calls, text on odd ones."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0

    async def generate(self, prompt, *, max_tokens, stop=(), **sampling) -> Call:
        text = CALL if self.calls % 2 == 0 else "All good."
        self.calls += 1
        encode = getattr(self.tokenizer, "encode_rendered", self.tokenizer.encode)
        ids = np.append(encode(text), self.tokenizer.eos_id).astype(np.int32)[:max_tokens]
        return Call(np.asarray(prompt, np.int32), ids, np.full(len(ids), -0.5, np.float32), 0)


async def session_times(tokenizer, sessions: int, calls: int) -> tuple[np.ndarray, dict]:
    """Seconds per request [sessions, calls], and the gateway's rendering counts."""
    engine = InstantEngine(tokenizer)
    times = np.zeros((sessions, calls))
    async with Gateway(engine, max_context=1 << 16, announce=False) as gateway:
        for s in range(sessions):
            session = gateway.open()
            engine.calls = 0
            messages = [{"role": "user", "content": "Check the weather."}]
            for c in range(calls):
                start = time.perf_counter()
                body = {"model": "m", "messages": messages, "tools": [TOOL]}
                request = chat_request(json.loads(json.dumps(body)))
                with session.admitted(b"", retry=False):
                    rendered = session.chat_prompt(request)
                    tally(gateway.rendering, rendered)
                    call = await engine.generate(rendered.ids, max_tokens=64)
                    sample = cut(call, tokenizer, ())
                    reply = parse_reply(sample.text, tools=True, format=gateway.tool_format)
                    ids = tuple(call_id for call_id, _, _ in reply.tool_calls)
                    turn = Turn(call, reply.content, ids, len(messages), b"", templated=rendered)
                    session.record(turn)
                times[s, c] = time.perf_counter() - start
                message = {"role": "assistant", "content": reply.content}
                if reply.tool_calls:
                    message["tool_calls"] = [
                        {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                        for i, n, a in reply.tool_calls
                    ]
                    messages += [message, {"role": "tool", "tool_call_id": ids[0], "content": "7"}]
                else:
                    messages += [message, {"role": "user", "content": "Again."}]
        return times, dict(gateway.rendering)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few sessions, for CI")
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--calls", type=int, default=16, help="requests per session")
    args = parser.parse_args()
    if args.smoke:
        args.sessions, args.calls = 3, 6
    if args.sessions < 1 or args.calls < 2:
        parser.error("--sessions must be >= 1 and --calls >= 2")
    chatml, _ = trio.run(session_times, BYTES, args.sessions, args.calls)
    templated, counts = trio.run(session_times, qwen_tokenizer(), args.sessions, args.calls)
    print(f"chat template benchmark: {args.sessions} sessions of {args.calls} calls, tools on")
    print("  call  messages  ChatML ms  Qwen2.5 template ms")
    for c in range(args.calls):
        messages = 1 + 2 * c
        ours, theirs = 1000 * np.median(chatml[:, c]), 1000 * np.median(templated[:, c])
        print(f"  {c + 1:4d}  {messages:8d}  {ours:9.3f}  {theirs:19.3f}")
    print(
        f"  mean per request: ChatML {1000 * chatml.mean():.3f} ms, "
        f"template {1000 * templated.mean():.3f} ms"
    )
    print(f"  template prompts spliced / drift / rerendered: {counts}")


if __name__ == "__main__":
    main()
