"""The rank as a process: how it starts, shows it is alive, and what it does for a script without the runtime.

- ``bootstrap``: the entry torchrun runs (``-m ckptrun.runtime.worker.bootstrap``): run the user's script and
  record why it died (error file, fatal record).
- ``warm_start``: the entry of a rank forked from a warm torchrun agent, already past ``import torch``.
- ``liveness``: heartbeats and the watch on the supervisor (exit when it is gone).
- ``step_hook``: zero-code supervision — torch's global optimizer-step hook beats for any script.
- ``fault_injection``: fires the test faults that C1's ``fault`` field names.
- ``timeline``: when this worker reached each start-up milestone.
- ``fork_safety``: what a forked rank checks and undoes first (a CUDA poisoned by its agent, inherited
  listening sockets, BLAS thread counts).
- ``determinism``: torch's "no deterministic implementation" error as one line and exit 4.

What runs in a worker before ``init()`` returns: ``bootstrap`` (or ``warm_start`` then ``bootstrap``), the
user's script, then ``ckptrun.runtime.step.startup.init``. Imports only the contracts; torch-free until the
script imports torch.
"""
