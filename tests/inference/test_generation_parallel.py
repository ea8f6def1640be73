"""Generation at TP=2 x PP=2 (4 processes) equals generation in one process, for the library and the
``python -m mcore.inference.generate`` command (on a checkpoint written with
``save_logical_model_checkpoint``); in the same launch the command generates greedily from a
mixture-of-experts checkpoint at TP=2 x EP=2 (DP=2) with the single process's tokens."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from mcore.distributed.groups import ProcessGroups
from mcore.inference import SamplingParams, TextGenerator, build_model_chunk
from mcore.testing.distributed import free_port, run_distributed
from mcore.testing.distributed import test_backend_name as backend_name

sys.path.insert(0, str(Path(__file__).parent))  # gen_models, here and in the spawned ranks (importlib mode)
from gen_models import EOD, PROMPTS, VOCAB, model_config  # noqa: E402

pytestmark = pytest.mark.slow
FAMILIES = ("gpt2", "llama")
PARAMS = {
    "greedy": SamplingParams(max_new_tokens=10, greedy=True),
    "greedy-no-cache": SamplingParams(max_new_tokens=10, greedy=True, use_cache=False),
    "sampled": SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=11),
    "beam": SamplingParams(max_new_tokens=8, num_beams=3, length_penalty=0.8),
}


def _generate_all(groups: ProcessGroups, device=None) -> dict:
    out = {}
    for family in FAMILIES:
        # The same seed gives the same full weights at every layout (layout-independent init).
        model = build_model_chunk(model_config(family), groups, VOCAB, device=device)
        gen = TextGenerator(model, groups, VOCAB, eod=EOD)
        for name, params in PARAMS.items():
            result = gen.generate(PROMPTS, params)
            out[f"{family}/{name}"] = (result.tokens, result.finish_reasons)
    return out


def parallel_generation(ckpt: str, output_json: str, moe_ckpt: str, moe_port: int) -> dict:
    """Rank function: the library at TP=2 x PP=2, then the command on ``ckpt``; then the command's
    greedy generation from ``moe_ckpt`` at TP=2 x EP=2 (``<moe_ckpt>.json``; a fresh rendezvous on
    ``moe_port``: the first command tore the process group down)."""
    from mcore.config.parallel import ParallelConfig
    from mcore.distributed.groups import initialize_parallel
    from mcore.inference.generate import main

    groups = initialize_parallel(
        ParallelConfig(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, device_backend=backend_name()
        )
    )
    results = _generate_all(groups)
    code = main(
        [
            "--load", ckpt, "--prompt-ids", *(" ".join(map(str, p)) for p in PROMPTS),
            "--max-new-tokens", "10", "--num-beams", "3",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--device-backend", backend_name(), "--output-json", output_json,
        ]
    )  # fmt: skip
    os.environ["MASTER_PORT"] = str(moe_port)
    code += main(
        [
            "--load", moe_ckpt, "--prompt-ids", *(" ".join(map(str, p)) for p in PROMPTS),
            "--max-new-tokens", "10", "--greedy", "--device-backend", backend_name(),
            "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
            "--output-json", f"{moe_ckpt}.json",
        ]
    )  # fmt: skip
    return {"results": results, "exit": code}


def test_tp2_pp2_generation_equals_single_process(tmp_path):
    from mcore.checkpoint import save_logical_model_checkpoint
    from mcore.inference.loading import gather_logical_state

    single = ProcessGroups.single()
    expected = _generate_all(single, torch.device("cpu"))
    # A checkpoint of the Llama-style model for the command (NullTokenizer: ids are the text).
    cfg = model_config("llama")
    model = build_model_chunk(cfg, single, VOCAB, device=torch.device("cpu"))
    run_config = {
        "model": dataclasses.asdict(cfg),
        "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": EOD},
    }
    save_logical_model_checkpoint(tmp_path / "ckpt", gather_logical_state([model], single), run_config)
    beams = TextGenerator(model, single, VOCAB, eod=EOD).generate(
        PROMPTS, SamplingParams(max_new_tokens=10, num_beams=3)
    )

    moe = build_model_chunk(model_config("moe"), single, VOCAB, device=torch.device("cpu"))
    run_config["model"] = dataclasses.asdict(model_config("moe"))
    save_logical_model_checkpoint(tmp_path / "moe", gather_logical_state([moe], single), run_config)
    moe_greedy = TextGenerator(moe, single, VOCAB, eod=EOD).generate(
        PROMPTS, SamplingParams(max_new_tokens=10, greedy=True)
    )

    output = tmp_path / "out.json"
    ranks = run_distributed(
        parallel_generation,
        4,
        str(tmp_path / "ckpt"),
        str(output),
        str(tmp_path / "moe"),
        free_port(),
        timeout=300,
    )
    for rank in ranks:
        assert rank["exit"] == 0
        for key, value in expected.items():
            assert rank["results"][key] == value, key
    written = json.loads(output.read_text())
    assert [r["generated_ids"] for r in written] == beams.tokens
    assert [r["prompt_ids"] for r in written] == PROMPTS
    assert all(
        r["text"]
        == " ".join(map(str, r["generated_ids"][:-1] if r["finish_reason"] == "stop" else r["generated_ids"]))
        for r in written
    )
    assert os.path.getsize(output) > 0
    # MoE: the command's greedy tokens at TP=2 x EP=2 are the single process's
    assert [r["generated_ids"] for r in json.loads((tmp_path / "moe.json").read_text())] == moe_greedy.tokens
