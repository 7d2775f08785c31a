"""Experiments built on the library: the language-model length study (:mod:`.lm`: ``lssar eval``,
``lssar reproduce``), associative recall (:mod:`.recall`) and the orbital world model
(:mod:`.orbits`). They declare arms, run them and write reports the same way (:mod:`.common`)
and judge them with one statistics (:mod:`.stats`). Nothing in the library imports them."""
