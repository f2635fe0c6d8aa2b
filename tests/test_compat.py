"""Feature detection across torch releases: the decision on stand-in signatures of either kind,
the keywords it picks for the installed torch against its real constructor, and the installed
stack against the declared range."""

from __future__ import annotations

import tomllib
import warnings
from importlib import metadata
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.version import Version
from test_packaging import image_pins
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from clip_train.compat import ddp_no_buffer_sync_kwargs, torchrun_waits_for_its_workers
from clip_train.preemption import torchrun_grace_warning


def _ddp_before_2_13(self, module, device_ids=None, broadcast_buffers=True, process_group=None):
    """DDP's constructor as torch 2.11 and 2.12 declare it (the keywords that matter here)."""


def _ddp_from_2_13(self, module, broadcast_buffers=None, process_group=None, forward_sync_buffers=None):
    """DDP's constructor from torch 2.13: the new keyword beside the deprecated one."""


@pytest.mark.parametrize(
    ("ddp_init", "expected"),
    [
        (_ddp_before_2_13, {"broadcast_buffers": False}),
        (_ddp_from_2_13, {"forward_sync_buffers": False}),
    ],
)
def test_ddp_keyword_follows_the_signature(ddp_init, expected) -> None:
    assert ddp_no_buffer_sync_kwargs(ddp_init) == expected


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_installed_ddp_takes_the_keywords_silently_and_stops_forward_buffer_sync(one_rank_group) -> None:
    """No TypeError (an unknown keyword) and no FutureWarning (a deprecated one) on this torch."""
    module = nn.Linear(3, 2)
    module.register_buffer("constant", torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddp = DistributedDataParallel(module, **ddp_no_buffer_sync_kwargs())
    assert ddp.broadcast_buffers is False  # an attribute before torch 2.13, a property after


def test_installed_torch_is_inside_the_declared_range_with_the_triton_it_requires() -> None:
    """Run on both stacks CI tests: the cap (`make test`) and the floor (`make test-floor`, whose
    torch, Triton and numpy come from docker/constraints.txt, as the image's do)."""
    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    torch_range = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch")
    installed = Version(metadata.version("torch"))
    assert installed.public in torch_range.specifier, f"torch {installed} is outside {torch_range}"
    triton = [Requirement(r) for r in metadata.requires("torch") or [] if Requirement(r).name == "triton"]
    assert all(metadata.version("triton") in r.specifier for r in triton)
    pins = image_pins()
    if installed.public == pins["torch"]:
        assert triton and {str(s) for r in triton for s in r.specifier} == {f"=={pins['triton']}"}
        assert metadata.version("numpy") == pins["numpy"]


def _agent_before_its_shutdown_timeout(
    self, spec, logs_specs, start_method="spawn", exit_barrier_timeout=300, log_line_prefix_template=None
):
    """torchrun's agent as torch 2.11 declares it: its workers get 30 s, fixed."""


def _agent_with_its_shutdown_timeout(
    self, spec, logs_specs, start_method="spawn", exit_barrier_timeout=300, shutdown_timeout=30
):
    """torchrun's agent from the release that reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT (2.14 has it)."""


def test_torchruns_grace_follows_its_agents_signature_and_the_floors_is_30_s() -> None:
    """The floor's torchrun (torch 2.11, the image's) kills its workers 30 s after a stop signal; the
    cap's waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT. Rank 0 says so at start-up under torchrun only."""
    assert not torchrun_waits_for_its_workers(_agent_before_its_shutdown_timeout)
    assert torchrun_waits_for_its_workers(_agent_with_its_shutdown_timeout)
    floor = Version(metadata.version("torch")).public == image_pins()["torch"]
    assert torchrun_waits_for_its_workers() is not floor
    under_torchrun = {"TORCHELASTIC_RUN_ID": "none"}
    assert torchrun_grace_warning({}, waits_for_its_workers=False) is None
    assert torchrun_grace_warning(under_torchrun, waits_for_its_workers=True) is None
    warning = torchrun_grace_warning(under_torchrun, waits_for_its_workers=False)
    assert warning.startswith("warning: this torch's torchrun kills the ranks 30 s after")
