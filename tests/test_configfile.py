import dataclasses
import json
import tomllib

import pytest

from imgtrain.config import TrainConfig, validate
from imgtrain.configfile import as_toml, describe_fields, read_config_file
from imgtrain.errors import ImgtrainError


def write(tmp_path, text: str, name: str = "run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_config_file_sets_fields_with_flag_names_hyphens_and_elastic_workers(tmp_path):
    values, problems = read_config_file(write(tmp_path, """
        data = "data/mnist-sample"
        name = "demo"
        batch-size = 64        # a flag's spelling
        gpu = false            # the flag's name for use_gpu
        stall_timeout = 30     # the flag's name for stall_timeout_s, an int for a float
        workers = "1-4"        # elastic, as on the command line
        lr = 1e-3
    """))
    assert problems == []
    assert values == {"data": "data/mnist-sample", "name": "demo", "batch_size": 64, "use_gpu": False,
                      "stall_timeout_s": 30.0, "min_workers": 1, "workers": 4, "lr": 0.001}
    assert isinstance(values["stall_timeout_s"], float)


def test_every_problem_in_a_file_is_reported_at_once_with_the_values_problems(tmp_path):
    values, problems = read_config_file(write(tmp_path, """
        epoch = 3              # misspelt
        lr = "fast"
        workers = true         # a bool is not an int
        augment = 1
        batch_size = -1        # the right type, a bad value: validate() finds it
    """))
    assert problems == [
        "unknown field 'epoch' (did you mean 'epochs'?)",
        "lr must be a number, got 'fast'",
        "workers must be an integer, got True",
        "augment must be true or false, got 1",
    ]
    with pytest.raises(ImgtrainError) as e:
        validate(TrainConfig(**values), problems)
    message = str(e.value)
    assert all(p in message for p in problems)
    assert "--batch-size must be at least 0, got -1" in message and "--name is required" in message
    assert "\n" not in message


def test_unreadable_and_malformed_files_are_one_clear_error(tmp_path):
    with pytest.raises(ImgtrainError, match="cannot read config file .*missing.toml"):
        read_config_file(tmp_path / "missing.toml")
    with pytest.raises(ImgtrainError, match=r"is not valid TOML: .*line 1"):
        read_config_file(write(tmp_path, "epochs = = 3"))
    with pytest.raises(ImgtrainError, match="must hold a table of fields"):
        read_config_file(write(tmp_path, "[1, 2]", "list.json"))


def test_a_runs_config_json_is_a_config_file(tmp_path):
    from imgtrain.storage.runs import versions

    cfg = TrainConfig(name="a", data="d", lr=0.01, address=None, mlflow=None)
    values, problems = read_config_file(write(tmp_path, json.dumps({**cfg.to_dict(), **versions()}), "config.json"))
    assert problems == [] and TrainConfig(**values) == cfg


def test_the_template_lists_every_field_with_its_default_and_parses_back(tmp_path):
    text = as_toml()
    values, problems = read_config_file(write(tmp_path, text))
    assert problems == []
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    unset = {k for k, v in defaults.items() if v is None}  # TOML has no null: written commented out
    assert values == {k: v for k, v in defaults.items() if k not in unset}
    assert all(f"# {k} = " in text for k in unset)
    assert tomllib.loads(text)["epochs"] == TrainConfig.epochs


def test_config_show_rows_are_one_line_each():
    rows = describe_fields()
    assert [r[0] for r in rows] == [f.name for f in dataclasses.fields(TrainConfig)]
    for name, value, description in rows:
        assert description and "\n" not in description and "``" not in description, name
        assert description.endswith((".", ")")), (name, description)
    assert dict((r[0], r[1]) for r in rows)["epochs"] == "12"
    assert dict((r[0], r[1]) for r in describe_fields({"epochs": 3}))["epochs"] == "3"


def test_imgtrain_config_fills_only_the_settings_a_run_leaves_at_their_defaults(tmp_path, monkeypatch):
    """A script or notebook run as written with other settings: the file's values go where the
    code set nothing; what it set stays (here: workers and lr)."""
    from imgtrain.configfile import ENV_VAR, environment_settings

    cfg = TrainConfig(name="nb", data="d", workers=4, lr=1e-3)
    assert environment_settings(cfg) == (cfg, [])  # no variable: as it was
    monkeypatch.setenv(ENV_VAR, str(write(tmp_path, """
        epochs = 1
        workers = 1
        lr = 0.01
        backend = "local"
        seed = 0               # the default already: nothing taken
    """)))
    taken, names = environment_settings(cfg)
    assert names == ["backend", "epochs"]
    assert (taken.epochs, taken.backend, taken.workers, taken.lr, taken.name) == (1, "local", 4, 1e-3, "nb")
    monkeypatch.setenv(ENV_VAR, str(write(tmp_path, "epochs = \"one\"\n")))
    with pytest.raises(ImgtrainError, match=r"^IMGTRAIN_CONFIG=.*: epochs must be an integer, got 'one'$"):
        environment_settings(cfg)
