"""Streams with several choices (`n` > 1) survive their replica: real runtime processes behind one gateway,
the replica serving the stream SIGKILLed mid-stream. Each choice that had not finished goes on on another
replica as its own continuation, and their chunks come back under the choice's own `index` (the openai
SDK's chat and completion streams): greedy choices equal an unbroken run's, with one usage counting every
choice; a seeded sampled choice i goes on from its own tokens, drawn afresh from the seed plus i, exactly
as a request for its rest with that seed would."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import openai
import pytest
from resume_env import MESSAGES, kill_the_serving_replica, replicas_behind_a_gateway, resumed

from goodput_gateway import resume

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("resume-n")
    with replicas_behind_a_gateway(tiny_model_dir, workdir) as (gateway, pods):
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=60)
        yield gateway, pods, client


def test_a_greedy_chat_stream_with_two_choices_goes_on_with_the_same_choices(env):
    gateway, pods, client = env

    def run(kill_after: int | None = None) -> tuple[dict, dict, tuple[int, int] | None, set[str]]:
        texts, reasons, usage, ids = defaultdict(str), {}, None, set()
        stream = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            stream=True,
            n=2,
            temperature=0,
            max_tokens=300,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for seen, chunk in enumerate(stream, 1):
            ids.add(chunk.id)
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason is not None:
                    reasons[choice.index] = choice.finish_reason
            if chunk.usage is not None:
                usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            if seen == kill_after:
                kill_the_serving_replica(pods)
        return dict(texts), reasons, usage, ids

    unbroken = run()
    assert set(unbroken[0]) == {0, 1} and len(unbroken[0][0]) > 200
    assert unbroken[1] == {0: "length", 1: "length"} and unbroken[2] is not None and unbroken[2][1] == 600
    before = resumed(gateway)
    texts, reasons, usage, ids = run(kill_after=8)
    assert (texts, reasons, usage) == unbroken[:3] and len(ids) == 1
    assert resumed(gateway) == before + 2  # one continuation per choice
    assert gateway.metric("goodput_gateway_streams_lost_total", service="tiny") == 0


def test_seeded_choices_go_on_each_from_its_own_tokens_and_seed(env):
    gateway, pods, client = env
    sampling = {"temperature": 1.0, "seed": 11, "max_tokens": 120}
    extra = {"ignore_eos": True, "return_token_ids": True}  # the client's own ids

    def run(kill_after: int | None = None) -> tuple[list[int], dict[int, list[int]], dict[int, int], int]:
        prompt, ids, before_kill, tokens = [], defaultdict(list), {}, 0
        stream = client.completions.create(
            model="tiny",
            prompt="Once upon a time",
            stream=True,
            n=2,
            stream_options={"include_usage": True},
            **sampling,
            extra_body=extra,
        )
        for seen, chunk in enumerate(stream, 1):
            prompt = (chunk.model_extra or {}).get("prompt_token_ids", prompt)
            for choice in chunk.choices:
                ids[choice.index].extend(choice.model_extra["token_ids"])
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if seen == kill_after:
                before_kill = {i: len(got) for i, got in ids.items()}
                kill_the_serving_replica(pods)
        return prompt, dict(ids), before_kill, tokens

    prompt, unbroken, _, tokens = run()
    assert unbroken[0] != unbroken[1] and tokens == 240
    before = resumed(gateway)
    _, ids, before_kill, tokens = run(kill_after=6)
    assert tokens == 240 and resumed(gateway) == before + 2
    for index in (0, 1):
        got, seen = ids[index], before_kill.get(index, 0)
        assert len(got) == 120 and got[:seen] == unbroken[index][:seen]
        # the break lies between what the client had at the kill and the first token unlike the unbroken
        # run's; the rest from there is what a request for it with the choice's seed (seed + index) draws
        common = next((k for k, (a, b) in enumerate(zip(got, unbroken[index], strict=True)) if a != b), 120)
        assert common < 120, "a sampled rest drawn afresh should part from the unbroken run"
        rests = []
        for cut in range(common, seen - 1, -1):
            rest = client.completions.create(
                model="tiny",
                prompt=prompt + got[:cut],
                **{**sampling, "seed": 11 + index, "max_tokens": 120 - cut},
                extra_body=extra,
            )
            rests.append(rest.choices[0].model_extra["token_ids"] == got[cut:])
        assert any(rests), f"choice {index}'s rest is not its own seed's draw from its own tokens"


def test_echo_with_several_choices_is_not_resumed():
    """A choice that had not begun when its replica went away would lose the prompt echoed on its first
    chunk: such a stream ends with the lost error naming `echo`, as does an `n` the runtime refuses."""
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    assert resume.why_not({**body, "n": 2}) is None and resume.why_not({**body, "echo": True}) is None
    assert resume.why_not({**body, "n": 2, "echo": True}) == "echo"
    assert resume.why_not({**body, "n": 2, "best_of": 2}) is None
    assert resume.why_not({**body, "n": 2, "best_of": 3}) == "best_of"
    assert resume.why_not({**body, "n": "2"}) == "n"


async def test_the_choices_continuations_are_let_go_when_the_client_leaves_or_one_is_lost():
    """The continuations run side by side; a client gone, or one continuation lost for good, closes every
    other (each replica sees its connection go and aborts the request)."""
    closed: list[int] = []

    async def continuation(index: int, fail_after: int | None = None):
        try:
            for seen in range(1000):
                if seen == fail_after:
                    raise ConnectionResetError("lost again")
                yield f"{index}:{seen}".encode()
                await asyncio.sleep(0)
        finally:
            closed.append(index)

    stream = resume.merged([continuation(0), continuation(1)])
    got = [await anext(stream) for _ in range(6)]
    assert {g.split(b":")[0] for g in got} == {b"0", b"1"}  # side by side, not one after the other
    await stream.aclose()
    assert sorted(closed) == [0, 1]
    closed.clear()
    with pytest.raises(ConnectionResetError):
        async for _ in resume.merged([continuation(0), continuation(1, fail_after=3)]):
            pass
    assert sorted(closed) == [0, 1]
