import glob

import pytest

from autofit.errors import SpecError
from autofit.search.studies import load_study_file


@pytest.mark.parametrize("path", sorted(glob.glob("studies/*.yaml")))
def test_example_studies_load_and_build(path):
    from autofit.search.request import build_context
    from autofit.search.space import Allowed, SearchSpace

    data = load_study_file(path)
    ctx = build_context(
        data["model"], data["gpus"], seq_len=data.get("seq_len", 2048), global_batch=data.get("global_batch")
    )
    SearchSpace(
        ctx,
        Allowed.parse(
            data.get("methods"),
            data.get("optimizers"),
            data.get("precisions"),
            data.get("lora_ranks") and str(data["lora_ranks"]),
        ),
    )


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("model: gpt2\nbogus: 1\n", "unknown key 'bogus'"),
        ("model: 3\n", "'model' must be str"),
        ("trials: true\n", "'trials' must be int"),
        ("- a\n- b\n", "must be a mapping"),
        ("model: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_study_files(tmp_path, text, fragment):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    with pytest.raises(SpecError, match=fragment):
        load_study_file(str(p))


@pytest.mark.parametrize(
    "raw,fragment",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", r"is not UTF-8 text \(byte 0x89 at offset 0\)"),
        (b"model: gpt2\nname: caf\xe9\n", r"is not UTF-8 text \(byte 0xe9 at offset 21\)"),
        (b"model: gpt2\n#" + b"x" * 2**20, "is over 1 MiB"),
        (b"model: &m gpt2\nname: *m\n", r"uses a YAML alias \(line 2\)"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"headroom: .nan\n", "'headroom' must be a finite number"),
        (b"lora_ranks: [8, 0]\n", "'lora_ranks' must be positive integers, got 0"),
        (b"lora_ranks: -4\n", "'lora_ranks' must be positive integers, got -4"),
        (b"timeout: -5\n", "'timeout': duration -5 must be a positive"),
        (b"timeout: 0\n", "'timeout': duration 0 must be a positive"),
        (b"timeout: .inf\n", "'timeout'"),
        (b"timeout: soon\n", "'timeout': cannot read duration 'soon'"),
        (b"name: " + b"x" * 500 + b"\nbogus" + b"y" * 500 + b": 1\n", "unknown key 'bogusyyy"),
        (b"model: gpt2\nmodle: x\n", r"unknown key 'modle' \(did you mean 'model'\?\)$"),
        (b"flavour: x\n", r"unknown key 'flavour' \(known keys: model, gpus, .*, db\)$"),
        (b"1: x\n", "unknown key '1'"),
        (b"model:\ngpus: 1xA10\n", "'model' has no value: give one, or leave the key out"),
        (b"evaluator: analytic\nbackend: simulated\n", "'backend' is the earlier name of 'evaluator': give one"),
        (b"host_mem: lots\n", "'host_mem': cannot read size 'lots'"),
        (b"host_mem: 1.5\n", "'host_mem' must be str or int, got 1.5"),
        (b"methods: 3\n", "'methods' must be str or list, got 3"),
        (b"precisions: [bf16, no]\n", "'precisions' must be str or a list of str, got False in the list .*quote it"),
        (b"trials: 4.0\n", "'trials' must be int, got 4.0"),
        (b"headroom: true\n", "'headroom' must be a number, got True"),
        (b"name: 2024-01-01\n", "'name' must be str, got datetime.date"),
    ],
)
def test_files_that_are_not_a_study(tmp_path, raw, fragment):
    p = tmp_path / "s.yaml"
    p.write_bytes(raw)
    with pytest.raises(SpecError, match=fragment) as err:
        load_study_file(str(p))
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_billion_laughs_is_refused_before_it_expands(tmp_path):
    import time

    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    p = tmp_path / "laughs.yaml"
    p.write_text("\n".join(lines) + "\n")
    start = time.monotonic()
    with pytest.raises(SpecError, match="uses a YAML alias"):
        load_study_file(str(p))
    assert time.monotonic() - start < 1


def test_a_study_file_of_exactly_1_mib_still_loads(tmp_path):
    head = b"model: gpt2\ntrials: 5\n#"
    p = tmp_path / "s.yaml"
    p.write_bytes(head + b"x" * (2**20 - len(head) - 1) + b"\n")
    assert load_study_file(str(p)) == {"model": "gpt2", "trials": 5}


def test_study_file_values_obey_the_cli_ranges_and_nothing_is_stored(tmp_path):
    from click.testing import CliRunner

    from autofit.cli import cli

    db = tmp_path / "s.db"
    for line, fragment in [
        ("trials: -3", "'trials': -3 is not in the range x>=1"),
        ("seed: 4294967296", "'seed': 4294967296 is not in the range 0<=x<=4294967295"),
        ("headroom: 0.91", "'headroom': 0.91 is not in the range 0.0<=x<=0.9"),
        ("nodes: 0", "'nodes': 0 is not in the range x>=1"),
    ]:
        p = tmp_path / "s.yaml"
        p.write_text(f"model: gpt2\ngpus: 1xA10\nseq_len: 1024\nglobal_batch: 8\nbackend: analytic\n{line}\n")
        r = CliRunner().invoke(cli, ["search", "--config", str(p), "--db", str(db), "--out", ""])
        assert r.exit_code != 0 and fragment in r.output and "Traceback" not in r.output, r.output
    assert not db.exists()


def test_the_command_line_still_overrides_an_out_of_range_file_value(tmp_path):
    from click.testing import CliRunner

    from autofit.cli import cli

    p = tmp_path / "s.yaml"
    p.write_text(
        "model: gpt2\ngpus: 1xA10\nseq_len: 1024\nglobal_batch: 8\nbackend: analytic\ntrials: -3\nheadroom: 0.1\n"
    )
    r = CliRunner().invoke(
        cli, ["search", "--config", str(p), "--trials", "2", "--db", str(tmp_path / "s.db"), "--out", "", "--json"]
    )
    assert r.exit_code == 0, r.output


def test_every_problem_of_a_study_file_is_named_on_one_line_in_the_file_s_order(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("trials: '12'\nmodle: gpt2\nheadroom: .nan\n")
    with pytest.raises(SpecError) as err:
        load_study_file(str(p))
    assert str(err.value) == (
        f"study file {str(p)!r}: 'trials' must be int, got '12'; also unknown key 'modle' (did you mean 'model'?); "
        "also 'headroom' must be a finite number, got nan"
    )
    p.write_text("a: 1\nb: 2\nc: 3\nd: 4\nmodel: 5\n")
    with pytest.raises(SpecError, match=r"unknown key 'c'; and 2 more problems \(known keys: model, ") as err:
        load_study_file(str(p))
    assert "\n" not in str(err.value)


def test_a_study_file_gives_lists_in_the_comma_form_and_keeps_other_values_as_written(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("methods: [full, lora]\nlora_ranks: [16, '64']\ntimeout: 1h30m\nhost_mem: 256GiB\nheadroom: 0.1\n")
    assert load_study_file(str(p)) == {
        "host_mem": "256GiB",
        "headroom": 0.1,
        "methods": "full,lora",
        "lora_ranks": "16,64",
        "timeout": "1h30m",
    }


def test_every_study_file_key_is_an_option_of_search():
    from autofit.cli.search import _STUDY_KEY_OPTIONS, search
    from autofit.search.studies import StudyFile

    options = {p.name for p in search.params}
    assert {_STUDY_KEY_OPTIONS.get(k, k) for k in StudyFile.model_fields} <= options
    assert set(_STUDY_KEY_OPTIONS) <= set(StudyFile.model_fields)


def test_a_lengths_path_in_a_study_file_is_relative_to_the_file(tmp_path):
    import json

    from click.testing import CliRunner

    from autofit.cli import cli

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "h.json").write_text(json.dumps({"300": 5, "1500": 1}))
    p = tmp_path / "sub" / "s.yaml"
    p.write_text("model: gpt2\ngpus: 1xA10\nseq_len: 1024\nglobal_batch: 8\nbackend: analytic\nlengths: h.json\n")
    args = ["search", "--config", str(p), "--db", str(tmp_path / "s.db"), "--out", "", "--json", "--trials", "2"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, [*args, "--lengths", "h.json"])  # the command line's: relative to the working dir
    assert r.exit_code != 0 and "h.json" in r.output and "Traceback" not in r.output, r.output
