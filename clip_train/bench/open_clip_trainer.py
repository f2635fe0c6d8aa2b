"""OpenCLIP's own trainer (``python -m open_clip_train.main``) as ``clip-train bench train`` runs it
under torchrun on the CPU, with its CPU quirks handled here and nowhere else:

* it hands ``device_ids=[device]`` to DistributedDataParallel, which refuses them for a CPU module:
  dropped when the module is on the CPU;
* open_clip 3.3.0 with webdataset >= 1.0 fails at the end of the first shard (KeyError 'fname'):
  the same one-argument shim as ``bench data`` (``tar_file_expander(eof_value=None)``);
* its ``--logs`` is an ambiguous abbreviation to torchrun's own parser (``--logs-specs``), so the
  folder comes in ``OPEN_CLIP_LOGS`` and is handed on here.

usage: OPEN_CLIP_LOGS=DIR [torchrun ...] -m clip_train.bench.open_clip_trainer OPEN_CLIP_TRAIN_ARGS...
"""

from __future__ import annotations

import functools
import os
import sys

import open_clip_train.data as open_clip_data
import torch
from open_clip_train.main import main
from webdataset.tariterators import tar_file_expander


class _CpuFriendlyDDP(torch.nn.parallel.DistributedDataParallel):
    def __init__(self, module: torch.nn.Module, *args, device_ids=None, **kwargs) -> None:
        on_cpu = next(module.parameters()).device.type == "cpu"
        super().__init__(module, *args, device_ids=None if on_cpu else device_ids, **kwargs)


if __name__ == "__main__":
    torch.nn.parallel.DistributedDataParallel = _CpuFriendlyDDP
    open_clip_data.tar_file_expander = functools.partial(tar_file_expander, eof_value=None)
    sys.exit(main([*sys.argv[1:], "--logs", os.environ["OPEN_CLIP_LOGS"]]))
