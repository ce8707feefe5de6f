"""Studies that produce the project's published evidence: ``python -m nash_mhc.study {ablation3,scaling,...}``.

- :mod:`nash_mhc.study.ablation3` (the ablation, v3): every variant (residual x attention and its options,
  :mod:`~nash_mhc.study.variants`) at every rate on every seed, a grid that grows off its edges, the rate chosen
  on a held-out selection split, bits per byte on a disjoint report split at equal tokens / full FLOPs /
  wall-clock, paired by seed; rules in :mod:`~nash_mhc.study.ablation3_protocol`, outputs in
  :mod:`~nash_mhc.study.ablation3_report`. (The v2 ablation, which chose each rate on one seed, is retired; its
  record is docs/results/ablation_v2.)
- :mod:`nash_mhc.study.scaling` and :mod:`~nash_mhc.study.scaling_report`: a ladder of model sizes per variant at
  a fixed tokens-per-parameter ratio, bits per byte against training FLOPs, power-law fits
  (:mod:`~nash_mhc.study.powerlaw`).
- :mod:`nash_mhc.study.stability` (+ ``stability_runs``, ``stability_report``): deep, narrow models over learning
  rates, trained in-process on the library API, with the gains of the composite residual mapping
  (:mod:`~nash_mhc.study.gains`) and mHC's Sinkhorn inputs and outputs (:mod:`~nash_mhc.study.sinkhorn_probe`);
  its protocol answers (best rate, usable rate range, gains at the best rate, paired differences vs plain on the
  held-out bits per byte) in :mod:`~nash_mhc.study.stability_protocol`.

The ablation and scaling studies drive ``python -m nash_mhc.train`` / ``nash_mhc.evaluate`` as child processes
(:mod:`~nash_mhc.study.child_runs`, :mod:`~nash_mhc.study.runner`). Every study resumes: a finished run is never
re-run, an interrupted one continues where it stopped. The scaling report ends with the full-size command for a
TPU and its cost estimate (:mod:`~nash_mhc.study.tpu_estimate`).
"""
