"""Planetary-orbit data and offline symbolic regression for the Newton-recovery experiment.

The paper (arXiv 2501.13428, v5) follows Vafa et al. (2025, "What Has a Foundation Model
Found?"): a GPT is pretrained on two-body trajectories, fine-tuned to predict forces, and the
predicted forces are handed to symbolic regression, which should recover ``F = G m1 m2 / r**2``.

* :mod:`lssar.studies.orbits.kepler` -- closed-form Kepler orbits, dataset splits, token formats.
* :mod:`lssar.studies.orbits.symreg` -- power-law fit, sparse law search, genetic-programming SR
  (pyoperon / gplearn) and the Newton pass/fail criteria.
* :mod:`lssar.studies.orbits.ceiling` -- the noise ceiling: the true law seen through a probe's
  measured noise, the yardstick of the Newton criterion.
* :mod:`lssar.studies.orbits.judging` / :mod:`.report` / :mod:`.plots` -- verdicts (paired by
  seed), REPORT.md and figures; :mod:`.study` runs it all (``lssar orbits``).

``kepler`` and ``ceiling`` need only numpy, ``symreg`` numpy + scipy + sympy plus one SR backend
(``pip install lssar[orbits]``); nothing is imported here, so that ``import
lssar.studies.orbits`` costs nothing.
"""

__all__ = ["kepler", "symreg"]
