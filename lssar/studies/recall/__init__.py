"""The associative-recall length-extrapolation study (``lssar recall``).

``task``: the seeded generator; ``study``: arms, presets, training, evaluation, caching;
``report``: REPORT.md from the tidy rows, ``plots`` its figures. ``lssar.studies.stats`` holds the
intervals/verdicts.
"""

from lssar.studies.recall.task import RecallTask


def cli(argv: list[str]) -> int:
    from lssar.studies.recall.study import cli as _cli

    return _cli(argv)


__all__ = ["RecallTask", "cli"]
