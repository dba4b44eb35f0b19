#!/usr/bin/env python3
"""SSD wear of a server's prompt cache on a written-down trace: what each admission rule
(``store(..., admit=)``) writes, what it restores, and the warm start after a reboot.

**The trace** (`make_trace`, deterministic in ``--seed``; docs/wear.md gives its mix):
requests of a server that many users share, in the order they arrive, each a prompt and
the reply the model gave (token ids, random but fixed):

- chats: a system prompt (one of a few), then turns; each turn's prompt is the previous
  turn's prompt and reply plus a user message (a growing chat);
- agent loops: an agent's system prompt and a task, then steps; each step's prompt is the
  last one's plus the model's tool call (its reply) and the tool's result;
- one-off questions: a system prompt and a question asked once, never again (a share of
  them with no system prompt: a completion);
- repeated questions: a few prompts asked two to four times over the trace (the same
  prompt each time: a FAQ, a retry);
- a reboot halfway: the server stops and starts again (its memory empty, its store kept).

**The replay** (`replay`) is ``mlx_lm.server``'s use of its prompt cache (0.32's batched
path) against the real `PersistentLRUPromptCache` and `PersistentPrefixCache`, with a real
store (LMDB, segment files, fsync): per request ``fetch_nearest_cache``; where the cache
found ends before the system prompt does, the system prompt's cache inserted as a
``"system"`` checkpoint; then the prompt and reply inserted (``"assistant"``). The KV is
synthetic (zeros of the tiny test model's layout: 512 bytes per token; the rule looks at
tokens, never at values), so a run takes a minute or two per rule on a small CPU.

Per rule it prints: bytes written to the store (segment files of new blocks and merges),
blocks left out by the rule, bytes restored from disk and from the RAM tier, write
amplification (bytes written / bytes restored), prompt tokens from the store and from the
server's in-memory cache, and the warm start after the reboot: the tokens a fetch would
restore (``peek``) for every prompt sent two or more times before the reboot (a
repeated question, a system prompt, a chat's earlier turns), against ``"always"``, and
for the last turn of every chat and agent loop still going at the reboot.

Examples::

    python tools/wear_trace.py                 # every rule, the default trace
    python tools/wear_trace.py --rules always reuse --json
    python tools/wear_trace.py --describe      # the trace's mix only, no replay
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from persistent_prefix_cache import PersistentPrefixCache  # noqa: E402
from persistent_prefix_cache.core.admission import ADMIT_RULES  # noqa: E402
from persistent_prefix_cache.compat.lru_prompt_cache import PersistentLRUPromptCache  # noqa: E402
from persistent_prefix_cache.tiny_model import TEST_MODEL, load_tiny_model, write_tiny_model  # noqa: E402

KEY = "model"  # the server's model key
VOCAB = 50_000  # token ids are drawn below this (the store keys any int32)


@dataclass
class Mix:
    """The trace's parameters (docs/wear.md): counts, and token lengths as (low, high)."""

    system_prompts: int = 4
    system_tokens: tuple[int, int] = (300, 1200)
    chats: int = 60
    turns: tuple[int, int] = (1, 8)
    user_tokens: tuple[int, int] = (20, 300)
    reply_tokens: tuple[int, int] = (50, 400)
    agents: int = 12
    agent_steps: tuple[int, int] = (3, 10)
    task_tokens: tuple[int, int] = (100, 600)
    tool_call_tokens: tuple[int, int] = (20, 80)
    tool_result_tokens: tuple[int, int] = (100, 1200)
    one_offs: int = 150
    bare_share: float = 0.2  # one-offs without a system prompt
    question_tokens: tuple[int, int] = (30, 600)
    repeated: int = 15
    repeats: tuple[int, int] = (2, 4)
    reboot_at: float = 0.5  # the share of requests before the reboot


@dataclass
class Request:
    """One request: its prompt, the reply generated, how much of the prompt is the
    system prompt (0: none), and what it belongs to (``chat 3``, ``one-off``, ...)."""

    prompt: list[int]
    reply: list[int]
    system: int
    kind: str
    conversation: int
    time: float = 0.0


def make_trace(mix: Mix, seed: int) -> list[Request]:
    """The trace's requests in arrival order (see the module's docstring)."""
    rng = random.Random(seed)

    def tokens(span: tuple[int, int]) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(rng.randint(*span))]

    systems = [tokens(mix.system_tokens) for _ in range(mix.system_prompts)]
    weights = [1 / (i + 1) for i in range(mix.system_prompts)]  # a few popular system prompts
    requests: list[Request] = []
    conversation = 0

    def conversation_of(kind: str, steps: list[tuple[list[int], list[int]]], system: int, start: float) -> None:
        nonlocal conversation
        conversation += 1
        when = start
        for prompt, reply in steps:
            requests.append(Request(prompt, reply, system, kind, conversation, when))
            when += rng.expovariate(1 / 0.02)  # the next turn comes soon after

    for _ in range(mix.chats):
        system = rng.choices(systems, weights)[0]
        prompt, steps = list(system), []
        for _ in range(rng.randint(*mix.turns)):
            prompt = prompt + tokens(mix.user_tokens)
            reply = tokens(mix.reply_tokens)
            steps.append((prompt, reply))
            prompt = prompt + reply
        conversation_of("chat", steps, len(system), rng.random())
    agent_system = tokens(mix.system_tokens)
    for _ in range(mix.agents):
        prompt, steps = agent_system + tokens(mix.task_tokens), []
        for _ in range(rng.randint(*mix.agent_steps)):
            reply = tokens(mix.tool_call_tokens)
            steps.append((prompt, reply))
            prompt = prompt + reply + tokens(mix.tool_result_tokens)
        conversation_of("agent", steps, len(agent_system), rng.random())
    for _ in range(mix.one_offs):
        bare = rng.random() < mix.bare_share
        system = [] if bare else rng.choices(systems, weights)[0]
        conversation_of("one-off", [(system + tokens(mix.question_tokens), tokens(mix.reply_tokens))], len(system),
                        rng.random())  # fmt: skip
    for _ in range(mix.repeated):
        system = rng.choices(systems, weights)[0]
        prompt = system + tokens(mix.question_tokens)
        for _ in range(rng.randint(*mix.repeats)):  # each time a reply of its own, at another time
            conversation_of("repeated", [(prompt, tokens(mix.reply_tokens))], len(system), rng.random())
    requests.sort(key=lambda r: r.time)
    return requests


def describe(trace: list[Request], mix: Mix) -> dict:
    """The trace's mix: requests and prompt tokens by kind, distinct tokens, the reboot."""
    out: dict = {"requests": len(trace), "reboot_after": int(len(trace) * mix.reboot_at)}
    for kind in ("chat", "agent", "one-off", "repeated"):
        of = [r for r in trace if r.kind == kind]
        out[kind] = {"requests": len(of), "prompt_tokens": sum(len(r.prompt) for r in of),
                     "conversations": len({r.conversation for r in of})}  # fmt: skip
    out["prompt_tokens"] = sum(len(r.prompt) for r in trace)
    out["reply_tokens"] = sum(len(r.reply) for r in trace)
    return out


def synthetic(model, n: int, cache: list | None = None) -> list:
    """`cache` (or a fresh one) extended by `n` positions of zeros: the server's prefill."""
    cache = cache if cache is not None else make_prompt_cache(model)
    if n > 0:
        for layer in cache:
            shape = (1, TEST_MODEL["num_kv_heads"], n, TEST_MODEL["hidden_size"] // TEST_MODEL["num_heads"])
            layer.update_and_fetch(mx.zeros(shape, mx.float32), mx.zeros(shape, mx.float32))
        mx.eval([layer.state for layer in cache])
    return cache


@dataclass
class Totals:
    """A rule's figures, summed over the handles of both halves."""

    counters: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)

    def add(self, lru: PersistentLRUPromptCache) -> None:
        persistent = lru.persistent_stats()
        for key in ("restored_tokens", "memory_tokens", "computed_tokens"):
            self.server[key] = self.server.get(key, 0) + persistent[key]
        for entry in persistent["stores"]:
            for key, value in entry["stats"].items():
                if isinstance(value, int) and not key.startswith(("store_", "memory_budget")):
                    self.counters[key] = self.counters.get(key, 0) + value


def replay(trace: list[Request], mix: Mix, *, rule: str, model, folder: Path, memory: int) -> dict:
    """Replay `trace` under `rule` into a new store in `folder` (see the module's docstring)."""
    store_path = folder / f"store-{rule}"
    reboot = int(len(trace) * mix.reboot_at)
    seen: dict[tuple, int] = {}  # prompt -> times sent before the reboot
    last: dict[int, tuple[list[int], int]] = {}  # conversation -> its last prompt and reply, turns: before the reboot
    totals = Totals()
    warm: dict = {}
    for half, requests in enumerate((trace[:reboot], trace[reboot:])):
        # One memory budget for the LRU and the RAM tier together (as ``ppc serve`` has), and
        # no cost model: every rule's fetches restore whatever is stored, whatever the timing.
        store = PersistentPrefixCache(store_path, model, memory_bytes=memory, fingerprint="wear-trace",
                                      cost_model=False)  # fmt: skip
        lru = PersistentLRUPromptCache(store, max_size=10, max_bytes=memory, admit=rule)
        if half == 1:  # the reboot: a new process (memory empty), the store kept
            warm = warm_start(store, seen, last, trace[reboot:])
        for r in requests:
            serve(lru, model, r)
            if half == 0:
                for prompt in {tuple(r.prompt), tuple(r.prompt[: r.system])} - {()}:  # and its system prompt
                    seen[prompt] = seen.get(prompt, 0) + 1
                turns = last[r.conversation][1] + 1 if r.conversation in last else 1
                last[r.conversation] = (r.prompt + r.reply, turns)
        lru.flush()
        totals.add(lru)
        lru.close()
        store.close()
    c = totals.counters
    written = c["bytes_written"] + c["bytes_rewritten"]
    restored = c["bytes_restored_ram"] + c["bytes_restored_disk"]
    return {
        "rule": rule,
        "bytes_written": written,
        "bytes_merged": c["bytes_rewritten"],  # merges of small segments: when the writer is quiet
        "blocks_written": c["blocks_written"],
        "blocks_not_admitted": c["blocks_not_admitted"],
        "bytes_restored_disk": c["bytes_restored_disk"],
        "bytes_restored_ram": c["bytes_restored_ram"],
        "write_amplification": round(written / restored, 3) if restored else None,
        "written_per_disk_byte_restored": round(written / c["bytes_restored_disk"], 3)
        if c["bytes_restored_disk"]
        else None,  # fmt: skip
        "tokens_from_store": totals.server["restored_tokens"],
        "tokens_from_memory": totals.server["memory_tokens"],
        "tokens_computed": totals.server["computed_tokens"],
        "tokens_saved_share": round(1 - totals.server["computed_tokens"] / sum(len(r.prompt) for r in trace), 3),
        "store_bytes_at_end": _store_bytes(store_path, model),
        **warm,
    }


def serve(lru: PersistentLRUPromptCache, model, r: Request) -> None:
    """One request as ``mlx_lm.server``'s batched path uses its prompt cache."""
    cache, rest = lru.fetch_nearest_cache(KEY, r.prompt)
    have = len(r.prompt) - len(rest) if cache is not None else 0
    if r.system and have < r.system:  # the server saves the system prompt's cache on its way
        lru.insert_cache(KEY, r.prompt[: r.system], synthetic(model, r.system), cache_type="system")
    cache = synthetic(model, len(r.prompt) - have + len(r.reply), cache)
    lru.insert_cache(KEY, r.prompt + r.reply, cache, cache_type="assistant")


def warm_start(store: PersistentPrefixCache, seen: dict, last: dict, after: list[Request]) -> dict:
    """What a fresh process restores (`peek`) right after the reboot: every prompt sent
    twice or more before it (a system prompt: as the start of two or more prompts); the
    last turn (prompt and reply) of every conversation that goes on after it and had two
    or more turns before it (its last turn continued an earlier one); and the same for
    those that had one (a first turn: a one-off as far as the server could tell)."""
    twice = [list(p) for p, n in seen.items() if n >= 2]
    going_on = {r.conversation for r in after} & set(last)
    out = {"prompts_seen_twice": len(twice), "warm_seen_twice": _share(store, twice)}
    for name, turns in (("going_on", lambda n: n >= 2), ("going_on_after_one_turn", lambda n: n == 1)):
        prompts = [last[c][0] for c in going_on if turns(last[c][1])]
        out[f"conversations_{name}"] = len(prompts)
        out[f"warm_{name}"] = _share(store, prompts)
    return out


def _share(store: PersistentPrefixCache, prompts: list[list[int]]) -> str:
    """Tokens a fetch would restore of `prompts`, of all but the last token of each."""
    return f"{sum(store.peek(p) for p in prompts)}/{sum(len(p) - 1 for p in prompts)}"


def _store_bytes(path: Path, model) -> int:
    with PersistentPrefixCache(path, model, fingerprint="wear-trace", readonly=True) as store:
        return store.stats()["block_bytes"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rules", nargs="+", choices=ADMIT_RULES, default=list(ADMIT_RULES))
    parser.add_argument("--memory-mb", type=int, default=64, help="the server's in-memory budget: its LRU and "
                        "the RAM tier together")  # fmt: skip
    parser.add_argument("--one-offs", type=int, default=Mix.one_offs, help="one-off questions in the trace")
    parser.add_argument("--describe", action="store_true", help="print the trace's mix only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    mix = Mix(one_offs=args.one_offs)
    trace = make_trace(mix, args.seed)
    out: dict = {"trace": describe(trace, mix), "runs": []}
    if not args.describe:
        folder = Path(tempfile.mkdtemp(prefix="wear-trace-"))
        try:
            model_dir = write_tiny_model(folder / "model", **{k: v for k, v in TEST_MODEL.items() if k != "family"})
            model = load_tiny_model(model_dir)
            for rule in args.rules:
                out["runs"].append(replay(trace, mix, rule=rule, model=model, folder=folder,
                                          memory=args.memory_mb << 20))  # fmt: skip
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(json.dumps(out["trace"]))
    for run in out["runs"]:
        print(json.dumps(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
