import glob

import pytest

from autofit.errors import SpecError
from autofit.studies import load_study_file


@pytest.mark.parametrize("path", sorted(glob.glob("studies/*.yaml")))
def test_example_studies_load_and_build(path):
    from autofit.request import build_context
    from autofit.space import Allowed, SearchSpace

    data = load_study_file(path)
    ctx = build_context(data["model"], data["gpus"], seq_len=data.get("seq_len", 2048),
                        global_batch=data.get("global_batch"))
    SearchSpace(ctx, Allowed.parse(data.get("methods"), data.get("optimizers"), data.get("precisions"),
                                   data.get("lora_ranks") and str(data["lora_ranks"])))


@pytest.mark.parametrize("text,fragment", [
    ("model: gpt2\nbogus: 1\n", "unknown key 'bogus'"),
    ("model: 3\n", "'model' must be str"),
    ("trials: true\n", "'trials' must be int"),
    ("- a\n- b\n", "must be a mapping"),
    ("model: [unclosed\n", "not valid YAML"),
])
def test_bad_study_files(tmp_path, text, fragment):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    with pytest.raises(SpecError, match=fragment):
        load_study_file(str(p))
