"""--average-last K: after the last epoch, a checkpoint holding the uniform average of the last
K epochs' evaluated weights (what each epoch's model.pt holds: the moving average's when
--ema-decay is on), its BatchNorm statistics recomputed and validated (``save_average``).

The K epochs' weights are kept by rank 0 as training goes (``weight_window.WeightWindow``), in
memory and in every checkpoint's train_state.pt, so a run resumed anywhere averages exactly the
same weights.

The average checkpoint (``checkpoint_epoch_NNNN_average``) carries the last epoch's whole
training state too (its ``model.pt`` aside, in ``EVALUATED_WEIGHTS_KEY``): it is the run's
latest, and Ray Train hands its latest to a retried or extended run, which goes on from it
exactly as from the last epoch's checkpoint.
"""

from __future__ import annotations

import time

import torch

from imgtrain.checkpoint_policy import POLICY
from imgtrain.data.format import eval_split
from imgtrain.training import multilabel
from imgtrain.training.calibration import calibrate_batchnorm
from imgtrain.training.checkpointing import save
from imgtrain.training.evaluation import THRESHOLDS, evaluate, evaluated_model, plain_model
from imgtrain.training.run_state import Run


def save_average(run: Run) -> None:
    """Average the window's weights into a plain model (every rank: rank 0's average is
    broadcast), recompute its BatchNorm statistics from the calibration images (kept as
    averaged with --bn-calibration 0), validate it and save it as the average checkpoint; rank 0
    sends its record. A collective: all ranks call it."""
    cfg, backend, manifest = run.cfg, run.backend, run.manifest
    last = run.history[-1]["epoch"]
    backend.progress.enter("sync", run.step)
    trained = evaluated_model(run)  # the last epoch's: a full copy gathered from the shards with FSDP
    averaged = plain_model(cfg, manifest)
    averaged.load_state_dict(trained.state_dict())  # integer buffers (BatchNorm's batch count): the last epoch's
    averaged.to(backend.device, memory_format=run.memory_format)
    state = averaged.state_dict()
    names = [k for k, v in state.items() if v.is_floating_point()]
    size = sum(state[k].numel() for k in names)
    flat = run.window.mean(names) if backend.rank == 0 else torch.zeros(size, dtype=torch.float64)
    flat = backend.broadcast(flat)
    offset = 0
    with torch.no_grad():
        for name in names:
            t = state[name]
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    backend.progress.enter("eval")
    if backend.calibration_batches is not None:
        calibrate_batchnorm(averaged, backend, manifest, run.memory_format)
    validation = evaluate(averaged, backend, manifest, cfg.label_smoothing, run.memory_format,
                          multilabel.validation_loss(cfg, manifest, backend.device))
    thresholds = validation.pop(THRESHOLDS, None)
    epochs = list(run.window.epochs)  # rank 0's: only rank 0 writes the record and the checkpoint
    metrics = {"epoch": last, "step": run.step, **validation, "val_split": eval_split(manifest), "time": time.time()}
    name = POLICY.average_name(last, backend.damaged)
    save(run, last, metrics, None, name, averaged, average={"epochs": epochs},
         trained_evaluated=None if run.sharded else trained, thresholds=thresholds)
    if backend.rank == 0:
        backend.send(dict(metrics, kind="average", epochs=epochs, checkpoint=name))

