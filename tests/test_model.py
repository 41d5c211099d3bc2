import torch
import torch.nn as nn
from torchvision.models import resnet18

from imgtrain.data.order import augment_draw
from imgtrain.data.tensors import random_affine, to_model_input
from imgtrain.models.resnet18 import build_resnet18


def tutorial_build_model() -> nn.Module:
    # The Ray tutorial's own model builder, verbatim in substance.
    model = resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(in_channels=1, out_channels=64, kernel_size=(7, 7), stride=(2, 2),
                            padding=(3, 3), bias=False)
    return model


def test_same_seed_gives_the_tutorial_models_weights_and_outputs():
    torch.manual_seed(3)
    ours = build_resnet18(1, 10)
    torch.manual_seed(3)
    theirs = tutorial_build_model()
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(ours.eval()(x), theirs.eval()(x))


def test_channels_and_classes_follow_the_data_set():
    model = build_resnet18(3, 7).eval()
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def test_model_input_is_nchw_in_minus_one_to_one():
    images = torch.tensor([0, 255], dtype=torch.uint8).repeat(2, 28, 14, 1).reshape(2, 28, 28, 1)
    x = to_model_input(images, [0.5], [0.5])
    assert x.shape == (2, 1, 28, 28) and x.dtype == torch.float32
    assert x.min().item() == -1.0 and x.max().item() == 1.0


def test_random_affine_keeps_shape_background_and_is_seeded():
    x = torch.full((4, 1, 28, 28), -1.0)
    x[:, :, 10:18, 10:18] = 1.0
    a = random_affine(x, augment_draw(0, 1, 4, 1, 0), 10, 0.1, 0.1)
    b = random_affine(x, augment_draw(0, 1, 4, 1, 0), 10, 0.1, 0.1)
    c = random_affine(x, augment_draw(0, 2, 4, 1, 0), 10, 0.1, 0.1)
    assert a.shape == x.shape and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.allclose(a[:, :, 0, 0], torch.tensor(-1.0))  # corners stay background
    assert not torch.equal(a, x)


def test_random_affine_with_zero_ranges_is_identity():
    x = torch.rand(3, 1, 28, 28) * 2 - 1
    y = random_affine(x, augment_draw(0, 0, 3, 1, 0), 0, 0, 0)
    assert torch.allclose(x, y, atol=1e-5)
