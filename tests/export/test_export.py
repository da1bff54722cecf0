"""export_plan: the files, golden copies of them, and the ways writing them can fail.

Regenerate the golden files after an intended change with
``AUTOFIT_UPDATE_GOLDEN=1 pytest tests/export/test_export.py -k golden`` and review the diff.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autofit.errors import ExportError, PlanError
from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.export import export_files, export_plan, train_script
from autofit.plan import Plan
from tests.export.plans import GOLDEN, all_sweep_plans, golden, target

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE = os.environ.get("AUTOFIT_UPDATE_GOLDEN") == "1"


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden(name):
    ctx, plan = golden(name)
    assert AnalyticEvaluator().evaluate(plan, ctx).fits  # the goldens are plans a search could return
    files = export_files(plan, ctx)
    # train.py is the one template of every export (templates/train.py), not a golden copy each
    assert files.pop("train.py") == train_script()
    d = GOLDEN_DIR / name
    if UPDATE:
        d.mkdir(parents=True, exist_ok=True)
        for old in d.iterdir():
            old.unlink()
        for fname, text in files.items():
            (d / fname).write_text(text)
    assert sorted(p.name for p in d.iterdir()) == sorted(files)
    for fname, text in files.items():
        assert (d / fname).read_text() == text, f"{name}/{fname} differs from the golden copy"


def test_the_files_agree_with_each_other():
    """Precision and batch as the launcher sets them equal what the Trainer is told, for every
    swept plan (the DeepSpeed side is compared by transformers itself in test_trainer.py)."""
    n = 0
    for _, ctx, plan in all_sweep_plans():
        files = export_files(plan, ctx)
        acc = yaml.safe_load(files["accelerate_config.yaml"])
        ta = json.loads(files["trainer_args.json"])["training_arguments"]
        if plan.engine == "deepspeed":
            ds = json.loads(files["ds_config.json"])  # its precision is the Trainer's: "auto", filled from ta
            assert ("bf16" in ds, "fp16" in ds) == (ta["bf16"], ta["fp16"])
            assert {ds[k]["enabled"] for k in ("bf16", "fp16") if k in ds} <= {"auto"}
            assert "mixed_precision" not in acc
        else:
            assert acc["mixed_precision"] == ("bf16" if ta["bf16"] else "fp16" if ta["fp16"] else "no")
        assert (
            ta["per_device_train_batch_size"] * ta["gradient_accumulation_steps"] * acc["num_processes"]
            == ctx.workload.global_batch
        )
        n += 1
    assert n > 1500


def test_files_per_engine(tmp_path):
    ctx = target("mistral-2xA10")
    ds = export_plan(Plan(micro_batch=1, grad_accum=8, sharding="zero2", offload="optimizer"), ctx, tmp_path / "ds")
    common = ["trainer_args.json", "plan.json", "train.py", "README.md"]
    assert [p.name for p in ds] == ["ds_config.json", "accelerate_config.yaml", *common]
    fsdp = export_plan(Plan(micro_batch=1, grad_accum=8, sharding="fsdp"), ctx, tmp_path / "fsdp")
    assert [p.name for p in fsdp] == ["accelerate_config.yaml", *common]
    for p in ds + fsdp:
        assert p.is_file()
    assert json.loads(ds[0].read_text())["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert yaml.safe_load(fsdp[0].read_text())["distributed_type"] == "FSDP"
    readme = ds[-1].read_text()
    assert "accelerate launch --config_file accelerate_config.yaml train.py" in readme
    assert sorted(os.listdir(tmp_path / "ds")) == sorted(p.name for p in ds)  # no temporary files left


def test_export_overwrites_and_respects_umask(tmp_path):
    ctx = target("qwen2-1xA100")
    plan = Plan(method="lora", lora_rank=16, micro_batch=2, grad_accum=4)
    (tmp_path / "trainer_args.json").write_text("old")
    old = os.umask(0o027)
    try:
        paths = export_plan(plan, ctx, tmp_path)
    finally:
        os.umask(old)
    assert json.loads((tmp_path / "trainer_args.json").read_text())["peft"]["r"] == 16
    for p in paths:
        assert stat.S_IMODE(p.stat().st_mode) == 0o640


def test_invalid_plan_is_refused_with_every_problem(tmp_path):
    ctx = target("mistral-2xA10")
    with pytest.raises(PlanError) as err:
        export_plan(Plan(micro_batch=3, grad_accum=1, packing=True), ctx, tmp_path)
    assert "global batch is 16" in str(err.value) and "packing needs flash2" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_out_dir_under_a_regular_file(tmp_path):
    """Unwritable even for root: a directory cannot be made inside a file."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    ctx = target("mistral-2xA10")
    with pytest.raises(ExportError) as err:
        export_plan(Plan(micro_batch=1, grad_accum=8, sharding="zero2"), ctx, blocker / "out")
    msg = str(err.value)
    assert "\n" not in msg and str(blocker / "out") in msg
    with pytest.raises(ExportError, match="not a directory"):
        export_plan(Plan(micro_batch=1, grad_accum=8, sharding="zero2"), ctx, blocker)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_out_dir_without_write_permission(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(ExportError, match="Permission denied"):
            export_plan(Plan(micro_batch=1, grad_accum=8, sharding="zero2"), target("mistral-2xA10"), d)
        assert list(d.iterdir()) == []
    finally:
        d.chmod(0o700)


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 KiB file system (needs mount rights, e.g. root in a container)."""
    mounted = []

    def make(name: str, options: str) -> Path:
        p = tmp_path / name
        if not _mount_tmpfs(p, options):
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(p)
        return p

    yield make
    for p in mounted:
        subprocess.run(["umount", str(p)], check=False)


def test_full_disk_leaves_no_half_written_file(small_tmpfs):
    d = small_tmpfs("full", "size=64k")
    st = os.statvfs(d)
    # leave two 4 KiB pages: the first files fit, a later one does not
    (d / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 2 * 4096))
    ctx, plan = golden("zero3-offload-8xH100-llama-3-70b")
    assert len(export_files(plan, ctx)) == 6
    with pytest.raises(ExportError, match="No space left on device"):
        export_plan(plan, ctx, d / "out")
    assert os.listdir(d / "out") == []


def test_read_only_file_system(small_tmpfs):
    d = small_tmpfs("ro", "size=64k,ro")
    with pytest.raises(ExportError, match="read-only"):
        export_plan(Plan(micro_batch=1, grad_accum=8, sharding="zero2"), target("mistral-2xA10"), d)


@pytest.mark.parametrize(
    ("sharding", "imported"),
    [
        ("none", []),
        # the wrap classes are read from the transformers model classes (_no_split_modules)
        ("fsdp", ["torch", "transformers"]),
    ],
)
def test_export_imports_without_torch(sharding, imported):
    """A plan's export imports no library but where a library's own data decides the file: a
    DeepSpeed plan's (DeepSpeed parses its ds_config.json) and an FSDP plan's (transformers names
    the blocks to wrap)."""
    code = (
        "import sys\n"
        "from autofit.export import export_files\n"
        "from autofit.plan import Plan\n"
        "from autofit.search.request import build_context\n"
        "ctx = build_context('llama-3-8b', '2xA100', global_batch=16)\n"
        f"export_files(Plan(method='qlora', lora_rank=8, micro_batch=1, grad_accum=8, sharding={sharding!r}), ctx)\n"
        "heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'peft') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(imported)
