"""Rendezvous routing (gateway/routing.py): stable, minimal movement, keyed by the stable head."""

from __future__ import annotations

from gateway.routing import chat_head, rendezvous_order, route_key
from ignis.v1 import engine_pb2

NODES = [f"10.0.0.{i}:50051" for i in range(5)]


def owner(nodes: list[str], key: bytes) -> str:
    return rendezvous_order(nodes, nodes, key)[0]


def chat(*messages: tuple[str, str], tools: str = "") -> engine_pb2.ChatInput:
    return engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role=r, content=c) for r, c in messages],
                                tools_json=tools)


def test_order_is_a_permutation_and_deterministic() -> None:
    key = route_key("m", "", "head")
    order = rendezvous_order(NODES, NODES, key)
    assert sorted(order) == sorted(NODES)
    assert rendezvous_order(list(reversed(NODES)), list(reversed(NODES)), key) == order  # input order is irrelevant


def test_keys_spread_and_removing_a_node_moves_only_its_keys() -> None:
    keys = [route_key("m", "", f"system prompt {i}") for i in range(400)]
    before = {k: owner(NODES, k) for k in keys}
    assert all(sum(1 for o in before.values() if o == n) > 40 for n in NODES)  # roughly even
    gone = NODES[2]
    after = {k: owner([n for n in NODES if n != gone], k) for k in keys}
    for k in keys:
        if before[k] != gone:
            assert after[k] == before[k]
        else:
            assert after[k] == rendezvous_order(NODES, NODES, k)[1]  # the runner-up takes over


def test_the_head_is_the_system_prompt_and_tools() -> None:
    a = chat(("system", "You are a subagent."), ("user", "task one"), tools='[{"t": 1}]')
    b = chat(("system", "You are a subagent."), ("user", "task two"), ("assistant", "x"), ("user", "y"),
             tools='[{"t": 1}]')
    assert chat_head(a) == chat_head(b)
    assert chat_head(a) != chat_head(chat(("system", "You are a subagent."), ("user", "task one")))  # no tools
    assert chat_head(a) != chat_head(chat(("system", "Another."), ("user", "task one"), tools='[{"t": 1}]'))
    # No system prompt: the first message is what every later turn shares.
    assert chat_head(chat(("user", "hi"))) == chat_head(chat(("user", "hi"), ("assistant", "yo"), ("user", "more")))
    assert route_key("m", "salt-a", "h") != route_key("m", "salt-b", "h") != route_key("n", "salt-b", "h")
