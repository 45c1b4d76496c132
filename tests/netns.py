"""Separate network namespaces as hosts: each with its own veth interface and address on one
bridge, so that traffic between them crosses real (virtual) interfaces. Root only."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no ip(8)"
    probe = f"dlrmprobe{uuid.uuid4().hex[:6]}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """``n`` namespaces h0..h(n-1) at 10.<net>.0.(i+1)/24 on a bridge in the root namespace."""

    def __init__(self, n: int, net: int = 77, hostnames: list[str] | None = None) -> None:
        tag = uuid.uuid4().hex[:4]
        self.bridge = f"dlbr{tag}"
        self.names = [f"dlrm{tag}h{i}" for i in range(n)]
        self.addrs = [f"10.{net}.0.{i + 1}" for i in range(n)]
        self.hostnames = hostnames  # resolvable by name in every namespace (/etc/netns/<ns>/hosts)
        self.ifname = "eth0"
        self._veths: list[str] = []

    def __enter__(self) -> Hosts:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs, strict=True)):
            outer = f"{self.bridge}v{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", self.ifname, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", self.ifname)
            _ip("-n", ns, "link", "set", self.ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._veths.append(outer)
        if self.hostnames:
            table = "127.0.0.1 localhost\n" + "".join(
                f"{a} {h}\n" for a, h in zip(self.addrs, self.hostnames, strict=True)
            )
            for ns in self.names:  # `ip netns exec` bind-mounts /etc/netns/<ns>/* over /etc/*
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/hosts", "w") as f:
                    f.write(table)
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.names:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        for v in self._veths:
            _ip("link", "del", v, check=False)
        _ip("link", "del", self.bridge, check=False)

    def traffic(self, i: int) -> tuple[int, int]:
        """(rx, tx) bytes of host i's interface."""
        out = []
        for kind in ("rx_bytes", "tx_bytes"):
            r = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.names[i],
                    "cat",
                    f"/sys/class/net/{self.ifname}/statistics/{kind}",
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            out.append(int(r.stdout))
        return out[0], out[1]

    def command(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *argv]
