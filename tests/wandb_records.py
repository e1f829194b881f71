"""What a wandb offline run recorded, read from its `run-<id>.wandb` file with no wandb API call: the file is a
LevelDB-style log (a 7-byte ':W&B' header, 32 KiB blocks, records of crc32 / length / type FULL, FIRST, MIDDLE,
LAST), each record a `wandb_internal_pb2.Record` protobuf. Only wandb's protobuf classes are used, to parse."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK_BYTES, RECORD_HEADER_BYTES = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", f"{path} is not a wandb log"
    pos, pending, out = 7, b"", []
    while pos + RECORD_HEADER_BYTES <= len(data):
        left = BLOCK_BYTES - pos % BLOCK_BYTES
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + RECORD_HEADER_BYTES])
        if left < RECORD_HEADER_BYTES or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        chunk = data[pos + RECORD_HEADER_BYTES:pos + RECORD_HEADER_BYTES + length]
        pos += RECORD_HEADER_BYTES + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def offline_run(folder: Path) -> dict:
    """The single offline run under `folder` (a wandb dir: folder/wandb/offline-run-*): its name, project,
    group, job type, tags and config (as wandb.config holds it: {key: value})."""
    runs = sorted(Path(folder).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, f"expected one offline run under {folder}, found {runs}"
    # wandb's service process may still be writing the file when run.finish() returns: wait for its exit record
    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in records(runs[0])) and time.monotonic() < deadline:
        time.sleep(0.2)
    out = {"config": {}}
    for record in records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out.update(name=run.display_name, project=run.project, group=run.run_group, job_type=run.job_type,
                       tags=list(run.tags))
            updates = run.config.update
        elif kind == "config":
            updates = record.config.update
        else:
            continue
        for item in updates:
            key = item.key or "/".join(item.nested_key)
            out["config"][key] = json.loads(item.value_json)
    return out
