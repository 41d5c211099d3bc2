"""The command line: one function per verb, each a thin layer over the Python API.

Every user error is printed as one line, ``error: ...``, with exit status 2; no traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from imgtrain.errors import ImgtrainError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train image classifiers with data-parallel PyTorch on Ray.")
data_app = typer.Typer(no_args_is_help=True, help="Prepare data sets.")
runs_app = typer.Typer(no_args_is_help=True, help="Inspect runs.")
config_app = typer.Typer(no_args_is_help=True, help="Training settings: defaults and config files.")
clean_app = typer.Typer(no_args_is_help=True, help="Delete runs or prepared data sets (only what imgtrain made).")
for group, group_name in ((data_app, "data"), (runs_app, "runs"), (config_app, "config"), (clean_app, "clean")):
    app.add_typer(group, name=group_name)
console = Console(markup=False)  # messages hold paths and errors: never rich markup

STORAGE_HELP = "Where runs live (local or shared path)."


@data_app.command("prepare")
def data_prepare(
    source: str = typer.Argument(..., help="mnist-sample | mnist | folder | parquet"),
    out_dir: Path = typer.Argument(..., help="Directory to write the prepared data set to."),
    source_path: Optional[Path] = typer.Option(None, "--source", help="Input: IDX dir, image folder or Parquet."),
    download: bool = typer.Option(False, "--download", help="mnist: download with torchvision (needs internet)."),
    image_column: str = typer.Option("image", help="parquet: the image column."),
    label_column: str = typer.Option("label", help="parquet: the label column."),
    channels: Optional[int] = typer.Option(None, help="folder: 1 (grayscale) or 3 (RGB); default: detect."),
    size: Optional[str] = typer.Option(None, help="folder: resize every image to HxW, e.g. 28x28."),
    test_fraction: float = typer.Option(0.2, help="Share held out for testing when the source has no split."),
    seed: int = typer.Option(0, help="Seed of the split and the row order."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing data set in OUT_DIR."),
):
    """Convert a source into a prepared data set (manifest.json + train/ and test/ Parquet)."""
    from imgtrain.data.format import describe, prepare
    from imgtrain.data.sources import parse_size

    hw = parse_size(size) if size else None
    manifest = prepare(
        source, out_dir, source_path=source_path, download=download, image_column=image_column,
        label_column=label_column, channels=channels, size=hw, test_fraction=test_fraction,
        seed=seed, overwrite=overwrite,
    )
    console.print(describe(manifest), highlight=False)
    console.print(f"prepared data set: {out_dir.resolve()}", highlight=False)


def _default(field: str) -> str:
    from imgtrain.config import TrainConfig

    return f" [default: {getattr(TrainConfig, field)}]"


@app.command("train")
def train_cmd(
    config: Optional[Path] = typer.Option(
        None, "--config", help="TOML (or JSON) file of settings; flags given here override it. "
        "`imgtrain config show --toml` prints a template."),
    name: Optional[str] = typer.Option(None, help="Run name; the same name again resumes the run."),
    data: Optional[Path] = typer.Option(None, help="Prepared data set directory (not needed to resume)."),
    workers: Optional[str] = typer.Option(
        None, help="Data-parallel workers: N, or MIN-MAX for elastic training (continues with fewer "
        "when nodes leave, grows back when they return)." + _default("workers")),
    gpu: Optional[bool] = typer.Option(None, "--gpu/--cpu", help="One GPU per worker, or CPUs only. [default: cpu]"),
    epochs: Optional[int] = typer.Option(None, help="Passes over the training split." + _default("epochs")),
    batch_size: Optional[int] = typer.Option(None, help="Global batch, split across workers." + _default("batch_size")),
    optimizer: Optional[str] = typer.Option(None, help="adamw or sgd (Nesterov)." + _default("optimizer")),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate (one-cycle)." + _default("lr")),
    weight_decay: Optional[float] = typer.Option(None, help="AdamW weight decay." + _default("weight_decay")),
    augment: Optional[bool] = typer.Option(None, "--augment/--no-augment", help="Random affine augmentation. [default: on]"),
    ema_decay: Optional[float] = typer.Option(None, help="Weight moving average per step; 0 = off." + _default("ema_decay")),
    seed: Optional[int] = typer.Option(None, help="Seed for init, shuffling and augmentation." + _default("seed")),
    ingest: Optional[str] = typer.Option(None, help="ray-data or torch (DataLoader)." + _default("ingest")),
    backend: Optional[str] = typer.Option(None, help="ray or local (one plain PyTorch process)." + _default("backend")),
    storage: Optional[str] = typer.Option(None, help=STORAGE_HELP + _default("storage")),
    address: Optional[str] = typer.Option(None, help="Join this Ray cluster (e.g. auto); default: start one."),
    dashboard: Optional[bool] = typer.Option(None, "--dashboard", help="Start the Ray dashboard (local cluster)."),
    max_failures: Optional[int] = typer.Option(None, help="Worker failures retried from the latest checkpoint."),
    cpus_per_worker: Optional[float] = typer.Option(None, help="Logical CPUs a worker reserves." + _default("cpus_per_worker")),
    threads_per_worker: Optional[int] = typer.Option(None, help="torch threads per worker; 0 = cores / workers."),
    limit_train_batches: Optional[int] = typer.Option(None, help="Smoke mode: steps per epoch."),
    checkpoint_every_steps: Optional[int] = typer.Option(
        None, help="Also checkpoint every N steps inside an epoch; 0 = at epoch ends only."),
    stall_timeout: Optional[float] = typer.Option(
        None, help="Seconds without progress before a stuck rank is named and killed; 0 = never."
        + _default("stall_timeout_s")),
    deterministic: Optional[bool] = typer.Option(
        None, "--deterministic", help="Deterministic kernels: a resumed run ends with the same weights."),
    ledger: Optional[bool] = typer.Option(
        None, "--ledger", help="Record the sample ids each rank trains on at each step (ledger/)."),
    log_every_steps: Optional[int] = typer.Option(None, help="Progress record every N steps." + _default("log_every_steps")),
    eval_batch_size: Optional[int] = typer.Option(None, help="Validation batch per worker." + _default("eval_batch_size")),
    precision: Optional[str] = typer.Option(
        None, help="fp32, or bf16 (autocast; for GPUs with bfloat16)." + _default("precision")),
    compile: Optional[bool] = typer.Option(None, "--compile", help="torch.compile the training step (slow first steps)."),
    data_on_device: Optional[bool] = typer.Option(
        None, "--data-on-device", help="Hold the training split in GPU memory; batches are gathered there."),
    mlflow: Optional[str] = typer.Option(
        None, "--mlflow", metavar="URI", help="Log params, metrics and the final model to this MLflow "
        "tracking URI (sqlite:///mlflow.db, http://host:5000). Needs imgtrain[mlflow]."),
    mlflow_experiment: Optional[str] = typer.Option(None, help="MLflow experiment." + _default("mlflow_experiment")),
    tensorboard: Optional[bool] = typer.Option(
        None, "--tensorboard", help="Write TensorBoard event files to RUN/tensorboard. Needs imgtrain[tensorboard]."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Delete an existing run NAME and start afresh."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress display."),
    json_out: bool = typer.Option(False, "--json", help="Print the finished run as JSON."),
):
    """Train a ResNet-18 on a prepared data set with Ray Train, or resume the run NAME.

    Settings come from the defaults, then the stored config of the run being resumed, then
    --config FILE, then the flags given here.
    """
    import imgtrain
    from imgtrain import runs
    from imgtrain.ops import ownership
    from imgtrain.config import TrainConfig, resolve, validate
    from imgtrain.configfile import read_config_file
    from imgtrain.training.progress import TrainingDisplay

    min_workers, max_workers = _parse_workers(workers)
    overrides = dict(
        name=name, data=str(data) if data else None, workers=max_workers, min_workers=min_workers, use_gpu=gpu, epochs=epochs,
        batch_size=batch_size, optimizer=optimizer, lr=lr, weight_decay=weight_decay, augment=augment, seed=seed, ema_decay=ema_decay,
        ingest=ingest, backend=backend, storage=storage, address=address, dashboard=dashboard,
        max_failures=max_failures, cpus_per_worker=cpus_per_worker,
        threads_per_worker=threads_per_worker, limit_train_batches=limit_train_batches,
        checkpoint_every_steps=checkpoint_every_steps, stall_timeout_s=stall_timeout,
        deterministic=deterministic, ledger=ledger, log_every_steps=log_every_steps,
        eval_batch_size=eval_batch_size, precision=precision, compile=compile, data_on_device=data_on_device,
        mlflow=mlflow, mlflow_experiment=mlflow_experiment, tensorboard=tensorboard,
    )
    from_file, problems = read_config_file(config) if config else ({}, [])
    requested = {**from_file, **{k: v for k, v in overrides.items() if v is not None}}
    # A resumed run keeps its stored settings; an overwritten one starts from the defaults.
    run_name, run_storage = requested.get("name"), requested.get("storage", TrainConfig.storage)
    run_dir = runs.run_path(run_storage, run_name) if run_name else None
    stored = runs.read_config(run_dir) if run_dir and not overwrite and ownership.is_run(run_dir) else None
    cfg = resolve(requested, stored)
    if problems:  # the file's problems and the resolved config's, in one message
        validate(cfg, [f"{config}: {p}" for p in problems])
    result = imgtrain.train(cfg, display=TrainingDisplay(console, quiet=quiet or json_out), overwrite=overwrite)
    if json_out:
        print(json.dumps(result.to_json(), indent=2))
        return
    acc = result.final_accuracy
    console.print(
        f"finished {result.name}: test accuracy {acc:.2%}" if acc is not None else f"finished {result.name}",
        highlight=False,
    )
    console.print(f"run directory: {result.path}", highlight=False)
    if result.best_checkpoint:
        console.print(f"best checkpoint: {result.best_checkpoint}", highlight=False)


def _parse_workers(text: str | None) -> tuple[int | None, int | None]:
    """'2' -> (0, 2): a fixed world size; '1-4' -> (1, 4): elastic; None -> not given."""
    if text is None:
        return None, None
    low, sep, high = text.partition("-")
    try:
        return (int(low), int(high)) if sep else (0, int(low))
    except ValueError:
        raise ImgtrainError(f"--workers {text!r} is not a number N or a range MIN-MAX such as 1-4") from None


@runs_app.command("list")
def runs_list(storage: str = typer.Option("./runs", help=STORAGE_HELP),
              json_out: bool = typer.Option(False, "--json", help="Print JSON.")):
    """List the runs in STORAGE."""
    from imgtrain.runs import list_runs

    found = list_runs(storage)
    if json_out:
        print(json.dumps([r.to_json() for r in found], indent=2))
        return
    if not found:
        console.print(f"no runs in {storage}", highlight=False)
        return
    table = Table("name", "status", "epochs", "best val acc", "last val acc", "path")
    for r in found:
        best = r.to_json()["best_val_accuracy"]
        table.add_row(
            r.name, r.status, f"{len(r.history)}/{r.config.get('epochs')}",
            f"{best:.2%}" if best is not None else "-",
            f"{r.final_accuracy:.2%}" if r.final_accuracy is not None else "-", str(r.path),
        )
    console.print(table)


@runs_app.command("show")
def runs_show(name: str, storage: str = typer.Option("./runs", help=STORAGE_HELP),
              json_out: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Show one run: status, per-epoch metrics, checkpoints."""
    from imgtrain.training.progress import epoch_line
    from imgtrain.runs import load_run

    r = load_run(storage, name)
    if json_out:
        print(json.dumps(r.to_json(), indent=2))
        return
    console.print(f"{r.name}  status: {r.status}  ({r.path})", highlight=False, soft_wrap=True)
    if r.error:
        console.print(f"error: {r.error}", highlight=False, soft_wrap=True)
    cfg = r.config
    console.print(
        f"data {cfg.get('data')}  backend {cfg.get('backend')}  ingest {cfg.get('ingest')}  "
        f"workers {cfg.get('workers')}  batch {cfg.get('batch_size')}  lr {cfg.get('lr')}", highlight=False, soft_wrap=True,
    )
    for rec in r.history:
        console.print(epoch_line(rec, cfg.get("epochs", 0)), highlight=False, soft_wrap=True)
    last = r.history[-1] if r.history else {}
    if last.get("rank_step_time_s"):  # is any rank starved by data?
        per_rank = "; ".join(
            f"rank {rank}: {step:.3f} s/step, {wait * 1000:.1f} ms waiting for data ({wait / max(step, 1e-9):.0%})"
            for rank, (step, wait) in enumerate(zip(last["rank_step_time_s"], last["rank_data_wait_s"])))
        console.print(f"last epoch per rank: {per_rank}", highlight=False, soft_wrap=True)
    console.print(f"best checkpoint:   {r.best_checkpoint}", highlight=False, soft_wrap=True)
    console.print(f"latest checkpoint: {r.latest_checkpoint}", highlight=False, soft_wrap=True)


@config_app.command("show")
def config_show(
    run: Optional[str] = typer.Option(None, "--run", help="Show this run's resolved config instead of the defaults."),
    storage: str = typer.Option("./runs", help=STORAGE_HELP),
    toml: bool = typer.Option(False, "--toml", help="Print a commented TOML file, ready for --config."),
):
    """Every training setting with its default (or a run's value) and a one-line description."""
    from imgtrain.configfile import as_toml, describe_fields
    from imgtrain.runs import load_run

    values = load_run(storage, run).config if run else None
    if toml:
        print(as_toml(values))
        return
    rows = [("field", "value" if run else "default", "description"), *describe_fields(values)]
    width = max(len(value) for _, value, _ in rows)
    for field, value, description in rows:  # one line each: easy to grep, wrapped by the terminal
        console.print(f"{field:<22} {value:<{width}}  {description}", highlight=False, soft_wrap=True)


CHECKPOINT_HELP = "best, latest, or a checkpoint directory."
# Shared by evaluate and predict (typer options are plain metadata, safe to reuse).
GPU_OPTION = typer.Option(False, "--gpu", help="One GPU per inference actor.")
CONCURRENCY_OPTION = typer.Option(1, help="Inference actors in the Ray Data pool.")
BATCH_OPTION = typer.Option(500, help="Images per inference batch.")
THREADS_OPTION = typer.Option(0, help="torch threads per actor; 0 = cores / concurrency.")
BACKEND_OPTION = typer.Option("ray", help="ray (Ray Data actor pool) or local (this process).")
ADDRESS_OPTION = typer.Option(None, help="Join this Ray cluster; default: start one.")


def _inference_options(backend, batch_size, concurrency, threads, gpu, address, top_k=3):
    from imgtrain.inference.batch import InferenceOptions

    return InferenceOptions(backend=backend, batch_size=batch_size, concurrency=concurrency,
                            threads=threads, use_gpu=gpu, address=address, top_k=top_k)


@app.command("evaluate")
def evaluate_cmd(
    run: str = typer.Argument(..., help="Run name (in --storage), run directory or checkpoint directory."),
    checkpoint: str = typer.Option("best", help=CHECKPOINT_HELP),
    split: str = typer.Option("test", help="Split of the data set to evaluate on."),
    data: Optional[Path] = typer.Option(None, help="Another prepared data set (default: the run's)."),
    gpu: bool = GPU_OPTION, concurrency: int = CONCURRENCY_OPTION, batch_size: int = BATCH_OPTION,
    threads: int = THREADS_OPTION, backend: str = BACKEND_OPTION, address: Optional[str] = ADDRESS_OPTION,
    storage: str = typer.Option("./runs", help=STORAGE_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Accuracy, per-class precision/recall/F1 and confusion matrix of a checkpoint."""
    from imgtrain.inference.batch import evaluate

    opts = _inference_options(backend, batch_size, concurrency, threads, gpu, address)
    result = evaluate(run, checkpoint=checkpoint, storage=storage, split=split,
                      data=str(data) if data else None, options=opts)
    if json_out:
        print(json.dumps(result.to_json(), indent=2))
        return
    console.print(f"checkpoint {result.checkpoint}", highlight=False)
    recorded = result.recorded_val_accuracy
    console.print(
        f"{result.split} accuracy {result.accuracy:.2%} on {result.num_samples} samples"
        + (f" (recorded in training: {recorded:.2%})" if recorded is not None else ""), highlight=False,
    )
    table = Table("class", "precision", "recall", "f1", "support")
    for name, s in result.per_class.items():
        table.add_row(name, f"{s['precision']:.3f}", f"{s['recall']:.3f}", f"{s['f1']:.3f}", str(s["support"]))
    console.print(table)
    cm = Table("true \\ pred", *result.classes, title="confusion matrix")
    for name, row in zip(result.classes, result.confusion_matrix):
        cm.add_row(name, *(str(v) for v in row))
    console.print(cm)


@app.command("predict")
def predict_cmd(
    run: str = typer.Argument(..., help="Run name (in --storage), run directory or checkpoint directory."),
    input: str = typer.Argument(..., help="Prepared data set, Parquet file, image folder, glob or one image."),
    out: Path = typer.Option(..., "--out", help="Output file: .parquet or .csv."),
    checkpoint: str = typer.Option("best", help=CHECKPOINT_HELP),
    top_k: int = typer.Option(3, help="Classes listed per image, most probable first."),
    on_error: str = typer.Option("skip", help="Unreadable image files: skip (reported) or fail."),
    split: str = typer.Option("test", help="Prepared data set input: the split to predict."),
    image_column: str = typer.Option("image", help="Parquet input: the image column."),
    gpu: bool = GPU_OPTION, concurrency: int = CONCURRENCY_OPTION, batch_size: int = BATCH_OPTION,
    threads: int = THREADS_OPTION, backend: str = BACKEND_OPTION, address: Optional[str] = ADDRESS_OPTION,
    storage: str = typer.Option("./runs", help=STORAGE_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file."),
):
    """Predict classes for images; images of another size or colour mode are converted."""
    from imgtrain.inference.batch import predict

    opts = _inference_options(backend, batch_size, concurrency, threads, gpu, address, top_k)
    result = predict(run, input, out, checkpoint=checkpoint, storage=storage, on_error=on_error,
                     split=split, image_column=image_column, options=opts, overwrite=overwrite)
    err = Console(stderr=True, markup=False)
    for name, why in result.skipped:
        err.print(f"skipped {name}: {why}", highlight=False, soft_wrap=True)
    summary = f"wrote {result.num_predictions} predictions to {result.out}"
    if result.converted:
        summary += f" ({result.converted} image(s) converted to {result.image_shape_text})"
    if result.skipped:
        summary += f"; skipped {len(result.skipped)} unreadable file(s)"
    console.print(summary, highlight=False)


@app.command("report")
def report_cmd(
    run: str = typer.Argument(..., help="Run name (in --storage) or run directory."),
    checkpoint: str = typer.Option("best", help=CHECKPOINT_HELP),
    storage: str = typer.Option("./runs", help=STORAGE_HELP),
):
    """Write the run's plots and one self-contained HTML page into its report/ folder."""
    from imgtrain.inference.report import write_report

    page = write_report(run, checkpoint=checkpoint, storage=storage)
    console.print(f"report: {page}", highlight=False)


@app.command("serve")
def serve_cmd(
    run: str = typer.Argument(..., help="Run name (in --storage), run directory or checkpoint directory."),
    checkpoint: str = typer.Option("best", help=CHECKPOINT_HELP),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0 exposes it to the network; "
                             "there is no authentication or TLS: put a reverse proxy in front)."),
    port: int = typer.Option(8000, help="HTTP port."),
    max_request_bytes: int = typer.Option(1 << 20, help="Larger request bodies are refused with 413."),
    max_image_pixels: int = typer.Option(0, help="Larger images are refused with 413 before decoding; "
                                         "0 = 64 x the model's input, at least 1 megapixel."),
    max_batch_images: int = typer.Option(64, help="Most images in one request."),
    request_timeout: float = typer.Option(30.0, help="Seconds before an unanswered request gets 408/504."),
    max_queued_requests: int = typer.Option(100, help="Requests waiting per replica before new ones get 503."),
    replicas: int = typer.Option(1, help="Model replicas (Ray Serve deployment)."),
    openapi: bool = typer.Option(False, "--openapi", help="Also serve the API schema at /openapi.json."),
    address: Optional[str] = typer.Option(None, help="Join this Ray cluster; default: start one."),
    storage: str = typer.Option("./runs", help=STORAGE_HELP),
):
    """Serve the model over HTTP with Ray Serve: POST /predict, GET /healthz. Ctrl-C stops it."""
    from imgtrain.inference.serve import Limits, run_server

    limits = Limits(max_request_bytes=max_request_bytes, max_image_pixels=max_image_pixels,
                    max_batch_images=max_batch_images, request_timeout_s=request_timeout,
                    max_queued_requests=max_queued_requests)
    run_server(run, checkpoint=checkpoint, storage=storage, host=host, port=port, limits=limits,
               replicas=replicas, address=address, openapi=openapi,
               announce=lambda line: console.print(line, highlight=False, soft_wrap=True))


YES_OPTION = typer.Option(False, "--yes", "-y", help="Delete without asking.")
DRY_RUN_OPTION = typer.Option(False, "--dry-run", help="Only list what would be deleted.")


@clean_app.command("runs")
def clean_runs(
    names: Optional[list[str]] = typer.Argument(None, help="Runs to delete."),
    all_runs: bool = typer.Option(False, "--all", help="Every run in --storage."),
    storage: str = typer.Option("./runs", help=STORAGE_HELP),
    yes: bool = YES_OPTION, dry_run: bool = DRY_RUN_OPTION,
    force: bool = typer.Option(False, "--force", help="Also delete runs recorded as being trained on another "
                               "host whose driver is gone (a run locked on this machine is never deleted)."),
):
    """Delete runs: their checkpoints, metrics, logs and reports. Never a run being trained."""
    from imgtrain.ops.clean import plan_runs

    _clean(plan_runs(storage, names or [], everything=all_runs, force=force), yes, dry_run)


@clean_app.command("data")
def clean_data(
    data_dirs: list[Path] = typer.Argument(..., help="Prepared data set directories."),
    yes: bool = YES_OPTION, dry_run: bool = DRY_RUN_OPTION,
):
    """Delete prepared data sets: the manifest and the Parquet files it lists, nothing else."""
    from imgtrain.ops.clean import plan_dataset

    _clean([plan_dataset(d) for d in data_dirs], yes, dry_run)


def _clean(plan, yes: bool, dry_run: bool) -> None:
    from imgtrain.ops.clean import remove

    if not plan:
        console.print("nothing to delete", highlight=False)
        return
    for removal in plan:
        console.print(("would delete " if dry_run else "") + removal.describe(), highlight=False, soft_wrap=True)
    if dry_run:
        return
    total = sum(r.size for r in plan) / 2**20
    if not yes:
        try:
            agreed = typer.confirm(f"delete these {len(plan)} item(s), {total:,.1f} MiB?", default=False)
        except typer.Abort:  # end of input (a script, CI): never a yes
            raise ImgtrainError("no answer to the confirmation; nothing deleted (pass --yes to delete without asking)") from None
        if not agreed:
            console.print("nothing deleted", highlight=False)
            raise typer.Exit(1)
    for removal in plan:
        remove(removal)
        console.print(f"deleted {removal.path}", highlight=False, soft_wrap=True)
        for kept in removal.kept:
            console.print(f"  kept {kept} (not written by imgtrain)", highlight=False, soft_wrap=True)


@app.command("doctor")
def doctor_cmd(
    storage: str = typer.Option("./runs", help=STORAGE_HELP),
    address: Optional[str] = typer.Option(None, help="Check this Ray cluster (default: RAY_ADDRESS, or one running here)."),
    data: Optional[Path] = typer.Option(None, help="Also check this prepared data set (and that every node reads it)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Versions, CUDA, the Ray cluster's resources, whether storage is writable and shared: a verdict.

    Exits 0 when ready to train, 1 when something needs fixing first.
    """
    from imgtrain.ops.doctor import diagnose

    found = diagnose(storage=storage, address=address, data=str(data) if data else None)
    if json_out:
        print(json.dumps(found.to_json(), indent=2))
    else:
        for check in found.checks:
            console.print(f"{check.status:<5} {check.name}: {check.detail}", highlight=False, soft_wrap=True)
            for line in check.lines:
                console.print(f"        {line}", highlight=False, soft_wrap=True)
        console.print(f"verdict: {found.verdict}", highlight=False, soft_wrap=True)
    if not found.ready:
        raise typer.Exit(1)


def main() -> None:
    try:
        code = app(standalone_mode=False)  # a command's typer.Exit(N) comes back as N
        if isinstance(code, int) and code:
            sys.exit(code)
    except ImgtrainError as e:
        Console(stderr=True, markup=False).print(f"error: {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        Console(stderr=True).print("interrupted; run the same command again to resume")
        sys.exit(130)
    except typer.TyperException as e:  # unknown options, missing arguments: click's usage message
        show = getattr(e, "show", None)
        if show:
            show()
        sys.exit(getattr(e, "exit_code", 2))
    except Exception as e:  # a bug or an environment failure: one line, the traceback on request
        if os.environ.get("IMGTRAIN_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        Console(stderr=True, markup=False).print(
            f"error: unexpected {type(e).__name__}: {first} "
            "(run logs are in the run's logs/ folder; IMGTRAIN_DEBUG=1 shows the traceback)",
            highlight=False, soft_wrap=True,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
