"""What each InferencePipeline step kind adds to the time to first token.

One `python -m goodput_runtime` process serving SmolLM2-135M-Instruct (CPU) sits behind one
`python -m goodput_gateway` (no cluster: --static-model and --static-pipeline). The same
streaming chat request goes to the bare model and to one pipeline per step kind, in
alternating rounds (baseline, rules, template, output guard, ..., then again), sequentially,
so every variant sees the same machine noise. Per variant: the client's median TTFT and
its difference from the baseline measured in the same rounds; per step: the gateway's own
step histogram (goodput_pipeline_step_duration_seconds, mean). Then the rules alone,
in-process: one input check of the bench prompt, and the output filter per streamed chunk.

    python -m bench.pipeline_overhead [--rounds 12] [--out bench/results/pipeline_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from bench.server_process import REPO, gateway_process, start_server

PROMPT = (
    "How do I bake bread at home? I have flour, water, yeast and salt, a small oven and one afternoon. "
    "Give me a simple recipe with the steps in order and the baking time."
)
RULES = {
    "maxLength": 8000,
    "deny": [
        {"name": "credentials", "pattern": "(?i)(password|api[_ -]?key)\\s*[:=]"},
        {"name": "internal-url", "pattern": "https?://intranet\\.example\\.com\\S*"},
        {"name": "codename", "pattern": "(?i)project\\s+(falcon|osprey|kestrel)", "action": "redact"},
    ],
    "pii": [{"type": "email", "action": "redact"}, {"type": "phone", "action": "redact"}, {"type": "card"}],
}
TOPIC = 'Is this message about food or cooking? Answer yes or no.\n\nMessage: "{input}"'
GENERATE = {"name": "answer", "kind": "generate", "service": "smol"}
PIPELINES = {
    "rules": [{"name": "input-rules", "kind": "guard", "rules": RULES}, GENERATE],
    "template": [
        {
            "name": "persona",
            "kind": "template",
            "system": "You are a helpful cooking assistant.",
            "prompt": "Question from a customer: {input}",
        },
        GENERATE,
    ],
    "output-0": [GENERATE, {"name": "output-rules", "kind": "guard", "stage": "output", "holdBack": 0, "rules": RULES}],
    "output-64": [
        GENERATE,
        {"name": "output-rules", "kind": "guard", "stage": "output", "holdBack": 64, "rules": RULES},
    ],
    # the small model's verdict on a long prompt is unreliable, and a refused request streams nothing: both answers
    # allow here, so every request goes on to generate; the classifier's cost is the same whatever it answers
    "classifier": [
        {
            "name": "on-topic",
            "kind": "guard",
            "classifier": {
                "service": "smol",
                "template": TOPIC,
                "allow": ["yes", "no"],
                "block": ["never"],
                "onUnknown": "allow",
            },
        },
        GENERATE,
    ],
}
VARIANTS = ("smol", *PIPELINES)  # "smol": the bare model through the gateway, the baseline


def pipelines_yaml(path: Path) -> None:
    docs = [
        {
            "apiVersion": "serving.goodput.dev/v1alpha1",
            "kind": "InferencePipeline",
            "metadata": {"name": name},
            "spec": {"steps": steps},
        }
        for name, steps in PIPELINES.items()
    ]
    path.write_text(yaml.safe_dump_all(docs))


@contextmanager
def gateway(static: str, pipelines: Path, log_dir: Path) -> Iterator[str]:
    with gateway_process(
        static, log_dir, "pipelines", "--static-pipeline", str(pipelines), "--log-level", "warning"
    ) as (url, _pid):
        yield url


def ttft(url: str, model: str, max_tokens: int) -> float:
    """Seconds to the first streamed content, as the client sees it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    first = None
    try:
        response = urllib.request.urlopen(request, timeout=300)
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"{model}: {err.code} {err.read().decode()}") from None
    with response:
        for line in response:
            if first is None and line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    first = time.perf_counter() - started
    assert first is not None, f"{model}: no content streamed"
    return first


def step_means(url: str) -> dict[str, dict[str, float]]:
    """Per pipeline and step: the gateway's mean step duration (seconds) and its count."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    sums: dict[tuple[str, str, str], dict[str, float]] = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            name = "goodput_pipeline_step_duration_seconds" + suffix + "{"
            if line.startswith(name):
                labels = dict(part.split("=", 1) for part in line[len(name) : line.index("}")].split(","))
                key = tuple(labels[k].strip('"') for k in ("pipeline", "step", "kind"))
                sums.setdefault(key, {})[suffix] = float(line.rsplit(" ", 1)[1])  # type: ignore[index]
    return {
        f"{p}/{s} ({k})": {"mean_ms": 1000 * v["_sum"] / v["_count"], "count": v["_count"]}
        for (p, s, k), v in sorted(sums.items())
        if v.get("_count")
    }


def rules_in_process(iterations: int) -> dict[str, float]:
    from goodput_contract.api.pipeline_spec import parse_pipeline
    from goodput_gateway.pipelines.rules import RuleSet
    from goodput_gateway.pipelines.stream import OutputFilter

    steps = parse_pipeline("bench", "bench", {"steps": PIPELINES["output-64"]}).steps
    rules = RuleSet(steps[1].rules)
    started = time.perf_counter()
    for _ in range(iterations):
        rules.check(PROMPT)
    per_check = (time.perf_counter() - started) / iterations
    answer = (PROMPT + " ") * 4  # about 800 characters, streamed in 4-character chunks as tokens come
    chunks = [answer[i : i + 4] for i in range(0, len(answer), 4)]
    started = time.perf_counter()
    for _ in range(iterations // 10):
        f = OutputFilter(rules, 64)
        for chunk in chunks:
            f.feed(chunk)
        f.finish()
    per_chunk = (time.perf_counter() - started) / (iterations // 10) / len(chunks)
    return {
        "input_check_us": per_check * 1e6,
        "output_chunk_us": per_chunk * 1e6,
        "prompt_chars": len(PROMPT),
        "answer_chars": len(answer),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pipeline_overhead.json")
    args = p.parse_args()

    from goodput_runtime.tools import smollm2

    cache = REPO / ".cache" / "smollm2"
    model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    log_dir = REPO / "bench" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    pipelines = log_dir / "pipelines.yaml"
    pipelines_yaml(pipelines)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with (
        start_server(
            model, "smol", args.threads, ["--max-model-len", "1024", "--kv-cache-memory", "64Mi"], log_dir
        ) as server,
        gateway(f"smol={server.base_url}", pipelines, log_dir) as url,
    ):
        for variant in VARIANTS:  # warm-up: each prompt's first sight, and the gateway's first connection
            ttft(url, variant, args.max_tokens)
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                samples[variant].append(ttft(url, variant, args.max_tokens))
            print(
                f"  round {r}: " + ", ".join(f"{v} {samples[v][-1] * 1000:.0f}" for v in VARIANTS) + " ms", flush=True
            )
        steps = step_means(url)
    base = statistics.median(samples["smol"])
    variants = {
        v: {
            "ttft_p50_ms": 1000 * statistics.median(s),
            "added_ms": 1000 * (statistics.median(s) - base),
            "ratio": statistics.median(s) / base,
            "samples_ms": [round(1000 * x, 2) for x in s],
        }
        for v, s in samples.items()
    }
    in_process = rules_in_process(20000)
    report = {
        "machine": f"{os.cpu_count()} CPUs, shared",
        "args": {k: str(v) for k, v in vars(args).items()},
        "variants": variants,
        "gateway_steps": steps,
        "rules_in_process": in_process,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"\nTTFT through the gateway, median of {args.rounds} alternating rounds (SmolLM2-135M, CPU)")
    print(f"| {'variant':<12} | {'TTFT p50 (ms)':>13} | {'added (ms)':>10} | {'ratio':>6} |")
    print(f"|{'-' * 14}|{'-' * 15}|{'-' * 12}|{'-' * 8}|")
    for v, row in variants.items():
        print(f"| {v:<12} | {row['ttft_p50_ms']:>13.1f} | {row['added_ms']:>10.1f} | {row['ratio']:>6.2f} |")
    print("\nThe gateway's own step histograms (mean per request)")
    print(f"| {'pipeline/step (kind)':<40} | {'mean (ms)':>9} | {'count':>5} |")
    print(f"|{'-' * 42}|{'-' * 11}|{'-' * 7}|")
    for name, row in steps.items():
        print(f"| {name:<40} | {row['mean_ms']:>9.3f} | {row['count']:>5.0f} |")
    print(
        f"\nRules in process: input check {in_process['input_check_us']:.1f} µs "
        f"({in_process['prompt_chars']} chars), output filter {in_process['output_chunk_us']:.1f} µs per chunk"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
