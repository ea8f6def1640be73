"""A Megatron-LM user's command lines, logs and Hugging Face workflow, run as written (sizes aside).

The module fixture follows the CodeParrot GPT-2 blog literally: its preprocessing line (``--vocab``,
``--dataset-impl mmap``, ``--json-keys content``) through the ``mcore-preprocess-data`` console
script, its pretraining line (``python -m torch.distributed.launch ... pretrain_gpt.py`` with no
``--tokenizer-type``, ``--fp16``) on ``examples/pretrain_gpt.py``, the export with ``mcore-export-hf``,
and the blog's last step: ``pipeline("text-generation", model=exported_dir)("def hello_world():")``.
Only the sizes (layers, hidden, iterations, workers, one process) are the blog's scaled down.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
PROMPT = "def hello_world():"

# The mock dataset is Megatron's (100,000 documents): building its indices costs ~3 s of CPU a run, most
# of a tiny run. The module's runs pass one --data-cache-path (the product's index cache, keyed by the
# dataset's full description: seed, sizes, samples, split, tokenizer), so each distinct dataset is built
# once and later runs read the same arrays back; the directory goes with the module.
_INDEX_CACHE: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _mock_index_cache(tmp_path_factory):
    import shutil

    path = tmp_path_factory.mktemp("index_cache")
    _INDEX_CACHE.append(str(path))
    yield
    _INDEX_CACHE.remove(str(path))
    shutil.rmtree(path, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd, cwd, timeout=300, env=None, check=True):
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHON": sys.executable,
            # scripts that still call torchrun find this interpreter's
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            **(env or {}),
        },
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def blog(tmp_path_factory):
    from mcore.data.tokenizers import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("codeparrot")
    stdlib = pathlib.Path(os.__file__).parent
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in sorted(stdlib.glob("*.py"))[:30]]
    # Many small documents, so that the blog's --split 969,30,1 default leaves some for the test split.
    docs = [t[i : i + 1500] for t in texts for i in range(0, len(t), 1500)]
    with (root / "codeparrot_data.json").open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"content": doc}) + "\n")
    vocab, merges = train_bpe_tokenizer(docs, 512, root)
    assert pathlib.Path(vocab) == root / "vocab.json" and pathlib.Path(merges) == root / "merges.txt"

    # The blog's preprocessing line (workers 32 -> 2).
    preprocess = _run(
        [
            BIN / "mcore-preprocess-data", "--input", "codeparrot_data.json", "--output-prefix", "codeparrot",
            "--vocab", "vocab.json", "--dataset-impl", "mmap", "--tokenizer-type", "GPT2BPETokenizer",
            "--merge-file", "merges.txt", "--json-keys", "content", "--workers", "2", "--chunk-size", "25",
            "--append-eod",
        ],
        root,
    )  # fmt: skip

    # The blog's pretraining line: GPUS_PER_NODE=1 and the GPT_ARGS sizes scaled down.
    gpt_args = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --lr 0.0005 "
        "--train-iters 4 --lr-decay-iters 4 --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay .1 "
        "--adam-beta2 .999 --fp16 --log-interval 2 --save-interval 2 --eval-interval 2 --eval-iters 1"
    ).split()
    distributed_args = (
        f"--nproc_per_node 1 --nnodes 1 --node_rank 0 --master_addr localhost --master_port {_free_port()}"
    ).split()
    ckpt = root / "experiments" / "codeparrot-small"
    pretrain = _run(
        [
            sys.executable, "-m", "torch.distributed.launch", *distributed_args,
            REPO / "examples" / "pretrain_gpt.py",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", *gpt_args,
            "--vocab-file", "vocab.json", "--merge-file", "merges.txt",
            "--save", ckpt, "--load", ckpt, "--data-path", "codeparrot_content_document",
            "--tensorboard-dir", "experiments/tensorboard",
        ],
        root,
    )  # fmt: skip
    exported = root / "codeparrot-small-hf"
    export = _run([BIN / "mcore-export-hf", "--load", ckpt, "--save", exported], root)
    return {
        "root": root,
        "ckpt": ckpt,
        "exported": exported,
        "preprocess": preprocess,
        "pretrain": pretrain,
        "export": export,
    }


# ---- command lines -------------------------------------------------------------------------------


def test_blog_preprocessing_line_runs_as_written(blog):
    """``--vocab`` (the blog's abbreviation of ``--vocab-file``) and ``--dataset-impl mmap`` are taken."""
    root = blog["root"]
    assert (root / "codeparrot_content_document.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"
    assert (root / "codeparrot_content_document.bin").stat().st_size > 0


def test_blog_pretraining_line_needs_no_tokenizer_type(blog):
    """pretrain_gpt.py defaults --tokenizer-type to GPT2BPETokenizer, as Megatron's does."""
    out = blog["pretrain"].stdout
    assert "  tokenizer_type .................................. GPT2BPETokenizer" in out
    assert "iteration        4/       4" in out
    assert (blog["ckpt"] / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def test_unambiguous_prefixes_in_both_tools(tmp_path, capsys):
    from mcore.config.cli import parse_config
    from mcore.data.config import TokenizerConfig
    from mcore.data.preprocess import PreprocessConfig
    from mcore.training.run_config import parse_run_config

    cfg = parse_run_config(
        [
            "--num-layers",
            "2",
            "--hidden-s",
            "8",
            "--num-attention-h",
            "2",
            "--micro-batch",
            "3",
            "--mock-d",
            "--seq-len",
            "8",
        ]
    )
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.training.micro_batch_size) == (2, 8, 3)
    assert cfg.data.mock_data
    tools = {"input": PreprocessConfig, "tokenizer": TokenizerConfig}
    pre = parse_config(
        tools, ["--inp", "x.json", "--output-pre", "out", "--vocab", "v.json", "--merge-f", "m"]
    )
    assert (pre["input"].input, pre["input"].output_prefix, pre["tokenizer"].vocab_file) == (
        "x.json",
        "out",
        "v.json",
    )
    # Ambiguous and unknown spellings stay errors that name the candidates / the closest flag.
    # In process: the blog fixture runs the console script itself (one interpreter start less).
    from mcore.data.preprocess import main as preprocess_main

    with pytest.raises(SystemExit) as err:
        preprocess_main(["--vocab-s", "3", "--tok", "x"])
    assert err.value.code == 2 and "ambiguous option: --tok could match" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_run_config(["--num-layres", "2"])
    assert "unknown flag --num-layres (did you mean --num-layers?)" in capsys.readouterr().err


def test_legacy_flags_map_to_their_current_meaning(capsys):
    from mcore.training.run_config import parse_run_config

    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8"]
    cases = [
        (["--recompute-activations"], lambda c: c.model.recompute_granularity == "selective"),
        (
            ["--checkpoint-activations"],
            lambda c: (
                (c.model.recompute_granularity, c.model.recompute_method, c.model.recompute_num_layers)
                == ("full", "uniform", 1)
            ),
        ),
        (["--data-impl", "mmap"], lambda c: True),
        (["--dataset-impl=infer"], lambda c: True),
        (["--use-rotary-position-embeddings"], lambda c: c.model.position_embedding_type == "rope"),
        (["--position-embedding-type", "rotary"], lambda c: c.model.position_embedding_type == "rope"),
        (
            ["--position-embedding-type=absolute"],
            lambda c: c.model.position_embedding_type == "learned_absolute",
        ),
        (["--no-position-embedding"], lambda c: c.model.position_embedding_type == "none"),
        (["--no-query-key-layer-scaling"], lambda c: not c.model.apply_query_key_layer_scaling),
        (["--fp16-lm-cross-entropy"], lambda c: c.model.cross_entropy_loss_fusion),
        (["--empty-unused-memory-level", "2"], lambda c: c.training.empty_unused_memory_level == 2),
        (
            ["--attention-head-type", "multiquery"],
            lambda c: c.model.group_query_attention and c.model.num_query_groups == 1,
        ),
    ]
    for extra, holds in cases:
        cfg = parse_run_config(base + extra)
        assert holds(cfg), extra
        out = capsys.readouterr().out
        if extra[0] != "--empty-unused-memory-level":  # a current flag, not a deprecated one
            assert out.count("deprecated") == 1, (extra, out)
    with pytest.raises(SystemExit):
        parse_run_config(base + ["--data-impl", "lazy"])
    assert "--data-impl 'lazy': Megatron's lazy/cached formats are gone" in capsys.readouterr().err


def test_ignored_flags_are_listed_once_with_the_reason(capsys):
    from mcore.training.run_config import parse_run_config

    parse_run_config(
        ["--use-flash-attn", "--attention-backend", "auto", "--num-layers", "2", "--hidden-size", "8"]
        + ["--num-attention-heads", "2", "--seq-length", "8"]
    )
    out = capsys.readouterr().out
    assert out.count("NOTE: these Megatron-LM flags change nothing in mcore") == 1
    assert "--use-flash-attn (the device backend serves flash attention" in out
    assert "--attention-backend (the device backend picks the attention kernel" in out


def test_megatron_gpt3_script_scaled_down(tmp_path):
    """Megatron's examples/gpt3/train_gpt3_175b_distributed.sh with its variables and flag groups, sizes
    scaled down. Its --rampup-batch-size is left out: Megatron itself refuses it with --train-iters."""
    from mcore.data.tokenizers import train_bpe_tokenizer

    texts = [
        p.read_text(encoding="utf-8") for p in sorted(pathlib.Path(os.__file__).parent.glob("*.py"))[:20]
    ]
    docs = [t[i : i + 1000] for t in texts for i in range(0, len(t), 1000)]
    with (tmp_path / "corpus.json").open("w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    train_bpe_tokenizer(docs, 400, tmp_path)
    from mcore.data.preprocess import main as preprocess_main  # in process: the script is the subject here

    assert preprocess_main(["--input", str(tmp_path / "corpus.json"), "--output-prefix", str(tmp_path / "gpt3"),
                            "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt"),
                            "--append-eod", "--tokenizer-type", "GPT2BPETokenizer"]) == 0  # fmt: skip
    script = f"""
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=1
MASTER_ADDR=localhost
MASTER_PORT={_free_port()}
NUM_NODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
MERGE_FILE=$4
DATA_PATH=$5
DISTRIBUTED_ARGS=(--nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES --master_addr $MASTER_ADDR --master_port $MASTER_PORT)
GPT_MODEL_ARGS=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --attention-backend auto)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 2 --train-iters 3 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 3)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1)
DATA_ARGS=(--data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1)
EVAL_AND_LOGGING_ARGS=(--log-interval 1 --save-interval 10000 --eval-interval 1000 --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --eval-iters 1 --tensorboard-dir $TENSORBOARD_LOGS_PATH)
"$PYTHON" -m torch.distributed.run ${{DISTRIBUTED_ARGS[@]}} {REPO / "examples" / "pretrain_gpt.py"} \\
    ${{GPT_MODEL_ARGS[@]}} ${{TRAINING_ARGS[@]}} ${{MODEL_PARALLEL_ARGS[@]}} ${{DATA_ARGS[@]}} ${{EVAL_AND_LOGGING_ARGS[@]}}
"""
    (tmp_path / "train_gpt3.sh").write_text(script)
    proc = _run(
        ["bash", "train_gpt3.sh", "ckpt", "tb", "vocab.json", "merges.txt", "gpt3_text_document"], tmp_path
    )
    assert "iteration        3/       3" in proc.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_mindspeed_npu_script_honours_its_variables(tmp_path, blog):
    """MindSpeed's pretrain_gpt_distributed.sh variables: the data, tokenizer and checkpoint given are
    the ones used (simulated NPU on the CPU); without DATA_PATH the script says it uses mock data."""
    root = blog["root"]
    env = {
        "MCORE_SIMULATED_NPU": "1", "NPROC": "2", "TP": "2", "NUM_LAYERS": "1", "HIDDEN": "32", "HEADS": "2",
        "SEQ": "32", "MBS": "1", "GBS": "2", "TRAIN_ITERS": "2", "WARMUP": "1", "EVAL_ITERS": "1",
        "PRECISION": " ", "SAVE_INTERVAL": "2",
        "CHECKPOINT_PATH": str(tmp_path / "ckpt"), "VOCAB_FILE": str(root / "vocab.json"),
        "MERGE_FILE": str(root / "merges.txt"), "DATA_PATH": str(root / "codeparrot_content_document"),
    }  # fmt: skip
    proc = _run(["bash", REPO / "examples" / "pretrain_gpt_npu.sh"], tmp_path, env=env)
    assert "mock data" not in proc.stdout
    assert (
        f"  data_path ....................................... ['{root / 'codeparrot_content_document'}']"
        in proc.stdout
    )
    meta = json.loads((tmp_path / "ckpt" / "iter_0000002" / "metadata.json").read_text())
    assert meta["run_config"]["tokenizer"]["vocab_file"] == str(root / "vocab.json")
    env.pop("DATA_PATH")
    env.update(CHECKPOINT_PATH="", TRAIN_ITERS="1", WARMUP="0")
    proc = _run(["bash", REPO / "examples" / "pretrain_gpt_npu.sh"], tmp_path, env=env)
    assert "DATA_PATH is not set: training on mock data" in proc.stdout


# ---- logs ----------------------------------------------------------------------------------------


def test_startup_prints_megatron_arguments_block_and_parameter_count(blog):
    out = blog["pretrain"].stdout
    start = out.index("------------------------ arguments ------------------------")
    end = out.index("-------------------- end of arguments ---------------------")
    lines = out[start:end].splitlines()[1:]
    names = [line.split()[0] for line in lines]
    assert names == sorted(names, key=str.lower) and "num_layers" in names
    assert "  num_layers ...................................... 2" in lines
    # 2 layers of h=64 (12h^2 + 13h each), the 512-row embedding (512 is a multiple of 128), 64
    # positions, the final norm (the output layer is tied to the embedding)
    h, vocab = 64, 512
    expected = 2 * (12 * h * h + 13 * h) + vocab * h + 64 * h + 2 * h
    assert f" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): {expected}" in out


def test_iteration_line_keeps_megatron_fields_without_zero_tflops_on_cpu(blog):
    line = next(x for x in blog["pretrain"].stdout.splitlines() if x.startswith(" iteration        4/"))
    for field in (
        "consumed samples:", "elapsed time per iteration (ms):", "learning rate:", "global batch size:",
        "lm loss:", "loss scale:", "number of skipped iterations:", "number of nan iterations:",
    ):  # fmt: skip
        assert field in line, (field, line)
    assert "TFLOP/s/device: 0.0" not in blog["pretrain"].stdout


def test_tensorboard_tags_are_megatron_s(blog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (blog["root"] / "experiments" / "tensorboard").glob("events.out.tfevents.*")
    tags = set(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    for tag in (
        "lm loss",
        "learning-rate",
        "batch-size",
        "loss-scale",
        "lm loss validation",
        "lm loss vs samples",
    ):
        assert tag in tags, (tag, sorted(tags))
    assert not any(t.startswith("train/") for t in tags)


def _tiny(tmp_path, *extra, iters=4):
    return [
        "--device-backend", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", str(iters), "--lr", "1e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-workers", "0", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "1",
        *(["--data-cache-path", _INDEX_CACHE[-1]] if _INDEX_CACHE else []), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def timed_tp2(tmp_path_factory):
    """Two processes (TP=2) with the timers at level 2, the params norm and every TensorBoard option."""
    tmp = tmp_path_factory.mktemp("timed")
    argv = _tiny(
        tmp, "--tensor-model-parallel-size", "2", "--log-interval", "2", "--eval-interval", "2",
        "--timing-log-level", "2", "--timing-log-option", "minmax", "--log-timers-to-tensorboard",
        "--log-params-norm", "--log-validation-ppl-to-tensorboard", "--tensorboard-dir", str(tmp / "tb"),
        "--log-json", str(tmp / "log.jsonl"),
    )  # fmt: skip
    proc = _run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
         str(_free_port()), REPO / "examples" / "pretrain_gpt.py", *argv], tmp
    )  # fmt: skip
    return proc, tmp


def test_phase_timers_report_min_and_max_across_ranks(timed_tp2):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc, tmp = timed_tp2
    block = proc.stdout[proc.stdout.index("(min, max) time across ranks (ms):") :].splitlines()[:4]
    for name in ("forward-backward", "optimizer", "batch-generator"):
        row = next(line for line in block if line.strip().startswith(name + " ."))
        low, high = (float(x) for x in row.split(": (")[1].rstrip(")").split(", "))
        assert 0.0 <= low <= high, row
    (events,) = (tmp / "tb").glob("events.out.tfevents.*")
    tags = set(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    assert {"forward-backward-time", "optimizer-time", "batch-generator-time", "iteration-time"} <= tags


def test_no_timer_and_no_device_wait_at_timing_level_0(monkeypatch, capsys):
    from mcore.backend import current_backend
    from mcore.training import pretrain as pretrain_module
    from mcore.training.gpt import forward_step, model_provider

    waits = []
    original = pretrain_module.Timers.__init__

    def counting_init(self, log_level=0, log_option="minmax", synchronize=None):
        original(self, log_level, log_option, lambda: waits.append(1))

    monkeypatch.setattr(pretrain_module.Timers, "__init__", counting_init)
    pretrain_module.pretrain(model_provider, forward_step, argv=_tiny(None, "--log-interval", "2"))
    assert waits == [] and "time across ranks" not in capsys.readouterr().out
    assert current_backend() is not None


def test_params_norm_is_the_same_at_tp2_as_in_one_process(timed_tp2, tmp_path):
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    _, tmp = timed_tp2
    tp2 = [
        r["params_norm"]
        for r in map(json.loads, (tmp / "log.jsonl").read_text().splitlines())
        if r["kind"] == "train"
    ]
    log = tmp_path / "log.jsonl"
    pretrain(model_provider, forward_step, argv=_tiny(tmp_path, "--log-interval", "2", "--eval-interval", "2",
                                                      "--log-params-norm", "--log-json", str(log)))  # fmt: skip
    single = [r["params_norm"] for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"]
    assert len(single) == 2 and single == pytest.approx(tp2, rel=1e-5)
    assert single[0] > 0


def test_validation_ppl_goes_to_tensorboard_when_asked(timed_tp2):
    import math

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, tmp = timed_tp2
    (events,) = (tmp / "tb").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events)).Reload()
    loss = acc.Scalars("lm loss validation")[0].value
    assert acc.Scalars("lm loss validation ppl")[0].value == pytest.approx(math.exp(loss), rel=1e-4)


# ---- schedule on resume and the cyclic sampler ---------------------------------------------------


def test_raising_train_iters_on_resume_is_refused_unless_told(tmp_path, capsys):
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    ckpt = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--eval-iters", "0"]
    pretrain(model_provider, forward_step, argv=_tiny(tmp_path, *ckpt, iters=2))
    with pytest.raises(SystemExit) as err:
        pretrain(model_provider, forward_step, argv=_tiny(tmp_path, *ckpt, iters=4))
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert "decay_steps 8 samples in the checkpoint, 16 samples now" in message
    assert "--override-opt_param-scheduler" in message and "--use-checkpoint-opt_param-scheduler" in message
    kept = pretrain(
        model_provider,
        forward_step,
        argv=_tiny(tmp_path, *ckpt, "--use-checkpoint-opt_param-scheduler", iters=3),
    )
    assert kept.state.iteration == 3
    new = pretrain(
        model_provider, forward_step, argv=_tiny(tmp_path, *ckpt, "--override-opt_param-scheduler", iters=4)
    )
    assert new.state.iteration == 4


def test_cyclic_sampler_shuffles_each_epoch_and_resumes_exactly():
    from mcore.data.samplers import CyclicPretrainingSampler

    def take(sampler, n):
        out = []
        while len(out) < n:
            for batch in sampler:
                out.append(batch)
                if len(out) == n:
                    break
        return out

    single = take(CyclicPretrainingSampler(10, 0, 4, 0, 1, seed=3), 6)  # 8 samples an epoch, 2 per epoch
    flat = [i for b in single for i in b]
    assert sorted(flat[:8]) == list(range(8)) and sorted(flat[8:16]) == list(range(8))
    assert flat[:8] != flat[8:16]  # a new order each epoch
    # two data-parallel ranks of micro-batch 2 see, together, the single process's batches of 4
    ranks = [take(CyclicPretrainingSampler(10, 0, 2, r, 2, seed=3), 6) for r in range(2)]
    assert [a + b for a, b in zip(*ranks)] == single
    # resumed after 3 global batches (12 samples: inside epoch 1), it continues where it was
    assert take(CyclicPretrainingSampler(10, 12, 4, 0, 1, seed=3), 3) == single[3:]
    assert take(CyclicPretrainingSampler(10, 0, 4, 0, 1, seed=4), 2) != single[:2]


def test_cyclic_dataloader_training_resumes_exactly(tmp_path):
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    cyclic = ["--dataloader-type", "cyclic", "--eval-iters", "0"]
    straight = pretrain(model_provider, forward_step, argv=_tiny(tmp_path, *cyclic, iters=4)).train_losses
    ckpt = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    first = pretrain(
        model_provider, forward_step, argv=_tiny(tmp_path, *cyclic, *ckpt, "--exit-interval", "2")
    )
    rest = pretrain(model_provider, forward_step, argv=_tiny(tmp_path, *cyclic, *ckpt))
    assert first.train_losses + rest.train_losses == straight


# ---- generation ----------------------------------------------------------------------------------


def _generate(blog, *args, check=True):
    out = blog["root"] / "gen.json"
    proc = _run(
        [BIN / "mcore-generate", "--load", blog["ckpt"], "--prompt", PROMPT, "--max-new-tokens", "4",
         "--device-backend", "cpu", "--output-json", out, *args],
        blog["root"], check=check,
    )  # fmt: skip
    return proc, (json.loads(out.read_text()) if proc.returncode == 0 else None)


def test_generate_writes_log_probs_and_logits_and_honours_megatron_options(blog):
    proc, (result,) = _generate(
        blog, "--top-p", "0.9", "--top-p-decay", "0.5", "--top-p-bound", "0.2", "--add-BOS",
        "--return-output-log-probs", "--return-logits", "--seed", "3",
    )  # fmt: skip
    assert len(result["output_log_probs"]) == len(result["generated_ids"]) == len(result["logits"])
    assert all(lp <= 0.0 for lp in result["output_log_probs"])
    assert len(result["logits"][0]) == 512  # the tokenizer's vocabulary
    assert result["prompt_ids"][0] == 0  # --add-BOS: the end-of-document id (<|endoftext|> = 0) first
    assert "[length]" not in proc.stdout and "fine-tuning" not in proc.stdout
    assert "reached --max-new-tokens" in proc.stdout or "ended at a stop" in proc.stdout


REFUSED = [
    (["--greedy", "--top-k", "5"], "--greedy takes the most likely token; --top-k only apply to sampling"),
    (["--greedy", "--temperature", "0.5"], "--temperature only apply to sampling"),
    (["--num-beams", "2", "--top-p", "0.5"], "--num-beams 2 (beam search) does not sample: drop --top-p"),
    (["--temperature", "0"], "--temperature 0.0: must be > 0 (use --greedy"),
]


def test_generate_refuses_settings_it_would_ignore(blog, capsys):
    from mcore.inference.generate import main as generate_main

    for args, message in REFUSED:
        with pytest.raises(SystemExit) as err:
            generate_main(["--load", str(blog["ckpt"]), "--prompt", PROMPT, *args])
        assert err.value.code == 2 and message in capsys.readouterr().err, args
    proc, _ = _generate(blog, *REFUSED[0][0], check=False)  # the console script says the same
    assert proc.returncode == 2 and REFUSED[0][1] in proc.stderr, proc.stderr


# ---- the Hugging Face workflow -------------------------------------------------------------------


def test_pipeline_with_no_other_argument_generates(blog):
    from transformers import pipeline

    config = json.loads((blog["exported"] / "generation_config.json").read_text())
    assert config["max_length"] == 64 and config["eos_token_id"] == 0
    out = pipeline("text-generation", model=str(blog["exported"]))(PROMPT)
    assert out[0]["generated_text"].startswith(PROMPT)


def test_from_pretrained_with_device_map_auto(blog):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(blog["exported"], device_map="auto")
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 512)


def test_import_in_half_precision_passes_its_parity_check(blog, tmp_path, capsys):
    from mcore.hf import import_from_hf
    from mcore.hf.importer import main as import_main

    report = import_from_hf(str(blog["exported"]), str(tmp_path / "fp16"), dtype="float16")
    assert report.parity.ok and report.parity.weights_dtype == "float16"
    dtype = "bfloat16"
    proc = _run([BIN / "mcore-import-hf", "--hf-dir", blog["exported"], "--save", tmp_path / "ckpt",
                 "--dtype", dtype], tmp_path)  # fmt: skip
    assert f"both sides' weights rounded to {dtype}, computed in fp32" in proc.stdout
    assert "tolerance 0.0001" in proc.stdout
    capsys.readouterr()
    # The refusal in process (the console script ran above).
    refused = import_main(["--hf-dir", str(blog["exported"]), "--save", str(tmp_path / "c2"),
                           "--tensor-model-parallel-size", "2"])  # fmt: skip
    assert refused == 2 and "layout-free" in capsys.readouterr().err and not (tmp_path / "c2").exists()
