"""Hyperparameter sweeps with Ray Tune (``imgtrain tune``).

The sweep folder ``{storage}/{SWEEP}/``:
  sweep.json   what was asked (base settings, search space, trials, scheduler, metric) and the
               trial list with each trial's state, rewritten on every state change
  trials/      one ordinary imgtrain run per trial (the commands ``imgtrain runs show``,
               ``imgtrain evaluate`` and ``imgtrain report`` work with
               ``--storage {storage}/{SWEEP}/trials``)
  tune/        Ray Tune's experiment state (what ``Tuner.restore`` resumes from)
  logs/        driver.log (Ray's and Tune's logs) and one progress log per trial

``space`` parses the search expressions, ``trial`` is what runs inside a Tune trial, ``driver``
starts, resumes and reports a sweep, ``state`` reads and writes sweep.json.
"""
