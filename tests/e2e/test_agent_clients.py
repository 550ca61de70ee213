"""The agent CLIs as they ship (Claude Code, Codex; pinned in tests/e2e/clients/package.json)
against a real server: one turn that answers, and one where the model calls a tool, the client
runs it and sends its result back, and the model closes the turn.

The model (tests/fixtures/synth.py `write_agent_model_dir`) answers when the prompt holds no
trigger, calls the client's tool when the user's request names the clue file, and gives its
closing answer once the prompt holds a tool result: so a passing tool turn shows that the client
parsed the call, ran it and sent the result back. The clients' real prompts (their whole system
prompt and tool set, tens of thousands of tokens) go through the server, so the second request
of the tool turn also shows the prompt cache on a real flow.

`.ci/run` installs the CLIs with npm when node is present (`npm install --prefix
tests/e2e/clients`); without them these tests skip.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server_process import end, launch_quick, wait_until_serving
from tests.fixtures.synth import write_agent_model_dir

CLIENTS = Path(__file__).parent / "clients" / "node_modules" / ".bin"
CLUE = "mlxtrio-clue.txt"  # the file the tool turn reads; the word in the request that calls the tool
SECRET = "pelican-7731"  # the file's content: seen in the second request's prompt only if the tool ran
ANSWER = ("Hello", " from the scripted agent.")
AFTER_CALL = ("Done:", " the clue is read.")
MODEL = "agent-model"
CLIENT_LIMIT_S = 240


def client(name: str) -> Path:
    path = CLIENTS / name
    if not path.exists():
        pytest.skip(f"{name} CLI not installed (npm install --prefix tests/e2e/clients)")
    return path


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / CLUE).write_text(SECRET + "\n")
    return work


def serve(model_dir: Path, log_path: Path, model: str = MODEL) -> Iterator[str]:
    proc = launch_quick(["--model", str(model_dir), "--served-model-name", model, "--log-prompts"], log_path)
    try:
        yield wait_until_serving(proc, log_path, 60)
    finally:
        assert end(proc) == 0, log_path.read_text()[-3000:]


def requests(log_path: Path, route: str) -> list[dict[str, Any]]:
    """The request log's records of `route`, in order."""
    records = []
    for line in log_path.read_text().splitlines():
        match = re.search(r"mlx_trio\.requests: request (\{.*\})$", line)
        if match:
            record = json.loads(match.group(1))
            if record.get("route") == route:
                records.append(record)
    return records


def run_client(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=CLIENT_LIMIT_S, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, (
        f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    )
    return done


def check_tool_turn(log_path: Path, route: str, before: int) -> None:
    """The tool turn's requests: the call, then the result in the prompt, its prefix cached."""
    turn = requests(log_path, route)[before:]
    generations = [r for r in turn if r.get("prompt_tokens")]
    assert len(generations) >= 2 and all(r["status"] == 200 for r in generations), turn
    call, result = generations[-2], generations[-1]
    assert SECRET not in call["prompt"] and SECRET in result["prompt"]
    # The client's whole system prompt and tools come back from the cache on the second request.
    assert result["cached_tokens"] >= 0.9 * result["prompt_tokens"], (result["cached_tokens"], result["prompt_tokens"])


# --- Claude Code over the Anthropic Messages API ----------------------------------------------


@pytest.fixture(scope="module")
def claude_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("claude")
    call = [
        "<tool_call>",
        f'\n{{"name": "Read", "arguments": {{"file_path": "{root}/work/{CLUE}"}}}}\n',
        "</tool_call>",
    ]
    model = write_agent_model_dir(root / "model", answer=ANSWER, call=call, after_call=AFTER_CALL, call_trigger=CLUE)
    log_path = root / "server.log"
    for base in serve(model, log_path):
        yield base, log_path


def claude_env(base: str, home: Path) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": "sk-local",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }


@pytest.fixture(scope="module")
def claude_workdir(claude_server: tuple[str, Path]) -> Path:
    work = claude_server[1].parent / "work"  # the path the model's Read call names
    work.mkdir(exist_ok=True)
    (work / CLUE).write_text(SECRET + "\n")
    return work


def test_claude_code_answers(claude_server, claude_workdir):
    base, log_path = claude_server
    claude = client("claude")
    done = run_client([str(claude), "-p", "Say hello."], claude_env(base, claude_workdir.parent), claude_workdir)
    assert "".join(ANSWER) in done.stdout
    assert all(r["status"] == 200 for r in requests(log_path, "/v1/messages"))


def test_claude_code_runs_a_tool_and_sends_its_result(claude_server, claude_workdir):
    base, log_path = claude_server
    claude = client("claude")
    before = len(requests(log_path, "/v1/messages"))
    done = run_client(
        [str(claude), "-p", f"Read {CLUE} and tell me what it says.", "--allowedTools", "Read"],
        claude_env(base, claude_workdir.parent),
        claude_workdir,
    )
    assert "".join(AFTER_CALL) in done.stdout
    check_tool_turn(log_path, "/v1/messages", before)


# --- Codex over the Responses API -------------------------------------------------------------


@pytest.fixture(scope="module")
def codex_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("codex")
    call = ["<tool_call>", f'\n{{"name": "exec_command", "arguments": {{"cmd": "cat {CLUE}"}}}}\n', "</tool_call>"]
    model = write_agent_model_dir(root / "model", answer=ANSWER, call=call, after_call=AFTER_CALL, call_trigger=CLUE)
    log_path = root / "server.log"
    for base in serve(model, log_path):
        yield base, log_path


def codex_run(base: str, work: Path, prompt: str, model: str = MODEL) -> subprocess.CompletedProcess[str]:
    home = work.parent / "home"
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / ".codex"), "LOCAL_KEY": "sk-local"}
    provider = f'{{name="local", base_url="{base}/v1", wire_api="responses", env_key="LOCAL_KEY"}}'
    args = [
        str(client("codex")),
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "-c",
        "model_provider=local",
        "-c",
        f"model_providers.local={provider}",
        "-m",
        model,
        prompt,
    ]
    return run_client(args, env, work)


def test_codex_answers(codex_server, workdir):
    base, log_path = codex_server
    done = codex_run(base, workdir, "Say hello.")
    assert "".join(ANSWER) in done.stdout
    assert all(r["status"] == 200 for r in requests(log_path, "/v1/responses"))


def test_codex_runs_a_tool_and_sends_its_result(codex_server, workdir):
    base, log_path = codex_server
    before = len(requests(log_path, "/v1/responses"))
    done = codex_run(base, workdir, f"Read {CLUE} and tell me what it says.")
    assert "".join(AFTER_CALL) in done.stdout
    check_tool_turn(log_path, "/v1/responses", before)


# --- Codex's own tool shapes: a custom (freeform) apply_patch, a namespace's tool -------------

PATCHED = "patched.txt"
PATCH = f"*** Begin Patch\n*** Add File: {PATCHED}\n+written by the scripted agent\n*** End Patch\n"
# Codex sends apply_patch as a `custom` tool with a lark grammar for the models its catalog marks
# "freeform": serving the scripted model under such a name makes Codex send it.
FREEFORM_MODEL = "gpt-5.5"


def codex_tool_server(root: Path, call: dict[str, Any], model: str) -> Iterator[tuple[str, Path]]:
    markup = ["<tool_call>", "\n" + json.dumps(call) + "\n", "</tool_call>"]
    model_dir = write_agent_model_dir(
        root / "model", answer=ANSWER, call=markup, after_call=AFTER_CALL, call_trigger=CLUE
    )
    log_path = root / "server.log"
    for base in serve(model_dir, log_path, model):
        yield base, log_path


@pytest.fixture(scope="module")
def codex_patch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    call = {"name": "apply_patch", "arguments": {"input": PATCH}}
    yield from codex_tool_server(tmp_path_factory.mktemp("codex_patch"), call, FREEFORM_MODEL)


@pytest.fixture(scope="module")
def codex_namespace_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    call = {"name": "multi_agent_v1.close_agent", "arguments": {"target": "no-such-agent"}}
    yield from codex_tool_server(tmp_path_factory.mktemp("codex_namespace"), call, MODEL)


def test_codex_applies_a_freeform_patch_the_model_calls(codex_patch_server, workdir):
    base, log_path = codex_patch_server
    done = codex_run(base, workdir, f"Patch {CLUE}.", model=FREEFORM_MODEL)
    assert (workdir / PATCHED).read_text() == "written by the scripted agent\n"  # Codex ran our custom_tool_call
    assert "".join(AFTER_CALL) in done.stdout
    call, result = [r for r in requests(log_path, "/v1/responses") if r.get("prompt_tokens")][-2:]
    assert "apply_patch" in call["prompt"] and f"A {PATCHED}" in result["prompt"]  # its output came back


def test_codex_dispatches_a_namespace_tool_the_model_calls(codex_namespace_server, workdir):
    base, log_path = codex_namespace_server
    done = codex_run(base, workdir, f"Close the agent of {CLUE}.")
    assert "".join(AFTER_CALL) in done.stdout
    result = [r for r in requests(log_path, "/v1/responses") if r.get("prompt_tokens")][-1]
    # Codex ran close_agent (which found no such agent) instead of answering "unsupported call".
    assert "no-such-agent" in result["prompt"] and "unsupported call" not in result["prompt"]
