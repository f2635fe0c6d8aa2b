"""Evaluation: zero-shot accuracy, retrieval recall, sharding over ranks and the eval CLI.

The zero-shot and sharding tests use ``ToyCLIP``, whose answers are known by construction: each
test image carries its class in the red channel and its sample id in the green channel, and the
model reads them back as one-hot features. Data goes through real WebDataset tars and the real
eval loader (or a real torchvision ImageFolder), so everything but the towers runs for real.
"""

from __future__ import annotations

import collections
import io
import itertools
import json
import math
import multiprocessing
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import webdataset as wds
from dist_utils import run_distributed
from PIL import Image
from processes import run_to_end
from safetensors.torch import save_file
from timm.data import ImageNetInfo
from torch import nn

from clip_train.cli import main as cli_main
from clip_train.config import DataConfig, EvalConfig, load_config
from clip_train.data.eval_sources import image_folder_batches, shard_batches
from clip_train.errors import UserError
from clip_train.eval import (
    EvalError,
    build_zeroshot_classifier,
    encode_split,
    evaluate,
    hits_at_k,
    retrieval_recall,
    zeroshot_from_features,
    zeroshot_metadata,
)
from clip_train.logs import setup_logging

REPO = Path(__file__).resolve().parents[1]
TOY_SCALE = 10.0  # the toy model's logit scale, for the validation loss
CLASSNAMES = ["cat", "dog", "fox", "owl", "bee", "elk"]
TEMPLATES = ["a photo of a {}.", "a drawing of the {}.", "{}"]
CLASS_STEP = 40  # red value = CLASS_STEP * class + CLASS_STEP // 2
SHARD_SIZES = (5, 3, 6)  # uneven, so two ranks get different sample counts
NUM_SAMPLES = sum(SHARD_SIZES)
LABELS = [i % len(CLASSNAMES) for i in range(NUM_SAMPLES)]
IMAGE_SIZE = 16
CPU = torch.device("cpu")


class ToyCLIP(nn.Module):
    """A hand-built CLIP with known answers.

    Image feature: one-hot of ``class_map[class]`` plus one-hot of the sample id (normalised).
    Text feature: one-hot of the class a prompt names, or of the sample id of ``"sample {id}"``.
    ``class_map`` = identity is a perfect zero-shot classifier; a derangement is always wrong.
    """

    image_size = IMAGE_SIZE

    def __init__(self, class_map: list[int]) -> None:
        super().__init__()
        self.register_buffer("class_map", torch.tensor(class_map))
        self.dim = len(CLASSNAMES) + NUM_SAMPLES
        self.anchor = nn.Parameter(torch.zeros(()))  # gives the module parameters, as a real one has
        self.logit_scale = nn.Parameter(torch.tensor(math.log(TOY_SCALE), dtype=torch.float64))
        self.logit_bias = None

    def tokenizer(self, texts: list[str]) -> dict[str, torch.Tensor]:
        ids = [self._token(text) for text in texts]
        return {"input_ids": torch.tensor(ids)[:, None], "attention_mask": torch.ones(len(ids), 1).long()}

    @staticmethod
    def _token(text: str) -> int:
        sample = re.fullmatch(r"sample (\d+)", text)
        if sample:
            return len(CLASSNAMES) + int(sample.group(1))
        (name,) = [word for word in re.findall(r"[a-z]+", text) if word in CLASSNAMES]
        return CLASSNAMES.index(name)

    def _check_inference(self) -> None:
        assert not self.training and not torch.is_grad_enabled(), "eval must run in eval mode under no_grad"

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        self._check_inference()
        assert images.dtype == torch.uint8 and images.shape[-2:] == (IMAGE_SIZE, IMAGE_SIZE)
        red, green = images[:, :2].double().mean((2, 3)).round().long().unbind(1)
        features = F.one_hot(self.class_map[red // CLASS_STEP], self.dim)
        features += F.one_hot(len(CLASSNAMES) + green, self.dim)
        return F.normalize(features.double(), dim=-1)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self._check_inference()
        return F.one_hot(input_ids[:, 0], self.dim).double()


PERFECT = list(range(len(CLASSNAMES)))
SHIFTED = [(c + 1) % len(CLASSNAMES) for c in PERFECT]


def toy_image(label: int, sample_id: int, size: int = IMAGE_SIZE) -> Image.Image:
    pixels = np.zeros((size, size, 3), np.uint8)
    pixels[..., 0] = CLASS_STEP * label + CLASS_STEP // 2
    pixels[..., 1] = sample_id
    pixels[..., 2] = np.random.default_rng(sample_id).integers(0, 256, (size, size))
    return Image.fromarray(pixels)


def write_shards(
    directory: Path,
    captions: list[str] | None,
    image_size: int = IMAGE_SIZE,
    bad_first: int = 0,
    bad_last: int = 0,
    broken_json: bool = False,
) -> str:
    """Real WebDataset tars of png + txt + json; returns the brace-expanded URL. No ``captions``: no
    txt (a classification set's layout); ``broken_json``: a json that does not parse, no label.
    ``bad_first`` samples whose png does not decode open the first shard, ``bad_last`` close the
    last one."""
    directory.mkdir(parents=True, exist_ok=True)
    sample_id = 0
    for shard, size in enumerate(SHARD_SIZES):
        with wds.TarWriter(str(directory / f"val-{shard:06d}.tar")) as sink:
            write_bad_samples(sink, "first", bad_first if shard == 0 else 0)
            for _ in range(size):
                png = io.BytesIO()
                toy_image(LABELS[sample_id], sample_id, image_size).save(png, format="PNG")
                caption = {} if captions is None else {"txt": captions[sample_id]}
                meta = b"{not json" if broken_json else {"label": LABELS[sample_id]}
                sink.write({"__key__": f"s{sample_id:05d}", "png": png.getvalue(), **caption, "json": meta})
                sample_id += 1
            write_bad_samples(sink, "last", bad_last if shard == len(SHARD_SIZES) - 1 else 0)
    return f"{directory}/val-{{000000..{len(SHARD_SIZES) - 1:06d}}}.tar"


def write_bad_samples(sink: wds.TarWriter, where: str, count: int) -> None:
    for n in range(count):
        sink.write(
            {"__key__": f"bad_{where}{n}", "png": b"not a png", "txt": "sample 0", "json": {"label": 0}}
        )


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """Shards with exact captions, shards where every third caption names the next sample, an
    ImageFolder (20 px images, so they are resized) and the class-name JSON."""
    root = tmp_path_factory.mktemp("eval_data")
    exact = [f"sample {i}" for i in range(NUM_SAMPLES)]
    mixed = [f"sample {(i + 1) % NUM_SAMPLES if i % 3 == 0 else i}" for i in range(NUM_SAMPLES)]
    for i, label in enumerate(LABELS):
        folder = root / "folder" / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        toy_image(label, i, size=20).save(folder / f"{i}.png")
    (root / "zeroshot.json").write_text(json.dumps({"classnames": CLASSNAMES, "templates": TEMPLATES}))
    return {
        "exact": write_shards(root / "exact", exact),
        "exact_with_bad": write_shards(root / "exact_with_bad", exact, bad_first=2, bad_last=3),
        "mixed": write_shards(root / "mixed", mixed),
        "folder": str(root / "folder"),
        "zeroshot": str(root / "zeroshot.json"),
    }


# --------------------------------------------------------------------------------------------
# Zero-shot
# --------------------------------------------------------------------------------------------


def perfect_zeroshot(n: int, skipped: int = 0) -> dict[str, float]:
    """The metrics of a zero-shot pass that classifies each of its ``n`` images right."""
    return {"zeroshot/top1": 1.0, "zeroshot/top5": 1.0, "zeroshot/n": n, "zeroshot/skipped": skipped}


def test_zeroshot_perfect_model_scores_one_and_permuted_zero(data):
    classnames, templates = zeroshot_metadata(data["zeroshot"])
    assert classnames == CLASSNAMES and [t("x") for t in templates] == [t.format("x") for t in TEMPLATES]
    # shifted by one, one wrong class scores above the true one and 4 tie with it: top-5 4/5 of the time
    for class_map, top1, top5 in ((PERFECT, 1.0, 1.0), (SHIFTED, 0.0, 0.8)):
        model = ToyCLIP(class_map)
        classifier = build_zeroshot_classifier(model, classnames, templates, device=CPU, batch_size=4)
        batches = shard_batches(data["exact"], model, batch_size=4, rank=0, world_size=1)
        split = encode_split(model, batches, device=CPU, precision="fp32", text=False, labels=True)
        result = zeroshot_from_features(split.image_features, split.labels, classifier)
        assert result == pytest.approx({"top1": top1, "top5": top5, "n": NUM_SAMPLES}, abs=1e-12)


def test_zeroshot_classifier_averages_templates(tiny_model):
    """Against one prompt at a time, so batching across classes cannot mix them up."""
    templates = [t.format for t in TEMPLATES]
    classifier = build_zeroshot_classifier(tiny_model, CLASSNAMES, templates, device=CPU, batch_size=5)
    tiny_model.eval()
    with torch.no_grad():
        reference = []
        for name in CLASSNAMES:
            per_template = [tiny_model.encode_text(**tiny_model.tokenizer([t(name)])) for t in templates]
            reference.append(F.normalize(torch.cat(per_template).mean(0), dim=0))
    assert classifier.shape == (len(CLASSNAMES), tiny_model.text.proj.out_features)
    torch.testing.assert_close(classifier, torch.stack(reference), rtol=1e-5, atol=1e-6)


def test_evaluate_reports_both_and_restores_train_mode(data):
    model = ToyCLIP([0, 1, 2, 3, 5, 4]).train()  # classes 4 and 5 swapped
    eval_cfg = EvalConfig(zeroshot=data["zeroshot"], batch_size=4)
    saved: list[torch.Size] = []  # for a backward that never comes, kept until the loss is summed
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        metrics = evaluate(model, eval_cfg, DataConfig(val=data["exact"]), device=CPU, precision="fp32")
    assert saved == []
    # Every image scores s/√2 with its own caption and 0 with the others, in both directions.
    positive = TOY_SCALE / math.sqrt(2)
    # fp32 features: the loss is a difference of two ~7.08 log-sum-exps, good to ~1e-6 absolute.
    expected_loss = math.log1p((NUM_SAMPLES - 1) * math.exp(-positive))
    assert metrics.pop("val/loss") == pytest.approx(expected_loss, rel=1e-4)
    swapped = sum(label >= 4 for label in LABELS) / NUM_SAMPLES
    recall = {f"retrieval/{d}_R@{k}": 1.0 for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)}
    assert metrics == pytest.approx(
        {
            **recall,
            "retrieval/n": NUM_SAMPLES,
            "retrieval/skipped": 0,
            "zeroshot/top1": 1 - swapped,
            "zeroshot/top5": 1 - swapped * (1 - 0.8),  # a swapped image: 1 class above, 4 tied
            "zeroshot/n": NUM_SAMPLES,
            "zeroshot/skipped": 0,
        },
        abs=1e-12,
    )
    assert model.training


def test_zeroshot_shards_count_whatever_caption_key_the_training_shards_use(data):
    """Zero-shot reads only labels: its txt-captioned shards stay usable under
    data.caption_key=json:caption."""
    eval_cfg = EvalConfig(zeroshot=data["zeroshot"], zeroshot_data=data["exact"], retrieval=False)
    data_cfg = DataConfig(caption_key="json:caption", workers=0)
    metrics = evaluate(ToyCLIP(PERFECT), eval_cfg, data_cfg, device=CPU, precision="fp32")
    assert metrics == perfect_zeroshot(NUM_SAMPLES)


def test_zeroshot_shards_need_no_caption(tmp_path, data):
    """A classification set's shards hold an image and a json label, no caption: every sample was
    skipped as missing_caption, and the evaluation failed for want of labelled images."""
    labelled_only = write_shards(tmp_path / "labels", captions=None)
    eval_cfg = EvalConfig(zeroshot=data["zeroshot"], zeroshot_data=labelled_only, retrieval=False)
    metrics = evaluate(ToyCLIP(PERFECT), eval_cfg, DataConfig(workers=0), device=CPU, precision="fp32")
    assert metrics == perfect_zeroshot(NUM_SAMPLES)


def test_retrieval_reads_no_label_so_a_broken_json_beside_a_caption_costs_no_sample(tmp_path):
    """Evaluation read every json for zero-shot's labels, and a txt caption first in a caption_key
    list did not stop a broken json costing its sample: retrieval skipped all of them."""
    exact = [f"sample {i}" for i in range(NUM_SAMPLES)]
    val = write_shards(tmp_path / "val", exact, broken_json=True)
    data_cfg = DataConfig(val=val, caption_key=["txt", "json:caption"], workers=0)
    metrics = evaluate(ToyCLIP(PERFECT), EvalConfig(), data_cfg, device=CPU, precision="fp32")
    assert (metrics["retrieval/n"], metrics["retrieval/skipped"]) == (NUM_SAMPLES, 0)
    assert metrics["retrieval/image_to_text_R@1"] == metrics["retrieval/text_to_image_R@1"] == 1.0


def test_retrieval_on_a_table_with_named_columns_equals_its_shards(data, tmp_path):
    """``data.val`` may be a CSV, as OpenCLIP's --val-data: the ``data.csv_*`` keys reach the loader."""
    lines = ["caption;image"]
    for i in range(NUM_SAMPLES):
        toy_image(LABELS[i], i).save(tmp_path / f"{i}.png")
        lines.append(f"sample {i};{i}.png")
    (tmp_path / "val.csv").write_text("\n".join(lines) + "\n")
    keys = dict(csv_separator=";", csv_image_key="image", csv_caption_key="caption", csv_shard_rows=4)
    model, eval_cfg = ToyCLIP(PERFECT), EvalConfig(batch_size=4)
    from_table = evaluate(
        model, eval_cfg, DataConfig(val=str(tmp_path / "val.csv"), **keys), device=CPU, precision="fp32"
    )
    from_shards = evaluate(model, eval_cfg, DataConfig(val=data["exact"]), device=CPU, precision="fp32")
    assert from_table["retrieval/n"] == NUM_SAMPLES and "val/loss" in from_table
    assert from_table == pytest.approx(from_shards, abs=1e-12)


def test_zeroshot_on_an_image_folder(data):
    eval_cfg = EvalConfig(zeroshot=data["zeroshot"], zeroshot_data=data["folder"], retrieval=False)
    metrics = evaluate(ToyCLIP(PERFECT), eval_cfg, DataConfig(workers=0), device=CPU, precision="fp32")
    assert metrics == perfect_zeroshot(NUM_SAMPLES)


class NamedToy(ToyCLIP):
    """A toy for many named classes: a prompt's class is the name a template filled in; class i's
    images hold (red, green) = (i % 250, i // 250), and its feature is class i's, or with a
    ``decoy`` leans to the decoy's (1 against 0.9), so the decoy wins whenever it is scored."""

    def __init__(self, classnames: list[str], templates: list, decoy: int | None = None) -> None:
        super().__init__(PERFECT)
        self.dim, self.decoy = len(classnames), decoy
        self.prompts = {template(name): i for i, name in enumerate(classnames) for template in templates}

    def tokenizer(self, texts: list[str]) -> dict[str, torch.Tensor]:
        ids = torch.tensor([[self.prompts[text]] for text in texts])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        self._check_inference()
        red, green = images[:, :2].double().mean((2, 3)).round().long().unbind(1)
        features = F.one_hot(red + 250 * green, self.dim).double()
        if self.decoy is not None:
            features = 0.9 * features + F.one_hot(torch.full_like(red, self.decoy), self.dim)
        return F.normalize(features, dim=-1)


def class_folders(root: Path, folders: dict[str, int], per_class: int = 2) -> str:
    """An ImageFolder: ``folders`` maps each folder's name to the class its 20 px images show."""
    for name, label in folders.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.zeros((20, 20, 3), np.uint8)
            pixels[..., 0], pixels[..., 1], pixels[..., 2] = label % 250, label // 250, i
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return str(root)


def test_zeroshot_on_a_subset_of_imagenet_scores_among_its_classes(tmp_path, capsys):
    """ImageNet-R's and ImageNet-A's layout: 200 of the synset folders. Scored among all 1000
    classes every image here would go to the decoy; among the folder's own, each is right."""
    classnames, templates = zeroshot_metadata("imagenet-simple")
    synsets = ImageNetInfo().label_names()
    chosen = [10, 300, 998]
    folder = class_folders(tmp_path, {synsets[c]: c for c in chosen})
    model = NamedToy(classnames, templates, decoy=500)
    eval_cfg = EvalConfig(zeroshot="imagenet-simple", zeroshot_data=folder, retrieval=False)
    setup_logging()
    metrics = evaluate(model, eval_cfg, DataConfig(workers=0), device=CPU, precision="fp32")
    assert metrics == perfect_zeroshot(6)
    assert f"eval: {folder} holds 3 of the 1000 classes" in capsys.readouterr().err

    model.eval()
    with torch.no_grad():
        images = torch.stack([img for c in chosen for img in (class_image(c), class_image(c))])
        everything = build_zeroshot_classifier(model, classnames, templates, device=CPU, batch_size=64)
        labels = torch.tensor([c for c in chosen for _ in range(2)])
        assert zeroshot_from_features(model.encode_image(images).float(), labels, everything)["top1"] == 0.0


def test_more_zeroshot_sets_are_scored_each_under_its_name(tmp_path):
    """ImageNet-R's layout beside ImageNet-V2's, as OpenCLIP's --imagenet-v2 adds a set: the same
    classifier, each set's own classes (the decoy wins only where all 1000 are scored)."""
    synsets = ImageNetInfo().label_names()
    chosen = [10, 300, 998]
    r_like = class_folders(tmp_path / "r", {synsets[c]: c for c in chosen})
    v2_like = class_folders(tmp_path / "v2", {str(c): c for c in chosen}, per_class=1)
    classnames, templates = zeroshot_metadata("imagenet-simple")
    eval_cfg = EvalConfig(
        zeroshot="imagenet-simple", zeroshot_data=r_like, zeroshot_sets={"v2": v2_like}, retrieval=False
    )
    model = NamedToy(classnames, templates, decoy=500)
    metrics = evaluate(model, eval_cfg, DataConfig(workers=0), device=CPU, precision="fp32")
    assert metrics == {
        **perfect_zeroshot(6),
        **{"zeroshot/v2/top1": 0.0, "zeroshot/v2/top5": 1.0, "zeroshot/v2/n": 3, "zeroshot/v2/skipped": 0},
    }


def test_a_missing_set_is_named_by_its_key(data, tmp_path):
    """``evaluate`` names the key itself too, for callers without the start-up checks."""
    eval_cfg = EvalConfig(zeroshot=data["zeroshot"], zeroshot_sets={"v2": str(tmp_path / "nope")})
    with pytest.raises(
        UserError, match=re.escape(f"eval.zeroshot_sets.v2: no such file or directory: {tmp_path}")
    ):
        evaluate(ToyCLIP(PERFECT), eval_cfg, DataConfig(val=data["exact"]), device=CPU, precision="fp32")
    with pytest.raises(UserError, match=re.escape(f"data.val: no such file or directory: {tmp_path}")):
        evaluate(
            ToyCLIP(PERFECT),
            EvalConfig(),
            DataConfig(val=str(tmp_path / "gone")),
            device=CPU,
            precision="fp32",
        )


def class_image(label: int) -> torch.Tensor:
    return torch.tensor([label % 250, label // 250, 0], dtype=torch.uint8)[:, None, None].expand(3, 16, 16)


def test_zeroshot_folders_named_by_number_take_the_number_as_label(tmp_path):
    """ImageNet-V2's layout: folders 0 to 999. Sorted as text, 10 and 11 would come before 2."""
    classnames, templates = [f"thing {i}" for i in range(12)], ["a photo of a {}."]
    (tmp_path / "names.json").write_text(json.dumps({"classnames": classnames, "templates": templates}))
    folder = class_folders(tmp_path / "v2", {str(i): i for i in range(12)})
    model = NamedToy(classnames, [t.format for t in templates])
    eval_cfg = EvalConfig(zeroshot=str(tmp_path / "names.json"), zeroshot_data=folder, retrieval=False)
    metrics = evaluate(model, eval_cfg, DataConfig(workers=0), device=CPU, precision="fp32")
    assert metrics == perfect_zeroshot(24)
    class_folders(tmp_path / "v2", {"12": 0})
    with pytest.raises(
        EvalError, match=re.escape(f"eval.zeroshot_data={folder}: class folder 12 names no class of 12")
    ):
        evaluate(model, eval_cfg, DataConfig(workers=0), device=CPU, precision="fp32")


def test_zeroshot_folders_named_by_class_name_take_their_names_place_in_the_list(tmp_path):
    """Folders ``apple/`` and ``zebra/`` with the list ``["zebra", "apple"]``: taken in sorted order, each
    folder's images would be labelled the other class, and no image would score."""
    classnames, templates = ["zebra", "apple", "mango"], ["a photo of a {}."]
    (tmp_path / "names.json").write_text(json.dumps({"classnames": classnames, "templates": templates}))
    folder = class_folders(tmp_path / "fruit", {name: i for i, name in enumerate(classnames)})
    model = NamedToy(classnames, [t.format for t in templates])
    eval_cfg = EvalConfig(zeroshot=str(tmp_path / "names.json"), zeroshot_data=folder, retrieval=False)
    metrics = evaluate(model, eval_cfg, DataConfig(workers=0), device=CPU, precision="fp32")
    assert metrics == perfect_zeroshot(6)


def test_a_folder_is_read_in_every_image_format_and_its_undecodable_files_are_skipped_and_counted(tmp_path):
    """GIFs beside PNGs (torchvision's ImageFolder lists no GIF; a class of GIFs alone failed), a file
    that is not an image and a zero-byte one: the GIFs score, the two bad files are counted as a
    shard's would be, on 2 ranks and their workers too."""
    classnames, templates = ["zebra", "apple", "mango"], ["a photo of a {}."]
    (tmp_path / "names.json").write_text(json.dumps({"classnames": classnames, "templates": templates}))
    folder = Path(class_folders(tmp_path / "fruit", {name: i for i, name in enumerate(classnames)}))
    for png in folder.glob("[am]*/*.png"):  # apple's and mango's
        Image.open(png).save(png.with_suffix(".gif"))
    for png in folder.glob("mango/*.png"):
        png.unlink()  # a class of GIFs alone
    (folder / "zebra" / "broken.jpg").write_bytes(b"not an image")
    (folder / "apple" / "empty.png").touch()
    model = NamedToy(classnames, [t.format for t in templates])
    eval_cfg = EvalConfig(zeroshot=str(tmp_path / "names.json"), zeroshot_data=str(folder), retrieval=False)
    metrics = evaluate(model, eval_cfg, DataConfig(workers=0), device=CPU, precision="fp32")
    assert metrics == perfect_zeroshot(8, skipped=2)
    share = dict(labels=None, image_size=16, batch_size=3, workers=2)
    running = set(multiprocessing.active_children())
    loaders = [image_folder_batches(str(folder), rank=r, world_size=2, **share) for r in range(2)]
    # the workers start when a set is encoded: made up front, every set's decoded at once
    assert set(multiprocessing.active_children()) == running
    per_rank = [list(loader) for loader in loaders]
    assert sum(len(b.images) for batches in per_rank for b in batches) == 8
    skipped = collections.Counter()
    for batches in per_rank:
        for batch in batches:
            skipped.update(batch.skipped)
    assert skipped == {"bad_image": 1, "empty_file": 1}


def test_a_16_bit_grey_image_in_a_folder_reads_as_its_top_8_bits(tmp_path):
    """Evaluation folders decode as training shards do: PIL's own conversion would clip 16-bit grey
    at 255, near white."""
    grey = np.random.default_rng(0).integers(0, 1 << 16, (16, 16), dtype=np.uint16)
    for folder, pixels in (("16-bit", grey), ("8-bit", (grey >> 8).astype(np.uint8))):
        (tmp_path / folder / "class").mkdir(parents=True)
        Image.fromarray(pixels).save(tmp_path / folder / "class" / "image.png")
    share = dict(labels=None, image_size=16, batch_size=1, workers=0, rank=0, world_size=1)
    read = {
        folder: next(iter(image_folder_batches(str(tmp_path / folder), **share))).images
        for folder in ("16-bit", "8-bit")
    }
    assert Image.open(tmp_path / "16-bit" / "class" / "image.png").mode == "I;16"
    assert read["16-bit"].shape == (1, 3, 16, 16) and torch.equal(read["16-bit"], read["8-bit"])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file; give a class-name JSON file or one of imagenet, imagenet-simple"),
        ("{", "not valid JSON"),
        ('{"classnames": [], "templates": ["{}"]}', "'classnames' must be a non-empty list of strings"),
        *(
            (
                f'{{"classnames": ["a"], "templates": ["{{}}", "{template}"]}}',
                f"template '{template}' must hold one '{{}}'",
            )
            for template in ("a photo", "a {} of {}", "a {label} of a {}", "a {} in {braces")
        ),
    ],
)
def test_bad_zeroshot_files_are_named(tmp_path, content, message):
    path = tmp_path / "zeroshot.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=re.escape(message)):
        zeroshot_metadata(str(path))


def test_imagenet_names_come_from_open_clip():
    classnames, templates = zeroshot_metadata("imagenet")
    assert len(classnames) == 1000 and classnames[1] == "goldfish" and len(templates) == 80
    assert all("goldfish" in template("goldfish") for template in templates)
    assert len(zeroshot_metadata("imagenet-simple")[1]) == 7


# --------------------------------------------------------------------------------------------
# Retrieval
# --------------------------------------------------------------------------------------------


def brute_force_recall(images: torch.Tensor, texts: torch.Tensor, k: int) -> tuple[float, float]:
    """Sort every query's scores and look for its own pair among the first k."""
    scores = (images @ texts.T).tolist()

    def recall(rows: list[list[float]]) -> float:
        hits = [i in sorted(range(len(row)), key=lambda j: -row[j])[:k] for i, row in enumerate(rows)]
        return sum(hits) / len(hits)

    return recall(scores), recall([list(col) for col in zip(*scores, strict=True)])


def random_pairs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 8, generator=gen, dtype=torch.float64)
    texts = images + 2.0 * torch.randn(n, 8, generator=gen, dtype=torch.float64)
    return F.normalize(images, dim=-1), F.normalize(texts, dim=-1)


def test_retrieval_recall_matches_brute_force():
    images, texts = random_pairs(37, seed=0)
    metrics = retrieval_recall(images, texts)
    for k in (1, 5, 10):
        image_to_text, text_to_image = brute_force_recall(images, texts, k)
        assert metrics[f"image_to_text_R@{k}"] == image_to_text
        assert metrics[f"text_to_image_R@{k}"] == text_to_image
    assert 0 < metrics["image_to_text_R@1"] < metrics["image_to_text_R@10"] < 1  # not a degenerate case
    assert metrics["n"] == 37


def test_ties_are_broken_at_random_in_expectation():
    """Against the average over every order of the row (a stable sort then breaks ties by order)."""
    rows = [[0.5, 0.5, 0.9, 0.5, 0.1, 0.5], [0.2, 0.7, 0.7, 0.7, 0.1, 0.3], [0.4, 0.1, 0.4, 0.9, 0.4, 0.0]]
    positives = [0, 2, 5]
    ks = (1, 2, 3, 4, 6)
    expected = torch.zeros(len(ks), dtype=torch.float64)
    for row, positive in zip(rows, positives, strict=True):
        orders = list(itertools.permutations(range(len(row))))
        for i, k in enumerate(ks):
            in_top = [positive in sorted(order, key=lambda j: -row[j])[:k] for order in orders]
            expected[i] += sum(in_top) / len(orders)
    got = hits_at_k(torch.tensor(rows, dtype=torch.float64), torch.tensor(positives), ks)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    nan = float("nan")  # a NaN positive never counts; a NaN elsewhere ranks above the positive
    scores = torch.tensor([[nan, 0.5, 0.2], [0.9, nan, 0.1], [0.3, nan, 0.1]])
    assert hits_at_k(scores, torch.tensor([0, 0, 0]), (1, 2, 3)).tolist() == [0.0, 2.0, 2.0]


def test_scores_within_rounding_of_the_positive_tie_with_it():
    """A duplicate caption encoded in another batch, or scored at another place in the matmul,
    differs from its twin by ~1e-7 in fp32: its credit must not depend on which one rounds up."""
    for twin, hits in ((0.5 + 3e-7, 0.5), (0.5 - 3e-7, 0.5), (0.5 + 1e-5, 0.0), (0.5 - 1e-5, 1.0)):
        scores = torch.tensor([[0.5, twin, 0.2]], dtype=torch.float64)
        assert hits_at_k(scores, torch.tensor([0]), (1,)).tolist() == [hits], twin


def test_retrieval_recall_perfect_and_collapsed():
    images, _ = random_pairs(20, seed=1)
    assert set(retrieval_recall(images, images.clone()).values()) == {1.0, 20.0}
    collapsed = torch.ones(20, 8)  # every score ties: recall@k is chance, k / n
    expected = {f"{d}_R@{k}": k / 20 for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)}
    assert retrieval_recall(collapsed, collapsed) == pytest.approx({**expected, "n": 20}, abs=1e-12)


# --------------------------------------------------------------------------------------------
# Sharded over ranks
# --------------------------------------------------------------------------------------------

FEATURE_SPLIT = (20, 17)  # random features: rank 0 and rank 1 hold this many pairs (uneven)


def eval_of(val: str, data: dict[str, str]) -> dict[str, float]:
    eval_cfg = EvalConfig(zeroshot=data["zeroshot"], batch_size=7)  # 2 full batches of good samples
    data_cfg = DataConfig(val=val, workers=0)
    return evaluate(ToyCLIP([0, 2, 1, 3, 4, 4]), eval_cfg, data_cfg, device=CPU, precision="fp32")


def eval_with_bad_samples(rank: int, world_size: int, data: dict[str, str]) -> dict[str, float]:
    return eval_of(data["exact_with_bad"], data)


def test_bad_eval_samples_are_left_out_counted_and_reported(data, capsys):
    """2 bad samples before the first good one, 3 after the last: in one process the second batch of 7
    ends at the last good sample, so only a last batch held back until the stream ends carries the 3."""
    setup_logging()
    clean = eval_of(data["exact"], data)
    assert clean["retrieval/skipped"] == clean["zeroshot/skipped"] == 0
    counted = {**clean, "retrieval/skipped": 5, "zeroshot/skipped": 5}
    assert eval_with_bad_samples(0, 1, data) == pytest.approx(counted, rel=1e-12, abs=1e-12)
    line = (
        f"clip-train: eval: 5 bad samples of {data['exact_with_bad']} skipped ({{'bad_image': 5}}); its "
        "metrics leave them out"
    )
    said = [said for said in capsys.readouterr().err.splitlines() if said.startswith("clip-train: eval:")]
    assert said == [line]  # one line for the pass both metrics share
    for result in run_distributed(eval_with_bad_samples, 2, data):  # each rank holds a share of the bad ones
        assert result.pop("val/loss") == pytest.approx(counted["val/loss"], rel=1e-6)
        assert result == pytest.approx(
            {k: v for k, v in counted.items() if k != "val/loss"}, rel=1e-12, abs=1e-12
        )


@pytest.mark.parametrize("workers", [0, 2])
def test_a_share_without_one_usable_sample_still_counts_its_bad_ones(data, tmp_path, workers):
    """With 2 workers the second reads a shard of bad samples only: it made no batch, and its count
    was lost (a rank whose share is all bad is the same case)."""
    folder = tmp_path / "val"
    folder.mkdir()
    shutil.copy(Path(data["exact"]).parent / "val-000000.tar", folder / "val-000000.tar")
    with wds.TarWriter(str(folder / "val-000001.tar")) as sink:
        write_bad_samples(sink, "only", 3)
    eval_cfg = EvalConfig(zeroshot=data["zeroshot"], batch_size=7)
    data_cfg = DataConfig(val=f"{folder}/val-{{000000..000001}}.tar", workers=workers)
    metrics = evaluate(ToyCLIP([0, 2, 1, 3, 4, 4]), eval_cfg, data_cfg, device=CPU, precision="fp32")
    assert metrics["retrieval/skipped"] == metrics["zeroshot/skipped"] == 3
    assert metrics["retrieval/n"] == SHARD_SIZES[0]


def sharded_eval(rank: int, world_size: int, data: dict[str, str]) -> dict:
    model = ToyCLIP([0, 2, 1, 3, 4, 4])  # two classes swapped, one merged: fractional accuracy
    images, texts = random_pairs(sum(FEATURE_SPLIT), seed=2)
    first = sum(FEATURE_SPLIT[:rank])
    own = slice(first, first + FEATURE_SPLIT[rank]) if world_size > 1 else slice(None)
    shards = EvalConfig(zeroshot=data["zeroshot"], batch_size=4)
    folder = EvalConfig(zeroshot=data["zeroshot"], zeroshot_data=data["folder"], retrieval=False)
    own_batches = shard_batches(data["mixed"], model, batch_size=4, rank=rank, world_size=world_size)
    all_or_none = slice(None) if rank == 0 else slice(0, 0)  # an empty rank's features are (0, 0)
    return {
        "local_samples": sum(len(batch.keys) for batch in own_batches),
        "recall": retrieval_recall(images[own], texts[own]),
        "recall_one_rank_empty": retrieval_recall(
            images[all_or_none, all_or_none], texts[all_or_none, all_or_none]
        ),
        "shards": evaluate(
            model, shards, DataConfig(val=data["mixed"], workers=0), device=CPU, precision="fp32"
        ),
        "folder": evaluate(model, folder, DataConfig(workers=0), device=CPU, precision="fp32"),
    }


@pytest.mark.slow
def test_two_ranks_match_one_process(data):
    single = sharded_eval(0, 1, data)
    ranks = run_distributed(sharded_eval, 2, data)
    counts = [r["local_samples"] for r in ranks]
    assert sum(counts) == NUM_SAMPLES and counts[0] != counts[1]
    single_loss = single["shards"].pop("val/loss")
    for result in ranks:
        # fp32 losses summed in another order; the whole split is one batch, whatever the ranks
        assert result["shards"].pop("val/loss") == pytest.approx(single_loss, rel=1e-6)
        for key in ("recall", "shards", "folder"):  # tie shares summed in another order: tolerance
            assert result[key] == pytest.approx(single[key], rel=1e-12, abs=1e-12), key
        assert result["recall_one_rank_empty"] == single["recall"]
    # the mixed captions and the broken class map make every metric informative
    assert 0 < single["shards"]["retrieval/image_to_text_R@1"] < 1
    assert 0 < single["shards"]["zeroshot/top1"] < 1 and 0 < single["folder"]["zeroshot/top1"] < 1


# --------------------------------------------------------------------------------------------
# CLI on a real tiny checkpoint
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, data) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    shards = write_shards(root / "shards", [f"a picture of sample {i}" for i in range(NUM_SAMPLES)], 32)
    config = root / "eval.yaml"
    config.write_text(
        f"include: [{REPO / 'configs/model/tiny.yaml'}]\n"
        f"data: {{val: '{shards}', workers: 0}}\n"
        f"eval: {{zeroshot: '{data['zeroshot']}', batch_size: 8}}\n"
    )
    return config


@pytest.fixture(scope="module")
def tiny_model(tiny_config) -> nn.Module:
    from clip_train.model import build_model  # imported here: the spawned ranks do not need it

    torch.manual_seed(0)
    return build_model(load_config(tiny_config).model)


def clip_train(*args: str) -> subprocess.CompletedProcess:
    return run_to_end([sys.executable, "-m", "clip_train", *args], cwd=REPO)


@pytest.mark.slow
def test_eval_cli_on_a_tiny_checkpoint(tmp_path, tiny_config, tiny_model):
    checkpoint = tmp_path / "checkpoints" / "step_00000100"
    checkpoint.mkdir(parents=True)
    save_file(tiny_model.state_dict(), checkpoint / "model.safetensors")
    result = clip_train("eval", str(checkpoint), str(tiny_config))
    assert result.returncode == 0, result.stderr
    reported = json.loads(result.stdout.strip().splitlines()[-1])
    assert "zeroshot/top1" in result.stdout and reported["checkpoint"].endswith("model.safetensors")
    cfg = load_config(tiny_config)
    expected = evaluate(tiny_model, cfg.eval, cfg.data, device=CPU, precision="fp32")
    assert reported.pop("ema") is False
    assert result.stdout.startswith(f"evaluated: the weights in {checkpoint}/")
    assert {k: v for k, v in reported.items() if k != "checkpoint"} == expected  # the weights were loaded
    assert expected["zeroshot/n"] == expected["retrieval/n"] == NUM_SAMPLES


@pytest.mark.slow
def test_eval_cli_without_a_config_uses_the_checkpoints_own(demo_run):
    """A run directory alone: the newest checkpoint's model.yaml and the run's eval section give the
    numbers the run itself logged at its end."""
    result = clip_train("eval", str(demo_run))
    assert result.returncode == 0, result.stderr
    reported = json.loads(result.stdout.strip().splitlines()[-1])
    assert reported.pop("checkpoint") == str(demo_run / "checkpoints" / "step_00000040" / "model.safetensors")
    assert reported.pop("ema") is False  # the run's eval.use_ema
    logged = [json.loads(line) for line in (demo_run / "metrics.jsonl").read_text().splitlines()]
    final = [metrics for metrics in logged if "zeroshot/top1" in metrics][-1]
    keys = ("zeroshot/top1", "zeroshot/top5", "zeroshot/n", "zeroshot/skipped")
    assert reported == {key: final[key] for key in keys}


def test_eval_cli_without_a_config_keeps_the_checkpoints_model(demo_run, capsys):
    assert cli_main(["eval", str(demo_run), "model.embed_dim=8"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "clip-train: error: override model.embed_dim=8: without a CONFIG the checkpoint's own model config "
        "is used; give the config to change the model"
    ]


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (
            ["eval.zeroshot=", "eval.zeroshot_data=VAL"],
            "eval.zeroshot_data needs eval.zeroshot: the class names and templates to score it with",
        ),
        (
            ["eval.zeroshot=", "eval.zeroshot_data=", "eval.zeroshot_sets={v2: VAL}"],
            "eval.zeroshot_sets needs eval.zeroshot: the class names and templates to score them with",
        ),
        (
            ["data.caption_key=json"],
            "data.caption_key='json': each key is a member of the samples (txt, caption) or json:FIELD, "
            "a field of their json",
        ),
        (["eval.batch_size=0"], "eval.batch_size=0 must be > 0"),
        (
            ["eval.zeroshot_data=TABLE"],
            "eval.zeroshot_data=TABLE: a table's rows carry no labels, which eval.zeroshot needs; give "
            "labelled shards or an image folder",
        ),
    ],
)
def test_eval_cli_refuses_the_eval_settings_training_refuses(demo_run, tmp_path, overrides, error, capsys):
    """Rather than evaluate without what was asked for (zero-shot data with no class names), or fail
    once the model is built and the checkpoint read."""
    table = tmp_path / "val.tsv"
    table.write_text("filepath\ttitle\nimages/1.png\ta caption\n")

    def placed(text: str) -> str:
        return text.replace("VAL", str(demo_run)).replace("TABLE", str(table))

    assert cli_main(["eval", str(demo_run), *map(placed, overrides)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"clip-train: error: {placed(error)}"]


def test_eval_cli_rejects_missing_and_mismatched_checkpoints(tmp_path, tiny_config, tiny_model, capsys):
    """In-process through the CLI's ``main`` (the subprocess path is covered above): exit 2, one line."""
    assert cli_main(["eval", str(tmp_path / "nope"), str(tiny_config)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"clip-train: error: checkpoint not found: {tmp_path / 'nope'} does not exist; "
        "pass a checkpoint directory, a run directory or a .safetensors file"
    ]
    weights = dict(tiny_model.state_dict())
    weights.pop("logit_scale")
    save_file(weights, tmp_path / "partial.safetensors")
    assert cli_main(["eval", str(tmp_path / "partial.safetensors"), str(tiny_config)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"clip-train: error: {tmp_path / 'partial.safetensors'} does not fit the model")
    assert "missing 1 key (logit_scale)" in line
