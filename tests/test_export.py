"""``clip-train export --format open_clip``: real open_clip, clip_benchmark and hub-cache loads of the export.

Every comparison runs each library's own preprocessing and tokenizer on the same PIL images and
captions, so it covers resize, normalisation, tokenization, masks, pooling and projections.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
import webdataset as wds
from PIL import Image
from processes import run_to_end
from small_runs import TINY_MODEL, TINY_MODEL_CONFIG
from test_model import write_bert_dir
from timm.layers import DropPath

import clip_train
import clip_train.export
from clip_train import load_config
from clip_train.checkpoint import save_checkpoint
from clip_train.cli import main as cli_main
from clip_train.export import MARKER, Location, hub_files, open_clip_config, verify
from clip_train.model import build_model

TEXTS = [
    "a photo of the number seven.",
    "3",
    "",
    "A Handwritten DIGIT, wow!",
    "café  &amp; “quotes”",
    "a very long caption that is far longer than the context length of the tiny model " * 3,
]
TOLERANCE = 1e-5


def errors(stderr: str) -> list[str]:
    """The error lines among the command's status lines (progress, what was exported)."""
    return [line for line in stderr.splitlines() if line.startswith("clip-train: error: ")]


def sample_images(digits: Path) -> list[Image.Image]:
    """Real digits (16 px), and random pictures of other sizes and modes that must be resized."""
    shard = sorted((digits / "val").glob("*.tar"))[0]
    samples = wds.WebDataset(str(shard), shardshuffle=False).decode("pil")
    images = [sample["png"] for _, sample in zip(range(4), samples, strict=False)]
    rng = np.random.default_rng(0)
    for height, width, mode in ((23, 37, "RGB"), (50, 20, "L"), (64, 64, "RGBA")):
        pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
        images.append(Image.fromarray(pixels, "RGBA").convert(mode))
    return images


def clip_train_embeddings(checkpoint: Path, images, texts) -> tuple[torch.Tensor, torch.Tensor]:
    model, preprocess, tokenizer = clip_train.load(checkpoint)
    with torch.no_grad():
        image = model.encode_image(torch.stack([preprocess(i) for i in images]))
        return image, model.encode_text(tokenizer(texts))


def open_clip_embeddings(name: str, images, texts) -> tuple[torch.Tensor, torch.Tensor]:
    model, _, preprocess = open_clip.create_model_and_transforms(name)
    tokenizer = open_clip.get_tokenizer(name)
    model.eval()
    with torch.no_grad():
        image = model.encode_image(torch.stack([preprocess(i) for i in images]), normalize=True)
        return image, model.encode_text(tokenizer(texts), normalize=True)


def assert_same_embeddings(checkpoint: Path, name: str, images, texts=TEXTS) -> None:
    ours = clip_train_embeddings(checkpoint, images, texts)
    theirs = open_clip_embeddings(name, images, texts)
    for what, mine, other in zip(("image", "text"), ours, theirs, strict=True):
        assert mine.shape == other.shape, what
        torch.testing.assert_close(other, mine, rtol=0, atol=TOLERANCE, msg=what)
    assert not torch.allclose(ours[1][0], ours[1][1], atol=1e-3)  # distinct inputs, distinct embeddings


def checkpoint_of(tmp_path: Path, *overrides: str) -> Path:
    """A random-init tiny model's checkpoint, as the trainer writes it."""
    model_cfg = load_config(TINY_MODEL_CONFIG, [*TINY_MODEL, *overrides]).model
    torch.manual_seed(0)
    return save_checkpoint(tmp_path / "run", 1, build_model(model_cfg), model_cfg, {"step": 1}, keep=1)


def clip_train_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run_to_end([sys.executable, "-m", "clip_train", *args], env={**os.environ, **env})


@pytest.fixture(scope="module")
def exported_demo(demo_run, tmp_path_factory) -> Path:
    """The trained demo run (mean pooling), exported by the real CLI."""
    out = tmp_path_factory.mktemp("export") / "demo"
    result = clip_train_cli("export", str(demo_run), str(out), "--format", "open_clip")
    assert result.returncode == 0, result.stderr[-3000:]
    checked = re.search(r"max \|difference\| image (\S+), text (\S+)", result.stderr)
    assert checked and max(float(checked[1]), float(checked[2])) <= TOLERANCE, result.stderr
    steps = [line for line in result.stderr.splitlines() if line.startswith("clip-train: export: ")]
    assert len(steps) == 4 and steps[-1].endswith(" s")  # two steps, each announced and timed
    assert "treats token id 0 as padding" not in result.stderr  # the bundled BPE's caveat only
    return out


# --------------------------------------------------------------------------------------------
# Exact embeddings
# --------------------------------------------------------------------------------------------


def test_the_trained_demo_model_with_mean_pooling(exported_demo, demo_run, digits):
    assert sorted(p.name for p in exported_demo.iterdir()) == [
        MARKER,
        "README.md",
        "config.json",
        "open_clip_config.json",
        "open_clip_model.safetensors",
        "tokenizer.json",  # its WordPiece vocabulary, which open_clip loads from the folder
        "tokenizer_config.json",
    ]
    assert (
        json.loads((exported_demo / "open_clip_config.json").read_text())["model_cfg"]["text_cfg"][
            "hf_pooler_type"
        ]
        == "mean_pooler"
    )
    assert_same_embeddings(demo_run, f"local-dir:{exported_demo}", sample_images(digits))


def test_open_clip_builds_the_export_with_the_runs_stochastic_depth(exported_demo, demo_run):
    """Training the export in OpenCLIP drops the image trunk's residual branches as the run did
    (TINY_MODEL's drop_path_rate 0.1); a trunk configured without one exports none."""
    vision_cfg = json.loads((exported_demo / "open_clip_config.json").read_text())["model_cfg"]["vision_cfg"]
    assert vision_cfg["timm_drop_path"] == 0.1
    theirs, _, _ = open_clip.create_model_and_transforms(f"local-dir:{exported_demo}")
    ours, _, _ = clip_train.load(demo_run)
    rates = [
        [m.drop_prob for m in clip.visual.trunk.modules() if isinstance(m, DropPath)]
        for clip in (ours, theirs)
    ]
    assert rates[0] == rates[1] and max(rates[0]) == pytest.approx(0.1)
    trunk = "model.image.timm_kwargs={img_size: 16, patch_size: 8, depth: 2, embed_dim: 32, num_heads: 2}"
    plain = build_model(load_config(TINY_MODEL_CONFIG, [*TINY_MODEL, trunk]).model)
    assert not {"timm_drop_path", "patch_dropout"} & set(
        open_clip_config(plain, Location.folder(exported_demo))["model_cfg"]["vision_cfg"]
    )


def test_open_clip_builds_the_export_with_the_runs_patch_dropout(tmp_path):
    """FLIP's patch dropout (``timm_kwargs.patch_drop_rate``) goes on as open_clip's ``patch_dropout``,
    which open_clip hands back to the timm trunk. The export's own check compares the towers in eval
    mode, where every patch is seen, and hands a training model back training."""
    overrides = [*TINY_MODEL, "model.image.timm_kwargs.patch_drop_rate=0.5"]
    export = tmp_path / "export"
    model = build_model(load_config(TINY_MODEL_CONFIG, overrides).model)  # training: dropout on
    clip_train.export.export_open_clip(model, export)
    assert model.training
    vision_cfg = json.loads((export / "open_clip_config.json").read_text())["model_cfg"]["vision_cfg"]
    assert vision_cfg["patch_dropout"] == 0.5
    theirs, _, _ = open_clip.create_model_and_transforms(f"local-dir:{export}")
    assert theirs.visual.trunk.patch_drop.prob == 0.5


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.text.pooling=cls"],
        [
            "model.image.lock=true",
            "model.image.unlocked_layers=1",
            "model.text.lock=true",
            "model.text.unlocked_layers=1",
        ],
    ],
    ids=["cls", "lit-locked"],
)
def test_cls_pooling_and_a_lit_locked_tower(tmp_path, digits, overrides, capsys):
    checkpoint = checkpoint_of(tmp_path, *overrides)
    assert cli_main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    assert_same_embeddings(checkpoint, f"local-dir:{tmp_path / 'out'}", sample_images(digits))


def test_a_bundled_bpe_export_says_that_open_clip_masks_its_token_id_0(tmp_path, capsys):
    """open_clip masks a BERT tower's input where the id is 0, which the bundled BPE also writes for
    "!" before some punctuation: the export says so (a WordPiece vocabulary pads with its own id)."""
    checkpoint = checkpoint_of(tmp_path, "model.text.tokenizer=open_clip")
    assert cli_main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    assert 'note: open_clip treats token id 0 as padding, which the bundled BPE also uses for "!"' in (
        capsys.readouterr().err
    )


def test_a_sigmoid_loss_model_keeps_its_logit_bias(tmp_path, digits):
    """A SigLIP-style model: open_clip builds the bias parameter and loads its learned value."""
    checkpoint = checkpoint_of(tmp_path, "model.init_logit_bias=-7.5")
    with warnings.catch_warnings(action="error"):  # reading the trainable bias must not warn the user
        assert cli_main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'out'}")
    assert model.logit_bias is not None and model.logit_bias.item() == -7.5
    assert_same_embeddings(checkpoint, f"local-dir:{tmp_path / 'out'}", sample_images(digits))


def test_a_transformers_tokenizer_is_exported_and_cleans_text_as_open_clip_does(tmp_path, digits):
    write_bert_dir(tmp_path / "bert")
    checkpoint = checkpoint_of(
        tmp_path, f"model.text.hf={tmp_path / 'bert'}", "model.text.hf_config={}", "model.text.tokenizer="
    )
    assert cli_main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    text_cfg = json.loads((tmp_path / "out" / "open_clip_config.json").read_text())["model_cfg"]["text_cfg"]
    assert text_cfg["hf_tokenizer_name"] == str(tmp_path / "out")
    texts = ["the digit seven&amp;zero", "  a   handwritten\tseven ", "the digit seven&zero"]
    _, _, tokenizer = clip_train.load(checkpoint)
    assert tokenizer(texts[:1]).tolist() == tokenizer(texts[2:]).tolist()
    assert_same_embeddings(checkpoint, f"local-dir:{tmp_path / 'out'}", sample_images(digits), texts)


# --------------------------------------------------------------------------------------------
# What cannot be exported, and where the export goes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "model.text.hf_config={model_type: distilbert, dim: 32, n_layers: 1, n_heads: 2, "
                "hidden_dim: 64, max_position_embeddings: 16}"
            ],
            "model.text.hf: open_clip's text tower supports bert, m2m_100, mt5, roberta, xlm-roberta "
            "encoders, not distilbert",
        ),
        (
            [
                "model.text.hf_config={model_type: bert, hidden_size: 32, num_hidden_layers: 1, "
                "num_attention_heads: 2, intermediate_size: 64, max_position_embeddings: 16, pad_token_id: 1}"
            ],
            "model.text.tokenizer pads with id 0 but the encoder's pad_token_id is 1, from which open_clip "
            "derives the attention mask",
        ),
    ],
    ids=["encoder-type", "pad-id"],
)
def test_what_open_clip_cannot_express_is_one_line_naming_the_key(tmp_path, capsys, overrides, message):
    checkpoint = checkpoint_of(tmp_path, *overrides)
    assert cli_main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
    assert errors(capsys.readouterr().err) == [f"clip-train: error: {message}"]
    assert not (tmp_path / "out").exists()


def test_a_pad_id_that_also_marks_real_tokens_is_refused(tmp_path, capsys):
    """A tokenizer padding with its [SEP] id: open_clip would mask every caption's end token."""
    bert, tokenizer = write_bert_dir(tmp_path / "bert")
    tokenizer.pad_token = "[SEP]"
    tokenizer.save_pretrained(tmp_path / "bert")
    bert.config.pad_token_id = tokenizer.pad_token_id
    bert.config.save_pretrained(tmp_path / "bert")
    checkpoint = checkpoint_of(
        tmp_path, f"model.text.hf={tmp_path / 'bert'}", "model.text.hf_config={}", "model.text.tokenizer="
    )
    capsys.readouterr()  # transformers' progress bars
    assert cli_main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
    assert errors(capsys.readouterr().err) == [
        f"clip-train: error: model.text.tokenizer: its pad id {tokenizer.pad_token_id} also stands for a "
        "token of every caption (e.g. the end token), which open_clip would mask as padding"
    ]


def test_the_export_check_sees_a_tower_that_differs(tmp_path):
    """What the command compares before it finishes: a copy built with another pooling is caught."""
    exported = checkpoint_of(tmp_path / "cls")
    assert cli_main(["export", str(exported), str(tmp_path / "out")]) == 0
    same_weights_mean_pooling, _, _ = clip_train.load(
        checkpoint_of(tmp_path / "mean", "model.text.pooling=mean")
    )
    image, text = verify(same_weights_mean_pooling, Location.folder(tmp_path / "out"))
    assert image == 0 and text > 0.01


def test_an_export_replaces_its_own_earlier_export(tmp_path):
    checkpoint, out = checkpoint_of(tmp_path), tmp_path / "out"
    assert cli_main(["export", str(checkpoint), str(out)]) == 0
    (out / "open_clip_model.safetensors").write_bytes(b"from before")
    assert cli_main(["export", str(checkpoint), str(out)]) == 0
    assert (out / MARKER).is_file() and (out / "open_clip_model.safetensors").read_bytes() != b"from before"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folders left


def files_under(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its content (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in folder.rglob("*")}


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "a git checkout",
            "{out} holds files and is not an earlier export (it has no .clip_train_export); pick a new or "
            "empty folder",
        ),
        ("a file", "{out} is a file; give a folder to export into"),
    ],
    ids=["a git checkout", "a file"],
)
def test_anything_but_an_earlier_export_is_left_untouched(tmp_path, capsys, target, message):
    checkpoint, out = checkpoint_of(tmp_path / "source"), tmp_path / "out"
    if target == "a file":
        out.write_text("mine")
    else:
        (out / ".git").mkdir(parents=True)
        (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (out / "notes.txt").write_text("mine")
    before = files_under(tmp_path)
    assert cli_main(["export", str(checkpoint), str(out)]) == 2
    assert errors(capsys.readouterr().err) == [f"clip-train: error: {message.format(out=out)}"]
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("below", ["out", "sub/out"])
def test_an_out_below_a_file_is_one_line_before_anything_is_written(tmp_path, capsys, below):
    """``clip-train export CKPT afile/out``: refused before loading, naming OUT and the file in its way."""
    checkpoint, afile = checkpoint_of(tmp_path / "source"), tmp_path / "afile"
    afile.write_text("mine")
    out = afile / below
    before = files_under(tmp_path)
    assert cli_main(["export", str(checkpoint), str(out)]) == 2
    assert errors(capsys.readouterr().err) == [
        f"clip-train: error: cannot export to {out}: {afile} is a file, not a folder"
    ]
    assert files_under(tmp_path) == before


def full_disk(monkeypatch, when: str) -> None:
    """A full disk while the weights are written (half a file left), or at the swap into place."""

    def fail(path: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def write_half(weights: dict, file: Path, metadata: dict | None = None) -> None:
        file.write_bytes(b"half of the weights")
        fail(file)

    def replace(src: os.PathLike, dst: os.PathLike) -> None:
        if ".tmp-" in Path(src).name:
            fail(dst)
        real_replace(src, dst)

    real_replace = os.replace
    if when == "weights":
        monkeypatch.setattr(clip_train.export, "save_weights", write_half)
    else:
        monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("when", ["weights", "swap"])
@pytest.mark.parametrize("earlier", [False, True], ids=["new folder", "over an earlier export"])
def test_a_full_disk_is_one_line_and_leaves_no_temporary_folder(tmp_path, capsys, monkeypatch, earlier, when):
    checkpoint, out = checkpoint_of(tmp_path / "source"), tmp_path / "out"
    if earlier:
        assert cli_main(["export", str(checkpoint), str(out)]) == 0
        capsys.readouterr()
    before = files_under(tmp_path)
    full_disk(monkeypatch, when)
    assert cli_main(["export", str(checkpoint), str(out)]) == 2
    kept = "the earlier export there is unchanged" if earlier else "nothing was written there"
    assert errors(capsys.readouterr().err) == [
        f"clip-train: error: cannot export to {out}: No space left on device; {kept}"
    ]
    # no .out.tmp-<pid>/ or .out.old-<pid>/ left, and an earlier export as it was
    assert files_under(tmp_path) == before


def test_an_export_open_clip_does_not_reproduce_leaves_the_earlier_one(tmp_path, capsys, monkeypatch):
    """It is checked where it was written, before it takes the earlier export's place. No tower here
    differs (check_expressible refuses those that would): a tolerance below any difference stands in."""
    checkpoint, out = checkpoint_of(tmp_path / "source"), tmp_path / "out"
    assert cli_main(["export", str(checkpoint), str(out)]) == 0
    capsys.readouterr()
    before = files_under(tmp_path)
    monkeypatch.setattr(clip_train.export, "VERIFY_TOLERANCE", -1.0)
    assert cli_main(["export", str(checkpoint), str(out)]) == 2
    (line,) = errors(capsys.readouterr().err)
    assert re.fullmatch(
        r"clip-train: error: model\.image\.timm: open_clip's copy differs from the model .*", line
    )
    assert files_under(tmp_path) == before


HUB_EMBEDDINGS = """
import json, sys, torch, open_clip
from PIL import Image
from timm.layers import DropPath
name, images, texts = sys.argv[1], [Image.open(p) for p in json.loads(sys.argv[2])], json.loads(sys.argv[3])
model, _, preprocess = open_clip.create_model_and_transforms(name)
tokenizer = open_clip.get_tokenizer(name)
with torch.no_grad():
    image = model.eval().encode_image(torch.stack([preprocess(i) for i in images]), normalize=True)
    text = model.encode_text(tokenizer(texts), normalize=True)
print(json.dumps([image.tolist(), text.tolist()]))
"""


def test_what_push_to_hub_uploads_loads_from_the_hub(exported_demo, demo_run, digits, tmp_path):
    """The uploaded files, laid out as huggingface_hub caches a download, load with ``hf-hub:REPO``
    in a fresh process with the hub offline: the names they hold point at the repo, not at OUT."""
    repo = "clip-train-test/digits-demo"
    model, _, _ = clip_train.load(demo_run)
    revision = "0" * 40
    cache = tmp_path / "hub" / "models--clip-train-test--digits-demo"
    (cache / "refs").mkdir(parents=True)
    (cache / "refs" / "main").write_text(revision)
    snapshot = cache / "snapshots" / revision
    snapshot.mkdir(parents=True)
    uploaded = hub_files(model, exported_demo, repo)
    assert MARKER not in uploaded and (exported_demo / MARKER).is_file()  # the marker stays local
    for name, content in uploaded.items():
        (snapshot / name).write_bytes(content if isinstance(content, bytes) else content.read_bytes())
    assert str(exported_demo) not in (snapshot / "open_clip_config.json").read_text()
    images = sample_images(digits)
    paths = []
    for i, image in enumerate(images):
        paths.append(str(tmp_path / f"{i}.png"))
        image.save(paths[-1])
    command = [sys.executable, "-c", HUB_EMBEDDINGS, f"hf-hub:{repo}", json.dumps(paths), json.dumps(TEXTS)]
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    result = run_to_end(command, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = [torch.tensor(t) for t in json.loads(result.stdout.splitlines()[-1])]
    ours = clip_train_embeddings(demo_run, [Image.open(p) for p in paths], TEXTS)
    for mine, other in zip(ours, theirs, strict=True):
        torch.testing.assert_close(other, mine, rtol=0, atol=TOLERANCE)


def test_push_to_hub_offline_is_one_line_and_keeps_the_export(demo_run, tmp_path):
    out = tmp_path / "out"
    result = clip_train_cli("export", str(demo_run), str(out), "--push-to-hub", "me/demo", HF_HUB_OFFLINE="1")
    assert result.returncode == 2
    (line,) = errors(result.stderr)
    assert line.startswith("clip-train: error: --push-to-hub me/demo: Cannot reach https://huggingface.co")
    assert line.endswith(
        f"the export in {out} is complete, rerun with --push-to-hub when the hub is reachable"
    )
    assert (out / "open_clip_config.json").is_file() and (out / "open_clip_model.safetensors").is_file()


# --------------------------------------------------------------------------------------------
# clip_benchmark
# --------------------------------------------------------------------------------------------


# clip_benchmark 1.6.2's accuracy() calls float() on 1-element arrays, which NumPy >= 2.4 rejects
# (LAION-AI/CLIP_benchmark#147). The shim gives float() NumPy < 2.4's behaviour in that module only,
# so its own code still computes every number.
CLIP_BENCHMARK = """
import builtins, sys
import numpy
from clip_benchmark import cli
from clip_benchmark.metrics import zeroshot_classification
zeroshot_classification.float = lambda value: builtins.float(numpy.asarray(value).reshape(()))
sys.exit(cli.main())
"""


def write_clip_benchmark_digits(digits: Path, root: Path) -> None:
    """The digits val set in clip_benchmark's webdataset layout, by its own converter."""
    from clip_benchmark.webdataset_builder import convert_dataset

    zeroshot = json.loads((digits / "zeroshot.json").read_text())
    samples = wds.WebDataset(sorted(str(p) for p in (digits / "val").glob("*.tar")), shardshuffle=False)

    class Labelled(list):
        """(image bytes, label) pairs with the ``classes`` and ``templates`` convert_dataset reads."""

    dataset = Labelled((s["png"], json.loads(s["json"])["label"]) for s in samples)
    dataset.classes = zeroshot["classnames"]
    dataset.templates = [t.replace("{}", "{c}") for t in zeroshot["templates"]]
    convert_dataset(dataset, "test", str(root), image_format="png", verbose=False)


@pytest.mark.slow
def test_clip_benchmark_zero_shot_agrees_with_clip_train_eval(exported_demo, demo_run, digits, tmp_path):
    root = tmp_path / "wds_digits"
    write_clip_benchmark_digits(digits, root)
    assert (root / "classnames.txt").read_text().splitlines()[3] == "three"
    benchmark = [
        sys.executable, "-c", CLIP_BENCHMARK, "eval", "--model_type", "open_clip",
        "--model", f"local-dir:{exported_demo}", "--pretrained", "none",
        "--dataset", "wds/digits", "--dataset_root", str(root), "--task", "zeroshot_classification",
        "--no_amp", "--num_workers", "0", "--batch_size", "64", "--output", str(tmp_path / "result.json"),
    ]  # fmt: skip
    result = run_to_end(benchmark)
    assert result.returncode == 0, result.stderr[-3000:]
    top1 = json.loads((tmp_path / "result.json").read_text())["metrics"]["acc1"]
    zeroshot = [f"eval.zeroshot={digits}/zeroshot.json", f"eval.zeroshot_data={digits}/val"]
    evaluated = clip_train_cli("eval", str(demo_run), *zeroshot)  # the checkpoint's own model config
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    ours = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert ours["zeroshot/n"] == 359 and ours["zeroshot/top1"] > 0.1  # better than chance: a trained model
    assert abs(top1 - ours["zeroshot/top1"]) <= 0.01
