"""The tutorial's Ray Train + Ray Data pipeline as written, on imgtrain's data, for comparison.

What the "Introduction to Ray Train" notebook does (module 02, Ray Data): the images go into a
pandas DataFrame as lists of lists, then one Parquet file; ``read_parquet`` then a row-wise
``map`` (numpy -> PIL -> ToTensor -> Normalize); a ``TorchTrainer`` on 2 CPU workers whose
loop feeds ``iter_torch_batches`` into a DDP ResNet-18 with Adam, prints the loss and saves a
checkpoint from rank 0 every epoch. Its own ``ray.init`` starts a local cluster with 4 logical
CPUs (with 2, the workers leave nothing for the map tasks and it waits forever).

The only additions are measurements: rank 0 appends the time of every step to a file, and the
script prints when it started, when ``fit()`` started and ended. Usage (from
``bench/train_throughput.py``): ``python bench/tutorial_pipeline.py --data D --epochs 2 --out F``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

T0 = time.time()

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import ray  # noqa: E402
import ray.train  # noqa: E402
import ray.train.torch  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402
from torch.nn import CrossEntropyLoss  # noqa: E402
from torch.optim import Adam  # noqa: E402
from torchvision.models import resnet18  # noqa: E402
from torchvision.transforms import Compose, Normalize, ToTensor  # noqa: E402

from imgtrain.data.format import read_split  # noqa: E402


def build_resnet18():
    model = resnet18(num_classes=10)
    model.conv1 = torch.nn.Conv2d(1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)
    return model


def transform_images(row: dict):
    transform = Compose([ToTensor(), Normalize((0.5,), (0.5,))])
    image_arr = np.array(row["image"], dtype=np.uint8)
    row["image"] = transform(Image.fromarray(image_arr))
    return row


def train_loop_ray_train_ray_data(config: dict):
    criterion = CrossEntropyLoss()
    model = ray.train.torch.prepare_model(build_resnet18())
    optimizer = Adam(model.parameters(), lr=1e-3)
    batch_size = config["global_batch_size"] // ray.train.get_context().get_world_size()
    data_loader = ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=batch_size, prefetch_batches=2)
    rank = ray.train.get_context().get_world_rank()
    timings = open(config["step_times"], "a") if rank == 0 else None  # measurement, not the tutorial's
    for epoch in range(config["num_epochs"]):
        for batch in data_loader:
            outputs = model(batch["image"])
            loss = criterion(outputs, batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if timings:
                timings.write(json.dumps({"epoch": epoch, "time": time.time(), "images": len(batch["label"])}) + "\n")
                timings.flush()
        metrics = {"loss": loss.item(), "epoch": epoch}
        if rank == 0:
            print(metrics)
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            checkpoint = None
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(temp_checkpoint_dir, "model.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(temp_checkpoint_dir)
            ray.train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rows", type=int, default=0, help="use the first N training rows (0 = all)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", required=True, help="directory for the Parquet file, run and step times")
    opts = parser.parse_args()

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    ids, images, labels = read_split(opts.data, "train")
    order = np.argsort(ids)  # the source's order: the tutorial never shuffles
    images, labels = images[order][..., 0], labels[order]
    if opts.rows:
        images, labels = images[: opts.rows], labels[: opts.rows]
    df = pd.DataFrame({"image": images.tolist(), "label": labels})
    parquet = os.path.join(opts.out, "MNIST.parquet")
    df.to_parquet(parquet)
    train_ds = ray.data.read_parquet(parquet).map(transform_images)

    step_times = os.path.join(opts.out, "step_times.jsonl")
    trainer = TorchTrainer(
        train_loop_ray_train_ray_data,
        train_loop_config={"num_epochs": opts.epochs, "global_batch_size": 128, "step_times": step_times},
        scaling_config=ScalingConfig(num_workers=opts.workers, use_gpu=False),
        run_config=RunConfig(storage_path=os.path.join(opts.out, "runs"), name="dist-MNIST-res18-ray-data"),
        datasets={"train": train_ds},
    )
    fit_start = time.time()
    trainer.fit()
    fit_end = time.time()
    ray.shutdown()
    print(json.dumps({"started": T0, "fit_start": fit_start, "fit_end": fit_end, "step_times": step_times}), flush=True)


if __name__ == "__main__":
    main()
