"""One vLLM engine run for tests/integrations/test_vllm.py, in its own process (one engine per
process).

``python tests/integrations/vllm_engine.py SPEC.json OUT.json``: SPEC holds ``model`` (a
directory), ``backend``, ``hf_overrides``, ``block_size``, ``prompts`` (token id lists),
``max_tokens`` and ``too_long`` (a prompt the engine must refuse, or null). OUT gets, per prompt,
the greedy tokens, their log-probabilities and the prompt's (from its second token), the attention
impl classes of the model's layers, and the error the too-long prompt raised.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: tiny models, a shared machine


def _impls(model) -> list[str]:
    return sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")})


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(
        spec["model"],
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=spec["block_size"],
        attention_backend=spec["backend"],
        hf_overrides=spec.get("hf_overrides") or {},
        seed=0,
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=spec["max_tokens"],
        ignore_eos=True,
        logprobs=0,
        prompt_logprobs=0,
        detokenize=False,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params)
    result = {"impls": llm.apply_model(_impls)[0], "tokens": [], "logprobs": [], "prompt": []}
    for prompt, out in zip(spec["prompts"], outs, strict=True):
        gen = out.outputs[0]
        result["tokens"].append(list(gen.token_ids))
        result["logprobs"].append([lp[t].logprob for t, lp in zip(gen.token_ids, gen.logprobs)])
        result["prompt"].append(
            [lp[t].logprob for t, lp in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)]
        )
    result["too_long_error"] = None
    if spec.get("too_long"):
        try:
            llm.generate([{"prompt_token_ids": spec["too_long"]}], params)
        except Exception as e:  # vLLM's own type for it varies between versions
            result["too_long_error"] = f"{type(e).__name__}: {e}"
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
