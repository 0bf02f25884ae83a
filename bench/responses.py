"""A 20-turn tool-call loop on /v1/responses three ways, the same requests in one run.

    python -m bench.responses [--turns 20] [--repeats 3]

- **resend**: HTTP, the client sends the whole conversation every turn (``store: false``);
- **previous_response_id**: HTTP, the client sends only the new ``function_call_output`` and names
  the previous response (stored in the engine, read back by the gateway every turn);
- **websocket**: one socket, only the new item, ``store: false`` (the connection keeps the
  conversation; nothing is read from the engine's store).

Every turn forces the tool (``tool_choice`` names it) and is greedy, so the three loops render
the same prompts and must produce the same calls (checked: "same outputs"). Measured per loop:
end-to-end time, bytes the client sent (request bodies / frame payloads; HTTP headers not
counted), the gateway process's CPU time per turn (utime + stime from /proc/<pid>/stat, before
and after the loop), and the last turn's prompt and cached tokens. The loops run interleaved
(resend, id, socket, resend, ...) --repeats times, each under its own cache_salt so no loop
claims another's state; the table gives medians. Tiny model (ignis-tiny), short outputs: this
measures the gateway and the protocol, not the model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx
from websockets.sync.client import connect
from websockets.sync.connection import Connection  # what `with connect(...)` yields

from common.launch import launch_engine, launch_gateway
from bench.table import markdown, save

MODEL = "ignis-tiny"
INSTRUCTIONS = ("You are a calculator agent. Call the add tool for every step, then use its result in the "
                "next step. Keep going until told to stop. ") * 4
TOOLS = [{"type": "function", "name": "add", "description": "add two digits", "parameters": {
    "type": "object", "required": ["a", "b"], "additionalProperties": False,
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                   "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}]
COMMON = {"model": MODEL, "instructions": INSTRUCTIONS, "tools": TOOLS, "tool_choice": {"type": "function",
          "name": "add"}, "temperature": 0, "max_output_tokens": 200, "parallel_tool_calls": False}
FIRST = "Start from 1 and keep adding."
MODES = ("resend", "previous_response_id", "websocket")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def the_call(response: dict[str, Any]) -> dict[str, Any]:
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    if not calls:
        raise RuntimeError(f"turn without a tool call: {response['output']}")
    return calls[0]


def result_item(call: dict[str, Any]) -> dict[str, Any]:
    args = json.loads(call["arguments"])
    return {"type": "function_call_output", "call_id": call["call_id"], "output": str(args["a"] + args["b"])}


class Loop:
    """One 20-turn conversation; `send(body) -> response` is the mode's transport."""

    def __init__(self, turns: int, salt: str) -> None:
        self.turns, self.salt = turns, salt
        self.sent = 0
        self.calls: list[str] = []
        self.last: dict[str, Any] = {}

    def run(self, step: Callable[[int, dict[str, Any] | None], dict[str, Any]]) -> None:
        previous = None
        for i in range(self.turns):
            previous = step(i, previous)
            call = the_call(previous)
            self.calls.append(f"{call['name']}({call['arguments']})")
        self.last = previous or {}


def http_post(client: httpx.Client, loop: Loop, body: dict[str, Any]) -> dict[str, Any]:
    data = json.dumps(body).encode()
    loop.sent += len(data)
    reply = client.post("/v1/responses", content=data, headers={"content-type": "application/json"})
    reply.raise_for_status()
    return dict(reply.json())


def resend(client: httpx.Client, loop: Loop) -> None:
    items: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]

    def step(i: int, previous: dict[str, Any] | None) -> dict[str, Any]:
        if previous is not None:
            call = the_call(previous)
            items.append({"type": "function_call", "call_id": call["call_id"], "name": call["name"],
                          "arguments": call["arguments"]})
            items.append(result_item(call))
        return http_post(client, loop, {**COMMON, "input": items, "store": False, "cache_salt": loop.salt})

    loop.run(step)


def by_id(client: httpx.Client, loop: Loop) -> None:
    def step(i: int, previous: dict[str, Any] | None) -> dict[str, Any]:
        if previous is None:
            return http_post(client, loop, {**COMMON, "input": FIRST, "cache_salt": loop.salt})
        return http_post(client, loop, {**COMMON, "input": [result_item(the_call(previous))],
                                        "previous_response_id": previous["id"], "cache_salt": loop.salt})

    loop.run(step)


def over_socket(ws: Connection, loop: Loop) -> None:
    def send(body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps({"type": "response.create", **body})
        loop.sent += len(data.encode())
        ws.send(data)
        while True:
            event = json.loads(ws.recv(timeout=300))
            if event["type"] == "error":
                raise RuntimeError(event)
            if event["type"] in ("response.completed", "response.incomplete"):
                return dict(event["response"])

    def step(i: int, previous: dict[str, Any] | None) -> dict[str, Any]:
        if previous is None:
            return send({**COMMON, "input": FIRST, "store": False, "cache_salt": loop.salt})
        return send({**COMMON, "input": [result_item(the_call(previous))], "previous_response_id": previous["id"],
                     "store": False, "cache_salt": loop.salt})

    loop.run(step)


def measure(port: int, gateway_pid: int, mode: str, turns: int, salt: str) -> dict[str, Any]:
    loop = Loop(turns, salt)
    cpu0, t0 = cpu_seconds(gateway_pid), time.perf_counter()
    if mode == "websocket":
        with connect(f"ws://127.0.0.1:{port}/v1/responses", open_timeout=60, max_size=None) as ws:
            over_socket(ws, loop)
    else:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
            (resend if mode == "resend" else by_id)(client, loop)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds(gateway_pid) - cpu0
    usage = loop.last["usage"]
    return {"mode": mode, "seconds": seconds, "bytes_sent": loop.sent, "gateway_cpu_ms_per_turn": cpu * 1000 / turns,
            "last_input_tokens": usage["input_tokens"],
            "last_cached_tokens": usage["input_tokens_details"]["cached_tokens"], "calls": loop.calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-responses-") as tmp:
        work = Path(tmp)
        engine = launch_engine(work / "engine", args=["--set", f"responses.path={work / 'store'}",
                                                      "--set", "reuse.retained_interactive_ttl=0"])
        try:
            gateway = launch_gateway(work / "gateway", [engine.address])
            try:
                runs = [measure(gateway.port, gateway.process.pid, mode, args.turns, f"bench-{r}-{mode}")
                        for r in range(args.repeats) for mode in MODES]
            finally:
                gateway.stop()
        finally:
            engine.stop()
    rows, summary = [], {}
    reference = next(r["calls"] for r in runs if r["mode"] == "resend")
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        med = {k: statistics.median(r[k] for r in mine) for k in ("seconds", "bytes_sent", "gateway_cpu_ms_per_turn",
                                                                   "last_input_tokens", "last_cached_tokens")}
        same = all(r["calls"] == reference for r in mine)
        summary[mode] = {**med, "same_outputs": same}
        rows.append([mode, med["seconds"], med["seconds"] * 1000 / args.turns, int(med["bytes_sent"]),
                     med["gateway_cpu_ms_per_turn"], int(med["last_input_tokens"]), int(med["last_cached_tokens"]),
                     "yes" if same else "NO"])
    base = summary["resend"]
    for row, mode in zip(rows, MODES):
        row.insert(4, f"{summary[mode]['bytes_sent'] / base['bytes_sent']:.2f}x")
    headers = ["mode", "loop s", "ms / turn", "bytes sent", "vs resend", "gateway CPU ms / turn",
               "last prompt tokens", "last cached tokens", "same outputs"]
    table = (f"{args.turns}-turn tool-call loop on /v1/responses, ignis-tiny, medians of {args.repeats} interleaved "
             f"loops per mode\n\n" + markdown(headers, rows))
    print(table)
    path = save("responses", {"turns": args.turns, "repeats": args.repeats, "summary": summary, "runs": runs}, table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
