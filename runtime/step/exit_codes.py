"""The exit codes a worker leaves with, shared by the parts of :class:`~ckptrun.runtime.step.session.Run`.

They match the CLI's (``ckptrun.cli.errors``): 1 this attempt failed, 3 stopped
and resumable, 4 a restart cannot fix. A worker that also writes a fatal record
(:func:`~ckptrun.runtime.records.write_fatal`) is not restarted: the supervisor ends
the run with the record's code (1 when saves failed too often: resumable once
the disk is fixed). Without one, an exit 1 is a failed attempt that the
supervisor restarts like a crash.
"""

EXIT_FAILED, EXIT_STOPPED, EXIT_UNRECOVERABLE = 1, 3, 4
