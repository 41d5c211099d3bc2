"""How a failed Ray run is explained: the root cause of a worker's failure, a full disk."""

import errno

import pytest

from imgtrain.errors import ImgtrainError
from imgtrain.ops.files import disk_full
from imgtrain.training import faults
from imgtrain.training.ray_backend import _root_cause


class Wrapped(Exception):
    """As Ray wraps a worker's exception: the original under ``cause``."""

    def __init__(self, message, cause):
        super().__init__(message)
        self.cause = cause


class GroupFailed(Exception):
    def __init__(self, failures):
        super().__init__("Training failed due to worker errors:\n...\nlast line of Ray's message")
        self.worker_failures = failures


def test_the_root_cause_names_the_rank_and_the_innermost_exception():
    inner = ValueError("bad things\nthe last line says what")
    error = GroupFailed({1: Wrapped("ray wrapper", Wrapped("another", inner))})
    assert _root_cause(error) == "rank 1: ValueError: the last line says what"


def test_an_imgtrain_error_on_a_worker_is_shown_as_it_is():
    error = GroupFailed({0: Wrapped("ray wrapper", ImgtrainError("--precision bf16: this GPU has no bfloat16; use fp32"))})
    assert _root_cause(error) == "--precision bf16: this GPU has no bfloat16; use fp32"
    assert _root_cause(RuntimeError("one\ntwo")) == "two"  # no worker failures: Ray's own last line


def test_ranks_the_watchdog_killed_are_not_their_own_cause():
    # Ray calls a SIGKILLed worker a possible OOM kill; after a stall the cause is what the others saw.
    killed = Wrapped("ray", RuntimeError("The actor died unexpectedly... due to the kernel OOM killing."))
    waiting = Wrapped("ray", RuntimeError("gloo: connection closed by peer"))
    assert _root_cause(GroupFailed({0: waiting, 1: killed}), skip_ranks={1}) == "rank 0: RuntimeError: gloo: connection closed by peer"
    assert _root_cause(GroupFailed({1: killed}), skip_ranks={1}) == ""


def test_a_full_disk_is_found_however_deep_it_is_wrapped():
    full = OSError(errno.ENOSPC, "No space left on device")
    assert disk_full(GroupFailed({0: Wrapped("ray", Wrapped("upload failed", full))}))
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("checkpoint upload failed") from e
    except RuntimeError as chained:
        assert disk_full(chained)
    assert not disk_full(GroupFailed({0: Wrapped("ray", ValueError("nan loss"))}))


def test_an_injected_fault_for_one_run_fires_in_that_run_only(tmp_path):
    fault = faults.parse("raise:0:3:2@trial-00001")
    assert (fault.kind, fault.rank, fault.step, fault.times, fault.run) == ("raise", 0, 3, 2, "trial-00001")
    faults.maybe_fire(fault, 0, 3, tmp_path / "trial-00000")  # another trial of the sweep: nothing
    assert not (tmp_path / "trial-00000" / ".faults").exists()
    with pytest.raises(faults.InjectedFault):
        faults.maybe_fire(fault, 0, 3, tmp_path / "trial-00001")
    assert faults.parse("hang:0:20").run is None  # every run
    for bad in ("raise:0:3@", "raise:0@trial", "bend:0:3@trial"):
        with pytest.raises(ImgtrainError, match=r"KIND:RANK:STEP\[:TIMES\]\[@RUN\]"):
            faults.parse(bad)
