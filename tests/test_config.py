import dataclasses

import pytest
import yaml
from small_runs import DEMO_CONFIG, TINY_MODEL_CONFIG

from clip_train import load_config
from clip_train.cli import main as cli_main
from clip_train.config import (
    Config,
    ConfigError,
    config_keys,
    load_model_config,
    model_config_yaml,
    save_config,
)
from clip_train.config.unused import unused_settings

BERT = "model.text.hf=bert-base-uncased"  # the defaults name no text encoder


def test_defaults_validate():
    config = load_config(None, [BERT])
    assert isinstance(config, Config)
    config.validate(world_size=1)


def test_yaml_round_trip(tmp_path):
    """Also text that the loader would read as a number (a run named after its learning rate): a
    saved config and a checkpoint's model.yaml read back as they were."""
    config = load_config(
        None,
        [
            "batch.global_size=1024",
            "model.image.timm_kwargs={depth: 2}",
            "log.wandb.tags=[a,b]",
            "log.wandb.name=3e-4",
            "train.out_dir=1e3",
            "model.init_from=2E5",
        ],
    )
    assert (config.log.wandb.name, config.train.out_dir, config.model.init_from) == ("3e-4", "1e3", "2E5")
    path = tmp_path / "run" / "config.yaml"
    save_config(config, path)
    assert load_config(path) == config
    assert yaml.safe_load(path.read_text())["batch"]["global_size"] == 1024
    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text(model_config_yaml(config.model))
    assert load_model_config(model_yaml, "distill.teacher_model") == config.model


@pytest.mark.parametrize(
    ("override", "getter", "expected"),
    [
        ("batch.global_size=65536", lambda c: c.batch.global_size, 65536),
        ("batch.global_size=65_536", lambda c: c.batch.global_size, 65536),
        ("optim.lr=1e-3", lambda c: c.optim.lr, 1e-3),
        ("optim.lr=2", lambda c: c.optim.lr, 2.0),
        ("batch.offload=true", lambda c: c.batch.offload, True),
        ("batch.offload=no", lambda c: c.batch.offload, False),
        ("train.out_dir=runs/x", lambda c: c.train.out_dir, "runs/x"),
        ("log.wandb.name=123", lambda c: c.log.wandb.name, "123"),
        ("optim.betas=[0.9,0.95]", lambda c: c.optim.betas, [0.9, 0.95]),
        ("data.rrc_scale=[1,1]", lambda c: c.data.rrc_scale, [1.0, 1.0]),
        ("log.wandb.tags=[lit,256k]", lambda c: c.log.wandb.tags, ["lit", "256k"]),
        ("model.image.timm_kwargs.depth=4", lambda c: c.model.image.timm_kwargs, {"depth": 4}),
        ("model.text.hf_config={hidden_size: 64}", lambda c: c.model.text.hf_config, {"hidden_size": 64}),
        ("loss.impl=inf", lambda c: c.loss.impl, "inf"),
        ("model.image.lock=True", lambda c: c.model.image.lock, True),
        # a text key takes its value as typed: YAML would fail on ",", cut at "#", read a number, base 60
        ("data.csv_separator=,", lambda c: c.data.csv_separator, ","),
        ("data.csv_separator=|", lambda c: c.data.csv_separator, "|"),
        ("train.out_dir=runs/exp #2", lambda c: c.train.out_dir, "runs/exp #2"),
        ("log.wandb.name=012", lambda c: c.log.wandb.name, "012"),
        ("log.wandb.name=12:30", lambda c: c.log.wandb.name, "12:30"),
        ("data.train={00000..00001}.tar", lambda c: c.data.train, "{00000..00001}.tar"),
        ("eval.zeroshot_sets.v2=/data/v2 #2", lambda c: c.eval.zeroshot_sets, {"v2": "/data/v2 #2"}),
        ("eval.zeroshot_sets.v2=012", lambda c: c.eval.zeroshot_sets, {"v2": "012"}),
        ("data.csv_separator=\t", lambda c: c.data.csv_separator, "\t"),  # a tab, not stripped away
        ("data.csv_caption_key= long caption", lambda c: c.data.csv_caption_key, " long caption"),
        ("batch.global_size= 64 ", lambda c: c.batch.global_size, 64),  # spaces around YAML: nothing
        ("optim.betas= [0.9, 0.95] ", lambda c: c.optim.betas, [0.9, 0.95]),
        # 1e-5 is a number wherever it goes, also where no type says so; a whole one fits an int
        (
            "model.text.hf_config.layer_norm_eps=1e-5",
            lambda c: c.model.text.hf_config,
            {"layer_norm_eps": 1e-5},
        ),
        (
            "model.image.timm_kwargs.drop_path_rate=1e-1",
            lambda c: c.model.image.timm_kwargs["drop_path_rate"],
            0.1,
        ),
        ("batch.global_size=1e5", lambda c: c.batch.global_size, 100000),
        ("train.seed=010", lambda c: c.train.seed, 10),  # YAML 1.1 would read octal 8 (09 it read as 9)
        ("model.image.timm_kwargs.depth=012", lambda c: c.model.image.timm_kwargs["depth"], 12),
        ("train.seed=0x10", lambda c: c.train.seed, 16),
        ("optim.image_lr=None", lambda c: c.optim.image_lr, None),  # as docs/config.md shows the default
        ("data.caption_key=[txt, json:caption]", lambda c: c.data.caption_key, ["txt", "json:caption"]),
    ],
)
def test_override_types(override, getter, expected):
    value = getter(load_config(None, [override]))
    assert value == expected
    assert type(value) is type(expected)


def test_overrides_beat_file_and_includes(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  embed_dim: 32\n  text:\n    context_length: 16\n")
    (tmp_path / "run.yaml").write_text(
        "include: [base.yaml]\nmodel:\n  embed_dim: 48\nbatch:\n  global_size: 8\n"
    )
    config = load_config(tmp_path / "run.yaml", ["batch.global_size=16"])
    assert (config.model.embed_dim, config.model.text.context_length, config.batch.global_size) == (
        48,
        16,
        16,
    )


def test_a_mapping_override_merges_into_a_section_and_replaces_a_mapping_value(tmp_path):
    """As across includes: model.image={...} keeps the file's other image keys (it reset lock and
    pretrained without a word), model.image.timm_kwargs={...} replaces the file's arguments."""
    (tmp_path / "run.yaml").write_text(
        "model:\n  image:\n    lock: true\n    pretrained: hub\n    timm_kwargs: {depth: 4, img_size: 32}\n"
    )
    image = load_config(
        tmp_path / "run.yaml", [BERT, "model.image={timm: vit_small_patch16_224}"]
    ).model.image
    assert (image.timm, image.lock, image.pretrained) == ("vit_small_patch16_224", True, "hub")
    assert image.timm_kwargs == {"depth": 4, "img_size": 32}
    image = load_config(tmp_path / "run.yaml", [BERT, "model.image.timm_kwargs={depth: 2}"]).model.image
    assert image.timm_kwargs == {"depth": 2} and image.lock


def test_a_mapping_value_in_a_file_replaces_the_included_one_whole(tmp_path):
    """Sections merge key by key across includes; a key whose value is a mapping (timm or
    transformers arguments) takes the later file's, ``{}`` included, as an override would."""
    (tmp_path / "base.yaml").write_text(
        "model:\n  embed_dim: 32\n  image:\n    timm_kwargs: {depth: 4, img_size: 32}\n"
        "  text:\n    hf_config: {model_type: bert, hidden_size: 64}\n"
    )
    (tmp_path / "run.yaml").write_text(
        "include: [base.yaml]\nmodel:\n  image:\n    timm_kwargs: {depth: 2}\n  text:\n    hf_config: {}\n"
        "    hf: bert-base-uncased\n"
    )
    config = load_config(tmp_path / "run.yaml")
    assert config.model.embed_dim == 32
    assert config.model.image.timm_kwargs == {"depth": 2}
    assert config.model.text.hf_config == {}
    config.validate(world_size=1)  # exactly one of model.text.hf and model.text.hf_config


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("batch.global_sise=8", "batch.global_size"),
        ("optim.warmup=10", "optim.warmup_steps"),
        ("modle.embed_dim=8", "model"),
    ],
)
def test_unknown_key_names_nearest(override, named):
    with pytest.raises(ConfigError, match="unknown config key") as err:
        load_config(None, [override])
    assert named in str(err.value)


def test_unknown_key_in_yaml(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  max_step: 3\n")
    with pytest.raises(ConfigError, match=r"train\.max_step\b.*train\.max_steps"):
        load_config(tmp_path / "c.yaml")


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ("optim:\n  lr: 2.0e-3\ntrain:\n  max_steps: 5\noptim:\n  eps: 1.0e-8\n", "optim", 5),
        ("model:\n  image:\n    lock: true\n    lock: false\n", "lock", 4),
    ],
)
def test_a_key_set_twice_in_one_mapping_is_an_error_naming_it(tmp_path, text, key, line):
    """PyYAML keeps the last: the first optim section's rate and the first lock went without a word.
    A YAML merge (<<) may still be overridden, as YAML means."""
    (tmp_path / "c.yaml").write_text(text)
    twice = rf"not valid YAML: '{key}' is set twice in one mapping\n.*line {line},"
    with pytest.raises(ConfigError, match=twice):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "merged.yaml").write_text("optim:\n  <<: {lr: 2.0e-3, eps: 1.0e-8}\n  lr: 1.0e-3\n")
    optim = load_config(tmp_path / "merged.yaml").optim
    assert (optim.lr, optim.eps) == (1.0e-3, 1.0e-8)


def test_a_retired_key_fails_in_one_line_unless_a_run_saved_it(tmp_path):
    """loss.kernel chose the Triton kernels, now gone: a config that sets it fails saying so, while
    the run configs earlier releases saved (all of which hold it) still load, without it."""
    message = (
        "loss.kernel was removed: the PyTorch tiles are the only loss path (the Triton kernels measured "
        "1.6-1.85x slower on an H100); delete the key"
    )
    expected = load_config(None, [BERT, "loss.kind=sigmoid"])
    saved = tmp_path / "config.yaml"
    raw = dataclasses.asdict(expected)
    raw["loss"]["kernel"] = "auto"  # after kind and impl, as earlier releases wrote it
    saved.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert load_config(saved, saved=True) == expected
    mine = tmp_path / "mine.yaml"
    mine.write_text("loss:\n  kernel: triton\n")
    users = [
        lambda: load_config(None, ["loss.kernel=torch"]),
        lambda: load_config(mine),
        lambda: load_config(saved),  # a run's config given as the user's own
        lambda: load_config(saved, ["loss.kernel=auto"], saved=True),  # overrides are the user's
    ]
    for load in users:
        with pytest.raises(ConfigError) as err:
            load()
        assert str(err.value) == message


@pytest.mark.parametrize(
    "override",
    [
        "batch.global_size=abc",
        "batch.global_size=1.5",
        "batch.global_size=true",
        "optim.lr=fast",
        "batch.offload=maybe",
        "loss.impl=flash",
        "train.precision=fp8",
        "train.compile_mode=max-autotune",
        "optim.betas=0.9",
        "model.image.timm_kwargs=3",
        "model.image=vit",
    ],
)
def test_bad_type_names_key(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_values_yaml_reads_otherwise_than_meant_are_one_line_naming_the_key(tmp_path):
    """Text keys take text only (YAML reads 0755 as 755, 1:30 as 90 and 1e3 as 1000.0: a run
    directory or a wandb name would change silently); a list's text that is not YAML, a number past
    a float's range, a file that is not UTF-8 and includes that name no file fail in one line."""
    cases = {
        "train:\n  out_dir: 1e3\n": r"^train\.out_dir=1000\.0: expected text; quote it in the YAML file$",
        "log:\n  wandb:\n    tags: [2024_01, a]\n": r"^log\.wandb\.tags\[0\]=202401: expected text",
        'data:\n  rrc_scale: "[0.5,"\n': r"^data\.rrc_scale=\[0\.5,: cannot read the value as YAML \(",
        f"optim:\n  lr: {10**400}\n": r"^optim\.lr=1000\d+: expected float$",
        "include: 5\n": r"include=5 must be a file name or a list of them$",
        "include: [model/tiny.yaml, 5]\n": r"include=\['model/tiny\.yaml', 5\] must be a file name",
    }
    for index, (text, message) in enumerate(cases.items()):
        (tmp_path / f"{index}.yaml").write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(tmp_path / f"{index}.yaml")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00train")
    with pytest.raises(ConfigError, match=r"binary\.yaml: not UTF-8 text$"):
        load_config(tmp_path / "binary.yaml")
    with pytest.raises(ConfigError, match=r"^log\.wandb\.tags\[0\]=755: expected text"):
        load_config(None, ["log.wandb.tags=[0755]"])
    assert load_config(None, ["train.out_dir=0755", "log.wandb.tags=['0755']"]).train.out_dir == "0755"


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["batch.global_size"])
    with pytest.raises(
        ConfigError, match=r"^override data.train_weights=\[1,: cannot read the value as YAML \("
    ):
        load_config(None, ["data.train_weights=[1,"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["batch.global_size=10"], 4, r"batch\.global_size=10 must be a positive multiple of the world size"),
        (
            ["batch.global_size=64", "batch.image_chunk=24"],
            2,
            r"batch\.image_chunk=24 must divide the per-rank",
        ),
        (["batch.global_size=64", "batch.text_chunk=-1"], 1, r"batch\.text_chunk=-1"),
        (["model.text.unlocked_layers=2"], 1, r"model\.text\.lock=true"),
        (["model.image.lock_head=true"], 1, r"^model\.image\.lock_head=true needs model\.image\.lock=true$"),
        (["model.text.freeze_norms=yes"], 1, r"^model\.text\.freeze_norms=true needs model\.text\.lock"),
        (["train.seed=-1"], 1, r"^train\.seed=-1 must lie in \[0, 2\*\*32\)$"),
        (["train.seed=4294967296"], 1, r"^train\.seed=4294967296 must lie in"),
        (["train.out_dir= "], 1, r"^train\.out_dir is empty"),
        (["train.out_dir=~/runs/a"], 1, r"^train\.out_dir=~/runs/a: ~ is not expanded here"),
        (["eval.zeroshot_data=/x", "eval.zeroshot="], 1, r"^eval\.zeroshot_data needs eval\.zeroshot"),
        (["optim.min_lr=1", "optim.lr=0.1"], 1, r"optim\.min_lr"),
        (["optim.betas=[0.9]"], 1, r"optim\.betas"),
        (["train.max_steps=0"], 1, r"train\.max_steps=0 must be > 0"),
        (["data.max_skip_fraction=2"], 1, r"data\.max_skip_fraction"),
        (["data.rrc_scale=[0.08,0.5,1.0]"], 1, r"data\.rrc_scale=\[0\.08, 0\.5, 1\.0\] must be two numbers"),
        (["data.rrc_ratio=[1.33,0.75]"], 1, r"data\.rrc_ratio=\[1\.33, 0\.75\] must be two numbers"),
        (["data.rrc_scale=[0,1]"], 1, r"data\.rrc_scale"),
        (["optim.warmup_steps=-5"], 1, r"^optim\.warmup_steps=-5 must be >= 0$"),
        (["optim.weight_decay=-0.1"], 1, r"^optim\.weight_decay=-0\.1 must be >= 0$"),
        (["optim.grad_clip=-1"], 1, r"^optim\.grad_clip=-1\.0 must be >= 0$"),
        (["optim.eps=0"], 1, r"^optim\.eps=0\.0 must be > 0$"),  # 0/0 where a gradient stays 0
        (["data.num_samples=-800"], 1, r"^data\.num_samples=-800 must be >= 0$"),
        (["data.workers=-1"], 1, r"^data\.workers=-1 must be >= 0$"),
        (["data.shuffle_buffer=-8"], 1, r"^data\.shuffle_buffer=-8 must be >= 0$"),
        (["eval.every_steps=-1"], 1, r"^eval\.every_steps=-1 must be >= 0$"),  # step % -1 == 0: every step
        (["checkpoint.every_steps=-1"], 1, r"^checkpoint\.every_steps=-1 must be >= 0$"),
        # NaN passes every range check by comparing false, infinity is never meant: both named
        (["optim.lr=.inf"], 1, r"^optim\.lr=inf must be a finite number$"),
        (["optim.text_lr=.nan"], 1, r"^optim\.text_lr=nan must be a finite number$"),
        (["train.ema_decay=0.9", "train.ema_warmup_power=.nan"], 1, r"^train\.ema_warmup_power=nan must be"),
        (["optim.betas=[0.9,.nan]"], 1, r"^optim\.betas=\[0\.9, nan\] must be a finite number$"),
        (["eval.zeroshot_sets={v2: /data/v2}"], 1, r"^eval\.zeroshot_sets needs eval\.zeroshot: the class"),
        (
            ["eval.zeroshot=imagenet", "eval.zeroshot_sets={top1: /data/v2}"],
            1,
            r"^eval\.zeroshot_sets: the name 'top1' must be letters, .* and not top1, top5, n or skipped",
        ),
        (["eval.zeroshot=imagenet", "eval.zeroshot_sets={a/b: /data/v2}"], 1, r"the name 'a/b' must be"),
        # a dotted name: an override's key splits at the dot, so no name holds one
        (["eval.zeroshot=imagenet", "eval.zeroshot_sets={in.v2: /data/v2}"], 1, r"the name 'in\.v2' must be"),
        (
            ["eval.zeroshot=imagenet", "eval.zeroshot_sets.in.v2=/data/v2"],
            1,
            r"^eval\.zeroshot_sets\.in\.v2: a set's name takes no '\.' \(an override's key splits at each "
            r"one\); name it in_v2, say$",
        ),
        (
            ["eval.zeroshot=imagenet", "eval.zeroshot_sets={v2: ''}"],
            1,
            r"^eval\.zeroshot_sets\.v2='' must name",
        ),
        (["distill.teacher_model=m.yaml"], 1, r"^distill\.teacher_model='m\.yaml' has no distill\.teacher"),
        (
            ["distill.teacher=runs/a", "loss.kind=sigmoid"],
            1,
            r"^distill\.teacher with loss\.kind=sigmoid: distillation matches the teacher's softmax",
        ),
        (["distill.teacher=runs/a", "distill.weight=0"], 1, r"^distill\.weight=0\.0 must be > 0$"),
        (
            ["distill.teacher=runs/a", "loss.impl=local"],
            1,
            r"^distill\.teacher with loss\.impl=local: the loss",
        ),
        (
            ["distill.teacher=open_clip:ViT-L-14/openai"],
            1,
            r"^distill\.teacher=open_clip:ViT-L-14/openai needs its architecture: set distill\.teacher_model",
        ),
        # accepted before, then clamped by the first update or failed later
        (
            ["model.init_logit_scale=100"],
            1,
            r"^model\.init_logit_scale=100\.0 must lie in \[0, ln 100 = 4\.605\]",
        ),
        (["model.init_logit_scale=-1"], 1, r"^model\.init_logit_scale=-1\.0 must lie in \[0, ln 100"),
        (
            ["train.dist_timeout_s=10000000000"],
            1,
            r"^train\.dist_timeout_s=10000000000 must be at most 10000000",
        ),
        (["train.io_timeout_s=100000000"], 1, r"^train\.io_timeout_s=100000000 must be at most"),
        (
            ["train.max_steps=20", "log.profile_steps=5", "log.profile_after=16"],
            1,
            r"^log\.profile_after=16 \+ log\.profile_steps=5 pass train\.max_steps=20: the trace would never",
        ),
        (
            ["checkpoint.remote=file:///bucket", "checkpoint.every_steps=0"],
            1,
            r"^checkpoint\.remote=file:///bucket mirrors checkpoints, and checkpoint\.every_steps=0 saves",
        ),
        (["eval.every_steps=100"], 1, r"^eval\.every_steps=100 has nothing to evaluate: set eval\.zeroshot"),
        (
            ["optim.schedule=const", "optim.min_lr=1e-5"],
            1,
            r"^optim\.min_lr=1e-05 has no effect with optim\.schedule=const; drop it$",
        ),
    ],
)
def test_cross_field_validation(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides).validate(world_size=world)


def test_a_model_yaml_named_by_a_key_is_read_as_an_include_is_and_its_errors_name_the_key(tmp_path):
    good, bad, empty = tmp_path / "good.yaml", tmp_path / "bad.yaml", tmp_path / "empty.yaml"
    good.write_text(f"include: [{TINY_MODEL_CONFIG}]\nmodel: {{embed_dim: 24}}\n")
    bad.write_text("model: {embed_dimm: 24}\n")
    empty.write_text("data: {}\n")
    model = load_model_config(good, "distill.teacher_model")
    assert model.embed_dim == 24 and model.image.timm_kwargs["depth"] == 4  # tiny.yaml's, overridden
    unknown = r"^distill\.teacher_model='.*bad\.yaml': unknown config key model\.embed_dimm: did you mean"
    with pytest.raises(ConfigError, match=unknown):
        load_model_config(bad, "distill.teacher_model")
    with pytest.raises(ConfigError, match=r"^distill\.teacher_model='.*empty\.yaml' has no model: section$"):
        load_model_config(empty, "distill.teacher_model")


CUDA_GRAPHS = [BERT, "train.compile=true", "train.compile_mode=reduce-overhead", "batch.global_size=64"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.compile=false"], r"^train\.compile_mode=reduce-overhead needs train\.compile=true"),
        (["train.parallel=fsdp"], r"train\.parallel=fsdp: CUDA graphs run with ddp only"),
        (["model.image.lock=true"], r"model\.image\.lock=true: a locked trunk runs its blocks without grad"),
        (["model.text.lock=true"], r"model\.text\.lock=true"),
        (
            ["batch.image_chunk=16"],
            r"needs one chunk a step, and batch\.image_chunk=16 splits the per-rank batch 32",
        ),
        (["batch.text_chunk=8"], r"batch\.text_chunk=8 splits"),
    ],
)
def test_cuda_graphs_take_one_chunk_of_trained_ddp_towers(overrides, message):
    """Only what ran on a GPU: Gradient Cache's no_grad encode stopped there (a locked trunk runs
    without gradients too), and FSDP is untried."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*CUDA_GRAPHS, *overrides]).validate(world_size=2)
    for one_chunk in (["batch.image_chunk=0", "batch.text_chunk=32"], ["batch.image_chunk=auto"]):
        load_config(None, [*CUDA_GRAPHS, *one_chunk]).validate(world_size=2)


def test_chunks_that_divide_pass():
    config = load_config(None, [BERT, "batch.global_size=64", "batch.image_chunk=16", "batch.text_chunk=32"])
    config.validate(world_size=2)


@pytest.mark.parametrize(
    ("config", "overrides", "message"),
    [
        (  # the case: a pretrained BERT named on top of the tiny model's random-init one
            TINY_MODEL_CONFIG,
            ["model.text.hf=/models/bert"],
            r"^model\.text\.hf='/models/bert' and model\.text\.hf_config are both set",
        ),
        (None, [], r"^model\.text\.hf and model\.text\.hf_config are both empty"),
        (None, ["model.text.hf_config={hidden_size: 64}"], r"^model\.text\.tokenizer is empty"),
    ],
    ids=["both", "neither", "no-tokenizer"],
)
def test_text_encoder_comes_from_exactly_one_of_hf_and_hf_config(config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config, overrides).validate(world_size=1)
    load_config(TINY_MODEL_CONFIG).validate(world_size=1)
    load_config(TINY_MODEL_CONFIG, ["model.text.hf=/models/bert", "model.text.hf_config={}"]).validate(1)


@pytest.mark.parametrize(
    ("every", "keep_every", "valid"),
    [(10, 0, True), (10, 20, True), (10, 25, False), (10, -10, False), (0, 0, True), (0, 10, False)],
    ids=str,
)
def test_milestones_must_be_saved_steps(every, keep_every, valid):
    """``checkpoint.every_steps=0`` saves nothing, so it keeps no milestones either."""
    config = load_config(
        None, [BERT, f"checkpoint.every_steps={every}", f"checkpoint.keep_every={keep_every}"]
    )
    if valid:
        config.validate(world_size=1)
    else:
        with pytest.raises(
            ConfigError, match=rf"checkpoint\.keep_every={keep_every} must be 0 or a multiple"
        ):
            config.validate(world_size=1)


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="world size"):
        load_config(None, ["batch.global_size=64"]).validate()


def test_config_keys_cover_every_field():
    keys = {key.name for key in config_keys()}
    assert {
        "batch.global_size",
        "batch.image_chunk",
        "batch.text_chunk",
        "batch.offload",
        "loss.impl",
    } <= keys
    assert {"train.max_steps", "train.seed", "train.precision", "train.out_dir"} <= keys
    for tower in ("image", "text"):
        assert {f"model.{tower}.lock", f"model.{tower}.unlocked_layers"} <= keys
    assert len(keys) == sum(1 for _ in _leaves(Config()))


def _leaves(obj):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        yield from _leaves(value) if dataclasses.is_dataclass(value) else [f.name]


def test_the_config_reference_page_is_current():
    from pathlib import Path

    from clip_train.commands.config import REFERENCE_BEGIN, REFERENCE_END, markdown_table

    page = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    section = page.split(REFERENCE_BEGIN)[1].split(REFERENCE_END)[0].strip()
    stale = "docs/config.md is stale: run clip-train config --reference docs/config.md"
    assert section == markdown_table(), stale
    assert all(row.split("|")[4].strip() for row in section.splitlines()[2:]), "a key has no description"
    assert len(section.splitlines()) - 2 == len(config_keys())


@pytest.mark.parametrize(
    ("overrides", "enabling", "line"),
    [
        (
            ["fsdp.cpu_offload=true"],
            "train.parallel=fsdp",
            "fsdp.cpu_offload=true has no effect without train.parallel=fsdp",
        ),
        (
            ["optim.name=adafactor", "optim.betas=[0.9, 0.95]", "optim.eps=1e-6"],
            "optim.name=adamw",
            "optim.betas=[0.9, 0.95] has no effect without optim.name=adamw",
        ),
        (
            ["loss.impl=vanilla", "loss.tile_size=512"],
            "loss.impl=inf",
            "loss.tile_size=512 has no effect without loss.impl=inf (or auto)",
        ),
        (
            ["loss.impl=local", "batch.keep_last_graph=false"],
            "loss.impl=auto",
            "batch.keep_last_graph=false has no effect without loss.impl=inf (or auto)",
        ),
        (
            ["batch.image_chunk=0", "batch.text_chunk=8", "batch.memory_budget=8"],
            "batch.text_chunk=auto",
            "batch.memory_budget=8.0 has no effect without batch.image_chunk=auto or batch.text_chunk=auto",
        ),
        (
            ["optim.cooldown_power=2"],
            "optim.schedule=const-cooldown",
            "optim.cooldown_power=2.0 has no effect without optim.schedule=const-cooldown",
        ),
        (
            ["distill.weight=0.5"],
            "distill.teacher=runs/teacher",
            "distill.weight=0.5 has no effect without distill.teacher",
        ),
        (
            ["data.color_jitter_prob=0.8"],
            "data.color_jitter=[0.4, 0.4, 0.4, 0.1]",
            "data.color_jitter_prob=0.8 has no effect without data.color_jitter",
        ),
        (
            ["log.profile_after=3"],
            "log.profile_steps=2",
            "log.profile_after=3 has no effect without log.profile_steps",
        ),
        (
            ["optim.warmup_steps=1000", "train.max_steps=999"],
            "train.max_steps=1001",
            "optim.warmup_steps=1000 >= train.max_steps=999: the rate rises to 99% of its peak at the last "
            "step, and optim.schedule=cosine never starts",
        ),
    ],
)
def test_a_key_that_other_settings_leave_without_effect_is_named_until_they_use_it(overrides, enabling, line):
    """One line for the key set away from its default (a key left at it, as optim.eps here, is no
    news), and none once the setting that reads it is chosen."""
    assert unused_settings(load_config(None, [BERT, *overrides])) == [line]
    assert unused_settings(load_config(None, [BERT, *overrides, enabling])) == []


def test_clip_train_config_warns_on_stderr_and_prints_the_yaml_on_stdout(capsys):
    assert cli_main(["config", str(DEMO_CONFIG), "optim.warmup_steps=600", "data.color_jitter_prob=0.5"]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["optim"]["warmup_steps"] == 600
    assert err.splitlines() == [
        "clip-train: warning: data.color_jitter_prob=0.5 has no effect without data.color_jitter",
        "clip-train: warning: optim.warmup_steps=600 >= train.max_steps=300: the rate rises to 50% of its "
        "peak at the last step, and optim.schedule=cosine never starts",
    ]
