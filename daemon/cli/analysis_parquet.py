"""`facecast analyze`'s Parquet tables (issue 23: "CSV always; Parquet when pyarrow is installed"),
in the analyze process.

Note [Parquet from the finished CSV]
    The CSV is the table `facecast analyze` writes as it goes: appended row by row, cut back to
    a resume point's length on a re-run (Note [Resume points] in video_analysis). Parquet has
    no such append, so `<name>.faces.parquet` is made from the CSV once the file is finished,
    with the same columns in the same order, typed: `frame` int64, `pts_s` and
    `capture_ts_lsl` float64 (the capture time's text carries every digit of the double, Note
    [Container timestamps]), `problem` and `participant` strings ("" when fine or unknown, as
    in the CSV), `track_id` int32,
    every other channel float32, the Face streams' own type (the CSV holds each as the shortest
    text that reads back to the same float32, so nothing is lost); an empty number is null. A re-run that finds a finished
    file without its Parquet table (made before pyarrow was installed) makes it from the CSV.
    pyarrow is an optional extra (`pip install 'facecast[analyze]'`): imported only here, only
    when a Parquet table is asked for.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from facecast.shared import private_files

INSTALL_HINT = "pip install 'facecast[analyze]' (or pip install pyarrow)"


def pyarrow_problem() -> str:
    """Why Parquet tables cannot be written here ("" when they can)."""
    try:
        import pyarrow  # noqa: F401
        import pyarrow.csv  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        return f"Parquet tables need pyarrow, which is not installed ({exc}): {INSTALL_HINT}"
    return ""


def column_types(columns: Sequence[str]) -> dict:
    """Each column's Arrow type (Note [Parquet from the finished CSV])."""
    import pyarrow as pa

    special = {"frame": pa.int64(), "pts_s": pa.float64(), "capture_ts_lsl": pa.float64(),
               "problem": pa.string(), "track_id": pa.int32(), "participant": pa.string()}
    return {name: special.get(name, pa.float32()) for name in columns}


def write_from_csv(csv_path: Path, parquet_path: Path, columns: Sequence[str]) -> int:
    """`parquet_path` made from the finished table `csv_path` (its header must be `columns`),
    atomically and 0600 like the CSV; the rows written."""
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    types = column_types(columns)
    table = pa_csv.read_csv(
        csv_path,
        read_options=pa_csv.ReadOptions(use_threads=False),
        convert_options=pa_csv.ConvertOptions(
            column_types=types, include_columns=list(columns), null_values=[""],
            strings_can_be_null=False))
    if table.column_names != list(columns):
        raise ValueError(f"{csv_path}: columns {table.column_names[:6]}... are not the table's")
    # Written beside it under a temporary name, then renamed: a reader never sees half a file.
    temporary = parquet_path.with_name(f".{parquet_path.name}.{os.getpid()}.partial")
    try:
        with private_files.open_private(temporary) as handle:
            pq.write_table(table, handle, compression="zstd")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, parquet_path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return table.num_rows
