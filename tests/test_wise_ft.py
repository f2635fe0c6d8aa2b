"""WiSE-FT: a fine-tuned run's weights mixed with those it started from, in ``clip-train eval``,
``clip-train export`` and ``clip_train.load``.

The start here is a released model as users have it: an open_clip folder (clip_train's export of a
perturbed tiny model), which a short run fine-tunes through ``model.init_from=open_clip:local-dir:``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from small_runs import DEMO_CONFIG, TINY_MODEL
from test_init_from import trainer
from test_init_from_open_clip import perturbed

import clip_train
from clip_train import load_config
from clip_train.checkpoint import MODEL_FILE
from clip_train.cli import main as cli_main
from clip_train.eval import eval_config, evaluate
from clip_train.export import export_open_clip
from clip_train.init_from import load_init_from
from clip_train.model import build_model
from clip_train.wise_ft import mixture

OPEN_CLIP_WEIGHTS = "open_clip_model.safetensors"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """An open_clip folder: the start of the fine-tuning."""
    out = tmp_path_factory.mktemp("released") / "model"
    export_open_clip(perturbed(build_model(load_config(DEMO_CONFIG, TINY_MODEL).model)), out)
    return out


@pytest.fixture(scope="module")
def fine_tuned(released, digits, tmp_path_factory) -> Path:
    """A run fine-tuned from ``released`` for 3 steps: its run directory."""
    out = tmp_path_factory.mktemp("fine_tuned")
    trainer(digits, out, 3, f"model.init_from=open_clip:local-dir:{released}", "optim.lr=1e-3").run()
    return out


def test_the_mixture_is_the_formula_over_every_floating_point_tensor():
    generator = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(4, 3, generator=generator), "steps": torch.tensor([1])}
    fine_tuned = {
        "w": torch.randn(4, 3, generator=generator, dtype=torch.float64),
        "steps": torch.tensor([5, 7]),
    }
    for alpha in (0.0, 0.3, 0.5, 0.9, 1.0):
        mixed = mixture(start, fine_tuned, alpha)
        expected = (1 - alpha) * start["w"].double() + alpha * fine_tuned["w"]
        assert mixed["w"].dtype == torch.float64  # in the fine-tuned tensor's dtype
        torch.testing.assert_close(mixed["w"], expected, rtol=0, atol=1e-15)
        assert torch.equal(mixed["steps"], fine_tuned["steps"])  # integers are not mixed
    assert torch.equal(mixture(start, fine_tuned, 0.0)["w"], start["w"].double())  # the ends exactly
    assert torch.equal(mixture(start, fine_tuned, 1.0)["w"], fine_tuned["w"])


def assert_mixed(mixed: torch.Tensor, start: torch.Tensor, end: torch.Tensor, alpha: float) -> None:
    """fp32 ``mixed`` against the mixture in fp64: within two roundings of the operands' size."""
    expected = (1 - alpha) * start.double() + alpha * end.double()
    bound = 2 * torch.finfo(torch.float32).eps * (start.double().abs() + end.double().abs())
    assert mixed.dtype == torch.float32 and ((mixed.double() - expected).abs() <= bound).all()


def export(*args: str) -> dict[str, torch.Tensor]:
    out = Path(args[1])
    assert cli_main(["export", *args]) == 0
    return load_file(out / OPEN_CLIP_WEIGHTS)


def test_an_export_at_0_is_the_released_model_and_between_the_ends_their_mixture(
    released, fine_tuned, tmp_path, caplog
):
    """Read back from open_clip's files: alpha 0 gives the released tensors bit for bit, alpha 1 the
    plain export of the run, 0.25 the mixture of those two files."""
    run = str(fine_tuned)
    plain = export(run, str(tmp_path / "plain"))
    at = {alpha: export(run, str(tmp_path / f"a{alpha}"), "--wise-ft", str(alpha)) for alpha in (0, 1, 0.25)}
    release = load_file(released / OPEN_CLIP_WEIGHTS)
    assert at[0].keys() == release.keys() == plain.keys()
    assert all(torch.equal(at[0][name], release[name]) for name in release)
    assert all(torch.equal(at[1][name], plain[name]) for name in plain)
    moved = [name for name in plain if not torch.equal(plain[name], release[name])]
    assert "visual.head.proj.weight" in moved and len(moved) > len(plain) // 2  # the run trained
    for name in moved:
        assert_mixed(at[0.25][name], release[name], plain[name], 0.25)
    said = f"the WiSE-FT mixture 0.75 x open_clip:local-dir:{released} + 0.25 x {fine_tuned}"
    assert any(said in record.message for record in caplog.records)


def test_eval_at_the_ends_gives_the_released_models_and_the_runs_metrics(
    released, fine_tuned, digits, capsys
):
    zeroshot = [f"eval.zeroshot={digits}/zeroshot.json", f"eval.zeroshot_data={digits}/val"]
    assert cli_main(["eval", str(fine_tuned), "--wise-ft", "0,1", *zeroshot]) == 0
    captured = capsys.readouterr()
    printed = captured.out.splitlines()
    reported = [json.loads(line) for line in printed if line.startswith("{")]
    assert [r.pop("wise_ft") for r in reported] == [
        {"alpha": alpha, "from": f"open_clip:local-dir:{released}"} for alpha in (0.0, 1.0)
    ]
    file = fine_tuned / "checkpoints" / "step_00000003" / MODEL_FILE
    assert printed[0] == f"evaluated: the weights in {file}"
    assert printed[1].split() == ["alpha", "0", "1"]
    start = f"open_clip:local-dir:{released}"
    assert [line for line in captured.err.splitlines() if "WiSE-FT alpha" in line] == [
        f"clip-train: WiSE-FT alpha 0: 1 x {start} + 0 x the fine-tuned weights",
        f"clip-train: WiSE-FT alpha 1: 0 x {start} + 1 x the fine-tuned weights",
    ]

    cfg = eval_config(file, None, zeroshot)
    start_cfg = dataclasses.replace(cfg.model, init_from=f"open_clip:local-dir:{released}")
    start = build_model(start_cfg, load_pretrained=False)
    load_init_from(start_cfg, start)
    run, _, _ = clip_train.load(fine_tuned)
    for model, metrics in zip((start, run), reported, strict=True):
        assert metrics.pop("checkpoint") == str(file) and metrics.pop("ema") is False
        assert metrics == evaluate(model.eval(), cfg.eval, cfg.data, device=CPU, precision="fp32")
    assert reported[0]["zeroshot/n"] > 0


def test_load_mixes_the_weights_and_names_another_start(released, fine_tuned, demo_run):
    run = clip_train.load(fine_tuned)[0].state_dict()
    other = clip_train.load(demo_run)[0].state_dict()  # a start of the same shapes, named by hand
    mixed = clip_train.load(fine_tuned, wise_ft=0.5, wise_ft_from=str(demo_run))[0].state_dict()
    for name, tensor in run.items():
        assert_mixed(mixed[name], other[name], tensor, 0.5)


def one_line_error(capsys, *argv: str) -> str:
    """The command's error (export also says which of its steps failed)."""
    assert cli_main(list(argv)) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("clip-train: error:")]
    return line


def test_a_run_without_a_start_or_with_a_missing_one_is_one_line(demo_run, fine_tuned, tmp_path, capsys):
    """The demo run started from random weights: nothing to mix with unless named."""
    out = str(tmp_path / "out")
    assert one_line_error(capsys, "export", str(demo_run), out, "--wise-ft", "0.5") == (
        "clip-train: error: --wise-ft: the run has no model.init_from to mix with; name the weights it "
        "started from with --wise-ft-from (a checkpoint or open_clip:ARCH/TAG)"
    )
    nope = tmp_path / "nope"
    line = one_line_error(
        capsys, "export", str(fine_tuned), out, "--wise-ft", "0.5", "--wise-ft-from", str(nope)
    )
    assert line.startswith(f"clip-train: error: the WiSE-FT start {nope}: checkpoint not found: {nope} does")
    assert line.endswith("(--wise-ft-from names another)")
    assert one_line_error(capsys, "export", str(fine_tuned), out, "--wise-ft-from", str(demo_run)) == (
        "clip-train: error: --wise-ft-from names the start of a WiSE-FT mixture: give its alpha with "
        "--wise-ft"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("alphas", ["1.5", "0,x", "-0.1"])
def test_an_alpha_outside_0_to_1_is_refused_by_the_command_line(fine_tuned, alphas, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["eval", str(fine_tuned), "--wise-ft", alphas])
    assert exit_.value.code == 2
    assert (
        "is not a number in [0, 1] (0: the weights the run started from, 1: the fine-tuned weights)"
        in (capsys.readouterr().err.splitlines()[-1])
    )
