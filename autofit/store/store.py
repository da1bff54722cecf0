"""The Store: every study and trial autofit evaluates, in one SQL database.

SQLite by default (a file in the user's data directory), PostgreSQL for teams and
distributed search; Optuna keeps its own tables in the same database. Every operation
goes through :meth:`Store.session_scope`, which commits, rolls back and turns driver
errors into one :class:`~autofit.errors.StoreError` line that names the (masked) URL.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import secrets
import shlex
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import tenacity
from sqlalchemy import and_, case, create_engine, event, exists, func, or_, select
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session, aliased, sessionmaker
from sqlalchemy.pool import StaticPool

from autofit.errors import PlanError, StoreError
from autofit.results import EVALUATORS, Status, TrialResult, ranked_among
from autofit.specs import Target
from autofit.store import schema
from autofit.store.models import ANATOMY_COLUMNS, VERSION_TABLE, StudyModel, TrialModel, utcnow
from autofit.store.records import SchemaInfo, StudyRecord, StudyStatus, StudySummary, TrialRecord

if TYPE_CHECKING:
    import optuna

ENV_VAR = "AUTOFIT_DB"
SQLITE_BUSY_TIMEOUT_S = 30.0

# Packages whose versions decide what a study found (read from metadata, never imported).
_VERSIONED = (
    "autofit",
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "deepspeed",
    "bitsandbytes",
    "flash-attn",
    "optuna",
    "sqlalchemy",
    "alembic",
)

_URL_HELP = "use a file path, sqlite:///PATH or postgresql+psycopg://USER[:PASSWORD]@HOST[:PORT]/DB"


# -- URLs ---------------------------------------------------------------------------------
def default_path() -> str:
    """``$XDG_DATA_HOME/autofit/autofit.db``, else ``~/.local/share/autofit/autofit.db``."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "autofit", "autofit.db")


def _mask_raw(text: str) -> str:
    """Hide the password of a URL SQLAlchemy could not parse.

    Up to the last ``@`` before any query: a password may hold ``/`` or ``@`` unencoded, and
    hiding a little of the host is better than showing part of a password.
    """
    return re.sub(r"(://[^:/@?]*:)[^?]*@", r"\1***@", text)


def _url_problem(raw: str) -> str:
    """What is wrong with the host and port of a URL that does not parse, in words."""
    hostport = re.split(r"[/?]", raw.split("://", 1)[-1].rpartition("@")[2], maxsplit=1)[0]
    if hostport.startswith("[") and "]" not in hostport:
        return "its IPv6 host lacks the closing ']' (write USER@[::1]:5432/DB)"
    if hostport.count(":") > 1 and not hostport.startswith("["):
        return "an IPv6 host goes in brackets (write USER@[::1]:5432/DB)"
    port = hostport.rpartition("]")[2].partition(":")[2]
    if not port.isdigit():
        return f"its port {port!r} is not a number"
    return "it is malformed"


def _env_path_error(raw: str, path: str) -> StoreError:
    return StoreError(
        f"{ENV_VAR}={raw!r} names a relative path, so every directory would get its own database; "
        f"set {ENV_VAR} to an absolute path (e.g. {os.path.abspath(os.path.expanduser(path))}) or a "
        "postgresql+psycopg:// URL, or pass --db"
    )


def _is_memory(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def resolve_url(url: str | None = None) -> URL:
    """Explicit ``url`` > ``$AUTOFIT_DB`` > the default SQLite file; a bare path is a SQLite file.

    The directory of a SQLite file is created; a PostgreSQL URL without a driver gets psycopg 3.
    ``$AUTOFIT_DB`` is global (a shell profile, a container), so a SQLite path there must be
    absolute: a relative one would quietly create a new database in whatever directory a
    command runs from (``AUTOFIT_DB=garbage`` made a file named ``garbage``).
    """
    env = os.environ.get(ENV_VAR)
    from_env = not url and bool(env)
    raw = url or env or default_path()
    if "://" not in raw:
        if from_env and not os.path.isabs(os.path.expanduser(raw)):
            raise _env_path_error(raw, raw)
        raw = "sqlite:///" + os.path.abspath(os.path.expanduser(raw))
    try:
        parsed = make_url(raw)
    except ArgumentError:
        raise StoreError(f"cannot read database URL {_mask_raw(raw)!r}; {_URL_HELP}") from None
    except ValueError:  # SQLAlchemy's int() of a port it could not read
        raise StoreError(f"cannot read database URL {_mask_raw(raw)!r}: {_url_problem(raw)}; {_URL_HELP}") from None
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise StoreError(f"database URL {_masked(parsed)} has port {parsed.port}, outside 1-65535; {_URL_HELP}")
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    try:
        parsed.get_dialect()
    except NoSuchModuleError:
        raise StoreError(
            f"unknown database URL scheme {parsed.drivername!r} in {_masked(parsed)}; {_URL_HELP}"
        ) from None
    if parsed.get_backend_name() == "sqlite" and not _is_memory(parsed) and not parsed.query.get("uri"):
        if from_env and not os.path.isabs(os.path.expanduser(parsed.database)):
            raise _env_path_error(raw, parsed.database)
        path = os.path.abspath(os.path.expanduser(parsed.database))
        parsed = parsed.set(database=path)
        if os.path.isdir(path):
            raise StoreError(f"database path {path} is a directory; give a file path such as {path}/autofit.db")
        parent = os.path.dirname(path)
        blocker = next((p for p in _ancestors(parent) if os.path.exists(p) and not os.path.isdir(p)), None)
        if blocker:
            raise StoreError(f"cannot create the database directory {parent}: {blocker} is a file")
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the database directory {parent}: {exc.strerror or exc}") from None
    return parsed


def _ancestors(path: str) -> list[str]:
    out = [path]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out


def _masked(url: URL) -> str:
    return url.render_as_string(hide_password=True)


# How long a store call keeps retrying a database that went away (PostgreSQL restarting,
# a network blip) before it gives up with one clear error.
RETRY_TOTAL_S = float(os.environ.get("AUTOFIT_DB_RETRY_S", "30"))


def is_transient(exc: BaseException) -> bool:
    """A lost or refused connection, as opposed to a query the database rejects."""
    from sqlalchemy.exc import DBAPIError, OperationalError

    while exc is not None:
        if isinstance(exc, DBAPIError) and exc.connection_invalidated:
            return True
        module = type(exc.orig if isinstance(exc, DBAPIError) else exc).__module__
        if isinstance(exc, OperationalError) or type(exc).__name__ in ("OperationalError", "InterfaceError"):
            if "sqlite" in module:  # a local file does not go away; only lock contention passes
                return any(w in str(exc).lower() for w in ("locked", "busy"))
            return True
        exc = exc.__cause__
    return False


# The one backoff of autofit: 0.5 s, doubling up to 8 s, until RETRY_TOTAL_S seconds of waiting are
# spent. Store calls wait with it through tenacity (:func:`retrying`); the search's work loop, which
# meets its failures one at a time instead of wrapping one call, through :class:`Backoff`.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 8.0


def backoff_spent(state: tenacity.RetryCallState) -> bool:
    """Give up once :data:`RETRY_TOTAL_S` seconds of waiting are spent: tenacity's ``idle_for``
    counts the waits alone (its ``stop_after_delay`` would count the failed tries too)."""
    return state.idle_for >= RETRY_TOTAL_S


def _unreachable(state: tenacity.RetryCallState) -> NoReturn:
    """The one clear error of a store call whose retries are spent (``args[0]``: the store)."""
    exc = state.outcome.exception()
    raise StoreError(
        f"the database ({state.args[0].masked_url}) is unreachable after {state.idle_for:.0f} s of retries: "
        f"{str(exc).splitlines()[0][:200]}; what was stored is kept — resume with --resume"
    ) from exc


# tenacity re-raises at once what its retry test refuses (a query the database rejects);
# wait_exponential waits multiplier * 2 ** (attempt - 1), at most max
_RETRYING = tenacity.Retrying(
    retry=tenacity.retry_if_exception(lambda exc: isinstance(exc, (StoreError, SQLAlchemyError)) and is_transient(exc)),
    wait=tenacity.wait_exponential(multiplier=BACKOFF_FIRST_S, max=BACKOFF_MAX_S),
    stop=backoff_spent,
    retry_error_callback=_unreachable,
)


def retrying(fn):
    """Retry a whole store call (one transaction) on transient errors, with the backoff above."""
    return _RETRYING.wraps(fn)


class Backoff:
    """The backoff above for a loop that meets its failures one at a time (the search's work loop)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Start over (the database answered)."""
        self.delay, self.waited = BACKOFF_FIRST_S, 0.0

    def retry(self, exc: BaseException) -> bool:
        """Wait before the next try and say True, where ``exc`` is a transient error and time
        is left; say False at once where the caller should give up (and raise)."""
        if not is_transient(exc) or self.waited >= RETRY_TOTAL_S:
            return False
        time.sleep(self.delay)
        self.waited += self.delay
        self.delay = min(self.delay * 2, BACKOFF_MAX_S)
        return True


_LOCK_NAMESPACE = 0x4146  # "AF": advisory-lock namespace of autofit's study locks


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    """WAL lets readers run beside one writer; the busy timeout makes writers wait, not fail."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        _switch_to_wal(cursor)
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _switch_to_wal(cursor: Any) -> None:
    """``PRAGMA journal_mode=WAL``, waiting like any write where the database is busy.

    On a file not yet in WAL mode (a new one) the switch takes the write lock from inside
    the read transaction that reads the header; where another connection holds or wants
    that lock, SQLite answers SQLITE_BUSY at once instead of calling the busy handler (it
    would deadlock: sqlite.org/c3ref/busy_handler.html), so busy_timeout does not apply and
    two processes opening a new file at once failed one of them with "database is locked".
    The statement failed whole (its read transaction is gone), so trying again is safe; once
    the file is in WAL mode the pragma is a read and no longer contends.
    """
    import sqlite3

    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    delay = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = any(w in str(exc).lower() for w in ("locked", "busy"))
            if not busy or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


# -- request identity ---------------------------------------------------------------------
def _canonical_allowed(allowed: Mapping[str, Iterable[Any]] | None) -> dict[str, list[str]]:
    return {k: sorted({str(getattr(v, "value", v)) for v in values}) for k, values in sorted((allowed or {}).items())}


def request_key(ctx: Target, *, evaluator: str, allowed: Mapping[str, Iterable[Any]] | None = None) -> str:
    """The identity of a search request: equal keys would find the same answer.

    Model fingerprint (not its name), cluster, workload (the length histogram, not the
    file it came from), allowed choices (as sets), evaluator and headroom.
    """
    workload = ctx.workload.as_dict()
    if workload.get("lengths"):
        workload["lengths"] = {"histogram": workload["lengths"]["histogram"]}
    cluster = ctx.cluster.as_dict()
    cpu_memory = cluster.pop("cpu_memory_bytes", None)  # keys stay what they were before clusters stored it
    cluster.pop("host_memory_origin", None)  # where the host figure came from does not change the answer
    blob = {
        "model": ctx.model.fingerprint,
        "cluster": cluster,
        "workload": workload,
        "allowed": _canonical_allowed(allowed),
        "backend": evaluator,  # the key's first name, kept so stored request keys still match
        "headroom": round(float(ctx.headroom), 9),
    }
    if cpu_memory is not None:  # the CPU target's memory is the request's budget (--cpu-mem-budget)
        blob["cpu_memory_bytes"] = cpu_memory
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def software_versions() -> dict[str, str]:
    """Versions of what shaped a result, from package metadata (nothing is imported)."""
    versions = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def _json_safe(value: Any) -> Any:
    """JSON that every backend accepts: no NaN/inf (PostgreSQL's json rejects them), no objects."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(getattr(value, "value", value))


def _slug(text: str, limit: int = 40) -> str:
    """A piece of a generated study name: safe characters only, never leading with '.' or '-'."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", text)[:limit].strip("-.") or "study"


STUDY_NAME_MAX = 100
_STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


OUT_ROOT = "autofit-out"


def study_dir(rec) -> Path:
    """Where a command writes a study's files when ``--out`` is not given (``search``: the
    winner's configs and the report; ``export``; ``report``): ``autofit-out/NAME``, or
    ``autofit-out/study-ID`` where the stored name is not a safe path component. New names are
    checked when a study is created (:func:`check_study_name`), but a database written before
    that may hold any name, ``../../x`` included, and the default must never leave ``autofit-out``."""
    try:
        safe = check_study_name(rec.name) == rec.name
    except StoreError:
        safe = False
    return Path(OUT_ROOT) / (rec.name if safe else f"study-{int(rec.id)}")


def check_study_name(name: str) -> str:
    """``name`` stripped, or a StoreError saying what a name may hold.

    A name becomes a directory (:func:`study_dir`: ``autofit-out/NAME``) and a word
    in printed shell commands, so it is a safe path component: letters, digits, ``.``, ``_``,
    ``-``, not leading with ``.`` or ``-`` (no ``..``, no hidden files, no options), and not
    only digits (those look a study up by id).
    """
    name = name.strip()
    if _STUDY_NAME.fullmatch(name) and len(name) <= STUDY_NAME_MAX and not name.isdigit():
        return name
    hint = _slug(name, STUDY_NAME_MAX)
    example = f" such as {hint!r}" if _STUDY_NAME.fullmatch(hint) and not hint.isdigit() else ""
    raise StoreError(
        f"study name {name!r} is not allowed: use 1-{STUDY_NAME_MAX} letters, digits, '.', '_' or '-', "
        f"starting with a letter or digit and not only digits{example}"
    )


def _utc(t: datetime.datetime | None) -> datetime.datetime | None:
    """SQLite hands back naive datetimes; everything is stored in UTC."""
    if t is None:
        return None
    return t.replace(tzinfo=datetime.timezone.utc) if t.tzinfo is None else t.astimezone(datetime.timezone.utc)


# -- rows -> records ----------------------------------------------------------------------
def _study_record(row: StudyModel) -> StudyRecord:
    try:
        status = StudyStatus(row.status)
    except ValueError:
        raise StoreError(
            f"study {row.name!r} has status {row.status!r}, unknown to this autofit; upgrade autofit"
        ) from None
    return StudyRecord(
        id=row.id,
        name=row.name,
        model_name=row.model_name,
        model_fingerprint=row.model_fingerprint,
        model_spec=dict(row.model_spec),
        cluster=dict(row.cluster),
        cluster_label=row.cluster_label,
        gpu_name=row.gpu_name,
        workload=dict(row.workload),
        allowed={k: list(v) for k, v in (row.allowed or {}).items()},
        evaluator=row.evaluator,
        budget=dict(row.budget or {}),
        headroom=float(row.headroom),
        versions=dict(row.versions or {}),
        status=status,
        request_key=row.request_key,
        optuna_study_name=row.optuna_study_name,
        created_at=_utc(row.created_at),
        updated_at=_utc(row.updated_at),
        finished_at=_utc(row.finished_at),
    )


def _trial_record(row: TrialModel) -> TrialRecord:
    values = {c: getattr(row, c) for c in ANATOMY_COLUMNS}
    try:  # the row's columns in TrialResult.as_dict()'s shape
        result = TrialResult.from_dict(
            {
                "plan": row.plan,
                "status": row.status,
                "evaluator": row.evaluator,
                "memory": None if all(v is None for v in values.values()) else values,
                "throughput": row.throughput,
                "capacity_bytes": row.capacity_bytes,
                "reason": row.reason,
                "duration_s": row.duration_s,
                "extra": row.extra,
            }
        )
    except (PlanError, ValueError) as exc:
        raise StoreError(
            f"trial {row.number} of study {row.study_id} holds a result this autofit cannot read "
            f"({exc}); upgrade autofit"
        ) from None
    return TrialRecord.of(
        result,
        id=row.id,
        study_id=row.study_id,
        number=row.number,
        optuna_trial_id=row.optuna_trial_id,
        plan_id=row.plan_id,
        created_at=_utc(row.created_at),
    )


def _fidelity(column: Any) -> Any:
    """``autofit.results.fidelity`` in SQL: the evaluator's place in EVALUATORS, -1 for others."""
    return case({name: i for i, name in enumerate(EVALUATORS)}, value=column, else_=-1)


def _authoritative_fits() -> list[Any]:
    """``autofit.results.authoritative``'s choice as conditions on TrialModel: the row fits, has a
    speed, and is its plan's authoritative evaluation in its study — no more faithful
    evaluation of the plan exists, nor a later one (trial number, then id: the order of
    :meth:`Store.trials`) as faithful (a measured OOM overrides a predicted fit). The answer
    among them is :func:`_answer`'s (the tie rule needs each result's time error and plan)."""
    other = aliased(TrialModel)
    mine, theirs = _fidelity(TrialModel.evaluator), _fidelity(other.evaluator)
    later = or_(other.number > TrialModel.number, and_(other.number == TrialModel.number, other.id > TrialModel.id))
    superseded = exists().where(
        other.study_id == TrialModel.study_id,
        other.plan_id == TrialModel.plan_id,
        or_(theirs > mine, and_(theirs == mine, later)),
    )
    return [TrialModel.status == Status.FITS.value, TrialModel.tokens_per_sec.is_not(None), ~superseded]


def _answer_order() -> tuple[Any, ...]:
    """Fastest first; among equally fast rows, the plan evaluated first in its study (the
    (number, id) of its first row), as ``autofit.results.ranked`` orders equals; across
    studies, the older study first. The order :func:`_answer` reads the rows in."""
    first, same = aliased(TrialModel), aliased(TrialModel)
    first_number = (
        select(func.min(first.number))
        .where(first.study_id == TrialModel.study_id, first.plan_id == TrialModel.plan_id)
        .correlate(TrialModel)
        .scalar_subquery()
    )
    first_id = (
        select(func.min(same.id))
        .where(same.study_id == TrialModel.study_id, same.plan_id == TrialModel.plan_id, same.number == first_number)
        .correlate(TrialModel)
        .scalar_subquery()
    )
    return TrialModel.tokens_per_sec.desc(), TrialModel.study_id, first_number, first_id


class Store:
    """autofit's database. Opening it migrates a new database and refuses an outdated one.

    ``check_schema=False`` opens without either, for ``autofit db upgrade`` / ``current``.
    """

    script_location: str = schema.SCRIPT_LOCATION  # where the Alembic revisions live

    def __init__(self, url: str | None = None, *, check_schema: bool = True):
        self._url = resolve_url(url)
        self.url = self._url.render_as_string(hide_password=False)
        self.masked_url = _masked(self._url)
        self._engine = self._create_engine()
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._optuna: Any = None
        self._optuna_key: tuple = (None, None)
        if check_schema:
            try:
                self._check_schema()
            except BaseException:
                self.close()
                raise

    def _create_engine(self) -> Engine:
        kwargs: dict[str, Any] = {}
        sqlite = self.dialect == "sqlite"
        if _is_memory(self._url):  # one connection, or every connection is a new empty database
            kwargs.update(poolclass=StaticPool, connect_args={"check_same_thread": False})
        elif not sqlite:
            kwargs["pool_pre_ping"] = True
        try:
            engine = create_engine(self._url, **kwargs)
        except ImportError as exc:
            raise StoreError(
                f"the driver for {self._url.drivername} is not installed ({exc}); "
                "pip install 'autofit[postgres]' for PostgreSQL"
            ) from None
        if sqlite:
            event.listen(engine, "connect", _sqlite_on_connect)
        return engine

    @property
    def dialect(self) -> str:
        return self._url.get_backend_name()

    @property
    def engine(self) -> Engine:
        """For migration tooling and tests; library code goes through session_scope()."""
        return self._engine

    def close(self) -> None:
        if self._optuna is not None:
            self._optuna.remove_session()
            self._optuna.engine.dispose()
            self._optuna = None
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.masked_url!r})"

    # -- errors and sessions --------------------------------------------------------------
    def _error(self, exc: BaseException) -> StoreError:
        orig = getattr(exc, "orig", None) or exc
        lines = [ln.strip() for ln in str(orig).splitlines() if ln.strip() and not ln.startswith("(Background")]
        detail = "; ".join(lines) or type(orig).__name__
        password = str(self._url.password or "")
        if len(password) >= 4:  # drivers should not echo it; make sure (shorter would garble the text)
            detail = detail.replace(password, "***")
        return StoreError(f"database error ({self.masked_url}): {detail}")

    @contextmanager
    def session_scope(self) -> Iterator[Session]:
        """One unit of work: commit on success, roll back on error, StoreError for the database's."""
        session = self._sessions()
        try:
            yield session
            session.commit()
        except SQLAlchemyError as exc:
            _rollback(session)
            raise self._error(exc) from exc
        except BaseException:
            _rollback(session)
            raise
        finally:
            session.close()

    @contextmanager
    def _connection(self) -> Iterator[Connection]:
        try:
            with self._engine.connect() as conn:
                yield conn
        except SQLAlchemyError as exc:
            raise self._error(exc) from exc

    # -- schema ---------------------------------------------------------------------------
    @classmethod
    def head_revision(cls) -> str:
        return schema.head(cls.script_location)

    @classmethod
    def revisions(cls) -> list[str]:
        """Every schema revision this autofit knows, oldest first."""
        return schema.revisions(cls.script_location)

    def current_revision(self) -> str | None:
        """The database's schema revision; None where autofit has not created its tables yet."""
        with self._connection() as conn:
            return schema.current(conn)

    def schema_info(self) -> SchemaInfo:
        current = self.current_revision()
        return SchemaInfo(
            self.masked_url, current, self.head_revision(), current is None or current in self.revisions()
        )

    def _newer_error(self, current: str) -> StoreError:
        version = software_versions().get("autofit", "?")
        return StoreError(
            f"database {self.masked_url} has schema revision {current}, unknown to this autofit ({version}): "
            "a newer autofit wrote it; upgrade autofit (pip install -U autofit) or use another --db"
        )

    def _check_schema(self) -> None:
        info = self.schema_info()
        if info.current is None:
            with self._connection() as conn:
                tables = schema.autofit_tables(conn)
            if not tables:
                self.upgrade()  # a new database: created at head, under the migration lock
                return
            # another process may have committed its migration since we read the revision
            info = self.schema_info()
            if info.current is None:
                raise StoreError(
                    f"database {self.masked_url} has autofit tables ({', '.join(tables)}) but no revision in "
                    f"{VERSION_TABLE}; it was not created by autofit's migrations"
                )
        if info.up_to_date:
            return
        if not info.known:
            raise self._newer_error(info.current)
        raise StoreError(
            f"database {self.masked_url} has schema revision {info.current}, older than this autofit's "
            f"{info.head}; run `autofit db upgrade --db {shlex.quote(self.masked_url)}`"
        )

    def upgrade(self, target: str = "head") -> tuple[str | None, str | None]:
        """Migrate to ``target`` (a new database is created); returns (before, after) revisions."""
        from alembic.util import CommandError

        before = self.current_revision()
        if before is not None and before not in self.revisions():
            raise self._newer_error(before)
        if before is None:
            self._refuse_foreign()
        try:
            with self._connection() as conn:
                try:
                    schema.upgrade(conn, target, self.script_location)
                    conn.commit()
                except BaseException:
                    conn.rollback()
                    raise
                finally:
                    if self.dialect == "sqlite":
                        conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                        conn.commit()
        except CommandError as exc:
            raise StoreError(f"cannot migrate {self.masked_url} to {target}: {exc}") from None
        return before, self.current_revision()

    def _refuse_foreign(self) -> None:
        """Refuse to create autofit's (and Optuna's) tables in another application's database.

        Applies to PostgreSQL as well: Optuna's tables are unprefixed (``studies``,
        ``trials``, ``alembic_version``) and would mix with, or clash with, the other
        application's in the same schema, and a team creates a dedicated database at the
        cost of one ``createdb``. A database with only Optuna's tables is accepted (autofit
        shares it by design), and so is one that already holds autofit's tables.
        """
        with self._connection() as conn:
            if schema.autofit_tables(conn):
                return
            foreign = schema.foreign_tables(conn)
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            fix = (
                "a new file (--db NEW.db)"
                if self.dialect == "sqlite"
                else "an empty database (createdb autofit; --db .../autofit)"
            )
            raise StoreError(
                f"database {self.masked_url} holds another application's tables ({shown}) and none of autofit's; "
                f"autofit will not add its tables to it: give {fix}"
            )

    def schema_diff(self) -> list[Any]:
        """Differences between the ORM classes and this database's autofit tables."""
        with self._connection() as conn:
            return schema.diff(conn)

    # -- Optuna ---------------------------------------------------------------------------
    def optuna_storage(
        self, heartbeat_interval: int | None = None, grace_period: int | None = None
    ) -> optuna.storages.RDBStorage:
        """Optuna's RDB storage on this database; its tables sit beside autofit's.

        With ``heartbeat_interval`` each running trial pings the database, and a trial
        whose worker died is marked failed after ``grace_period`` seconds (workers).
        """
        key = (heartbeat_interval, grace_period)
        if self._optuna is None or self._optuna_key != key:
            if _is_memory(self._url):
                raise StoreError("an in-memory SQLite database cannot be shared with Optuna; use a file (--db PATH)")
            import optuna

            if self._optuna is not None:
                self._optuna.engine.dispose()
            kwargs: dict[str, Any] = (
                {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}}
                if self.dialect == "sqlite"
                else {"pool_pre_ping": True}
            )
            try:
                # Optuna creates its tables on first use; two processes doing so at once race
                # on its version row, so the creation is serialized like our migrations
                with self._lock("optuna-init", 0), warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeat args
                    self._optuna = optuna.storages.RDBStorage(
                        self.url,
                        engine_kwargs=kwargs,
                        heartbeat_interval=heartbeat_interval,
                        grace_period=grace_period,
                    )
            except SQLAlchemyError as exc:
                raise self._error(exc) from exc
            self._optuna_key = key
        return self._optuna

    @contextmanager
    def study_lock(self, study_id: int) -> Iterator[None]:
        """A lock every worker of a study takes to claim its next trial (check budget, ask).

        PostgreSQL: a session advisory lock (any host). SQLite: an ``flock`` on a file
        beside the database (one machine) — SQLite's own write lock cannot serve, since
        Optuna writes the new trial through another connection while we would hold it.
        """
        with self._lock(f"study-{int(study_id)}", int(study_id)):
            yield

    @contextmanager
    def _lock(self, name: str, key: int) -> Iterator[None]:
        if self.dialect == "postgresql":
            with self.engine.connect() as conn:
                conn.exec_driver_sql(f"SELECT pg_advisory_lock({_LOCK_NAMESPACE}, {int(key)})")
                try:
                    yield
                finally:
                    conn.exec_driver_sql(f"SELECT pg_advisory_unlock({_LOCK_NAMESPACE}, {int(key)})")
            return
        from filelock import FileLock

        # filelock: an flock on Unix (a waiter retries every 50 ms); the file stays beside the database
        with FileLock(f"{self._url.database}.{name}.lock"):
            yield

    # -- studies --------------------------------------------------------------------------
    @retrying
    def create_study(
        self,
        ctx: Target,
        *,
        evaluator: str,
        allowed: Mapping[str, Iterable[Any]] | None = None,
        budget: Mapping[str, Any] | None = None,
        name: str | None = None,
        optuna_study_name: str | None = None,
    ) -> StudyRecord:
        """Record a new running study for the request ``ctx`` (+ evaluator and allowed choices).

        ``evaluator`` should be the resolved one (``analytic``, not ``auto``), so that
        ``request_key`` matches what was really run.
        """
        if name is not None:
            name = check_study_name(name)
        key = request_key(ctx, evaluator=evaluator, allowed=allowed)
        with self.session_scope() as s:
            if name is None:
                stem = f"{_slug(ctx.model.name)}-{_slug(ctx.cluster.label)}"
                name = f"{stem}-{secrets.token_hex(3)}"
                while StudyModel.find_by_name(s, name) is not None:
                    name = f"{stem}-{secrets.token_hex(3)}"
            elif StudyModel.find_by_name(s, name) is not None:
                raise StoreError(f"a study named {name!r} already exists; choose another name")
            now = utcnow()
            row = StudyModel(
                name=name,
                model_name=ctx.model.name,
                model_fingerprint=ctx.model.fingerprint,
                model_spec=_json_safe(ctx.model.as_dict()),
                cluster=_json_safe(ctx.cluster.as_dict()),
                cluster_label=ctx.cluster.label,
                gpu_name=ctx.cluster.gpu.name,
                workload=_json_safe(ctx.workload.as_dict()),
                seq_len=ctx.workload.seq_len,
                global_batch=ctx.workload.global_batch,
                allowed=_canonical_allowed(allowed),
                evaluator=evaluator,
                budget=_json_safe(dict(budget or {})),
                headroom=float(ctx.headroom),
                versions=software_versions(),
                status=StudyStatus.RUNNING.value,
                request_key=key,
                optuna_study_name=optuna_study_name,
                created_at=now,
                updated_at=now,
            )
            s.add(row)
            s.flush()
            return _study_record(row)

    def _study_row(self, s: Session, study_id: int) -> StudyModel:
        row = StudyModel.find(s, study_id)
        if row is None:
            raise StoreError(f"no study with id {study_id}; see `autofit history`")
        return row

    def _set_status(self, study_id: int, status: StudyStatus) -> StudyRecord:
        with self.session_scope() as s:
            row = self._study_row(s, study_id)
            now = utcnow()
            row.status = status.value
            row.updated_at = now
            row.finished_at = None if status is StudyStatus.RUNNING else now
            s.flush()
            return _study_record(row)

    @retrying
    def finish_study(self, study_id: int, status: StudyStatus | str = StudyStatus.FINISHED) -> StudyRecord:
        """Close a study as finished, interrupted or failed."""
        status = StudyStatus(status)
        if status is StudyStatus.RUNNING:
            raise ValueError("finish_study takes finished, interrupted or failed; use resume_study to reopen")
        return self._set_status(study_id, status)

    @retrying
    def resume_study(self, study_id: int) -> StudyRecord:
        """Mark a study running again (``autofit search --resume``)."""
        return self._set_status(study_id, StudyStatus.RUNNING)

    @retrying
    def get_study(self, name_or_id: str | int) -> StudyRecord:
        with self.session_scope() as s:
            if isinstance(name_or_id, int):
                row = StudyModel.find(s, name_or_id)
            else:
                row = StudyModel.find_by_name(s, name_or_id)
                if row is None and name_or_id.strip().isdigit():
                    row = StudyModel.find(s, int(name_or_id))
            if row is None:
                what = f"with id {name_or_id}" if isinstance(name_or_id, int) else f"named {name_or_id!r}"
                raise StoreError(f"no study {what}; see `autofit history`")
            return _study_record(row)

    @retrying
    def find_finished_study(self, request_key: str) -> StudyRecord | None:
        """The latest finished study of an identical request, to answer from the store."""
        with self.session_scope() as s:
            row = s.scalars(
                select(StudyModel)
                .where(StudyModel.request_key == request_key, StudyModel.status == StudyStatus.FINISHED.value)
                .order_by(StudyModel.finished_at.desc(), StudyModel.id.desc())
                .limit(1)
            ).one_or_none()
            return _study_record(row) if row is not None else None

    @retrying
    def find_resumable_study(self, request_key: str) -> StudyRecord | None:
        """The latest interrupted, failed (stopped by an error) or abandoned running study of
        an identical request."""
        with self.session_scope() as s:
            row = s.scalars(
                select(StudyModel)
                .where(
                    StudyModel.request_key == request_key,
                    StudyModel.status.in_(
                        [StudyStatus.INTERRUPTED.value, StudyStatus.FAILED.value, StudyStatus.RUNNING.value]
                    ),
                )
                .order_by(StudyModel.updated_at.desc(), StudyModel.id.desc())
                .limit(1)
            ).one_or_none()
            return _study_record(row) if row is not None else None

    @retrying
    def list_studies(self, model: str | None = None, gpu: str | None = None) -> list[StudySummary]:
        """Studies, newest first, each with its best fitting trial and per-status counts.

        ``model`` matches the model name (any case) or fingerprint; ``gpu`` the GPU name or
        the cluster label (``A10`` or ``2xA10``).
        """
        query = select(StudyModel)
        if model:
            query = query.where(
                or_(func.lower(StudyModel.model_name) == model.lower(), StudyModel.model_fingerprint == model)
            )
        if gpu:
            query = query.where(
                or_(func.lower(StudyModel.gpu_name) == gpu.lower(), func.lower(StudyModel.cluster_label) == gpu.lower())
            )
        with self.session_scope() as s:
            studies = s.scalars(query.order_by(StudyModel.created_at.desc(), StudyModel.id.desc())).all()
            ids = query.with_only_columns(StudyModel.id).scalar_subquery()
            counts: dict[int, dict[str, int]] = {}
            for study_id, status, n in s.execute(
                select(TrialModel.study_id, TrialModel.status, func.count())
                .where(TrialModel.study_id.in_(ids))
                .group_by(TrialModel.study_id, TrialModel.status)
            ):
                counts.setdefault(study_id, {})[status] = n
            fits: dict[int, list[TrialModel]] = {}
            query = select(TrialModel).where(TrialModel.study_id.in_(ids), *_authoritative_fits())
            for row in s.scalars(query.order_by(*_answer_order())):
                fits.setdefault(row.study_id, []).append(row)
            best = {study_id: _answer(rows) for study_id, rows in fits.items()}
            return [StudySummary(_study_record(r), best.get(r.id), counts.get(r.id, {})) for r in studies]

    # -- trials ---------------------------------------------------------------------------
    @retrying
    def record_trial(
        self,
        study_id: int,
        result: TrialResult,
        number: int | None = None,
        optuna_trial_id: int | None = None,
    ) -> TrialRecord:
        """Store one evaluation. ``number`` defaults to the study's next trial number."""
        memory = result.memory.as_dict() if result.memory else {}
        tp = result.throughput
        with self.session_scope() as s:
            study = self._study_row(s, study_id)
            if number is None:
                last = s.scalar(select(func.max(TrialModel.number)).where(TrialModel.study_id == study_id))
                number = 0 if last is None else last + 1
            row = TrialModel(
                study_id=study_id,
                number=number,
                optuna_trial_id=optuna_trial_id,
                plan=result.plan.as_dict(),
                plan_id=result.plan.plan_id,
                status=Status(result.status).value,
                evaluator=result.evaluator,
                **{c: memory.get(c) for c in ANATOMY_COLUMNS},
                tokens_per_sec=tp.tokens_per_sec if tp else None,
                step_time_s=tp.step_time_s if tp else None,
                throughput=_json_safe(tp.as_dict()) if tp else None,
                capacity_bytes=int(result.capacity_bytes or 0),
                reason=result.reason or "",
                extra=_json_safe(dict(result.extra or {})),
                duration_s=float(result.duration_s or 0.0),
                created_at=utcnow(),
            )
            s.add(row)
            study.updated_at = row.created_at
            s.flush()
            return _trial_record(row)

    @retrying
    def trials(self, study_id: int) -> list[TrialRecord]:
        """Every evaluation of a study, in trial-number order."""
        with self.session_scope() as s:
            self._study_row(s, study_id)
            rows = s.scalars(
                select(TrialModel).where(TrialModel.study_id == study_id).order_by(TrialModel.number, TrialModel.id)
            ).all()
            return [_trial_record(r) for r in rows]

    @retrying
    def measured_trials(self, gpu_name: str) -> list[TrialRecord]:
        """Every fitting measured trial on a GPU type, across studies (calibration's pairs)."""
        with self.session_scope() as s:
            rows = s.scalars(
                select(TrialModel)
                .join(StudyModel, TrialModel.study_id == StudyModel.id)
                .where(
                    TrialModel.evaluator == "measured",
                    TrialModel.status == Status.FITS.value,
                    func.lower(StudyModel.gpu_name) == gpu_name.lower(),
                )
                .order_by(TrialModel.id)
            ).all()
            return [_trial_record(r) for r in rows]

    @retrying
    def best_trial(
        self,
        model_fingerprint: str,
        cluster_label: str,
        seq_len: int | None = None,
        global_batch: int | None = None,
        headroom: float | None = None,
    ) -> TrialRecord | None:
        """The fastest stored plan that fits, across studies of this model on this cluster.

        With ``headroom``, only plans whose ``device_total`` leaves that much of the GPU free.
        """
        query = (
            select(TrialModel)
            .join(StudyModel, StudyModel.id == TrialModel.study_id)
            .where(
                StudyModel.model_fingerprint == model_fingerprint,
                StudyModel.cluster_label == cluster_label,
                *_authoritative_fits(),
            )
        )
        if seq_len is not None:
            query = query.where(StudyModel.seq_len == seq_len)
        if global_batch is not None:
            query = query.where(StudyModel.global_batch == global_batch)
        if headroom is not None:
            query = query.where(TrialModel.device_total <= TrialModel.capacity_bytes * (1.0 - headroom))
        with self.session_scope() as s:
            return _answer(s.scalars(query.order_by(*_answer_order())).all())

    @staticmethod
    def trial_result(record: TrialRecord) -> TrialResult:
        return record.result()


def _answer(rows: Iterable[TrialModel]) -> TrialRecord | None:
    """The answer among authoritative fitting rows in :func:`_answer_order` (one study's, or
    several studies' for :meth:`Store.best_trial`): ``autofit.results.ranked_among``'s first."""
    records = [_trial_record(row) for row in rows]
    results = [r.result() for r in records]
    best = ranked_among(results)
    return next(rec for rec, r in zip(records, results) if r is best[0]) if best else None


def _rollback(session: Session) -> None:
    try:
        session.rollback()
    except SQLAlchemyError:
        pass  # the connection is gone; the original error is the one to report
