"""Bad input, table-driven: each case exits non-zero with one clear line and never a traceback."""

import json
import random
import sqlite3

import pytest
from click.testing import CliRunner

from autofit.cli import cli

EST = ["estimate", "--global-batch", "8"]
GPT2 = ["-m", "gpt2", "--seq-len", "1024"]  # GPT-2 has 1,024 learned positions: the default 2048 is refused


@pytest.fixture
def files(tmp_path):
    (tmp_path / "nofields").mkdir()
    (tmp_path / "nofields" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    (tmp_path / "mamba.json").write_text(
        json.dumps(
            {
                "model_type": "mamba",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "vocab_size": 100,
            }
        )
    )
    (tmp_path / "unknown.yaml").write_text("model: gpt2\ngpus: 1xA10\ncolour: blue\n")
    (tmp_path / "types.yaml").write_text("model: gpt2\ngpus: 1xA10\ntrials: many\n")
    (tmp_path / "notyaml.yaml").write_text("model: [gpt2\n  gpus: {\n")
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    # a database written by a newer autofit: a revision this one does not know
    newer = tmp_path / "newer.db"
    with sqlite3.connect(newer) as conn:
        conn.execute("CREATE TABLE autofit_alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        conn.execute("INSERT INTO autofit_alembic_version VALUES ('9999_future')")
    spec_files(tmp_path)
    store_files(tmp_path)
    return tmp_path


def spec_files(d):
    """Files for the model-config, study-file and option cases."""
    base = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 704,
        "vocab_size": 1000,
        "max_position_embeddings": 2048,
    }
    for name, override in {
        "cfg-str": {"hidden_size": "4096"},
        "cfg-list": {"num_hidden_layers": [2]},
        "cfg-fraction": {"hidden_size": 4096.5},
        "cfg-zero-heads": {"num_attention_heads": 0},
        "cfg-type-list": {"model_type": ["llama"]},
        "cfg-maxpos": {"max_position_embeddings": "long"},
        "cfg-inter": {"intermediate_size": {"value": 704}},
        "cfg-kv": {"num_key_value_heads": "2"},
        "cfg-headdim": {"head_dim": 32.5},
        "cfg-tie": {"tie_word_embeddings": "yes"},
        "cfg-huge": {"num_hidden_layers": 10**12},
    }.items():
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps({**base, **override}))
    (d / "cfg-inf").mkdir()  # json reads 1e400 as inf
    (d / "cfg-inf" / "config.json").write_text(json.dumps(base).replace('"hidden_size": 256', '"hidden_size": 1e400'))
    (d / "cfg-binary").mkdir()
    (d / "cfg-binary" / "config.json").write_bytes(b"\xff\xfe{\x00\x89PNG\r\n")

    study = "model: gpt2\ngpus: 1xA10\nglobal_batch: 8\nbackend: analytic\n"
    (d / "png.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10")
    (d / "random.yaml").write_bytes(bytes(random.Random(12).randrange(256) for _ in range(4096)))
    (d / "huge.yaml").write_text(study + "# " + "x" * 2**20 + "\n")
    (d / "alias.yaml").write_text("model: &m gpt2\ngpus: 1xA10\nname: *m\n")
    laughs = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    laughs += [f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    (d / "laughs.yaml").write_text("\n".join(laughs) + "\n")
    for name, line in {
        "trials": "trials: -3",
        "nodes": "nodes: 0",
        "seqlen": "seq_len: 0",
        "batch": "global_batch: 0",
        "headroom": "headroom: 0.95",
        "seed": "seed: -1",
        "bigseed": "seed: 4294967296",
        "ranks": "lora_ranks: [16, 0]",
        "timeout": "timeout: -5",
        "backend": "backend: quantum",
    }.items():
        (d / f"range-{name}.yaml").write_text(study + line + "\n")


def store_files(d):
    """Files for the database, study-name and work-dir cases."""
    from tests.conftest import tiny

    tiny("gpt2").to_hf_config().save_pretrained(d / "tiny-gpt2")
    with sqlite3.connect(d / "otherapp.db") as conn:  # another application's database
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, user_id INTEGER)")


CASES = [
    ("misspelled model", EST + ["-m", "mistrl-7b", "-g", "1xA10"], "unknown model"),
    ("hub id offline", EST + ["-m", "nobody/no-such-model", "-g", "1xA10"], "cannot fetch the config of hub id"),
    ("config without fields", EST + ["-m", "{d}/nofields", "-g", "1xA10"], "lacks the fields"),
    ("not a transformer", EST + ["-m", "{d}/mamba.json", "-g", "1xA10"], "has no attention module"),
    ("unknown GPU", EST + [*GPT2, "-g", "1xB300"], "unknown GPU"),
    ("zero GPUs", EST + [*GPT2, "-g", "0xA10"], "at least 1"),
    ("negative GPUs", EST + [*GPT2, "-g", "-1xA10"], "at least 1"),
    ("two counts", EST + [*GPT2, "-g", "2xA10x3"], "malformed"),
    ("seq len 0", EST + [*GPT2, "-g", "1xA10", "--seq-len", "0"], "--seq-len"),
    (
        "batch not divisible",
        ["estimate", *GPT2, "-g", "3xA10", "--global-batch", "8"],
        "not divisible",
    ),
    (
        "search batch not divisible",
        ["search", *GPT2, "-g", "3xA10", "--global-batch", "8", "--evaluator", "analytic"],
        "multiple of the 3 GPUs",
    ),
    (
        "contradictory choices",
        [
            "search",
            *GPT2,
            "-g",
            "1xA10",
            "--methods",
            "qlora",
            "--precisions",
            "32-true",
            "--evaluator",
            "analytic",
        ],
        "qlora computes in 16-bit",
    ),
    (
        "unknown method",
        ["search", *GPT2, "-g", "1xA10", "--methods", "full,dora"],
        "--methods",
    ),
    ("study file unknown key", ["search", "--config", "{d}/unknown.yaml"], "unknown key 'colour'"),
    ("study file wrong type", ["search", "--config", "{d}/types.yaml"], "'trials' must be int"),
    ("study file not YAML", ["search", "--config", "{d}/notyaml.yaml"], "not valid YAML"),
    ("db unknown scheme", ["history", "--db", "oracle+cx://u@h/db"], "oracle"),
    ("db path cannot be created", ["history", "--db", "{d}/blocker/sub/a.db"], "{d}/blocker"),
    ("db from a newer autofit", ["history", "--db", "{d}/newer.db"], "newer"),
    ("unknown study in show", ["show", "nope", "--db", "{d}/ok.db"], "no study named 'nope'"),
    ("unknown study in export", ["export", "nope", "--out", "{d}/o", "--db", "{d}/ok.db"], "no study named 'nope'"),
    (
        "bad duration",
        ["search", *GPT2, "-g", "1xA10", "--timeout", "soon", "--evaluator", "analytic"],
        "cannot read duration",
    ),
    (
        "bad host memory",
        EST + [*GPT2, "-g", "1xA10", "--host-mem", "lots"],
        "cannot read size",
    ),
    (
        "fresh and resume",
        [
            "search",
            *GPT2,
            "-g",
            "1xA10",
            "--evaluator",
            "analytic",
            "--fresh",
            "--resume",
            "--db",
            "{d}/ok.db",
        ],
        "give only one",
    ),
]

# model configs, study files, options (specs/, studies.py, cli/options.py)
SPEC_SEARCH = [
    "search",
    "--evaluator",
    "analytic",
    "--trials",
    "2",
    "--global-batch",
    "8",
    "--out",
    "",
    "--db",
    "{d}/s.db",
]
SPEC_CASES = [
    (
        "config size as a string",
        EST + ["-m", "{d}/cfg-str/config.json", "-g", "1xA10"],
        "'hidden_size' must be a positive integer, got \"4096\" (a string); write it without quotes",
    ),
    (
        "config size as a list",
        EST + ["-m", "{d}/cfg-list", "-g", "1xA10"],
        "'num_hidden_layers' must be a positive integer",
    ),
    (
        "config size with a fraction",
        EST + ["-m", "{d}/cfg-fraction/config.json", "-g", "1xA10"],
        "{d}/cfg-fraction/config.json': 'hidden_size' must be a positive integer, got 4096.5",
    ),
    (
        "config size infinite",
        EST + ["-m", "{d}/cfg-inf/config.json", "-g", "1xA10"],
        "'hidden_size' must be a positive integer, got inf",
    ),
    (
        "config zero heads",
        EST + ["-m", "{d}/cfg-zero-heads/config.json", "-g", "1xA10"],
        "'num_attention_heads' must be a positive integer, got 0",
    ),
    (
        "config model type a list",
        EST + ["-m", "{d}/cfg-type-list/config.json", "-g", "1xA10"],
        "'model_type' must be a string",
    ),
    (
        "config max positions a word",
        EST + ["-m", "{d}/cfg-maxpos/config.json", "-g", "1xA10"],
        "'max_position_embeddings' must be a positive integer",
    ),
    (
        "config intermediate an object",
        EST + ["-m", "{d}/cfg-inter/config.json", "-g", "1xA10"],
        "'intermediate_size' must be a positive integer",
    ),
    (
        "config kv heads a string",
        EST + ["-m", "{d}/cfg-kv/config.json", "-g", "1xA10"],
        "'num_key_value_heads' must be a positive integer",
    ),
    (
        "config head dim a fraction",
        EST + ["-m", "{d}/cfg-headdim/config.json", "-g", "1xA10"],
        "'head_dim' must be a positive integer",
    ),
    (
        "config tie a string",
        EST + ["-m", "{d}/cfg-tie/config.json", "-g", "1xA10"],
        "'tie_word_embeddings' must be true or false",
    ),
    (
        "config absurd layer count",
        EST + ["-m", "{d}/cfg-huge/config.json", "-g", "1xA10"],
        "beyond the 1,024 any real model has",
    ),
    (
        "config not UTF-8",
        EST + ["-m", "{d}/cfg-binary", "-g", "1xA10"],
        "{d}/cfg-binary/config.json' is not UTF-8 text",
    ),
    ("study file a PNG", ["search", "--config", "{d}/png.yaml"], "png.yaml' is not UTF-8 text"),
    ("study file random bytes", ["search", "--config", "{d}/random.yaml"], "random.yaml' is not UTF-8 text"),
    ("study file over 1 MiB", ["search", "--config", "{d}/huge.yaml"], "is over 1 MiB"),
    ("study file with an alias", SPEC_SEARCH + ["--config", "{d}/alias.yaml"], "uses a YAML alias (line 3)"),
    ("study file billion laughs", ["search", "--config", "{d}/laughs.yaml"], "uses a YAML alias (line 2)"),
    (
        "study file negative trials",
        ["search", "--config", "{d}/range-trials.yaml", "--db", "{d}/s.db", "--out", ""],
        "'trials': -3 is not in the range x>=1",
    ),
    ("study file zero nodes", SPEC_SEARCH + ["--config", "{d}/range-nodes.yaml"], "'nodes': 0 is not in the range"),
    (
        "study file zero seq len",
        SPEC_SEARCH + ["--config", "{d}/range-seqlen.yaml"],
        "'seq_len': 0 is not in the range",
    ),
    (
        "study file zero batch",
        ["search", "--config", "{d}/range-batch.yaml", "--db", "{d}/s.db", "--out", ""],
        "'global_batch': 0 is not in the range",
    ),
    (
        "study file headroom over 0.9",
        SPEC_SEARCH + ["--config", "{d}/range-headroom.yaml"],
        "'headroom': 0.95 is not in the range",
    ),
    ("study file negative seed", SPEC_SEARCH + ["--config", "{d}/range-seed.yaml"], "'seed': -1 is not in the range"),
    (
        "study file seed past 2**32-1",
        SPEC_SEARCH + ["--config", "{d}/range-bigseed.yaml"],
        "'seed': 4294967296 is not in the range",
    ),
    (
        "study file zero LoRA rank",
        SPEC_SEARCH + ["--config", "{d}/range-ranks.yaml"],
        "'lora_ranks' must be positive integers",
    ),
    (
        "study file negative timeout",
        SPEC_SEARCH + ["--config", "{d}/range-timeout.yaml"],
        "'timeout': duration -5 must be a positive",
    ),
    (
        "study file unknown backend",
        ["search", "--config", "{d}/range-backend.yaml", "--db", "{d}/s.db", "--out", ""],
        "'backend': 'quantum' is not one of",
    ),
    (
        "negative seed",
        SPEC_SEARCH + [*GPT2, "-g", "1xT4", "--seed", "-1"],
        "'--seed': -1 is not in the range 0<=x<=4294967295",
    ),
    (
        "seed past numpy's range",
        SPEC_SEARCH + [*GPT2, "-g", "1xT4", "--seed", "99999999999"],
        "'--seed': 99999999999 is not in",
    ),
    (
        "hub id offline says what it is not",
        EST + ["-m", "nobody/no-such-model", "-g", "1xA10"],
        "not a registered model, not a local path, and the hub is unreachable",
    ),
    (
        "cpu budget beyond the machine",
        EST + [*GPT2, "-g", "1xcpu", "--cpu-mem-budget", "1000TiB"],
        "exceeds this machine's",
    ),
    (
        "absurd GPU count",
        EST + [*GPT2, "-g", "99999999999999999999xT4"],
        "more than any node holds (at most 72",
    ),
    (
        "73 GPUs per node",
        SPEC_SEARCH + [*GPT2, "-g", "73xT4"],
        "more than any node holds (at most 72",
    ),
    (
        "absurd node count",
        EST + [*GPT2, "-g", "1xT4", "--nodes", "99999999999999999999"],
        "--nodes 99,999,999,999,999,999,999",
    ),
    (
        "absurd seq len",
        EST + [*GPT2, "-g", "1xT4", "--seq-len", "99999999999"],
        "--seq-len 99,999,999,999 is beyond",
    ),
    (
        "absurd seq len in search",
        SPEC_SEARCH + [*GPT2, "-g", "1xT4", "--seq-len", "99999999999"],
        "is beyond the 1,048,576",
    ),
]

# databases, study names, work dirs (store/, cli/)
SEARCH = [
    "search",
    *GPT2,
    "-g",
    "1xA10",
    "--global-batch",
    "8",
    "--evaluator",
    "analytic",
    "--out",
    "",
]
MEASURED = [
    "search",
    "-m",
    "{d}/tiny-gpt2",
    "-g",
    "1xcpu",
    "--evaluator",
    "measured",
    "--trials",
    "2",
    "--seq-len",
    "64",
    "--global-batch",
    "2",
    "--out",
    "",
    "--db",
    "{d}/wd.db",
]
STORE_CASES = [
    (
        "db port not a number",
        ["history", "--db", "postgresql://postgres@127.0.0.1:notaport/x"],
        "cannot read database URL 'postgresql://postgres@127.0.0.1:notaport/x': its port 'notaport' is not a number",
    ),
    (
        "db port not a number, password",
        ["history", "--db", "postgresql://postgres:pw123@127.0.0.1:notaport/x"],
        "'postgresql://postgres:***@127.0.0.1:notaport/x'",
    ),
    ("db IPv6 host unclosed", ["history", "--db", "postgresql://postgres@[::1/x"], "lacks the closing ']'"),
    ("db IPv6 host unbracketed", ["history", "--db", "postgresql://postgres@::1/x"], "goes in brackets"),
    ("db port out of range", ["history", "--db", "postgresql://postgres@127.0.0.1:99999/x"], "outside 1-65535"),
    (
        "db of another application",
        ["history", "--db", "{d}/otherapp.db"],
        "holds another application's tables (orders, users) and none of autofit's",
    ),
    ("db upgrade of another application", ["db", "upgrade", "--db", "{d}/otherapp.db"], "give a new file"),
    (
        "study name is a path",
        SEARCH + ["--name", "../../escape", "--db", "{d}/names.db"],
        "study name '../../escape' is not allowed",
    ),
    ("study name starts with a dash", SEARCH + ["--name", "-x", "--db", "{d}/names.db"], "starting with a letter"),
    ("study name too long", SEARCH + ["--name", "n" * 101, "--db", "{d}/names.db"], "1-100 letters"),
    (
        "work dir under a file",
        MEASURED + ["--work-dir", "{d}/blocker/sub"],
        "cannot create work directory {d}/blocker/sub: {d}/blocker is a file",
    ),
    (
        "work dir under a file in estimate",
        [
            "estimate",
            "-m",
            "{d}/tiny-gpt2",
            "-g",
            "1xcpu",
            "--evaluator",
            "measured",
            "--seq-len",
            "64",
            "--global-batch",
            "1",
            "--work-dir",
            "{d}/blocker/a/b",
        ],
        "{d}/blocker is a file",
    ),
]

CASES = CASES + SPEC_CASES + STORE_CASES


@pytest.mark.parametrize("name,args,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(files, name, args, fragment):
    d = str(files)
    r = CliRunner().invoke(cli, [a.replace("{d}", d) for a in args])
    assert r.exit_code != 0, r.output
    assert "Traceback" not in r.output
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1, r.output
    assert fragment.replace("{d}", d) in lines[0], lines[0]


def test_unknown_trial_in_export(tmp_path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    r = CliRunner().invoke(cli, [*SEARCH, "--trials", "3", "--db", db, "--json"])
    study = json.loads(r.stdout)["study"]
    r = CliRunner().invoke(cli, ["export", study, "--trial", "99", "--out", str(tmp_path / "o"), "--db", db])
    assert r.exit_code != 0 and "has no trial 99" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("command", ["estimate", "search"])
def test_seq_len_past_the_positions_is_refused_in_one_line(command, tmp_path):
    tail = ["--backend", "analytic", "--db", f"sqlite:///{tmp_path}/s.db"] if command == "search" else []
    for model, seq, fragment in [
        ("gpt2", "2048", "--seq-len 2,048 is too long: gpt2 has 1,024 learned positions and fails past them"),
        ("llama-2-7b", "8192", "llama-2-7b was trained on 4,096 positions and its config sets no RoPE scaling"),
    ]:
        r = CliRunner().invoke(cli, [command, "-m", model, "-g", "1xA100", "--seq-len", seq, *tail])
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert r.exit_code != 0 and len(lines) == 1 and fragment in lines[0], r.output


def test_a_config_that_scales_rope_trains_past_its_positions(tmp_path):
    from autofit.specs import resolve_model

    cfg = resolve_model("llama-2-7b").to_hf_config().to_dict()
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ["estimate", "-m", str(tmp_path / "config.json"), "-g", "1xA100", "--backend", "analytic", "--json"]
    assert CliRunner().invoke(cli, [*args, "--seq-len", "8192"]).exit_code == 0
    r = CliRunner().invoke(cli, [*args, "--seq-len", "8193"])
    assert r.exit_code != 0 and "trained on 8,192 positions (with its RoPE scaling)" in r.output


def test_alibi_has_no_position_table_and_warns():
    r = CliRunner().invoke(
        cli, ["estimate", "-m", "bloom-7b1", "-g", "1xA100", "--seq-len", "4096", "--global-batch", "1"]
    )
    assert r.exit_code == 0 and "beyond bloom-7b1's 2048 positions" in r.output
