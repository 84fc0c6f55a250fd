"""The exit codes a worker leaves with, shared by the parts of :class:`~ckptrun.runtime.step.session.Run`.

They match the CLI's (``ckptrun.cli.errors``): 1 failed (a restart may help),
3 stopped and resumable, 4 a restart cannot fix. The supervisor reads them from
the process status and from ``fatal.json`` (:func:`~ckptrun.runtime.records.write_fatal`).
"""

EXIT_FAILED, EXIT_STOPPED, EXIT_UNRECOVERABLE = 1, 3, 4
