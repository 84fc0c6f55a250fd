"""The supervision engine: the launch spec, the run directory, attempts (torchrun trees), the world the
supervisor observes, its restart policy and state machine, and the recovery checks it makes while it watches.

It never imports the commands or the recovery budget; the in-launch RTO estimate is handed in
(:class:`ckptrun.cli.supervision.world.Estimator`). Importable without torch.
"""
