"""Per-node cost profiles: how long one forward of a node's model takes for n new tokens, measured on the spot.

One module per job:

- :mod:`shared.costs.curve`: the curve type (:class:`~shared.costs.curve.CostCurve`, interpolated, refined online),
  a node's :class:`~shared.costs.curve.NodeProfile` and its wire form, and the scores ``dtype: auto`` compares;
- :mod:`shared.costs.measure`: measuring within a time budget, on a quiet machine, one node at a time, and
  :func:`~shared.costs.measure.load_or_measure` (the cache, else a measurement);
- :mod:`shared.costs.cache`: the disk cache, its keys, and the check that flags a wrong entry;
- :mod:`shared.costs.dtype_choice`: ``dtype: auto``;
- :mod:`shared.costs.hardware`: the CPU and GPU facts a profile depends on.

Import from the module that does the job (this package re-exports nothing, so importing the curve type loads no
torch).
"""
