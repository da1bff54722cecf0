"""Bad input, table-driven: each case exits non-zero with one clear line and never a traceback."""

import json
import sqlite3

import pytest
from click.testing import CliRunner

from autofit.cli import cli

EST = ["estimate", "--global-batch", "8"]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "nofields").mkdir()
    (tmp_path / "nofields" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    (tmp_path / "mamba.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2,
                                                    "num_attention_heads": 2, "vocab_size": 100}))
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


def store_files(d):
    """Files for the database, study-name and work-dir cases."""


CASES = [
    ("misspelled model", EST + ["-m", "mistrl-7b", "-g", "1xA10"], "unknown model"),
    ("hub id offline", EST + ["-m", "nobody/no-such-model", "-g", "1xA10"], "cannot fetch the config of hub id"),
    ("config without fields", EST + ["-m", "{d}/nofields", "-g", "1xA10"], "lacks the fields"),
    ("unsupported model type", EST + ["-m", "{d}/mamba.json", "-g", "1xA10"], "not supported"),
    ("unknown GPU", EST + ["-m", "gpt2", "-g", "1xB300"], "unknown GPU"),
    ("zero GPUs", EST + ["-m", "gpt2", "-g", "0xA10"], "at least 1"),
    ("negative GPUs", EST + ["-m", "gpt2", "-g", "-1xA10"], "at least 1"),
    ("two counts", EST + ["-m", "gpt2", "-g", "2xA10x3"], "malformed"),
    ("seq len 0", EST + ["-m", "gpt2", "-g", "1xA10", "--seq-len", "0"], "--seq-len"),
    ("batch not divisible", ["estimate", "-m", "gpt2", "-g", "3xA10", "--global-batch", "8"], "not divisible"),
    ("search batch not divisible", ["search", "-m", "gpt2", "-g", "3xA10", "--global-batch", "8", "--backend",
                                    "analytic"], "multiple of the 3 GPUs"),
    ("contradictory choices", ["search", "-m", "gpt2", "-g", "1xA10", "--methods", "qlora", "--precisions", "32-true",
                               "--backend", "analytic"], "qlora computes in 16-bit"),
    ("unknown method", ["search", "-m", "gpt2", "-g", "1xA10", "--methods", "full,dora"], "--methods"),
    ("study file unknown key", ["search", "--config", "{d}/unknown.yaml"], "unknown key 'colour'"),
    ("study file wrong type", ["search", "--config", "{d}/types.yaml"], "'trials' must be int"),
    ("study file not YAML", ["search", "--config", "{d}/notyaml.yaml"], "not valid YAML"),
    ("db unknown scheme", ["history", "--db", "oracle+cx://u@h/db"], "oracle"),
    ("db path cannot be created", ["history", "--db", "{d}/blocker/sub/a.db"], "{d}/blocker"),
    ("db from a newer autofit", ["history", "--db", "{d}/newer.db"], "newer"),
    ("unknown study in show", ["show", "nope", "--db", "{d}/ok.db"], "no study named 'nope'"),
    ("unknown study in export", ["export", "nope", "--out", "{d}/o", "--db", "{d}/ok.db"], "no study named 'nope'"),
    ("bad duration", ["search", "-m", "gpt2", "-g", "1xA10", "--timeout", "soon", "--backend", "analytic"],
     "cannot read duration"),
    ("bad host memory", EST + ["-m", "gpt2", "-g", "1xA10", "--host-mem", "lots"], "cannot read size"),
]

# model configs, study files, options (specs/, studies.py, cli/options.py)
SPEC_CASES = [
]

# databases, study names, work dirs (store/, cli/)
STORE_CASES = [
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
    r = CliRunner().invoke(cli, ["search", "-m", "gpt2", "-g", "1xA10", "--global-batch", "8", "--backend", "analytic",
                                 "--trials", "3", "--db", db, "--out", "", "--json"])
    study = json.loads(r.stdout)["study"]
    r = CliRunner().invoke(cli, ["export", study, "--trial", "99", "--out", str(tmp_path / "o"), "--db", db])
    assert r.exit_code != 0 and "has no trial 99" in r.output and "Traceback" not in r.output


def test_seq_len_beyond_the_model_warns():
    r = CliRunner().invoke(cli, ["estimate", "-m", "gpt2", "-g", "1xA10", "--seq-len", "4096", "--global-batch", "1"])
    assert r.exit_code == 0
    assert "beyond gpt2's 1024 positions" in r.output
