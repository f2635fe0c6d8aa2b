"""Distillation from a frozen teacher (``distill.*``) in Gradient Cache and in real runs.

The engine's reference is plain autograd over the whole batch with open_clip's ``DistillClipLoss``
(which builds both b×b matrices): the chunked, tiled step must give its gradients in fp64. The runs
take their teacher as users give it: a clip_train run directory, or an open_clip folder with a
model YAML for its architecture.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import open_clip
import pytest
import torch
import yaml
from dist_utils import run_distributed
from open_clip.loss import DistillClipLoss
from safetensors.torch import save_file
from small_runs import DEMO_CONFIG, ROOT, TINY_MODEL, run_overrides
from test_gradcache import NO_DROPOUT, ROWS, assert_grads_close, grads, make_batch, make_model, tiny_config
from test_init_from import source_weights, trainer
from test_init_from_open_clip import perturbed

from clip_train.checkpoint import MODEL_FILE
from clip_train.config import DistillConfig, load_config
from clip_train.engine import GradCache
from clip_train.errors import UserError
from clip_train.export import export_open_clip
from clip_train.model import build_model
from clip_train.startup_checks import check_paths
from clip_train.teacher import load_teacher

WEIGHT = 0.7


def make_teacher() -> torch.nn.Module:
    """Another tiny CLIP, of another width and embedding size, reading the same inputs."""
    torch.manual_seed(1)
    overrides = [*NO_DROPOUT, "model.embed_dim=24", "model.image.timm_kwargs.embed_dim=64"]
    teacher = build_model(tiny_config(*overrides).model).double().eval().requires_grad_(False)
    with torch.no_grad():
        teacher.logit_scale.fill_(3.0)
    return teacher


def reference(model, teacher, batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The loss, its distillation term and the gradients, from one forward of the whole batch."""
    model.zero_grad(set_to_none=True)
    images, input_ids, attention_mask = batch
    features = model(images, input_ids, attention_mask)
    targets = teacher(images, input_ids, attention_mask)
    contrastive, distill = DistillClipLoss()(*features, *targets)
    (contrastive + WEIGHT * distill).backward()
    return (contrastive + WEIGHT * distill).detach(), distill.detach(), grads(model)


@pytest.mark.parametrize(("image_chunk", "text_chunk", "tile"), [(3, 4, 4), (0, 0, None), (4, 0, 3)])
def test_a_step_with_a_teacher_has_the_full_batch_gradients_of_contrastive_plus_distillation(
    image_chunk, text_chunk, tile
):
    model, teacher, batch = make_model(*NO_DROPOUT), make_teacher(), make_batch()
    loss, distill, expected = reference(model, teacher, batch)
    model.zero_grad(set_to_none=True)
    engine = GradCache(
        model,
        image_chunk=image_chunk,
        text_chunk=text_chunk,
        precision="fp64",
        tile_size=tile,
        teacher=teacher,
        distill_weight=WEIGHT,
    )
    stats = engine.step(*batch)
    torch.testing.assert_close(stats.loss, loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(stats.distill_loss, distill, rtol=1e-12, atol=0)
    assert_grads_close(grads(model), expected, rtol=1e-10)
    assert all(p.grad is None for p in teacher.parameters())
    # The teacher's term is there: without it the gradients differ.
    model.zero_grad(set_to_none=True)
    GradCache(model, image_chunk=image_chunk, text_chunk=text_chunk, precision="fp64").step(*batch)
    assert not torch.allclose(grads(model)["logit_scale"], expected["logit_scale"], rtol=1e-3)


def teacher_rank(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model, rows = make_model(*NO_DROPOUT), ROWS // world
    own = tuple(t[rank * rows : (rank + 1) * rows] for t in make_batch())
    engine = GradCache(
        model,
        image_chunk=2,
        text_chunk=3,
        precision="fp64",
        teacher=make_teacher(),
        distill_weight=WEIGHT,
        tile_size=2,
    )
    stats = engine.step(*own)
    return stats.loss, stats.distill_loss, grads(model)


def test_two_ranks_with_a_teacher_step_as_one_process_on_the_whole_batch():
    """Each rank's loss is its share of the global mean (their average is the whole batch's), and
    the averaged gradients (DDP's, and the scale's) are the whole batch's."""
    loss, distill, expected = reference(make_model(*NO_DROPOUT), make_teacher(), make_batch())
    ranks = run_distributed(teacher_rank, 2)
    torch.testing.assert_close(sum(rank[0] for rank in ranks) / 2, loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(sum(rank[1] for rank in ranks) / 2, distill, rtol=1e-12, atol=0)
    for _, _, rank_grads in ranks:
        assert_grads_close(rank_grads, expected, rtol=1e-10)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_distils_from_a_run_directory_and_logs_the_term(demo_run, digits, tmp_path):
    run = trainer(digits, tmp_path, 2, f"distill.teacher={demo_run}", "log.every_steps=1")
    teacher_start = {name: tensor.clone() for name, tensor in run.teacher.state_dict().items()}
    assert teacher_start.keys() == source_weights(demo_run).keys()
    assert all(torch.equal(tensor, source_weights(demo_run)[name]) for name, tensor in teacher_start.items())
    run.run()
    logged = [record for record in metrics(tmp_path) if "train/distill_loss" in record]
    assert [record["step"] for record in logged] == [1, 2]
    assert all(0 < record["train/distill_loss"] < record["train/loss"] for record in logged)
    assert all(torch.equal(tensor, teacher_start[name]) for name, tensor in run.teacher.state_dict().items())
    assert not run.teacher.training and not any(p.requires_grad for p in run.teacher.parameters())
    assert "train/distill_loss" not in json.dumps(metrics(demo_run))  # only runs with a teacher log it


def test_a_resumed_run_keeps_the_teacher_its_start_found_in_a_run_directory(demo_run, digits, tmp_path):
    """The teacher's run may go on training: a newer checkpoint there must not change the teacher of
    a resumed run (the steps after the resume would distil towards another model), whether it resumes
    in its own directory, on a fresh disk from its remote, or from its checkpoint in another directory."""
    source = tmp_path / "teacher"
    shutil.copytree(demo_run, source)
    out, teacher = tmp_path / "run", f"distill.teacher={source}"
    remote = f"checkpoint.remote=file://{tmp_path / 'bucket'}"
    trainer(digits, out, 2, teacher, remote).run()
    checkpoints = source / "checkpoints"
    shutil.copytree(checkpoints / "step_00000020", checkpoints / "step_00000060")  # other weights, newer
    kept = source_weights(demo_run)  # step 40's
    for resumed in (
        trainer(digits, out, 3, teacher, "checkpoint.resume=auto"),
        trainer(digits, tmp_path / "fresh-disk", 3, teacher, remote, "checkpoint.resume=auto"),
        trainer(
            digits,
            tmp_path / "elsewhere",
            3,
            teacher,
            f"checkpoint.resume={out / 'checkpoints' / 'step_00000002'}",
        ),
    ):
        assert resumed.step == 2 and resumed.cfg.distill.teacher == str(
            checkpoints / "step_00000040" / MODEL_FILE
        )
        assert all(torch.equal(tensor, kept[name]) for name, tensor in resumed.teacher.state_dict().items())
        resumed.loader.close()


def test_an_open_clip_teacher_takes_its_architecture_from_a_model_yaml(digits, tmp_path):
    released = perturbed(build_model(load_config(DEMO_CONFIG, TINY_MODEL).model))
    export_open_clip(released, tmp_path / "teacher")
    model_yaml = tmp_path / "teacher.yaml"
    model_cfg = dataclasses.asdict(load_config(DEMO_CONFIG, TINY_MODEL).model)
    model_yaml.write_text(yaml.safe_dump({"model": model_cfg}))
    teacher = [
        f"distill.teacher=open_clip:local-dir:{tmp_path / 'teacher'}",
        f"distill.teacher_model={model_yaml}",
    ]
    run = trainer(digits, tmp_path / "run", 1, *teacher)
    assert all(
        torch.equal(tensor, released.state_dict()[name]) for name, tensor in run.teacher.state_dict().items()
    )
    missing = tmp_path / "no-such.yaml"
    overrides = run_overrides(digits, tmp_path / "run2", 1, teacher[0], f"distill.teacher_model={missing}")
    with pytest.raises(UserError, match=f"^distill.teacher_model='{missing}': no such file$"):
        check_paths(load_config(DEMO_CONFIG, overrides))


def test_a_shipped_model_yaml_gives_an_open_clip_teacher_open_clips_embeddings(tmp_path):
    """``distill.teacher_model=configs/model/ViT-B-32-quickgelu.yaml`` as the docs give it, which
    leaves the logit scale to the defaults, for a random open_clip ViT-B-32-quickgelu saved as a
    weights file: the teacher is open_clip's model (fp64, against open_clip's own forward)."""
    arch = "ViT-B-32-quickgelu"
    theirs = perturbed(open_clip.create_model(arch, pretrained=None))
    weights = tmp_path / "weights.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in theirs.state_dict().items()}, weights)
    distill = DistillConfig(
        teacher=f"open_clip:{arch}/{weights}", teacher_model=str(ROOT / "configs" / "model" / f"{arch}.yaml")
    )
    student = build_model(load_config(distill.teacher_model).model, on_meta=True)  # the same inputs
    teacher = load_teacher(distill, student, torch.device("cpu"), torch.float64)
    theirs.double()
    images = torch.randn(2, 3, 224, 224, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tokens = teacher.tokenizer(["a photo of a dog", "Two Cats & a café!"])
    with torch.no_grad():
        image, text = teacher.encode_image(images), teacher.encode_text(**tokens)
        expected_image = theirs.encode_image(images, normalize=True)
        expected_text = theirs.encode_text(tokens["input_ids"], normalize=True)
    torch.testing.assert_close(image, expected_image, rtol=0, atol=1e-10)
    torch.testing.assert_close(text, expected_text, rtol=0, atol=1e-10)
    assert torch.equal(teacher.logit_scale, theirs.logit_scale)


@pytest.mark.parametrize(
    ("student", "message"),
    [
        ("model.image.timm_kwargs.img_size=24", "the teacher takes 16 px images and the student 24 px"),
        ("model.text.context_length=10", "the teacher's tokenizer gives other token ids than the student's"),
    ],
)
def test_a_teacher_that_reads_other_inputs_is_named(demo_run, digits, tmp_path, student, message):
    pinned = demo_run / "checkpoints" / "step_00000040" / MODEL_FILE  # the run directory's newest
    with pytest.raises(UserError, match=f"^distill.teacher={pinned}: {message}"):
        trainer(digits, tmp_path, 1, f"distill.teacher={demo_run}", student)
