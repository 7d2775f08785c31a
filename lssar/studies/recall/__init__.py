"""The associative-recall length-extrapolation study (``lssar recall``).

``task``: the seeded generator; ``presets``: arms and presets; ``study``: training, evaluation,
caching and the command; ``report``: REPORT.md from the tidy rows, ``plots`` its figures.
``lssar.studies.stats`` holds the intervals/verdicts.
"""

from lssar.studies.recall.task import RecallTask

__all__ = ["RecallTask"]
