"""``imgtrain doctor``: is this machine (or this cluster) ready to train, and if not, why.

Each check gives one line: ``ok``, ``info`` (worth knowing, not a problem) or ``FAIL``. The
verdict is "ready" when nothing failed. Nothing here waits long: an unreachable cluster is
found with a 5-second TCP connect, and the per-node storage probe gives up after a minute.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from imgtrain.errors import ImgtrainError
from imgtrain.ops import process
from imgtrain.ops.files import write_problem
from imgtrain.storage.runs import package_version

OK, INFO, FAIL = "ok", "info", "FAIL"
LOW_DISK_BYTES = 2 << 30  # a ResNet-18 checkpoint with its optimizer state is about 170 MB


@dataclass
class Check:
    status: str
    name: str
    detail: str
    lines: list[str] = field(default_factory=list)  # more detail, indented under the check


@dataclass
class Diagnosis:
    checks: list[Check]

    @property
    def ready(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    @property
    def verdict(self) -> str:
        failed = [c.name for c in self.checks if c.status == FAIL]
        return "ready to train" if not failed else f"not ready: {len(failed)} problem(s) ({', '.join(failed)})"

    def to_json(self) -> dict:
        return {"version": package_version("imgtrain"), "ready": self.ready, "verdict": self.verdict,
                "checks": [asdict(c) for c in self.checks]}


def diagnose(storage: str, address: str | None, data: str | None) -> Diagnosis:
    """The checks of ``imgtrain doctor`` (its options: ``cli.doctor_cmd``)."""
    from imgtrain.ops.remote import is_remote
    from imgtrain.storage.location import storage_root

    checks = [_versions(), _extras(), _cuda()]
    if is_remote(storage):
        return Diagnosis(checks + _object_store(storage, address, data))
    try:
        root = storage_root(storage)
    except ImgtrainError as e:
        return Diagnosis(checks + [Check(FAIL, "storage", str(e))])
    created = [p for p in (root, *root.parents) if not p.exists()]  # removed again at the end
    try:
        checks.append(_storage(root))
        if checks[-1].status == FAIL:
            root = None  # no point asking the nodes about it
        if data:
            checks.append(_data(data))
        checks += _cluster(address or os.environ.get("RAY_ADDRESS") or None, root, data)
    finally:
        for p in created:  # the deepest first
            with contextlib.suppress(OSError):
                p.rmdir()
    return Diagnosis(checks)


def _object_store(storage: str, address: str | None, data: str | None) -> list[Check]:
    """--storage s3://...: reachable and writable from here, and from every node of the cluster."""
    from imgtrain.ops import remote
    from imgtrain.storage import location

    try:
        st = location.store(storage)
        remote.probe(st)
    except ImgtrainError as e:
        return [Check(FAIL, "storage", str(e))]
    checks = [Check(OK, "storage", f"{st.uri}: reachable and writable from this machine (working copies in {st.local})")]
    if data:
        checks.append(_data(data))
    import ray._private.services as services

    from imgtrain import cluster

    address = address or os.environ.get("RAY_ADDRESS") or None
    running = sorted(services.find_gcs_addresses())
    if not address and len(running) != 1:  # says that none runs here, or that several do
        return checks + _cluster(None, None, None)
    address = address or running[0]

    with process.loggers_to(Path(os.devnull), cluster.RAY_LOGGERS):
        try:
            joined = cluster.start_or_join(address, 0)
        except ImgtrainError as e:
            return checks + [Check(FAIL, "cluster", str(e))]
        try:
            import ray

            nodes = [n for n in ray.nodes() if n.get("Alive")]
            problems = cluster.check_store_from_nodes(storage)
        finally:
            cluster.shutdown(joined)
    return checks + [Check(FAIL, "storage from every node", f"not every node can use {st.uri}", problems)
                     if problems else Check(OK, "storage from every node",
                                            f"every node ({len(nodes)}) writes, reads and deletes in {st.uri}")]


def _versions() -> Check:
    import torch

    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    versions = ", ".join(f"{p} {package_version(p) or 'missing'}" for p in ("torchvision", "ray"))
    return Check(OK, "versions", f"imgtrain {package_version('imgtrain')}, Python {platform.python_version()} "
                 f"({sys.executable}), torch {torch.__version__} ({build}), {versions}")


def _extras() -> Check:
    from imgtrain.training.tracking import registered

    found, missing = [], []
    for tracker in (t for t in registered() if t.packages):  # those that need an extra
        versions = [f"{p} {package_version(p)}" for p in tracker.packages if package_version(p)]
        found += versions
        if not versions:
            missing.append(tracker)
    detail = ", ".join(found) or "none"
    if missing:
        detail += (f" (for {' / '.join(t.flag for t in missing)}: pip install "
                   f"{' '.join(repr(f'imgtrain[{t.extra}]') for t in missing)})")
    return Check(INFO, "tracking extras", detail)


def _cuda() -> Check:
    import torch

    if not torch.cuda.is_available():
        return Check(INFO, "CUDA", "no GPU visible to PyTorch on this machine: CPU training only here (--gpu needs one)")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    bf16 = "yes" if torch.cuda.is_bf16_supported() else "no"
    return Check(OK, "CUDA", f"{len(names)} GPU(s): {', '.join(names)}; bfloat16 (--precision bf16): {bf16}")


def _storage(root: Path) -> Check:
    """Writable (``diagnose`` removes the folders created here), with room for checkpoints."""
    problem = write_problem(root)
    if problem:
        return Check(FAIL, "storage", f"{root} is not writable ({problem}); choose another --storage")
    free = shutil.disk_usage(root).free
    status = OK if free >= LOW_DISK_BYTES else FAIL
    note = "" if status == OK else " (less than 2 GiB: checkpoints may not fit)"
    return Check(status, "storage", f"{root}: writable, {free / 2**30:.1f} GiB free{note}")


def _data(data: str) -> Check:
    from imgtrain.data.format import describe, verify_dataset
    from imgtrain.ops.remote import is_remote
    from imgtrain.data.staging import local_data

    try:  # a data set in an object store is copied to this machine's cache, as training does
        manifest = verify_dataset(local_data(data), check_hashes=False)
    except ImgtrainError as e:
        return Check(FAIL, "data", str(e))
    return Check(OK, "data", f"{data if is_remote(data) else Path(data).resolve()}: {describe(manifest).splitlines()[0]}")


def _cluster(address: str | None, root: Path | None, data: str | None) -> list[Check]:
    import ray._private.services as services

    if not address:
        running = sorted(services.find_gcs_addresses())
        if len(running) != 1:
            detail = ("no Ray cluster running here: `imgtrain train` starts a private one "
                      f"({os.cpu_count()} cores), or pass --address to check a cluster" if not running else
                      f"{len(running)} Ray clusters run here ({', '.join(running)}): pass --address to choose one")
            return [Check(INFO, "cluster", detail)]
        address = running[0]
    return _joined_cluster(address, root, data)


def _joined_cluster(address: str, root: Path | None, data: str | None) -> list[Check]:
    """Nodes and resources; whether every node sees the storage (and data set) as this one does."""
    from imgtrain import cluster

    with process.loggers_to(Path(os.devnull), cluster.RAY_LOGGERS):  # a verdict, not Ray's log lines
        try:
            joined = cluster.start_or_join(address, 0)
        except ImgtrainError as e:
            return [Check(FAIL, "cluster", str(e))]
        try:
            return _cluster_checks(address, root, data)
        finally:
            cluster.shutdown(joined)


def _cluster_checks(address: str, root: Path | None, data: str | None) -> list[Check]:
    import ray

    from imgtrain import cluster

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    lines = [_node_line(n) for n in nodes]
    checks = [Check(OK, "cluster", f"{address}: {len(nodes)} node(s) alive, {total.get('CPU', 0):g} CPUs, "
                    f"{total.get('GPU', 0):g} GPUs, {total.get('memory', 0) / 2**30:.1f} GiB memory", lines)]
    if root is not None:
        manifest = [str(Path(data).resolve() / "manifest.json")] if data else []
        problems = cluster.check_shared_paths(root, manifest)
        what = "storage" + (" and data" if data else "")
        checks.append(Check(FAIL, "shared storage", f"{what} not shared by every node", problems) if problems
                      else Check(OK, "shared storage", f"every node ({len(nodes)}) sees and writes {root}"
                                 + (" and reads the data set" if data else "")))
    return checks


def _node_line(node: dict) -> str:
    r = node["Resources"]
    head = " (head)" if "node:__internal_head__" in r else ""
    return (f"{node['NodeManagerAddress']}{head} {node['NodeID'][:8]}: {r.get('CPU', 0):g} CPUs, "
            f"{r.get('GPU', 0):g} GPUs, {r.get('memory', 0) / 2**30:.1f} GiB")
