"""The language-model length study: ``lssar eval`` (:mod:`.evaluate`: loss vs length, passkey,
diagnostics of one run) and ``lssar reproduce`` (:mod:`.presets` the arms and presets,
:mod:`.reproduce` the runner, :mod:`.report` and :mod:`.figures` the report)."""
