"""Where an adapter's files come from: the disk tier below the CPU tier (engine/lora_manager.py).

- a path, or ``file:///path``: a directory the runtime reads in place (a ``pvc://`` adapter is such a
  path under the pod's mount, rendered by the operator);
- ``hf://org/repo`` (``hf://org/repo@revision``): its ``adapter_config.json`` and
  ``adapter_model.safetensors`` fetched with huggingface_hub into the disk cache (``GOODPUT_LORA_CACHE``,
  else the Hub's own cache) and read from there; a second load of the same revision reads the cache.
  ``HF_ENDPOINT`` (a mirror) and ``HF_TOKEN`` are read at each fetch.

A fetch touches the network and the disk only: callers run it off the step loop, as they do reading an
adapter. A source that cannot serve an adapter is a LoraError naming why: no such repository or revision
(404), a repository that holds no PEFT adapter or a token it refuses (400); a Hub that cannot be reached
or answers with its own error is a 503 (``LoraSourceUnavailable``), so a client may retry.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from goodput_runtime.engine.lora_errors import LoraError, LoraNotFound

HF = "hf://"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_REPO = re.compile(r"[A-Za-z0-9][-_.A-Za-z0-9]*/[A-Za-z0-9][-_.A-Za-z0-9]*")
_NAME = re.compile(r"[A-Za-z0-9][-_.A-Za-z0-9]*")  # an adapter's name under a --lora-source


class LoraSourceUnavailable(LoraError):
    status = 503
    code = "lora_source_unavailable"


def scheme(source: str) -> str | None:
    """The source's scheme (None for a plain path)."""
    return source.split("://", 1)[0] if "://" in source else None


def parse_hf(source: str) -> tuple[str, str | None]:
    """(repo id, revision) of an ``hf://org/repo[@revision]`` source; ValueError when malformed."""
    rest = source.removeprefix(HF).strip("/")
    repo, _, revision = rest.partition("@")
    if not _REPO.fullmatch(repo) or ".." in repo or (revision == "" and "@" in rest):
        raise ValueError(f"{source!r} is not hf://ORG/REPO or hf://ORG/REPO@REVISION")
    return repo, revision or None


def under(source: str, name: str) -> str | None:
    """The source of adapter `name` under a --lora-source: ``hf://org/name`` (whether it exists is
    learnt by fetching it), or the subdirectory `name` when it holds an adapter_config.json; None when
    `name` is no plain name or no such subdirectory."""
    if not _NAME.fullmatch(name) or ".." in name:
        return None
    if source.startswith(HF):
        org = source.removeprefix(HF).strip("/")
        return f"{HF}{org}/{name}" if "/" not in org else None
    path = Path(source.removeprefix("file://")) / name
    return str(path) if (path / "adapter_config.json").is_file() else None


def local_dir(name: str, source: str | Path) -> Path:
    """The directory holding adapter `name`'s files, fetched first into the disk cache for ``hf://``."""
    text = str(source)
    if text.startswith(HF):
        return fetch_hf(name, text)
    if scheme(text) not in (None, "file"):
        raise LoraError(f"adapter {name!r}: {text!r} is not a path, file:// or hf:// source")
    return Path(text.removeprefix("file://"))


def fetch_hf(name: str, source: str) -> Path:
    """The adapter of an hf:// source, downloaded (or found) in the disk cache; its directory."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        repo, revision = parse_hf(source)
    except ValueError as e:
        raise LoraError(f"adapter {name!r}: {e}") from None
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    where = f"{source} ({endpoint})"
    paths = []
    for filename in ADAPTER_FILES:
        try:
            paths.append(
                hf_hub_download(
                    repo,
                    filename,
                    revision=revision,
                    cache_dir=os.environ.get("GOODPUT_LORA_CACHE") or None,
                    endpoint=endpoint,
                    token=os.environ.get("HF_TOKEN") or None,
                )
            )
        except GatedRepoError:
            raise LoraError(f"adapter {name!r}: {where} is gated: the token has no access to it") from None
        except RepositoryNotFoundError:
            raise LoraNotFound(f"adapter {name!r}: {where}: no such repository (or it is private)") from None
        except RevisionNotFoundError:
            raise LoraNotFound(f"adapter {name!r}: {where}: no revision {revision!r} in the repository") from None
        except LocalEntryNotFoundError as e:  # before EntryNotFoundError, its base: the Hub was not reached
            raise LoraSourceUnavailable(f"adapter {name!r}: {where} could not be reached ({e})") from None
        except EntryNotFoundError:
            raise LoraError(
                f"adapter {name!r}: {where} is not a PEFT adapter: it has no {filename}"
                f" (a PEFT adapter holds {' and '.join(ADAPTER_FILES)})"
            ) from None
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status in (401, 403):
                raise LoraError(f"adapter {name!r}: {where} refused the token ({status})") from None
            raise LoraSourceUnavailable(f"adapter {name!r}: {where} answered {status or 'an error'}") from None
        except OSError as e:  # the connection, or the cache's disk
            raise LoraSourceUnavailable(f"adapter {name!r}: fetching {where} failed ({e})") from None
    return Path(paths[0]).parent
