"""``agentkv serve``'s command line: every option documented in ``--help``, the agent options turned
into the server's defaults, and bad ones refused (exit 2) before the model loads."""

from __future__ import annotations

import inspect
import re

import pytest
from typer.testing import CliRunner

from agentkv.cli.app import app, serve
from agentkv.cli.agent import CLI_TOOLS, AgentOptions, CLIUsageError, PolicyName
from agentkv.cli.serve import agent_defaults
from agentkv.policies import SlidingWindow


def test_serve_help_documents_every_option():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert result.exit_code == 0
    text = re.sub(r"\s+", " ", result.output)
    for parameter in inspect.signature(serve).parameters.values():
        flags = parameter.default.param_decls
        for flag in flags:
            for name in flag.split("/"):
                assert name in text, f"{name} is missing from serve --help"
        assert parameter.default.help and len(parameter.default.help) > 10


def test_agent_options_become_the_servers_defaults():
    defaults = agent_defaults(AgentOptions(system="Be brief.", tools=True, policy=PolicyName.sliding,
                                           max_prompt_len=2048, max_new_tokens=64, temperature=0.0), 8192)
    assert defaults.instructions == "Be brief." and defaults.tools == CLI_TOOLS
    assert isinstance(defaults.policy, SlidingWindow) and defaults.max_prompt_len == 2048
    assert (defaults.max_new_tokens, defaults.temperature) == (64, 0.0)
    plain = agent_defaults(AgentOptions())
    assert (plain.instructions, plain.tools, plain.policy, plain.max_new_tokens, plain.temperature) == (
        None, (), None, 512, 1.0)


def test_a_window_over_the_models_context_is_refused():
    with pytest.raises(CLIUsageError, match="exceeds the model's context"):
        agent_defaults(AgentOptions(max_prompt_len=100_000), 8192)


@pytest.mark.parametrize("options", [["--temperature", "-1"], ["--max-prompt-len", "200"], ["--system", " "],
                                     ["--policy", "lru"]])
def test_bad_serve_options_exit_2_before_the_model_loads(monkeypatch, options):
    monkeypatch.setattr("agentkv.engine.factory.open_engine", lambda *a, **k: pytest.fail("model loaded"))
    result = CliRunner().invoke(app, ["serve", *options])
    assert result.exit_code == 2, result.output


@pytest.mark.parametrize(("wait", "warned"), [("2", True), ("0", False), ("10", False)])
def test_a_lease_wait_shorter_than_a_crashed_hosts_lease_is_warned_about(monkeypatch, wait, warned):
    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr("agentkv.cli.config.open_store", stop)  # end the command after the options are read
    result = CliRunner().invoke(app, ["serve", "--lease-wait", wait])
    assert isinstance(result.exception, Stop)
    assert ("--lease-wait 2 is shorter than" in result.stderr) is warned


def test_the_kv_tier_options_reach_the_store(monkeypatch, tmp_path):
    class Stop(Exception):
        pass

    seen = {}

    def stop(db, snapshots=None, kv_tiers=None):
        seen["tiers"] = kv_tiers
        raise Stop

    monkeypatch.setattr("agentkv.cli.config.open_store", stop)
    result = CliRunner().invoke(app, ["serve", "--kv-host-mb", "64", "--kv-disk", str(tmp_path), "--kv-disk-gb", "1.5"])
    assert isinstance(result.exception, Stop)
    assert seen["tiers"].host_mib == 64 and seen["tiers"].disk == tmp_path and seen["tiers"].disk_gib == 1.5


def test_open_store_turns_the_tier_options_into_byte_bounds(tmp_path):
    from agentkv.cli.config import KVTierOptions, open_store
    from agentkv.kvstore.block_files import DiskBlocks
    from agentkv.kvstore.block_tiers import HostBlocks

    store = open_store(f"sqlite:///{tmp_path / 'a.db'}", str(tmp_path / "kv"),
                       KVTierOptions(host_mib=64, disk=None, disk_gib=0.5))
    host, disk = store.blocks.tiers
    assert isinstance(host, HostBlocks) and host.usage().max_bytes == 64 << 20
    assert isinstance(disk, DiskBlocks) and disk.usage().max_bytes == 1 << 29
    store.blocks.close()
