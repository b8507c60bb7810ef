"""Input saved by Hugging Face `datasets` (`save_to_disk`): one split's folder of Arrow stream files."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads

from batchprefill.errors import JobError
from batchprefill.io.arrow_datasets import ArrowDataset
from batchprefill.io.input_format import InputFormat
from batchprefill.io.own_files import UNREADABLE

ARROW_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an Arrow IPC stream's end-of-stream marker


class SavedDatasetFormat(InputFormat):
    name = "datasets"

    def find(self, path: str) -> list[Path]:
        folder = Path(path)
        if (folder / "dataset_dict.json").exists():
            splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
            raise JobError(f"data.input {path} holds a DatasetDict (splits: {', '.join(splits)}): point data.input "
                           "at one split's folder")
        files = sorted(folder.glob("data-*.arrow")) or sorted(folder.glob("*.arrow"))
        if not (folder / "dataset_info.json").exists() or not files:
            raise JobError(f"data.input {path} is not a folder saved by datasets' save_to_disk")
        return files

    def check(self, files: list[Path]) -> None:
        """Each Arrow file is read through a memory map, which leaves its data pages alone (0.02 s for a 512 MB
        file in the page cache): a truncated or foreign file is named before anything runs."""
        for file in files:
            reason = _arrow_fault(file)
            if reason is not None:
                raise JobError(f"data.input: {file} {reason}; save the dataset again")

    def open(self, files: list[Path]) -> ArrowDataset:
        return ArrowDataset(pads.dataset([pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files]))


def _arrow_fault(file: Path) -> str | None:
    try:
        with pa.memory_map(str(file)) as source:
            pa.ipc.open_stream(source).read_all()
            source.seek(max(source.size() - len(ARROW_END), 0))
            if source.read() != ARROW_END:  # a stream cut between two messages reads as complete
                return "is cut short: its Arrow stream has no end marker"
    except UNREADABLE as error:
        return f"is not a readable Arrow stream as datasets' save_to_disk writes ({error})"
    return None
