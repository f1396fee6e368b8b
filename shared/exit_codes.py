"""A worker's exit codes, shared by the worker (facecast.workers.base) and the supervisor
(facecast.daemon.process), which must not import the workers' heavy modules."""

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_BOOT_ERROR = 3  # could not boot: not respawned (STYLE §5, gunicorn's WORKER_BOOT_ERROR)
