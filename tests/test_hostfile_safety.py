"""A hostfile, and the launch.json profile beside it, are data: nothing in them runs on this
machine. Host names are checked when a hostfile is read (ssh and mpirun's ssh launch take a
name that starts with '-' as an option), ssh gets `--` before the host, a bad file is one
line and exit 2, and a profile's ssh agent runs only when this user's rig wrote it here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, env

from mlxdist.launch.hosts import LaunchError, Remote, read_hostfile
from mlxdist.launch.job import Launch
from mlxdist.launch.mpirun import hostfile_hosts
from mlxdist.launch.profile import ClusterProfile, ProfileHost


def _mlxrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launch" / "mlxrun"), *args], capture_output=True,
                          text=True, env=env(), timeout=60)


def _one_error_line(r: subprocess.CompletedProcess, start: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), r.stderr
    return lines[0]


def _recording_agent(path: Path, record: Path) -> Path:
    """An ssh stand-in that only notes that it ran, and how."""
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {record}\n')
    path.chmod(0o755)
    return path


@pytest.fixture
def own_key(tmp_path, monkeypatch):
    """Profiles signed with a key of this test's own, not the user's."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


@pytest.mark.parametrize("agent", ["ssh", "recording"])
def test_option_like_host_runs_nothing(tmp_path, agent):
    marker, record = tmp_path / "pwned", tmp_path / "agent-ran"
    if agent == "ssh":
        ssh = shutil.which("ssh")
        if ssh is None:
            pytest.skip("no ssh client here; the recording agent covers it")
    else:
        ssh = str(_recording_agent(tmp_path / "fake-ssh", record))
    host = f"-oProxyCommand=touch${{IFS}}{marker}"
    hf = tmp_path / "evil.hosts"
    hf.write_text(f"{host} slots=1\n")
    r = _mlxrun("--ssh-agent", ssh, "--dry-run", "--hostfile", str(hf))
    assert not marker.exists() and not record.exists()
    line = _one_error_line(r, f"error: hostfile {hf}:1: host '-oProxyCommand=touch${{IFS}}")
    assert "starts with '-'" in line and "studio.local" in line  # what is wrong, what to write instead


@pytest.mark.parametrize("data, line_no", [(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x00 slots=1\n", 1),
                                           (b"# hosts\nstudio.local\x00 slots=1\n", 2),
                                           (b"studio.local slots=1\n\nmac\xe9book slots=1\n", 3)])
def test_binary_hostfile_is_one_line(tmp_path, data, line_no):
    hf = tmp_path / "hosts"
    hf.write_bytes(data)
    _one_error_line(_mlxrun("--dry-run", "--hostfile", str(hf)), f"error: hostfile {hf}:{line_no}: binary data")
    assert hostfile_hosts(hf) is None


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   # and another\n"])
def test_hostfile_without_hosts_says_what_to_write(tmp_path, text):
    hf = tmp_path / "hosts"
    hf.write_text(text)
    line = _one_error_line(_mlxrun("--dry-run", "--hostfile", str(hf)), f"error: hostfile {hf}: lists no hosts")
    assert "NAME slots=N" in line


def test_zero_slots_is_refused(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=1\nlocalhost slots=0\n")
    line = _one_error_line(_mlxrun("--dry-run", "--no-check", "--hostfile", str(hf)), f"error: hostfile {hf}:2:")
    assert "'localhost'" in line and "slots=0" in line and "at least 1" in line


@pytest.mark.parametrize("opt", ["slots=-1", "slots=two", "slots=\u0663", "slots=", "max_slots=0"])
def test_slot_counts_must_be_positive_integers(tmp_path, opt):
    hf = tmp_path / "hosts"
    hf.write_text(f"studio.local {opt}\n")
    with pytest.raises(LaunchError, match=rf"^hostfile {hf}:1: host 'studio.local': '{opt}' is not a number"):
        read_hostfile(hf)


@pytest.mark.parametrize("name, why", [
    ("-J", "starts with '-'"), ("--help", "starts with '-'"), ("john@studio.local", "~/.ssh/config"),
    ("studio;reboot", "not a host name"), ("$(reboot)", "not a host name"), ("a/b", "not a host name"),
    ("studio..local", "not a host name"), ("fe80::1%en0", "not a host name"), ("-1.2.3.4", "starts with '-'"),
    ("\x1b[2Jstudio", "not a host name"),
])
def test_bad_host_names_are_named_with_their_line(tmp_path, name, why):
    hf = tmp_path / "hosts"
    hf.write_text(f"# cluster\nstudio.local slots=1\n{name} slots=1\n")
    with pytest.raises(LaunchError) as e:
        read_hostfile(hf)
    msg = str(e.value)
    assert msg.startswith(f"hostfile {hf}:3: host {name!r}") and why in msg and "\n" not in msg


def test_mac_style_names_still_launch(tmp_path):
    """Names a Mac gives itself and addresses keep working (a guard: they worked before too)."""
    hf = tmp_path / "hosts"
    hf.write_text("Johns-MacBook-Pro.local slots=2  # laptop\r\nstudio.local slots=1\n"
                  "mac_mini slots=1\n192.168.1.20 max_slots=4\nfe80::1\n")
    r = _mlxrun("--dry-run", "--no-check", "--hostfile", str(hf))
    assert r.returncode == 0, r.stderr
    assert "-np 6" in r.stdout
    assert [h.name for h in read_hostfile(hf)] == ["Johns-MacBook-Pro.local", "studio.local", "mac_mini",
                                                     "192.168.1.20", "fe80::1"]


def test_mlx_json_hostfile_names_are_checked(tmp_path):
    record = tmp_path / "agent-ran"
    agent = _recording_agent(tmp_path / "fake-ssh", record)
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps({"hosts": [{"ssh": "studio.local", "ips": []}, {"ssh": "-oProxyCommand=x", "ips": []}]}))
    r = _mlxrun("--ssh-agent", str(agent), "--dry-run", "--hostfile", str(hf))
    assert not record.exists()
    _one_error_line(r, f"error: hostfile {hf}: entry 1: host '-oProxyCommand=x' starts with '-'")


def test_mlx_json_hostfile_sets_only_mlx_settings(tmp_path):
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps({"backend": "jaccl", "envs": ["MLX_METAL_FAST_SYNCH=1", f"LD_PRELOAD={tmp_path}/x.so"],
                              "hosts": [{"ssh": "localhost", "ips": []}]}))
    line = _one_error_line(_mlxrun("--dry-run", "--no-check", "--hostfile", str(hf)),
                           f"error: hostfile {hf}: 'envs' sets 'LD_PRELOAD'")
    assert "-x LD_PRELOAD=VALUE" in line


def test_ssh_argv_has_double_dash_before_the_host(tmp_path):
    from mlxdist.rig.simcluster import SimCluster

    assert Remote().command("studio.local", "true")[-3:] == ["--", "studio.local", "true"]
    assert Remote().command("studio.local", "true")[0] == "ssh"
    rig = SimCluster(2, name="mlxhs", subnet="10.79.91", state_dir=tmp_path)
    rig._write_agent()
    remote = Launch(tmp_path / "hostfile", [], ssh_agent=rig.ssh_agent).remote()
    cmd = remote.command(rig.ip(1), "true")
    assert cmd == [str(rig.ssh_agent), "--", rig.ip(1), "true"]
    # The rig's stand-in reads the host after `--` (and after ssh's own options).
    for argv in (cmd, [str(rig.ssh_agent), "-o", "BatchMode=yes", "-x", "--", rig.ip(2), "true"]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert "unknown host" not in r.stderr, r.stderr
    r = subprocess.run([str(rig.ssh_agent), "--", "-oProxyCommand=x", "true"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 255 and "unknown host -oProxyCommand=x" in r.stderr


def _profile_dir(d: Path, agent_at: Path, marker: Path) -> Path:
    """A cluster folder as a download might bring it: hostfile, launch.json, an agent that
    leaves `marker` when it runs."""
    d.mkdir(parents=True, exist_ok=True)
    agent_at.write_text(f"#!/bin/sh\ntouch {marker}\n")
    agent_at.chmod(0o755)
    (d / "hostfile").write_text("localhost slots=1\n")
    return d / "hostfile"


def test_unsigned_profile_beside_a_hostfile_runs_nothing(tmp_path, own_key):
    marker = tmp_path / "pwned"
    d = tmp_path / "download"
    hostfile = _profile_dir(d, d / "ssh-agent", marker)
    (d / "launch.json").write_text(json.dumps({"name": "evil", "hostfile": "hostfile", "ssh_agent": "ssh-agent",
                                               "hosts": [{"name": "localhost", "ip": "localhost"}]}))
    r = _mlxrun("--hostfile", str(hostfile), "--dry-run")
    assert not marker.exists(), r.stderr
    assert r.returncode == 0 and "plm_ssh_agent" not in r.stdout, r.stderr
    assert f"cluster profile {d / 'launch.json'} was not written by `launch/simcluster`" in r.stderr
    line = _one_error_line(_mlxrun("--simcluster", str(d), "--dry-run"), f"error: --simcluster {d}: cluster profile")
    assert "sudo launch/simcluster up" in line and not marker.exists()


@pytest.mark.parametrize("how", ["copied", "agent outside", "agent writable by others"])
def test_signed_profile_runs_only_its_own_agent(tmp_path, own_key, how):
    marker = tmp_path / "pwned"
    d = tmp_path / "cluster"
    agent = d / "ssh-agent" if how != "agent outside" else tmp_path / "elsewhere-agent"
    hostfile = _profile_dir(d, agent, marker)
    ClusterProfile("mlxhs", d, hostfile, [ProfileHost("mlxhs1", "localhost")], agent).write()
    if how == "copied":
        d = shutil.copytree(d, tmp_path / "copy")
        hostfile = d / "hostfile"
    elif how == "agent writable by others":
        agent.chmod(0o777)
    r = _mlxrun("--hostfile", str(hostfile), "--dry-run", "--no-check")
    assert r.returncode == 0 and "plm_ssh_agent" not in r.stdout, r.stderr
    assert "not using its ssh agent" in r.stderr and not marker.exists()
