"""The worker-group start timeout an elastic run gives Ray Train, and that a user's own wins."""

import os

from imgtrain.training.ray_backend import (
    ELASTIC_START_TIMEOUT_S,
    START_TIMEOUT_ENV,
    _start_timeout,
)


def test_an_elastic_fit_waits_less_for_its_workers_and_leaves_the_environment_as_it_was(monkeypatch):
    monkeypatch.delenv(START_TIMEOUT_ENV, raising=False)
    with _start_timeout(elastic=True):
        assert os.environ[START_TIMEOUT_ENV] == str(ELASTIC_START_TIMEOUT_S)
    assert START_TIMEOUT_ENV not in os.environ
    with _start_timeout(elastic=False):  # a fixed-size run keeps Ray's default
        assert START_TIMEOUT_ENV not in os.environ


def test_a_timeout_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(START_TIMEOUT_ENV, "300")
    with _start_timeout(elastic=True):
        assert os.environ[START_TIMEOUT_ENV] == "300"
    assert os.environ[START_TIMEOUT_ENV] == "300"
