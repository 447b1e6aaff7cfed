"""``deploy/haproxy.cfg`` as shipped: HAProxy accepts it (``haproxy -c``) as users run it and as
``LocalCluster`` renders it for N replicas; every replica gets a server line in both backends, and a
config whose replica block was lost is refused with a message saying what to restore."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from agentkv.testing.cluster import DEFAULT_CONFIG, ClusterError, haproxy_binary, render_haproxy_config


def check(config: str, tmp_path, **env: str) -> subprocess.CompletedProcess[str]:
    """``haproxy -c`` on ``config`` (skipped where HAProxy is not installed)."""
    try:
        binary = haproxy_binary()
    except ClusterError as missing:
        pytest.skip(str(missing))
    path = tmp_path / "haproxy.cfg"
    path.write_text(config, encoding="utf-8")
    settings = {"AGENTKV_PROXY_SOCKET": str(tmp_path / "admin.sock"), **env}
    return subprocess.run([binary, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **settings})


def test_the_shipped_config_is_valid_haproxy_as_users_run_it(tmp_path):
    checked = check(DEFAULT_CONFIG.read_text(encoding="utf-8"), tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("replicas", [1, 5])
def test_the_config_rendered_for_n_replicas_lists_each_in_both_backends_and_is_valid(tmp_path, replicas):
    rendered = render_haproxy_config(DEFAULT_CONFIG.read_text(encoding="utf-8"), replicas)
    names = re.findall(r"^\s*server (replica\d+) ", rendered, re.M)
    assert names == [f"replica{k}" for k in range(1, replicas + 1)] * 2
    addresses = {f"AGENTKV_REPLICA_{k}": f"127.0.0.1:{9000 + k}" for k in range(1, replicas + 1)}
    checked = check(rendered, tmp_path, **addresses)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_config_without_its_replica_block_is_refused_with_what_to_restore():
    broken = DEFAULT_CONFIG.read_text(encoding="utf-8").replace("# >>> replicas", "# replicas")
    with pytest.raises(ClusterError, match="restore it from deploy/haproxy.cfg"):
        render_haproxy_config(broken, 3)
