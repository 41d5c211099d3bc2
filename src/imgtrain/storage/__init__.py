"""The run store: everything about the runs under ``--storage``, a local folder or an object store
(``--storage s3://bucket/prefix``; gs:// and other pyarrow URIs too).

The store holds the run: Ray Train's workers upload checkpoints there themselves (in the
background, ``ray.train.report``'s async mode), and the driver mirrors the files it writes
(config.json, metrics.jsonl, status.json, logs) up every few seconds, with a heartbeat that
tells other machines it is alive. Every command works on a local *working copy* of the runs it
touches, under ``IMGTRAIN_CACHE`` (``~/.cache/imgtrain/stores/<scheme>/<bucket>/<prefix>``): a
run named on the command line is brought down whole before it is used (only files whose size or
time changed are fetched), ``runs list`` fetches each run's small files and its checkpoints'
meta.json only. A run that a process on this machine trains (or deletes) is never brought down
over that process's files. So the rest of imgtrain keeps reading and writing plain files, and
any machine with the credentials can resume, evaluate or serve a run another machine trained.

Credentials come from the environment as the cloud's own tools read them (``AWS_ACCESS_KEY_ID``
..., an instance role, ``GOOGLE_APPLICATION_CREDENTIALS``); they never travel inside a
pickled filesystem object. pyarrow's S3 client ignores ``AWS_ENDPOINT_URL`` (apache/arrow#49643),
so an S3-compatible server (MinIO, moto) is named by ``IMGTRAIN_S3_ENDPOINT`` (or
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``), e.g. ``http://127.0.0.1:9000``.

The package, one job a module, lowest first: ``ownership`` (which folders are runs: the marker,
the lock, ``--overwrite``'s move-aside), ``checkpoint`` (a checkpoint's files, and the
checkpoints in a run's folder), ``lease`` (the driver's heartbeat, its lease on the run),
``ledger`` (which checkpoints of the working copy have been in the store), ``mirror`` (a run's
working copy: pull, push, delete, the driver's background mirror), ``location`` (where a run
lives: its folder, its URI, the working copy brought down, its ranks' checkpoint staging),
``runs`` (the run's own files and records: config, status, metrics; a run read back, listed).
Below them all, ``ops.remote`` (a location in an object store, its filesystem, this machine's
cache of it, the one check that turns a key of the store into a local path) is a utility, so that
``data`` may use it too; a data set in a bucket is copied to a node by ``data.staging``.
"""
