"""Training configuration: one typed dataclass, defaults in code, flags only override.

The worker boundary is a plain dict (``dataclasses.asdict``) turned back into a
``TrainConfig`` at once on the other side (``TrainConfig(**d)``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from imgtrain.errors import ImgtrainError

BACKENDS = ("ray", "local")
INGESTS = ("ray-data", "torch")
OPTIMIZERS = ("adamw", "sgd")
PRECISIONS = ("fp32", "bf16")

# Fields that may change when an existing run is resumed; any other difference means a
# different experiment and is refused (issue 4 adds --overwrite).
RESUMABLE_FIELDS = (
    "epochs", "workers", "use_gpu", "address", "storage", "log_every_steps", "dashboard",
    "max_failures", "threads_per_worker", "cpus_per_worker", "limit_train_batches", "min_workers",
    "checkpoint_every_steps", "ledger", "stall_timeout_s", "deterministic", "compile", "data_on_device",
    "mlflow", "mlflow_experiment", "tensorboard",
)

# Names a config file may also use for a field: the CLI flag's name where it differs.
ALIASES = {"gpu": "use_gpu", "stall_timeout": "stall_timeout_s"}

# The range of every numeric field, in interval notation. Every float must also be finite (a
# NaN passes every comparison: stall_timeout = nan silently turned the watchdog off).
RANGES = {
    "workers": "[1, 10000]", "min_workers": "[0, 10000]", "cpus_per_worker": "(0, 1024]",
    "threads_per_worker": "[0, 1024]", "epochs": "[1, 100000]", "batch_size": "[1, 1048576]",
    "lr": "(0, 10]", "weight_decay": "[0, 10]", "warmup_fraction": "[0, 1)", "label_smoothing": "[0, 1)",
    "max_rotate_deg": "[0, 180]", "max_shift": "[0, 1]", "max_scale": "[0, 1)", "ema_decay": "[0, 1)",
    "seed": "[0, 4294967295]", "eval_batch_size": "[1, 1048576]", "log_every_steps": "[1, 1000000000]",
    "num_to_keep": "[1, 1000]", "max_failures": "[-1, 1000]", "checkpoint_every_steps": "[0, 1000000000]",
    "stall_timeout_s": "[0, 604800]", "limit_train_batches": "[0, 1000000000]",
}


@dataclass
class TrainConfig:
    data: str = ""
    """Prepared data set directory (``imgtrain data prepare ...``)."""
    name: str = ""
    """Run name; the run lives in ``{storage}/{name}``. Same name again resumes."""
    storage: str = "./runs"
    """Where runs live: a local path or a shared filesystem path (NFS) on a cluster."""

    backend: str = "ray"
    """Where the loop runs: ``ray`` (Ray Train workers) or ``local`` (one plain PyTorch process)."""
    ingest: str = "ray-data"
    """How rows reach the workers: ``ray-data`` (Ray Data) or ``torch`` (Parquet files into a
    DataLoader). Either way each worker takes its share of every global batch in the run's one
    seeded order."""
    workers: int = 2
    """Number of data-parallel training workers (Ray backend); the most, when elastic."""
    min_workers: int = 0
    """Elastic training (``--workers MIN-MAX``): the fewest workers to go on with when nodes
    leave; 0 = a fixed ``workers``. The global batch stays the same at every world size."""
    use_gpu: bool = False
    """One GPU per worker. Fails fast when the cluster has too few GPUs."""
    cpus_per_worker: float = 1.0
    """Logical CPUs each worker reserves in Ray. Threads are set separately (threads_per_worker)."""
    threads_per_worker: int = 0
    """torch intra-op threads per worker; 0 = this node's cores divided by workers on it."""
    address: str | None = None
    """Ray cluster address (``HOST:6379``, ``auto``, ``ray://host:10001``); unset starts a local cluster."""
    dashboard: bool = False
    """Start the Ray dashboard with a local cluster (about ten more processes; off to start fast)."""

    epochs: int = 12
    """Passes over the training split."""
    batch_size: int = 128
    """Global batch size, split across workers. When it does not divide, the first
    ``batch_size % workers`` ranks take one extra sample, so the global batch is exact. An
    epoch is ``train rows // batch_size`` steps at every world size."""
    optimizer: str = "adamw"
    """The optimizer: ``adamw`` or ``sgd`` (Nesterov momentum 0.9)."""
    lr: float = 3e-3
    """Peak learning rate of the one-cycle schedule."""
    weight_decay: float = 0.05
    """Weight decay: decoupled for AdamW, L2 for SGD (where about 5e-4 is usual)."""
    warmup_fraction: float = 0.15
    """Share of steps spent warming the LR up to its peak (one-cycle pct_start)."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing. Off: on the embedded split 0.1 cost 0.2-0.4 points (docs/NOTES.md)."""
    augment: bool = True
    """Random affine augmentation (rotate, scale, shift) on whole batches, training only."""
    max_rotate_deg: float = 10.0
    """Largest random rotation, degrees."""
    max_shift: float = 0.1
    """Largest random shift, as a fraction of the image size."""
    max_scale: float = 0.1
    """Largest random zoom in or out, as a fraction."""
    ema_decay: float = 0.98
    """Per-step decay of an exponential moving average of the weights, which is what gets
    evaluated and saved as model.pt; 0 turns it off. Smooths the epoch-to-epoch jitter."""
    seed: int = 0
    """Seeds model init, shuffling and augmentation."""

    channels_last: bool = True
    """NHWC memory layout for convolutions: measured 5-10% faster on CPU here, and the usual
    choice on GPUs. The saved state_dict loads into a model of either layout."""
    precision: str = "fp32"
    """Training precision: ``fp32``, or ``bf16`` (forward pass and loss under bfloat16 autocast;
    weights, gradients and optimizer state stay float32, no loss scaling needed). For GPUs with
    bfloat16 (A100, H100); on a CPU without bfloat16 instructions it is slower. Validation runs
    in float32, so recorded accuracies match a later ``imgtrain evaluate``."""
    compile: bool = False
    """Compile the training forward and backward pass with ``torch.compile``. The first steps pay
    for the compilation (tens of seconds); worth it on GPUs for long runs."""
    data_on_device: bool = False
    """Keep the training split in device memory and gather each batch there (no host-to-device
    copy per step); for data sets small enough to hold in memory (the in-memory ingest limit).
    On a CPU it changes nothing."""
    eval_batch_size: int = 500
    """Batch size per worker for validation (no gradients, so larger is fine)."""
    log_every_steps: int = 10
    """Every N steps each rank sends a progress record to the driver (fire and forget, no barrier)."""
    num_to_keep: int = 1
    """Checkpoints kept, ranked by validation accuracy; the latest is always kept in addition."""
    max_failures: int = 0
    """Worker-group failures Ray Train retries from the latest checkpoint before giving up."""
    checkpoint_every_steps: int = 0
    """Also checkpoint every N optimizer steps inside an epoch (0 = only at epoch ends). A
    crash then costs at most N steps, and the epoch resumes exactly where it stopped."""
    stall_timeout_s: float = 300.0
    """Seconds without progress (outside a collective the others wait in) after which a rank is
    named, its Python stacks and log files printed, and killed, failing or retrying the run; 0 =
    wait forever."""
    deterministic: bool = False
    """Deterministic kernels only (torch.use_deterministic_algorithms): a resumed run ends
    with the same weights as an uninterrupted one."""
    ledger: bool = False
    """Record the sample ids every rank trains on at every step in ``ledger/rank-R.jsonl``."""
    limit_train_batches: int = 0
    """Smoke mode: stop each epoch after N batches per worker (0 = whole epoch)."""

    mlflow: str | None = None
    """MLflow tracking URI (``sqlite:///mlflow.db``, ``http://host:5000``): log params, step and
    epoch metrics and the final model there. Needs ``pip install 'imgtrain[mlflow]'``."""
    mlflow_experiment: str = "imgtrain"
    """MLflow experiment the run is logged under (created when missing)."""
    tensorboard: bool = False
    """Write TensorBoard event files to ``{run}/tensorboard``. Needs ``pip install 'imgtrain[tensorboard]'``."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def effective_workers(self) -> int:
        return 1 if self.backend == "local" else self.workers

    def fewest_workers(self) -> int:
        """The smallest world size the run may train at (``min_workers`` when elastic)."""
        return 1 if self.backend == "local" else (self.min_workers or self.workers)


def config_fields() -> list[tuple[str, object, str]]:
    """(name, default, one-line description) for every field, for help and docs."""
    docs = _field_docs()
    return [(f.name, f.default, docs.get(f.name, "")) for f in dataclasses.fields(TrainConfig)]


def _field_docs() -> dict[str, str]:
    # Field docstrings are not kept at run time; read them from the source once.
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def flag(name: str) -> str:
    """The command-line spelling of a field: ``--batch-size``, ``--gpu``, ``--stall-timeout``."""
    spelled = {v: k for k, v in ALIASES.items()}.get(name, name)
    return "--" + spelled.replace("_", "-")


def range_problem(name: str, value, interval: str) -> str | None:
    """Why ``value`` is outside ``interval`` ("[0, 1)": brackets include the bound), or None."""
    import math

    lo_text, hi_text = interval[1:-1].split(",")
    lo, hi = float(lo_text), float(hi_text)
    if isinstance(value, float) and not math.isfinite(value):
        return f"{flag(name)} must be a finite number, got {value}"
    if value < lo or value == lo and interval[0] == "(":
        bound = "at least" if interval[0] == "[" else "above"
        return f"{flag(name)} must be {bound} {lo_text.strip()}, got {value}"
    if value > hi or value == hi and interval[-1] == ")":
        bound = "at most" if interval[-1] == "]" else "below"
        return f"{flag(name)} must be {bound} {hi_text.strip()}, got {value}"
    return None


def validate(cfg: TrainConfig, problems: list[str] = ()) -> None:
    """Check every field; raise one ImgtrainError listing every problem found, after the
    ``problems`` already found elsewhere (a config file's unknown keys and wrong types)."""
    issues = list(problems)
    if not cfg.name:
        issues.append("--name is required (the run is stored under {storage}/{name})")
    elif "/" in cfg.name or cfg.name.startswith(".") or "\0" in cfg.name:
        issues.append(f"--name {cfg.name!r} must be a plain name without '/' or a leading '.'")
    for name, allowed in (("backend", BACKENDS), ("ingest", INGESTS), ("precision", PRECISIONS),
                          ("optimizer", OPTIMIZERS)):
        if getattr(cfg, name) not in allowed:
            issues.append(f"{flag(name)} {getattr(cfg, name)!r} is not one of {', '.join(allowed)}")
    out_of_range = [range_problem(name, getattr(cfg, name), interval) for name, interval in RANGES.items()]
    issues += [problem for problem in out_of_range if problem]
    if cfg.min_workers > cfg.workers:
        issues.append(f"--workers {cfg.min_workers}-{cfg.workers}: the minimum must be between 1 and the maximum")
    if 1 <= cfg.batch_size < cfg.effective_workers():
        issues.append(
            f"--batch-size {cfg.batch_size} is smaller than --workers {cfg.workers}: "
            "every worker needs at least one sample per step; raise the batch size or use fewer workers"
        )
    if cfg.mlflow is not None and not cfg.mlflow.strip():
        issues.append("--mlflow needs a tracking URI, e.g. sqlite:///mlflow.db")
    if not cfg.mlflow_experiment.strip():
        issues.append("mlflow_experiment must not be empty")
    if issues:
        raise ImgtrainError("invalid configuration: " + "; ".join(issues))


def resolve(overrides: dict, stored: dict | None = None) -> TrainConfig:
    """Defaults, then the stored config of the run being resumed, then what the user set."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ImgtrainError(f"unknown config field(s): {', '.join(unknown)}")
    base = {k: v for k, v in (stored or {}).items() if k in known}
    return TrainConfig(**{**base, **{k: v for k, v in overrides.items() if v is not None}})


def steps_per_epoch(n_train: int, global_batch: int, limit: int = 0) -> int:
    """Steps per epoch: whole global batches of the training split (the rest of the epoch's
    order, fewer than one batch, is left out), the same at every world size. 0 means too
    little data."""
    steps = n_train // global_batch
    return min(steps, limit) if limit else steps


def per_worker_batch_sizes(global_batch: int, world_size: int) -> list[int]:
    """Split a global batch across ranks: equal shares, the remainder to the first ranks.

    >>> per_worker_batch_sizes(128, 3)
    [43, 43, 42]
    """
    base, extra = divmod(global_batch, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def changed_fields(old: dict, new: dict) -> list[str]:
    """Fields that differ between a stored run config and a new request, resumable ones excepted."""
    return sorted(
        k for k in new if k not in RESUMABLE_FIELDS and k in old and old[k] != new[k]
    )
