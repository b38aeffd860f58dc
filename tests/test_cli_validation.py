"""``s3capture demo`` checks every option and input before anything starts.

Each bad option or input must end the command with exit status 2 and exactly one line on stderr,
``s3capture demo: error: ...``, before any S3 server, bucket request or worker process starts: the
in-process runs below replace ``start_moto``, ``_ensure_bucket`` and ``run_workload`` with guards
that fail the test when reached, and a few runs of the real command in a subprocess show the same
line and status from the installed entry point. The last tests show that a worker which cannot
start (here: an endpoint nothing listens on) ends the run within seconds with its one-line error;
before, every call failed after botocore's retries, one rollout at a time, for minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_demo import example_file

import s3capture.cli as cli
import s3capture.cli.demo as cli_demo
import s3capture.demo as demo
import s3capture.localserver as localserver
from s3capture.cli import main

REPO = Path(__file__).resolve().parents[1]

ROLLOUT = (
    '{"responses_create_params": {"input": "hi"}, "response": {"output": ['
    '{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]}]}}'
)
NO_MODEL_CALL = '{"responses_create_params": {"input": "hi"}, "response": {"output": []}}'


class _Reached(Exception):
    """Raised by the guards: validation let the command get as far as ``where``."""

    def __init__(self, where: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(where)
        self.where, self.args_, self.kwargs = where, args, kwargs


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AWS settings from the caller's environment, and a guard on everything that starts something."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)

    def guard(where: str) -> Any:
        def reached(*args: Any, **kwargs: Any) -> Any:
            raise _Reached(where, *args, **kwargs)

        return reached

    monkeypatch.setattr(localserver, "start_moto", guard("start_moto"))
    monkeypatch.setattr(cli_demo, "_ensure_bucket", guard("_ensure_bucket"))  # the module whose commands read it
    monkeypatch.setattr(demo, "run_workload", guard("run_workload"))


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``s3capture demo <argv>``; assert exit 2, nothing on stdout, one error line; return it."""
    try:
        status = main(["demo", "--no-progress", *argv])
    except _Reached as reached:
        pytest.fail(f"{argv}: validation let the command reach {reached.where}")
    out, err = capsys.readouterr()
    assert status == 2, (argv, status, out, err)
    assert out == "", out
    lines = err.splitlines()
    assert len(lines) == 1, f"{argv}: expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("s3capture demo: error: "), lines[0]
    return lines[0]


# Every numeric option, out of range or not a number.
NUMERIC = [
    (["--workers", "0"], "argument --workers: must be from 1 to 256, got 0"),
    (["--workers", "-3"], "argument --workers: must be from 1 to 256, got -3"),
    (["--workers", "257"], "argument --workers: must be from 1 to 256, got 257"),
    (["--workers", "four"], "argument --workers: expected an integer from 1 to 256, got 'four'"),
    (["--concurrency", "0"], "argument --concurrency: must be from 1 to 1024, got 0"),
    (["--concurrency", "1025"], "argument --concurrency: must be from 1 to 1024, got 1025"),
    (["--parallel-rollouts", "0"], "argument --parallel-rollouts: must be from 1 to 100000, got 0"),
    (["--parallel-rollouts", "1e3"], "argument --parallel-rollouts: expected an integer"),
    (["--rollouts", "0"], "argument --rollouts: must be from 1 to 1000000, got 0"),
    (["--rollouts", "2.5"], "argument --rollouts: expected an integer"),
    (["--calls", "0"], "argument --calls: must be from 1 to 10000, got 0"),
    (["--calls", "10001"], "argument --calls: must be from 1 to 10000, got 10001"),
    (["--calls", "2000"], "--rollouts 40 --calls 2000 would generate 3,845,760,000 token ids"),
    (["--rollouts", "1000000"], "--rollouts 1000000 --calls 6 would generate 1,296,000,000 token ids"),
    (["--seed", "-1"], "argument --seed: must be from 0 to"),
    (["--seed", "x"], "argument --seed: expected an integer"),
]

# Every URL option: --url and --staging-url are s3://bucket[/prefix], --endpoint http(s)://host[:port].
URLS = [
    (["--url", "http://example.com/x"], "argument --url: expected s3://bucket[/prefix], got 'http://example.com/x'"),
    (["--url", "s3://"], "argument --url: no bucket in 's3://'"),
    (["--url", "s3:///prefix"], "argument --url: no bucket in 's3:///prefix'"),
    (["--url", "bucket/prefix"], "argument --url: expected s3://bucket[/prefix]"),
    (["--url", ""], "argument --url: expected s3://bucket[/prefix]"),
    (["--url", "s3://ab/x"], "argument --url: 'ab' in 's3://ab/x' is not a bucket name"),
    (["--url", "s3://my bucket/x"], "argument --url: 'my bucket' in 's3://my bucket/x' is not a bucket name"),
    (["--url", "s3://minio:9000/bkt"], "the endpoint goes in --endpoint"),
    (["--url", "s3://bkt/x?versionId=1"], "argument --url: an s3:// URL takes no query or fragment"),
    (["--capture", "ledger", "--staging-url", "s3://"], "argument --staging-url: no bucket in 's3://'"),
    (["--capture", "ledger", "--staging-url", "http://x/y"], "argument --staging-url: expected s3://bucket[/prefix]"),
    (["--capture", "ledger", "--staging-url", "s3://-bad-/y"], "argument --staging-url: '-bad-' in"),
    (
        ["--endpoint", "localhost:9000"],
        "argument --endpoint: the endpoint 'localhost:9000' is not http://HOST[:PORT] or https://HOST[:PORT] (the scheme is required)",
    ),
    (["--endpoint", "ftp://host"], "argument --endpoint: the endpoint 'ftp://host' is not http://HOST[:PORT]"),
    (
        ["--endpoint", "http://"],
        "argument --endpoint: the endpoint 'http://' is not http://HOST[:PORT] or https://HOST[:PORT] (it names no host)",
    ),
    (["--endpoint", "s3://bkt"], "argument --endpoint: the endpoint 's3://bkt' is not http://HOST[:PORT]"),
    (["--endpoint", "http://host:0"], "argument --endpoint: the endpoint 'http://host:0' has a bad port"),
    (["--endpoint", "http://host:99999"], "argument --endpoint: the endpoint 'http://host:99999' has a bad port"),
    (["--endpoint", "http://host:port"], "argument --endpoint: the endpoint 'http://host:port' has a bad port"),
    (
        ["--endpoint", "http://key:secret@host"],
        "argument --endpoint: the endpoint 'http://key:secret@host' takes no user name or password",
    ),
    (
        ["--endpoint", "http://host:9000/bkt"],
        "argument --endpoint: the endpoint 'http://host:9000/bkt' has a path ('/bkt'): give the server's address only, http://host:9000",
    ),
    (
        ["--endpoint", "https://host/?x=1"],
        "argument --endpoint: the endpoint 'https://host/?x=1' takes no query or fragment",
    ),
]

# --capture, --prompt-storage and the options that belong to one mode only.
MODES = [
    (["--capture", "tokens"], "argument --capture: invalid choice: 'tokens' (choose from 'store', 'ledger')"),
    (["--prompt-storage", "zip"], "argument --prompt-storage: invalid choice: 'zip' (choose from 'delta', 'full')"),
    (["--capture", "ledger", "--prompt-storage", "full"], "--prompt-storage applies only with --capture store"),
    (["--capture", "ledger", "--prompt-storage", "delta"], "--prompt-storage applies only with --capture store"),
    (["--staging-url", "s3://bkt/staging"], "--staging-url applies only with --capture ledger"),
    (["--capture", "store", "--staging-url", "s3://bkt/staging"], "--staging-url applies only with --capture ledger"),
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    # No abbreviations: "--roll 3" would otherwise run as --rollouts 3, and a typo could pass.
    (["--roll", "3"], "unrecognized arguments: --roll"),
    # The embedded server stops with the demo: what --keep kept would be gone with it.
    (["--keep"], "--keep needs --url or --endpoint"),
]


@pytest.mark.parametrize(
    ("argv", "message"), NUMERIC + URLS + MODES, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_bad_option_is_one_line_and_exit_2(
    guarded: None, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
):
    line = _one_line_error(argv, capsys)
    assert message in line, line


@pytest.mark.parametrize(("rollouts", "calls"), [(1, 1), (3, 2), (2, 17)])
def test_generated_size_is_what_synthetic_rollouts_makes(rollouts: int, calls: int):
    from s3capture.replay import synthetic_rollouts

    made = synthetic_rollouts(rollouts, calls)
    tokens = sum(len(c.prompt_token_ids) + len(c.generation_token_ids) for r in made for c in r.calls)
    assert cli.generated_tokens(rollouts, calls) == tokens


@pytest.mark.parametrize("capture", ["store", "ledger"])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "0"], "--workers"),
        (["--concurrency", "0"], "--concurrency"),
        (["--parallel-rollouts", "0"], "--parallel-rollouts"),
        (["--rollouts", "0"], "--rollouts"),
        (["--url", "s3://"], "--url"),
    ],
)
def test_each_capture_mode_checks_the_options(
    guarded: None, capsys: pytest.CaptureFixture[str], capture: str, argv: list[str], message: str
):
    line = _one_line_error(["--capture", capture, *argv], capsys)
    assert f"argument {message}: " in line, line


@pytest.mark.parametrize(("name", "value"), [("AWS_ENDPOINT_URL", "minio:9000"), ("AWS_ENDPOINT_URL_S3", "http://")])
def test_endpoint_from_the_environment_is_checked(
    guarded: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str
):
    monkeypatch.setenv(name, value)
    line = _one_line_error(["--url", "s3://bkt/x"], capsys)
    assert line.startswith(f"s3capture demo: error: {name} {value!r} is not http://HOST[:PORT]"), line


# ------------------------------------------------------------------------------------ input files
def _inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Bad inputs, each with the text its error line must contain."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\n")
    no_calls = tmp_path / "no_calls.jsonl"
    no_calls.write_text(NO_MODEL_CALL + "\n" + NO_MODEL_CALL + "\n")
    good = tmp_path / "good.jsonl"
    good.write_text(ROLLOUT + "\n")
    not_json = tmp_path / "notes.jsonl"
    not_json.write_text("these are notes\n")
    not_a_rollout = tmp_path / "list.jsonl"
    not_a_rollout.write_text("[1, 2]\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "readme.txt").write_text(ROLLOUT + "\n")
    (folder / "sub.jsonl").mkdir()  # a folder named like a file does not count
    folder_with_empty = tmp_path / "mixed"
    folder_with_empty.mkdir()
    (folder_with_empty / "a.jsonl").write_text(ROLLOUT + "\n")
    (folder_with_empty / "b.jsonl").write_text("")
    return {
        "missing": ([str(tmp_path / "nope.jsonl")], f"input {tmp_path / 'nope.jsonl'}: no such file or folder"),
        "empty file": ([str(empty)], f"input {empty}: no usable rollout (no rollout)"),
        "blank lines only": ([str(blank)], f"input {blank}: no usable rollout (no rollout)"),
        "no model call": ([str(no_calls)], f"input {no_calls}: no usable rollout (2 rollouts, none with a model call)"),
        "empty beside a good one": ([str(good), str(empty)], f"input {empty}: no usable rollout"),
        "not JSON": ([str(not_json)], "notes.jsonl:1: invalid JSON"),
        "not a rollout": ([str(not_a_rollout)], "list.jsonl:1: a rollout line must be a JSON object"),
        "folder without .jsonl": ([str(folder)], f"input folder {folder} contains no .jsonl file"),
        "empty file in a folder": (
            [str(folder_with_empty)],
            f"input {folder_with_empty / 'b.jsonl'}: no usable rollout",
        ),
        "not a file": ([os.devnull], f"input {os.devnull} is neither a regular file nor a folder"),
        "same file twice": ([str(good), str(good)], "duplicate rollout id 'good-L1'"),
        "--rollouts with files": (["--rollouts", "3", str(good)], "--rollouts sizes the generated workload"),
        "--calls with files": ([str(good), "--calls", "3"], "--calls sizes the generated workload"),
    }


INPUT_CASES = [
    "missing",
    "empty file",
    "blank lines only",
    "no model call",
    "empty beside a good one",
    "not JSON",
    "not a rollout",
    "folder without .jsonl",
    "empty file in a folder",
    "not a file",
    "same file twice",
    "--rollouts with files",
    "--calls with files",
]


@pytest.mark.parametrize("capture", ["store", "ledger"])
@pytest.mark.parametrize("case", INPUT_CASES)
def test_bad_input_is_one_line_and_exit_2(
    guarded: None, capsys: pytest.CaptureFixture[str], tmp_path: Path, capture: str, case: str
):
    argv, message = _inputs(tmp_path)[case]
    line = _one_line_error(["--capture", capture, *argv], capsys)
    assert message in line, line


def _unreadable_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret.jsonl"
    path.write_text(ROLLOUT + "\n")
    path.chmod(0)
    try:
        path.open("rb").close()
    except PermissionError:
        return path
    # Root reads files whatever their mode; a write-only sysctl is a regular file root cannot read.
    sysctl = Path("/proc/sys/vm/compact_memory")
    try:
        sysctl.open("rb").close()
    except PermissionError:
        return sysctl
    except OSError:
        pass
    pytest.skip("no file this user cannot read")


def test_unreadable_input_is_one_line_and_exit_2(guarded: None, capsys: pytest.CaptureFixture[str], tmp_path: Path):
    path = _unreadable_file(tmp_path)
    line = _one_line_error([str(path)], capsys)
    assert f"input {path}: cannot read it: Permission denied" in line, line


def test_valid_options_and_inputs_reach_the_workload(guarded: None, tmp_path: Path):
    """The checks refuse nothing valid: files and folders load, options arrive as given."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text(ROLLOUT + "\n" + NO_MODEL_CALL + "\n" + ROLLOUT + "\n")
    (folder / "notes.txt").write_text("ignored")
    single = tmp_path / "b.jsonl"
    single.write_text("\n" + ROLLOUT + "\n")
    with pytest.raises(_Reached) as reached:
        main(
            [
                "demo",
                "--no-progress",
                "--capture",
                "ledger",
                "--url",
                "s3://bkt/run",
                "--staging-url",
                "s3://other_bucket.x/stage",
                "--endpoint",
                "https://minio.example:9000/",
                "--workers",
                "256",
                "--concurrency",
                "1",
                "--parallel-rollouts",
                "1",
                "--seed",
                "7",
                str(folder),
                str(single),
            ]
        )
    assert reached.value.where == "run_workload"
    rollouts, url, env = reached.value.args_
    assert [r.rollout_id.split("@")[0] for r in rollouts] == ["a-L1", "a-L2", "a-L3", "b-L2"]
    assert [len(r.calls) for r in rollouts] == [1, 0, 1, 1]
    assert url == "s3://bkt/run"
    assert env == {
        "AWS_ENDPOINT_URL": "https://minio.example:9000/",
        "AWS_ENDPOINT_URL_S3": "https://minio.example:9000/",
    }
    assert isinstance(reached.value.kwargs.pop("wall_started"), float)  # the command's start, for the total wall time
    assert reached.value.kwargs == dict(
        workers=256,
        concurrency=1,
        parallel_rollouts=1,
        delta=True,
        seed=7,
        progress=False,
        capture="ledger",
        staging_url="s3://other_bucket.x/stage",
        export_dest=None,
        keep=False,
    )


def test_generated_workload_defaults(guarded: None, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with pytest.raises(_Reached) as reached:
        main(["demo", "--url", "s3://bkt/run"])
    rollouts, url, env = reached.value.args_
    assert len(rollouts) == 40 and {len(r.calls) for r in rollouts} == {6}
    assert env == {} and reached.value.kwargs["delta"] is True and reached.value.kwargs["capture"] == "store"


def test_the_example_folder_is_valid_input(guarded: None):
    """The shared example folder: its three .jsonl files load; vllm_round_trip.json is not a .jsonl file."""
    folder = example_file("vllm_round_trip.json").parent
    with pytest.raises(_Reached) as reached:
        main(["demo", "--url", "s3://bkt/run", "--endpoint", "http://127.0.0.1:9", str(folder)])
    sources = {r.source.split(":")[0] for r in reached.value.args_[0]}
    assert sources == {"anyterminal_hermes.jsonl", "competitive_coding.jsonl", "hermes_math.jsonl"}


# ------------------------------------------------------------------------- the installed command
def _command(*args: str, timeout: float = 60, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    base["PYTHONPATH"] = str(REPO / "src") + os.pathsep + base.get("PYTHONPATH", "")
    base["AWS_CONFIG_FILE"] = base["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "s3capture.cli", "demo", "--no-progress", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - started


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "0"], "argument --workers: must be from 1 to 256, got 0"),
        (["--url", "s3://"], "argument --url: no bucket in 's3://'"),
        (["--capture", "ledger", "--parallel-rollouts", "0"], "argument --parallel-rollouts: must be from 1 to 100000"),
        ([os.devnull], "is neither a regular file nor a folder"),
    ],
)
def test_command_prints_one_line_and_exits_2(argv: list[str], message: str):
    proc, seconds = _command(*argv)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("s3capture demo: error: ") and message in proc.stderr, proc.stderr
    assert seconds < 30, f"{seconds:.1f} s: something started before the check"


@pytest.mark.parametrize("capture", ["store", "ledger"])
def test_worker_that_cannot_start_ends_the_run_at_once(capture: str):
    """Nothing listens on 127.0.0.1:1: every worker fails its start-up probe, and the first failure ends the run.

    Before, each worker started, and every rollout's first call failed after botocore's five attempts;
    with one rollout in flight that took minutes (the timeout below) before 'every model call failed'.
    """
    proc, seconds = _command(
        "--capture",
        capture,
        "--endpoint",
        "http://127.0.0.1:1",
        "--url",
        "s3://s3capture-unreachable/run",
        "--parallel-rollouts",
        "1",
        "--rollouts",
        "40",
        timeout=120,
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("s3capture demo: error: worker "), lines[0]
    assert " failed at start-up: StoreError: " in lines[0] and "http://127.0.0.1:1/s3capture-unreachable" in lines[0]
    assert proc.stdout == ""
    assert seconds < 60, f"the run took {seconds:.1f} s to give up"


def test_other_commands_take_no_abbreviated_options_and_the_tool_has_a_version(capsys: pytest.CaptureFixture[str]):
    # "ls URL --stat frozen" ran as --state (a typo passing unnoticed): refused before any request.
    assert main(["ls", "s3://bucket-x/root", "--stat", "frozen"]) == 2
    assert "unrecognized arguments: --stat frozen" in capsys.readouterr().err
    assert main(["export", "s3://bucket-x/root", "--ou", "/tmp/never"]) == 2
    assert "unrecognized arguments: --ou" in capsys.readouterr().err
    assert main(["--version"]) == 0
    from s3capture import __version__

    assert capsys.readouterr().out.strip() == f"s3capture {__version__}"


@pytest.mark.parametrize("transport", ["aioboto3", "obstore"])
def test_missing_credentials_name_the_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, transport: str
):
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never reached: signing fails first
    monkeypatch.setenv("S3CAPTURE_TRANSPORT", transport)
    assert main(["ls", "s3://bucket-x/root"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no AWS credentials found" in err, err
    if transport == "aioboto3":
        assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in err


def test_an_ids_file_with_a_byte_order_mark_keeps_its_first_id(tmp_path) -> None:
    """Notepad and PowerShell's Out-File start a UTF-8 file with a BOM; it stayed on the first id,
    which then matched no rollout and was skipped (a breaker, 2026-12-02)."""
    from s3capture.export import read_ids

    path = tmp_path / "ids.txt"
    path.write_bytes("\ufeffrun-1\r\nrun-2\r\n".encode())
    assert read_ids(path) == ["run-1", "run-2"]


@pytest.mark.parametrize("grace", [float("nan"), float("inf"), -1.0])
def test_fence_grace_must_be_a_finite_number_of_seconds(grace: float) -> None:
    """NaN passed the store's ``< 0`` check and turned off drop's wait and the slow-put fence
    re-read (conformance --fence-grace nan passed every check); inf hung (a breaker, 2026-12-02)."""
    from s3capture.store import S3TokenStore

    with pytest.raises(ValueError, match="finite number of seconds"):
        S3TokenStore("s3://bucket/p", fence_grace=grace)


def test_conformance_checks_its_endpoint_like_the_other_commands(capsys: pytest.CaptureFixture[str]) -> None:
    """``conformance --endpoint http://user:pw@host`` retried for 13 s, then failed with an HTTP
    client error; ``doctor`` and ``export`` refuse such a value at once (a breaker, 2026-12-02)."""
    from s3capture.cli import main

    assert main(["conformance", "s3://b/p", "--endpoint", "http://user:pw@127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "takes no user name or password" in err and err.count("\n") == 1


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"])
def test_conformance_without_a_url_names_the_endpoint_variable_that_is_set(
    variable: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With only ``AWS_ENDPOINT_URL_S3`` set, the refusal said ``AWS_ENDPOINT_URL=... is set``, a
    variable the user had not set (a docs walkthrough, 2026-12-03)."""
    from s3capture.cli import main

    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "http://127.0.0.1:1")
    assert main(["conformance"]) == 2
    err = capsys.readouterr().err
    assert f"{variable}=http://127.0.0.1:1 is set" in err, err
