"""`make demo`'s batch step: a small batch through the gateway's Batch API with the official `openai` SDK.

    python3 hack/demo_batch.py --base-url http://127.0.0.1:PORT/v1 --model smollm2 [--timeout 300]

Uploads a JSONL file of a few chat requests (files.create), creates a batch of them
(batches.create), polls it until it ends or --timeout seconds pass, then prints each answer by
its custom_id from the output file (files.content). Exits 1 when the batch does not complete in
time or any line failed.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time

QUESTIONS = (
    "What is the capital of Italy?",
    "Name a primary colour.",
    "What is 2 + 2?",
)
TERMINAL = ("completed", "failed", "expired", "cancelled")


def jsonl(model: str, max_tokens: int) -> bytes:
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i, question in enumerate(QUESTIONS, 1)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="the gateway's OpenAI base URL, ending in /v1")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for the batch to end")
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args()

    import openai  # the demo installs it when missing

    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=3, timeout=30)
    upload = client.files.create(file=("demo.jsonl", io.BytesIO(jsonl(args.model, args.max_tokens))), purpose="batch")
    print(f"files.create    -> {upload.id} ({upload.bytes} bytes, {len(QUESTIONS)} requests)")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"from": "demo"}
    )
    print(f"batches.create  -> {batch.id} ({batch.status})")
    deadline = time.monotonic() + args.timeout
    last = ""
    while batch.status not in TERMINAL:
        if time.monotonic() > deadline:
            print(f"the batch is still {batch.status} after {args.timeout:.0f} s", file=sys.stderr)
            return 1
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
        counts = batch.request_counts
        seen = f"{batch.status} ({counts.completed}/{counts.total} done)" if counts else batch.status
        if seen != last:
            print(f"batches.retrieve -> {seen}")
            last = seen
    if batch.status != "completed" or not batch.output_file_id:
        errors = [e.message for e in (batch.errors.data if batch.errors else None) or []]
        print(f"the batch ended {batch.status}: {errors}", file=sys.stderr)
        return 1
    print()
    answers = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    for line in sorted(answers, key=lambda a: a["custom_id"]):
        question = QUESTIONS[int(line["custom_id"][1:]) - 1]
        response = line["response"]
        content = response["body"]["choices"][0]["message"]["content"] if response["status_code"] == 200 else None
        print(f"{line['custom_id']}: {question}")
        print(f"    {content!r}" if content is not None else f"    HTTP {response['status_code']}")
    failed = batch.request_counts.failed if batch.request_counts else 0
    if failed:
        print(f"{failed} line(s) failed; see the error file {batch.error_file_id}", file=sys.stderr)
    return 1 if failed or len(answers) != len(QUESTIONS) else 0


if __name__ == "__main__":
    sys.exit(main())
