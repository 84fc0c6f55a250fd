"""The training script's handle: ``init()`` and the ``Run`` it returns, and everything one step decides.

- ``startup``: ``init()`` — policy from C1, process group, precision, seeds, restore — returns a ``Run``.
- ``session``: the ``Run`` (its state, tracking, the optimizer step, stop and finish), made of parts:
  ``loop`` (the loop's two shapes and step boundaries), ``step_end`` (closing a step: metrics, shared
  decisions, saves due), ``restoring`` (resuming from a snapshot), ``rollback`` (``--on-anomaly``),
  ``saving`` (a snapshot at a boundary and its outcome); ``exit_codes`` (what a worker exits with);
  ``stepper`` (one optimizer step under the precision policy).
- Decisions every rank shares: ``decisions`` (facts gathered every N steps in one collective),
  ``anomaly`` (non-finite or spiking losses).
- Precision: ``precision`` (the policy and its flags), ``precision_report`` (what each op class ran in).
- Data and resume: ``data`` (a loader that knows how far it got), ``rng`` (every generator, per rank),
  ``reshard`` (resuming at another world size), ``hparams`` (what changed on resume), ``preflight``
  (the worker side of ``ckptrun preflight``).

Imports ``checkpoint``, ``storage``, ``worker`` and the contracts; no other room imports it. Besides
``ckptrun.runtime``'s lazy facade, the CLI imports it in three places: preflight's checks read
``preflight.read_digests`` (torch-free), a warm standby agent imports ``data`` and ``startup`` ahead of
the ranks, and the RTO probe imports ``session`` to time what a rank's imports cost.
"""
