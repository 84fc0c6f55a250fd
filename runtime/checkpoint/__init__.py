"""A snapshot of the whole training state: its format, the write path, the read path, verify and retention.

- Format: ``treecodec`` (state as a JSON tree + flat tensors), ``train_state`` (tracked objects as DCP
  ``Stateful``s), ``wrappers`` (the model inside DDP / ``torch.compile``), ``dcp_io`` (DCP storage that
  hashes as it writes and unpickles nothing unsafe).
- Write path: ``staging`` (stage: host copies in reused buffers), ``saver`` (persist and publish in the
  background), ``save_plan``, ``writeback``, ``zip_crc``, ``pacing``, ``remote_publish`` (the upload phase),
  ``snapshot`` (save and load of one snapshot, contract C2; its file names and records in
  ``snapshot_types``), ``memory_tier`` (a frequent snapshot in node-local shared memory), ``node_planner``
  (DCP's save planning for a node's own part of sharded tensors).
- Read path: ``verified_read`` (bytes checked against the manifest as they are read), ``tiering`` (which copy
  a restart restores from).
- Judging and keeping: ``verify`` (the one place that says a snapshot is good), ``policies`` (when to save,
  what to keep), ``retention`` (delete only what a newer verified snapshot covers).

Offers the step room ``Saver`` (which saves through ``snapshot.persist_and_publish``), ``snapshot.load``,
``MemoryTier``, ``tiering`` and retention; offers
the CLI ``verify`` (torch-free). Imports the contracts and ``storage``; never ``step`` or ``worker``.
"""
