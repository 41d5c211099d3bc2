import os

import pytest
import torch

from imgtrain.models.resnet18 import build_resnet18
from imgtrain.storage import checkpoint as ckpt


def save_one(path):
    model = build_resnet18(1, 10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(2, 1, 28, 28)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=10)
    state = {ckpt.OPTIMIZER_KEY: opt.state_dict(), ckpt.SCHEDULER_KEY: sched.state_dict(),
             ckpt.EPOCH_KEY: 3, ckpt.STEP_KEY: 40,
             ckpt.RNG_KEY: {"torch": torch.get_rng_state()}}
    ckpt.save(path, model.state_dict(), state, {"epoch": 3, "step": 40, "metrics": {"val_accuracy": 0.5}})
    return model


def test_round_trip_with_weights_only(tmp_path):
    model = save_one(tmp_path)
    meta = ckpt.verify(tmp_path)
    assert set(meta["sha256"]) == {ckpt.MODEL_FILE, ckpt.TRAIN_STATE_FILE}
    loaded = ckpt.load_model_state(tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    state = ckpt.load_train_state(tmp_path)
    assert state[ckpt.EPOCH_KEY] == 3 and state[ckpt.STEP_KEY] == 40
    assert "total_steps" in state[ckpt.SCHEDULER_KEY]


def test_tampered_file_is_named(tmp_path):
    save_one(tmp_path)
    with open(tmp_path / ckpt.MODEL_FILE, "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ckpt.CheckpointError, match="model.pt fails its sha256"):
        ckpt.verify(tmp_path)


def test_directory_without_meta_is_not_a_checkpoint(tmp_path):
    save_one(tmp_path)
    os.remove(tmp_path / ckpt.META_FILE)
    with pytest.raises(ckpt.CheckpointError, match="meta.json is missing"):
        ckpt.verify(tmp_path)


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_arbitrary_pickled_object_is_refused(tmp_path):
    save_one(tmp_path)
    torch.save({"evil": Payload()}, tmp_path / ckpt.TRAIN_STATE_FILE)
    with pytest.raises(ckpt.CheckpointError, match="refusing to load"):
        ckpt.load_train_state(tmp_path)


def test_meta_without_hashes_cannot_be_verified(tmp_path):
    import json

    save_one(tmp_path)
    meta = json.loads((tmp_path / ckpt.META_FILE).read_text())
    del meta["sha256"][ckpt.MODEL_FILE]
    (tmp_path / ckpt.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="no sha256 for model.pt"):
        ckpt.verify(tmp_path)


def test_files_other_ranks_wrote_are_verified_too(tmp_path):
    # FSDP: rank 1's shard lands in the checkpoint beside rank 0's files; meta.json has its hash.
    (tmp_path / ckpt.SHARDED_DIR).mkdir()
    shard = tmp_path / ckpt.SHARDED_DIR / "__1_0.distcp"
    shard.write_bytes(b"rank 1's shard")
    from imgtrain.ops.files import sha256_file

    model = build_resnet18(1, 10)
    ckpt.save(tmp_path, model.state_dict(), {}, {}, {"sharded/__1_0.distcp": sha256_file(shard)})
    assert set(ckpt.verify(tmp_path)["sha256"]) == {ckpt.MODEL_FILE, ckpt.TRAIN_STATE_FILE, "sharded/__1_0.distcp"}
    shard.unlink()
    with pytest.raises(ckpt.CheckpointError, match="__1_0.distcp is missing"):
        ckpt.verify(tmp_path)


def test_a_meta_json_naming_files_outside_the_checkpoint_is_refused(tmp_path):
    save_one(tmp_path / "c")
    (tmp_path / "secret").write_text("x")
    from imgtrain.ops.files import sha256_file

    meta = ckpt.read_meta(tmp_path / "c")
    meta["sha256"]["../secret"] = sha256_file(tmp_path / "secret")
    (tmp_path / "c" / ckpt.META_FILE).write_text(__import__("json").dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="names a file outside the checkpoint"):
        ckpt.verify(tmp_path / "c")
