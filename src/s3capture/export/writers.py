"""Shard data files: the Parquet schema and writer (row groups bounded in rows and bytes; one
``token_ids`` type per export) and the Gym JSONL writer (``gym_dict``), each writing a temp file
that the destination publishes atomically."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

import msgspec

from s3capture.export.destinations import _Destination
from s3capture.export.records import ExportJob

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1

# The metrics NeMo Gym's consumer reports that are scalars, as typed columns (``metric_<name>``);
# every metric (nested ones too) is also in the ``metrics`` JSON column.
METRIC_COLUMNS: dict[str, str] = {
    "chains": "int",
    "roots": "int",
    "quarantined_calls": "int",
    "quarantined_fraction": "float",
    "delivered_fraction": "float",
    "generated_tokens_captured": "int",
    "generated_tokens_delivered": "int",
    "unresolved_parent_calls": "int",
    "empty_generation_calls": "int",
    "capture_incomplete": "bool",
}


def parquet_schema(token_type: str = "int32") -> Any:
    """The Parquet schema of an export: one row per trajectory (``docs/export.md``).

    ``token_type`` is ``"int32"`` or ``"int64"`` (the ``token_ids`` element type). Needs pyarrow
    (``pip install 's3capture[parquet]'``).
    """
    import pyarrow as pa

    ids = pa.int64() if token_type == "int64" else pa.int32()
    metric_types = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}
    fields = [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("chain_id", pa.string(), nullable=False),
        pa.field("snapshot_id", pa.string(), nullable=False),
        pa.field("version", pa.int64(), nullable=False),
        pa.field("token_ids", pa.list_(ids), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("call_ids", pa.list_(pa.string()), nullable=False),
        pa.field("num_calls", pa.int32(), nullable=False),
        pa.field("masked", pa.bool_(), nullable=False),
        pa.field("mask_reasons", pa.list_(pa.string()), nullable=False),
    ]
    fields += [pa.field(f"metric_{name}", metric_types[kind]) for name, kind in METRIC_COLUMNS.items()]
    fields.append(pa.field("metrics", pa.string(), nullable=False))
    return pa.schema(fields, metadata={b"s3capture.export": b"1"})


def _metric_value(metrics: dict, name: str, kind: str) -> Any:
    value = metrics.get(name)
    if value is None or isinstance(value, (dict, list, str)):
        return None
    if kind == "bool":
        return bool(value)
    if kind == "int":
        return int(value) if not isinstance(value, float) or value.is_integer() else None
    return float(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "value"):  # enums
        return value.value
    return str(value)


_json_encoder = msgspec.json.Encoder(enc_hook=_json_default, order="sorted")


def _metrics_json(metrics: dict) -> str:
    return _json_encoder.encode(metrics).decode()


class _Built(msgspec.Struct, kw_only=True):
    """One rollout read and built, as a shard consumes it."""

    info: Any
    snapshot_id: str = ""
    version: int = 0
    sealed: bool = True
    build: Any = None
    masked: bool = False
    reasons: list[str] = []
    skipped: str = ""
    failed: str = ""


class _Writer:
    """Rows of one shard into a temp file, then published atomically."""

    def __init__(self, job: ExportJob, dest: _Destination, shard: int) -> None:
        self.job = job
        self.dest = dest
        self.name = job.shard_name(shard)
        self.temp = dest.temp_path(self.name)
        self.rows = 0
        self.clipped = 0
        """Log probabilities of the last ``add`` written as the column type's nearest finite value
        (Parquet's float32 column: finite values beyond about ±3.4e38)."""

    def add(self, built: _Built) -> tuple[int, int]:
        """Write one built rollout; ``(rows, tokens)`` written (``clipped`` says how many of its log
        probabilities were clipped). ``OverflowError`` for a token id that the export's column type
        does not hold (int32 under ``token_type="auto"``, int64 under ``"int64"``): nothing of that
        rollout is written then."""
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    async def publish(self) -> tuple[str | None, int]:
        """Close and publish the data file; ``(name, bytes)``, or ``(None, 0)`` without a row."""
        self.finish()
        if not self.rows:
            self.discard()
            return None, 0
        return self.name, await self.dest.publish(self.name, self.temp)

    def discard(self) -> None:
        try:
            self.finish()
        except Exception:  # noqa: BLE001 - discarding after a failure
            pass
        try:
            os.unlink(self.temp)
        except FileNotFoundError:
            pass


def _trajectory_rows(built: _Built) -> list[dict]:
    build = built.build
    metrics = dict(getattr(build, "metrics", None) or {})
    common = {
        "rollout_id": built.info.rollout_id,
        "snapshot_id": built.snapshot_id,
        "version": built.version,
        "masked": built.masked,
        "mask_reasons": list(built.reasons) if built.masked else [],
        "metrics": _metrics_json(metrics),
    }
    for name, kind in METRIC_COLUMNS.items():
        common[f"metric_{name}"] = _metric_value(metrics, name, kind)
    rows = []
    for t in build.trajectories or ():
        aligned = len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
        rows.append(
            dict(
                common,
                chain_id=t.chain_id,
                token_ids=t.token_ids if aligned else [],  # sequences, converted once by the writer
                loss_mask=t.loss_mask if aligned else [],
                logprobs=t.logprobs if aligned else [],
                call_ids=list(t.call_ids),
                num_calls=len(t.call_ids),
            )
        )
    if not rows:  # a masked rollout without a trajectory still leaves its evidence
        rows.append(dict(common, chain_id="", token_ids=[], loss_mask=[], logprobs=[], call_ids=[], num_calls=0))
    return rows


_LIST_COLUMNS = (("token_ids", "int64"), ("loss_mask", "int8"), ("logprobs", "float32"))
"""The token-aligned list columns and the numpy type each row's values are held in until written."""
_DICTIONARY_COLUMNS = ["rollout_id", "chain_id", "snapshot_id", "call_ids.list.element", "mask_reasons.list.element"]
"""Parquet columns worth dictionary encoding (repeated strings); token ids, masks and log-probabilities
are written plain (zstd compresses them; a dictionary of a 150k vocabulary only costs CPU)."""


_NUMPY_NAMES = {"int8": "int8", "int32": "int32", "int64": "int64", "float": "float32"}
"""numpy's name of a list column's Arrow element type, by the type's ``str`` (Arrow spells float32
"float"); ``to_pandas_dtype()`` would import pandas, half a second of CPU in every worker."""


class _ParquetWriter(_Writer):
    """Row groups of at most ``row_group_rows`` rows / ``row_group_bytes`` estimated bytes.

    ``token_ids`` is ``list<int32>`` in every shard of an export with ``token_type="auto"`` and
    ``list<int64>`` with ``"int64"``: one schema per export, never chosen per shard.

    Each row's token ids, loss mask and log-probabilities are converted once, when the rollout is
    added, into numpy arrays (which also finds the largest id without a Python loop); a row group's
    list columns are then one concatenation each, handed to Arrow without a per-element step."""

    def __init__(self, job: ExportJob, dest: _Destination, shard: int) -> None:
        import numpy  # noqa: F401 - the writer's arrays; with pyarrow, the parquet extra
        import pyarrow  # noqa: F401 - fail here, before any read, when the extra is missing

        super().__init__(job, dest, shard)
        self.token_type = "int64" if job.token_type == "int64" else "int32"
        self.buffer: list[dict] = []
        self.buffered_bytes = 0
        self.writer: Any = None

    def _open(self) -> Any:
        import pyarrow.parquet as pq

        if self.writer is None:
            self.writer = pq.ParquetWriter(
                self.temp, parquet_schema(self.token_type), compression="zstd", use_dictionary=_DICTIONARY_COLUMNS
            )
        return self.writer

    def add(self, built: _Built) -> tuple[int, int]:
        import numpy as np

        rows = _trajectory_rows(built)
        highest = 0
        self.clipped = 0
        for row in rows:
            n = len(row["token_ids"])
            logprobs = row["logprobs"]
            for name, kind in _LIST_COLUMNS:
                try:
                    with np.errstate(over="ignore"):
                        row[name] = np.fromiter(row[name], dtype=kind, count=n)
                except OverflowError:
                    raise OverflowError(
                        f"a token id of {built.info.rollout_id} does not fit a signed 64-bit integer, the widest "
                        "Parquet token_ids type (ids of 2**63 and above): export it with --format gym-jsonl"
                    ) from None
            if not np.isfinite(row["logprobs"]).all():
                # put refuses non-finite log-probabilities; one that is finite but beyond float32's
                # range (below about -3.4e38) is written as float32's lowest finite value, not -inf.
                # Counted (``ExportSummary.logprobs_clipped``): the training data differs there.
                lowest = np.finfo(np.float32).min
                wide = np.fromiter(logprobs, dtype="float64", count=n)
                self.clipped += int(np.count_nonzero((wide < lowest) | (wide > -lowest)))
                row["logprobs"] = np.clip(wide, lowest, -lowest).astype("float32")
            if n:
                highest = max(highest, int(row["token_ids"].max()))
        if highest > _INT32_MAX and self.token_type == "int32":
            # One schema per export: readers open the folder as one dataset (pyarrow.dataset, Ray
            # Data, pandas), which a shard of list<int64> among list<int32> ones would break.
            raise OverflowError(
                f"a token id of {built.info.rollout_id} ({highest}) does not fit int32, the token_ids type of "
                "every shard under --token-ids auto (token_type='auto'); re-run with --token-ids int64 (token_type='int64') into a new destination, so that "
                "every shard has the same schema"
            )
        tokens = 0
        for row in rows:
            # Row by row: a rollout of many trajectories (per_request, a long delta chain) fills
            # several row groups, never one over the bounds; a single row over row_group_bytes is a
            # row group of its own.
            n = len(row["token_ids"])
            size = 9 * n + 256
            if self.buffer and self.buffered_bytes + size > self.job.row_group_bytes:
                self._flush()
            tokens += n
            self.buffer.append(row)
            self.buffered_bytes += size
            if len(self.buffer) >= self.job.row_group_rows or self.buffered_bytes >= self.job.row_group_bytes:
                self._flush()
        self.rows += len(rows)
        return len(rows), tokens

    def _flush(self) -> None:
        if not self.buffer:
            return
        self._write(self.buffer)
        self.buffer = []
        self.buffered_bytes = 0

    def _write(self, rows: list[dict]) -> None:
        """One row group of ``rows``; two when its token count exceeds an Arrow list's 32-bit offsets."""
        import numpy as np
        import pyarrow as pa

        total = sum(len(row["token_ids"]) for row in rows)
        if total > _INT32_MAX and len(rows) > 1:
            self._write(rows[: len(rows) // 2])
            self._write(rows[len(rows) // 2 :])
            return
        schema = parquet_schema(self.token_type)
        arrays = []
        for field in schema:
            values = [row[field.name] for row in rows]
            if field.name not in dict(_LIST_COLUMNS):
                arrays.append(pa.array(values, type=field.type))
                continue
            offsets = np.zeros(len(values) + 1, dtype=np.int64)
            np.cumsum([len(v) for v in values], out=offsets[1:])
            flat = np.concatenate(values).astype(_NUMPY_NAMES[str(field.type.value_type)], copy=False)
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(flat)))
        self._open().write_table(pa.Table.from_arrays(arrays, schema=schema))

    def finish(self) -> None:
        if self.writer is None and self.rows:
            self._open()
        self._flush()
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def gym_dict(build: Any, *, snapshot_id: str, version: int, masked: bool, reasons: Sequence[str], builder: str) -> dict:
    """The dict NeMo Gym's ``trajectories_from_source`` returns for a rollout: ``build.gym_result``
    when Gym's builder ran, else an equivalent built from the built-in builder's trajectories
    (``rebuilt_response.output`` holds token-only items, one per generated run, as Gym's projection
    makes for calls without content items). ``mask_sample`` is True whenever ``masked`` is;
    ``_capture_snapshot`` names the snapshot and ``_s3capture`` the mask reasons."""
    result = getattr(build, "gym_result", None)
    if result is not None:
        out = dict(result)
    else:
        trajectories = list(build.trajectories or ())
        main = next((t for t in trajectories if t.chain_id == "main"), trajectories[0] if trajectories else None)
        response = None
        if main is not None:
            items: list[dict] = []
            n = len(main.token_ids)
            position = 0
            while position < n:
                if main.loss_mask[position]:
                    end = position
                    while end < n and main.loss_mask[end]:
                        end += 1
                    items.append(
                        {
                            "type": "message",
                            "prompt_token_ids": list(main.token_ids[:position]),
                            "generation_token_ids": list(main.token_ids[position:end]),
                            "generation_log_probs": [float(x) for x in main.logprobs[position:end]],
                        }
                    )
                    position = end
                else:
                    position += 1
            response = {
                "id": f"proj-{build.rollout_id}",
                "model": "",
                "object": "response",
                "output": items,
                "usage": {
                    "input_tokens": len(items[0]["prompt_token_ids"]) if items else 0,
                    "output_tokens": sum(len(i["generation_token_ids"]) for i in items),
                },
            }
        out = {
            "rollout_id": build.rollout_id,
            "builder": builder,
            "rebuilt_response": response,
            "metrics": dict(getattr(build, "metrics", None) or {}),
            "mask_sample": masked,
        }
    out["mask_sample"] = bool(out.get("mask_sample")) or masked
    out.setdefault("_capture_snapshot", {"snapshot_id": snapshot_id, "version": version})
    out["_s3capture"] = {"masked": masked, "mask_reasons": list(reasons) if masked else []}
    return out


class _JsonlWriter(_Writer):
    """One line per rollout: ``gym_dict`` (the dict Gym's consumer returns)."""

    def __init__(self, job: ExportJob, dest: _Destination, shard: int) -> None:
        super().__init__(job, dest, shard)
        self.handle: io.BufferedWriter | None = open(self.temp, "wb")

    def add(self, built: _Built) -> tuple[int, int]:
        assert self.handle is not None
        line = gym_dict(
            built.build,
            snapshot_id=built.snapshot_id,
            version=built.version,
            masked=built.masked,
            reasons=built.reasons,
            builder=self.job.builder,
        )
        self.handle.write(_json_encoder.encode(line) + b"\n")
        self.rows += 1
        tokens = sum(len(t.token_ids) for t in built.build.trajectories or ())
        return 1, tokens

    def finish(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def _open_writer(job: ExportJob, dest: _Destination, shard: int) -> _Writer:
    return _ParquetWriter(job, dest, shard) if job.format == "parquet" else _JsonlWriter(job, dest, shard)
