"""``clip-train make-shards``: folder, CSV and digits writers, read back as real tar files."""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clip_train.commands import make_shards
from clip_train.data import DataError
from clip_train.data.digits import CLASSNAMES
from clip_train.data.samples import decode_sample
from clip_train.data.sources import read_shard


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    make_shards.add_arguments(parser)
    return make_shards.run(parser.parse_args([str(a) for a in argv]))


def image_bytes(seed: int, fmt: str) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def tar_members(path: Path) -> list[str]:
    with tarfile.open(path) as tar:
        return tar.getnames()


def read_back(out: Path) -> tuple[dict[str, int], dict[str, tuple[str, bytes, dict]]]:
    """sizes.json, and {source path: (caption, image bytes, json)} read from the shards."""
    sizes = json.loads((out / "sizes.json").read_text())
    samples = {}
    for shard in sorted(out.glob("*.tar")):
        members = tar_members(shard)
        keys = [m.split(".")[0] for m in members]
        assert keys == sorted(keys), f"{shard.name}: a sample's files are not contiguous"
        assert len(set(keys)) == sizes[shard.name]
        for raw in read_shard(str(shard)):
            sample = decode_sample(raw)
            ext = next(e for e in ("png", "jpg", "jpeg", "webp") if e in raw)
            samples[sample.meta["source"]] = (sample.caption, raw[ext], sample.meta)
    assert sorted(sizes) == sorted(p.name for p in out.glob("*.tar"))
    return sizes, samples


@pytest.fixture
def image_folder(tmp_path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for i in range(7):
        folder = src / "sub" if i % 2 else src
        fmt, ext = ("PNG", "png") if i % 3 else ("JPEG", "JPG")
        (folder / f"img.{i}.{ext}").write_bytes(image_bytes(i, fmt))  # dots in names must not break keys
        (folder / f"img.{i}.txt").write_text(f"caption number {i}\n")
    (src / "lonely.png").write_bytes(image_bytes(99, "PNG"))  # no caption: left out
    return src


def test_folder_round_trip_contiguous_keys_and_sizes(image_folder, tmp_path):
    out = tmp_path / "out"
    assert run_cli("folder", image_folder, out, "--per-shard", 3) == 0
    sizes, samples = read_back(out)
    assert list(sizes.values()) == [3, 3, 1]
    sources = sorted(p for p in image_folder.rglob("img.*") if p.suffix != ".txt")
    assert sorted(samples) == [str(p) for p in sources]
    for path in sources:
        caption, data, _ = samples[str(path)]
        assert caption == path.with_suffix(".txt").read_text().strip()
        assert data == path.read_bytes()


def test_folder_captions_not_utf8_are_left_out_and_a_bom_dropped(image_folder, tmp_path, capsys):
    (image_folder / "img.0.txt").write_bytes("café au lait".encode("latin-1"))  # a Windows-1252 file
    (image_folder / "img.2.txt").write_bytes("\ufeffa caption saved with a BOM".encode())
    out = tmp_path / "out"
    assert run_cli("folder", image_folder, out) == 0
    bad = f"{image_folder / 'img.0.txt'}: not UTF-8 (invalid continuation byte at byte 3)"
    assert (
        capsys.readouterr().err.splitlines()[0]
        == f"clip-train: left out 2 of the folder's images (1 bad_caption, 1 empty_caption), e.g. {bad}"
    )
    _, samples = read_back(out)
    assert len(samples) == 6 and str(image_folder / "img.0.JPG") not in samples
    assert samples[str(image_folder / "img.2.png")][0] == "a caption saved with a BOM"


def test_rerun_is_idempotent_and_a_changed_source_rewrites(image_folder, tmp_path):
    out = tmp_path / "out"
    run_cli("folder", image_folder, out, "--per-shard", 4)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    run_cli("folder", image_folder, out, "--per-shard", 4)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert sum(json.loads((out / "sizes.json").read_text()).values()) == 7
    (image_folder / "img.0.txt").write_text("an edited caption")
    run_cli("folder", image_folder, out, "--per-shard", 4)
    _, samples = read_back(out)
    assert samples[str(image_folder / "img.0.JPG")][0] == "an edited caption"
    assert len(samples) == 7 and not (tmp_path / "out.partial").exists()


def test_out_may_be_a_link_to_a_folder_on_another_disk_or_the_current_folder(
    image_folder, tmp_path, monkeypatch
):
    """Written beside the link's target and swapped in there (the link stays): a rerun after a change
    rewrites it, and nothing is left beside the link."""
    (tmp_path / "big" / "shards").mkdir(parents=True)
    (tmp_path / "shards").symlink_to(tmp_path / "big" / "shards")
    run_cli("folder", image_folder, tmp_path / "shards", "--per-shard", 4)
    (image_folder / "img.0.txt").write_text("an edited caption")
    run_cli("folder", image_folder, tmp_path / "shards", "--per-shard", 4)
    assert (tmp_path / "shards").is_symlink() and not (tmp_path / "shards.partial").exists()
    _, samples = read_back(tmp_path / "big" / "shards")
    assert samples[str(image_folder / "img.0.JPG")][0] == "an edited caption" and len(samples) == 7
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    run_cli("folder", image_folder, ".", "--per-shard", 4)
    assert len(read_back(tmp_path / "here")[1]) == 7


@pytest.mark.parametrize("option", ["--train-shards", "--val-shards", "--size"])
def test_a_count_below_one_is_refused_naming_its_option(tmp_path, capsys, option):
    with pytest.raises(SystemExit) as exited:
        run_cli("digits", tmp_path / "digits", option, "0")
    assert exited.value.code == 2
    assert f"argument {option}: '0' is not a whole number >= 1" in capsys.readouterr().err


def test_csv_round_trip_and_bad_csv_errors(image_folder, tmp_path):
    rows = ["path,caption", "img.0.JPG,first one", "sub/img.1.png,second one", "nothere.png,missing file"]
    (image_folder / "list.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "csv_out"
    assert run_cli("csv", image_folder / "list.csv", out, "--per-shard", 10) == 0
    sizes, samples = read_back(out)
    assert sizes == {"shard-000000.tar": 2}
    assert {Path(k).name: v[0] for k, v in samples.items()} == {
        "img.0.JPG": "first one",
        "img.1.png": "second one",
    }
    (image_folder / "other.csv").write_text("file,text\nimg.0.JPG,x\n")
    with pytest.raises(DataError, match=r"no image column 'filepath' or 'path' .*found: \['file', 'text'\]"):
        run_cli("csv", image_folder / "other.csv", tmp_path / "bad_out")
    with pytest.raises(
        DataError, match=r"no caption column 'title' or 'caption' .*found: \['file', 'text'\]"
    ):
        run_cli("csv", image_folder / "other.csv", tmp_path / "bad_out", "--image-key", "file")
    with pytest.raises(DataError, match=r"no caption column 'label' \(separator ','\)"):
        run_cli(
            "csv", image_folder / "other.csv", tmp_path / "bad_out", "--image-key=file", "--caption-key=label"
        )
    assert not (tmp_path / "bad_out").exists()
    run_cli(
        "csv",
        image_folder / "other.csv",
        tmp_path / "other_out",
        "--csv-img-key=file",
        "--csv-caption-key=text",
    )
    assert [caption for caption, _, _ in read_back(tmp_path / "other_out")[1].values()] == ["x"]
    with pytest.raises(DataError, match=r"separator ';;' must be one character"):
        run_cli("csv", image_folder / "list.csv", tmp_path / "bad_out", "--separator", ";;")
    (image_folder / "mac.csv").write_bytes(b"path,caption\rimg.0.JPG,first one\r")  # classic Mac OS text
    with pytest.raises(
        DataError, match=r"mac\.csv: .*a carriage return outside quotes \(save the table with LF"
    ):
        run_cli("csv", image_folder / "mac.csv", tmp_path / "bad_out")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not written by make-shards"):
        run_cli("csv", image_folder / "list.csv", tmp_path / "foreign")


def test_openclip_tsv_quoted_captions_absolute_paths_and_bad_rows(image_folder, tmp_path, capsys):
    """OpenCLIP's filepath/title header, tab-separated because of the extension; rows 4 to 6 are
    bad, each for its own reason, and counted in one line."""
    quoted = '"a caption with a\ttab, a comma and\na newline"'
    rows = [
        "filepath\ttitle",
        f"img.0.JPG\t{quoted}",
        "sub/img.1.png\tsecond one",
        f"{image_folder / 'img.2.png'}\tan absolute path",
        "nothere.png\tmissing file",
        "img.4.png\t   ",
        "sub/img.3.JPG\tthree\tfields",
        "sub/img.5.png\tthe last one",
    ]
    (image_folder / "list.tsv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "tsv_out"
    assert run_cli("csv", image_folder / "list.tsv", out, "--per-shard", 3) == 0
    bad_rows = "1 missing_image, 1 empty_caption, 1 bad_row"
    missing = f"row 4: missing_image: no file {image_folder / 'nothere.png'}"
    assert (
        capsys.readouterr().err.splitlines()[0]
        == f"clip-train: left out 3 of the table's rows ({bad_rows}), e.g. {missing}"
    )
    sizes, samples = read_back(out)
    assert list(sizes.values()) == [3, 1]
    expected = {
        image_folder / "img.0.JPG": "a caption with a\ttab, a comma and\na newline",
        image_folder / "sub/img.1.png": "second one",
        image_folder / "img.2.png": "an absolute path",
        image_folder / "sub/img.5.png": "the last one",
    }
    assert {source: caption for source, (caption, _, _) in samples.items()} == {
        str(path): caption for path, caption in expected.items()
    }
    assert all(samples[str(path)][1] == path.read_bytes() for path in expected)
    keys = [raw["__key__"] for shard in sorted(out.glob("*.tar")) for raw in read_shard(str(shard))]
    assert keys == ["000000001", "000000002", "000000003", "000000007"]  # row numbers, as training keys them
    (image_folder / "list.txt").write_text("\n".join(rows) + "\n")
    run_cli("csv", image_folder / "list.txt", tmp_path / "txt_out", "--separator", "\\t", "--per-shard", 3)
    assert read_back(tmp_path / "txt_out")[1] == samples


def test_digits_demo_set(tmp_path):
    from sklearn.datasets import load_digits

    assert run_cli("digits", tmp_path, "--size", 16) == 0
    labels, phrasings = {}, set()
    for split, shards in (("train", 8), ("val", 2)):
        sizes = json.loads((tmp_path / split / "sizes.json").read_text())
        assert len(sizes) == shards
        assert len(list((tmp_path / split).glob("*.tar"))) == shards
        labels[split] = []
        for shard in sorted((tmp_path / split).glob("*.tar")):
            samples = [decode_sample(raw) for raw in read_shard(str(shard))]
            assert len(samples) == sizes[shard.name]
            for sample in samples:
                label = sample.meta["label"]
                assert sample.image.size == (16, 16)
                words = sample.caption.replace(",", " ").split()
                assert str(label) in words or CLASSNAMES[label] in words
                labels[split].append(label)
                phrasings.add(sample.caption.replace(str(label), "N"))
    assert len(phrasings) > 30  # varied templates, not one caption per class
    assert len(labels["train"]) == 1438 and len(labels["val"]) == 359  # 1797 split 80/20
    expected = np.bincount(load_digits().target, minlength=10)
    assert (np.bincount(labels["train"] + labels["val"], minlength=10) == expected).all()
    zeroshot = json.loads((tmp_path / "zeroshot.json").read_text())
    assert zeroshot["classnames"][7] == "seven" and len(zeroshot["classnames"]) == 10
    assert zeroshot["templates"] and all(t.count("{}") == 1 for t in zeroshot["templates"])
