"""Every command in the README's code blocks is run by a test (or by CI itself), and the launch
scripts it names run, scaled down, under torchrun."""

import json
import math
import os
import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# command pattern -> (file that exercises it, text that file must contain)
EXERCISED = {
    r"^bash examples/quickstart\.sh": ("tests/test_quickstart.py", "quickstart"),
    r"^bash \.ci/run": (".ci/run", "pytest"),
    r"^pip install -e \.$": (".ci/run", 'pip install -q -e ".[test]"'),
    r"^pip install -e examples/third_party_backend": (
        ".ci/run",
        "pip install -q -e examples/third_party_backend",
    ),
    r"^mcore-preprocess-data ": ("tests/data/test_data_preprocess.py", "preprocess_main"),
    r"^mcore-merge-datasets ": ("tests/data/test_data_preprocess.py", "merge_main"),
    r"^torchrun .*examples/pretrain_gpt\.py": ("tests/training/test_pretrain.py", "pretrain_gpt3_tp_pp.sh"),
    r"^bash examples/pretrain_gpt3_tp_pp\.sh": ("tests/training/test_pretrain.py", "pretrain_gpt3_tp_pp.sh"),
    r"^bash examples/pretrain_gpt2_codeparrot\.sh": ("tests/test_readme.py", "pretrain_gpt2_codeparrot.sh"),
    r"^bash examples/pretrain_llama\.sh": ("tests/test_readme.py", "pretrain_llama.sh"),
    r"^bash examples/pretrain_gpt_npu\.sh": ("tests/test_readme.py", "pretrain_gpt_npu.sh"),
    r"^mcore-inspect-checkpoint ": ("tests/checkpoint/test_inspect.py", "main"),
    r"^mcore-export-hf ": ("tests/hf/test_hf_errors.py", "export_main"),
    r"^mcore-export-megatron ": ("tests/checkpoint/test_megatron_interop.py", "EXPORT_MEGATRON"),
    r"^mcore-import-hf ": ("tests/hf/test_hf_errors.py", "import_main"),
    r"^mcore-generate ": ("tests/hf/hf_runs.py", "mcore.inference.generate"),
    r"^python examples/npu_smoke\.py": ("tests/npu/test_simulated_npu_conformance.py", "npu_smoke"),
    r"^python -m mcore\.backends": ("tests/plugins/test_backends_cli.py", '"mcore.backends"'),
    r"^python benchmarks/train_throughput\.py": ("tests/test_readme.py", "train_throughput.py"),
}


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(re.sub(r"\s+", " ", line))
    return commands


def test_every_readme_command_is_exercised():
    commands = readme_commands()
    assert len(commands) >= 10
    unmatched = []
    for command in commands:
        rule = next((r for r in EXERCISED if re.search(r, command)), None)
        if rule is None:
            unmatched.append(command)
            continue
        path, needle = EXERCISED[rule]
        source = (REPO / path).read_text(encoding="utf-8")
        assert needle in source, f"{path} no longer exercises {command!r} (no {needle!r} in it)"
    assert not unmatched, "README commands no test runs:\n" + "\n".join(unmatched)


TINY = {
    "NPROC": "2",
    "NUM_LAYERS": "2",
    "HIDDEN": "64",
    "HEADS": "4",
    "SEQ": "32",
    "MBS": "2",
    "GBS": "4",
    "TRAIN_ITERS": "2",
    "WARMUP": "1",
    "EVAL_ITERS": "1",
    "NUM_WORKERS": "0",
    "DEVICE_BACKEND": "cpu",
    "OMP_NUM_THREADS": "1",
    "SAVE_INTERVAL": "1000",
    "LOG_INTERVAL": "1",
}


@pytest.mark.parametrize(
    ("script", "extra"),
    [
        ("pretrain_gpt2_codeparrot.sh", {"TP": "2", "PRECISION": " "}),
        ("pretrain_llama.sh", {"TP": "2", "GROUPS": "2", "FFN": "96", "PRECISION": " "}),
        ("pretrain_gpt_npu.sh", {"TP": "2", "PRECISION": " ", "MCORE_SIMULATED_NPU": "1"}),
    ],
)
def test_example_launch_scripts_run_scaled_down(tmp_path, script, extra):
    env = {**os.environ, **TINY, **extra, "OUTPUT_DIR": str(tmp_path / "out")}
    proc = subprocess.run(
        ["bash", str(REPO / "examples" / script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "iteration        2/       2" in proc.stdout


TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --vocab-size 100 --warmup 1 --iters 1"
).split()


def _throughput(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            "python",
            str(REPO / "benchmarks" / "train_throughput.py"),
            "--device-backend",
            "cpu",
            *TINY_GPT,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_throughput_benchmark_runs_on_cpu():
    proc = _throughput()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"tokens_per_s"' in proc.stdout


def test_throughput_benchmark_times_the_plain_reference_in_the_same_process():
    proc = _throughput("--reference", "plain-eager")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    reference, ours = lines[0], lines[1]
    assert reference["peer"] == "plain-eager" and reference["tokens_per_s"] > 0
    assert math.isfinite(reference["lm_loss"])
    assert ours["of_reference"] == ours["tokens_per_s"] / reference["tokens_per_s"]


def test_throughput_reference_refuses_a_model_it_does_not_model():
    proc = _throughput("--reference", "plain", "--swiglu")
    assert proc.returncode != 0
    assert "this run differs in --swiglu" in proc.stderr
    assert '"tokens_per_s"' not in proc.stdout
