"""The cost of structured output: grammar engines compared, and output tokens/s with and without a
JSON Schema on the real model at concurrency 1 and 16.

Two parts, both written to one JSON file under bench/results/ and printed as tables:

1. engines: llguidance as the runtime drives it (structured/grammar.py's GrammarCompiler, its JSON
   settings) and xgrammar (when installed: `pip install -e .[bench]`; skipped otherwise) on the
   model's tokenizer: CPU time to compile fresh JSON Schemas (each distinct, so nothing is cached),
   CPU time to fill one token mask per step while replaying a valid output token by token, and
   CPU time to apply a 16-row mask to the logits.
2. serving: our server (a child process) answers chat requests at concurrency 1 and 16, plain and
   with response_format json_schema, in alternating rounds (plain, schema, plain, schema, ...).
   The schema is an array of at least 100 nested objects (strings, enums, numbers, booleans), so
   every request runs to max_tokens and both sides decode the same number of tokens per request:
   the difference is the grammar's (mask filling, its transfer and application), not output length.

    PYTHONPATH=runtime:contract python -m bench.structured_output --model .cache/smollm2/0.1.2/hf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from bench.serve import default_output, write_json
from bench.server_process import start_server

ITEM = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "enum": ["France", "Japan", "Italy", "Spain", "Other"]},
        "population_millions": {"type": "number"},
        "coastal": {"type": "boolean"},
        "location": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
        },
    },
    "required": ["city", "country", "population_millions", "coastal", "location"],
}
LONG_SCHEMA = {"type": "array", "items": ITEM, "minItems": 100}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
SAMPLE = [
    {
        "city": "Paris",
        "country": "France",
        "population_millions": 2.1,
        "coastal": False,
        "location": {"lat": 48.85, "lon": 2.35},
    },
    {
        "city": "Tokyo",
        "country": "Japan",
        "population_millions": 14.0,
        "coastal": True,
        "location": {"lat": 35.68, "lon": 139.69},
    },
]


def schemas_under_test() -> list[tuple[str, dict, str]]:
    """(name, schema, a valid output's text) for each schema measured: a nested object, the serving
    part's array of at least 100 of them (two replayed, not closed), and tool_choice required's call."""
    from goodput_runtime.server.protocol import Tool, tool_call_spec

    call = json.loads(tool_call_spec((Tool("get_weather", None, WEATHER, {}),), "required", True).source)
    return [
        ("object", ITEM, json.dumps(SAMPLE[0])),
        ("array_min100", LONG_SCHEMA, json.dumps(SAMPLE)[:-1]),
        ("tool_call", call, json.dumps([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}])),
    ]


def engines(model: str, num_schemas: int) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    results: dict = {"schemas": num_schemas}
    for name, base, sample in schemas_under_test():
        # each distinct (a title of its own), so nothing is cached
        schemas = [{**base, "title": f"s-{i}"} for i in range(num_schemas)]
        ids = tokenizer(sample, add_special_tokens=False).input_ids
        figures: dict = {"replayed_tokens": len(ids), "llguidance": llguidance_figures(tokenizer, vocab, schemas, ids)}
        try:
            figures["xgrammar"] = xgrammar_figures(tokenizer, vocab, schemas, ids)
        except ImportError:
            figures["xgrammar"] = None  # not installed: pip install -e .[bench]
        results[name] = figures
    results["apply_16_rows"] = apply_figures(vocab)
    results["sampler_step"] = step_figures(tokenizer, vocab)
    return results


def step_figures(tokenizer, vocab: int) -> dict:
    """What a decode step pays for grammars in the runtime: Sampler.mask (every row's mask filled,
    moved, applied) and each row's matcher advanced, for 1 and 16 rows replaying a valid output of
    the serving part's schema; wall µs per step, median over the steps."""
    import torch

    from goodput_runtime.engine.sampler import Sampler, SampleRow
    from goodput_runtime.sampling import SamplingParams
    from goodput_runtime.structured.grammar import GrammarCompiler, GrammarSpec

    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    compiled = compiler.compile(GrammarSpec.json_schema(LONG_SCHEMA))
    ids = tokenizer(json.dumps(SAMPLE)[:-1], add_special_tokens=False).input_ids
    figures: dict = {"replayed_tokens": len(ids)}
    default_threads = torch.get_num_threads()
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        for rows in (1, 16):
            sample_rows = [
                SampleRow(SamplingParams(max_tokens=1000), ("r", i), [], 0, compiled.matcher()) for i in range(rows)
            ]
            logits = torch.randn(rows, vocab)
            times = []
            for token in ids:
                start = time.perf_counter()
                Sampler.mask(logits, sample_rows)
                for row in sample_rows:
                    assert row.grammar is not None and row.grammar.accept(token)
                times.append(time.perf_counter() - start)
            figures[f"threads_{threads}_rows_{rows}_us"] = statistics.median(times) * 1e6
    torch.set_num_threads(default_threads)
    return figures


def timed(fn) -> float:
    """CPU seconds fn took on the process: on a shared machine, wall time of a microsecond call mostly
    measures how long the scheduler kept the thread waiting."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def xgrammar_figures(tokenizer, vocab: int, schemas: list[dict], ids: list[int]) -> dict:
    import xgrammar as xgr

    setup = time.perf_counter()
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), max_threads=1, cache_enabled=False
    )
    setup = time.perf_counter() - setup
    compiled = []
    # strict_mode: objects closed, as the runtime has them with llguidance
    compile_s = [
        timed(
            lambda s=s: compiled.append(
                compiler.compile_json_schema(json.dumps(s), any_whitespace=False, strict_mode=True)
            )
        )
        for s in schemas
    ]
    matcher = xgr.GrammarMatcher(compiled[-1])
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    mask_s = []
    for token in ids:
        mask_s.append(timed(lambda: matcher.fill_next_token_bitmask(bitmask, 0)))
        assert matcher.accept_token(token)
    return summary(setup, compile_s, mask_s)


def llguidance_figures(tokenizer, vocab: int, schemas: list[dict], ids: list[int]) -> dict:
    """As the runtime pays it: GrammarCompiler.compile (the matcher and its first mask: llguidance
    builds its lexer lazily) and Grammar.fill."""
    from goodput_runtime.structured.grammar import GrammarCompiler, GrammarSpec, allocate_bitmask

    setup = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    setup = time.perf_counter() - setup
    compiled = []
    compile_s = [timed(lambda s=s: compiled.append(compiler.compile(GrammarSpec.json_schema(s)))) for s in schemas]
    matcher = compiled[-1].matcher()
    bitmask = allocate_bitmask(1, vocab)
    mask_s = []
    for token in ids:
        mask_s.append(timed(lambda: matcher.fill(bitmask, 0)))
        assert matcher.accept(token), matcher.matcher.get_error()
    return summary(setup, compile_s, mask_s)


def apply_figures(vocab: int, rows: int = 16, repeats: int = 50) -> dict:
    """Wall µs (median) to apply a [rows, ceil(V / 32)] bitmask to [rows, V] float32 logits: the
    runtime's tensor operations, and xgrammar's kernel when installed; on one torch thread and on the
    default number (CPU time would count the pool's idle spinning)."""
    import torch

    from goodput_runtime.structured.grammar import apply_bitmask

    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(rows, vocab)
    every = list(range(rows))

    def wall(fn) -> float:
        times = []
        for _ in range(repeats):
            target = logits.clone()
            start = time.perf_counter()
            fn(target)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
    figures: dict = {"rows": rows}
    default_threads = torch.get_num_threads()
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        figures[f"threads_{threads}"] = {
            "runtime_us": wall(lambda t: apply_bitmask(t, bitmask, every)),
            "xgrammar_us": wall(lambda t: xgr.apply_token_bitmask_inplace(t, bitmask, indices=every))
            if xgr is not None
            else None,
        }
    torch.set_num_threads(default_threads)
    return figures


def summary(setup: float, compile_s: list[float], mask_s: list[float]) -> dict:
    ordered = sorted(mask_s)
    return {
        "tokenizer_setup_ms": setup * 1e3,
        "compile_first_ms": compile_s[0] * 1e3,
        "compile_median_ms": statistics.median(compile_s) * 1e3,
        "mask_mean_us": statistics.fmean(mask_s) * 1e6,
        "mask_p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6,
        "mask_max_us": ordered[-1] * 1e6,
    }


async def one_round(
    base_url: str, model: str, concurrency: int, max_tokens: int, structured: bool, round_index: int
) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=3600)
    extra: dict = {"ignore_eos": True}
    if structured:
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "cities", "schema": LONG_SCHEMA}}}

    async def request(i: int) -> int:
        result = await client.chat.completions.create(
            model=model,
            max_tokens=max_tokens,
            temperature=0.7,
            seed=1000 * round_index + i,
            messages=[{"role": "user", "content": "List many world cities as JSON, with their details."}],
            extra_body=extra,
        )
        assert result.choices[0].finish_reason == "length"  # every request runs to max_tokens
        return result.usage.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(request(i) for i in range(concurrency))))
    wall = time.perf_counter() - start
    await client.close()
    return {
        "concurrency": concurrency,
        "structured": structured,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
    }


def serving(
    model: str, rounds: int, concurrencies: list[int], max_tokens: int, threads: int, log_dir: Path
) -> list[dict]:
    records = []
    with start_server(
        model,
        "bench",
        threads,
        ["--max-model-len", "1024", "--kv-cache-memory", "256Mi", "--max-num-seqs", "32"],
        log_dir,
    ) as server:
        asyncio.run(one_round(server.base_url, "bench", 1, 8, True, -1))  # compiles the schema before timing
        for concurrency in concurrencies:
            for r in range(rounds):
                for structured in (False, True):
                    record = asyncio.run(one_round(server.base_url, "bench", concurrency, max_tokens, structured, r))
                    record["round"] = r
                    records.append(record)
                    print(
                        f"  c={concurrency} round {r} {'json_schema' if structured else 'plain      '} "
                        f"{record['tokens_per_s']:.2f} tokens/s",
                        flush=True,
                    )
    return records


def serving_table(records: list[dict]) -> tuple[str, list[dict]]:
    rows, lines = (
        [],
        [
            "| concurrency | plain tokens/s | json_schema tokens/s | ratio (schema / plain, per round) |",
            "|---|---|---|---|",
        ],
    )
    for concurrency in sorted({r["concurrency"] for r in records}):
        mine = [r for r in records if r["concurrency"] == concurrency]
        plain = [r["tokens_per_s"] for r in mine if not r["structured"]]
        schema = [r["tokens_per_s"] for r in mine if r["structured"]]
        ratios = [s / p for p, s in zip(plain, schema, strict=True)]
        rows.append(
            {
                "concurrency": concurrency,
                "plain_tokens_per_s": statistics.median(plain),
                "json_schema_tokens_per_s": statistics.median(schema),
                "ratios": ratios,
                "median_ratio": statistics.median(ratios),
            }
        )
        lines.append(
            f"| {concurrency} | {statistics.median(plain):.2f} | {statistics.median(schema):.2f} | "
            f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)}) |"
        )
    return "\n".join(lines), rows


def engines_table(results: dict) -> str:
    lines = [
        "| schema | engine | tokenizer setup ms | first compile ms | median compile ms | mask mean µs | mask p99 µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for schema in ("object", "array_min100", "tool_call"):
        for name in ("xgrammar", "llguidance"):
            f = results[schema].get(name)
            if f:
                lines.append(
                    f"| {schema} | {name} | {f['tokenizer_setup_ms']:.0f} | {f['compile_first_ms']:.1f} | "
                    f"{f['compile_median_ms']:.1f} | {f['mask_mean_us']:.1f} | {f['mask_p99_us']:.1f} |"
                )
    lines += ["", "| apply a 16-row mask, wall µs | runtime (llguidance masks) | xgrammar's kernel |", "|---|---|---|"]
    for key, f in results["apply_16_rows"].items():
        if key.startswith("threads_"):
            xgr = f"{f['xgrammar_us']:.0f}" if f["xgrammar_us"] is not None else "not installed"
            lines.append(f"| {key.removeprefix('threads_')} torch thread(s) | {f['runtime_us']:.0f} | {xgr} |")
    lines.append("\ngrammar cost of a decode step (Sampler.mask and the matchers advanced, wall µs, median):")
    for key, value in results["sampler_step"].items():
        if key.startswith("threads_"):
            threads, _, rows = key.removeprefix("threads_").removesuffix("_us").partition("_rows_")
            lines.append(f"  {threads} torch thread(s), {rows} row(s): {value:.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".cache/smollm2/0.1.2/hf")
    parser.add_argument("--schemas", type=int, default=10, help="distinct schemas compiled per engine")
    parser.add_argument("--rounds", type=int, default=3, help="alternating plain/json_schema rounds per concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    figures = engines(args.model, args.schemas)
    print(engines_table(figures))
    payload: dict = {"model": args.model, "engines": figures}
    if not args.skip_serving:
        records = serving(
            args.model, args.rounds, args.concurrency, args.max_tokens, args.threads, Path("bench/results/logs")
        )
        table, rows = serving_table(records)
        payload.update(rounds=records, serving=rows)
        print(table)
    path = write_json(args.output or default_output("structured-output"), payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
