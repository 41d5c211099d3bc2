"""Models by name and starting from a weights file: what gets built, and what a file's tensors
become (loaded, adapted, new) or why the file is refused."""

from __future__ import annotations

import pickle

import pytest
import torch
from torchvision import models

from imgtrain import finetune
from imgtrain.errors import ImgtrainError
from imgtrain.models import parts, zoo
from imgtrain.models.resnet18 import ResNet18


def args(name, channels=1, classes=10, stem="standard", size=32):
    return {"architecture": name, "in_channels": channels, "num_classes": classes, "stem": stem,
            "image_size": [size, size]}


@pytest.mark.parametrize("name", [n for n in zoo.LISTED_MODELS if n != "resnet18"])
def test_each_listed_model_takes_the_data_sets_channels_and_classes(name):
    model = zoo.build_from_args(args(name, channels=1, classes=7)).eval()
    assert parts.first_conv(model)[1].in_channels == 1
    with torch.no_grad():
        assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 7)


def test_the_default_model_is_the_configs():  # the driver reads it there, without importing torch
    from imgtrain.config import TrainConfig

    assert TrainConfig.model == zoo.DEFAULT_MODEL


def test_the_default_is_the_tutorials_resnet18_with_torchvisions_names():
    model = zoo.build_from_args({"architecture": "resnet18", "in_channels": 1, "num_classes": 10})
    assert isinstance(model, ResNet18)  # no torchvision import for the default
    assert model.state_dict().keys() == models.resnet18().state_dict().keys()
    assert zoo.model_args({"channels": 1, "num_classes": 10, "image_shape": [28, 28, 1]}) == {
        "architecture": "resnet18", "in_channels": 1, "num_classes": 10}  # what older runs wrote


def test_the_small_stem_keeps_a_28px_digits_resolution():
    small = zoo.build_from_args(args("resnet18", stem="small", size=28))
    assert small.conv1.kernel_size == (3, 3) and small.conv1.stride == (1, 1)
    assert isinstance(small.maxpool, torch.nn.Identity)
    seen = {}
    small.layer4.register_forward_hook(lambda m, i, o: seen.update(shape=o.shape))
    small.eval()(torch.zeros(1, 1, 28, 28))
    assert seen["shape"][-2:] == (4, 4)  # the standard stem leaves 1x1 here
    assert "small-image stem" in zoo.describe(args("resnet18", stem="small"))


def test_the_default_stem_is_small_for_tiny_images_and_the_tutorials_for_mnist():
    digits = {"channels": 1, "num_classes": 10}
    # 28x28 MNIST: the tutorial's model, written as older runs wrote it
    assert zoo.model_args({**digits, "image_shape": [28, 28, 1]}, stem="auto") == {
        "architecture": "resnet18", "in_channels": 1, "num_classes": 10}
    tiny = zoo.model_args({**digits, "image_shape": [8, 8, 1]}, stem="auto")
    assert tiny["stem"] == "small" and tiny["image_size"] == [8, 8]  # stored as chosen: resumes rebuild the same
    assert zoo.model_args({**digits, "image_shape": [8, 8, 1]}, stem="standard").get("stem", "standard") == "standard"
    assert zoo.chosen_stem("resnet18", [16, 20]) == "small" and zoo.chosen_stem("resnet18", [17, 17]) == "standard"
    # models whose first layers imgtrain does not change keep their own
    assert zoo.chosen_stem("vit_b_16", [16, 16]) == zoo.chosen_stem("timm:resnet18", [8, 8]) == "standard"
    assert "small-image stem for 8x8 images" in zoo.describe(tiny)


@pytest.mark.parametrize("meta_args, message", [
    (args("no_such_net"), "no torchvision classification model"),
    (args("vit_b_16", size=28), "multiple of 16"),
    (args("vit_b_16", stem="small"), "no convolution stem"),
    (dict(args("resnet18"), num_classes=10**9), "out of range"),
    (dict(args("resnet18"), stem="tiny"), "not understood"),
])
def test_model_args_that_cannot_be_built_say_why(meta_args, message):
    with pytest.raises(ValueError, match=message):
        zoo.build_from_args(meta_args)


def test_an_unknown_name_suggests_close_ones():
    with pytest.raises(ValueError, match="no torchvision model 'resnet19'; for example resnet18"):
        zoo.check_name("resnet19", "standard")
    with pytest.raises(ValueError, match="mobilenet_v3_small"):
        zoo.check_name("mobilenet_v3_smal", "standard")


def test_torchvision_imagenet_weights_adapt_to_gray_digits(tmp_path):
    torch.manual_seed(0)
    imagenet = models.resnet18()  # 3 channels, 1000 classes: as in torchvision's weights file
    path = tmp_path / "resnet18-imagenet.pth"
    torch.save(imagenet.state_dict(), path)
    model = zoo.build_from_args({"architecture": "resnet18", "in_channels": 1, "num_classes": 10})
    report = finetune.initialise(model, str(path), "resnet18")
    assert torch.equal(model.conv1.weight, imagenet.conv1.weight.sum(1, keepdim=True))
    assert torch.equal(model.layer3[1].conv2.weight, imagenet.layer3[1].conv2.weight)
    assert torch.equal(model.bn1.running_var, imagenet.bn1.running_var)
    assert model.fc.weight.shape == (10, 512)
    assert report.adapted == ["conv1.weight (3 -> 1 channels, summed)"]
    assert report.new == ["fc.weight, fc.bias (1000 -> 10 classes)"]
    assert len(report.loaded) == len(model.state_dict()) - 3
    line = report.summary(str(path))
    assert "119 tensors loaded" in line and "adapted conv1.weight" in line and "new fc.weight" in line


def test_a_gray_run_starts_an_rgb_model_and_wrapped_files_are_unwrapped(tmp_path):
    gray = zoo.build_from_args(args("mobilenet_v3_small", channels=1))
    wrapped = {"state_dict": {"module." + k: v for k, v in gray.state_dict().items()}}  # DDP in a Lightning file
    torch.save(wrapped, tmp_path / "gray.ckpt")
    rgb = zoo.build_from_args(args("mobilenet_v3_small", channels=3))
    report = finetune.initialise(rgb, str(tmp_path / "gray.ckpt"), "mobilenet_v3_small")
    conv = "features.0.0.weight"
    assert torch.allclose(rgb.state_dict()[conv], gray.state_dict()[conv].repeat(1, 3, 1, 1) / 3)
    assert report.adapted == [f"{conv} (1 -> 3 channels, spread)"] and not report.new


def test_the_small_stem_starts_from_a_standard_file_with_a_new_first_layer(tmp_path):
    torch.save(models.resnet18().state_dict(), tmp_path / "r18.pt")
    model = zoo.build_from_args(args("resnet18", stem="small"))
    report = finetune.initialise(model, str(tmp_path / "r18.pt"), "resnet18")
    assert report.new[0] == "conv1.weight (another kernel size)"


@pytest.mark.parametrize("saved, message", [
    ("resnet50", r"'layer1.0.conv1.weight' is \[64, 64, 1, 1\] in the file and \[64, 64, 3, 3\]"),
    ("resnet34", "the file has 96 tensors the model has not"),  # every resnet18 name is in a resnet34
    ("mobilenet_v3_small", "is missing from the file"),
])
def test_a_file_for_another_architecture_is_refused(tmp_path, saved, message):
    torch.save(getattr(models, saved)().state_dict(), tmp_path / "w.pt")
    model = zoo.build_from_args({"architecture": "resnet18", "in_channels": 3, "num_classes": 1000})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ImgtrainError, match=message):
        finetune.initialise(model, str(tmp_path / "w.pt"), "resnet18")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing half-loaded


class Payload:
    def __reduce__(self):
        return (print, ("unpickled",))


def test_a_file_that_is_not_plain_tensors_is_never_unpickled(tmp_path, capsys):
    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"conv1.weight": Payload()}))
    with pytest.raises(ImgtrainError, match="not a state dict PyTorch can read safely"):
        finetune.read_state_dict(tmp_path / "evil.pt")
    assert "unpickled" not in capsys.readouterr().out
    with pytest.raises(ImgtrainError, match="no such file"):
        finetune.read_state_dict(tmp_path / "missing.pt")


def test_a_timm_model_by_name_with_its_own_channel_and_head_handling(tmp_path):
    model = zoo.build_from_args(args("timm:resnet10t", channels=1, classes=5)).eval()
    with torch.no_grad():
        assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 5)
    assert parts.head_name(model) == "fc" and parts.first_conv(model)[1].in_channels == 1
    rgb = zoo.build_from_args(args("timm:resnet10t", channels=3, classes=1000))
    torch.save(rgb.state_dict(), tmp_path / "timm.pt")
    report = finetune.initialise(model, str(tmp_path / "timm.pt"), "timm:resnet10t")
    assert report.new == ["fc.weight, fc.bias (1000 -> 5 classes)"] and len(report.adapted) == 1
    with pytest.raises(ValueError, match="timm has no model 'no_such_net'"):
        zoo.check_name("timm:no_such_net", "standard")
