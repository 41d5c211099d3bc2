"""FSDP pieces in a world of one process (a real gloo process group in this process): which
modules become units, the weight average on sharded parameters, bfloat16 with BatchNorm, and
the sharded state's round trip. The 2-worker runs are in tests/integration/test_fsdp.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from imgtrain.models.resnet18 import build_resnet18
from imgtrain.models.zoo import build_from_args
from imgtrain.training import fsdp
from imgtrain.training.recipe import WeightAverage

CPU = torch.device("cpu")


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_units_are_blocks_or_stages():
    resnet = build_resnet18(1, 10)
    assert [type(u).__name__ for u in fsdp.units(resnet)] == ["BasicBlock"] * 8  # layer1-4, two each
    mobilenet = build_from_args({"architecture": "mobilenet_v3_small", "in_channels": 1, "num_classes": 10,
                                 "image_size": [28, 28]})
    units = fsdp.units(mobilenet)
    assert units[:len(mobilenet.features)] == list(mobilenet.features)  # stem and every inverted residual
    assert units[len(mobilenet.features):] == [mobilenet.classifier[0], mobilenet.classifier[3]]  # the two Linear


def test_the_average_of_sharded_weights_is_the_average_of_plain_ones(world_of_one):
    torch.manual_seed(0)
    plain = build_resnet18(1, 10)
    sharded = fsdp.shard(copy.deepcopy(plain), CPU, "fp32")
    assert fsdp.is_sharded(sharded) and not fsdp.is_sharded(plain)
    averages = (WeightAverage(plain, 0.9), WeightAverage(sharded, 0.9, fsdp.shard(build_resnet18(1, 10), CPU, "fp32")))
    for step in range(4):
        for model, average in zip((plain, sharded), averages):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.01).add_(0.001 * step)  # the same change to both
            average.update()
    expected = averages[0].module.state_dict()
    got = fsdp.full_state(averages[1].module)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert not torch.equal(expected["fc.weight"], plain.fc.weight.detach())  # really an average


def test_bfloat16_runs_blocks_in_bfloat16_and_batchnorm_in_float32(world_of_one):
    torch.manual_seed(0)
    model = fsdp.shard(build_resnet18(1, 10), CPU, "bf16")
    seen = {}
    for name in ("layer1.0.conv1", "layer1.0.bn1"):  # the weights each layer runs with (gathered)
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: seen.update({name: m.weight.dtype}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 1, 28, 28)).float().logsumexp(1).sum()
    loss.backward()
    assert torch.isfinite(loss)
    assert seen == {"layer1.0.conv1": torch.bfloat16, "layer1.0.bn1": torch.float32}
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # reduced and kept in float32
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the sharded weights themselves


def test_another_family_in_bfloat16_trains_and_gathers_float32_weights(world_of_one):
    # MobileNet-V3: its units are the entries of `features`, with BatchNorm inside them (each
    # its own float32 unit). A few optimizer steps in bfloat16, then the plain state dict that
    # model.pt holds: float32 and finite. (This was a 2-worker Ray run; what differs from the
    # ResNet runs of tests/integration/test_fsdp.py is the sharding, which is this process's.)
    torch.manual_seed(0)
    model = fsdp.shard(build_from_args({"architecture": "mobilenet_v3_small", "in_channels": 1, "num_classes": 10,
                                        "image_size": [28, 28]}), CPU, "bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, labels = torch.randn(8, 1, 28, 28), torch.arange(8) % 10
    losses = []
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(images).float(), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    state = fsdp.full_state(model)
    floats = [v for v in state.values() if v.is_floating_point()]
    assert floats and {v.dtype for v in floats} == {torch.float32}
    assert all(torch.isfinite(v).all() for v in floats)
    plain = build_from_args({"architecture": "mobilenet_v3_small", "in_channels": 1, "num_classes": 10,
                             "image_size": [28, 28]})
    plain.load_state_dict(state)  # what every other verb loads from model.pt


def test_the_sharded_state_round_trips(world_of_one, tmp_path):
    torch.manual_seed(0)
    model = fsdp.shard(build_resnet18(1, 10), CPU, "fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    optimizer.step()
    ema = fsdp.shard(build_resnet18(1, 10), CPU, "fp32")
    hashes = fsdp.save_sharded(tmp_path / "sharded", model, optimizer, ema)
    assert sorted(hashes) == ["sharded/.metadata", "sharded/__0_0.distcp"]

    torch.manual_seed(1)  # other weights, an optimizer without state
    model2 = fsdp.shard(build_resnet18(1, 10), CPU, "fp32")
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    ema2 = fsdp.shard(build_resnet18(1, 10), CPU, "fp32")
    fsdp.load_sharded(tmp_path / "sharded", model2, optimizer2, ema2)
    for a, b in ((model, model2), (ema, ema2)):
        sa, sb = fsdp.full_state(a), fsdp.full_state(b)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    moments = [optimizer.state[p]["exp_avg"].to_local() for p in model.parameters()]
    assert all(torch.equal(m, optimizer2.state[p]["exp_avg"].to_local())
               for m, p in zip(moments, model2.parameters()))


class RunsCode:
    """What a crafted pickle does: calls a function while it is read."""

    def __reduce__(self):
        return (print, ("this ran while loading",))


def test_a_crafted_sharded_checkpoint_runs_no_code_on_resume(world_of_one, tmp_path, capsys):
    import pickle

    torch.manual_seed(0)
    model = fsdp.shard(build_resnet18(1, 10), CPU, "fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp.save_sharded(tmp_path / "sharded", model, optimizer, None)
    metadata_file = tmp_path / "sharded" / ".metadata"
    metadata = fsdp.read_metadata(metadata_file.open("rb"))  # the real one reads with the allowed classes only
    assert metadata.state_dict_metadata

    metadata_file.write_bytes(pickle.dumps(RunsCode()))
    with pytest.raises(pickle.UnpicklingError, match="print is not part of a checkpoint's metadata"):
        fsdp.read_metadata(metadata_file.open("rb"))
    with pytest.raises(RuntimeError, match="print is not part of a checkpoint's metadata"):
        fsdp.load_sharded(tmp_path / "sharded", model, optimizer, None)

    # A non-tensor item (an optimizer hyperparameter) replaced by a pickle that runs code:
    fsdp.save_sharded(tmp_path / "sharded", model, optimizer, None)
    metadata = fsdp.read_metadata(metadata_file.open("rb"))
    lr = next(info for index, info in metadata.storage_data.items() if index.fqn.endswith("param_groups.0.lr"))
    shard = tmp_path / "sharded" / lr.relative_path
    payload = io.BytesIO()
    torch.save(RunsCode(), payload)
    lr.offset, lr.length = shard.stat().st_size, len(payload.getvalue())  # appended, the index pointing at it
    with shard.open("ab") as f:
        f.write(payload.getvalue())
    metadata_file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(RuntimeError, match="Weights only load failed"):
        fsdp.load_sharded(tmp_path / "sharded", model, optimizer, None)
    assert "this ran while loading" not in capsys.readouterr().out


def test_a_fully_sharded_model_is_still_an_nn_module(world_of_one):
    model = fsdp.shard(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), CPU, "fp32")
    assert isinstance(model, nn.Module) and len(fsdp.units(model)) == 2
