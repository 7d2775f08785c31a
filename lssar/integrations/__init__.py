"""The library inside other frameworks: transformers (:mod:`.hf`: lssar attention in any HF model;
:mod:`.hf_gpt`: the ``lssar-gpt`` model and export) and lm-evaluation-harness (:mod:`.lm_eval`)."""
