"""The smg gateway (OpenAI-compatible HTTP) in front of a scheduler: finding it, and its command line."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from services.flags import model_folder


def find_smg() -> str:
    """The ``smg`` executable: next to this Python first (the same venv), then on PATH."""
    beside = Path(sys.executable).parent / "smg"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("smg")
    if found is None:
        raise SystemExit("ordinal: the smg gateway is not installed (pip install smg==1.13.0), or use --no-gateway")
    return found


def smg_argv(
    smg: str,
    *,
    host: str,
    port: int,
    worker_url: str,
    model_dir: Path,
    metrics_port: int,
    log_level: str,
) -> list[str]:
    """The smg command line that serves the OpenAI API in front of one SglangScheduler worker."""
    return [
        smg,
        "launch",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        worker_url,
        "--model-path",
        str(model_dir),  # tokenizer.json + tokenizer_config.json (chat template) are read from here
        "--backend",
        "sglang",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        {"WARNING": "warn"}.get(log_level, log_level.lower()),
        # In-flight HTTP requests get this long to finish on SIGTERM (smg's default is 180 s).
        "--shutdown-grace-period-secs",
        "5",
    ]


def gateway(args: argparse.Namespace) -> int:
    """Replace this process with smg, configured for one scheduler."""
    if args.metrics_port < 1:
        raise SystemExit("ordinal gateway: --metrics-port must be >= 1 (smg always serves metrics)")
    argv = smg_argv(
        find_smg(),
        host=args.host,
        port=args.port,
        worker_url=args.worker_url,
        model_dir=model_folder(args.model),
        metrics_port=args.metrics_port,
        log_level=args.log_level,
    )
    sys.stdout.flush()
    os.execv(argv[0], argv)
