"""Check a Ling-3.0 -fp4 checkpoint directory against its config before weights load.

Reads only safetensors headers (a few KB per shard), so a missing shard, a missing
tensor, or a scale of the wrong dtype or shape is reported in seconds with the file
and tensor named, instead of surfacing deep inside vLLM's loader. No vLLM import.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from vllm_ling.models.checkpoint_format import TensorSpec, checkpoint_specs, stored_tensors
from vllm_ling.refusal import Refusal

INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {
    "BF16": "bfloat16", "F32": "float32", "F16": "float16", "F8_E4M3": "float8_e4m3fn",
    "U8": "uint8", "F8_E8M0": "float8_e8m0fnu", "I32": "int32", "I64": "int64", "BOOL": "bool",
}
# E8M0 scales may be stored as raw uint8 exponents or as float8_e8m0fnu.
_EQUIVALENT = {"float8_e8m0fnu": {"float8_e8m0fnu", "uint8"}}
MAX_LISTED = 12


class CheckpointFormatError(Refusal, ValueError):
    """The checkpoint does not match the Ling-3.0 -fp4 format its config declares."""


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (torch dtype name, shape) from a .safetensors header.

    Also checks that the file holds the data its header describes: a shard cut short
    (an interrupted download or copy) keeps an intact header, and safetensors then fails
    at load with "incomplete metadata, file not fully covered" and no file name."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise CheckpointFormatError(f"{path}: not a safetensors file (truncated header)")
        (n,) = struct.unpack("<Q", raw_len)
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointFormatError(f"{path}: unreadable safetensors header ({exc})") from None
    out = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = (_SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"]), tuple(info["shape"]))
        data_end = max(data_end, info["data_offsets"][1])
    size = path.stat().st_size
    expected = 8 + n + data_end
    if size != expected:
        what = "truncated" if size < expected else "longer than its header describes"
        raise CheckpointFormatError(
            f"{path}: shard is {what}: {size} bytes on disk, its header describes {expected} "
            f"(8 + {n} header + {data_end} data); download or copy it again")
    return out


def unreadable_paths(model_dir: Path) -> list[Path]:
    """Files (and folders) under ``model_dir`` this process cannot read: vLLM would otherwise
    fail on the first of them tens of seconds into the load, with a traceback."""
    bad: list[Path] = []
    if not os.access(model_dir, os.R_OK | os.X_OK):
        return [model_dir]
    for root, dirs, files in os.walk(model_dir, onerror=lambda exc: bad.append(Path(exc.filename))):
        for name in files:
            path = Path(root) / name
            if not os.access(path, os.R_OK):
                bad.append(path)
        bad += [Path(root) / d for d in dirs if not os.access(Path(root) / d, os.R_OK | os.X_OK)]
    return sorted(set(bad))


def checkpoint_tensors(model_dir: Path) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """name -> (shard file name, dtype, shape) for every tensor of the checkpoint."""
    index = model_dir / INDEX_FILE
    problems = []
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (model_dir / shard).exists():
                names = [n for n, s in weight_map.items() if s == shard]
                problems.append(f"{model_dir / shard}: shard listed in {INDEX_FILE} is missing "
                                f"({len(names)} tensors, e.g. {names[0]})")
        if problems:
            raise CheckpointFormatError("; ".join(problems))
    else:
        shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not shards:
            raise CheckpointFormatError(f"{model_dir}: no *.safetensors files and no {INDEX_FILE}")
    tensors = {}
    for shard in shards:
        for name, (dtype, shape) in read_safetensors_header(model_dir / shard).items():
            tensors[name] = (shard, dtype, shape)
    return tensors


def compare_with_specs(model_dir: Path, specs: list[TensorSpec], what: str = "checkpoint") -> list[str]:
    """Raise CheckpointFormatError naming each tensor of ``specs`` that is missing from the shards of
    ``model_dir`` or stored with another dtype or shape; return the shards' other tensor names."""
    found = checkpoint_tensors(model_dir)
    problems: list[str] = []
    expected_names: set[str] = set()
    for spec in specs:
        for name, shape, dtype in stored_tensors(spec):
            expected_names.add(name)
            if name not in found:
                problems.append(f"{name}: missing from the {what} in {model_dir}")
                continue
            shard, got_dtype, got_shape = found[name]
            if got_dtype not in _EQUIVALENT.get(dtype, {dtype}):
                problems.append(f"{model_dir / shard}: tensor {name} has dtype {got_dtype}, "
                                f"expected {dtype}")
            elif tuple(got_shape) != tuple(shape):
                problems.append(f"{model_dir / shard}: tensor {name} has shape {list(got_shape)}, "
                                f"expected {list(shape)}")
    if problems:
        shown = problems[:MAX_LISTED]
        more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
        raise CheckpointFormatError(
            f"{what} {model_dir} does not match its config.json "
            f"({len(problems)} problem(s)){more}:\n  " + "\n  ".join(shown))
    return sorted(n for n in found if n not in expected_names)


def check_checkpoint(model_dir: str | Path, config: dict[str, Any],
                     include_mtp: bool = False) -> list[str]:
    """Raise CheckpointFormatError naming each bad tensor; return unexpected tensor names."""
    model_dir = Path(model_dir)
    unexpected = compare_with_specs(model_dir, checkpoint_specs(config, include_mtp=include_mtp))
    n_target = config["num_hidden_layers"]
    mtp_prefixes = tuple(f"model.layers.{i}." for i in
                         range(n_target, n_target + config.get("num_nextn_predict_layers", 0)))
    return [n for n in unexpected if not (not include_mtp and n.startswith(mtp_prefixes))]
