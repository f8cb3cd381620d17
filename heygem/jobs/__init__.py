"""Jobs: the one path every generation takes, and its entry points.

The web UI, the REST API, batch mode and ``python -m heygem jobs`` all create and read jobs
through the store and run them on worker threads.

- :mod:`heygem.jobs.request`: the one check of a job request (options, remote limits, file names);
- :mod:`heygem.jobs.limits`: the caps on processes a remote job may start;
- :mod:`heygem.jobs.store`: the SQLite store, the job states and who owns a running job;
- :mod:`heygem.jobs.worker`: the worker threads and :func:`heygem.jobs.worker.run_job`;
- :mod:`heygem.jobs.files`: where a job's files live and the rules for their names;
- :mod:`heygem.jobs.batch`: many inputs planned into items, one job each;
- :mod:`heygem.jobs.api`: the REST API;
- :mod:`heygem.jobs.ray_executor`: with ``--ray``, workers whose jobs run as Ray tasks on a cluster
  (imported only then, and it imports ray only then).
"""
