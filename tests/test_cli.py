"""The `jattn` command: dispatch, config overrides, one-line errors before compiling, bench."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jattn import cli
from jattn.train import ConfigError, apply_overrides, load_config, split_overrides

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.py")
NO_CACHE = ["--compilation_cache_dir="]  # keep this process's jax config untouched


@pytest.fixture
def compiles():
    """Counts XLA backend compilations while the test runs."""
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    jax.monitoring.unregister_event_duration_listener(listener)


def test_compile_counter_sees_compiles(compiles):
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7.0))
    assert compiles, "the listener must see a compilation, or the tests below prove nothing"


# -- overrides --------------------------------------------------------------------------


def test_overrides_are_typed_against_the_locked_config():
    config = load_config(SMOKE)
    overrides, rest = split_overrides(
        ["--config.model.d_model=64", "--workdir", "w", "--config.mesh_shape", "(1,-1,1)",
         "--config.progress_bar=true", "--config.learning_rate=2", "--config.model.num_kv_heads=1",
         "--config.model.attention_impl=chunked"]
    )  # fmt: skip
    assert rest == ["--workdir", "w"]
    apply_overrides(config, overrides)
    assert config.model.d_model == 64 and isinstance(config.model.d_model, int)
    assert config.mesh_shape == (1, -1, 1)
    assert config.progress_bar is True
    assert config.learning_rate == 2.0 and isinstance(config.learning_rate, float)
    assert config.model.num_kv_heads == 1 and config.model.attention_impl == "chunked"


@pytest.mark.parametrize(
    "override, message",
    [
        (("model.d_modl", "3"), "unknown config key 'd_modl' in model (did you mean 'd_model'?)"),
        (("batch_sise", "3"), "unknown config key 'batch_sise' in config (did you mean"),
        (("model.d_model.x", "3"), "unknown config key 'x' in model.d_model"),
        (("batch_size", "abc"), "--config.batch_size='abc': not a valid int"),
        (("batch_size", "1.5"), "not a valid int"),
        (("progress_bar", "maybe"), "not a valid bool"),
        (("model", "3"), "--config.model: is a group of keys"),
        (("mesh_shape", "(1,"), "not a valid tuple"),
    ],
)
def test_bad_overrides_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as e:
        apply_overrides(load_config(SMOKE), [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_variants():
    config = load_config(f"{REPO}/configs/base.py:rope,chunked,bf16")
    assert (config.model.position, config.model.attention_impl) == ("rope", "chunked")
    assert config.model.dtype == "bfloat16" and config.model.param_dtype == "float32"
    assert load_config(f"{REPO}/configs/base.py:shaw").model.position == "shaw"
    with pytest.raises(ConfigError, match="unknown config variant 'nonsense'"):
        load_config(f"{SMOKE}:nonsense")
    with pytest.raises(ConfigError, match="no such config file"):
        load_config("configs/does_not_exist.py")


@pytest.mark.parametrize("body", ["return {}['learning_rate']", "return 1 / 0", "raise OSError(5)"])
def test_a_get_config_that_raises_is_a_one_line_config_error(body, tmp_path, capsys):
    """Before: a KeyError or ValueError was one line, anything else a 19-line traceback
    and exit 1. Now any exception is one line naming it and the file's line, exit 2."""
    path = tmp_path / "broken.py"
    path.write_text(f"def get_config(arg=None):\n    x = 1\n    {body}\n")
    status = cli.main(["train", "--config", str(path), "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert status == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"jattn train: error: --config: {path}")
    if "1 / 0" in body:
        assert line.endswith(
            f".get_config() raised ZeroDivisionError: division by zero (at {path}:3)"
        )
    assert not (tmp_path / "w").exists()


def test_base_config_is_the_papers_setup():
    from jattn.train.config import read_parts
    from jattn.train.optim import make_optimizer

    c = load_config(f"{REPO}/configs/base.py")
    assert (c.adam_b1, c.adam_b2, c.adam_eps) == (0.9, 0.98, 1e-9)
    assert (c.label_smoothing, c.model.dropout_rate, c.warmup_steps) == (0.1, 0.1, 4000)
    assert (c.num_train_steps, c.decode, c.beam_size, c.beam_alpha) == (100_000, "beam", 4, 0.6)
    assert 24_000 <= c.batch_size * c.max_len <= 26_000
    m = c.model
    assert (m.d_model, m.num_heads, m.num_layers, m.d_ff) == (512, 8, 6, 2048)
    _, schedule = make_optimizer(read_parts(c).optimizer)
    # lr = d^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1.
    for step in (1, 1000, 4000, 10_000):
        want = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
        assert float(schedule(step - 1)) == pytest.approx(want, rel=1e-5)


# -- jattn train: one-line errors before anything compiles -------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config.model.d_modl=3"], "did you mean 'd_model'"),
        (["--config.batch_size=abc"], "not a valid int"),
        (["--config.mesh_shape=(2,1,1)"], "mesh_shape=(2, 1, 1) needs 2 devices, but there are 1"),
        (["--config.mesh_shape=(1,1)"], "mesh_shape must give the sizes of"),
        (["--config.dataset=no_such_dataset"], "unknown dataset name 'no_such_dataset'"),
        (["--config.dataset=copy/huge"], "unknown config 'huge'"),
        (["--config.batch_size=8", "--config.grad_accum_steps=3"], "not divisible by grad_accum"),
        (["--config.model.num_heads=5"], "must be divisible by num_heads=5"),
        (["--config.model.position=nope"], "is not a positional scheme"),
        (["--config.schedule=exp"], "schedule='exp': choose one of"),
        (["--num_processes=2"], "go together"),
    ],
)
def test_train_rejects_bad_input_in_one_line_without_compiling(
    args, message, tmp_path, capsys, compiles
):
    status = cli.main(
        ["train", "--config", SMOKE, "--workdir", str(tmp_path / "w"), *NO_CACHE, *args]
    )
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("jattn train: error: ") and "\n" not in err, err
    assert message in err
    assert not compiles
    assert not (tmp_path / "w" / "config.json").exists()


def test_unknown_command_and_help(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "bench" not in out


def test_console_script_reports_errors_in_one_line(tmp_path):
    script = Path(sys.executable).parent / "jattn"
    assert script.exists(), "pip install -e . provides the jattn console script"
    proc = subprocess.run(
        [str(script), "train", "--config", SMOKE, "--workdir", str(tmp_path),
         "--config.model.d_modl=3"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "jattn train: error: --config.model.d_modl: unknown config key 'd_modl' in model "
        "(did you mean 'd_model'?)"
    ]


# -- the benchmarks are scripts of the checkout, not a subcommand ------------------------


def test_jattn_bench_is_gone_and_says_what_to_run(capsys):
    """`jattn bench NAME` only ran benchmarks/NAME.py from a checkout: the scripts are
    the lab's (they read configs/ and tests/), run as `python benchmarks/NAME.py`."""
    assert "bench" not in cli.COMMANDS
    assert cli.main(["bench", "attention"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "jattn: error: `jattn bench` was removed: run `python benchmarks/NAME.py`"


def test_every_subcommand_has_help(capsys):
    for name in ("train", "ablate", "probe"):
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
        assert f"usage: jattn {name}" in capsys.readouterr().out


def test_model_keys_are_the_fields_of_the_model_config():
    """`model.*` follows TransformerConfig: a new field is a new key, with its default;
    None defaults are placeholders typed by the annotation."""
    import dataclasses

    from jattn.models import TransformerConfig
    from jattn.train import default_config

    model = default_config().model
    fields = dataclasses.fields(TransformerConfig)
    assert set(model.keys()) == {f.name for f in fields}
    for f in fields:
        want = -1 if f.name == "vocab_size" else f.default
        got = model[f.name]
        if f.default_factory is not dataclasses.MISSING:  # position_options: every scheme's
            want, got = f.default_factory(), got.to_dict()
        assert got == want, f.name
    assert model.position_options.t5.num_buckets == 32  # a scheme's default, from its Options
    config = load_config(SMOKE)
    apply_overrides(config, [("model.num_kv_heads", "2"), ("model.attention_impl", "xla")])
    assert config.model.num_kv_heads == 2 and config.model.attention_impl == "xla"
    with pytest.raises(ConfigError, match="num_kv_heads='two': not a valid int"):
        apply_overrides(load_config(SMOKE), [("model.num_kv_heads", "two")])


def test_tuples_and_none_parse_from_plain_text():
    """`--config.eval_splits=validation,test_longer` is a tuple of strings; `None` sets an
    Optional key (a placeholder) to None; other keys keep their type and reject None."""
    config = load_config(SMOKE)
    overrides, _ = split_overrides(
        ["--config.eval_splits=validation,test_longer", "--config.model.num_kv_heads=2",
         "--config.model.num_kv_heads=None", "--config.data_dir=None", "--config.mesh_shape=1,-1,1",
         "--config.logical_axis_rules=((\"batch\", \"data\"),)"]
    )  # fmt: skip
    apply_overrides(config, overrides)
    assert config.eval_splits == ("validation", "test_longer")
    assert config.model.num_kv_heads is None and config.data_dir is None
    assert config.mesh_shape == (1, -1, 1)
    assert config.logical_axis_rules == (("batch", "data"),)
    apply_overrides(config, [("eval_splits", "validation"), ("model.num_kv_heads", "none")])
    assert config.eval_splits == ("validation",) and config.model.num_kv_heads is None
    apply_overrides(config, [("eval_splits", "('test', 'validation')")])  # the literal still works
    assert config.eval_splits == ("test", "validation")
    with pytest.raises(ConfigError, match="batch_size='None': not a valid int"):
        apply_overrides(config, [("batch_size", "None")])
    apply_overrides(config, [("model.position", "none")])  # a string key: the scheme "none"
    assert config.model.position == "none"
    with pytest.raises(ConfigError, match="eval_splits=.*: not a valid tuple"):
        apply_overrides(config, [("eval_splits", "('test")])


def test_train_takes_a_plain_tuple_on_the_command_line(tmp_path, capsys, compiles):
    """The whole path of `jattn train`: a tuple key from plain text reaches the checks
    (here the mesh check, which needs two devices), not a parse error."""
    argv = ["train", "--config", SMOKE, "--workdir", str(tmp_path / "w"), *NO_CACHE]
    status = cli.main([*argv, "--config.mesh_shape=2,1,1", "--config.model.num_kv_heads=None"])
    assert status == 2
    assert "mesh_shape=(2, 1, 1) needs 2 devices" in capsys.readouterr().err
    assert not compiles


# -- one flag style, help on every flag, jattn configs -----------------------------------


def _parsers():
    from jattn.cli import ablate, decode, probe, train

    return {
        "train": train.make_parser(),
        "ablate": ablate.make_parser(),
        "probe": probe.make_parser(),
        "decode": decode.make_parser(),
    }


def test_flags_are_dashed_and_every_flag_has_help():
    for name, parser in _parsers().items():
        for action in parser._actions:
            for flag in action.option_strings:
                assert "_" not in flag, f"jattn {name} {flag}: flags are spelled with dashes"
            assert action.help and action.help != "==SUPPRESS==", f"jattn {name} {action.dest}"


def test_old_underscore_flags_still_work(tmp_path, capsys):
    from jattn.cli.common import normalize_flags

    assert normalize_flags(
        ["--compilation_cache_dir=/x_y", "--num_processes", "2", "--config.model.d_model=3",
         "--config_dir_x", "a_b", "--", "--keep_me"]
    ) == ["--compilation-cache-dir=/x_y", "--num-processes", "2", "--config.model.d_model=3",
          "--config-dir-x", "a_b", "--", "--keep_me"]  # fmt: skip
    args = _parsers()["train"].parse_args(
        normalize_flags(["--config", "c_1.py", "--workdir", "w_1", "--process_id=1",
                         "--coordinator_address", "h:1", "--compilation-cache-dir="])
    )  # fmt: skip
    assert (args.config, args.workdir, args.process_id, args.coordinator_address) == (
        "c_1.py", "w_1", 1, "h:1",
    )  # fmt: skip
    assert args.compilation_cache_dir == ""
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--num-processes" in out and "--num_processes" not in out
    # Old spellings through the real command: the flags are recognised (the error is
    # the distributed one, not argparse's "unrecognized arguments").
    status = cli.main(["train", "--config", SMOKE, "--workdir", str(tmp_path),
                       "--compilation_cache_dir=", "--num_processes=2"])  # fmt: skip
    assert status == 2 and "go together" in capsys.readouterr().err


def test_configs_lists_configs_variants_datasets_and_experiments(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert cli.main(["configs"]) == 0
    out = capsys.readouterr().out
    for want in ("configs/base.py", "configs/numbers.py", "configs/smoke.py",
                 "dataset numbers, ", "takes :VARIANT", "sinusoidal+shaw", "chunked", "bf16",
                 "numbers/{de,en,fr,de_7to8,de_millions,de_tiny}", "copy/{default,tiny}",
                 "reverse_digits/{default,small,tiny}", "experiments/shaw_variants.py",
                 "experiments/positional.py", "python benchmarks/NAME.py",
                 "attention"):  # fmt: skip
        assert want in out, want
    experiments = out.split("experiments  (")[1].split("benchmarks  (")[0]
    # Only ablation grids are experiments; benchmarks and their helpers are not.
    for name in ("attention", "gpu", "_gpu_cells", "_harness"):
        assert f"experiments/{name}.py" not in experiments and f"{name}.py" not in experiments
    benches = out.split("benchmarks  (python benchmarks/NAME.py): ")[1].splitlines()[0].split(", ")
    assert {"attention", "gpu", "memory"} <= set(benches) and "_gpu_cells" not in benches
    assert cli.main(["--help"]) == 0
    assert "configs" in capsys.readouterr().out


def test_configs_paths_traces_each_configs_attention_through_the_rule(capsys, monkeypatch):
    """`jattn configs --paths`: the rule's line for a config's training attention,
    at its own shapes (T, S = its lengths; B*N = its batch times heads), traced
    without running; a config that needs a variant says it does not load; and the
    process's own once-per-path announcements are left as they were."""
    from jattn.cli.configs import attention_paths

    monkeypatch.chdir(REPO)
    config = load_config("configs/chomsky.py:reverse_string,test100")
    lines = attention_paths(config)
    assert attention_paths(config) == lines  # each call says its paths afresh
    t, batch_heads = config.max_len, config.batch_size * config.model.num_heads
    assert len(lines) == 1, lines  # on the CPU every call takes one path, said once
    assert f"T={t} S={t} " in lines[0] and f"B*N={batch_heads} " in lines[0], lines
    assert "implementation=None -> 'xla'" in lines[0] and "on cpu" in lines[0]
    assert cli.main(["configs", "--paths", "configs/chomsky.py", "configs/smoke.py"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("attention paths of training on cpu")
    chomsky, smoke = out.split("  configs/smoke.py\n")
    assert "does not load: " in chomsky and "name one task" in chomsky
    assert smoke.count("implementation=None -> ") == 1


# -- the benchmark scripts: flags, --gpu, where outputs go -------------------------------


def _bench_module(name):
    import runpy

    return runpy.run_path(str(REPO / "benchmarks" / f"{name}.py"))


class _Parsed(Exception):
    pass


def _bench_parser(name, monkeypatch):
    """The argparse parser a bench script's main builds (caught before it parses)."""
    import argparse

    seen = []

    def capture(self, *args, **kwargs):
        seen.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    main = _bench_module(name)["main"]
    with pytest.raises(_Parsed):
        main() if name == "train" else main([])
    return seen[0]


@pytest.mark.parametrize(
    "name", ["aot", "attention", "decode", "gpu", "memory", "score_mod", "train"]
)
def test_bench_flags_are_dashed_with_help(name, monkeypatch):
    parser = _bench_parser(name, monkeypatch)
    for action in parser._actions:
        for flag in action.option_strings:
            assert "_" not in flag, f"bench {name} {flag}: flags are spelled with dashes"
        assert action.help, f"bench {name} {action.dest} has no help"
        if action.dest == "out" and action.default is not None:
            assert action.default.startswith(os.path.join("runs", "bench", "")), action.default


def test_bench_train_times_each_arm_against_the_first(capsys):
    """Arms of the smoke config: the same config again, another learning rate, and
    rows half as long and twice as many. The table has each, the first at 1.00x
    of itself, the short rows as their overrides make them; the state column
    says the same config ends bit for bit in the first's state, another
    learning rate does not, and other rows or another scheme's parameters are not
    compared."""
    main = _bench_module("train")["main"]
    spec = str(REPO / "configs" / "smoke.py")
    arms = [
        "base:",
        "again:",
        "lr:learning_rate=0.5",
        "short:max_len=8,max_input_len=8,batch_size=16",
        "shaw:model.position=shaw",
    ]
    assert main(["--config", spec, *arms, "--steps", "2", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) == {"arm", "base", "again", "lr", "short", "shaw"}
    assert rows["base"].rstrip().endswith("| 1.00x | 1.00x | - |")
    assert rows["again"].rstrip().endswith("| yes |")
    assert "| no (" in rows["lr"]
    assert "16x(8+8)" in rows["short"] and rows["short"].rstrip().endswith("| - (other batches) |")
    assert rows["shaw"].rstrip().endswith("| - (other parameters) |")
    assert out.count("round ") == 2


def test_bench_train_refuses_a_malformed_arm(capsys):
    main = _bench_module("train")["main"]
    spec = str(REPO / "configs" / "smoke.py")
    with pytest.raises(SystemExit) as e:
        main(["--config", spec, "base:", "bad:max_len"])
    assert e.value.code == 2
    assert "override 'max_len' is not key=value" in capsys.readouterr().err


def test_bench_train_data_takes_old_underscore_flags(monkeypatch):
    import argparse

    seen = []
    real = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        seen.append(real(self, args, namespace))
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed):
        _bench_module("train")["main"](["--data", "--max_input_lens", "0", "--num_batches=2",
                                        "--data-dir=d"])  # fmt: skip
    assert (seen[0].max_input_lens, seen[0].num_batches, seen[0].data_dir) == ("0", 2, "d")


def test_bench_gpu_without_a_gpu_refuses_at_once(tmp_path, capsys, compiles, monkeypatch):
    """No interpret-mode run, nothing compiled, one clear line, well under a second."""
    import time

    assert jax.default_backend() != "gpu"
    monkeypatch.chdir(tmp_path)
    main = _bench_module("gpu")["main"]
    t0 = time.perf_counter()
    status = main(["--out", str(tmp_path / "gpu.csv")])
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert status == 2 and elapsed < 1.0, elapsed
    assert err.startswith("bench_gpu: error: no GPU: ") and "--cpu-smoke" in err, err
    assert "\n" not in err and not compiles and not list(tmp_path.iterdir())


def test_bench_attention_writes_under_runs_bench_by_default(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main = _bench_module("attention")["main"]
    argv = ["--lengths", "16", "--heads", "1", "--head_dim", "8", "--repeats", "1",
            "--modes", "fwd", "--only", "jattn xla"]  # fmt: skip
    assert main(argv) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]
    table = (tmp_path / "runs" / "bench" / "bench_attention.csv").read_text()
    assert "jattn xla" in table
    assert "wrote runs/bench/bench_attention.csv" in capsys.readouterr().out
