"""Subcommands of ``clip-train`` that belong to no larger module (see ``clip_train.cli``)."""
