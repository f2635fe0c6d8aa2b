"""Step checkpoints: ``{out_dir}/checkpoints/step_{N:08d}/``, written to a hidden directory and renamed,
so a ``step_*`` directory is never half-written.

It holds ``model.safetensors`` (readable without this project), ``train_state.pt`` (every
component's state; ``torch.load(weights_only=True)``), with ``train.ema_decay`` ``ema.safetensors``
(the moving average of the trainable parameters, ``clip_train/ema.py``), what rebuilds the model
offline: ``model.yaml`` (the model config) and ``text/`` (the text encoder's transformers config and
tokenizer files), and, written last, ``manifest.json``: every other file's size and SHA-256. Listing
a run's checkpoints compares the sizes; resuming, evaluating, loading and exporting compare the
checksums too, so a file damaged after the save (a truncated copy, a failing disk) is never used.
Checkpoints from before manifests load unverified.

``layout``: the names, the listing and the checks; ``writing``: the atomic saves and pruning;
``reading``: the weights, the train state and the model config; ``checkpointer``: a run's saves and
resume over every component's state.
"""

from clip_train.checkpoint.checkpointer import Checkpointer, Stateful
from clip_train.checkpoint.layout import (
    EMA_FILE,
    MANIFEST_FILE,
    MODEL_CONFIG_FILE,
    MODEL_FILE,
    RUN_CONFIG_FILE,
    SHARDS_DIR,
    STATE_FILE,
    SUPERSEDED_DIR,
    TEMP_PREFIX,
    TEXT_DIR,
    checkpoint_dir,
    checkpoint_problem,
    checkpoint_root,
    checkpoint_step,
    complete_checkpoints,
    is_step_name,
    latest_checkpoint,
    read_manifest,
    record_launch,
    resolve_resume,
    resume_at_restart,
    run_config_file,
    saved_step,
    step_dirs,
    temp_checkpoint_dir,
)
from clip_train.checkpoint.reading import (
    checkpoint_init_from,
    checkpoint_model_config,
    find_weights,
    load_train_state,
    load_weights,
    load_weights_file,
)
from clip_train.checkpoint.writing import (
    WRITE_ERRORS,
    beyond_keep,
    cannot_save,
    fresh_temp_dir,
    publish_checkpoint,
    remove_stale_temp_dirs,
    replace_checkpoint,
    replace_folder,
    save_checkpoint,
    save_weights,
    write_checkpoint_files,
    write_failure,
    write_manifest,
)

__all__ = [
    "EMA_FILE",
    "MANIFEST_FILE",
    "MODEL_CONFIG_FILE",
    "MODEL_FILE",
    "RUN_CONFIG_FILE",
    "SHARDS_DIR",
    "STATE_FILE",
    "SUPERSEDED_DIR",
    "TEMP_PREFIX",
    "TEXT_DIR",
    "WRITE_ERRORS",
    "Checkpointer",
    "Stateful",
    "beyond_keep",
    "cannot_save",
    "checkpoint_dir",
    "checkpoint_init_from",
    "checkpoint_model_config",
    "checkpoint_problem",
    "checkpoint_root",
    "checkpoint_step",
    "complete_checkpoints",
    "find_weights",
    "fresh_temp_dir",
    "is_step_name",
    "latest_checkpoint",
    "load_train_state",
    "load_weights",
    "load_weights_file",
    "publish_checkpoint",
    "read_manifest",
    "record_launch",
    "remove_stale_temp_dirs",
    "replace_checkpoint",
    "replace_folder",
    "resolve_resume",
    "resume_at_restart",
    "run_config_file",
    "save_checkpoint",
    "save_weights",
    "saved_step",
    "step_dirs",
    "temp_checkpoint_dir",
    "write_checkpoint_files",
    "write_failure",
    "write_manifest",
]
