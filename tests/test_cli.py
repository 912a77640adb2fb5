"""The command line and the settings schema.

Command-line truths: `calibrate` lists the model's own verdicts, help texts match behaviour.

The one description of settings (`cotangent.harness.schema`): types from annotations,
bounds and choices from the field, one-line errors; TrainConfig and Protocol use it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
from cotangent import calibration
from cotangent.harness import cli, schema
from cotangent.harness.commands import calibrate
from cotangent.harness.commands import train as commands_train
from cotangent.harness.campaign import Protocol
from cotangent.harness.schema import setting
from cotangent.harness.train import TrainConfig, format_config, settings_of, train_config
from cotangent.norms import bucket_norm_is_exact


def _calibrate(model: str, capsys) -> tuple[list[str], list[dict]]:
    assert cli.main(["calibrate", "--model", model, "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return lines, json.loads(lines[-1])


@pytest.mark.e2e
def test_calibrate_lists_only_the_verdicts_of_that_models_layout(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    # A verdict some other model left in the cache file (a length no tiny model has).
    foreign = calibration.full_key("bucket_norm", "cpu", ("torch.float32", 123457, 3, 2.0),
                                   probe=bucket_norm_is_exact)
    calibration.record(foreign, True)
    assert foreign in {calibrate.calibration_key(r) for r in calibration.table()}

    lines, rows = _calibrate("tiny-transformer", capsys)
    keys = {calibrate.calibration_key(r) for r in rows}
    assert rows and foreign not in keys
    assert not any("123457" in line for line in lines)
    assert f"{len(rows)} verdicts used by tiny-transformer" in "\n".join(lines)
    every = {calibrate.calibration_key(r) for r in calibration.table()}
    assert keys < every  # a strict subset: the cache holds more than this model uses

    _, conv_rows = _calibrate("tiny-causal-conv", capsys)
    conv_keys = {calibrate.calibration_key(r) for r in conv_rows}
    assert conv_keys and foreign not in conv_keys
    # cotangent.AdamW packs nothing: its verdicts follow the settings, not the model's layout
    assert conv_keys == keys
    # run again from the cache: the same verdicts, none dropped, none added
    _, again = _calibrate("tiny-transformer", capsys)
    assert {calibrate.calibration_key(r) for r in again} == keys


@pytest.mark.e2e
def test_calibrate_restores_the_calibration_functions(capsys):
    lookup, record = calibration.lookup, calibration.record
    _calibrate("tiny", capsys)
    assert (calibration.lookup, calibration.record) == (lookup, record)


def test_report_help_counts_the_figures_it_writes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "five PNG figures," not in text
    assert "four PNG figures (five when the campaign ran the four arms of the 2x2 factorial)" \
        in text


def test_bench_help_names_the_shapes(capsys):
    from cotangent.harness.bench import SHAPES

    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(shape in text for shape in SHAPES)


@pytest.mark.slow
@pytest.mark.slow
def test_command_without_the_harness_extra_names_it_in_one_line():
    """A core-only install (`pip install cotangent`): the `cotangent` command's entry point
    says which extra to install (exit 2, no traceback). Simulated by blocking numpy."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['numpy'] = None; "
            "from cotangent._entry import main; sys.exit(main(['train']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines()[-1] == (
        "cotangent: the command needs the harness extra (numpy is not installed): "
        "pip install 'cotangent[harness]'")
    assert "Traceback" not in out.stderr


@dataclass(frozen=True, kw_only=True)
class Example:
    name: str = setting("a name", pattern=r"[a-z]+")
    count: int = setting("how many", 1, low=1, high=10)
    rate: float = setting("a rate", 0.5, low=0.0, high=1.0, high_open=True)
    scale: float = setting("a scale", 1.0, low=0.0, low_open=True)
    flag: bool = setting("on or off", False)
    kind: str = setting("which", "a", choices=("a", "b", "c"))
    pair: tuple[float, float] = setting("two numbers", (0.1, 0.2), low=0.0)
    names: tuple[str, ...] = setting("some names", ("a",), choices=("a", "b", "c"),
                                     min_items=1, distinct=True)
    target: float | dict[str, float] = setting("one or per key", 1.0, low=0.0, low_open=True)


def _error(values: dict, **kw) -> str:
    with pytest.raises(ValueError) as info:
        schema.check(Example, values, **kw)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_values_are_converted_to_what_the_fields_hold():
    got = schema.check(Example, {"name": "x", "rate": 0, "pair": [1, 2.5], "names": ["b", "a"],
                                 "target": {"p": 2}, "scale": 3})
    assert got == {"name": "x", "rate": 0.0, "pair": (1.0, 2.5), "names": ("b", "a"),
                   "target": {"p": 2.0}, "scale": 3.0}
    assert type(got["rate"]) is float and type(got["target"]["p"]) is float
    assert schema.check(Example, {"target": 4})["target"] == 4.0


@pytest.mark.parametrize("values, message", [
    ({"count": 0}, "count must be an integer from 1 to 10, got 0"),
    ({"count": 2.0}, "count must be an integer from 1 to 10, got 2.0"),
    ({"count": True}, "count must be an integer from 1 to 10, got True"),
    ({"rate": 1.0}, "rate must be a number in [0, 1), got 1.0"),
    ({"rate": float("nan")}, "rate must be a number in [0, 1), got nan"),
    ({"scale": 0}, "scale must be a finite number > 0, got 0"),
    ({"scale": float("inf")}, "scale must be a finite number > 0, got inf"),
    ({"scale": 10**400}, "scale must be a finite number > 0, got 1000"),
    ({"flag": 1}, "flag must be true or false, got 1"),
    ({"kind": "d"}, "kind must be a, b or c, got 'd'"),
    ({"name": "A"}, "name must be a string matching [a-z]+, got 'A'"),
    ({"pair": [0.1]}, "pair must be a list of two numbers >= 0, got [0.1]"),
    ({"pair": "0.1,0.2"}, "pair must be a list of two numbers >= 0, got '0.1,0.2'"),
    ({"names": []}, "names must be a non-empty list of distinct names from a, b or c, got []"),
    ({"names": ["a", "a"]}, "names must be a non-empty list of distinct names"),
    ({"names": ["a", "z"]}, "names must be a non-empty list of distinct names"),
    ({"target": {"p": -1.0}}, "target must be a finite number > 0, or a table of numbers > 0"),
    ({"target": "x"}, "target must be a finite number > 0, or a table of numbers > 0, got 'x'"),
])
def test_bad_values_are_one_line_errors_naming_the_field(values, message):
    assert message in _error(values, where="f.toml: ")
    assert _error(values, where="f.toml: ").startswith("f.toml: ")


def test_unknown_missing_and_disallowed_keys():
    assert _error({"nope": 1, "count": 2}) == (
        "unknown setting(s) nope; known: name, count, rate, scale, flag, kind, pair, names, "
        "target")
    assert _error({"count": 2}, complete=True, noun="key") == "missing key(s) name"
    assert _error({"kind": "a"}, allowed=["count"]) == "unknown setting(s) kind; known: count"


def test_every_field_of_the_real_settings_is_described():
    for cls in (TrainConfig, Protocol):
        for name, spec in schema.specs(cls).items():
            assert spec.doc and spec.kinds, (cls.__name__, name)
    assert schema.required(Protocol) == ["name", "models", "arms", "seeds", "steps",
                                          "eval_every", "target_bpb", "level", "margin_bpb"]
    # the defaults pass their own descriptions
    values = schema.flatten(TrainConfig())
    assert list(values) == list(schema.specs(TrainConfig))
    assert schema.check(TrainConfig, values) == values
    assert schema.build(TrainConfig, values) == TrainConfig()


def test_a_field_without_a_description_is_refused():
    @dataclass
    class Bare:
        x: int = 0

    with pytest.raises(TypeError, match="Bare.x is not declared with schema.setting or "
                                        "schema.section"):
        schema.specs(Bare)


def test_train_help_comes_from_the_field_descriptions(capsys):
    from cotangent.harness import cli

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    specs = schema.specs(TrainConfig)
    for name in commands_train.TRAIN_FLAGS:
        assert " ".join(specs[name].doc.split()) in text, name
    assert "--batch-size BATCH_SIZE" in text and "{cpu,cuda,mps}" in text


# --------------------------------------------------------------------------- nested train config

def _resolved(argv: list[str]) -> TrainConfig:
    """`cotangent train ARGV`'s resolved config, without training."""
    import argparse

    parser = argparse.ArgumentParser()
    commands_train.add_parser(parser.add_subparsers())
    return commands_train.resolve_train_config(parser.parse_args(["train", *argv]))


def test_train_config_is_nested_by_section():
    cfg = train_config(model="tiny", compile=True, lr=3e-4, betas=[0.8, 0.9], muon_lr=0.05,
                       muon_compile=True, eval_every=5, eval_batch=4, batch_size=2)
    assert (cfg.model.name, cfg.model.compile) == ("tiny", True)
    assert (cfg.optimizer.lr, cfg.optimizer.betas) == (3e-4, (0.8, 0.9))
    assert (cfg.muon.lr, cfg.muon.compile) == (0.05, True)
    assert (cfg.eval.every, cfg.eval.batch, cfg.data.batch_size) == (5, 4, 2)
    assert settings_of(cfg)["muon_lr"] == 0.05 and settings_of(cfg)["eval_every"] == 5
    # the sections' own defaults, untouched by the others
    assert cfg.muon.weight_decay == 0.0 and cfg.optimizer.weight_decay == 0.1
    with pytest.raises(ValueError, match="lr must be a finite number >= 0, got -1"):
        train_config(lr=-1)
    with pytest.raises(ValueError, match="unknown setting"):
        train_config(muon_nope=1)


@pytest.mark.parametrize("text", [
    # the tables a run's config.toml holds
    '[model]\nname = "tiny"\n[optimizer]\nlr = 0.003\n[muon]\nlr = 0.05\n[eval]\nevery = 7\n',
    # setting names at the top level (config files written before the sections)
    'model = "tiny"\nlr = 0.003\nmuon_lr = 0.05\neval_every = 7\n',
    # dotted keys, TOML's other spelling of the tables
    'model.name = "tiny"\noptimizer.lr = 0.003\nmuon.lr = 0.05\neval.every = 7\n',
])
def test_a_config_file_may_use_sections_or_setting_names(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    cfg = _resolved(["--config", str(path)])
    assert (cfg.model.name, cfg.optimizer.lr, cfg.muon.lr, cfg.eval.every) == (
        "tiny", 0.003, 0.05, 7)


def test_the_saved_config_loads_back_as_the_same_config(tmp_path):
    cfg = _resolved(["--model", "tiny", "--steps", "9", "--eval-every", "3", "--set",
                     "optimizer.betas=[0.5, 0.6]", "--set", "muon_ns_steps=3",
                     "--arms", "native,cotangent"])
    assert cfg.optimizer.betas == (0.5, 0.6) and cfg.muon.ns_steps == 3
    path = tmp_path / "config.toml"
    path.write_text(format_config(cfg))
    assert "[optimizer]\nlr = " in path.read_text()
    assert _resolved(["--config", str(path)]) == cfg


@pytest.mark.parametrize("argv, message", [
    (["--set", "optimizer.nope=1"], "unknown setting optimizer.nope; known in [optimizer]: lr, "
                                    "betas, eps, weight_decay, max_norm"),
    (["--set", "muon.lr=-1"], "muon_lr must be a finite number >= 0, got -1"),
    (["--set", "eval=3"], "eval must be a table of settings ([eval])"),
    (["--set", "optimiser.lr=1"], "unknown section [optimiser] (in optimiser.lr); sections: "
                                  "model, optimizer, muon, eval, data"),
    (["--set", "lrr=1"], "(or by section: model, optimizer, muon, eval, data)"),
])
def test_a_bad_section_setting_is_one_line(argv, message, capsys):
    assert cli.main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ('lr = 0.1\n[optimizer]\nlr = 0.2\n', "setting lr is given twice (as lr and as optimizer.lr)"),
    ('[foo]\nx = 1\n', "unknown section [foo] (in foo); sections: model, optimizer, muon, "
                      "eval, data"),
    ('lrr = 1\n', "unknown setting(s) lrr; known: steps, seed"),
    ('[eval]\neval_every = 5\n', "unknown setting eval.eval_every (in [eval] it is every)"),
    ('[muon]\nlr = "x"\n', "muon_lr must be a finite number >= 0, got 'x'"),
    ('arms = "native,nope"\n', "arms must be"),
])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, capsys, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["--set", "betas=0.8,0.9"], ["--set", "optimizer.betas=0.8,0.9"],
                                  ["--set", "optimizer.betas=[0.8, 0.9]"]])
def test_a_comma_list_of_numbers_is_a_list_of_numbers(argv):
    assert _resolved(argv).optimizer.betas == (0.8, 0.9)
    assert _resolved(["--arms", "native,cotangent,packed"]).arms == ("native", "cotangent",
                                                                     "packed")


def test_a_config_built_without_its_sections_is_one_line():
    from cotangent.harness.train import validate_config

    with pytest.raises(ValueError, match=r"model must be a ModelSettings \(build a config from "
                                         r"setting names with train_config"):
        validate_config(TrainConfig(model="tiny"))
    with pytest.raises(ValueError, match="optimizer must be a OptimizerSettings"):
        validate_config(TrainConfig(optimizer={"lr": 1.0}))


def test_any_out_path_loads_back_from_the_saved_config(tmp_path):
    cfg = train_config(out=str(tmp_path / "runs \u00e9 \U0001f600 \x7f \" \\ x"))
    path = tmp_path / "config.toml"
    path.write_text(format_config(cfg), encoding="utf-8")
    assert _resolved(["--config", str(path)]) == cfg


def test_the_audit_finds_every_setting_where_the_config_holds_it():
    """The stdlib-only audit's copy of the setting paths is `TrainConfig`'s."""
    from cotangent.harness import audit

    paths = {name: spec.path for name, spec in schema.specs(TrainConfig).items()
             if len(spec.path) > 1}
    assert audit.SETTING_PATHS == paths
    nested = json.loads(json.dumps(dataclasses.asdict(train_config(model="tiny", lr=0.5))))
    flat = json.loads(json.dumps(settings_of(train_config(model="tiny", lr=0.5))))
    for name, value in flat.items():
        assert audit.config_setting(nested, name) == value, name
        assert audit.config_setting(flat, name) == value, name  # records before the sections
    assert repr(audit.config_setting(nested, "nope")) == "(missing)"
    # a nested record is read at the sections' paths alone: a stray top-level key is no
    # setting (a review's tampered record passed through one)
    assert audit.config_setting({**nested, "muon_lr": 9.0}, "muon_lr") == nested["muon"]["lr"]
    assert audit.train_settings({"optimizer": {"lr": 1.0}, "muon": {"lr": 2.0},
                                 "optimizer.eps": 4.0, "val_bytes": 3}) == {
        "lr": 1.0, "muon_lr": 2.0, "eps": 4.0, "val_bytes": 3}


@dataclass(frozen=True)
class _Inner:
    lr: float = setting("inner lr", 1.0)


@dataclass(frozen=True)
class _Outer:
    lr: float = setting("outer lr", 1.0)
    inner: _Inner = schema.section(_Inner, "inner")


def test_a_setting_name_used_twice_is_refused():
    with pytest.raises(TypeError, match="setting name lr is used twice"):
        schema.specs(_Outer)
