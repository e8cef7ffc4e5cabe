"""The docs are the product's front door: what they name must exist, what they show must run as written.

Checked over README.md and docs/*.md: the generated config reference, every config key documented,
every file path and relative link, every cited test, every command in a fenced `bash` block (parsed,
never run: our CLIs and jobs by their own argparse parsers, `ray` and `mlflow` by their click
commands), the cluster commands against the config they feed, and the NCCL environment in code,
cluster files and docs. No Ray instance is started.

Citing a test: `<file>.py::<function>` (optionally `tests/` before the file, `[param]` after the
function; the file is looked up in tests/ and tests/unit/), e.g.
`test_chaos.py::test_kills_while_saving_starting_and_restoring_resume_bitwise`. A bare backticked
`test_...` name is refused, so every citation can be checked.
"""

from __future__ import annotations

import argparse
import ast
import glob
import importlib.util
import os
import re
import shlex
from pathlib import Path

import click
import pytest
import yaml

from conftest import REPO
from raytrain_ft.core.config import valid_keys
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.config_reference import reference_markdown
from raytrain_ft.core.errors import UserError
from raytrain_ft.launch.driver import WORKER_ENV

README = "README.md"
DOCS = {README: Path(REPO, README).read_text()} | {
    os.path.relpath(p, REPO): Path(p).read_text() for p in sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
}
CONFIG_REFERENCE = "docs/configuration.md"
# Pages written on other branches and indexed from the README already; delete each entry once the
# page is merged (test_every_relative_link_resolves then checks it too).
PENDING_PAGES: set[str] = set()
CITED_TEST = re.compile(r"((?:tests/)?[\w/]*\w\.py)::(\w+)(?:\[[^\]]*\])?")
BARE_TEST = re.compile(r"`(test_\w+)`")


def test_config_reference_is_the_generated_one():
    text = DOCS[CONFIG_REFERENCE]
    start = text.index("-->\n", text.index("<!-- config-reference:start")) + 4
    end = text.index("<!-- config-reference:end -->")
    assert text[start:end] == reference_markdown(), "regenerate it: python -m raytrain_ft.core.config_reference"


def test_every_config_key_is_documented():
    for key in valid_keys():
        assert f"`{key}`" in DOCS[CONFIG_REFERENCE], key


def test_the_readme_stays_a_front_door():
    assert len(DOCS[README].encode()) <= 14_000
    for page in (*(p for p in DOCS if p.startswith("docs/")), *PENDING_PAGES):
        assert f"]({page})" in DOCS[README], f"{page} is missing from the README's index"


def test_docs_name_existing_files():
    named: dict[str, set[str]] = {}
    for doc, text in DOCS.items():
        paths = set(
            re.findall(
                r"\b((?:scripts|jobs|benchmarks|configs|tests|raytrain_ft)/[\w./-]*\w\.(?:sh|py|yaml|json))", text
            )
        )
        paths |= set(re.findall(r"\b(cluster(?:-gcp)?\.yaml)\b", text))
        named[doc] = paths
        for path in paths:
            assert os.path.exists(os.path.join(REPO, path)), f"{doc} names {path}, which does not exist"
    assert {
        "scripts/demo.sh",
        "scripts/test.sh",
        "jobs/pretrain.py",
        "jobs/prepare_data.py",
        "configs/gpu-7b.yaml",
        "cluster.yaml",
    } <= named[README]
    shipped = {os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "configs", "*.yaml"))}
    assert shipped <= named[CONFIG_REFERENCE], "every shipped config is listed in docs/configuration.md"
    for config in shipped:
        load_config(os.path.join(REPO, config))  # every shipped config is valid


def test_result_files_are_the_ones_the_benchmarks_page_cites():
    cited = set(re.findall(r"results/([\w.-]+\.json)", DOCS["docs/benchmarks.md"]))
    kept = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "benchmarks", "results", "*.json"))}
    assert kept <= cited, f"result files no doc cites (delete them, git keeps them): {sorted(kept - cited)}"


def test_every_relative_link_resolves():
    for doc, text in DOCS.items():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            path = os.path.normpath(os.path.join(os.path.dirname(doc), target))
            assert path in PENDING_PAGES or os.path.exists(os.path.join(REPO, path)), f"{doc} links to {target}"


def test_no_reference_to_design_notes():
    for doc, text in DOCS.items():
        assert "design notes" not in text.lower(), doc


def _functions(path: str) -> set[str]:
    tree = ast.parse(Path(path).read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_cited_test_exists():
    cited = 0
    for doc, text in DOCS.items():
        for file, name in CITED_TEST.findall(text):
            bare = file.removeprefix("tests/")
            found = [os.path.join(REPO, "tests", d, bare) for d in ("", "unit")]
            path = next((p for p in found if os.path.exists(p)), found[0])
            assert os.path.exists(path), f"{doc} cites {file}::{name}: no such file in tests/ or tests/unit/"
            assert name in _functions(path), f"{doc} cites {file}::{name}: no such function"
            cited += 1
        bare = BARE_TEST.findall(text)
        assert not bare, f"{doc}: cite tests as <file>.py::<name>, not {bare}"
    assert cited > 20


# ---- commands in fenced bash blocks ----


def _bash_commands(text: str) -> list[list[str]]:
    """Every command of every ```bash block: continuation lines joined, comments dropped, split at
    `&&`, `||`, `;` and `|`, leading `VAR=value` assignments removed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split, lexer.commenters = True, "#"
            current: list[str] = []
            for token in [*lexer, ";"]:
                if token in (";", "&&", "||", "|"):
                    while current and re.fullmatch(r"\w+=.*", current[0]) and len(current) > 1:
                        current.pop(0)
                    if current:
                        commands.append(current)
                    current = []
                else:
                    current.append(token)
    return commands


class _Parsed(Exception):
    pass


def _dry_parse_script(path: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """Parse `argv` with the argparse parser a job script builds in its `main`, without running it."""
    spec = importlib.util.spec_from_file_location(f"doc_check_{Path(path).stem}", os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        with pytest.raises(_Parsed) as parsed:
            module.main(argv)
    return parsed.value.args[0]


def _click_parse(group: click.Group, prog: str, argv: list[str]) -> click.Context:
    """Resolve `argv`'s subcommands in a click group and parse the rest (raises on unknown options)."""
    cmd: click.Command = group
    ctx = click.Context(group, info_name=prog)
    while isinstance(cmd, click.Group):
        assert argv and not argv[0].startswith("-"), f"{prog}: a subcommand is missing"
        sub = cmd.get_command(ctx, argv[0])
        assert sub is not None, f"{prog} has no subcommand {argv[0]!r}"
        ctx = click.Context(sub, info_name=argv[0], parent=ctx)
        cmd, argv, prog = sub, argv[1:], f"{prog} {argv[0]}"
    return cmd.make_context(ctx.info_name, list(argv), parent=ctx.parent)


def _check_command(tokens: list[str], monkeypatch) -> None:
    program, args = tokens[0].removeprefix(".venv/bin/"), tokens[1:]
    if program in ("export", "cd"):
        return
    if program == "bash":
        assert os.path.exists(os.path.join(REPO, args[0])), args[0]
    elif program == "python" and args[0] == "-m":
        module = args[1]
        if module == "raytrain_ft.cli":
            _check_command(["raytrain-ft", *args[2:]], monkeypatch)
        else:
            assert importlib.util.find_spec(module) is not None, module
    elif program == "python":
        assert re.fullmatch(r"jobs/\w+\.py", args[0]), f"python {args[0]}: only jobs/*.py are checked"
        parsed = _dry_parse_script(args[0], args[1:], monkeypatch)
        if args[0] == "jobs/pretrain.py":
            load_config(parsed.config, parsed.overrides)  # the overrides are valid keys and values
    elif program == "raytrain-ft":
        from raytrain_ft.cli import build_parser

        build_parser().parse_args(args)
    elif program == "ray":
        from ray.scripts.scripts import cli

        ctx = _click_parse(cli, "ray", args)
        if args[:2] == ["job", "submit"]:
            _check_command(list(ctx.params["entrypoint"]), monkeypatch)
        if args[0] == "exec":
            for command in _bash_commands(f"```bash\n{ctx.params['cmd']}\n```"):
                _check_command(command, monkeypatch)
    elif program == "mlflow":
        from mlflow.cli import cli

        _click_parse(cli, "mlflow", args)
    else:
        raise AssertionError(f"no check for the command {program!r}: add one to tests/test_docs.py")


@pytest.mark.parametrize("doc", list(DOCS))
def test_every_command_shown_parses(doc, monkeypatch):
    monkeypatch.chdir(REPO)
    for command in _bash_commands(DOCS[doc]):
        try:
            _check_command(command, monkeypatch)
        except (SystemExit, click.ClickException, AssertionError, ValueError, UserError) as e:
            raise AssertionError(f"{doc}: `{shlex.join(command)}` does not parse: {e!r}") from e


def _cluster_commands(text: str, section: str) -> list[list[str]]:
    start = text.index(section)
    return _bash_commands(text[start : text.index("\n## ", start + 1)])


@pytest.mark.parametrize(
    ("doc", "section"), [(README, "## Run on a cluster"), ("docs/cluster.md", "## The cluster files")]
)
def test_cluster_commands_agree_with_the_config_they_feed(doc, section):
    commands = _cluster_commands(DOCS[doc], section)
    entrypoints = [c[c.index("--") + 1 :] for c in commands if c[:3] == ["ray", "job", "submit"]]
    prepare = next(e for e in entrypoints if e[1] == "jobs/prepare_data.py")
    trains = [e for e in entrypoints if e[1] == "jobs/pretrain.py"]
    assert trains, "no pretrain submission"
    for train in trains:
        config_path = train[train.index("--config") + 1]
        cfg = load_config(os.path.join(REPO, config_path), train[train.index("--config") + 2 :])
        assert prepare[prepare.index("--seq-len") + 1] == str(cfg.train.seq_len), f"--seq-len vs {config_path}"
        assert prepare[prepare.index("--output") + 1] == cfg.data.path, f"--output vs {config_path} data.path"
        for history in (c for c in commands if c[:2] == ["ray", "exec"]):
            assert history[3].split()[-1] == cfg.run.name, "raytrain-ft history names the run the config starts"


def _exports(cluster_file: str) -> dict[str, str]:
    config = yaml.safe_load(Path(REPO, cluster_file).read_text())
    commands = " ; ".join(config["worker_start_ray_commands"])
    return dict(re.findall(r"export ((?:TORCH_)?NCCL_\w+)=([^;\s]+);", commands))


def test_nccl_environment_is_the_same_in_code_cluster_files_and_docs():
    code = {k: v for k, v in WORKER_ENV.items() if "NCCL" in k}
    table = DOCS["docs/cluster.md"].split("## NCCL environment", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| (`[^`]*`|not set) \|", table, re.M))
    documented = {k: v.strip("`") for k, v in rows.items() if v != "not set"}
    assert code == documented, "launch/driver.py WORKER_ENV vs docs/cluster.md"
    for cluster_file in ("cluster.yaml", "cluster-gcp.yaml"):
        assert _exports(cluster_file) == code, f"{cluster_file} worker_start_ray_commands vs WORKER_ENV"
    assert {k for k, v in rows.items() if v == "not set"} >= {"TORCH_NCCL_BLOCKING_WAIT", "NCCL_TIMEOUT"}


def test_every_mlflow_ui_link_opens_the_model_training_view():
    # MLflow 3.17's UI opens an experiment in its GenAI view (the browser's saved choice) unless the
    # link asks for the model-training view
    for doc, text in DOCS.items():
        for link in re.findall(r"https?://[^\s`'\")]*#/experiments[^\s`'\")]*", text):
            assert "?workflowType=machine_learning" in link, f"{doc}: {link}"
    printed = [
        *glob.glob(os.path.join(REPO, "scripts", "*.sh")),
        *glob.glob(os.path.join(REPO, "raytrain_ft", "**", "*.py"), recursive=True),
    ]
    for path in printed:
        text = Path(path).read_text()
        if "#/experiments" in text:
            assert "?workflowType=machine_learning" in text, path
    assert "#/experiments" in Path(REPO, "scripts", "demo.sh").read_text()


def test_the_waits_table_names_every_bound_key_of_the_config():
    # a bound: every key of the `waits` section and every `*_timeout_s` key elsewhere
    text = DOCS["docs/hangs-and-waits.md"]
    section = text[text.index("## Every wait is bounded") :]
    section = section.split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| wait |")]
    named = {k for row in rows for k in re.findall(r"`([a-z_]+\.[a-z_.]+)`", row.split(" | ")[2])}
    bounds = {k for k in valid_keys() if k.startswith("waits.") or k.endswith("timeout_s")}
    assert bounds <= named, f"add a row to the table in docs/hangs-and-waits.md for {sorted(bounds - named)}"
    assert named <= set(valid_keys()), f"the table names keys the config lacks: {sorted(named - set(valid_keys()))}"
