"""`tools/wear_trace.py` (docs/wear.md): its trace is the same on every run, and a small
one replayed under each rule shows what the docs claim of the rules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from persistent_prefix_cache.tiny_model import TEST_MODEL, load_tiny_model, write_tiny_model

TOOL = Path(__file__).resolve().parents[1] / "tools" / "wear_trace.py"


@pytest.fixture(scope="module")
def wear():
    spec = importlib.util.spec_from_file_location("wear_trace", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["wear_trace"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["wear_trace"]


def test_the_trace_is_written_down(wear):
    mix = wear.Mix()
    trace = wear.make_trace(mix, 0)
    again = wear.make_trace(mix, 0)
    assert [(r.prompt, r.reply, r.kind) for r in trace] == [(r.prompt, r.reply, r.kind) for r in again]
    described = wear.describe(trace, mix)
    # The mix docs/wear.md gives.
    assert described["requests"] == 586 and described["prompt_tokens"] == 1_123_930
    assert described["reply_tokens"] == 118_956 and described["reboot_after"] == 293
    assert {k: described[k]["requests"] for k in ("chat", "agent", "one-off", "repeated")} == {
        "chat": 313, "agent": 76, "one-off": 150, "repeated": 47
    }  # fmt: skip
    # A conversation's turns grow: each prompt is the last one's prompt and reply, and more.
    turns_of: dict[int, list] = {}
    for r in trace:
        if r.kind in ("chat", "agent"):
            turns_of.setdefault(r.conversation, []).append(r)
    pairs = [(a, b) for turns in turns_of.values() for a, b in zip(turns, turns[1:])]
    assert len(pairs) == 313 + 76 - 60 - 12
    for a, b in pairs:
        assert b.prompt[: len(a.prompt) + len(a.reply)] == a.prompt + a.reply
        assert len(b.prompt) > len(a.prompt) + len(a.reply)
    one_offs = [tuple(r.prompt) for r in trace if r.kind == "one-off"]
    assert len(set(one_offs)) == len(one_offs)


def test_a_small_trace_under_each_rule(wear, tmp_path):
    mix = wear.Mix(chats=8, agents=2, one_offs=30, repeated=4)
    trace = wear.make_trace(mix, 1)
    model = load_tiny_model(
        write_tiny_model(tmp_path / "model", **{k: v for k, v in TEST_MODEL.items() if k != "family"})
    )
    runs = {
        rule: wear.replay(trace, mix, rule=rule, model=model, folder=tmp_path, memory=64 << 20)
        for rule in ("always", "seen", "reuse")
    }
    always, seen, reuse = runs["always"], runs["seen"], runs["reuse"]
    assert always["blocks_not_admitted"] == 0 and reuse["blocks_not_admitted"] > 0
    assert seen["blocks_written"] < reuse["blocks_written"] < always["blocks_written"]
    assert reuse["store_bytes_at_end"] < always["store_bytes_at_end"]
    # The warm start after the reboot: as good as always for what was seen twice, and for
    # conversations past their first turn, under "reuse".
    assert always["prompts_seen_twice"] > 0 and always["conversations_going_on"] > 0
    for key in ("warm_seen_twice", "warm_going_on"):
        done, of = map(int, always[key].split("/"))
        assert done == of and reuse[key] == always[key], (key, always[key], reuse[key])
    assert seen["warm_seen_twice"] == always["warm_seen_twice"]
