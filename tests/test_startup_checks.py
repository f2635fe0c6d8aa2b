"""Every path a run reads is checked before the first step: one line naming the key, no training."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from processes import run_to_end
from small_runs import DEMO_CONFIG, run_overrides

from clip_train import load_config
from clip_train.cli import main
from clip_train.errors import UserError
from clip_train.startup_checks import check_paths, check_wandb


def run_config(digits: Path, out_dir: Path, *extra: str):
    return load_config(DEMO_CONFIG, run_overrides(digits, out_dir, 2, *extra))


MISSING = [  # (overrides, the error's start); DIGITS stands for the digits set's directory
    (["data.train=/no/such/shards"], "data.train: no such file or directory: /no/such/shards"),
    (["data.val=/no/such/val/{0..3}.tar"], "data.val: no such file or directory: /no/such/val/0.tar"),
    (
        ["eval.zeroshot=/no/such/classes.json", "data.val=DIGITS/val"],
        "eval.zeroshot='/no/such/classes.json': no such file",
    ),
    (
        ["eval.zeroshot=DIGITS/zeroshot.json", "eval.zeroshot_data=/no/such/imagenet/val"],
        "eval.zeroshot_data: no such file or directory",
    ),
    (
        ["eval.zeroshot=DIGITS/zeroshot.json"],
        "eval.zeroshot is set but neither eval.zeroshot_data nor data.val names labelled images",
    ),
    (
        ["eval.zeroshot=DIGITS/zeroshot.json", "data.val=DIGITS/val", "eval.zeroshot_sets={v2: /no/such/v2}"],
        "eval.zeroshot_sets.v2: no such file or directory: /no/such/v2",
    ),
    (
        ["model.image.pretrained=/no/such/vit.safetensors"],
        "model.image.pretrained='/no/such/vit.safetensors': no such file or directory",
    ),
    (
        ["model.text.hf=/no/such/bert", "model.text.hf_config={}"],
        "model.text.hf='/no/such/bert': no such directory",
    ),
    (["model.text.tokenizer=./no/such/tokenizer"], "model.text.tokenizer='./no/such/tokenizer': no such"),
    (["model.init_from=/no/such/run"], "model.init_from=/no/such/run: checkpoint not found: /no/such/run"),
    (["checkpoint.resume=/no/such/step"], "checkpoint.resume=/no/such/step: not a complete checkpoint"),
    (["distill.teacher=/no/such/run"], "distill.teacher=/no/such/run: checkpoint not found: /no/such/run"),
]


@pytest.mark.parametrize(
    ("overrides", "message"), MISSING, ids=[overrides[0].split("=")[0] for overrides, _ in MISSING]
)
def test_a_missing_path_is_named(digits, tmp_path, overrides, message):
    cfg = run_config(digits, tmp_path, *(item.replace("DIGITS", str(digits)) for item in overrides))
    with pytest.raises(UserError) as err:
        check_paths(cfg)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("key", ["eval.zeroshot_data", "eval.zeroshot_sets.odd"])
def test_class_folders_that_map_to_no_class_names_fail_at_start_up(digits, tmp_path, key):
    """Not after the last step, where the evaluation reads them."""
    folder = tmp_path / "folders"
    for name in ("cats", "dogs", "owls"):
        (folder / name).mkdir(parents=True)
    where = (
        f"eval.zeroshot_data={folder}"
        if key == "eval.zeroshot_data"
        else f"eval.zeroshot_sets={{odd: {folder}}}"
    )
    cfg = run_config(
        digits, tmp_path / "run", f"eval.zeroshot={digits}/zeroshot.json", f"data.val={digits}/val", where
    )
    with pytest.raises(UserError) as err:
        check_paths(cfg)
    assert str(err.value) == f"{key}={folder}: 3 class folders but 10 class names"


def test_zeroshot_data_is_not_checked_while_zeroshot_is_off(digits, tmp_path):
    """Only zero-shot reads it: a run without eval.zeroshot (as run_overrides sets) starts whatever."""
    check_paths(run_config(digits, tmp_path, "eval.zeroshot_data=/no/such/imagenet/val"))


def test_a_val_table_header_is_checked_at_start_up(digits, tmp_path):
    table = tmp_path / "val.tsv"
    table.write_text("file\ttitle\nimages/1.png\ta caption\n")
    with pytest.raises(UserError) as err:
        check_paths(run_config(digits, tmp_path / "run", f"data.val={table}"))
    assert str(err.value).startswith(f"{table}: the header has no image column 'filepath' or 'path'")
    assert str(err.value).endswith("Name it with --image-key or data.csv_image_key")
    check_paths(run_config(digits, tmp_path / "run", f"data.val={table}", "data.csv_image_key=file"))


NO_LABELS = "a table's rows carry no labels, which eval.zeroshot needs;"


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("data.val=TABLE", f"data.val=TABLE: {NO_LABELS} set eval.zeroshot_data to labelled shards or"),
        ("eval.zeroshot_data=TABLE", f"eval.zeroshot_data=TABLE: {NO_LABELS} give labelled shards or"),
        ("eval.zeroshot_sets={tab: TABLE}", f"eval.zeroshot_sets.tab=TABLE: {NO_LABELS} give labelled"),
    ],
    ids=["data.val", "eval.zeroshot_data", "eval.zeroshot_sets"],
)
def test_zero_shot_on_a_table_fails_at_start_up(digits, tmp_path, where, message):
    """Not at the first evaluation, after the training before it (docs/data.md: tables carry no labels)."""
    table = tmp_path / "val.tsv"
    table.write_text("filepath\ttitle\nimages/1.png\ta caption\n")
    zero_shot = (f"eval.zeroshot={digits}/zeroshot.json", f"data.val={digits}/val")
    cfg = run_config(digits, tmp_path / "run", *zero_shot, where.replace("TABLE", str(table)))
    with pytest.raises(UserError) as err:
        check_paths(cfg)
    assert str(err.value).startswith(message.replace("TABLE", str(table)))
    assert str(err.value).endswith("an image folder") and "\n" not in str(err.value)


def test_what_exists_or_cannot_be_checked_passes(digits, tmp_path, demo_run):
    image_folder = tmp_path / "imagenet-val"
    (image_folder / "n01440764").mkdir(parents=True)
    out = tmp_path / "run"
    shutil.copytree(demo_run / "checkpoints", out / "checkpoints")
    cfg = run_config(
        digits,
        out,
        f"data.val={digits}/val",
        "eval.zeroshot=imagenet",
        f"eval.zeroshot_data={image_folder}",
        "model.image.pretrained=hub",
        "model.text.tokenizer=bert-base-uncased",  # a hub name: looked up when the model is built
        "model.init_from=/no/such/run",  # never read: the run resumes from its own checkpoint
        "checkpoint.resume=auto",
    )
    check_paths(cfg)
    check_paths(run_config(digits, out, "data.train=pipe:cat /no/such/{0..9}.tar"))


def test_a_run_that_may_resume_is_not_refused_for_what_only_a_fresh_start_reads(digits, tmp_path, demo_run):
    """init_from and the pretrained weights are read only by a run that starts afresh: a requeued run
    on a fresh disk whose checkpoint.remote holds its checkpoint (auto finds it there), or one beside
    its checkpoints, passes without them; the same run starting afresh is refused."""
    gone = ["model.init_from=/no/such/run", "model.image.pretrained=/no/such/vit.safetensors"]
    remote = ["checkpoint.resume=auto", f"checkpoint.remote=file://{tmp_path / 'bucket'}"]
    check_paths(run_config(digits, tmp_path / "fresh-disk", *remote, *gone))
    beside = tmp_path / "requeued"
    shutil.copytree(demo_run / "checkpoints", beside / "checkpoints")
    check_paths(run_config(digits, beside, "checkpoint.resume=auto", gone[1]))
    with pytest.raises(UserError, match=r"^model\.image\.pretrained='/no/such/vit\.safetensors': no such"):
        check_paths(run_config(digits, tmp_path / "afresh", "checkpoint.resume=auto", gone[1]))


def test_the_issue_example_fails_before_the_first_step(digits, tmp_path):
    """The demo config run from a directory without data/digits/zeroshot.json."""
    overrides = [
        f"data.train={digits}/train",
        f"data.val={digits}/val",
        f"eval.zeroshot_data={digits}/val",
        "train.max_steps=8",
        f"train.out_dir={tmp_path / 'run'}",
        "log.wandb.mode=disabled",
    ]
    command = [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *overrides]
    result = run_to_end(command, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "clip-train: error: eval.zeroshot='data/digits/zeroshot.json': no such file; give a class-name "
        "JSON file or one of imagenet, imagenet-simple"
    ]
    assert not (tmp_path / "run").exists()  # no step, no run directory


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_run_logging_to_a_missing_wandb_fails_at_start_up(digits, tmp_path, monkeypatch, capsys, mode):
    """The offline GPU kit installs no wandb: a run that logs to it stops before the model is built,
    not when the monitor imports it."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an import finds where it is not installed
    out = tmp_path / "run"
    assert main(["train", str(DEMO_CONFIG), *run_overrides(digits, out, 2, f"log.wandb.mode={mode}")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"clip-train: error: log.wandb.mode={mode}: wandb is not installed; install it (pip install wandb) "
        "or set log.wandb.mode=disabled"
    ]
    assert not out.exists()
    check_wandb(run_config(digits, out).log.wandb)  # disabled: no wandb needed
