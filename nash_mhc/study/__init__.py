"""Studies that produce the project's published evidence: ``python -m nash_mhc.study {ablation,stability}``.

- :mod:`nash_mhc.study.ablation`: a grid of model variants (residual x attention) trained for the same tokens
  on the same data and seeds through ``python -m nash_mhc.train``, evaluated on held-out text through
  ``python -m nash_mhc.evaluate``; results.json, a markdown table and a PNG of loss curves.
- :mod:`nash_mhc.study.stability`: deep, narrow models at high learning rates, trained in-process on the
  library API, with the forward/backward gains of the composite residual mapping over depth
  (:mod:`nash_mhc.study.gains`), grad-norm and loss curves; report.md, PNGs and results.json.

Both resume: a finished run is never re-run, an interrupted one continues where it stopped.
"""
