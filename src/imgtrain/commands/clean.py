"""``imgtrain clean``: delete runs or prepared data sets (the tutorials' clean-up cell, made safe).

Only what imgtrain made is ever deleted:
  * a run: a real directory (not a link) directly inside the storage root that imgtrain
    marked as a run (``storage/ownership.py``); never one that a live process is training: the run's
    lock is taken and its status read again just before deleting. A status left "running" by
    a driver on another host that is gone can be overridden with ``--force``.
  * a data set: its ``manifest.json``, the Parquet files the manifest lists and its
    ``dedupe.csv`` (``--dedupe``) and the teachers' logits distillation cached beside it
    (``.teacher-logits/*.npy``, older versions' ``.npz``, a writer's ``.tmp``), then the folders
    they leave empty. Any other file in the folder stays where it is.
Links inside a run (``logs/ray`` points at Ray's session logs) are removed as links, never
followed, so nothing outside the run's own directory is touched. A run in an object store
(``--storage s3://...``) is judged on its working copy, then deleted there and in the store.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from imgtrain.errors import ImgtrainError
from imgtrain.ops import remote
from imgtrain.storage import location, mirror, ownership, runs


@dataclass
class Removal:
    """One run or data set to delete: what goes, its size, and what stays behind."""

    kind: str  # "run" or "data set"
    path: Path
    files: list[Path] = field(default_factory=list)  # data set: the files imgtrain wrote
    size: int = 0
    kept: list[Path] = field(default_factory=list)  # data set: files in its folder imgtrain did not write
    force: bool = False  # run: delete even if another host's driver is recorded as training it
    store: str | None = None  # run: the object store it lives in (``--storage s3://...``)

    def describe(self) -> str:
        kept = f"; keeps {len(self.kept)} file(s) imgtrain did not write" if self.kept else ""
        where = location.store(self.store).run_uri(self.path.name) if self.store else self.path
        return f"{self.kind} {where} ({self.size / 2**20:,.1f} MiB){kept}"


def plan_runs(storage: str, names: list[str], everything: bool = False, force: bool = False) -> list[Removal]:
    """The runs to delete: those named, or with ``everything`` every run in ``storage``.
    ``force``: also runs whose status says another host's driver is training them."""
    for name in names:  # before anything is read or deleted
        ownership.check_name(name)
    root = location.storage_root(storage)
    store = location.store(storage) if remote.is_remote(storage) else None
    if store:  # the working copy of every run's small files, to be judged as local runs are
        runs.list_runs(storage)
    if everything:
        if names:
            raise ImgtrainError("name runs or pass --all, not both")
        found = sorted(d for d in root.iterdir() if _is_run(d)) if root.is_dir() else []
    else:
        if not names:
            raise ImgtrainError("name the runs to delete (imgtrain runs list shows them), or pass --all")
        found = []
        for name in names:
            if not _is_run(root / name):
                known = ", ".join(sorted(d.name for d in root.iterdir() if _is_run(d))) if root.is_dir() else ""
                raise ImgtrainError(f"no run named {name!r} in {root} (runs there: {known or 'none'}); nothing deleted")
            found.append(root / name)
    for run_dir in found:
        _refuse_if_running(run_dir, force)
    if store:
        return [Removal("run", d, size=sum(size for size, _ in mirror.remote_files(store, d.name).values()),
                        force=force, store=storage) for d in found]
    return [Removal("run", d, size=_tree_size(d), force=force) for d in found]


def _refuse_if_running(run_dir: Path, force: bool, locked: bool = False) -> None:
    """``locked``: this process holds the run's lock, so no driver of this host trains it."""
    hint = "stop it first" if not force else "stop it first (--force is for a driver on another host that is gone)"
    if runs.read_status(run_dir).get("host") != socket.gethostname():
        hint = "if that driver is gone, pass --force"
    runs.refuse_if_trained(run_dir, hint=hint + "; nothing deleted", this_host=not locked, other_hosts=not force)


def plan_dataset(data_dir: str | Path) -> Removal:
    """A prepared data set: its manifest and the files the manifest lists, nothing else."""
    from imgtrain.data.format import MANIFEST, load_manifest, side_files, split_files
    from imgtrain.training import teacher_cache

    data_dir = Path(data_dir).absolute()
    if data_dir.is_symlink() or not data_dir.is_dir():
        raise ImgtrainError(f"{data_dir} is not a data set directory; nothing deleted")
    manifest = load_manifest(data_dir)  # refuses a folder imgtrain did not prepare
    files = [data_dir / MANIFEST] + [p for s in manifest["splits"] for p in split_files(data_dir, manifest, s) if p.is_file()]
    files += [data_dir / name for name in side_files(manifest) if (data_dir / name).is_file()]
    cached = data_dir / teacher_cache.FOLDER  # the teachers' logits distillation cached beside it: imgtrain's
    if cached.is_dir():
        files += sorted(p for p in cached.iterdir()
                        if p.suffix in teacher_cache.SUFFIXES and p.is_file() and not p.is_symlink())
    inside = data_dir.resolve()
    for path in files:  # a linked split folder would make us delete what lies elsewhere
        if inside not in path.resolve().parents:
            raise ImgtrainError(f"{path} lies outside the data set {data_dir} (through a symbolic link); "
                                "nothing deleted")
    ours = set(files)
    kept = sorted(p for p in data_dir.rglob("*") if (p.is_file() or p.is_symlink()) and p not in ours)
    return Removal("data set", data_dir, files=files, size=sum(p.lstat().st_size for p in files), kept=kept)


def remove(removal: Removal) -> None:
    if removal.kind == "run":
        if not _is_run(removal.path):  # checked again: it may have changed since the plan
            raise ImgtrainError(f"{removal.path} is no longer an imgtrain run; not deleting it")
        store = location.store(removal.store) if removal.store else None
        # a run in an object store: locked in its turn, as a driver locks it (mirror.turn)
        with mirror.turn(store, removal.path.name) if store else contextlib.nullcontext(), \
                ownership.locked(removal.path, "deleted"):  # a driver that started since: refused
            _refuse_if_running(removal.path, removal.force, locked=True)
            if store:  # the store first: a working copy left behind is only a cache
                mirror.delete(store, removal.path.name)
            shutil.rmtree(removal.path)  # removes links inside as links, never what they point to
        return
    for path in removal.files:
        path.unlink(missing_ok=True)
    folders = sorted({p.parent for p in removal.files}, key=lambda p: len(p.parts), reverse=True)
    for folder in folders:  # the split folders, then the data set folder, if nothing else is left
        if folder == removal.path or removal.path in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty: something imgtrain did not write lives there
                pass


def _is_run(path: Path) -> bool:
    return ownership.is_run(path)


def _tree_size(path: Path) -> int:
    total = 0
    for folder, _, names in os.walk(path):  # does not descend into linked folders
        total += sum(os.lstat(os.path.join(folder, n)).st_size for n in names)
    return total
