"""Where snapshot bytes live: the store interface and its backends, below every other room.

- ``store``: the local checkpoint directory's owner — names, temp dirs, atomic publish, lineage, deletion.
- ``store_backend``: the ``SnapshotStore`` interface and its local backend.
- ``remote_store``: object storage through fsspec (immutable prefixes, the manifest written last is the commit).
- ``transfer``: copies between stores with every byte hashed on the way, and retries.
- ``ckpt_url``: what a checkpoint location names (a directory or a URL) and its storage options.

Offers the others: listing, opening, publishing and deleting snapshots. Imports only the contracts at
``ckptrun.runtime``'s top level (manifest, hashing); never the checkpoint, step or worker rooms. Torch-free,
so that ``ckptrun verify`` and the supervisor can use it.
"""
