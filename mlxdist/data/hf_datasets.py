"""`data.source=hf`: a Hugging Face `datasets` dataset, read into the same rows as JSONL.

`data.path` is a hub name (read from the local cache when offline), a directory written by
`Dataset.save_to_disk`, or a directory of data files (`load_dataset` reads .jsonl/.json/
.csv/.parquet). Rows keep JSONL's shapes (`text`, `prompt`+`completion`, `messages`), so
everything after reading (chat templates, masking, packing) is the JSONL path, unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The held-out split, in the order datasets name it; else data.eval_fraction of train.
EVAL_SPLITS = ("validation", "valid", "eval", "test")
_SHAPES = ({"text"}, {"prompt", "completion"}, {"messages"})


def read_hf(path: str) -> tuple[list[dict], list[dict] | None, str]:
    """(train rows, eval rows or None, where) for the dataset at `path`."""
    try:
        import datasets
    except ImportError:
        raise ValueError("data.source=hf needs the `datasets` package: pip install 'mlxdist[datasets]'") from None
    local = Path(path).expanduser()
    if path.startswith(("/", ".", "~")) and not local.exists():  # a path, not a hub name: no network
        raise ValueError(f"data.path: {path} does not exist")
    try:
        if (local / "dataset_info.json").exists() or (local / "dataset_dict.json").exists():
            loaded: Any = datasets.load_from_disk(str(local))
        else:
            loaded = datasets.load_dataset(str(local) if local.is_dir() else path)
    except FileNotFoundError as e:
        raise ValueError(f"data.path: {path}: {e}") from None
    except Exception as e:  # noqa: BLE001 - hub/network/format errors: one line naming the dataset
        raise ValueError(f"data.path: {path}: could not load it with datasets ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); offline, give a local directory") from None
    if isinstance(loaded, datasets.Dataset):
        return _rows(loaded, f"{path}"), None, path
    if "train" not in loaded:
        raise ValueError(f"data.path: {path} has splits {sorted(loaded)}, no 'train'")
    held_out = next((s for s in EVAL_SPLITS if s in loaded), None)
    eval_rows = _rows(loaded[held_out], f"{path}[{held_out}]") if held_out else None
    return _rows(loaded["train"], f"{path}[train]"), eval_rows, path


def _rows(split: Any, where: str) -> list[dict]:
    columns = set(split.column_names)
    shape = next((s for s in _SHAPES if s <= columns), None)
    if shape is None:
        raise ValueError(f"{where}: columns {sorted(columns)}; expected 'text', 'prompt'+'completion' or "
                         "'messages' (rename with Dataset.rename_column)")
    return [{k: row[k] for k in shape} for row in split.select_columns(sorted(shape))]
