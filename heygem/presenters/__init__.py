"""Saved presenters: a face clip (or photo) recorded once, then only typed or spoken for.

This package owns the presenter records (``records``: a table in the job store's SQLite database and a
folder per presenter under the outputs, ``presenters/<id>/``, each owned by the user who made it), the
checks a clip must pass to become one (``checks``: refusals and warnings, each naming the second), the
one-time preparation (``prepare``: the clip's whole face track stored in the avatar cache and kept
beside the clip, what each installed engine prepares once (MuseTalk's crop latents), a thumbnail with
the face box and the mouth drawn, a speech sample cut from the clip's own sound) and its doors (``cli``:
``python -m heygem presenters``; ``api``: ``/api/presenters``).

A presenter is what a job's face resolves to: the pipeline still takes a face path. Before a job is
made, :func:`heygem.presenters.prepare.use_for_job` hands its clip's path and face index to the job and
puts the prepared track in the avatar cache under the key that job computes, so the job tracks no face.
"""
