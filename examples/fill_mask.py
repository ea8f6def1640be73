"""Fill the ``[MASK]`` of a sentence with a Hugging Face BERT directory (what ``mcore-export-hf`` writes).

    python examples/fill_mask.py --model bert/hf_model --text "the [MASK] statement leaves a loop."

Runs transformers' ``pipeline("fill-mask")`` on ``AutoModelForMaskedLM`` and the directory's tokenizer
(nothing is downloaded) and prints the ``--top-k`` completions, best first, one JSON object a line:
``{"token": "break", "score": 0.41, "sequence": "the break statement leaves a loop."}``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def fill_mask(model_dir: pathlib.Path, text: str, top_k: int) -> list[dict]:
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline
    from transformers.utils import logging

    # Loading a *ForPreTraining export as *ForMaskedLM leaves out its pooler and binary head, which
    # transformers reports key by key; fill-mask does not use them.
    logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForMaskedLM.from_pretrained(model_dir)
    fill = pipeline("fill-mask", model=model, tokenizer=tokenizer, device="cpu")
    return [
        {"token": p["token_str"], "score": round(float(p["score"]), 6), "sequence": p["sequence"]}
        for p in fill(text, top_k=top_k)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=pathlib.Path, help="a Hugging Face BERT directory")
    parser.add_argument("--text", required=True, help="a sentence with one [MASK]")
    parser.add_argument("--top-k", type=int, default=5, help="completions to print")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (export one with mcore-export-hf)")
    if args.text.count("[MASK]") != 1:
        parser.error(f"--text {args.text!r}: give exactly one [MASK]")
    for prediction in fill_mask(args.model, args.text, args.top_k):
        print(json.dumps(prediction))
    return 0


if __name__ == "__main__":
    sys.exit(main())
