"""Integrations that make a framework's own training loop first-class under ``ckptrun launch``.

- ``lightning``: ``CkptrunCallback`` (a Lightning ``Callback``) and ``resume_path(dirpath)``.
- ``transformers``: ``CkptrunCallback`` (a ``transformers.TrainerCallback``) and ``resume_path(output_dir)``.
- ``framework_run``: what both share — the run's contract (C1), heartbeats with the framework's global step,
  metrics, the stop request agreed by all ranks, the ``stopped`` event and exit 3.

Each framework keeps its loop and its checkpoints; ckptrun publishes those checkpoints with a manifest
(:mod:`ckptrun.runtime.checkpoint.framework_files`) and ``resume_path`` returns the newest that verifies.
Installed as ``ckptrun.integrations`` (extras ``ckptrun[lightning]``, ``ckptrun[transformers]``).
Imports the runtime's contracts and its rooms; nothing in ckptrun imports this package, and importing
``ckptrun`` or ``ckptrun.runtime`` never imports Lightning or transformers.
"""
