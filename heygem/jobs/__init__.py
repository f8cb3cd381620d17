"""Jobs: the one path every generation takes.

The web UI, the REST API, batch mode and ``python -m heygem jobs`` all create
and read jobs through :class:`JobStore` and run them on :class:`Worker` threads.

- :mod:`heygem.jobs.store`: the SQLite store, the job states and who owns a running job;
- :mod:`heygem.jobs.worker`: the worker threads and :func:`run_job`;
- :mod:`heygem.jobs.files`: where a job's files live and the rules for their names;
- :mod:`heygem.jobs.ray_executor`: with ``--ray``, workers whose jobs run as Ray tasks on a cluster
  (imported only then, and it imports ray only then).
"""

from heygem.jobs.files import (
                               DATABASE_NAME,
                               DEFAULT_OUTPUTS,
                               LOG_NAME,
                               OPTIONS_NAME,
                               RESERVED_NAMES,
                               RESULT_NAME,
                               SUMMARY_NAME,
                               Upload,
                               UploadTooLarge,
                               human_size,
                               sanitize_filename,
)
from heygem.jobs.store import (
                               CANCELLED,
                               DONE,
                               FAILED,
                               FINISHED,
                               QUEUED,
                               RUNNING,
                               STATUSES,
                               Job,
                               JobLimits,
                               JobStore,
                               NotEnoughDisk,
                               QueueFull,
                               flatten_options,
                               iso_time,
                               job_device,
                               new_job_id,
                               process_owner,
)
from heygem.jobs.worker import Worker, devices_from_flags, parse_devices, plan_devices, run_job, start_workers

__all__ = [
    "CANCELLED", "DATABASE_NAME", "DEFAULT_OUTPUTS", "DONE", "FAILED", "FINISHED", "LOG_NAME", "OPTIONS_NAME",
    "QUEUED", "RESERVED_NAMES", "RESULT_NAME", "RUNNING", "STATUSES", "SUMMARY_NAME", "Job", "JobLimits", "JobStore",
    "NotEnoughDisk", "QueueFull", "Upload",
    "UploadTooLarge", "Worker", "devices_from_flags", "flatten_options", "human_size", "iso_time", "job_device",
    "new_job_id", "parse_devices", "plan_devices", "process_owner", "run_job", "sanitize_filename", "start_workers",
]
