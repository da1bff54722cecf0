import os
import secrets

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

pytest_plugins = ("tests.showcase",)  # session-wide studies for the report, plot and progress tests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


@pytest.fixture(autouse=True, scope="session")
def _census_cache(tmp_path_factory):
    """The analytic evaluator's censuses kept in one folder for the session (its CLI subprocesses
    too), never the user's cache: each is run once per session (evaluators/census_cache.py)."""
    from autofit.evaluators import census_cache

    old = os.environ.get(census_cache.ENV_VAR)
    os.environ[census_cache.ENV_VAR] = str(tmp_path_factory.mktemp("census"))
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
