"""Zero-copy views of safetensors files.

The file is memory-mapped copy-on-write and each tensor is a torch view of the
mapping, so loading a float32 checkpoint onto the CPU reads pages lazily and
never holds a second copy of the weights.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from engine.model.errors import CheckpointError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,  # fp8 checkpoints' weights
}
_SAMPLE_EVERY = 64 << 20  # bytes between fingerprint samples of the weight data
_SAMPLE_BYTES = 64 << 10


@dataclass
class SafetensorsFile:
    path: Path
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    digest: bytes = b""
    _map: mmap.mmap | None = None


def open_safetensors(path: Path) -> SafetensorsFile:
    try:
        with path.open("rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path}: truncated safetensors file")
            (header_len,) = struct.unpack("<Q", raw_len)
            header_bytes = fh.read(header_len)
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from exc
    try:
        header = json.loads(header_bytes)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON") from exc
    base = 8 + header_len
    result = SafetensorsFile(path=path, _map=mapped)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = end - begin
        if count == 0:
            result.tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=dtype, count=count // dtype.itemsize, offset=base + begin)
        result.tensors[name] = flat.view(shape)
    digest = xxhash.xxh3_128(header_bytes)
    for offset in range(base, len(mapped), _SAMPLE_EVERY):
        digest.update(mapped[offset : offset + _SAMPLE_BYTES])
    result.digest = digest.digest()
    return result


def open_checkpoint_weights(checkpoint: Path) -> tuple[dict[str, torch.Tensor], bytes, list[SafetensorsFile]]:
    """All tensors of a checkpoint (sharded or not) by name, plus a weight-identity digest."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: expected a JSON object with 'weight_map'") from exc
        shard_names = sorted(set(weight_map.values()))
    else:
        shard_names = sorted(p.name for p in checkpoint.glob("*.safetensors"))
        if not shard_names:
            raise CheckpointError(f"{checkpoint}: no *.safetensors weights found")
    files: list[SafetensorsFile] = []
    tensors: dict[str, torch.Tensor] = {}
    digest = xxhash.xxh3_128()
    for name in shard_names:
        shard_path = checkpoint / name
        if not shard_path.is_file():
            held = sorted(t for t, shard in weight_map.items() if shard == name)
            more = f" and {len(held) - 1} more" if len(held) > 1 else ""
            raise CheckpointError(f"{index}: shard {name} is listed but missing (it holds {held[0]!r}{more})")
        shard = open_safetensors(shard_path)
        files.append(shard)
        digest.update(shard.digest)
        for tensor_name, tensor in shard.tensors.items():
            if tensor_name in tensors:
                raise CheckpointError(f"{shard_path}: tensor {tensor_name!r} appears in more than one shard")
            tensors[tensor_name] = tensor
    return tensors, digest.digest(), files
