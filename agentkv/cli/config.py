"""The CLI's configuration from the environment: where the store lives, and the variables' help.

Read once, at the edge (the library itself reads only ``$AGENTKV_DB_URL`` and ``$AGENTKV_SNAPSHOT_URL``
in ``Store.from_env``, ``$AGENTKV_HOME`` for its default data directory and ``$AGENTKV_CACHE_DIR`` for
the model cache)::

    store = open_store(None)          # --db, else $AGENTKV_DB_URL, else $AGENTKV_HOME, else the default
    store = open_store(None, "s3://bucket/kv")    # snapshots: --snapshots, else $AGENTKV_SNAPSHOT_URL
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from agentkv.cli.agent import CLIUsageError
from agentkv.memory import Store
from agentkv.memory.database import ENV_HOME
from agentkv.engine.factory import ENGINE_ENV
from agentkv.engine.paged.compiled_pool import KEEP_ENV
from agentkv.memory.snapshots import ENV_SNAPSHOT_URL
from agentkv.memory.store import ENV_DB_URL

ENV_MODEL = "AGENTKV_MODEL"
"""The model when ``--model`` is not given."""
ENV_CACHE_DIR = "AGENTKV_CACHE_DIR"
"""Where the default model is converted to OpenVINO IR and compiled blobs are cached."""

ENVIRONMENT_HELP = f"""Environment variables:

{ENV_HOME}: root of the default database ({ENV_HOME}/agentkv.db) and of the KV snapshots
({ENV_HOME}/snapshots); default: the user data directory.

{ENV_DB_URL}: SQLAlchemy URL of the store, e.g. postgresql+psycopg2://u:p@host/db (--db wins over it;
it wins over {ENV_HOME}'s database).

{ENV_SNAPSHOT_URL}: where KV snapshots go: s3://bucket/prefix (credentials and endpoint from
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL_S3, AWS_REGION), file:///dir or a directory
(--snapshots wins); default: a directory beside the database.

{ENV_MODEL}: GGUF file or OpenVINO IR directory (--model wins); default: SmolLM2-135M-Instruct.

{ENGINE_ENV}: the engine that runs the model: paged (KV in shared blocks, requests batched together) or
stateful (one KV cache per conversation); default: paged on CPU and GPU (stateful when a model's paged
form fails), stateful on NPU.

{ENV_CACHE_DIR}: where models are converted to OpenVINO IR and compiled models are cached (`agentkv
models list` shows them, `agentkv models prune` removes stale ones); default: the user cache directory.

{KEEP_ENV}: how many compiled model graphs a process keeps in memory when an engine closes, so that
the next engine on the same model and settings skips compiling (the default model's engine has 3);
default: 0.
"""
"""The ``--help`` epilog (typer's rich help keeps paragraphs separated by blank lines)."""


@dataclass(frozen=True)
class KVTierOptions:
    """The KV block tiers asked for on the command line (``agentkv serve --kv-host-mb 512``)."""

    host_mib: int = 256
    """``--kv-host-mb``: host memory for recently used blocks (0: none)."""
    disk: Path | None = None
    """``--kv-disk``: a local block cache in front of an S3 snapshot store."""
    disk_gib: float | None = None
    """``--kv-disk-gb``: the most the disk blocks may take (None: no bound)."""


def open_store(db: str | None, snapshots: str | None = None, kv_tiers: KVTierOptions = KVTierOptions()) -> Store:
    """The store the CLI uses: ``--db``, else ``$AGENTKV_DB_URL``, else ``$AGENTKV_HOME/agentkv.db``,
    else the default file (the library resolves the last two: ``memory.database.data_root``); its
    snapshots at ``--snapshots``, else ``$AGENTKV_SNAPSHOT_URL``, else beside the database; its KV
    block tiers as ``kv_tiers`` says."""
    disk_bytes = None if kv_tiers.disk_gib is None else int(kv_tiers.disk_gib * (1 << 30))
    return Store(db or os.environ.get(ENV_DB_URL) or None,
                 snapshots=snapshots or os.environ.get(ENV_SNAPSHOT_URL) or None,
                 kv_host_bytes=kv_tiers.host_mib << 20, kv_disk=kv_tiers.disk, kv_disk_bytes=disk_bytes)


def model_choice(model: str | None) -> str | None:
    """``--model``, else ``$AGENTKV_MODEL``, else None (the default model)."""
    return model or os.environ.get(ENV_MODEL) or None


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w`` as a timedelta; ``CLIUsageError`` otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*([smhdw])\s*", text)
    if match is None:
        raise CLIUsageError(f"--older-than takes a number and a unit (s, m, h, d, w), e.g. 30d; got {text!r}")
    return timedelta(seconds=int(match.group(1)) * _AGE_UNITS[match.group(2)])
