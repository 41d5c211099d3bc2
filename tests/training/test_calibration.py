"""BatchNorm calibration: the statistics validation and model.pt use come from the calibration
images, preprocessed as for evaluation, averaged over every rank's images."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from imgtrain.data.tensors import to_model_input
from imgtrain.training.calibration import calibrate_batchnorm

NORMALIZE = {"normalize": {"mean": [0.5], "std": [0.5]}}


def model() -> nn.Sequential:
    torch.manual_seed(0)
    # the dropout before the second BatchNorm must be off while calibrating, as in evaluation
    return nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4, momentum=0.1), nn.ReLU(),
                         nn.Dropout(0.9), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2, momentum=0.1))


def batches(*sizes: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"image": torch.randint(0, 256, (n, 8, 8, 1), dtype=torch.uint8, generator=g),
             "label": torch.zeros(n, dtype=torch.int64)} for n in sizes]


def backend(calibration: list[dict], all_reduce_sum=lambda t: t):
    return SimpleNamespace(calibration_batches=lambda: iter(calibration), all_reduce_sum=all_reduce_sum)


def features(net: nn.Sequential, batch: dict, upto: int) -> torch.Tensor:
    """The input of layer ``upto``, dropout off (BatchNorms in the mode they are in)."""
    net[3].eval()
    with torch.no_grad():
        return net[:upto](to_model_input(batch["image"], [0.5], [0.5]))


def test_the_statistics_are_the_calibration_images_own_weighted_by_images_with_dropout_off():
    net, data = model(), batches(5, 3, 1)  # the 1-image batch has no variance: left out
    net.train()
    calibrate_batchnorm(net, backend(data), NORMALIZE)
    first, second = net[1], net[5]
    assert net.training and first.momentum == second.momentum == 0.1  # the model as it was
    assert int(first.num_batches_tracked) == 2
    conv = [features(net, b, 1) for b in data[:2]]
    assert torch.allclose(first.running_mean, torch.cat(conv).mean((0, 2, 3)), atol=1e-5)
    variances = [c.transpose(0, 1).flatten(1).var(1) for c in conv]  # unbiased, per batch
    assert torch.allclose(first.running_var, (5 * variances[0] + 3 * variances[1]) / 8, atol=1e-5)
    # the second layer saw its input with dropout off, the first layer normalising with each
    # batch's own statistics (one pass for all layers, as torch's swa_utils.update_bn does)
    first.train()
    first.momentum = 0.0  # batch statistics without moving the calibrated ones
    seen = [features(net, b, 5) for b in data[:2]]
    first.momentum = 0.1
    assert torch.allclose(second.running_mean, torch.cat(seen).mean((0, 2, 3)), atol=1e-5)


def test_ranks_are_averaged_by_their_images_and_a_rank_without_any_counts_for_nothing():
    alone, data = model(), batches(6, 2)
    calibrate_batchnorm(alone, backend(data), NORMALIZE)
    # this rank has no calibration image; the other rank (simulated) had them all
    other = model()
    calibrate_batchnorm(other, backend(data), NORMALIZE)
    sent = []

    def all_reduce_sum(t):  # this rank's contribution plus the other's
        sent.append(t)
        return t + theirs

    layers = [m for m in other.modules() if isinstance(m, nn.BatchNorm2d)]
    theirs = torch.cat([s.double().flatten() * 8 for m in layers for s in (m.running_mean, m.running_var)]
                       + [torch.tensor([8.0, 2.0], dtype=torch.float64)])
    empty = model()
    calibrate_batchnorm(empty, backend([], all_reduce_sum), NORMALIZE)
    for a, b in zip(alone.state_dict().values(), empty.state_dict().values()):
        assert torch.allclose(a.double(), b.double(), atol=1e-6)


@pytest.mark.parametrize("data", [[], batches(1)])
def test_no_calibration_image_anywhere_keeps_the_statistics_training_gathered(data):
    net = model()
    net.train()
    with torch.no_grad():
        net(to_model_input(batches(4)[0]["image"], [0.5], [0.5]))
    gathered = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    calibrate_batchnorm(net, backend(data), NORMALIZE)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in gathered.items())
