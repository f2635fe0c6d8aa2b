import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from processes import run_to_end
from small_runs import DEMO_CONFIG
from test_load import final_eval

from clip_train.cli import BENCH_COMMANDS, COMMANDS, main
from clip_train.config import config_keys, load_config


def clip_train(*args: str) -> subprocess.CompletedProcess:
    return run_to_end([sys.executable, "-m", "clip_train", *args])


def test_top_level_help_runs_as_a_module():
    result = clip_train("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: clip-train")
    assert all(command.name in result.stdout for command in COMMANDS)


@pytest.mark.parametrize(
    "argv",
    [*[[c.name] for c in COMMANDS], ["bench"], *[["bench", c.name] for c in BENCH_COMMANDS]],
    ids=" ".join,
)
def test_every_command_has_help(argv, capsys):
    """In this process: each command's module imports the library, which a subprocess would redo."""
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: clip-train {' '.join(argv)}")


def test_console_script_matches_module():
    from clip_train.cli import build_parser

    assert build_parser().prog == "clip-train"


def test_bad_config_is_one_readable_line(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("batch:\n  global_sise: 64\n")
    result = clip_train("train", str(config))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        "clip-train: error: unknown config key batch.global_sise: did you mean batch.global_size"
    )


def test_bad_override_and_missing_file(tmp_path, capsys):
    """In this process (the subprocess test above covers the entry point): an exception other than
    the one-line error would propagate here and fail the test."""
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    config = tmp_path / "ok.yaml"
    config.write_text("batch:\n  global_size: 6\n")
    assert main(["train", str(config), "batch.image_chunk=4"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "batch.image_chunk=4 must divide" in line


def test_the_retired_loss_kernel_key_is_one_line_naming_what_replaced_it(capsys):
    assert main(["train", str(DEMO_CONFIG), "loss.kernel=triton"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("clip-train: error: loss.kernel was removed: the PyTorch tiles are the only loss")


def test_building_the_parser_imports_no_torch():
    """``--help`` of every command stays fast: command modules import torch only when they run."""
    code = "import sys, clip_train.cli as cli; cli.build_parser(); print('torch' in sys.modules)"
    result = run_to_end([sys.executable, "-c", code])
    assert result.stdout.strip() == "False", result.stderr


def test_config_prints_the_resolved_yaml():
    overrides = ["batch.global_size=64", "model.text.pooling=cls"]
    result = clip_train("config", str(DEMO_CONFIG), *overrides)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed == dataclasses.asdict(load_config(DEMO_CONFIG, overrides))
    assert printed["batch"]["global_size"] == 64 and printed["model"]["text"]["pooling"] == "cls"
    assert printed["model"]["embed_dim"] == 128  # from the included model/tiny.yaml


def test_config_fails_like_train_on_a_bad_config():
    result = clip_train("config", str(DEMO_CONFIG), "model.text.hf=/models/bert")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "clip-train: error: model.text.hf='/models/bert' and model.text.hf_config are both set: hf loads a "
        "pretrained encoder, hf_config builds a random-init one; drop one (model.text.hf_config={} or "
        "model.text.hf=)"
    ]


def test_config_keys_lists_every_key_with_type_and_default():
    result = clip_train("config", "--keys")
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["key", "type", "default", "meaning"]
    assert [row.split()[0] for row in rows] == [key.name for key in config_keys()]
    (keep_every,) = [row.split(maxsplit=3) for row in rows if row.startswith("checkpoint.keep_every ")]
    assert keep_every[1:3] == ["int", "0"] and "milestones" in keep_every[3]


def key_values(table: str) -> dict[str, str]:
    """{key: value cell} from ``config --keys``: each cell starts under the third title and ends at two
    spaces (a long one overflows its column)."""
    header, *rows = table.splitlines()
    start = header.index(header.split()[2])
    return {row.split()[0]: row[start:].split("  ")[0] for row in rows}


def test_config_keys_of_a_config_lists_its_values_with_overrides(capsys):
    """The demo recipe's 128-wide embedding (from its include) and the override's step count, not the
    defaults 512 and 1000 that ``--keys`` alone lists; a config that ``train`` refuses is refused."""
    assert main(["config", "--keys"]) == 0
    defaults = capsys.readouterr().out
    assert main(["config", str(DEMO_CONFIG), "train.max_steps=7", "--keys"]) == 0
    table = capsys.readouterr().out
    assert table.split()[:4] == ["key", "type", "value", "meaning"]
    values = key_values(table)
    assert [values[k] for k in ("model.embed_dim", "train.max_steps")] == ["128", "7"]
    assert [key_values(defaults)[k] for k in ("model.embed_dim", "train.max_steps")] == ["512", "1000"]
    assert values["model.text.hf_config"] == repr(load_config(DEMO_CONFIG).model.text.hf_config)
    assert values.keys() == {key.name for key in config_keys()}
    assert main(["config", str(DEMO_CONFIG), "model.text.hf=/models/bert", "--keys"]) == 2


def test_overrides_may_follow_a_commands_options(capsys):
    """argparse alone refuses ``key=value`` after an option; anything else left over still fails."""
    assert main(["config", str(DEMO_CONFIG), "train.max_steps=7", "--keys", "model.embed_dim=64"]) == 0
    values = key_values(capsys.readouterr().out)
    assert [values[k] for k in ("model.embed_dim", "train.max_steps")] == ["64", "7"]
    with pytest.raises(SystemExit) as exit_:
        main(["config", str(DEMO_CONFIG), "--keys", "stray"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "clip-train: error: unrecognized arguments: stray"


def test_config_reference_rewrites_only_the_marked_section(tmp_path):
    from clip_train.commands.config import REFERENCE_BEGIN, REFERENCE_END, markdown_table

    page = tmp_path / "config.md"
    page.write_text(f"# Title\n{REFERENCE_BEGIN}\n| stale |\n{REFERENCE_END}\nafter\n")
    first = clip_train("config", "--reference", str(page))
    second = clip_train("config", "--reference", str(page))
    assert first.returncode == 0 and "updated" in first.stdout, first.stderr
    assert "already current" in second.stdout
    assert page.read_text() == f"# Title\n{REFERENCE_BEGIN}\n{markdown_table()}\n{REFERENCE_END}\nafter\n"
    page.write_text("no markers\n")
    missing = clip_train("config", "--reference", str(page))
    assert missing.returncode != 0 and "config-reference:begin" in missing.stderr
    assert page.read_text() == "no markers\n"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["bench", "loss", "--batch", "64,abc"],
            "--batch '64,abc' must be comma-separated positive integers",
        ),
        (["bench", "loss", "--batch", "0"], "--batch '0' must be comma-separated positive integers"),
        (["bench", "step", "--batch", "256,"], "--batch '256,' must be comma-separated positive integers"),
        (["bench", "train", "--procs", "two"], "--procs 'two' must be comma-separated positive integers"),
        (["config", "--reference", "/no/such/config.md"], "--reference /no/such/config.md: No such file"),
    ],
)
def test_bad_command_arguments_are_one_line(argv, line, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"clip-train: error: {line}")


@pytest.mark.parametrize(
    ("workers", "before", "after"), [(1, None, "PASSIVE"), (0, None, None), (1, "ACTIVE", "ACTIVE")]
)
def test_train_lets_idle_openmp_threads_sleep_when_loader_workers_share_the_cores(
    monkeypatch, tmp_path, workers, before, after
):
    """Set before torch starts its threads (here the run then stops at the path checks), only with
    loader workers, and never over the user's own choice."""
    if before is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", before)
    assert main(["train", str(DEMO_CONFIG), f"data.workers={workers}", f"data.train={tmp_path}/none"]) == 2
    assert os.environ.get("OMP_WAIT_POLICY") == after


def metrics_without_eval(run: Path, into: Path) -> Path:
    """A copy of ``run``'s metrics.jsonl with only its training records: a run that never evaluated."""
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    into.mkdir()
    (into / "metrics.jsonl").write_text("".join(line for line in lines if "train/loss" in line))
    return into


def test_report_shows_the_steps_loss_and_zero_shot_of_a_run(demo_run, capsys):
    assert main(["report", str(demo_run), "--prefix", "demo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(line.startswith("demo: ") for line in lines)
    windows = [json.loads(line).get("time/window_s", 0) for line in (demo_run / "metrics.jsonl").open()]
    assert f"40 steps in {sum(windows):.0f} s, " in lines[2]  # the steps' own time, every window's
    first = json.loads((demo_run / "metrics.jsonl").open().readline())
    assert lines[2].endswith(f" samples/s, start-up {first['startup/total_s']:.0f} s")  # one process
    assert lines[3].startswith("demo: loss            step 10: ")
    assert "step_00000040" in lines[1] and "step 40: " in lines[3]
    assert lines[-1] == f"demo: zero-shot top-1 = {final_eval(demo_run)['zeroshot/top1']:.3f}"


def test_report_of_a_run_without_eval_shows_its_training(demo_run, tmp_path, capsys):
    run = metrics_without_eval(demo_run, tmp_path / "no_eval")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[2]["step"] == 30
    records[2]["startup/total_s"] = 2.6  # a process resumed at step 20 logs its start-up with step 30
    starts = records[0]["startup/total_s"] + 2.6
    still_written = '{"step": 50, "time": '  # a record a running run is still writing
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + still_written)
    assert main(["report", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["run", "checkpoint", "training", "loss"]
    assert lines[1] == "run: checkpoint      none" and "40 steps in " in lines[2]
    assert lines[2].endswith(f", start-up {starts:.0f} s over 2 starts")
    losses = [
        json.loads(line)["train/loss"] for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]
    ]
    assert lines[3].endswith(f"step 40: {losses[-1]:.3f}") and f"step 10: {losses[0]:.3f}, " in lines[3]


def test_report_shows_each_zero_shot_set_before_the_main_top1(demo_run, tmp_path, capsys):
    run = metrics_without_eval(demo_run, tmp_path / "sets")
    evaluated = {"step": 40, "zeroshot/top1": 0.5, "zeroshot/v2/top1": 0.25, "zeroshot/v2/n": 8.0}
    with (run / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({**evaluated, "zeroshot/r/top1": 0.125, "zeroshot/r/top5": 0.5}) + "\n")
    assert main(["report", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == ["run: zero-shot sets  top-1 v2 0.250, r 0.125", "run: zero-shot top-1 = 0.500"]


def test_report_of_a_run_with_no_steps_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"clip-train: error: {tmp_path}: no metrics.jsonl; give a run directory (the run's train.out_dir)"
    ]
    (tmp_path / "metrics.jsonl").touch()  # what a run leaves before its first logged step
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"clip-train: error: {tmp_path}: no training step logged in metrics.jsonl yet"
    ]
