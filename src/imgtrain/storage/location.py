"""Where a run lives: the folder runs live in (``--storage``: a local folder, or this machine's
working copy of a bucket's prefix), a run's folder in it, the run's location as its user names it
(a path, or the bucket's URI), the working copy brought down before it is read (``fetch``), and
the folder where each rank stages its checkpoints before they go into the run.

A location in an object store itself (its filesystem, this machine's cache, keys turned into
local paths, objects copied down) is ``ops.remote``: data sets and webdataset shards in a
bucket use it too.
"""

from __future__ import annotations

from pathlib import Path

from imgtrain.errors import ImgtrainError
from imgtrain.ops.remote import Store, cache_dir, cache_root, check_plain_s3, is_remote, split
from imgtrain.storage import mirror, ownership


def store(storage: str) -> Store:
    """The object store ``storage`` names (``--storage s3://bucket/prefix``): its filesystem, its
    root there, and this machine's working copy of its runs."""
    uri = storage.rstrip("/")
    scheme, _, rest = uri.partition("://")
    if not rest.strip("/"):
        raise ImgtrainError(f"--storage {storage}: name a bucket, e.g. {scheme}://my-bucket/runs")
    check_plain_s3(uri)
    _, root = split(uri)  # an unknown scheme or a missing client library: said now
    # the cache keeps the account of abfs://container@account/... (two accounts, two copies)
    return Store(uri=uri, root=root, local=cache_dir("stores", uri, rest.partition("?")[0]))


def storage_root(storage: str) -> Path:
    """The folder runs live in: the storage itself, or the working copy of an object store."""
    if is_remote(storage):
        return store(storage).local
    return Path(storage.removeprefix("file://")).expanduser().resolve()


def run_path(storage: str, name: str) -> Path:
    return storage_root(storage) / ownership.check_name(name)  # one folder inside the storage, never outside


def fetch(storage: str, name: str, checkpoints: bool = True) -> Path:
    """``run_path``, with a run in an object store brought down into the working copy first:
    whole, or without the checkpoints' weights. A run that a process on this machine trains is
    read as that process has it."""
    if is_remote(storage):
        return mirror.pull(store(storage), name, checkpoints=checkpoints)
    return run_path(storage, name)


def location(storage: str, name: str) -> str:
    """Where the run lives, as a user names it: a path, or the object store's URI."""
    return store(storage).run_uri(name) if is_remote(storage) else str(run_path(storage, name))


def checkpoint_staging(run_location: str, rank: int) -> Path:
    """Where rank ``rank`` of the run at ``run_location`` writes its checkpoints before they go
    into the run, on its node: save()'s folder, and for an object store the files waiting for
    Ray's upload (Ray deletes one once uploaded; one whose upload failed, the store out of
    reach, fails the attempt with it). What a rank leaves when it dies (SIGKILLed by a fault or
    by Ray stopping its worker group in the middle of a save: 180 MB each for a ResNet-18) is
    cleared by the rank's next attempt on this node and by the driver's end. In the user's own
    cache, not a shared /tmp where another user could put a link in its way."""
    import hashlib

    return cache_root() / "staging" / hashlib.sha256(run_location.encode()).hexdigest()[:16] / f"rank-{rank}"
