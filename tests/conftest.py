import fcntl
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

pytest_plugins = ("tests.showcase",)  # session-wide studies for the report, plot and progress tests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist every worker shares the machine's cores: one torch thread each (the workers
# are the parallelism), inherited by the children tests launch. Set before anything imports torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# -- tests that must not run beside others (tests/README.md, "Parallel workers") --
def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "alone(reason): runs with no other test beside it under pytest-xdist (it restarts a service the "
        "others use, or its assertions time something); the reason says which",
    )
    config.addinivalue_line(
        "markers",
        "ranks(reason): launches several processes that each take a core; under pytest-xdist no two such "
        "tests run at once (a single-process test may run beside one)",
    )


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 4 (each holds torch, transformers and its own
    session fixtures: about 2 GiB)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


class _WorkerLocks:
    """File locks that the xdist workers of one run share (``flock``: released if a worker dies).

    ``alone`` is a readers-writer lock with writer preference: every test holds ``shared`` for
    reading, an ``alone`` test holds it for writing; the ``turnstile`` that an ``alone`` test
    keeps while it waits stops the other worker from starting its next test meanwhile.
    """

    def __init__(self, run_id: str) -> None:
        folder = Path(tempfile.gettempdir()) / f"autofit-xdist-{run_id}"
        folder.mkdir(exist_ok=True)
        self.fds = {n: os.open(folder / n, os.O_CREAT | os.O_RDWR) for n in ("turnstile", "shared", "ranks")}

    def lock(self, name: str, mode: int) -> None:
        fcntl.flock(self.fds[name], mode)

    def unlock(self, name: str) -> None:
        fcntl.flock(self.fds[name], fcntl.LOCK_UN)


_LOCKS: _WorkerLocks | None = None


@pytest.fixture(autouse=True)
def _xdist_exclusion(request):
    """Serialise ``alone`` and ``ranks`` tests across the xdist workers; nothing without xdist."""
    global _LOCKS
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id:
        yield
        return
    if _LOCKS is None:
        _LOCKS = _WorkerLocks(run_id)
    alone = request.node.get_closest_marker("alone") is not None
    ranks = request.node.get_closest_marker("ranks") is not None
    _LOCKS.lock("turnstile", fcntl.LOCK_EX)
    if alone:
        _LOCKS.lock("shared", fcntl.LOCK_EX)
    else:
        _LOCKS.unlock("turnstile")
        _LOCKS.lock("shared", fcntl.LOCK_SH)
    if ranks:
        _LOCKS.lock("ranks", fcntl.LOCK_EX)
    try:
        yield
    finally:
        if ranks:
            _LOCKS.unlock("ranks")
        _LOCKS.unlock("shared")
        if alone:
            _LOCKS.unlock("turnstile")


def tiny(name: str, layers: int = 2, **overrides):
    """A small variant of a registered architecture that trains on the CPU in well under a second."""
    from autofit.specs import MODELS

    base = MODELS[name]
    fields = dict(
        num_layers=layers,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2 if base.num_kv_heads < base.num_heads else 8,
        head_dim=64 if base.model_type == "gemma2" else 32,
        intermediate_size=704,
        vocab_size=1000,
        name=f"tiny-{name}",
    )
    if base.family.moe:  # 8 experts, top-2, as wide as the dense tiny MLPs' share
        f = base.family
        routing = {f.experts_key: 8, f.top_k_key: 2, **({f.expert_width_key: 128} if f.expert_width_key else {})}
        routing.update({f.shared_expert_key: 192} if f.shared_expert_key else {})
        fields["hf_extra"] = tuple({**dict(base.hf_extra), **routing}.items())
        fields["intermediate_size"] = 256
    fields.update(overrides)
    return base.variant(**fields)


@pytest.fixture
def tiny_model():
    return tiny


# -- databases: every store-backed test runs on a SQLite file and on a fresh PostgreSQL database --
PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def pg_admin():
    """An AUTOCOMMIT engine on AUTOFIT_TEST_PG that creates and drops per-test databases."""
    url = make_url(os.environ.get("AUTOFIT_TEST_PG", PG_DEFAULT))
    engine = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", exc)).splitlines()[0]
        pytest.skip(f"PostgreSQL at {url.render_as_string(hide_password=True)} is unreachable: {reason}")
    yield engine, url
    engine.dispose()


@pytest.fixture
def pg_url(pg_admin):
    """A new, empty database for one test: no test sees another's tables, concurrent runs included."""
    engine, url = pg_admin
    name = f"autofit_test_{os.getpid()}_{secrets.token_hex(4)}"
    with engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    yield url.set(database=name).render_as_string(hide_password=False)
    with engine.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'autofit.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def store(db_url):
    from autofit.store import Store

    with Store(db_url) as s:
        yield s


@pytest.fixture(scope="session")
def deepspeed_jit_ops():
    """DeepSpeed's shared-memory all-reduce op, built once for the machine before a test launches
    DeepSpeed ranks. On the CPU accelerator every process that starts ``deepspeed.comm`` loads it
    (deepspeed/comm/torch.py: ``TorchBackend.__init__`` calls ``build_shm_op``), and the first one
    on a machine JIT-compiles it into torch's extensions folder: about 30 s on both cores here,
    once. Built here, in a child (importing DeepSpeed in this worker would change its torch), that
    half-minute is this fixture's, not the launched test's (tests/README.md: under 60 s a test).
    A second worker finds it built; torch's build lock serialises two that ask at once."""
    code = (
        "import deepspeed.ops\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
        "if b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME, False):\n"
        "    b.load()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(autouse=True, scope="session")
def _census_cache(tmp_path_factory):
    """The analytic evaluator's censuses kept in one folder for the session (its CLI subprocesses
    too), never the user's cache: each is run once per session (evaluators/census_cache.py).
    The xdist workers of one run share the folder (the run's common temporary root): a census is
    named by what it depends on and written whole by an atomic rename, so a worker reads another's
    or writes the same numbers again, and none runs a census another has run."""
    from autofit.evaluators import census_cache

    old = os.environ.get(census_cache.ENV_VAR)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "census"
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("census")
    os.environ[census_cache.ENV_VAR] = str(folder)
    yield
    if old is None:
        os.environ.pop(census_cache.ENV_VAR, None)
    else:
        os.environ[census_cache.ENV_VAR] = old


@pytest.fixture(autouse=True)
def _no_ambient_db(monkeypatch, tmp_path):
    """No test may touch the user's real database through $AUTOFIT_DB or the default path."""
    monkeypatch.delenv("AUTOFIT_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
